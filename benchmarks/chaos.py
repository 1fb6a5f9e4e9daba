"""Benchmark: a chaos soak. One deterministic run survives a seeded schedule of every fault the
product claims to survive, and ends with the weights of an unbroken run, bit for bit.

The job: examples.digits on 2 workers (tf_keras on TensorFlow; with `--backend jax`,
examples.keras3_digits on Keras 3 and JAX), deterministic (`job.deterministic: true`, one
seed), 6 x 20 steps, a checkpoint every 5, paced at 0.1 s a step throughout
(tests/workloads/paced_digits.py, paced_jax_digits.py), driven through the CLI
(`orchestrate train --plain` in a subprocess), as a user runs it, so that the controller itself
can be killed and taken over with `orchestrate train --attach`. The schedule (`--seed`) orders
the faults and spaces them 6 to 12 steps after the previous recovery's first step; each fires
once the run has recovered from the one before. Fault classes:

- worker killed: a worker's process SIGKILLed (crashed; the chief saves the step under way).
- chief killed: the chief's process SIGKILLed (crashed; no survivor's snapshot yet).
- task hung: a task's process SIGSTOPped (hung, caught by the progress watchdog, `hang_s`).
- preempted: a task's process sent SIGTERM, as a preempted VM's is (every task saves at one
  step and exits 75).
- controller killed: the `orchestrate train` process SIGKILLed mid-run; the tasks keep training
  and `orchestrate train --attach` takes the run over.
- disk full: the checkpoint file system (a 32 MiB tmpfs at `checkpoint.dir`; needs root) filled
  two steps before a save, and freed once the group has been stopped.
- host cut off (full mode, namespace SSH hosts): a worker's host's link down for 5 s (host_lost,
  caught by the status poll), the tasks running as an unprivileged user.
- chief's host cut off (full mode, namespace SSH hosts): the same for the chief's host: a
  worker saves in its place.

Figures: faults injected and survived (the attempt a fault hit ended with the cause it should
have, or, for the controller, the run was taken over), steps redone per fault (the chief's last
step before the fault minus the step the next attempt resumed at), wall time against the
unbroken run (same pace, same CLI), and whether the final weights (every task's
`weights_sha256`) equal the unbroken run's. Goal: every fault survived, bit-identical, and at
most one step redone per crash.

    python benchmarks/chaos.py            # local processes, then namespace SSH hosts (root),
                                          # on TensorFlow, then on JAX
    python benchmarks/chaos.py --quick    # local processes only, TensorFlow only
    python benchmarks/chaos.py --backend jax   # Keras 3 on JAX only
    python benchmarks/chaos.py --seed 3   # another schedule
    python benchmarks/chaos.py --quick --faults "worker killed,preempted"   # a subset
    python benchmarks/chaos.py --warm-tasks   # relaunch from warm tasks (cold by default)
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import REPO, describe_machine, note, parser, publish, temp_home
from jobs import LOCAL, PACED, PACED_JAX, Target, digits_spec, namespace_lab, write_spec

from orchestrator import spec as specs
from orchestrator.events import Event, parse_line
from orchestrator.state import RunRecord, Store

WORKERS, EPOCHS, STEPS_PER_EPOCH, EVERY = 2, 6, 20, 5
TOTAL_STEPS = EPOCHS * STEPS_PER_EPOCH
# The last steps go unpaced, through no Python at all (PACE_UNTIL_BATCH; see
# tests/workloads/pace.py): once the fix for a hang at fit's end, when the runtime still
# destroyed fit's input iterator (it keeps it now: docs/ARCHITECTURE.md, test workloads).
UNPACED_LAST = 5
PACE_S = "0.1"
GAP = (6, 12)  # steps after a recovery's first step before the next fault
CHIEF = "worker:0"
CRASHES = ("worker killed", "chief killed")  # the goal's "at most one step redone per crash"
LOCAL_FAULTS = ("worker killed", "chief killed", "task hung", "preempted", "controller killed",
                "disk full")
EXPECTED = {"worker killed": "crashed", "chief killed": "crashed", "task hung": "hung",
            "preempted": "preempted", "disk full": "crashed", "host cut off": "host_lost",
            "chief's host cut off": "host_lost",
            "controller killed": None}  # None: no attempt ends
# What each backend's soak runs: its paced module, and what its job adds
BACKENDS: dict[str, tuple[str, dict[str, Any]]] = {
    "tensorflow": (PACED, {}), "jax": (PACED_JAX, {"backend": "jax"})}
OUTAGE_S = 5.0
TMPFS_SIZE = "32m"
POLL_S = 0.1
RUN_TIMEOUT_S = 600.0
SETTINGS: dict[str, Any] = {
    "job": {"deterministic": True, "seed": 7},
    "retry": {"max_restarts": 10, "backoff_initial_s": 0.2, "backoff_max_s": 1},
    "timeouts": {"stop_grace_s": 5, "poll_s": 3, "hang_s": 6, "startup_s": 120,
                 "repair_s": 60},
    # the pace (and its py_function) ends before the last steps; see UNPACED_LAST
    "env": {"DIGITS_PACE_S": PACE_S, "PACE_UNTIL_BATCH": str(TOTAL_STEPS - UNPACED_LAST)},
}


def soak_spec(directory: Path, name: str, target: Target, checkpoint_dir: str | None,
              user: str | None = None, backend: str = "tensorflow") -> Path:
    """The paced, deterministic job on ``backend``; on lab hosts, logged in as ``user`` on
    every host."""
    module, job = BACKENDS[backend]
    spec = digits_spec(name, WORKERS, target, epochs=EPOCHS, steps_per_epoch=STEPS_PER_EPOCH,
                       checkpoint_every=EVERY, module=module,
                       **{k: v for k, v in SETTINGS.items() if k != "job"})
    spec["job"].update({**SETTINGS["job"], **job})
    if checkpoint_dir is not None:
        spec["checkpoint"]["dir"] = checkpoint_dir
    for entry in spec.get("provider", {}).get("hosts", []) if user else []:
        entry["user"] = user
    return write_spec(directory, spec)


def schedule(faults: tuple[str, ...], seed: int) -> list[tuple[str, int, str]]:
    """(fault, steps after the previous recovery, the task it hits), in a seeded order."""
    rng = random.Random(seed)
    order = rng.sample(list(faults), len(faults))
    tasks = [f"worker:{i}" for i in range(WORKERS)]
    return [(fault, rng.randint(*GAP),
             CHIEF if fault in ("chief killed", "chief's host cut off")
             else rng.choice(tasks[1:]) if fault in ("worker killed", "host cut off")
             else rng.choice(tasks))
            for fault in order]


@dataclass
class Injected:
    fault: str
    task: str
    attempt: int  # the attempt it hit
    step: int  # the chief's last step when it fired
    at: float
    cause: str | None = None
    steps_redone: int | None = None
    recorded_steps_lost: int | None = None  # what the supervisor recorded
    recovery_s: float | None = None  # the supervisor's: failure to the next first step
    detail: str = ""  # the attempt's recorded reason
    snapshot_step: int | None = None
    said_snapshot: bool = False  # train's output said "resumed from a survivor's snapshot"
    survived: bool = False
    why: str = ""

    def figures(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "at"}


@dataclass
class Logs:
    """Every task log of a run read as it grows: each attempt's chief steps and task pids."""

    offsets: dict[str, int] = field(default_factory=dict)
    pids: dict[tuple[int, str], int] = field(default_factory=dict)
    steps: dict[int, list[int]] = field(default_factory=dict)  # the chief's, per attempt
    finished: dict[str, str] = field(default_factory=dict)  # weights_sha256 by task (last attempt)
    checkpoint_dirs: set[str] = field(default_factory=set)  # the chief's, as it reported them

    def read(self, record: RunRecord) -> None:
        for attempt in record.attempts:
            for task in attempt.tasks:
                for event in self._new(task.log):
                    self._take(event)

    def _new(self, log: str) -> Iterator[Event]:
        try:
            with open(log, "rb") as f:
                f.seek(self.offsets.get(log, 0))
                data = f.read()
        except FileNotFoundError:
            return
        whole = data[: data.rfind(b"\n") + 1]
        self.offsets[log] = self.offsets.get(log, 0) + len(whole)
        for line in whole.decode(errors="replace").splitlines():
            event = parse_line(line)
            if event is not None:
                yield event

    def _take(self, event: Event) -> None:
        if event.kind == "started":
            self.pids[(event.attempt, event.task)] = int(event.get("pid"))
        elif event.kind == "progress" and event.task == CHIEF:
            self.steps.setdefault(event.attempt, []).append(int(event.get("step")))
        elif event.kind == "checkpoint":
            self.checkpoint_dirs.add(str(event.get("path")))
        elif event.kind == "finished":
            self.finished[event.task] = str(event.get("weights_sha256", ""))

    def last_step(self, attempt: int) -> int | None:
        steps = self.steps.get(attempt)
        return max(steps) if steps else None


