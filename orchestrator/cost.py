"""What a cluster costs an hour, and what a run cost: its hours, GPU hours and money, and the
share of them lost to restarts (the recoveries, and the steps done twice).

On gcp the price is Compute Engine's list price of the VMs (cores and RAM), their GPUs (attached
or built into A2, A3 and G2 types) and their boot disks, on demand or spot, in the region of
the first zone: from the Cloud Billing Catalog when it can be read (``providers/gcp/billing``),
else from the table shipped with the package, whose date goes with every figure. Slurm, static
hosts and Kubernetes have no price list: their runs are counted in GPU hours, and in money at
the user's own price per GPU hour (``cost.gpu_hour_price``); static hosts' GPUs are those their
tasks report as they connect (the spec does not say). Local runs are on this machine: nothing
is priced.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from orchestrator.hosts import machine_id
from orchestrator.providers.gcp import billing, prices
from orchestrator.spec import (
    ClusterSpec,
    GcpProvider,
    KubernetesProvider,
    LocalProvider,
    SlurmProvider,
    StaticProvider,
)

if TYPE_CHECKING:
    from orchestrator.state import AttemptRecord, RunRecord

USER_PRICE = "your price per GPU hour (cost.gpu_hour_price)"
PARTS = {"vm": "VMs", "gpu": "GPUs", "disk": "disks"}  # Price.parts' keys, for people


@dataclass(frozen=True)
class Price:
    """The hourly price of a whole cluster, and where it comes from."""

    per_hour: float | None  # None: unknown (GPU hours only, or a type no list prices)
    currency: str
    gpus: int  # in the whole cluster
    machines: int
    parts: dict[str, float]  # per hour for the cluster: "vm" (cores and RAM), "gpu", "disk"
    spot: bool
    source: str  # for people: "Cloud Billing Catalog, read 2026-11-29", ...
    as_of: str  # the day of the prices, YYYY-MM-DD; "" for the user's own price
    provider: str = ""  # provider.kind
    region: str = ""  # gcp: the region of the first zone
    note: str = ""  # what is not priced, or why the catalog was not read
    # The tasks the price is for (``workers``): an elastic group's attempt on more or fewer
    # costs in proportion (``cost_of``). 0: not known (a record from before it was kept).
    tasks: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> Price:
        """The Price ``to_json`` gave, as a run record keeps it.

        Raises:
            ValueError: ``data`` is not such a dict (a damaged or older record).
        """
        if not isinstance(data, dict):
            raise ValueError(f"a price is a mapping, received {type(data).__name__}")
        try:
            per_hour = data["per_hour"]
            parts = data["parts"]
            if not (per_hour is None or _number(per_hour)) or not isinstance(parts, dict) \
                    or not all(isinstance(k, str) and _number(v) for k, v in parts.items()):
                raise ValueError("per_hour or parts is not a number")
            counts = {name: data[name] for name in ("gpus", "machines")}
            counts["tasks"] = data.get("tasks", 0)
            for name, count in counts.items():
                if not isinstance(count, int) or isinstance(count, bool) or count < 0:
                    raise ValueError(f"{name} is not a count")
            texts = {name: data[name] for name in ("currency", "source", "as_of")}
            texts.update({name: data.get(name, "") for name in ("provider", "region", "note")})
            if not all(isinstance(v, str) for v in texts.values()) or \
                    not isinstance(data["spot"], bool):
                raise ValueError("a text or the spot flag is of the wrong type")
        except KeyError as exc:
            raise ValueError(f"a price without {exc.args[0]!r}") from None
        return cls(per_hour=None if per_hour is None else float(per_hour),
                   parts={k: float(v) for k, v in parts.items()}, spot=data["spot"],
                   **counts, **texts)


@dataclass(frozen=True)
class Cost:
    """What a run has cost so far (or in all, once ``ended``), and the restarts' share of it."""

    hours: float
    gpu_hours: float
    money: float | None  # None when the price is unknown
    lost_seconds: float  # recoveries plus the time spent redoing steps
    lost_gpu_hours: float
    lost_money: float | None
    recovery_s: float  # from each failure to training again, summed
    steps_redone: int
    steps_untimed: int = 0  # redone steps whose time no attempt's pace tells
    ended: bool = False


