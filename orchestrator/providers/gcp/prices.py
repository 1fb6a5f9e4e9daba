"""Compute Engine's prices: the table shipped with the package, the machine types it can price,
and ``Rates``, the one form the table and the Cloud Billing Catalog (billing.py) give them in.

The table is a dated snapshot of Google's public list prices in USD, written down by hand: it
is what ``plan`` shows without a network, and what everything falls back to when the catalog
cannot be read. It is never a quote: every figure made from it is shown with its date. Its
regions other than us-central1 are us-central1's prices times the ratio of their N1 core
price to us-central1's (close for VMs and disks; GPUs differ by less than that in most of
them). Spot prices move (Google may change them once a month): those here are the day's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

AS_OF = "2025-06-01"
CURRENCY = "USD"
SOURCE = f"price table of {AS_OF}, not a quote"
HOURS_PER_MONTH = 730.0  # Google's: a GiB-month of disk is billed as 730 GiB-hours
FAMILIES = ("n1", "n2", "g2", "a2", "a3")
# The model in a GPU SKU's description ("Nvidia Tesla A100 80GB GPU running in Americas"),
# lower case, and the accelerator type Compute Engine names it by.
GPU_MODELS = {
    "t4": "nvidia-tesla-t4",
    "p4": "nvidia-tesla-p4",
    "p100": "nvidia-tesla-p100",
    "v100": "nvidia-tesla-v100",
    "l4": "nvidia-l4",
    "a100": "nvidia-tesla-a100",
    "a100 80gb": "nvidia-a100-80gb",
    "h100 80gb": "nvidia-h100-80gb",
}
# A disk type and the start of its capacity SKU's description ("Balanced PD Capacity in Iowa").
DISK_SKUS = {"pd-standard": "storage pd", "pd-balanced": "balanced pd", "pd-ssd": "ssd backed pd"}

Resource = Literal["core", "ram", "gpu", "disk"]


def key(resource: Resource, name: str, *, spot: bool = False) -> str:
    """The name of a rate in ``Rates``: ``core n1``, ``spot gpu nvidia-l4``, ``disk pd-ssd``.

    Per hour for a core or a GPU, per GiB-hour for RAM, per GiB-month for a disk.
    """
    return f"{'spot ' if spot else ''}{resource} {name}"


@dataclass(frozen=True)
class Rates:
    """A price list: its rates by region, then by ``key()``, and where they come from."""

    source: str  # for people: "Cloud Billing Catalog, read 2026-11-29" or SOURCE
    as_of: str  # the day the prices were read or written down, YYYY-MM-DD
    currency: str
    regions: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    note: str = ""  # why this list and not a fresher one ("" when nothing went wrong)

    def rate(self, region: str, name: str) -> float | None:
        return self.regions.get(region, {}).get(name)


@dataclass(frozen=True)
class Machine:
    """A machine type's shape: what its price is made of."""

    family: str
    cores: int
    memory_gib: float
    gpu_type: str | None = None  # the GPUs that come with it (A2, A3, G2)
    gpus: int = 0


# GiB of memory per core of the predefined N1 and N2 types, and their core counts.
_GIB_PER_CORE = {("n1", "standard"): 3.75, ("n1", "highmem"): 6.5, ("n1", "highcpu"): 0.9,
                 ("n2", "standard"): 4.0, ("n2", "highmem"): 8.0, ("n2", "highcpu"): 1.0}
