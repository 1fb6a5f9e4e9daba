"""Benchmark: what a warm task costs at rest, and what it saves at the go.

One task of the digits job (1 worker, this machine) started as the supervisor starts a warm
task (`ORCHESTRATE_WARM=<go file>`, no TF_CONFIG; as the chief's, it also watches the
checkpoint index, `ORCHESTRATE_WARM_VERIFY`): the time until it is `ready` (TensorFlow, tf_keras
and the job's module imported), then, while it waits, its resident memory (VmRSS) and the CPU
it uses (utime + stime from /proc over IDLE seconds, as a share of one core). Then the go file
is written and the time from the go to its first step is measured, against the same task
hand-launched cold (process start to first step) in the same run.

    python benchmarks/warm_cost.py            # 3 repeats, 30 s idle each
    python benchmarks/warm_cost.py --quick    # once, 5 s idle
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from common import describe_machine, note, parser, publish, ratio, repeats, show, spread, temp_home
from jobs import LOCAL, digits_spec, write_spec

from orchestrator.api import Cluster
from orchestrator.events import parse_line

TIMEOUT_S = 300.0


def wait_for(log: Path, kind: str, proc: subprocess.Popen[bytes]) -> float:
    """The time of the first ``kind`` event in ``log`` (the worker's clock)."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        if log.is_file():
            for line in log.read_text(errors="replace").splitlines():
                event = parse_line(line)
                if event is not None and event.kind == kind:
                    return event.time
        if proc.poll() is not None:
            raise RuntimeError(f"the task exited ({proc.returncode}) before '{kind}': "
                               f"{log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.05)
    raise RuntimeError(f"no '{kind}' event within {TIMEOUT_S:.0f}s")


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def start(task: dict[str, Any], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(task["argv"], cwd=task["cwd"], env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def once(task: dict[str, Any], scratch: Path, idle_s: float) -> dict[str, Any]:
    n = time.time_ns()
    base = {**os.environ, **{k: str(v) for k, v in task["env"].items()}}
    Path(task["env"]["ORCHESTRATE_CHECKPOINT_DIR"]).mkdir(parents=True, exist_ok=True)
    # cold: the task as the supervisor starts it without warm tasks
    cold_log = scratch / f"cold-{n}.log"
    started = time.time()
    proc = start(task, cold_log, base)
    try:
        cold = wait_for(cold_log, "progress", proc) - started
    finally:
        proc.kill()
        proc.wait()
    # warm: started, ready, idle, then the go
    go = scratch / f"go-{n}"
    warm_env = {k: v for k, v in base.items() if k != "TF_CONFIG"}
    warm_env["ORCHESTRATE_WARM"] = str(go)
    warm_env["ORCHESTRATE_WARM_VERIFY"] = json.dumps(
        [task["env"]["ORCHESTRATE_CHECKPOINT_DIR"], str(scratch / f"verified-{n}.json"),
         str(scratch / f"verify-now-{n}")])
    warm_log = scratch / f"warm-{n}.log"
    started = time.time()
    proc = start(task, warm_log, warm_env)
    try:
        ready = wait_for(warm_log, "ready", proc) - started
        time.sleep(1.0)  # past the import's last threads
        cpu_before, at = cpu_s(proc.pid), time.monotonic()
        time.sleep(idle_s)
        idle_cpu = (cpu_s(proc.pid) - cpu_before) / (time.monotonic() - at)
        memory = rss_mib(proc.pid)
        tmp = go.with_suffix(".tmp")
        tmp.write_text(json.dumps({"argv": task["argv"][3:], "env": base_env(task),
                                   "cwd": task["cwd"]}))
        said = time.time()
        tmp.rename(go)
        first = wait_for(warm_log, "progress", proc) - said
    finally:
        proc.kill()
        proc.wait()
    return {"cold_first_step_s": cold, "warm_ready_s": ready, "idle_cpu_share": idle_cpu,
            "rss_mib": memory, "go_to_first_step_s": first}


def base_env(task: dict[str, Any]) -> dict[str, str]:
    return {k: str(v) for k, v in task["env"].items()}


def main() -> None:
    args = parser(__doc__).parse_args()
    host, began = describe_machine(), time.monotonic()
    idle_s = 5.0 if args.quick else 30.0
    samples: list[dict[str, Any]] = []
    with temp_home("warm-cost"), tempfile.TemporaryDirectory(prefix="orchestrate-bench-") as tmp:
        scratch = Path(tmp)
        path = write_spec(scratch, digits_spec("warm-cost", 1, LOCAL, epochs=1,
                                               steps_per_epoch=20, checkpoint_every=10))
        task = Cluster.from_spec(path).plan_document()["tasks"][0]
        for _ in range(repeats(args)):
            samples.append(once(task, scratch, idle_s))
            s = samples[-1]
            note(f"cold {s['cold_first_step_s']:.2f}s to the first step; warm ready after "
                 f"{s['warm_ready_s']:.2f}s, {s['rss_mib']:.0f} MiB, "
                 f"{100 * s['idle_cpu_share']:.2f}% of a core idle, first step "
                 f"{s['go_to_first_step_s']:.2f}s after the go")
    figures = {key: spread([s[key] for s in samples], 4) for key in samples[0]}
    saved = ratio(figures["go_to_first_step_s"]["median"], figures["cold_first_step_s"]["median"])
    publish("warm_cost", args, host, began,
            {"job": "examples.digits, 1 worker, this machine", "idle_s": idle_s,
             "go_over_cold": saved, **figures},
            ["figure", "median [min-max]"],
            [["warm task ready (imports)", show(figures["warm_ready_s"], "s")],
             ["resident memory at rest", show(figures["rss_mib"], " MiB")],
             ["CPU at rest (share of a core)", show(figures["idle_cpu_share"])],
             ["go to first step", show(figures["go_to_first_step_s"], "s")],
             ["cold start to first step", show(figures["cold_first_step_s"], "s")],
             ["go / cold", str(saved)]])


if __name__ == "__main__":
    main()