def price_of(spec: ClusterSpec, *, catalog: prices.Rates | None = None,
             gpus_counted: int | None = None) -> Price | None:
    """The cluster's price an hour, from ``catalog`` (default: the shipped table).

    Args:
        catalog: gcp's list prices (``billing.rates()``), unused by other providers.
        gpus_counted: the GPUs of the cluster's machines, where the spec does not say (static
            hosts): those the tasks reported, each machine's once.

    Returns:
        None for the local provider. A type, GPU, disk or region the list lacks gives
        ``per_hour`` None and a note naming what.
    """
    provider = spec.provider
    if isinstance(provider, LocalProvider):
        return None
    if isinstance(provider, GcpProvider):
        price = _gcp_price(spec, provider, catalog or prices.TABLE)
    else:
        price = _gpu_hour_price(spec, gpus_counted)
    return replace(price, tasks=spec.num_tasks)


def lookup_price(spec: ClusterSpec, *, online: bool,
                 gpus_counted: int | None = None) -> Price | None:
    """``price_of`` with the newest list prices at hand: for gcp, the Billing Catalog when
    ``online`` (read at most once a day, then cached), else its cached read if newer than the
    table, else the table. Never raises for the catalog: a failed read is a note."""
    catalog = (billing.rates(spec.cost.currency, online=online)
               if isinstance(spec.provider, GcpProvider) else None)
    return price_of(spec, catalog=catalog, gpus_counted=gpus_counted)


def plan_entry(spec: ClusterSpec) -> dict[str, Any] | None:
    """``plan``'s price: from what this machine has (the catalog's cached read, else the
    table), never the network, so that a plan stays offline and instant."""
    price = lookup_price(spec, online=False)
    return None if price is None else {**price.to_json(), "summary": describe_price(price)}


def _gcp_price(spec: ClusterSpec, provider: GcpProvider, rates: prices.Rates) -> Price:
    region = provider.zones[0].rsplit("-", 1)[0]
    shape = prices.machine(provider.machine_type)
    gpus = [(shape.gpu_type, shape.gpus)] if shape is not None and shape.gpu_type else []
    if provider.accelerator is not None:
        gpus.append((provider.accelerator.type, provider.accelerator.count))
    machines = spec.num_tasks
    missing: list[str] = []

    def rate(resource: prices.Resource, name: str, spot: bool) -> float:
        found = rates.rate(region, prices.key(resource, name, spot=spot))
        if found is None:
            missing.append(f"{'spot ' if spot else ''}{name}")
        return found or 0.0

    spot = provider.spot
    parts = {"vm": 0.0, "gpu": 0.0, "disk": 0.0}
    if shape is None:
        missing.append(f"machine type {provider.machine_type}")
    else:
        parts["vm"] = machines * (shape.cores * rate("core", shape.family, spot)
                                  + shape.memory_gib * rate("ram", shape.family, spot))
    own_gpu_price, notes = _own_gpu_price(spec, rates)
    for gpu_type, count in gpus:
        each = own_gpu_price if own_gpu_price is not None else rate("gpu", gpu_type, spot)
        parts["gpu"] += machines * count * each
    parts["disk"] = machines * provider.disk_size_gb * rate("disk", provider.disk_type, False) \
        / prices.HOURS_PER_MONTH
    if region not in rates.regions:
        notes.append(f"no prices for region {region} in the {_list_name(rates)} (it has "
                     f"{', '.join(sorted(rates.regions))})")
    elif missing:
        notes.append(f"no price for {', '.join(missing)} in {region} in the {_list_name(rates)}")
    if rates.note:
        notes.append(rates.note)
    unknown = region not in rates.regions or bool(missing)
    source = rates.source + (f"; GPUs at {USER_PRICE}" if own_gpu_price is not None else "")
    return Price(per_hour=None if unknown else sum(parts.values()), currency=rates.currency,
                 gpus=machines * sum(count for _, count in gpus), machines=machines,
                 parts={} if unknown else {k: v for k, v in parts.items() if v},
                 spot=spot, source=source, as_of=rates.as_of, provider="gcp", region=region,
                 note="; ".join(notes))