_CORES = {"n1": (1, 2, 4, 8, 16, 32, 64, 96), "n2": (2, 4, 8, 16, 32, 48, 64, 80, 96, 128)}
# The types whose GPUs come with the machine: (cores, GiB, GPU type, GPUs).
_GPU_MACHINES: dict[str, tuple[int, float, str, int]] = {
    **{f"g2-standard-{cores}": (cores, 4.0 * cores, "nvidia-l4", gpus)
       for cores, gpus in ((4, 1), (8, 1), (12, 1), (16, 1), (24, 2), (32, 1), (48, 4), (96, 8))},
    **{f"a2-highgpu-{n}g": (12 * n, 85.0 * n, "nvidia-tesla-a100", n) for n in (1, 2, 4, 8)},
    "a2-megagpu-16g": (96, 1360.0, "nvidia-tesla-a100", 16),
    **{f"a2-ultragpu-{n}g": (12 * n, 170.0 * n, "nvidia-a100-80gb", n) for n in (1, 2, 4, 8)},
    **{f"a3-highgpu-{n}g": (26 * n, 234.0 * n, "nvidia-h100-80gb", n) for n in (1, 2, 4, 8)},
}


def machine(machine_type: str) -> Machine | None:
    """The shape of ``machine_type``; None for one this module does not know (E2, C2, custom
    types, A3 Mega, ...)."""
    built_in = _GPU_MACHINES.get(machine_type)
    if built_in is not None:
        cores, memory, gpu_type, gpus = built_in
        return Machine(machine_type[:2], cores, memory, gpu_type, gpus)
    match = re.fullmatch(r"(n1|n2)-(standard|highmem|highcpu)-([0-9]+)", machine_type)
    if match is None or int(match[3]) not in _CORES[match[1]]:
        return None
    cores = int(match[3])
    return Machine(match[1], cores, _GIB_PER_CORE[(match[1], match[2])] * cores)


# -- the table -----------------------------------------------------------------------------
# us-central1: (per core-hour, per GiB-hour of RAM), on demand then spot.
_VMS = {
    "n1": ((0.031611, 0.004237), (0.00698, 0.000936)),
    "n2": ((0.031611, 0.004237), (0.0075, 0.001)),
    "g2": ((0.024988, 0.002929), (0.009995, 0.001171)),
    "a2": ((0.031611, 0.004237), (0.012644, 0.001695)),
    "a3": ((0.031611, 0.004237), (0.012644, 0.001695)),
}
# us-central1: per GPU-hour, on demand and spot.
_GPUS = {
    "nvidia-tesla-t4": (0.35, 0.14),
    "nvidia-tesla-p4": (0.60, 0.24),
    "nvidia-tesla-p100": (1.46, 0.584),
    "nvidia-tesla-v100": (2.48, 0.992),
    "nvidia-l4": (0.56, 0.224),
    "nvidia-tesla-a100": (2.933908, 1.173563),
    "nvidia-a100-80gb": (3.969168, 1.587667),
    "nvidia-h100-80gb": (9.2478, 3.69912),
}
# us-central1: per GiB-month (spot VMs' disks cost the same).
_DISKS = {"pd-standard": 0.04, "pd-balanced": 0.10, "pd-ssd": 0.17}
# Each region's N1 core price over us-central1's.
_REGION_FACTORS = {
    "us-central1": 1.0, "us-east1": 1.0, "us-west1": 1.0, "us-east4": 1.1264,
    "europe-west1": 1.1, "europe-west4": 1.1, "asia-east1": 1.158, "asia-southeast1": 1.2337,
}


def _us_central1() -> dict[str, float]:
    rates: dict[str, float] = {}
    for family, pair in _VMS.items():
        for spot, (core, ram) in zip((False, True), pair, strict=True):
            rates[key("core", family, spot=spot)] = core
            rates[key("ram", family, spot=spot)] = ram
    for gpu, (on_demand, spot_price) in _GPUS.items():
        rates[key("gpu", gpu)] = on_demand
        rates[key("gpu", gpu, spot=True)] = spot_price
    for disk, per_month in _DISKS.items():
        rates[key("disk", disk)] = per_month
    return rates


TABLE = Rates(SOURCE, AS_OF, CURRENCY, {
    region: {name: round(price * factor, 6) for name, price in _us_central1().items()}
    for region, factor in _REGION_FACTORS.items()})
