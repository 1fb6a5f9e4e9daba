"""Benchmark: recovery with warm tasks, from a fault to the first step after the whole group relaunched.

Cases, each on a 2-worker digits job (4 x 40 steps, checkpoint every 10) under the real
Supervisor in this process, with `retry.warm_tasks: true`: a worker SIGKILLed, the chief
SIGKILLed (local provider), and a worker's host cut off from the network for a few seconds
(sshd hosts in network namespaces, caught by the status-poll watchdog). A real failure comes
long after the next attempt's warm tasks are ready, so the fault fires once the chief has
reached step 25 AND every task's warm process for the next attempt has logged `ready`
(TensorFlow and the job's module imported; read from that attempt's task logs on each host).
Until the fault the job is paced (tests/workloads/paced_digits.py: each batch >= 0.2 s), so
training still runs when the warm tasks are ready; the run is released to full speed right
after the fault, so the recovery itself runs at full speed.

Measured per case:
- fault to first step: from the fault (this process's clock) to the chief's first step of the
  next attempt (the worker's own event time); the goal is on this figure.
- where the time goes, as the supervisor records it on the failed attempt
  (`AttemptRecord.phases`): detect / stop / backoff / repair / checkpoint / launch / connect /
  first_step, which add up to its recorded `recovery_s` (failure, as the supervisor dates it,
  to the first step); the script checks that they do, within 0.01 s, and warns if not.
  repair is shown only when a host was repaired (a crash leaves none; the few ms spent
  finding that out still count in the sum).
- steps redone: the chief's last step before the fault minus the step it resumed at.
- whether the relaunch used the warm tasks (the supervisor's "N warm: told to go") and whether
  the chief's warm task had verified the checkpoint it resumed from.
- cold start: the same tasks hand-launched (unpaced), time to first step, in the same run.

Goals, fault-to-first-step over the cold start: a worker or the chief SIGKILLed <= 1.0x; a host
cut off <= 1.5x. The full run also measures the worker-killed case with `warm_tasks: false`
(cold relaunch), so warm and cold can be read side by side, and with
`retry.snapshot_on_crash: false`, so the steps redone with and without the chief's snapshot
(on by default: the group resumes at the step the crash broke) can be read side by side.

    python benchmarks/recovery.py             # warm: all three cases, + worker killed cold; 3 repeats
    python benchmarks/recovery.py --cold      # the same cases, all with warm_tasks: false
    python benchmarks/recovery.py --quick     # the worker-killed case (warm), once; no cold start
    python benchmarks/recovery.py --case "host cut off"   # one case alone, 3 repeats
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import (
    describe_machine,
    median_of,
    note,
    parser,
    publish,
    ratio,
    repeats,
    show,
    spread,
    table,
    temp_home,
)
from jobs import LOCAL, PACED, Target, by_hand, digits_spec, namespace_lab, supervise, write_spec

from orchestrator import paths
from orchestrator import spec as specs
from orchestrator.events import Event, parse_line
from orchestrator.supervisor import RECOVERY_PHASES
from orchestrator.view import RunView

KILL_GOAL, CUT_GOAL = 1.0, 1.5  # fault to first step over the cold start
WORKERS = 2
CHIEF = "worker:0"
EPOCHS, STEPS_PER_EPOCH, EVERY = 4, 40, 10
AT_STEP = 25
# Paced at 0.2 s a step, the chief reaches this step ~21 s after AT_STEP: if the warm tasks are
# not ready by then, the fault fires anyway (and the sample says so), before training ends.
LAST_CALL_STEP = EPOCHS * STEPS_PER_EPOCH - 3 * EVERY
OUTAGE_S = 5.0
POLL_S = 0.1
SUM_TOLERANCE_S = 0.01
SETTINGS = {
    "retry": {"max_restarts": 2, "backoff_initial_s": 0.2, "backoff_max_s": 1, "warm_tasks": True},
    "timeouts": {"stop_grace_s": 1, "poll_s": 3, "hang_s": 10, "startup_s": 120, "repair_s": 60},
}
PHASES = tuple(f"{phase}_s" for phase in RECOVERY_PHASES)  # the result's keys, in order
GO = re.compile(r"attempt (\d+): started (\d+) tasks(?: \((\d+) warm: told to go\))?")


def settings(warm: bool, snapshot: bool = True) -> dict[str, Any]:
    return {**SETTINGS, "retry": {**SETTINGS["retry"], "warm_tasks": warm,
                                  "snapshot_on_crash": snapshot}}


def recovery_job(directory: Path, name: str, target: Target, *, warm: bool,
                 snapshot: bool = True) -> Path:
    """The paced job a fault is fired into, with warm tasks on or off, and the survivor's
    snapshot after a crash (retry.snapshot_on_crash) on or off."""
    return write_spec(directory, digits_spec(name, WORKERS, target, epochs=EPOCHS,
                                             steps_per_epoch=STEPS_PER_EPOCH,
                                             checkpoint_every=EVERY, module=PACED,
                                             **settings(warm, snapshot)),
                      stem=f"{name}-{'warm' if warm else 'cold'}{'' if snapshot else '-nosnap'}")


def cold_start_job(directory: Path, name: str, target: Target) -> Path:
    """The same job and module, unpaced (``DIGITS_PACE_S=0``): for a time to first step."""
    return write_spec(directory, digits_spec(name, WORKERS, target, epochs=EPOCHS,
                                             steps_per_epoch=STEPS_PER_EPOCH,
                                             checkpoint_every=EVERY, module=PACED,
                                             env={"DIGITS_PACE_S": "0"}, **settings(False)),
                      stem=f"{name}-unpaced")


def task_roots(target: Target, cluster: str) -> list[str]:
    """Per task index, the cluster's directory on the task's host (runs/<run>/... below it)."""
    if target.lab is None:
        return [str(paths.cluster_home(cluster))] * WORKERS
    return [paths.host_root(h.home, cluster) for h in target.hosts[:WORKERS]]


def events_of(log: Path) -> list[Event]:
    try:
        text = log.read_text(errors="replace")
    except FileNotFoundError:
        return []
    return [e for e in (parse_line(line) for line in text.splitlines()) if e is not None]


@dataclass
class Recorder:
    """The run's listener. A thread of its own fires the fault once the chief is at step
    ``AT_STEP`` or later and (warm) every warm task of the next attempt has logged ``ready``,
    then releases the paced run; the listener keeps what the events and the supervisor say."""

    fault: Callable[[Recorder], None]
    roots: list[str]  # per task index: see task_roots
    warm: bool
    pids: dict[tuple[int, str], int] = field(default_factory=dict)
    fired_at: float | None = None
    fired_in: int = 0  # the attempt the fault hit (a port taken by another program fails one)
    fired_step: int = 0
    warm_state: str = ""  # ready | unusable | not ready (when the fault fired; warm only)
    ready: dict[str, Event] = field(default_factory=dict)  # the warm tasks' 'ready', by task
    said: list[tuple[float, str]] = field(default_factory=list)
    first_step: dict[int, float] = field(default_factory=dict)
    last_step: dict[int, int] = field(default_factory=dict)  # the chief's, per attempt
    resumed: dict[int, int] = field(default_factory=dict)
    chief_attempt: int = 0  # the newest attempt whose chief reported a step
    timers: list[threading.Timer] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    error: BaseException | None = None

    def __call__(self, view: RunView, event: Event | None) -> None:
        now = time.time()
        self.said += [(now, m) for m in view.messages[len(self.said):]]
        if event is None:
            return
        if event.kind == "started":
            self.pids[(event.attempt, event.task)] = int(event.get("pid"))
        if event.kind in ("training", "resumed") and event.task == CHIEF:
            self.resumed[event.attempt] = int(event.get("step", 0))
        if event.kind == "progress" and event.task == CHIEF:
            self.first_step.setdefault(event.attempt, event.time)
            self.last_step[event.attempt] = max(self.last_step.get(event.attempt, 0),
                                                int(event.get("step")))
            self.chief_attempt = max(self.chief_attempt, event.attempt)
            if self.thread is None:
                self.thread = threading.Thread(target=self._arm, args=(view.run_id,), daemon=True)
                self.thread.start()

    def _arm(self, run_id: str) -> None:
        try:
            while not self.done.is_set():
                attempt = self.chief_attempt
                step = self.last_step.get(attempt, 0)
                if step >= AT_STEP:
                    state = self._warm_state(run_id, attempt + 1) if self.warm else ""
                    if state != "waiting" or step >= LAST_CALL_STEP:
                        self.warm_state = "not ready" if state == "waiting" else state
                        self.fired_at, self.fired_in, self.fired_step = time.time(), attempt, step
                        try:
                            self.fault(self)
                        finally:
                            self._release(run_id)
                        return
                self.done.wait(POLL_S)
        except BaseException as exc:  # recover() raises it
            self.error = exc
            self._release(run_id)

    def _warm_state(self, run_id: str, attempt: int) -> str:
        """ready (every task's warm process), unusable (one said so), or waiting."""
        for index, root in enumerate(self.roots):
            task = f"worker:{index}"
            log = Path(paths.RunPaths.of(root, run_id).task_stem(attempt, "worker", index) + ".log")
            events = events_of(log)
            if any(e.kind == "warm_unusable" for e in events):
                return "unusable"
            ready = next((e for e in events if e.kind == "ready"), None)
            if ready is None:
                return "waiting"
            self.ready[task] = ready
        return "ready"

    def _release(self, run_id: str) -> None:
        """Let the paced job run at full speed on every host (tests/workloads/pace.py)."""
        for root in dict.fromkeys(self.roots):
            run_dir = Path(paths.RunPaths.of(root, run_id).run_dir)
            if run_dir.is_dir():
                (run_dir / "release").touch()

    def said_after(self, pattern: str) -> list[str]:
        """What the supervisor said after the fault, containing ``pattern``."""
        return [m for t, m in self.said if pattern in m and t >= (self.fired_at or 0)]


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


def recover(path: Path, fault: Callable[[Recorder], None], target: Target = LOCAL) -> dict[str, Any]:
    """One run of a ``recovery_job`` with one fault; the figures of its first recovery."""
    spec = specs.load(path)
    warm = spec.retry.warm_tasks is True
    recorder = Recorder(fault, task_roots(target, spec.name), warm)
    try:
        result = supervise(path, recorder)
    finally:
        recorder.done.set()
        if recorder.thread is not None:
            recorder.thread.join()
        for timer in recorder.timers:
            timer.join()
    if recorder.error is not None:
        raise RuntimeError(f"the fault was not fired: {recorder.error!r}") from recorder.error
    fired, hit = recorder.fired_at, recorder.fired_in
    if fired is None or len(result.attempts) <= hit or hit + 1 not in recorder.first_step:
        raise RuntimeError(f"no recovery to measure: fault at {fired}, attempts {result.attempts}")
    failed, again = result.attempts[hit - 1], hit + 1
    phases = {name: float(seconds) for name, seconds in failed.phases.items()}
    total = sum(phases.values())
    warnings = []
    if list(phases) != list(RECOVERY_PHASES):
        warnings.append(f"recorded phases {list(phases)}, not {list(RECOVERY_PHASES)}")
    if failed.recovery_s is None or abs(total - failed.recovery_s) > SUM_TOLERANCE_S:
        warnings.append(f"the recorded phases add up to {total:.3f}s, recovery_s is "
                        f"{failed.recovery_s}")
    launched = [GO.match(m) for m in recorder.said_after(f"attempt {again}: started")]
    went = next((int(m.group(3) or 0) for m in launched if m is not None), None)
    verified = bool(recorder.said_after("was verified by the chief's warm task"))
    if warm:
        if recorder.warm_state != "ready":
            warnings.append(f"the fault fired at step {recorder.fired_step} with the warm tasks "
                            f"{recorder.warm_state}")
        if went != WORKERS:
            warnings.append(f"the relaunch told {went} of {WORKERS} warm tasks to go")
    repaired = bool(recorder.said_after("repairing "))
    readies = list(recorder.ready.values())
    return {
        "cause": failed.cause, "failed_task": failed.failed_task,
        "warm_tasks": warm, "fault_step": recorder.fired_step,
        "kill_to_first_step_s": recorder.first_step[again] - fired,
        "fault_to_failed_at_s": None if failed.failed_at is None else failed.failed_at - fired,
        "recorded_recovery_s": failed.recovery_s, "recorded_detect_s": failed.detect_s,
        "recorded_phases": phases, "phases_sum_s": total,
        **{key: None if phase == "repair" and not repaired else phases.get(phase)
           for key, phase in zip(PHASES, RECOVERY_PHASES, strict=True)},
        "steps_repeated": recorder.last_step[hit] - recorder.resumed.get(again, 0),
        "recorded_steps_lost": failed.steps_lost,
        "snapshot_step": failed.snapshot_step, "snapshot": failed.snapshot,
        "warm_state_at_fault": recorder.warm_state or None,
        "warm_told_to_go": went,
        "checkpoint_verified_by_warm_task": verified,
        "warm_imported_s": max((float(e.get("imported_s")) for e in readies), default=None),
        "ready_to_fault_s": fired - max(e.time for e in readies) if readies else None,
        "warnings": warnings,
    }


@dataclass(frozen=True)
class Case:
    name: str
    target: Target
    path: Path  # a recovery_job
    cold_start: Path  # its cold_start_job
    fault: Callable[[Recorder], None]
    goal: float
    warm: bool
    snapshot: bool = True  # retry.snapshot_on_crash

    @property
    def label(self) -> str:
        return f"{self.name} ({self.relaunch})"

    @property
    def relaunch(self) -> str:
        return ("warm" if self.warm else "cold") + ("" if self.snapshot else ", snapshot off")


def summarize(case: Case, samples: list[dict[str, Any]], cold: list[float | None]) -> dict[str, Any]:
    kill_to_step = [s["kill_to_first_step_s"] for s in samples]
    value = ratio(median_of(kill_to_step), median_of(cold))
    return {
        "case": case.name, "relaunch": case.relaunch, "snapshot_on_crash": case.snapshot,
        "target": case.target.name, "workers": WORKERS,
        "cause": samples[0]["cause"] if samples else None,
        "kill_to_first_step_s": spread(kill_to_step),
        "recorded_recovery_s": spread([s["recorded_recovery_s"] for s in samples]),
        **{phase: spread([s[phase] for s in samples]) for phase in PHASES},
        "phases_add_up": all(abs(s["phases_sum_s"] - (s["recorded_recovery_s"] or 0))
                             <= SUM_TOLERANCE_S for s in samples),
        "fault_to_failed_at_s": spread([s["fault_to_failed_at_s"] for s in samples]),
        "fault_step": spread([s["fault_step"] for s in samples], 1),
        "steps_repeated": spread([s["steps_repeated"] for s in samples], 1),
        "recorded_steps_lost": spread([s["recorded_steps_lost"] for s in samples], 1),
        "resumed_from_a_snapshot": sum(s["snapshot_step"] is not None for s in samples),
        "snapshots": [s["snapshot"] for s in samples],
        "warm_ready_at_fault": sum(s["warm_state_at_fault"] == "ready" for s in samples),
        "warm_told_to_go": spread([s["warm_told_to_go"] for s in samples], 1),
        "checkpoint_verified_by_warm_task": sum(s["checkpoint_verified_by_warm_task"]
                                                for s in samples),
        "warm_imported_s": spread([s["warm_imported_s"] for s in samples]),
        "ready_to_fault_s": spread([s["ready_to_fault_s"] for s in samples]),
        "cold_start_s": spread(cold), "ratio_to_cold_start": value,
        "goal": f"<= {case.goal}x the cold start", "goal_ratio": case.goal,
        "goal_met": value is not None and value <= case.goal,
        "samples": len(samples), "recorded_phases": [s["recorded_phases"] for s in samples],
        "warnings": [w for s in samples for w in s["warnings"]],
    }


def measure(cases: list[Case], runs: int, cold_starts: bool) -> list[dict[str, Any]]:
    """Per repeat: each target's cold start, then each case, so drift falls on all alike."""
    samples: dict[str, list[dict[str, Any]]] = {c.label: [] for c in cases}
    cold: dict[str, list[float | None]] = {c.target.name: [] for c in cases}
    for _ in range(runs):
        measured: set[str] = set()
        for case in cases:
            if cold_starts and case.target.name not in measured:
                measured.add(case.target.name)
                start = by_hand(case.cold_start, case.target).first_step_s()
                cold[case.target.name].append(start)
                note(f"cold start on {case.target.name}: first step at {start or 0:.2f}s")
            sample = recover(case.path, case.fault, case.target)
            samples[case.label].append(sample)
            note(f"{case.label}: {sample['cause']} at step {sample['fault_step']}, back at the "
                 f"first step {sample['kill_to_first_step_s']:.2f}s after the fault (recorded "
                 f"{sample['recorded_recovery_s'] or 0:.2f}s: "
                 f"{', '.join(f'{p} {s:.2f}' for p, s in sample['recorded_phases'].items())}); "
                 f"warm tasks told to go: {sample['warm_told_to_go']}, checkpoint verified by "
                 f"the warm chief: {sample['checkpoint_verified_by_warm_task']}")
            for warning in sample["warnings"]:
                note(f"WARNING: {case.label}: {warning}")
    return [summarize(c, samples[c.label], cold[c.target.name]) for c in cases]


def main() -> None:
    cli = parser(__doc__)
    cli.add_argument("--cold", action="store_true",
                     help="relaunch cold (retry.warm_tasks: false) in every case")
    cli.add_argument("--case", choices=("worker killed", "chief killed", "host cut off"),
                     help="measure this case alone (full mode)")
    args = cli.parse_args()
    host, started = describe_machine(), time.monotonic()
    skipped: dict[str, str] = {}
    lab_or_none = contextlib.nullcontext((None, "")) if args.quick else namespace_lab(WORKERS)
    warm = not args.cold
    with temp_home("recovery"), tempfile.TemporaryDirectory(prefix="orchestrate-bench-") as scratch, \
            lab_or_none as (lab, reason):
        directory = Path(scratch)
        local_cold = cold_start_job(directory, "recovery-local", LOCAL)

        def local(warm_tasks: bool, snapshot: bool = True) -> Path:
            return recovery_job(directory, "recovery-local", LOCAL, warm=warm_tasks,
                                snapshot=snapshot)

        cases = [Case("worker killed", LOCAL, local(warm), local_cold, kill("worker:1"),
                      KILL_GOAL, warm)]
        if args.quick:
            skipped["chief killed"] = skipped["host cut off"] = "--quick runs the worker-killed case only"
        else:
            if warm:  # the same case relaunched cold, and without the snapshot, next to it
                cases.append(Case("worker killed", LOCAL, local(False), local_cold,
                                  kill("worker:1"), KILL_GOAL, False))
                cases.append(Case("worker killed", LOCAL, local(True, snapshot=False),
                                  local_cold, kill("worker:1"), KILL_GOAL, True, snapshot=False))
            cases.append(Case("chief killed", LOCAL, local(warm), local_cold, kill(CHIEF),
                              KILL_GOAL, warm))
            if lab is None:
                skipped["host cut off"] = reason
            else:
                target = Target("namespaces", lab, tuple(lab.hosts(WORKERS)))
                cases.append(Case("host cut off", target,
                                  recovery_job(directory, "recovery-ns", target, warm=warm),
                                  cold_start_job(directory, "recovery-ns", target),
                                  cut_off(target, 1), CUT_GOAL, warm))
        if args.case:
            skipped.update({c.name: f"--case {args.case!r}" for c in cases if c.name != args.case})
            cases = [c for c in cases if c.name == args.case]
        if args.quick:
            skipped["cold start"] = "--quick measures no cold start (launch.py does), so no ratio"
        results = measure(cases, repeats(args), cold_starts=not args.quick)
    names = [p.removesuffix("_s").replace("_", " ") for p in PHASES]
    print(table(["case", "relaunch", *names, "sum", "recorded"],
                [[r["case"], r["relaunch"], *(show(r[p]) for p in PHASES),
                  "ok" if r["phases_add_up"] else "NO", show(r["recorded_recovery_s"], "s")]
                 for r in results]), file=sys.stderr, flush=True)
    rows = [[r["case"], r["relaunch"], r["target"], r["cause"], show(r["kill_to_first_step_s"], "s"),
             " / ".join(show(r[p]["median"]) for p in PHASES),
             show(r["steps_repeated"]), warm_use(r), show(r["cold_start_s"], "s"),
             r["ratio_to_cold_start"], f"<= {r['goal_ratio']}x: {'yes' if r['goal_met'] else 'no'}"]
            for r in results]
    rows += [[name, "-", "-", "skipped", why, "", "", "", "", "", ""] for name, why in skipped.items()]
    publish("recovery", args, host, started,
            {"goals": {"worker killed": f"fault to first step <= {KILL_GOAL}x the cold start",
                       "chief killed": f"fault to first step <= {KILL_GOAL}x the cold start",
                       "host cut off": f"fault to first step <= {CUT_GOAL}x the cold start"},
             "job": f"{PACED} (examples.digits paced at 0.2 s a step until the fault), "
                    f"{WORKERS} workers, {EPOCHS} x {STEPS_PER_EPOCH} steps, checkpoint every "
                    f"{EVERY}; fault at step >= {AT_STEP} once every warm task is ready; cold "
                    "start: the same job unpaced, hand-launched",
             "relaunch": "cold (--cold)" if args.cold else "warm",
             "settings": {**SETTINGS, "outage_s": OUTAGE_S}, "phases": list(PHASES),
             "results": results, "skipped": skipped},
            ["case", "relaunch", "target", "cause", "fault to first step",
             " / ".join(names), "steps redone", "warm tasks", "cold start", "ratio", "goal"],
            rows)


def warm_use(result: dict[str, Any]) -> str:
    """How the warm tasks served: ready at the fault, told to go, checkpoint verified."""
    if result["relaunch"].startswith("cold"):
        return "-"
    n = result["samples"]
    went = result["warm_told_to_go"]
    return (f"ready {result['warm_ready_at_fault']}/{n}, went {show(went)}/{WORKERS}, "
            f"ckpt verified {result['checkpoint_verified_by_warm_task']}/{n}")


if __name__ == "__main__":
    main()
