"""Benchmark: recovery, from a failure at a set step to the first step after the whole group relaunched.

Cases, each on a 2-worker digits job (checkpoint every 10 steps) under the real Supervisor in
this process: a worker SIGKILLed at step 25, the chief SIGKILLed at step 25 (local provider), and a
worker's host cut off from the network at step 25 for a few seconds (sshd hosts in network
namespaces, caught by the status-poll watchdog). Each figure is split into where the time
goes: detect, stop (and, for a lost host, ask whether it is back), backoff, repair (a lost
host: wait for it, `up` again, stop what ran there), checkpoint verification plus relaunch,
relaunch to first step. Steps repeated: the chief's last step before the fault minus the
step it resumed at. Cold start = the same tasks
hand-launched, time to first step, measured in the same run. Goal: kill-to-first-step within
1.5x of the cold start.

    python benchmarks/recovery.py             # all three cases, 3 repeats
    python benchmarks/recovery.py --quick     # the worker-killed case, once
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import describe_machine, median_of, note, parser, publish, ratio, repeats, show, spread, temp_home
from jobs import LOCAL, Target, by_hand, digits_spec, namespace_lab, supervise, write_spec

from orchestrator.events import Event
from orchestrator.view import RunView

GOAL_RATIO = 1.5
WORKERS = 2
AT_STEP = 25
OUTAGE_S = 5.0
SETTINGS = {
    "retry": {"max_restarts": 2, "backoff_initial_s": 0.2, "backoff_max_s": 1},
    "timeouts": {"stop_grace_s": 1, "poll_s": 3, "hang_s": 10, "startup_s": 120, "repair_s": 60},
}
PHASES = ("detect_s", "stop_s", "backoff_s", "repair_s", "verify_and_launch_s",
          "launch_to_first_step_s")


@dataclass
class Recorder:
    """The run's listener: fires the fault at the set step and stamps what the supervisor says."""

    fault: Callable[[Recorder], None]
    pids: dict[tuple[int, str], int] = field(default_factory=dict)
    fired_at: float | None = None
    fired_in: int = 0  # the attempt the fault hit (a port taken by another program fails one)
    said: list[tuple[float, str]] = field(default_factory=list)
    attempt_at: dict[int, float] = field(default_factory=dict)
    first_step: dict[int, float] = field(default_factory=dict)
    last_step: dict[int, int] = field(default_factory=dict)  # the chief's, per attempt
    resumed: dict[int, int] = field(default_factory=dict)
    timers: list[threading.Timer] = field(default_factory=list)

    def __call__(self, view: RunView, event: Event | None) -> None:
        now = time.time()
        self.said += [(now, m) for m in view.messages[len(self.said):]]
        self.attempt_at.setdefault(view.attempt, now)
        if event is None:
            return
        if event.kind == "started":
            self.pids[(event.attempt, event.task)] = int(event.get("pid"))
        if event.kind in ("training", "resumed") and event.task == "worker:0":
            self.resumed[event.attempt] = int(event.get("step", 0))
        if event.kind == "progress" and event.task == "worker:0":
            self.first_step.setdefault(event.attempt, event.time)
            self.last_step[event.attempt] = max(self.last_step.get(event.attempt, 0),
                                                int(event.get("step")))
            if self.fired_at is None and int(event.get("step")) >= AT_STEP:
                self.fired_at, self.fired_in = time.time(), event.attempt
                self.fault(self)

    def said_at(self, start: str) -> float | None:
        """When the supervisor first said something starting so, after the fault."""
        return next((t for t, m in self.said if m.startswith(start) and t >= (self.fired_at or 0)),
                    None)


def kill(task: str) -> Callable[[Recorder], None]:
    def fault(recorder: Recorder) -> None:
        os.kill(recorder.pids[(recorder.fired_in, task)], signal.SIGKILL)
    return fault


def cut_off(target: Target, index: int) -> Callable[[Recorder], None]:
    def fault(recorder: Recorder) -> None:
        host = target.hosts[index]
        host.cut()
        timer = threading.Timer(OUTAGE_S, host.restore)
        timer.start()
        recorder.timers.append(timer)
    return fault


def recover(path: Path, fault: Callable[[Recorder], None]) -> dict[str, Any]:
    """One run with one fault; the figures of its first recovery."""
    recorder = Recorder(fault)
    try:
        result = supervise(path, recorder)
    finally:
        for timer in recorder.timers:
            timer.join()
    fired, hit = recorder.fired_at, recorder.fired_in
    if fired is None or len(result.attempts) <= hit or hit + 1 not in recorder.first_step:
        raise RuntimeError(f"no recovery to measure: fault at {fired}, attempts {result.attempts}")
    first, again = result.attempts[hit - 1], hit + 1
    restart = recorder.said_at("restarting all tasks")
    repairing = recorder.said_at("repairing ")
    planned, launched = recorder.attempt_at.get(again), recorder.said_at(f"attempt {again}: started")
    back = recorder.first_step[again]
    return {
        "cause": first.cause, "failed_task": first.failed_task,
        "kill_to_first_step_s": back - fired,
        "detect_s": (first.detected_at or fired) - fired,
        "stop_s": _between(first.detected_at, first.ended_at),
        "backoff_s": _between(restart, repairing or planned),
        "repair_s": _between(repairing, planned),
        "verify_and_launch_s": _between(planned, launched),
        "launch_to_first_step_s": _between(launched, back),
        "recorded_recovery_s": first.recovery_s, "recorded_detect_s": first.detect_s,
        "steps_repeated": recorder.last_step[hit] - recorder.resumed.get(again, 0),
        "recorded_steps_lost": first.steps_lost,
    }