def _own_gpu_price(spec: ClusterSpec, rates: prices.Rates) -> tuple[float | None, list[str]]:
    """``cost.gpu_hour_price`` where it can replace the list price of gcp's GPUs: in the
    list's currency."""
    own = spec.cost.gpu_hour_price
    if own is None or spec.cost.currency == rates.currency:
        return own, []
    return None, [f"cost.gpu_hour_price is in {spec.cost.currency} and the {_list_name(rates)} "
                  f"in {rates.currency}: the GPUs are at the list's price"]


def _list_name(rates: prices.Rates) -> str:
    return (f"price table of {rates.as_of}" if rates.source == prices.SOURCE
            else f"Billing Catalog's prices of {rates.as_of}")


def _gpu_hour_price(spec: ClusterSpec, gpus_counted: int | None) -> Price:
    """Providers without a price list: GPU hours, and money at the user's price per GPU hour."""
    provider = spec.provider
    note = ""
    gpus: int | None = None
    if isinstance(provider, SlurmProvider):
        per_task = provider.gpus_per_node
    elif isinstance(provider, KubernetesProvider):
        per_task = provider.gpus_per_pod
    elif gpus_counted is not None:
        gpus = gpus_counted
    else:
        per_task = 0
        note = ("the spec does not say how many GPUs the hosts have: 0 counted until the "
                "tasks say, as they connect")
    if isinstance(provider, StaticProvider):
        machines = len({machine_id(h.ssh_address or h.address, h.ssh_port)
                        for h in provider.hosts[:spec.num_tasks]})  # (not the spares)
    else:
        machines = spec.num_tasks  # a node or a pod per task
    if gpus is None:
        gpus = per_task * spec.num_tasks
    own = spec.cost.gpu_hour_price
    per_hour = None if own is None else gpus * own
    return Price(per_hour=per_hour, currency=spec.cost.currency, gpus=gpus, machines=machines,
                 parts={} if per_hour is None else {"gpu": per_hour},
                 spot=isinstance(provider, KubernetesProvider) and provider.spot,
                 source=USER_PRICE if own is not None else "no price list: GPU hours only",
                 as_of="", provider=provider.kind, note=note)


# -- a run's cost --------------------------------------------------------------------------
def cost_of(price: Price, run: RunRecord, now: float) -> Cost:
    """What ``run`` has cost at ``now`` (a ``time.time()``), or in all once it ended.

    The restarts' share is every attempt's recovery (from its failure to the next attempt's
    first step) and the steps the next attempt did again, timed at that attempt's pace
    (seconds from its first step to its end over the steps it made); while that attempt is
    still running, at the pace of the one that failed. Steps neither pace times are counted
    in ``steps_untimed``, and not in the time.
    """
    end = run.ended_at if run.ended_at is not None else now
    hours = max(0.0, end - run.started_at) / 3600
    attempts = sorted(run.attempts, key=lambda a: a.number)
    recovery = sum(a.recovery_s or 0.0 for a in attempts)
    redone_s, redone, untimed = _redone(attempts)
    lost_hours = (recovery + redone_s) / 3600
    sized = _sized_hours(price, run.started_at, end, attempts)
    return Cost(hours=hours, gpu_hours=sized * price.gpus, money=_money(price, sized),
                lost_seconds=recovery + redone_s, lost_gpu_hours=lost_hours * price.gpus,
                lost_money=_money(price, lost_hours), recovery_s=recovery,
                steps_redone=redone, steps_untimed=untimed, ended=run.ended_at is not None)


def _sized_hours(price: Price, started: float, end: float,
                 attempts: Sequence[AttemptRecord]) -> float:
    """The run's hours at the price's size: each attempt's span (to the next one's start, or
    the end) weighed by its tasks over the price's, where an elastic group trained on more or
    fewer; before the first attempt, and where either count is not known, at full size."""
    if not price.tasks or not attempts:
        return max(0.0, end - started) / 3600
    seconds = max(0.0, min(attempts[0].started_at, end) - started)
    for attempt, after in zip(attempts, [*attempts[1:], None], strict=True):
        stop = min(after.started_at if after is not None else end, end)
        weight = len(attempt.tasks) / price.tasks if attempt.tasks else 1.0
        seconds += max(0.0, stop - attempt.started_at) * weight
    return seconds / 3600


