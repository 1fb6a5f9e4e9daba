"""Benchmark: Slurm, `orchestrate train` against the same job run by hand with sbatch + srun.

On the real Slurm of tests/slurmlab.py (slurmctld, a slurmd per node in its own network
namespace; 3 nodes; a login node whose sshd lets the lab's unprivileged user in), the paced
digits job (tests/workloads/paced_digits.py: 0.1 s a step, a checkpoint every 5 steps), 3
workers, one per node, in a small project (examples/ and the paced workload) on the file
system every node shares. In one run, the ways of each figure taking turns, the order
turning every round:

- submit to first step: `orchestrate train --plain` (a subprocess; the clock starts with it)
  with no allocation yet: it submits one over SSH on the login node, waits for it, syncs the
  project, checks that every node sees it, runs the doctor and starts a step per task;
  outside --quick, `train --no-doctor` too; against `sbatch` (as the lab's user; the clock
  starts with it) of a batch script whose `srun` starts the same worker (same argv and
  environment; the project read where it is, no sync) on every node, its TF_CONFIG from
  TensorFlow's own `SlurmClusterResolver` (goal: `train` at most 1.10x);
- a task killed to the first step after the relaunch: worker:2 SIGKILLed on its node once it
  reports a given step. The orchestrator restarts the group from the chief's checkpoint as
  new steps of the same allocation (`retry.backoff_initial_s: 0`). By hand, the person acts
  the moment the task dies (their best case: no time to notice), and the whole job goes back
  through the queue and resumes from the same checkpoint, either requeued (`scontrol
  requeue`: Slurm holds a requeued job for AuthInfo's cred_expire, 10 s in the lab, 120 s by
  default) or cancelled and submitted again (`scancel`, `sbatch`); the goal (at most 0.5x)
  is against the faster of the two (medians).

Every time is the chief's own event time (its log, on the shared file system) against this
machine's clock at the submit or the kill. Also reported: the time to the chief's
`connected` event (TensorFlow imported and the group joined), and the orchestrator's
recovery phases as its supervisor records them. A run of the orchestrator that fails
otherwise than the benchmark made it fail (its SSH connection to the login node lost, say)
keeps its figure when the figure was measured before (the failure is listed under
`incidents`); otherwise the sample is listed under `discarded` and taken again.

    python benchmarks/slurm.py              # 3 repeats, after one untimed run by hand
    python benchmarks/slurm.py --quick      # once, fewer steps, `train` only
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from common import describe_machine, median_of, note, parser, publish, ratio, repeats, show, spread, temp_home
from jobs import LOCAL, PACED, cli, digits_spec, write_spec
from slurmlab import SlurmLab

from orchestrator import spec as specs
from orchestrator.api import Cluster
from orchestrator.events import Event, parse_line
from orchestrator.state import AttemptRecord, Store
from orchestrator.supervisor import RECOVERY_PHASES
from orchestrator.view import RunView

GOAL_LAUNCH, GOAL_RECOVERY = 1.10, 0.5
WORKERS, CHIEF, VICTIM = 3, "worker:0", "worker:2"
PACE_S, CHECKPOINT_EVERY = "0.1", 5
TIMEOUT_S = 300.0
TRIES = 3  # a measurement whose run fails unexpectedly (see Unexpected) is taken again
# Squeue's states of a job that is over (it stays listed for MinJobAge); "" once it is gone.
OVER = {"", "COMPLETING", "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL",
        "PREEMPTED", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY"}
# What the person's batch script runs on every node: TF_CONFIG from Slurm's environment by
# TensorFlow's own resolver, then the worker, in this process (TensorFlow imported once).
HAND = """\
import json, os, runpy, sys
import tensorflow as tf
resolver = tf.distribute.cluster_resolver.SlurmClusterResolver(
    jobs={"worker": int(os.environ["SLURM_NTASKS"])}, port_base=%(port)d, gpus_per_node=1,
    gpus_per_task=1)  # 0 fails in TF 2.21 (a range with step 0): one "GPU" id, unused on CPU
cluster = resolver.cluster_spec().as_dict()  # first: it assigns the tasks get_task_info reads
task_type, index = resolver.get_task_info()
os.environ["TF_CONFIG"] = json.dumps({"cluster": cluster,
                                      "task": {"type": task_type, "index": index}})
