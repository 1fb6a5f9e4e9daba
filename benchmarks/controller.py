"""Benchmark: controller scale, the supervisor's CPU share, memory and event latency with 64 tasks.

Each task is a light process (benchmarks/light_task.py, command mode: no TensorFlow) that
reports 5 progress events per second; each runs on its own sshd host in its own network
namespace (static provider, one SSH connection per host), all on this machine. The real
Supervisor watches them from this process. Figures, over the steady
window (every task reporting, none finished yet): the controller's CPU time / wall time,
its resident memory, and the event latency (worker's timestamp to the listener call); and
how long `up` plus the launch took until every task reported.
Without namespaces the tasks fall back to local processes, and the JSON says so.

    python benchmarks/controller.py           # 64 tasks x 40 s, 3 repeats
    python benchmarks/controller.py --quick   # 8 tasks x 6 s, once
"""

from __future__ import annotations

import resource
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import REPO, describe_machine, note, parser, publish, repeats, show, spread, temp_home
from jobs import PORTS, Target, namespace_lab, static_provider, supervise, write_spec

from orchestrator.events import Event
from orchestrator.view import RunView

RATE = 5.0  # progress events per second per task


def rss_mib(field_name: str = "VmRSS") -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


@dataclass
class Meter:
    """The run's listener: event latencies, and CPU and memory at the steady window's edges."""

    tasks: int
    seen: set[str] = field(default_factory=set)
    latencies: list[float] = field(default_factory=list)
    start: tuple[float, float] | None = None  # (wall, controller CPU) when every task reports
    end: tuple[float, float] | None = None  # ... when the first task has reported its last step
    rss_at_end: float = 0.0
    threads_at_end: int = 0

    def __call__(self, view: RunView, event: Event | None) -> None:
        if event is None or event.kind != "progress":
            return
        now = time.time()
        if self.start is not None and self.end is None:
            self.latencies.append(now - event.time)
        self.seen.add(event.task)
        if self.start is None and len(self.seen) == self.tasks:
            self.start = (now, time.process_time())
        if self.start is not None and self.end is None and event.get("step") == event.get("total_steps"):
            self.end = (now, time.process_time())
            self.rss_at_end = rss_mib()
            self.threads_at_end = threading.active_count()


def measure(path: Path, tasks: int) -> dict[str, Any]:
    meter = Meter(tasks)
    rss_before = rss_mib()
    began, wall, cpu = time.time(), time.monotonic(), time.process_time()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    supervise(path, meter)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if meter.start is None or meter.end is None or not meter.latencies:
        raise RuntimeError(f"no steady window: {len(meter.seen)} of {tasks} tasks reported")
    window = meter.end[0] - meter.start[0]
    latencies = sorted(meter.latencies)
    return {
        "cpu_share": (meter.end[1] - meter.start[1]) / window, "window_s": window,
        "all_reporting_after_s": meter.start[0] - began,
        "rss_mib": meter.rss_at_end, "rss_growth_mib": meter.rss_at_end - rss_before,
        "threads": meter.threads_at_end,
        "latency_median_s": statistics.median(latencies),
        "latency_p95_s": latencies[int(0.95 * (len(latencies) - 1))],
        "latency_max_s": latencies[-1], "events": len(latencies),
        "events_per_s": len(latencies) / window,
        "run_wall_s": time.monotonic() - wall, "run_cpu_s": time.process_time() - cpu,
        "run_children_cpu_s": (after.ru_utime + after.ru_stime) - (children.ru_utime + children.ru_stime),
    }


def job_spec(tasks: int, seconds: float, target: Target) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": f"scale-{tasks}", "workers": tasks, "workdir": str(REPO / "benchmarks"),
        "job": {"command": f"python light_task.py --rate {RATE:g} --seconds {seconds:g}"},
        "retry": {"max_restarts": 0}, "timeouts": {"startup_s": 180, "stop_grace_s": 1},
        "ports": PORTS,
    }
    if target.lab is not None:
        spec["provider"] = static_provider(target.lab, target.hosts)
    return spec


def main() -> None:
    args = parser(__doc__).parse_args()
    host, started = describe_machine(), time.monotonic()
    tasks, seconds = (8, 6.0) if args.quick else (64, 40.0)
    samples: list[dict[str, Any]] = []
    with temp_home("controller"), tempfile.TemporaryDirectory(prefix="orchestrate-bench-") as scratch, \
            namespace_lab(tasks) as (lab, reason):
        target = Target("local") if lab is None else Target("namespaces", lab, tuple(lab.hosts(tasks)))
        path = write_spec(Path(scratch), job_spec(tasks, seconds, target))
        for _ in range(repeats(args)):
            sample = measure(path, tasks)
            samples.append(sample)
            note(f"{tasks} tasks on {target.name}: controller CPU {100 * sample['cpu_share']:.1f}%, "
                 f"RSS {sample['rss_mib']:.0f} MiB, latency median {sample['latency_median_s']:.3f}s")
    figures = {key: spread([s[key] for s in samples], 1 if key.startswith(("rss", "run")) else 3)
               for key in samples[0]}
    result = {"tasks": tasks, "hosts": len(target.hosts) or 1, "transport": target.name,
              "fallback_reason": reason or None, "events_per_s_per_task": RATE,
              "task_seconds": seconds, **figures}
    rows = [[tasks, result["hosts"], target.name, f"{RATE * tasks:g}",
             show(spread([100 * s["cpu_share"] for s in samples], 1), "%"),
             show(figures["rss_mib"], " MiB"), show(figures["latency_median_s"], "s"),
             show(figures["latency_p95_s"], "s"), show(figures["latency_max_s"], "s"),
             show(figures["all_reporting_after_s"], "s")]]
    publish("controller", args, host, started, {"result": result},
            ["tasks", "hosts", "transport", "events/s", "controller CPU", "RSS", "latency median",
             "p95", "max", "all reporting after"], rows)


if __name__ == "__main__":
    main()