def _money(price: Price, hours: float) -> float | None:
    return None if price.per_hour is None else price.per_hour * hours


def _redone(attempts: Sequence[AttemptRecord]) -> tuple[float, int, int]:
    """(seconds, steps, untimed steps) of the steps done again after each failure."""
    seconds, steps, untimed = 0.0, 0, 0
    for i, attempt in enumerate(attempts):
        lost = attempt.steps_lost or 0
        if lost <= 0:
            continue
        steps += lost
        after = attempts[i + 1] if i + 1 < len(attempts) else None
        pace = (_seconds_per_step(after) if after is not None else None) \
            or _seconds_per_step(attempt)
        if pace is None:
            untimed += lost
        else:
            seconds += lost * pace
    return seconds, steps, untimed


def _seconds_per_step(attempt: AttemptRecord) -> float | None:
    a = attempt
    if None in (a.last_step, a.resumed_from_step, a.ended_at, a.first_step_at):
        return None
    steps = (a.last_step or 0) - (a.resumed_from_step or 0)
    seconds = (a.ended_at or 0.0) - (a.first_step_at or 0.0)
    return seconds / steps if steps > 0 and seconds > 0 else None


# -- for people ------------------------------------------------------------------------------
def describe_price(price: Price) -> str:
    """One line: the price an hour and what makes it, or the GPUs when only GPU hours are
    known; with where the prices come from, and their date."""
    noun = "VM" if price.provider == "gcp" else "machine"
    machines = _count(price.machines, noun)
    gpus = _count(price.gpus, "GPU")
    usage = "spot" if price.spot else "on demand" if price.provider == "gcp" else ""
    if price.region:
        usage = f"{usage} in {price.region}".strip()
    usage = f", {usage}" if usage else ""
    if price.per_hour is None:
        if price.provider == "gcp":
            text = f"price unknown for {machines} ({gpus}){usage}"
        else:
            text = (f"{gpus} on {machines}{usage}: GPU hours only (set cost.gpu_hour_price to "
                    "see money)")
    else:
        parts = ", ".join(f"{PARTS.get(k, k)} {money(v, price.currency)}"
                          for k, v in price.parts.items())
        text = (f"{money(price.per_hour, price.currency)}/h for {machines} ({gpus}"
                f"{'; ' + parts if parts else ''}){usage}; {price.source}")
    return text + (f"; {price.note}" if price.note else "")


def describe_cost(cost: Cost, price: Price) -> str:
    """One line: the run's cost (so far) and the restarts' share, in money where the price is
    known, else in GPU hours; with the prices' source."""
    usage = f"{_hours(cost.hours)} h, {_hours(cost.gpu_hours)} GPU h"
    if cost.money is not None:
        text = f"cost{'' if cost.ended else ' so far'} {money(cost.money, price.currency)} ({usage})"
    else:
        text = f"{'in all' if cost.ended else 'so far'} {usage}"
    if cost.lost_seconds > 0 or cost.steps_redone:
        what = [f"recoveries {_seconds(cost.recovery_s)}"] if cost.recovery_s else []
        if cost.steps_redone:
            untimed = f" ({cost.steps_untimed} not timed)" if cost.steps_untimed else ""
            what.append(f"{cost.steps_redone} step{'s' if cost.steps_redone != 1 else ''} "
                        f"redone{untimed}")
        lost = f"{_hours(cost.lost_gpu_hours)} GPU h: {', '.join(what)}"
        text += (f"; restarts {money(cost.lost_money, price.currency)} ({lost})"
                 if cost.lost_money is not None else f"; restarts {lost}")
    return text + (f"; {price.source}" if cost.money is not None else "")


def money(amount: float, currency: str) -> str:
    """``$3.10`` (USD) or ``3.10 EUR``; amounts under a dime with two significant digits."""
    text = f"{amount:,.2f}" if amount >= 0.1 or amount < 0.001 else f"{amount:.2g}"
    return f"${text}" if currency == "USD" else f"{text} {currency}"


def _hours(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.2g}" if value < 1 else f"{value:.1f}"


def _seconds(value: float) -> str:
    if value < 60:
        return f"{value:.0f} s"
    return f"{value / 60:.1f} min" if value < 3600 else f"{value / 3600:.1f} h"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