def _between(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start


@dataclass(frozen=True)
class Case:
    name: str
    target: Target
    path: Path
    fault: Callable[[Recorder], None]


def summarize(case: Case, samples: list[dict[str, Any]], cold: list[float | None]) -> dict[str, Any]:
    kill_to_step = [s["kill_to_first_step_s"] for s in samples]
    value = ratio(median_of(kill_to_step), median_of(cold))
    return {
        "case": case.name, "target": case.target.name, "workers": WORKERS,
        "cause": samples[0]["cause"] if samples else None,
        "kill_to_first_step_s": spread(kill_to_step),
        **{phase: spread([s[phase] for s in samples]) for phase in PHASES},
        "recorded_recovery_s": spread([s["recorded_recovery_s"] for s in samples]),
        "steps_repeated": spread([s["steps_repeated"] for s in samples], 1),
        "recorded_steps_lost": spread([s["recorded_steps_lost"] for s in samples], 1),
        "cold_start_s": spread(cold), "ratio_to_cold_start": value,
        "goal_met": value is not None and value <= GOAL_RATIO,
    }


def measure(cases: list[Case], runs: int, cold_starts: bool) -> list[dict[str, Any]]:
    """Per repeat: each target's cold start, then each case, so drift falls on all alike."""
    samples: dict[str, list[dict[str, Any]]] = {c.name: [] for c in cases}
    cold: dict[str, list[float | None]] = {c.target.name: [] for c in cases}
    for _ in range(runs):
        measured: set[str] = set()
        for case in cases:
            if cold_starts and case.target.name not in measured:
                measured.add(case.target.name)
                start = by_hand(case.path, case.target).first_step_s()
                cold[case.target.name].append(start)
                note(f"cold start on {case.target.name}: first step at {start or 0:.2f}s")
            sample = recover(case.path, case.fault)
            samples[case.name].append(sample)
            note(f"{case.name}: {sample['cause']}, back at the first step "
                 f"{sample['kill_to_first_step_s']:.2f}s after the fault "
                 f"({', '.join(f'{p} {sample[p] or 0:.2f}' for p in PHASES)})")
    return [summarize(c, samples[c.name], cold[c.target.name]) for c in cases]


def main() -> None:
    args = parser(__doc__).parse_args()
    host, started = describe_machine(), time.monotonic()
    skipped: dict[str, str] = {}
    lab_or_none = contextlib.nullcontext((None, "")) if args.quick else namespace_lab(WORKERS)
    with temp_home("recovery"), tempfile.TemporaryDirectory(prefix="orchestrate-bench-") as scratch, \
            lab_or_none as (lab, reason):
        directory = Path(scratch)

        def job(name: str, target: Target) -> Path:
            return write_spec(directory, digits_spec(name, WORKERS, target, epochs=2,
                                                     steps_per_epoch=40, checkpoint_every=10,
                                                     **SETTINGS))

        local = job("recovery-local", LOCAL)
        cases = [Case("worker killed", LOCAL, local, kill("worker:1"))]
        if args.quick:
            skipped["chief killed"] = skipped["host cut off"] = "--quick runs the worker-killed case only"
        else:
            cases.append(Case("chief killed", LOCAL, local, kill("worker:0")))
            if lab is None:
                skipped["host cut off"] = reason
            else:
                target = Target("namespaces", lab, tuple(lab.hosts(WORKERS)))
                cases.append(Case("host cut off", target, job("recovery-ns", target),
                                  cut_off(target, 1)))
        if args.quick:
            skipped["cold start"] = "--quick measures no cold start (launch.py does), so no ratio"
        results = measure(cases, repeats(args), cold_starts=not args.quick)
    rows = [[r["case"], r["target"], r["cause"], show(r["kill_to_first_step_s"], "s"),
             " / ".join(show(r[p]) for p in PHASES), show(r["steps_repeated"]),
             show(r["cold_start_s"], "s"), r["ratio_to_cold_start"], "yes" if r["goal_met"] else "no"]
            for r in results]
    rows += [[name, "-", "skipped", why, "", "", "", "", ""] for name, why in skipped.items()]
    publish("recovery", args, host, started,
            {"goal": f"kill-to-first-step <= {GOAL_RATIO}x the hand-launched cold start",
             "job": f"examples.digits, {WORKERS} workers, 2 x 40 steps, checkpoint every 10, "
                    f"fault at step {AT_STEP}",
             "settings": {**SETTINGS, "outage_s": OUTAGE_S}, "phases": list(PHASES),
             "results": results, "skipped": skipped},
            ["case", "target", "cause", "fault to first step",
             "detect / stop / backoff / repair / verify+launch / to first step", "steps redone",
             "cold start", "ratio", "goal"],
            rows)


if __name__ == "__main__":
    main()
