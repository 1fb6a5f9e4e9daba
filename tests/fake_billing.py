"""An HTTP fake of the Cloud Billing Catalog API's SKU listing, with failure switches.

It answers ``GET /v1/services/{service}/skus`` (and ``GET /v1/services``) in the real JSON
shapes: ``skus[]`` of ``name``, ``skuId``, ``description``, ``category{serviceDisplayName,
resourceFamily, resourceGroup, usageType}``, ``serviceRegions``, ``pricingInfo[]{effectiveTime,
summary, pricingExpression{usageUnit, usageUnitDescription, baseUnit, baseUnitDescription,
baseUnitConversionFactor, displayQuantity, tieredRates[{startUsageAmount, unitPrice{
currencyCode, units (a string: int64), nanos}}]}, currencyConversionRate}``, ``serviceProviderName``
and ``geoTaxonomy``; pages of at most ``pageSize`` (and at most the fake's ``page_size``) with
an opaque ``nextPageToken``, absent on the last page; ``currencyCode`` converts every price.
Errors are Google's: ``{"error": {"code", "message", "status", "details": [{"@type", "reason",
"domain", "metadata"}]}}``. Drive it with the real google-cloud-billing client::

    with FakeBilling(page_size=4) as fake:
        client = billing_v1.CloudCatalogClient(transport="rest",
                                               credentials=AnonymousCredentials(),
                                               client_options={"api_endpoint": fake.url})

The default catalog is Compute Engine's for the Americas (us-central1, us-east1, us-west1)
and the Netherlands (europe-west4), on demand and spot, with the SKUs a reader must skip
beside the ones it reads: commitments, custom and sole-tenant cores, a Virtual Workstation
GPU, regional disks, egress in volume tiers. Its prices are not the shipped table's, so a test
tells which it got; Storage PD Capacity has a free first tier.

Switches a test flips: ``fail_next(n, status)`` (the next n requests answer 503, or another
status), ``deny()`` (403 PERMISSION_DENIED: the API is disabled in the caller's project),
``latency_s`` (before every answer). ``requests`` records every listing request's query.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

COMPUTE = "6F81-5844-456A"
EFFECTIVE = "2026-11-28T08:00:00.000Z"
Json = dict[str, Any]
# What a dollar is in the currencies the fake converts to (the real API takes any ISO code
# it bills in; this is enough to see the conversion applied).
RATES_PER_USD = {"USD": 1.0, "EUR": 0.9, "JPY": 150.0}
AMERICAS = ["us-central1", "us-east1", "us-west1"]
NETHERLANDS = ["europe-west4"]
# The unit each kind of SKU is quoted in: (usageUnit, its description, baseUnit, its
# description, baseUnitConversionFactor), as the real catalog gives them.
UNITS = {
    "h": ("h", "hour", "s", "second", 3600),
    "GiBy.h": ("GiBy.h", "gibibyte hour", "By.s", "byte second", 3865470566400),
    "GiBy.mo": ("GiBy.mo", "gibibyte month", "By.s", "byte second", 2.8759101014016e15),
    "GiBy": ("GiBy", "gibibyte", "By", "byte", 1073741824),
}


@dataclass(frozen=True)
class Sku:
    """One SKU of the fake catalog; ``tiers`` are (startUsageAmount, USD per usageUnit)."""

    description: str
    regions: tuple[str, ...]
    usage_type: str  # OnDemand, Preemptible, Commit1Yr
    resource_group: str
    unit: str
    tiers: tuple[tuple[float, float], ...]
    resource_family: str = "Compute"

    @property
    def sku_id(self) -> str:
        digest = hashlib.sha256(f"{self.description}|{self.usage_type}".encode()).hexdigest()
        return "-".join(digest[i:i + 4] for i in (0, 4, 8)).upper()

    def to_json(self, currency: str) -> Json:
        unit, unit_text, base, base_text, factor = UNITS[self.unit]
        rate = RATES_PER_USD[currency]
        return {
            "name": f"services/{COMPUTE}/skus/{self.sku_id}",
            "skuId": self.sku_id,
            "description": self.description,
            "category": {"serviceDisplayName": "Compute Engine",
                         "resourceFamily": self.resource_family,
                         "resourceGroup": self.resource_group, "usageType": self.usage_type},
            "serviceRegions": list(self.regions),
            "pricingInfo": [{
                "summary": "",
                "pricingExpression": {
                    "usageUnit": unit, "usageUnitDescription": unit_text, "baseUnit": base,
                    "baseUnitDescription": base_text, "baseUnitConversionFactor": factor,
                    "displayQuantity": 1,
                    "tieredRates": [{"startUsageAmount": start,
                                     "unitPrice": money(price * rate, currency)}
                                    for start, price in self.tiers]},
                "currencyConversionRate": rate,
                "effectiveTime": EFFECTIVE,
            }],
            "serviceProviderName": "Google",
            "geoTaxonomy": {"type": "MULTI_REGIONAL" if len(self.regions) > 1 else "REGIONAL",
                            "regions": list(self.regions)},
        }


def money(amount: float, currency: str) -> Json:
    """google.type.Money as JSON: whole units as a string (int64), the rest in nanos."""
    units = int(amount)
    return {"currencyCode": currency, "units": str(units),
            "nanos": round((amount - units) * 1e9)}


def _vm(family: str, where: str, regions: list[str], group: str, core: float, ram: float,
        spot_core: float, spot_ram: float, predefined: bool = False) -> list[Sku]:
    kind = "Predefined Instance" if predefined else "Instance"
    out = []
    for prefix, usage, c, r in (("", "OnDemand", core, ram),
                                ("Spot Preemptible ", "Preemptible", spot_core, spot_ram)):
        out.append(Sku(f"{prefix}{family} {kind} Core running in {where}", tuple(regions), usage,
                       group, "h", ((0, c),)))
        out.append(Sku(f"{prefix}{family} {kind} Ram running in {where}", tuple(regions), usage,
                       group, "GiBy.h", ((0, r),)))
    return out


def _gpu(model: str, where: str, regions: list[str], price: float, spot: float) -> list[Sku]:
    return [Sku(f"Nvidia {model} GPU running in {where}", tuple(regions), "OnDemand", "GPU", "h",
                ((0, price),)),
            Sku(f"Spot Preemptible Nvidia {model} GPU running in {where}", tuple(regions),
                "Preemptible", "GPU", "h", ((0, spot),))]


def _disks(where: str, regions: list[str], standard: float, balanced: float,
           ssd: float) -> list[Sku]:
    return [
        Sku(f"Storage PD Capacity in {where}", tuple(regions), "OnDemand", "PDStandard",
            "GiBy.mo", ((0, 0.0), (30, standard)), "Storage"),
        Sku(f"Balanced PD Capacity in {where}", tuple(regions), "OnDemand", "SSD", "GiBy.mo",
            ((0, balanced),), "Storage"),
        Sku(f"SSD backed PD Capacity in {where}", tuple(regions), "OnDemand", "SSD", "GiBy.mo",
            ((0, ssd),), "Storage"),
        Sku(f"Regional Balanced PD Capacity in {where}", tuple(regions), "OnDemand", "SSD",
            "GiBy.mo", ((0, 2 * balanced),), "Storage"),
    ]


def default_catalog() -> list[Sku]:
    """Compute Engine in the Americas and the Netherlands (see the module docstring)."""
    skus: list[Sku] = []
    for where, regions, f in (("Americas", AMERICAS, 1.0), ("Netherlands", NETHERLANDS, 1.1)):
        skus += _vm("N1", where, regions, "N1Standard", 0.0332 * f, 0.00445 * f, 0.0071 * f,
                    0.00095 * f, predefined=True)
        skus += _vm("N2", where, regions, "CPU", 0.0333 * f, 0.00446 * f, 0.008 * f,
                    0.00107 * f)
        skus += _vm("G2", where, regions, "G2Standard", 0.0262 * f, 0.00307 * f, 0.0105 * f,
                    0.00123 * f)
        skus += _vm("A2", where, regions, "CPU", 0.0332 * f, 0.00445 * f, 0.0133 * f,
                    0.00178 * f)
        skus += _vm("A3", where, regions, "CPU", 0.0332 * f, 0.00445 * f, 0.0133 * f,
                    0.00178 * f)
        skus += _gpu("Tesla T4", where, regions, 0.37 * f, 0.15 * f)
        skus += _gpu("Tesla V100", where, regions, 2.6 * f, 1.04 * f)
        skus += _gpu("Tesla P100", where, regions, 1.53 * f, 0.61 * f)
        skus += _gpu("L4", where, regions, 0.59 * f, 0.235 * f)
        skus += _gpu("Tesla A100", where, regions, 3.08 * f, 1.23 * f)
        skus += _gpu("Tesla A100 80GB", where, regions, 4.17 * f, 1.67 * f)
        skus += _gpu("H100 80GB", where, regions, 9.71 * f, 3.88 * f)
        skus += _disks(where, regions, 0.048 * f, 0.11 * f, 0.18 * f)
        # What a reader must leave alone: the same words around other things.
        skus += [
            Sku(f"Commitment v1: N1 Predefined Instance Core running in {where}",
                tuple(regions), "Commit1Yr", "N1Standard", "h", ((0, 0.02 * f),)),
            Sku(f"N1 Custom Instance Core running in {where}", tuple(regions), "OnDemand",
                "N1Standard", "h", ((0, 0.035 * f),)),
            Sku(f"N2 Sole Tenancy Instance Core running in {where}", tuple(regions), "OnDemand",
                "CPU", "h", ((0, 0.04 * f),)),
            Sku(f"Nvidia Tesla T4 GPU running in {where} for 1 Year", tuple(regions),
                "Commit1Yr", "GPU", "h", ((0, 0.22 * f),)),
            Sku(f"Nvidia Tesla T4 Virtual Workstation GPU running in {where}", tuple(regions),
                "OnDemand", "GPU", "h", ((0, 0.57 * f),)),
            Sku(f"E2 Instance Core running in {where}", tuple(regions), "OnDemand", "CPU", "h",
                ((0, 0.022 * f),)),
            Sku(f"Network Internet Egress from {where} to Americas", tuple(regions), "OnDemand",
                "PremiumInternetEgress", "GiBy", ((0, 0.12), (1024, 0.11), (10240, 0.08)),
                "Network"),
        ]
    return skus


@dataclass
class _Failures:
    count: int
    status: int


class FakeBilling:
    """The fake server; see the module docstring. Use as a context manager, or start()/stop()."""

    def __init__(self, skus: list[Sku] | None = None, *, page_size: int = 5000,
                 latency_s: float = 0.0) -> None:
        self.skus = default_catalog() if skus is None else skus
        self.page_size = page_size  # the most SKUs a page holds, whatever pageSize asks
        self.latency_s = latency_s
        self.requests: list[Json] = []  # the query of every listing request, in order
        self._failures: list[_Failures] = []
        self._denied = False
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> FakeBilling:
        handler = type("Handler", (_Handler,), {"fake": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="fake-billing",
                         daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def __enter__(self) -> FakeBilling:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        assert self._server is not None, "start() the fake first"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    # -- switches ------------------------------------------------------------------------
    def fail_next(self, count: int, status: int = 503) -> None:
        """Answer the next ``count`` requests with ``status`` (503: UNAVAILABLE)."""
        with self._lock:
            self._failures.append(_Failures(count, status))

    def deny(self) -> None:
        """Answer 403 from now on, as for a project where the Cloud Billing API is disabled."""
        with self._lock:
            self._denied = True

    # -- the API -------------------------------------------------------------------------
    def handle(self, path: str, query: Json) -> tuple[int, Json]:
        if self.latency_s:
            time.sleep(self.latency_s)
        with self._lock:
            failing = self._failures[0] if self._failures else None
            if failing is not None:
                failing.count -= 1
                if failing.count <= 0:
                    self._failures.pop(0)
                return error(failing.status)
            if self._denied:
                return denied()
        parts = path.strip("/").split("/")
        if parts == ["v1", "services"]:
            return 200, {"services": [{"name": f"services/{COMPUTE}", "serviceId": COMPUTE,
                                       "displayName": "Compute Engine",
                                       "businessEntityName": "businessEntities/GCP"}]}
        if len(parts) == 4 and parts[:2] == ["v1", "services"] and parts[3] == "skus":
            self.requests.append(query)
            return self._skus(parts[2], query)
        return error(404, f"The requested URL /{'/'.join(parts)} was not found on this server.")

    def _skus(self, service: str, query: Json) -> tuple[int, Json]:
        if service != COMPUTE:
            return error(404, f"Service {service} not found.")
        currency = query.get("currencyCode") or "USD"
        if currency not in RATES_PER_USD:
            return error(400, f"Currency code {currency} is not supported.")
        start = 0
        token = query.get("pageToken") or ""
        if token:
            if not token.startswith("page-") or not token[5:].isdigit():
                return error(400, "Invalid page token.")
            start = int(token[5:])
        size = min(int(query.get("pageSize") or 5000), self.page_size)
        page = self.skus[start:start + size]
        answer: Json = {"skus": [s.to_json(currency) for s in page]}
        if start + size < len(self.skus):
            answer["nextPageToken"] = f"page-{start + size}"
        return 200, answer


STATUS_NAMES = {400: "INVALID_ARGUMENT", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
                429: "RESOURCE_EXHAUSTED", 500: "INTERNAL",
                503: "UNAVAILABLE"}


def error(code: int, message: str = "The service is currently unavailable.") -> tuple[int, Json]:
    return code, {"error": {"code": code, "message": message,
                            "status": STATUS_NAMES.get(code, "UNKNOWN")}}


def denied(project: str = "123456789012") -> tuple[int, Json]:
    """What the API answers a caller whose quota project has not enabled it."""
    activation = ("https://console.developers.google.com/apis/api/cloudbilling.googleapis.com/"
                  f"overview?project={project}")
    return 403, {"error": {
        "code": 403,
        "message": f"Cloud Billing API has not been used in project {project} before or it is "
                   f"disabled. Enable it by visiting {activation} then retry. If you enabled "
                   "this API recently, wait a few minutes for the action to propagate to our "
                   "systems and retry.",
        "status": "PERMISSION_DENIED",
        "details": [
            {"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": "SERVICE_DISABLED",
             "domain": "googleapis.com",
             "metadata": {"service": "cloudbilling.googleapis.com",
                          "consumer": f"projects/{project}", "activationUrl": activation,
                          "serviceTitle": "Cloud Billing API", "containerInfo": project}},
            {"@type": "type.googleapis.com/google.rpc.LocalizedMessage", "locale": "en-US",
             "message": f"Cloud Billing API has not been used in project {project} before or "
                        "it is disabled."},
            {"@type": "type.googleapis.com/google.rpc.Help",
             "links": [{"description": "Google developers console API activation",
                        "url": activation}]},
        ],
    }}


class _Handler(BaseHTTPRequestHandler):
    fake: FakeBilling
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        parts = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        status, payload = self.fake.handle(parts.path, query)
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=UTF-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: tests read ``fake.requests`` instead."""