os.environ["ORCHESTRATE_TASK"] = f"{task_type}:{index}"
sys.argv = ["worker", *sys.argv[1:]]
runpy.run_module("worker", run_name="__main__", alter_sys=True)
"""
T = TypeVar("T")


def events(path: Path) -> list[Event]:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return []
    return [e for e in map(parse_line, text.splitlines()) if isinstance(e, Event)]


def first(found: list[Event], kind: str, after: float = 0.0) -> float | None:
    """The time of the first ``kind`` event of the first process started after ``after``
    (a log that a requeued job appends to holds the killed run's events too)."""
    start = next((i for i, e in enumerate(found) if e.kind == "started" and e.time > after), None)
    if start is None:
        return None
    return next((e.time for e in found[start:] if e.kind == kind), None)


def wait_for(what: str, check: Callable[[], T | None], timeout_s: float = TIMEOUT_S,
             log: Path | None = None) -> T:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = check()
        if found is not None and found is not False:
            return found
        time.sleep(0.1)
    tail = log.read_text(errors="replace")[-2000:] if log is not None and log.exists() else ""
    raise RuntimeError(f"timed out after {timeout_s:.0f}s waiting for {what}: {tail}")


def spec_path(lab: SlurmLab, directory: Path, steps: int) -> Path:
    """The job as a spec for the lab's partition, driven as the lab's user on its login node;
    its project (examples/ and the paced workload) under ``directory``."""
    login = {"address": lab.login.address, "user": lab.user, "key_file": lab.key_file,
             "host_key": lab.login_host_key()}
    spec = digits_spec("bench-slurm", WORKERS, LOCAL, epochs=1, steps_per_epoch=steps,
                       checkpoint_every=CHECKPOINT_EVERY, module=PACED,
                       provider={"kind": "slurm", "partition": "main", "python": sys.executable,
                                 "queue_timeout_s": 120, "login": login},
                       env={"DIGITS_PACE_S": PACE_S},
                       retry={"max_restarts": 2, "backoff_initial_s": 0},
                       timeouts={"stop_grace_s": 5})
    return write_spec(directory, spec)


class Unexpected(RuntimeError):
    """A run that failed otherwise than the benchmark made it fail: its sample is discarded
    (and counted), and the measurement taken again."""


def evidence(lab: SlurmLab, attempts: list[AttemptRecord]) -> str:
    """Why each attempt ended, and what the login node's sshd said of the connections it
    dropped."""
    sshd = lab.login.dir / "sshd.log"
    said = [line for line in (sshd.read_text(errors="replace") if sshd.exists() else "").splitlines()
            if "Disconnecting" in line or "bad id" in line]
    return (f"{[(a.number, a.cause, a.failed_task, a.detail[:200]) for a in attempts]}; the login "
            f"node's sshd: {said[-4:]}")


def later_failures(lab: SlurmLab, attempts: list[AttemptRecord], expected: int) -> list[str]:
    """The failures after the first ``expected`` attempts (which failed by the benchmark's own
    doing), with the evidence: none when the run went as planned."""
    extra = [a for a in attempts[expected:] if a.cause]
    return [evidence(lab, extra)] if extra else []


def orchestrated_launch(lab: SlurmLab, path: Path, *flags: str) -> dict[str, Any]:
    """`orchestrate train FLAGS` with no allocation yet: seconds to the chief's connected and
    first step events.

    Raises:
        Unexpected: its first attempt failed before its first step.
    """
    name = specs.load(path).name
    started = time.time()
    try:
        proc = cli("train", str(path), "--plain", *flags, timeout_s=TIMEOUT_S)
        if proc.returncode != 0:
            raise RuntimeError(f"orchestrate train exited {proc.returncode}:\n"
                               f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        store = Store()
        try:
            attempts = store.runs(name, limit=1)[0].attempts
        finally:
            store.close()
        chief = next(Path(t.log) for t in attempts[0].tasks if t.task == CHIEF)
        found = events(chief)
        if first(found, "progress", after=started) is None:
            raise Unexpected(f"attempt 1 reached no step: {evidence(lab, attempts)}")
        return {**since(started, found, chief), "incidents": later_failures(lab, attempts, 0)}
    finally:
        Cluster.from_spec(path).down()


def since(started: float, found: list[Event], log: Path) -> dict[str, float]:
    """Seconds from ``started`` to the connected and first step events of the first process
    started after it."""
    times = {kind: first(found, kind, after=started) for kind in ("connected", "progress")}
    if times["connected"] is None or times["progress"] is None:
        raise RuntimeError(f"no first step after {started:.1f} in {log}: "
                           f"{log.read_text(errors='replace')[-2000:] if log.exists() else ''}")
    return {"connected": times["connected"] - started, "first_step": times["progress"] - started}


def orchestrated_recovery(lab: SlurmLab, path: Path, kill_at: int) -> dict[str, Any]:
    """worker:2 SIGKILLed at step ``kill_at``: seconds from the kill to the chief's connected
    and first step events of the next attempt, the supervisor's phases, and any failure after.

    Raises:
        Unexpected: the first attempt failed otherwise, or the next one reached no step.
    """
    cluster = Cluster.from_spec(path)
    pids: dict[str, int] = {}
    killed: list[float] = []
    second: list[Event] = []

    def listener(view: RunView, event: Event | None) -> None:
        if event is None:
            return
        if event.kind == "started" and event.attempt == 1:
            pids[event.task] = int(event.get("pid"))
        if (event.kind == "progress" and event.attempt == 1 and event.task == VICTIM
                and event.get("step") >= kill_at and not killed):
            killed.append(time.time())
            os.kill(pids[VICTIM], signal.SIGKILL)  # the task's process on its node
        if event.attempt == 2 and event.task == CHIEF:
            second.append(event)

    try:
        cluster.up()
        result = cluster.train(listener=listener).wait()
        failed = result.attempts[0]
        if (not killed or failed.cause != "crashed" or len(result.attempts) < 2
                or first(second, "progress", after=killed[0]) is None):
            raise Unexpected(f"killed at {killed[0] if killed else 'never'}; attempts "
                             f"{evidence(lab, result.attempts)}")
        at = since(killed[0], second, Path(result.attempts[1].tasks[0].log))
        return {**at, "phases": failed.phases, "incidents": later_failures(lab, result.attempts, 1)}
    finally:
        cluster.down()


class ByHand:
    """The same worker started on every node by a batch script's srun, as the lab's user; the
    argv and environment from the orchestrator's plan (`Cluster.plan`: nothing is touched)."""

    def __init__(self, lab: SlurmLab, path: Path, directory: Path, port: int) -> None:
        self.lab, self.dir = lab, directory
        project = specs.workdir_of(specs.load(path), path)
        (task,) = (t for t in Cluster.from_spec(path).plan().tasks if t.key == CHIEF)
        assert task.argv[1:3] == ("-m", "worker"), task.argv
        self.run_dir = directory / "by-hand"
        env = {k: v for k, v in task.env.items() if k not in ("TF_CONFIG", "ORCHESTRATE_TASK")}
        env.update({"ORCHESTRATE_RUN_ID": "by-hand", "PYTHONPATH": str(project),
                    "ORCHESTRATE_CHECKPOINT_DIR": str(self.run_dir / "checkpoints"),
                    "ORCHESTRATE_MODEL_DIR": str(self.run_dir / "model")})
        hand = directory / "hand.py"
        hand.write_text(HAND % {"port": port})
        q = shlex.quote
        lines = ["#!/bin/sh", "#SBATCH --job-name=by-hand", f"#SBATCH --nodes={WORKERS}",
                 "#SBATCH --ntasks-per-node=1", "#SBATCH --partition=main",
                 f"#SBATCH --output={directory}/batch-%j.out",
                 *(f"export {k}={q(v)}" for k, v in sorted(env.items())),
                 f"cd {q(str(project))}",
                 f"exec srun --output={q(str(self.run_dir))}/task-%t.log {q(sys.executable)} "
                 f"{q(str(hand))} {shlex.join(task.argv[3:])}"]
        self.script = directory / "job.sh"
        self.script.write_text("\n".join(lines) + "\n")

    def log(self, index: int) -> Path:
        return self.run_dir / f"task-{index}.log"

    def fresh(self) -> None:
        self.lab.run("rm", "-rf", str(self.run_dir), user=self.lab.user)
        self.lab.run("mkdir", "-p", str(self.run_dir), user=self.lab.user)

    def submit(self) -> str:
        out: str = self.lab.run("sbatch", "--parsable", str(self.script), user=self.lab.user).stdout
        return out.strip().split(";")[0]

    def state(self, job: str) -> str:
        out: str = self.lab.run("squeue", "--noheader", f"--jobs={job}", "--format=%T",
                                check=False).stdout
        return out.strip()

    def launch(self) -> dict[str, float]:
        """Seconds from sbatch to the chief's connected and first step events."""
        self.fresh()
        started = time.time()
        job = self.submit()
        chief = self.log(0)
        wait_for("the chief's first step", lambda: first(events(chief), "progress"), log=chief)
        self.finish(job)
        return since(started, events(chief), chief)

    def recovery(self, kill_at: int, how: str) -> dict[str, float]:
        """Kill worker:2 at step ``kill_at``, then at once either requeue the job (``requeue``)
        or cancel it and submit it again (``resubmit``); seconds from the kill to the chief's
        connected and first step events of the job's next run (from the same checkpoints)."""
        self.fresh()
        job = self.submit()
        victim = self.log(2)
        wait_for(f"{VICTIM}'s step {kill_at}", lambda: any(
            e.kind == "progress" and e.get("step") >= kill_at for e in events(victim)), log=victim)
        pid = next(int(e.get("pid")) for e in events(victim) if e.kind == "started")
        killed = time.time()
        os.kill(pid, signal.SIGKILL)
        if how == "requeue":
            self.lab.run("scontrol", "requeue", job, user=self.lab.user)
        else:
            self.lab.run("scancel", job, user=self.lab.user)
            job = self.submit()
        chief = self.log(0)
        wait_for("the job's next first step",
                 lambda: first(events(chief), "progress", after=killed), log=chief)
        self.finish(job)
        return since(killed, events(chief), chief)

    def finish(self, job: str) -> None:
        """Wait for the job to end; it must have trained to the end."""
        wait_for(f"job {job} to end", lambda: self.state(job) in OVER)
        chief = self.log(0)
        if not any(e.kind == "finished" for e in events(chief)):
            raise RuntimeError(f"job {job} ended ({self.state(job) or 'gone'}) before the chief "
                               f"finished: {chief.read_text(errors='replace')[-2000:]}")




def measure(lab: SlurmLab, path: Path, hand: ByHand, runs: int, kill_at: int, *, quick: bool,
            discarded: list[str], incidents: list[str]
            ) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """``runs`` rounds of every kind, taking turns, the order turning every round; a run that
    failed again after its figure was measured adds an incident (its figure stands)."""
    launch: dict[str, Callable[[], dict[str, Any]]] = {
        "orchestrate": lambda: orchestrated_launch(lab, path),
        **({} if quick else {"orchestrate_no_doctor":
                             lambda: orchestrated_launch(lab, path, "--no-doctor")}),
        "by_hand": hand.launch}
    recovery: dict[str, Callable[[], dict[str, Any]]] = {
        "orchestrate": lambda: orchestrated_recovery(lab, path, kill_at),
        "requeue": lambda: hand.recovery(kill_at, "requeue"),
        "resubmit": lambda: hand.recovery(kill_at, "resubmit")}
    found: dict[str, dict[str, list[dict[str, Any]]]] = {
        "launch": {kind: [] for kind in launch}, "recovery": {kind: [] for kind in recovery}}
    for i in range(runs):
        for figure, ways in (("launch", launch), ("recovery", recovery)):
            kinds = list(ways)
            for kind in kinds[i % len(kinds):] + kinds[:i % len(kinds)]:
                found[figure][kind].append(sample(lab, f"{figure}, {kind}", ways[kind], discarded))
                for incident in found[figure][kind][-1].get("incidents", []):
                    incidents.append(f"{figure}, {kind}: {incident}")
                    note(f"{figure}, {kind}: failed again after the figure: {incident}")
                note(f"round {i + 1}, {figure}, {kind}: first step "
                     f"{found[figure][kind][-1]['first_step']:.2f}s after the "
                     f"{'submit' if figure == 'launch' else 'kill'}")
    return found


def sample(lab: SlurmLab, what: str, measure: Callable[[], dict[str, Any]],
           discarded: list[str]) -> dict[str, Any]:
    """One measurement, taken again (up to ``TRIES`` times in all) while it fails unexpectedly;
    each discarded try is added to ``discarded``. The lab is idle again after each try."""
    tries = 1
    while True:
        try:
            return measure()
        except Unexpected as exc:
            if tries == TRIES:
                raise
            tries += 1
            discarded.append(f"{what}: {exc}")
            note(f"{what}: discarded, measured again: {exc}")
        finally:
            lab.cancel_all()
            lab.wait_idle()


def figures_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"first_step_s": spread([r["first_step"] for r in runs]),
            "connected_s": spread([r["connected"] for r in runs])}


def median_first_step(runs: list[dict[str, Any]]) -> float | None:
    return median_of([r["first_step"] for r in runs])


def launch_summary(found: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    by_hand = median_first_step(found["by_hand"])
    value = ratio(median_first_step(found["orchestrate"]), by_hand)
    summary: dict[str, Any] = {kind: figures_of(runs) for kind, runs in found.items()}
    if "orchestrate_no_doctor" in found:
        summary["no_doctor_ratio"] = ratio(median_first_step(found["orchestrate_no_doctor"]), by_hand)
    return {**summary, "ratio": value, "goal": GOAL_LAUNCH,
            "goal_met": value is not None and value <= GOAL_LAUNCH}


def recovery_summary(found: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Against the person's best case: the faster of requeue and resubmit (medians)."""
    ours = median_first_step(found["orchestrate"])
    summary: dict[str, Any] = {kind: figures_of(runs) for kind, runs in found.items()}
    summary["orchestrate"]["phases_s"] = {
        p: spread([r["phases"].get(p) for r in found["orchestrate"]]) for p in RECOVERY_PHASES}
    hand = {how: median_first_step(found[how]) for how in ("requeue", "resubmit")}
    best = min((how for how in hand if hand[how] is not None), key=lambda how: hand[how] or 0.0,
               default=None)
    value = ratio(ours, hand[best]) if best is not None else None
    requeue = ratio(ours, hand["requeue"])
    return {**summary, "requeue_ratio": requeue, "resubmit_ratio": ratio(ours, hand["resubmit"]),
            "requeue_goal_met": requeue is not None and requeue <= GOAL_RECOVERY,
            "by_hand_best": best,
            "ratio": value, "goal": GOAL_RECOVERY,
            "goal_met": value is not None and value <= GOAL_RECOVERY}


def rows_of(launch: dict[str, Any], recovery: dict[str, Any]) -> list[list[str]]:
    def row(figure: str, how: str, found: dict[str, Any], kind: str, versus: str) -> list[str]:
        return [figure, how, show(found[kind]["first_step_s"], "s"),
                show(found[kind]["connected_s"], "s"), versus]

    def goal(found: dict[str, Any]) -> str:
        return (f"{show(found['ratio'])}x (goal <= {found['goal']}: "
                f"{'met' if found['goal_met'] else 'missed'})")

    rows = [row("submit to first step", "orchestrate train", launch, "orchestrate", goal(launch))]
    if "orchestrate_no_doctor" in launch:
        rows.append(row("", "orchestrate train --no-doctor", launch, "orchestrate_no_doctor",
                        f"{show(launch['no_doctor_ratio'])}x"))
    return [*rows, row("", "sbatch + srun by hand", launch, "by_hand", ""),
            row("task killed to first step", "orchestrate", recovery, "orchestrate",
                f"{goal(recovery)} against {recovery['by_hand_best']}"),
            row("", "scontrol requeue by hand", recovery, "requeue",
                f"{show(recovery['requeue_ratio'])}x"),
            row("", "scancel + sbatch by hand", recovery, "resubmit",
                f"{show(recovery['resubmit_ratio'])}x")]


def main() -> None:
    args = parser(__doc__).parse_args()
    runs = repeats(args)
    steps, kill_at = (20, 12) if args.quick else (40, 22)
    started = time.monotonic()
    host = describe_machine()
    discarded: list[str] = []
    incidents: list[str] = []
    lab = SlurmLab.start()
    note(f"slurm lab up in {time.monotonic() - started:.1f}s")
    try:
        with temp_home("slurm"), tempfile.TemporaryDirectory(dir=lab.user_home) as d:
            directory = Path(d)
            os.chmod(directory, 0o777)  # the lab's user writes the hand job's logs here
            path = spec_path(lab, directory, steps)
            hand = ByHand(lab, path, directory, specs.load(path).ports.start)
            # untimed: the lab's first job (its scheduler and nodes' first start), and outside
            # --quick a whole run (TensorFlow's files in the page cache)
            lab.run("srun", f"--nodes={WORKERS}", "--partition=main", "true", user=lab.user)
            if not args.quick:
                hand.launch()
            lab.wait_idle()
            found = measure(lab, path, hand, runs, kill_at, quick=args.quick, discarded=discarded,
                            incidents=incidents)
    finally:
        try:
            lab.cancel_all()
        finally:
            lab.close()
    launch, recovery = launch_summary(found["launch"]), recovery_summary(found["recovery"])
    figures = {"job": f"{PACED}, {WORKERS} workers, 1 epoch x {steps} steps, {PACE_S} s a step, "
                      f"a checkpoint every {CHECKPOINT_EVERY}; {VICTIM} killed at step {kill_at}",
               "submit_to_first_step": launch, "kill_to_first_step": recovery,
               "discarded": discarded, "incidents": incidents}
    if args.quick:
        figures["skipped"] = {"orchestrate_no_doctor": "--quick measures `train` only"}
    publish("slurm", args, host, started, figures,
            ["figure", "how", "first step", "connected", "orchestrate / by hand"], rows_of(launch, recovery))


if __name__ == "__main__":
    main()
