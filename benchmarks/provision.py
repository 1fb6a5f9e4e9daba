"""Benchmark: the cloud half of `up` for 1, 8 and 64 VMs against the fake Compute API.

Every operation of the fake (tests/fake_compute.py) takes a realistic latency and each VM a
boot time; the first zone is out of capacity, so every size also pays one fall-through to the
second zone. Figures: `up` wall time and API calls (all, and instance creates) per size.

    python benchmarks/provision.py            # 2 s per operation, 1 s boot, 3 repeats
    python benchmarks/provision.py --quick    # 0.2 s per operation, 0.1 s boot, once
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from common import REPO, describe_machine, note, parser, publish, ratio, repeats, show, spread, temp_home
from fake_compute import FakeCompute

from orchestrator import spec as specs
from orchestrator.providers.gcp.compute import ENDPOINT_ENV
from orchestrator.providers.gcp.provider import GcpProvider

COUNTS = (1, 8, 64)
ZONES = ("us-central1-a", "us-central1-b")


def measure(count: int, latency_s: float, boot_s: float) -> dict[str, Any]:
    """Provision ``count`` VMs (firewall rule, bulk create with one fall-through, RUNNING)."""
    with FakeCompute(latency_s=latency_s, boot_s=boot_s) as fake, temp_home("provision"):
        os.environ[ENDPOINT_ENV] = fake.url
        fake.exhaust(ZONES[0])
        spec = specs.parse(json.dumps({
            "name": f"bench-{count}", "workers": count, "job": {"module": "examples.digits"},
            "provider": {"kind": "gcp", "project": "bench-project", "zones": list(ZONES),
                         "machine_type": "a2-highgpu-1g", "spot": True},
        }))
        provider = GcpProvider(spec, REPO / "bench.yaml")
        started = time.perf_counter()
        vms = provider.provision()
        wall = time.perf_counter() - started
        provider.close()
        if len(vms) != count:
            raise RuntimeError(f"asked for {count} VMs, got {len(vms)}")
        return {"up_s": wall, "create_calls": fake.calls["instances.bulkInsert"],
                "api_calls": sum(fake.calls.values())}


def main() -> None:
    args = parser(__doc__).parse_args()
    host, started = describe_machine(), time.monotonic()
    latency_s, boot_s = (0.2, 0.1) if args.quick else (2.0, 1.0)
    samples: dict[int, list[dict[str, Any]]] = {count: [] for count in COUNTS}
    previous = os.environ.get(ENDPOINT_ENV)
    try:
        for _ in range(repeats(args)):
            for count in COUNTS:
                samples[count].append(measure(count, latency_s, boot_s))
                note(f"{count} VM(s): up in {samples[count][-1]['up_s']:.2f}s")
    finally:
        if previous is None:
            os.environ.pop(ENDPOINT_ENV, None)
        else:
            os.environ[ENDPOINT_ENV] = previous
    results: list[dict[str, Any]] = [{"vms": count, "up_s": spread([s["up_s"] for s in runs]),
                "create_calls": spread([s["create_calls"] for s in runs], 0),
                "api_calls": spread([s["api_calls"] for s in runs], 0)}
               for count, runs in samples.items()]
    rows = [[r["vms"], show(r["up_s"], "s"), show(r["create_calls"]), show(r["api_calls"])]
            for r in results]
    publish("provision", args, host, started,
            {"operation_latency_s": latency_s, "boot_s": boot_s, "zones_tried": len(ZONES),
             "results": results,
             "up_s_64_over_1": ratio(results[-1]["up_s"]["median"], results[0]["up_s"]["median"], 2)},
            ["VMs", "up", "create calls", "API calls"], rows)


if __name__ == "__main__":
    main()