def cli_train(spec: Path, output: Path, *flags: str) -> subprocess.Popen[bytes]:
    with output.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "train", str(spec),
                                 "--plain", "--no-doctor", *flags], cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def newest_run(store: Store, cluster: str) -> RunRecord | None:
    runs = store.runs(cluster)
    return runs[0] if runs else None


@dataclass
class Soak:
    """One run of the job under a schedule of faults, through the CLI."""

    spec: Path
    target: Target
    plan: list[tuple[str, int, str]]
    output: Path
    disk: Path | None = None  # the tmpfs at checkpoint.dir, for "disk full"
    logs: Logs = field(default_factory=Logs)
    injected: list[Injected] = field(default_factory=list)
    timers: list[threading.Timer] = field(default_factory=list)
    cleanups: list[Callable[[], None]] = field(default_factory=list)

    def run(self) -> tuple[RunRecord, float]:
        name = specs.load(self.spec).name
        store = Store()
        started = time.monotonic()
        controller = cli_train(self.spec, self.output)
        pending = list(self.plan)
        need = 1  # the next fault waits for this attempt (a new one after a restart)
        count_from: tuple[int, int] | None = None  # (attempt, the step its gap counts from)
        try:
            while True:
                if time.monotonic() - started > RUN_TIMEOUT_S:
                    raise RuntimeError(f"the soak ran past {RUN_TIMEOUT_S:.0f} s")
                ended = controller.poll() is not None  # before the store: it is final then
                record = newest_run(store, name)
                if record is not None:
                    self.logs.read(record)
                if ended:
                    if record is not None and record.status != "running":
                        break
                    raise RuntimeError(f"the controller exited {controller.returncode} with "
                                       f"the run {record.status if record else 'not made'}")
                if record is None or not record.attempts:
                    time.sleep(POLL_S)
                    continue
                attempt = record.attempts[-1].number
                steps = self.logs.steps.get(attempt)
                if steps and max(steps) >= TOTAL_STEPS - UNPACED_LAST:
                    release(record, self.logs.checkpoint_dirs)
                if steps and attempt >= need and pending \
                        and record.controller_pid == controller.pid:
                    if count_from is None or count_from[0] != attempt:
                        count_from = (attempt, min(steps))
                    fault, gap, task = pending[0]
                    if self._ready(fault, attempt, count_from[1] + gap):
                        pending.pop(0)
                        controller = self._fire(fault, task, record, controller)
                        if fault == "controller killed":  # the same attempt trains on
                            count_from = (attempt, self.logs.last_step(attempt) or 0)
                        else:
                            need, count_from = attempt + 1, None
                time.sleep(POLL_S)
        finally:
            for timer in self.timers:
                timer.cancel()
            for cleanup in self.cleanups:
                cleanup()
            if controller.poll() is None:
                controller.kill()
                controller.wait()
        wall = time.monotonic() - started
        record = newest_run(store, name)
        store.close()
        assert record is not None
        self.logs.read(record)
        if pending:
            seen = {a: (min(s), max(s), len(s)) for a, s in sorted(self.logs.steps.items())}
            raise RuntimeError(f"the run ended {record.status} before these faults fired: "
                               f"{pending}; the chief's steps seen, per attempt (first, last, "
                               f"lines): {seen}")
        self._judge(record)
        return record, wall

    def _ready(self, fault: str, attempt: int, at_step: int) -> bool:
        step = self.logs.last_step(attempt) or 0
        if step < at_step or not all((attempt, f"worker:{i}") in self.logs.pids
                                     for i in range(WORKERS)):
            return False
        # disk full: two steps before a save, so that the save itself finds the disk full; a
        # poll of the logs slower than a step (a loaded machine) may see no such step, so past
        # one interval at any step: the next save finds the disk full all the same
        return fault != "disk full" or step % EVERY == EVERY - 2 or step >= at_step + EVERY

    def _fire(self, fault: str, task: str, record: RunRecord,
              controller: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
        attempt = record.attempts[-1].number
        pid = self.logs.pids[(attempt, task)]
        step = self.logs.last_step(attempt) or 0
        note(f"{fault} ({task}) in attempt {attempt} at step {step}")
        self.injected.append(Injected(fault, task, attempt, step, time.time()))
        if fault in ("worker killed", "chief killed"):
            os.kill(pid, signal.SIGKILL)
        elif fault == "task hung":
            os.kill(pid, signal.SIGSTOP)
            self.cleanups.append(lambda: _signal(pid, signal.SIGCONT))
        elif fault == "preempted":
            os.kill(pid, signal.SIGTERM)
        elif fault == "controller killed":
            controller.kill()
            controller.wait()
            time.sleep(1.0)  # the tasks train on, with no controller
            controller = cli_train(self.spec, self.output, "--attach")
            self.injected[-1].why = f"attached as pid {controller.pid}"
        elif fault == "disk full":
            assert self.disk is not None
            ballast = fill(self.disk)
            self.cleanups.append(lambda: ballast.unlink(missing_ok=True))
            self._free_when_stopped(ballast, attempt)
        elif fault in ("host cut off", "chief's host cut off"):
            host = self.target.hosts[int(task.split(":")[1])]
            host.cut()
            self.cleanups.append(host.restore)
            self._later(OUTAGE_S, host.restore)
        return controller

    def _free_when_stopped(self, ballast: Path, attempt: int) -> None:
        """Free the disk once the attempt the fault hit has ended (or 30 s on)."""
        name = specs.load(self.spec).name

        def wait() -> None:
            store = Store()
            deadline = time.monotonic() + 30
            try:
                while time.monotonic() < deadline:
                    record = newest_run(store, name)
                    if record is None or record.status != "running" \
                            or record.attempts[-1].number > attempt:
                        break
                    time.sleep(POLL_S)
            finally:
                store.close()
                ballast.unlink(missing_ok=True)

        thread = threading.Thread(target=wait, daemon=True)
        thread.start()
        self.cleanups.append(thread.join)

    def _later(self, seconds: float, action: Callable[[], None]) -> None:
        timer = threading.Timer(seconds, action)
        timer.start()
        self.timers.append(timer)

    def _judge(self, record: RunRecord) -> None:
        """What became of each fault, from the attempt records."""
        by_number = {a.number: a for a in record.attempts}
        output = self.output.read_text(errors="replace").splitlines()
        for fault in self.injected:
            hit = by_number[fault.attempt]
            expected = EXPECTED[fault.fault]
            if expected is None:  # the controller: no attempt may end for it
                fault.cause = None
                took_over = any(
                    f"attached to attempt {fault.attempt} of run {record.id}" in line
                    for line in output)
                fault.steps_redone = 0
                fault.survived = took_over and record.status == "succeeded"
                fault.why = fault.why if fault.survived else "no 'attached to attempt' line"
                continue
            fault.cause = hit.cause
            following = by_number.get(fault.attempt + 1)
            last = self.logs.last_step(fault.attempt)
            if following is not None and following.resumed_from_step is not None \
                    and last is not None:
                # max: a planned stop saves at the step under way, one the chief may not have
                # printed yet (it resumes one past its last progress line)
                fault.steps_redone = max(0, last - following.resumed_from_step)
            fault.recorded_steps_lost, fault.recovery_s = hit.steps_lost, hit.recovery_s
            fault.detail = hit.detail[:300]
            fault.snapshot_step = hit.snapshot_step
            fault.said_snapshot = hit.snapshot_step is not None and any(
                f"resumed from a survivor's snapshot at step {hit.snapshot_step}," in line
                for line in output)
            fault.survived = hit.cause == expected and following is not None \
                and record.status == "succeeded"
            if not fault.survived:
                fault.why = f"the attempt ended {hit.cause!r} ({hit.detail[:200]}), " \
                            f"expected {expected!r}"
            elif hit.snapshot:
                fault.why = hit.snapshot[:200]


def release(record: RunRecord, checkpoint_dirs: set[str]) -> None:
    """Let the paced job run at full speed: a ``release`` file where tests/workloads/pace.py
    looks, beside the checkpoint directory (the run's directory on each host's disk, or the
    run's parent on shared storage)."""
    for log in {t.log for a in record.attempts for t in a.tasks}:
        with contextlib.suppress(OSError):
            (Path(log).parents[2] / "release").touch()  # RUN/logs/attempt-N/TASK.log
    for chief in checkpoint_dirs:  # CHECKPOINT_DIR/chief
        with contextlib.suppress(OSError):
            (Path(chief).parent.parent / "release").touch()


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def fill(directory: Path) -> Path:
    """A file that takes every free byte of ``directory``'s file system."""
    ballast = directory / "ballast"
    chunk = b"\0" * (1 << 20)
    with ballast.open("wb") as f:
        try:
            while True:
                f.write(chunk)
                f.flush()
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
    return ballast


@contextlib.contextmanager
def small_disk(directory: Path) -> Iterator[Path | None]:
    """A tmpfs of TMPFS_SIZE mounted at ``directory``, or None where mounting is refused."""
    directory.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE},mode=1777",
                              "tmpfs", str(directory)], capture_output=True, text=True)
    if mounted.returncode != 0:
        note(f"disk full skipped: mount tmpfs: {mounted.stderr.strip()}")
        yield None
        return
    try:
        yield directory
    finally:
        subprocess.run(["umount", str(directory)], capture_output=True)


