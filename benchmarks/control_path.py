"""Benchmark: a status poll and log read while a checkpoint-sized download crosses a slow link.

One namespace host with sshd; its link to this machine (the controller) is throttled like a
laptop's outside the cloud. While one file of SIZE MiB downloads through the runner, a poll
(status + log read, what the watch loop does per task every 0.25 s) is timed every 0.2 s.
Two ways, measured in the same run: the runner as it is (transfers on a connection of their
own), and every transfer on the control connection (how it was before). Figures: the poll's
round trip idle and during the download (median, p95, max), the download's seconds, and the
poll as a share of `timeouts.poll_s` (15 s by default: a poll slower than that loses the host).

    python benchmarks/control_path.py           # 64 MiB at 16 Mbit/s, 3 repeats (root)
    python benchmarks/control_path.py --quick   # 8 MiB, once
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from common import describe_machine, note, parser, publish, ratio, repeats, show, spread
from jobs import namespace_lab

from orchestrator.remote.base import LaunchSpec, TaskHandle
from orchestrator.remote.ssh import Link, SSHRunner

RATE = "16mbit"
POLL_S = 15.0  # timeouts.poll_s's default


class OneConnection(SSHRunner):
    """The runner before transfers had a connection of their own: everything on one."""

    def _open_sftp(self, what: str, link: Link) -> Any:
        return super()._open_sftp(what, "control")


def poll_s(runner: SSHRunner, handle: TaskHandle) -> float:
    started = time.perf_counter()
    runner.poll_log(handle, 0)  # what the watch loop does per task: status and log, one round trip
    return time.perf_counter() - started


def measure(runner: SSHRunner, handle: TaskHandle, remote: str,
            throttle: Callable[[], None]) -> dict[str, Any]:
    idle = [poll_s(runner, handle) for _ in range(5)]
    during: list[float] = []
    with tempfile.TemporaryDirectory(prefix="orchestrate-bench-pull-") as scratch:
        downloader = threading.Thread(target=runner.get_file, args=(remote, f"{scratch}/big.bin"))
        throttle()
        started = time.perf_counter()
        downloader.start()
        while downloader.is_alive():
            during.append(poll_s(runner, handle))
            time.sleep(0.2)
        took = time.perf_counter() - started
    return {"idle": idle, "during": during, "download_s": took}


def figures(samples: list[dict[str, Any]]) -> dict[str, Any]:
    during = [x for s in samples for x in s["during"]]
    p95 = statistics.quantiles(during, n=20)[-1] if len(during) >= 2 else max(during)
    return {"idle_poll_s": spread([x for s in samples for x in s["idle"]]),
            "poll_s": spread(during), "poll_p95_s": round(p95, 3),
            "download_s": spread([s["download_s"] for s in samples], 1),
            "max_poll_of_poll_timeout": ratio(max(during), POLL_S)}


def main() -> None:
    args = parser(__doc__).parse_args()
    host_facts, started = describe_machine(), time.monotonic()
    size_mib = 8 if args.quick else 64
    with namespace_lab(1) as (lab, why):
        if lab is None:
            note(f"skipped: {why}")
            publish("control_path", args, host_facts, started, {"skipped": why}, ["skipped"], [[why]])
            return
        host = lab.hosts(1)[0]
        samples: dict[str, list[dict[str, Any]]] = {"own connection": [], "one connection": []}
        for _ in range(repeats(args)):
            for way, cls in (("own connection", SSHRunner), ("one connection", OneConnection)):
                with cls(host.name, host.endpoint()) as runner:
                    remote = f"{host.home}/bench-{size_mib}.bin"
                    runner.run(["sh", "-c", f"head -c {size_mib << 20} /dev/urandom > {remote}"])
                    log = f"{host.home}/bench-task"
                    handle = runner.start(LaunchSpec(("echo", "hello"), host.home, f"{log}.log",
                                                     f"{log}.rc"))
                    try:
                        sample = measure(runner, handle, remote,
                                         lambda: host.throttle(RATE, to=str(lab.bridge_address)))
                    finally:
                        host.heal()
                    samples[way].append(sample)
                    note(f"{way}: {len(sample['during'])} polls during a "
                         f"{sample['download_s']:.1f}s download, the slowest "
                         f"{max(sample['during'] or [0]):.2f}s")
        results = {way: figures(s) for way, s in samples.items()}
    rows = [[way, show(r["idle_poll_s"], "s"), show(r["poll_s"], "s"), f"{r['poll_p95_s']:g}s",
             show(r["download_s"], "s"), r["max_poll_of_poll_timeout"]] for way, r in results.items()]
    publish("control_path", args, host_facts, started,
            {"rate": RATE, "size_mib": size_mib, "results": results,
             "poll_median_one_over_own": ratio(results["one connection"]["poll_s"]["median"],
                                               results["own connection"]["poll_s"]["median"], 1)},
            ["transfers on", "idle poll", "poll during download", "p95", "download",
             "slowest poll / poll_s"], rows)


if __name__ == "__main__":
    main()
