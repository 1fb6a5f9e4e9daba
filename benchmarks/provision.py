"""Benchmark: the cloud half of `up` for 1, 8 and 64 VMs against the fake Compute API with
per-operation latency (the first zone out of capacity); prints one JSON line of figures.

    python benchmarks/provision.py            # 2 s per operation, 1 s boot
    python benchmarks/provision.py --quick    # 0.2 s per operation, 0.1 s boot
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from fake_compute import FakeCompute  # noqa: E402

from orchestrator import spec as specs  # noqa: E402
from orchestrator.providers.gcp.compute import ENDPOINT_ENV  # noqa: E402
from orchestrator.providers.gcp.provider import GcpProvider  # noqa: E402

COUNTS = (1, 8, 64)
ZONES = ("us-central1-a", "us-central1-b")


def measure(count: int, latency_s: float, boot_s: float) -> dict[str, Any]:
    """Provision ``count`` VMs (firewall rule, bulk create with one fall-through, RUNNING)."""
    with FakeCompute(latency_s=latency_s, boot_s=boot_s) as fake, \
            tempfile.TemporaryDirectory(prefix="orchestrate-bench-") as home:
        os.environ["ORCHESTRATE_HOME"] = home
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
        assert len(vms) == count
        return {"vms": count, "up_s": round(wall, 3),
                "create_calls": fake.calls["instances.bulkInsert"],
                "api_calls": sum(fake.calls.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short latencies, for CI")
    args = parser.parse_args()
    latency_s, boot_s = (0.2, 0.1) if args.quick else (2.0, 1.0)
    results = [measure(count, latency_s, boot_s) for count in COUNTS]
    print(json.dumps({
        "benchmark": "provision", "operation_latency_s": latency_s, "boot_s": boot_s,
        "zones_tried": len(ZONES), "results": results,
        "up_s_64_over_1": round(results[-1]["up_s"] / results[0]["up_s"], 2),
    }))


if __name__ == "__main__":
    main()
