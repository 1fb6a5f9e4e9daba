"""Benchmark: the orchestrator (warm tasks) next to Ray Train's TensorflowTrainer, same job, same run.

One 2-worker digits job (160 steps, checkpoint every 10, a worker SIGKILLed) three ways,
interleaved every repeat: hand-launched (time to first step); the orchestrator (time to first
step from the start of `orchestrate train`; kill-to-first-step under the Supervisor in this
process, with `retry.warm_tasks: true`, measured as recovery.py does: the job paced until the
kill, which fires at step 25 or later once the next attempt's warm tasks are ready, then
released); Ray Train (benchmarks/ray_digits.py: `TensorflowTrainer`,
`FailureConfig(max_failures=1)`; rank 1 SIGKILLed at step 25; time to first step from the
driver script's start, and kill-to-first-step, in one run). Steps redone: the chief's (rank
0's) last step before the kill minus the step it resumed at.

Goals: the orchestrator's kill-to-first-step <= 0.35x Ray's; its steps redone <= the
checkpoint interval (10).

Ray is the optional extra `bench` (pip install -e ".[bench]"); without it the Ray side is
skipped and the JSON says why.

    python benchmarks/peer.py             # 3 repeats
    python benchmarks/peer.py --quick     # once; Ray only if installed
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import (
    REPO,
    describe_machine,
    median_of,
    note,
    parser,
    publish,
    ratio,
    repeats,
    show,
    spread,
    temp_home,
)
from jobs import LOCAL, by_hand, orchestrated
from recovery import (
    AT_STEP,
    EPOCHS,
    EVERY,
    STEPS_PER_EPOCH,
    WORKERS,
    cold_start_job,
    kill,
    recover,
    recovery_job,
)

STEPS = EPOCHS * STEPS_PER_EPOCH
GOAL_RATIO = 0.35  # the orchestrator's kill-to-first-step over Ray's
RAY_TIMEOUT_S = 420.0
RAY_FIGURES = ("first_step_s", "kill_to_first_step_s", "kill_to_workers_started_s",
               "workers_started_to_resumed_s", "resumed_to_first_step_s", "steps_repeated")


def ray_status() -> tuple[str | None, str]:
    """Ray's version, or None and why it cannot be measured here."""
    try:
        version = importlib.metadata.version("ray")
    except importlib.metadata.PackageNotFoundError:
        return None, "ray is not installed (pip install -e .[bench])"
    probe = subprocess.run([sys.executable, "-c", "from ray.train.tensorflow import TensorflowTrainer"],
                           capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        return None, f"ray {version}: ray.train.tensorflow.TensorflowTrainer does not import: " \
                     f"{probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else probe.returncode}"
    return version, ""


def ray_run(scratch: Path) -> dict[str, Any]:
    """One Ray Train run; SIGKILL rank 1 once rank 0 reports step AT_STEP; time both starts."""
    events, storage = Path(tempfile.mkdtemp(dir=scratch)), Path(tempfile.mkdtemp(dir=scratch))
    session = Path(tempfile.mkdtemp(prefix="r", dir=scratch))
    argv = [sys.executable, str(REPO / "benchmarks" / "ray_digits.py"), "--events", str(events),
            "--storage", str(storage), "--temp", str(session), "--workers", str(WORKERS),
            "--steps", str(STEPS), "--every", str(EVERY)]
    log = scratch / f"ray-{time.time_ns()}.log"
    started = time.time()
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=scratch)
    first_pids: dict[int, int] = {}
    fired: tuple[float, int] | None = None
    deadline = time.monotonic() + RAY_TIMEOUT_S
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            seen = _ray_events(events)
            if fired is None:
                first_pids = {int(e["rank"]): int(e["pid"]) for e in seen if e["event"] == "started"}
                if len(first_pids) == WORKERS and any(
                        e["event"] == "progress" and e["rank"] == 0 and e["step"] >= AT_STEP for e in seen):
                    os.kill(first_pids[1], signal.SIGKILL)
                    fired = (time.time(), first_pids[1])
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return _ray_figures(_ray_events(events), started, fired, set(first_pids.values()), proc.returncode,
                        log.read_text(errors="replace"))


def _ray_events(directory: Path) -> list[dict[str, Any]]:
    found = []
    for path in directory.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                found.append(json.loads(line))
    return found


def _ray_figures(seen: list[dict[str, Any]], started: float, fired: tuple[float, int] | None,
                 first: set[int], code: int | None, output: str) -> dict[str, Any]:
    def first_time(kind: str, pids: set[int] | None = None, rank: int = 0) -> float | None:
        times = [e["time"] for e in seen if e["event"] == kind and e["rank"] == rank
                 and (pids is None or e["pid"] in pids)]
        return min(times) if times else None

    later = {int(e["pid"]) for e in seen} - first
    step_at = first_time("progress", first)
    back = first_time("progress", later) if later else None
    restarted, resumed = first_time("started", later), first_time("resumed", later)
    killed_at = fired[0] if fired else None
    last_before = max((e["step"] for e in seen if e["event"] == "progress" and e["pid"] in first
                       and e["rank"] == 0), default=None)
    resumed_step = next((e["step"] for e in seen if e["event"] == "resumed" and e["pid"] in later), None)
    error = None if code == 0 and back is not None else (
        f"exit {code}; {'no step after the kill; ' if back is None else ''}"
        f"last output: {output.strip()[-600:]}")
    return {
        "first_step_s": None if step_at is None else step_at - started,
        "kill_to_first_step_s": None if back is None or killed_at is None else back - killed_at,
        "kill_to_workers_started_s": None if restarted is None or killed_at is None
        else restarted - killed_at,
        "workers_started_to_resumed_s": None if resumed is None or restarted is None
        else resumed - restarted,
        "resumed_to_first_step_s": None if back is None or resumed is None else back - resumed,
        "steps_repeated": None if last_before is None or resumed_step is None
        else max(0, last_before - resumed_step),
        "error": error,
    }