def soak(directory: Path, target: Target, faults: tuple[str, ...], seed: int,
         label: str, user: str | None = None, backend: str = "tensorflow") -> dict[str, Any]:
    """The unbroken run, then the same job under the schedule, on ``backend``; the figures of
    both."""
    requested = faults
    with small_disk(directory / f"{label}-disk") if "disk full" in faults \
            else contextlib.nullcontext(None) as disk:
        if disk is None:  # not root: no tmpfs to fill
            faults = tuple(f for f in faults if f != "disk full")
        checkpoint_dir = str(disk) if disk is not None else None
        reference = Soak(soak_spec(directory, f"chaos-{label}-a", target, checkpoint_dir, user,
                                   backend), target, [], directory / f"{label}-unbroken.out")
        unbroken, unbroken_s = reference.run()
        plan = schedule(faults, seed)
        broken = Soak(soak_spec(directory, f"chaos-{label}-b", target, checkpoint_dir, user,
                                backend), target, plan, directory / f"{label}-soak.out", disk)
        record, wall = broken.run()
    crashes = [f.steps_redone for f in broken.injected if f.fault in CRASHES]
    survived = sum(f.survived for f in broken.injected)
    digests = set(broken.logs.finished.values())
    identical = len(digests) == 1 and digests == set(reference.logs.finished.values())
    return {
        "target": target.name, "backend": backend, "workers": WORKERS, "seed": seed,
        "steps": TOTAL_STEPS, "unpaced_last": UNPACED_LAST, "checkpoint_every": EVERY,
        "pace_s": float(PACE_S),
        "schedule": [[f, gap, task] for f, gap, task in plan],
        "faults": [f.figures() for f in broken.injected],
        "injected": len(broken.injected), "survived": survived,
        "status": record.status, "attempts": len(record.attempts),
        "attempt_ends": [[a.number, a.status, a.cause, a.detail[:300]] for a in record.attempts],
        "unbroken_status": unbroken.status,
        "steps_redone_total": sum(f.steps_redone or 0 for f in broken.injected),
        "max_redone_per_crash": max((c for c in crashes if c is not None), default=None),
        "wall_s": round(wall, 2), "unbroken_wall_s": round(unbroken_s, 2),
        "wall_ratio": round(wall / unbroken_s, 2),
        "bit_identical": identical, "digests": sorted(digests),
        "goal_met": survived == len(broken.injected) and identical
        and all(c is not None and c <= 1 for c in crashes),
        "skipped": [f for f in requested if f not in faults],
    }


