"""Compute Engine's list prices from the Cloud Billing Catalog API, kept a day on this machine.

Every SKU of the Compute Engine service is listed once (a few pages of 5000), and the ones
``prices.Rates`` holds are kept: the cores and RAM of the families the table knows, GPUs and
persistent disks, on demand and spot, by region. The result is cached in a private file under
ORCHESTRATE_HOME, shared by every cluster. Whatever stops the read (no credentials, the API
disabled or refused, 5xx past the retries, no answer before the deadline) gives the newest list
at hand, the cache or the shipped table, with a one-line note that says why: a price is never
worth a failed command. google-cloud-billing is imported only for the read itself.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any

from tenacity import (
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential_jitter,
)

from orchestrator import paths
from orchestrator.errors import ProviderError
from orchestrator.files import private_dir, write_atomic
from orchestrator.providers.gcp.prices import (
    DISK_SKUS,
    FAMILIES,
    GPU_MODELS,
    TABLE,
    Rates,
    Resource,
    key,
)

SERVICE = "services/6F81-5844-456A"  # Compute Engine, in the catalog
ENDPOINT_ENV = "ORCHESTRATE_BILLING_ENDPOINT"  # e.g. http://127.0.0.1:8090 for a local fake (tests)
CLOUD_SCOPE = "https://www.googleapis.com/auth/cloud-platform"
CACHE = "gcp-billing-catalog"
CACHE_VERSION = 1
FRESH_S = 24 * 3600.0  # list prices change at most monthly: a day-old read is current enough
DEADLINE_S = 20.0  # the whole read, every page and retry: a train does not wait longer for it
CALL_TIMEOUT_S = 10.0
PAGE_SIZE = 5000  # the API's largest page
MAX_TRIES = 4
RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})
# Usage types read: on demand, and spot (the catalog still calls it Preemptible).
USAGE_TYPES = {"OnDemand": False, "Preemptible": True}
# The unit each kind of rate must be quoted in; a SKU in another unit is not read.
UNITS: dict[Resource, str] = {"core": "h", "gpu": "h", "ram": "GiBy.h", "disk": "GiBy.mo"}
_SPOT = r"(?:spot )?(?:preemptible )?"
_VM_SKU = re.compile(_SPOT + rf"(?P<family>{'|'.join(FAMILIES)}) (?:predefined )?instance "
                     r"(?P<what>core|ram) running in .+", re.IGNORECASE)
_GPU_SKU = re.compile(_SPOT + r"nvidia (?:tesla )?(?P<model>.+?) gpu running in .+", re.IGNORECASE)
_DISK_SKU = re.compile(r"(?P<kind>storage pd|balanced pd|ssd backed pd) capacity(?: in .+)?",
                       re.IGNORECASE)
_DISK_TYPES = {description: disk for disk, description in DISK_SKUS.items()}


class CatalogUnavailable(ProviderError):
    """The catalog could not be read; the message says why, in a few words."""


def rates(currency: str = "USD", *, online: bool, deadline_s: float = DEADLINE_S,
          sleep: Callable[[float], None] = time.sleep) -> Rates:
    """The newest prices at hand, in ``currency``.

    Args:
        online: read the catalog when the cache is more than a day old (or absent); without
            it, nothing but the cache and the table is read (``plan``: no network, no Google
            library, no wait).
        deadline_s: how long the read may take, every page and retry together.
        sleep: the backoff sleep (tests pass a recorder).

    Returns:
        The catalog's prices (fresh or cached), else the shipped table; when a read was tried
        and failed, with ``note`` saying why.
    """
    cached = _load_cache(currency)
    if cached is not None and (not online or time.time() - cached[1] < FRESH_S):
        return cached[0]
    fallback = cached[0] if cached is not None and cached[0].as_of > TABLE.as_of else TABLE
    if not online:
        return fallback
    try:
        fresh = read_catalog(currency, deadline_s=deadline_s, sleep=sleep)
    except CatalogUnavailable as exc:
        return replace(fallback, note=f"the Billing Catalog was not read: {exc.message}")
    _save_cache(fresh)
    return fresh


def read_catalog(currency: str, *, deadline_s: float = DEADLINE_S,
                 sleep: Callable[[float], None] = time.sleep) -> Rates:
    """Compute Engine's prices from the Cloud Billing Catalog, read now.

    The API is at $ORCHESTRATE_BILLING_ENDPOINT when set (a plain-http one gets anonymous
    credentials: a local fake), else cloudbilling.googleapis.com with Application Default
    Credentials.

    Raises:
        CatalogUnavailable: why it could not be read, within ``deadline_s``.
    """
    try:
        import google.auth
        import requests
        from google.api_core import exceptions as api_errors
        from google.auth import exceptions as auth_errors
        from google.auth.credentials import AnonymousCredentials, Credentials
        from google.cloud import billing_v1
    except ImportError as exc:
        raise CatalogUnavailable(f"google-cloud-billing cannot be imported ({exc})",
                                 fix="pip install google-cloud-billing") from None
    endpoint = os.environ.get(ENDPOINT_ENV) or None
    deadline = time.monotonic() + deadline_s
    anonymous: Callable[[], Credentials] = AnonymousCredentials
    try:
        if endpoint and endpoint.startswith("http://"):  # a local fake: never send tokens there
            credentials = anonymous()
        else:
            credentials, _ = google.auth.default(scopes=[CLOUD_SCOPE])
        with billing_v1.CloudCatalogClient(
                transport="rest", credentials=credentials,
                client_options={"api_endpoint": endpoint} if endpoint else None) as client:
            found = _parse(_skus(client, billing_v1.ListSkusRequest, currency, deadline,
                                     deadline_s, sleep))
    except api_errors.GoogleAPICallError as exc:
        raise CatalogUnavailable(_refusal(exc)) from None
    except requests.Timeout:
        raise CatalogUnavailable(f"it did not answer within {deadline_s:g} s") from None
    except requests.RequestException as exc:
        raise CatalogUnavailable(f"cannot reach {endpoint or 'cloudbilling.googleapis.com'} "
                                 f"({type(exc).__name__})") from None
    except auth_errors.DefaultCredentialsError:
        raise CatalogUnavailable("no Google Cloud credentials on this machine ('gcloud auth "
                                 "application-default login' makes them)") from None
    except auth_errors.GoogleAuthError as exc:
        raise CatalogUnavailable(f"the Google Cloud credentials do not work ({_short(exc)})") \
            from None
    today = datetime.now(timezone.utc).date().isoformat()
    if not found:
        raise CatalogUnavailable("it listed no price of a Compute Engine core, GPU or disk")
    return Rates(f"Cloud Billing Catalog, read {today}", today, currency, found)


def _parse(skus: Iterator[Any]) -> dict[str, dict[str, float]]:
    """The rates of ``skus`` (the catalog's Sku messages) by region, then by ``prices.key``.

    A SKU offered in fewer regions wins over a wider one for the same rate ("... running in
    Virginia" over "... running in Americas"); a rate's price is its newest pricing's first
    tier with a price (a free allowance is an account's, shared, and soon used up).
    """
    found: dict[str, dict[str, float]] = {}
    width: dict[tuple[str, str], int] = {}
    for sku in skus:
        name = _rate_name(sku.description, sku.category.usage_type)
        if name is None or not sku.pricing_info:
            continue
        expression = sku.pricing_info[-1].pricing_expression
        if expression.usage_unit != UNITS[name[0]]:
            continue
        price = _unit_price(expression.tiered_rates)
        regions = list(sku.service_regions)
        for region in regions:
            if width.get((region, name[1]), len(regions) + 1) > len(regions):
                found.setdefault(region, {})[name[1]] = price
                width[(region, name[1])] = len(regions)
    return found


def _rate_name(description: str, usage_type: str) -> tuple[Resource, str] | None:
    """(resource, ``prices.key``) of a SKU this module reads; None for every other SKU."""
    spot = USAGE_TYPES.get(usage_type)
    if spot is None:
        return None
    vm = _VM_SKU.fullmatch(description)
    if vm is not None:
        what: Resource = "core" if vm["what"].lower() == "core" else "ram"
        return what, key(what, vm["family"].lower(), spot=spot)
    gpu = _GPU_SKU.fullmatch(description)
    if gpu is not None and gpu["model"].lower() in GPU_MODELS:
        return "gpu", key("gpu", GPU_MODELS[gpu["model"].lower()], spot=spot)
    disk = _DISK_SKU.fullmatch(description)
    if disk is not None and not spot:
        return "disk", key("disk", _DISK_TYPES[disk["kind"].lower()])
    return None


def _unit_price(tiers: Any) -> float:
    for tier in tiers:
        price = tier.unit_price.units + tier.unit_price.nanos / 1e9
        if price:
            return float(price)
    return 0.0


def _skus(client: Any, request_of: Callable[..., Any], currency: str, deadline: float,
          deadline_s: float, sleep: Callable[[float], None]) -> Iterator[Any]:
    """Every SKU of the service, page by page, each page retried on 429, 5xx and lost
    connections until the deadline."""
    token = ""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise CatalogUnavailable(f"it did not answer within {deadline_s:g} s")
        request = request_of(parent=SERVICE, currency_code=currency, page_size=PAGE_SIZE,
                             page_token=token)
        retrying = Retrying(
            retry=retry_if_exception(_transient),
            wait=wait_exponential_jitter(multiplier=0.5, max=4.0, jitter=0.5),
            stop=stop_after_attempt(MAX_TRIES) | stop_after_delay(left),
            sleep=sleep, reraise=True)
        page = retrying(_page, client, request, deadline, deadline_s)
        yield from page.skus
        token = page.next_page_token
        if not token:
            return


def _page(client: Any, request: Any, deadline: float, deadline_s: float) -> Any:
    """One page, given what is left of the deadline (at most CALL_TIMEOUT_S)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise CatalogUnavailable(f"it did not answer within {deadline_s:g} s")
    return client.list_skus(request=request, retry=None, timeout=min(CALL_TIMEOUT_S, left))


def _transient(exc: BaseException) -> bool:
    import requests
    from google.api_core import exceptions as api_errors

    if isinstance(exc, requests.ConnectionError | requests.Timeout):
        return True
    return isinstance(exc, api_errors.GoogleAPICallError) and exc.code in RETRYABLE_STATUS


def _refusal(exc: Any) -> str:
    """The API's answer in a few words: its status and reason, and the start of its message
    (without the request line the REST transport puts before it)."""
    status = f"HTTP {exc.code}" if exc.code is not None else "an error"
    reason = f" {exc.reason}" if getattr(exc, "reason", None) else ""
    message = re.sub(r"^[A-Z]+ https?://\S+: ", "", str(exc.message or exc))
    return f"{status}{reason}: {_short(message)}"


def _short(text: object, limit: int = 160) -> str:
    """The first sentence of ``text``, on one line, cut at ``limit`` characters."""
    line = " ".join(str(text).split())
    line = line.split(". ", 1)[0] + ("." if ". " in line else "")
    return line if len(line) <= limit else line[:limit - 3] + "..."


# -- the cache -------------------------------------------------------------------------------
def _load_cache(currency: str) -> tuple[Rates, float] | None:
    """The cached read in ``currency``, and when it was made; None when there is none, or it
    cannot be used (another currency, another version, a damaged file)."""
    path = paths.price_cache(CACHE)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data["version"] != CACHE_VERSION or data["currency"] != currency:
            return None
        regions = {str(region): {str(name): float(price) for name, price in rates.items()}
                   for region, rates in data["regions"].items()}
        return (Rates(str(data["source"]), str(data["as_of"]), currency, regions),
                float(data["read_at"]))
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def _save_cache(fresh: Rates) -> None:
    """Keep ``fresh`` for the next day's commands; a cache that cannot be written costs only
    another read."""
    path = paths.price_cache(CACHE)
    try:
        private_dir(path.parent)
        write_atomic(path, json.dumps({
            "version": CACHE_VERSION, "read_at": time.time(), "source": fresh.source,
            "as_of": fresh.as_of, "currency": fresh.currency,
            "regions": {region: dict(rates) for region, rates in fresh.regions.items()}}))
    except OSError:
        pass