def main() -> None:
    args = parser(__doc__).parse_args()
    host, started = describe_machine(), time.monotonic()
    version, ray_missing = ray_status()
    runs = repeats(args)
    skipped: dict[str, str] = {}
    if args.quick and version is None:
        runs = 0
        skipped["orchestrate"] = "--quick without Ray compares nothing (launch.py and recovery.py " \
                                 "measure these)"
    hand: list[float | None] = []
    cli_first: list[float | None] = []
    recoveries: list[dict[str, Any]] = []
    rays: list[dict[str, Any]] = []
    with temp_home("peer"), tempfile.TemporaryDirectory(prefix="orchestrate-bench-") as scratch:
        first = cold_start_job(Path(scratch), "peer-local", LOCAL)  # unpaced: to the first step
        paced = recovery_job(Path(scratch), "peer-local", LOCAL, warm=True)
        for _ in range(runs):
            hand.append(by_hand(first, LOCAL).first_step_s())
            cli_first.append(orchestrated(first).first_step_s())
            recoveries.append(recover(paced, kill("worker:1")))
            note(f"by hand {hand[-1] or 0:.2f}s, orchestrate train {cli_first[-1] or 0:.2f}s to the "
                 f"first step; orchestrate back {recoveries[-1]['kill_to_first_step_s']:.2f}s after a "
                 f"kill at step {recoveries[-1]['fault_step']} ({recoveries[-1]['warm_told_to_go']} "
                 "warm tasks told to go)")
            for warning in recoveries[-1]["warnings"]:
                note(f"WARNING: orchestrate: {warning}")
            if version is not None:
                rays.append(ray_run(Path(scratch)))
                note(f"ray: first step {rays[-1]['first_step_s'] or 0:.2f}s, back "
                     f"{rays[-1]['kill_to_first_step_s'] or 0:.2f}s after a kill, "
                     f"error: {rays[-1]['error']}")
    orchestrate = {
        "first_step_s": spread(cli_first),
        "kill_to_first_step_s": spread([r["kill_to_first_step_s"] for r in recoveries]),
        "steps_repeated": spread([r["steps_repeated"] for r in recoveries], 1),
        "fault_step": spread([r["fault_step"] for r in recoveries], 1),
        "warm_told_to_go": spread([r["warm_told_to_go"] for r in recoveries], 1),
        "recorded_phases": [r["recorded_phases"] for r in recoveries],
        "warnings": [w for r in recoveries for w in r["warnings"]],
    }
    if version is None:
        ray: dict[str, Any] = {"skipped": ray_missing}
    else:
        ray = {"version": version, "trainer": "ray.train.tensorflow.TensorflowTrainer",
               "failure_config": "FailureConfig(max_failures=1)",
               **{key: spread([r[key] for r in rays]) for key in RAY_FIGURES},
               "errors": [r["error"] for r in rays if r["error"]]}
    ours = median_of([r["kill_to_first_step_s"] for r in recoveries])
    theirs = median_of([r["kill_to_first_step_s"] for r in rays])
    over_ray = ratio(ours, theirs)
    redone = orchestrate["steps_repeated"]["max"]
    goals = {
        "kill_to_first_step": f"orchestrator <= {GOAL_RATIO}x Ray's",
        "kill_to_first_step_met": None if over_ray is None else over_ray <= GOAL_RATIO,
        "steps_repeated": f"orchestrator <= the checkpoint interval ({EVERY})",
        "steps_repeated_met": None if redone is None else redone <= EVERY,
    }
    rows = [["by hand", show(spread(hand), "s"), "-", "-"],
            ["orchestrate (warm)", show(orchestrate["first_step_s"], "s"),
             show(orchestrate["kill_to_first_step_s"], "s")
             + ("" if over_ray is None else f" = {over_ray}x Ray's (goal <= {GOAL_RATIO}x: "
                f"{'yes' if goals['kill_to_first_step_met'] else 'no'})"),
             show(orchestrate["steps_repeated"])
             + ("" if redone is None else f" (goal <= {EVERY}: "
                f"{'yes' if goals['steps_repeated_met'] else 'no'})")]]
    rows.append(["ray train", "skipped", ray["skipped"], ""] if version is None else
                ["ray train", show(ray["first_step_s"], "s"), show(ray["kill_to_first_step_s"], "s"),
                 show(ray["steps_repeated"])])
    publish("peer", args, host, started,
            {"job": f"examples.digits model and data, {WORKERS} workers, {STEPS} steps, checkpoint "
                    f"every {EVERY}, worker SIGKILLed at step {AT_STEP} (the orchestrator's: at "
                    f"step {AT_STEP} or later, once its warm tasks are ready, the job paced until "
                    "then)",
             "goals": goals,
             "by_hand": {"first_step_s": spread(hand)}, "orchestrate": orchestrate, "ray": ray,
             "skipped": skipped,
             "orchestrate_over_ray": {"kill_to_first_step": over_ray},
             "ray_over_orchestrate": {
                 "first_step": ratio(median_of([r["first_step_s"] for r in rays]), median_of(cli_first)),
                 "kill_to_first_step": ratio(theirs, ours)}},
            ["launcher", "time to first step", "kill to first step", "steps redone"], rows)


if __name__ == "__main__":
    main()