def main() -> None:
    cli = parser(__doc__, full_repeats=1)
    cli.add_argument("--seed", type=int, default=1, help="the fault schedule's seed")
    cli.add_argument("--faults", help="a comma-separated subset of the fault classes")
    cli.add_argument("--warm-tasks", action="store_true",
                     help="relaunch from warm tasks (retry.warm_tasks: true)")
    cli.add_argument("--backend", choices=[*BACKENDS, "both"],
                     help="the job's backend (default: both, one after the other; with "
                          "--quick, tensorflow)")
    args = cli.parse_args()
    if args.warm_tasks:
        SETTINGS["retry"]["warm_tasks"] = True
    chosen = [f.strip() for f in args.faults.split(",")] if args.faults else list(EXPECTED)
    unknown = sorted(set(chosen) - set(EXPECTED))
    if unknown:
        cli.error(f"unknown fault class(es) {unknown}: choose from {sorted(EXPECTED)}")
    backend = args.backend or ("tensorflow" if args.quick else "both")
    backends = list(BACKENDS) if backend == "both" else [backend]
    host, started = describe_machine(), time.monotonic()
    results: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    with temp_home("chaos"), tempfile.TemporaryDirectory(prefix="orchestrate-chaos-") as scratch:
        directory = Path(scratch)
        local_faults = tuple(f for f in LOCAL_FAULTS if f in chosen)
        ssh_faults = tuple(f for f in (*LOCAL_FAULTS, "host cut off", "chief's host cut off")
                           if f != "disk full" and f in chosen)
        for name in backends:
            label = "local" if name == "tensorflow" else f"{name}-local"
            results.append(soak(directory, LOCAL, local_faults, args.seed, label,
                                backend=name))
        if args.quick:
            skipped["namespace SSH hosts"] = "--quick soaks local processes only"
        else:
            with namespace_lab(WORKERS) as (lab, reason):
                if lab is None:
                    skipped["namespace SSH hosts"] = reason
                else:
                    target = Target("namespaces", lab, tuple(lab.hosts(WORKERS)))
                    for name in backends:
                        label = "ssh" if name == "tensorflow" else f"{name}-ssh"
                        results.append(soak(directory, target, ssh_faults, args.seed, label,
                                            lab.plain_user(), backend=name))
    rows = [[r["target"], r["backend"], f"{r['survived']}/{r['injected']}", r["attempts"],
             " ".join(f"{f['fault'].split()[0]}:{f['steps_redone']}" for f in r["faults"]),
             r["max_redone_per_crash"], f"{r['wall_s']}s / {r['unbroken_wall_s']}s",
             r["wall_ratio"], "yes" if r["bit_identical"] else "NO",
             "yes" if r["goal_met"] else "no"] for r in results]
    rows += [[name, "", "skipped", why, "", "", "", "", "", ""] for name, why in skipped.items()]
    publish("chaos", args, host, started,
            {"goal": "every fault survived, bit-identical to the unbroken run, at most one "
                     "step redone per crash",
             "results": results, "skipped": skipped},
            ["target", "backend", "survived", "attempts", "steps redone per fault", "max per crash",
             "wall (soak / unbroken)", "ratio", "bit-identical", "goal met"], rows)


if __name__ == "__main__":
    main()
