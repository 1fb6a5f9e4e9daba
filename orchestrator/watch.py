"""Watch one attempt: read every task's events, poll it, and say which failure ended it, and why.

Polls run on a thread pool so one host that stops answering cannot stall the others; a
poll that takes longer than ``timeouts.poll_s`` marks its host lost. A poll is one round trip
(``Launcher.poll_log``: the status, then the new log bytes). While a task's output keeps
coming, its polls read the log alone and skip the costly half of the status (whether its
process group lives): an exit is still seen at once by the exit code its wrapper records
(which every poll looks at), and a group that vanished without one by the first full poll
after its log went quiet (``POLL_QUIET_S``), or within ``STATUS_EVERY_S`` at most.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from orchestrator.causes import Cause
from orchestrator.errors import RemoteError
from orchestrator.events import BadEvent, Event, LineBuffer, read_line
from orchestrator.launchers import Launcher
from orchestrator.plan import TaskPlan
from orchestrator.remote.base import Runner, TaskHandle, TaskState, TaskStatus
from orchestrator.runtimes import runtime_for
from orchestrator.spec import ClusterSpec
from orchestrator.state import TaskRecord
from orchestrator.view import Listener, RunView, TaskView

# Errors a task raises because a PEER failed: the task that raised them is not the cause.
PEER_ERRORS = ("UnavailableError", "CancelledError", "AbortedError", "DeadlineExceededError",
               "CollectiveOpsError")
# (Gloo's "Connection closed by peer": a JAX task whose peer died, which since 504de70 exits at
# once, before the controller may have read the dead peer's own end.)
PEER_MARKS = (*PEER_ERRORS, "Connection reset by peer", "failed to connect to all addresses",
              "Socket closed", "Collective ops is aborted", "Connection closed by peer")
PORT_CONFLICT_MARKS = ("Could not start gRPC server", "Address already in use")
# What TensorFlow says when the tasks' collectives disagree: they restored different
# checkpoints (or none), so their ops, shapes or types differ at the first all-reduce.
MISMATCH = re.compile(r"Shape mismatch in the collective instance \d+|"
                      r"Collective instance \d+ expected [^\n]{0,200}but got [^\n]{0,200}")
# A task that reports no steps (command mode) and fails this soon after its start counts as
# failing before its first step: the same failure twice in a row is then not retried again.
EARLY_S = 120.0
STEP_EVENTS = ("training", "resumed", "progress")
SETTLE_S = 3.0  # how long peers' secondary errors wait for the primary failure to show
# A task whose last poll brought log bytes this recently is polled for its log alone (and the
# exit code its wrapper recorded); a quiet one is asked whether its process group lives, and
# so is every task at least every STATUS_EVERY_S (a group whose leftovers keep writing).
POLL_QUIET_S = 1.0
STATUS_EVERY_S = 5.0
WAITING_EVERY_S = 2.0  # how often a task not started yet is asked why (a scheduler's reason)
DRAIN_READS = 8  # polls' worth of log (POLL_LOG_MAX each) read after the tasks were stopped


class AttemptFailed(Exception):
    """Why an attempt ended, with the evidence a person needs to act on it."""

    def __init__(
        self, cause: Cause, task: str, detail: str, *, exit_code: int | None = None,
        evidence: str = "", failed_at: float | None = None, host: str | None = None,
        port: tuple[str, int] | None = None, before_first_step: bool = False,
        vanished: bool = False, connection_lost: bool = False, saved_step: int | None = None,
        fix: str = "",
    ) -> None:
        super().__init__(f"{cause.value}: {task}: {detail}")
        self.cause = cause
        self.task = task
        self.detail = detail
        self.exit_code = exit_code
        self.evidence = evidence
        self.failed_at = failed_at
        self.host = host  # the host to repair, for host_lost / preempted
        self.port = port  # the (address, port) to avoid, for port_conflict
        self.before_first_step = before_first_step
        self.vanished = vanished  # the task's process group was gone without an exit code
        self.connection_lost = connection_lost  # ... and the SSH connection dropped meanwhile
        # Every task saved a checkpoint at this step on a SIGTERM, then exited: a planned stop.
        self.saved_step = saved_step
        self.fix = fix  # what to do, where the failure itself knows (else the cause's advice)

    @property
    def signature(self) -> str:
        """Same code failing the same way gives the same signature, whichever task shows it."""
        last_lines = "\n".join(self.evidence.splitlines()[-3:])
        return f"{self.cause.value}|{self.detail[:200]}|{last_lines}"


@dataclass
class Watched:
    """One task of the attempt, as the controller knows it."""

    plan: TaskPlan
    handle: TaskHandle
    runner: Runner
    buffer: LineBuffer = field(default_factory=LineBuffer)
    offset: int = 0
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=40))
    error: Event | None = None
    finished: Event | None = None
    status: TaskStatus | None = None
    reached_step: bool = False
    step: int = 0
    start_step: int | None = None
    first_progress_at: float | None = None
    last_heard: float = field(default_factory=time.time)
    unreachable: str | None = None
    # The runner's drops when a poll last saw the task running. Only a status that says so
    # counts, never log bytes: bytes read over a connection made after a drop may have been
    # written before it (by a task whose machine rebooted since), so they prove nothing about
    # the task after the drop.
    drops_alive: int = -1
    pending: Future[Polled] | None = None
    pending_since: float = 0.0
    # When the newest poll that came back was sent: the host answered about the task after it.
    answered_at: float = field(default_factory=time.time)
    data_at: float = float("-inf")  # (monotonic) when a poll last brought log bytes
    status_at: float = float("-inf")  # (monotonic) when the last poll with a status was sent
    last_event: Event | None = None
    checkpoint_step: int | None = None
    stopped: Event | None = None  # the task saved at a step on a SIGTERM, and exits
    # After a peer's loss: the checkpoint it saved at its last completed step, or why it could
    # not (retry.snapshot_on_crash).
    snapshot: Event | None = None
    snapshot_refused: str = ""
    snapshotting: bool = False  # it said it began one
    snapshot_asked: bool = False  # the controller asked it to save one in the chief's place
    waiting: str = ""  # why it has not started yet, as its scheduler last said
    unplaced: str = ""  # an elastic group's: why no machine can take it, as last said

    def __post_init__(self) -> None:
        if self.drops_alive < 0:  # started (or found) running: as of now
            self.drops_alive = self.runner.drops

    @property
    def key(self) -> str:
        return self.plan.key

    @property
    def exit_code(self) -> int | None:
        return self.status.exit_code if self.status else None

    @property
    def ended(self) -> bool:
        return self.status is not None and self.status.state is not TaskState.RUNNING

    def record(self, launcher: Launcher) -> TaskRecord:
        """The task as the attempt's record keeps it, with the last event it printed."""
        event = self.last_event
        return dataclasses.replace(
            launcher.record(self.plan, self.handle), exit_code=self.exit_code,
            last_event=event.kind if event else "", last_event_at=event.time if event else None,
            step=self.step if self.reached_step else None, checkpoint_step=self.checkpoint_step)


@dataclass(frozen=True)
class Polled:
    """One poll of a task: its status (None when not asked and no exit code was recorded),
    then the log bytes from ``offset`` to ``next_offset``; ``capped``: more may follow.
    ``drops``: the runner's connection drops as the poll returned."""

    status: TaskStatus | None
    data: bytes
    offset: int
    next_offset: int
    capped: bool = False
    drops: int = 0


class AttemptWatch:
    """Runs the watch loop of one attempt until success (returns) or failure (raises)."""

    def __init__(
        self, spec: ClusterSpec, watched: list[Watched], view: RunView, listener: Listener,
        *, launcher: Launcher, on_tick: Callable[[], None],
        on_event: Callable[[Watched, Event], None], python_for: Callable[[Watched], str],
        interval_s: float = 0.25,
    ) -> None:
        self.spec = spec
        self.launcher = launcher
        self.watched = watched
        self.view = view
        self.listener = listener
        self.on_tick = on_tick
        self.on_event = on_event
        self.python_for = python_for
        self.interval_s = interval_s
        self.started = time.time()
        self._reports_steps = runtime_for(spec.job).reports_steps
        self._pool = ThreadPoolExecutor(max_workers=len(watched) + 2,
                                        thread_name_prefix="orchestrate-poll")
        self._first_failure_seen: float | None = None
        self._waiting_at = float("-inf")
        self._queued_at = float("-inf")  # when a task was last seen queued

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for runner in {id(w.runner): w.runner for w in self.watched}.values():
            runner.end_polls()  # a poll still in flight keeps its shell until the runner closes

    def run(self) -> dict[str, Event]:
        while True:
            self.on_tick()
            self._collect()
            failure = self._failure()
            if failure is not None:
                raise failure
            if all(w.ended and w.exit_code == 0 for w in self.watched):
                return {w.key: w.finished or Event("finished", w.key, 0, 0.0, {})
                        for w in self.watched}
            self._check_waiting()
            self._check_unplaced()
            self._check_startup()
            self._check_hang()
            time.sleep(self.interval_s)

    def wait_for(self, w: Watched, timeout_s: float, *,
                 until: Callable[[Watched], bool] = lambda w: False) -> None:
        """Go on polling until ``w`` has ended, or its host stops answering, or ``until(w)``,
        or ``timeout_s`` passed (the others are polled too: what they print is read as usual)."""
        deadline = time.monotonic() + timeout_s
        while not (w.ended or w.unreachable or until(w)) and time.monotonic() < deadline:
            self._collect()
            time.sleep(self.interval_s)

    def drain(self) -> None:
        """Read what every reachable task wrote last (after they were stopped): first the polls
        still in flight, then the rest of each log, so no line before a failure is lost."""
        for w in self.watched:
            if w.pending is not None and w.unreachable is None:
                with contextlib.suppress(RemoteError, FutureTimeout):
                    self._take(w, w.pending.result(timeout=self.spec.timeouts.poll_s))
            w.pending = None
            for _ in range(DRAIN_READS):
                if w.unreachable is not None:
                    break
                try:
                    polled = self._read(w)
                except RemoteError:
                    break
                self._take(w, polled)
                if not polled.capped:
                    break

    # -- polling ---------------------------------------------------------------------------
    def _io(self, w: Watched, offset: int, status: bool) -> Polled:
        """On a pool thread: one poll, the status (or without ``status`` only a recorded exit
        code), then the log after it (so nothing is missed)."""
        got = self.launcher.poll_log(w.runner, w.handle, offset, status=status)
        return Polled(got.status, got.data, offset, got.next_offset, got.capped, w.runner.drops)

    def _read(self, w: Watched) -> Polled:
        """The log alone (the tasks are stopped: how they ended is the stop's to say)."""
        got = self.launcher.poll_log(w.runner, w.handle, w.offset, status=False)
        return Polled(None, got.data, w.offset, got.next_offset, got.capped)

    def _take(self, w: Watched, polled: Polled) -> None:
        """Consume a poll: the log offset moves here, in the loop that feeds the data on.

        An end (exit code or vanished group) counts once the log is read to it: a poll that
        ended its read at the cap leaves the end for a later poll, which reports it again."""
        consumed = polled.offset == w.offset
        if consumed:
            w.offset = polled.next_offset
            if polled.data:
                w.data_at = time.monotonic()
            self._feed(w, polled.data)
        if polled.status is None:
            return
        if polled.status.state is TaskState.RUNNING:
            w.drops_alive = polled.drops
        elif consumed and not polled.capped:
            w.status = polled.status

    def _status_due(self, w: Watched) -> bool:
        """Whether the next poll asks if the task's group lives: not while its output keeps
        coming (``POLL_QUIET_S``), unless the last such poll is ``STATUS_EVERY_S`` old; and
        always once the connection dropped since the task was last seen running: bytes read
        over the new connection may have been written before its machine went away and came
        back, so they say nothing about whether the task outlived the drop."""
        now = time.monotonic()
        dropped = w.runner.drops > w.drops_alive
        if not dropped and now - w.data_at < POLL_QUIET_S and now - w.status_at < STATUS_EVERY_S:
            return False
        w.status_at = now
        return True

    def _collect(self) -> None:
        now = time.time()
        for w in self.watched:
            if w.ended or w.unreachable:
                continue
            if w.pending is None:
                w.pending = self._pool.submit(self._io, w, w.offset, self._status_due(w))
                w.pending_since = now
            if w.pending.done():
                try:
                    self._take(w, w.pending.result())
                    w.answered_at = w.pending_since
                except RemoteError as exc:
                    w.unreachable = str(exc).splitlines()[0]
                w.pending = None
            elif now - w.pending_since > self.spec.timeouts.poll_s:
                w.unreachable = f"did not answer a status poll for {self.spec.timeouts.poll_s:.0f}s"

    def _feed(self, w: Watched, data: bytes) -> None:
        if data:
            w.last_heard = time.time()
        for line in w.buffer.feed(data):
            event = read_line(line)
            if isinstance(event, BadEvent):  # output, and a note once per kind of mistake
                w.tail.append(line[:2000])
                note = self.view.bad_events.note(w.key, event)
                if note is not None:
                    self.view.messages.append(note)
                    self.listener(self.view, None)
                continue
            if event is None:
                if line.strip():
                    w.tail.append(line)
                continue
            self._on_event(w, event)

    def _on_event(self, w: Watched, event: Event) -> None:
        view = self.view.tasks[w.key]
        view.last_event = event.kind
        w.last_event = event
        if event.kind == "checkpoint":
            w.checkpoint_step = int(event.get("step", 0))
            if event.get("reason") == "snapshot":
                w.snapshot = event
        if event.kind == "snapshot_started":
            w.snapshotting = True
        if event.kind == "snapshot_failed":
            w.snapshot_refused = str(event.get("reason", ""))[:1000]
        if event.kind in ("training", "resumed"):
            w.start_step = int(event.get("step", 0))
        if event.kind in STEP_EVENTS:
            w.reached_step = True
            w.step = max(w.step, int(event.get("step", 0)))
            view.state, view.step = "training", w.step
            self.view.total_steps = event.get("total_steps", self.view.total_steps)
        if event.kind == "started" and not self._reports_steps:
            w.reached_step = True  # command mode reports no steps: being up is all we see
            view.state = "running"
        if event.kind == "progress":
            if w.first_progress_at is None:
                w.first_progress_at = time.time()
            view.loss = event.get("loss")
            view.steps_per_s = event.get("steps_per_s")
            view.metrics = dict(event.get("metrics") or {})
        elif event.kind == "error":
            w.error = event
            view.state = "error"
        elif event.kind == "finished":
            w.finished = event
            view.state = "finished"
            view.metrics = dict(event.get("metrics") or {}) or view.metrics
        elif event.kind == "connected":
            view.state = "connected"
            self._connected(view, event)
        elif event.kind == "built":
            self.view.global_batch_size = event.get("global_batch_size")
            self.view.learning_rate = event.get("learning_rate")
        elif event.kind == "stopped":
            w.stopped = event  # it trained up to the step it saved at (maybe unreported)
            w.step = max(w.step, int(event.get("step", 0)))
            view.state = "stopped"
        self.on_event(w, event)
        self.listener(self.view, event)

    def _connected(self, view: TaskView, event: Event) -> None:
        """The replicas the task really runs (one per GPU it uses); fields an older worker
        does not send stay as they were."""
        local = event.get("local_replicas")
        view.replicas = int(local) if local is not None else None
        if event.get("replicas") is not None:
            self.view.replicas = int(event.get("replicas"))
        self.view.collectives = event.get("collectives", self.view.collectives)

    # -- deciding --------------------------------------------------------------------------
    def _failure(self) -> AttemptFailed | None:
        failures = [f for f in map(self._task_failure, self.watched) if f is not None]
        if not failures:
            return None
        primary = [f for f in failures if not _secondary(f) and f.saved_step is None]
        if primary:
            return sorted(primary, key=_rank)[0]
        now = time.time()
        self._first_failure_seen = self._first_failure_seen or now
        running = [w for w in self.watched if not w.ended]
        saved = [f for f in failures if f.saved_step is not None]
        if saved:  # the others save at the same step and exit within moments: name who got TERM
            if running and now - self._first_failure_seen < SETTLE_S:
                return None
            return self._saved_stop(saved[0])
        if now - self._first_failure_seen < SETTLE_S and running:
            return None  # peers fail within seconds of the real failure: let it show first
        if self._unanswered(running, now):
            return None
        return self._stuck_failure(running, failures[0]) or failures[0]

    def _unanswered(self, running: list[Watched], now: float) -> bool:
        """Whether a running task's host has not answered a poll sent since the peers' failure
        was seen. Its poll may be reconnecting to a machine that went away: the answer (the
        group vanished over a dropped connection, or none within ``poll_s``, so unreachable)
        names the primary failure. Probing now could land after the machine is back, find
        nothing stuck, and blame the peer."""
        assert self._first_failure_seen is not None
        if now - self._first_failure_seen >= SETTLE_S + self.spec.timeouts.poll_s:
            return False
        return any(w.answered_at < self._first_failure_seen for w in running
                   if w.unreachable is None)

    def _stuck_failure(self, running: list[Watched], peer: AttemptFailed) -> AttemptFailed | None:
        """Peers failed (e.g. TF's heartbeat timeout) because a task still 'running' is stuck."""
        if not running:
            return None
        stuck = self._stuck()
        if not stuck:
            return None
        w = self._by_key(stuck[0])
        lost = stuck[0] in self._lost_keys()
        return AttemptFailed(
            Cause.HOST_LOST if lost else Cause.HUNG, w.key,
            f"its peers failed ({peer.task}: {peer.detail[:200]})" + self._stuck_text(stuck),
            evidence=self._evidence(w), failed_at=w.last_heard, host=w.plan.host.name,
            before_first_step=not w.reached_step,
        )

    def _task_failure(self, w: Watched) -> AttemptFailed | None:
        if w.unreachable is not None:
            self.view.tasks[w.key].state = "lost"
            return AttemptFailed(
                Cause.HOST_LOST, w.key, f"host {w.plan.host.name} ({w.plan.host.address}) "
                f"{w.unreachable}", evidence=self._evidence(w), failed_at=w.last_heard,
                host=w.plan.host.name, before_first_step=not w.reached_step)
        if not w.ended or (w.exit_code == 0 and (w.finished is not None or w.last_event is None)):
            return None
        self.view.tasks[w.key].state = "failed"
        ended_at = min((w.status.ended_at if w.status else None) or time.time(), time.time())
        early = not w.reached_step or (not self._reports_steps and
                                       ended_at - self.started < EARLY_S)
        make = functools.partial(AttemptFailed, evidence=self._evidence(w), failed_at=ended_at,
                                 before_first_step=early, exit_code=w.exit_code)
        if w.stopped is not None:
            step = int(w.stopped.get("step", 0))
            return make(Cause.PREEMPTED, w.key, f"saved a checkpoint at step {step} on SIGTERM",
                        saved_step=step, host=w.plan.host.name)
        if w.status is not None and w.status.state is TaskState.LOST:
            return make(Cause.CRASHED, w.key, "its process group vanished without an exit code "
                        "(killed as a whole)", vanished=True, host=w.plan.host.name,
                        connection_lost=w.runner.drops > w.drops_alive)
        engine = None if w.last_event is not None else self.launcher.engine_failure(
            w.plan.host, w.exit_code, "\n".join(w.tail))
        if engine is not None:
            return make(Cause.ENGINE_ERROR, w.key, f"{w.plan.host.name}: the container engine "
                        f"could not start the task: {engine.line}",
                        host=w.plan.host.name, fix=engine.fix)
        if w.exit_code == 0:  # e.g. Slurm's srun, which says 0 for a task whose node failed
            return make(Cause.CRASHED, w.key, "exited 0 without the worker reporting the end of "
                        "its training (its launcher said 0 for a task that did not finish)",
                        host=w.plan.host.name)
        return _classify(w, make)

    def _saved_stop(self, first: AttemptFailed) -> AttemptFailed:
        """Every task saved at one step because one got SIGTERM (from outside the controller:
        a spot VM's shutdown, a maintenance event, a person): blame that one."""
        signalled = [w for w in self.watched
                     if w.stopped is not None and w.stopped.get("signal") == "SIGTERM"]
        w = signalled[0] if signalled else self._by_key(first.task)
        saved = sorted({int(x.stopped.get("step", 0)) for x in self.watched if x.stopped})
        who = f"{w.key} on {w.plan.host.name} got SIGTERM" if signalled else \
            "a task got SIGTERM"
        return AttemptFailed(
            Cause.PREEMPTED, w.key,
            f"{who} (a spot VM's shutdown, a maintenance event, or a stop from outside); "
            f"every task saved a checkpoint at step {'/'.join(map(str, saved))} and exited",
            exit_code=w.exit_code, evidence=self._evidence(w), failed_at=first.failed_at,
            host=w.plan.host.name, saved_step=saved[-1] if saved else first.saved_step)

    def _check_waiting(self) -> None:
        """Every ``WAITING_EVERY_S``, ask why the tasks not started yet wait (a scheduler's
        reason); a new reason goes to the run's messages and the task's view."""
        now = time.monotonic()
        if now - self._waiting_at < WAITING_EVERY_S:
            return
        self._waiting_at = now
        for w in self.watched:
            if w.reached_step or w.ended or w.unreachable is not None:
                continue
            try:
                queued = self.launcher.queued(w.runner, w.handle)
                reason = queued or self.launcher.waiting(w.runner, w.handle) or ""
                if self.spec.elastic is not None:
                    w.unplaced = self.launcher.unplaced(w.runner, w.handle) or ""
            except RemoteError:
                continue
            if queued:  # the startup clock starts once the group leaves the queue
                self._queued_at = time.time()
            if reason == w.waiting:
                continue
            w.waiting = reason
            task = self.view.tasks.get(w.key)
            if task is not None:
                task.waiting = reason
                task.state = "waiting" if reason else "starting"
            if reason:
                self.view.messages.append(f"{w.key} is waiting: {reason}")
            self.listener(self.view, None)

    def _starting_for(self) -> float:
        """Seconds on the start's clock (timeouts.startup_s): since the attempt started, or
        since a task was last seen queued (a scheduler's wait does not count)."""
        return time.time() - max(self.started, self._queued_at)

    def _check_unplaced(self) -> None:
        """An elastic group's task that no machine can take (a pod no node has room for, as
        its scheduler says) once the attempt has waited ``timeouts.repair_s`` (or
        ``startup_s``, if sooner) since it left any queue: its machine is lost, and the
        provider's repair says whether the group goes on without it."""
        if self.spec.elastic is None:
            return
        timeouts = self.spec.timeouts
        limit, which = min((timeouts.repair_s, "repair_s"), (timeouts.startup_s, "startup_s"))
        if self._starting_for() <= limit:
            return
        for w in self.watched:
            if w.unplaced and not w.reached_step and not w.ended:
                raise AttemptFailed(
                    Cause.HOST_LOST, w.key,
                    f"no machine could take {w.key} within {limit:.0f}s (timeouts.{which}): "
                    f"{w.unplaced}"[:2000], evidence=self._evidence(w), failed_at=self.started,
                    before_first_step=True, host=w.plan.host.name)

    def _check_startup(self) -> None:
        late = [w.key for w in self.watched if not w.reached_step]
        if late and self._starting_for() > self.spec.timeouts.startup_s:
            stuck = self._stuck()
            culprit = stuck[0] if stuck else late[0]
            raise AttemptFailed(
                Cause.HOST_LOST if culprit in self._lost_keys() else Cause.STARTUP_TIMEOUT,
                culprit,
                f"{', '.join(late)} did not reach the first step within "
                f"{self.spec.timeouts.startup_s:.0f}s" + self._stuck_text(stuck)
                + "".join(f"; {w.key} was waiting: {w.waiting}" for w in self.watched
                          if w.waiting and not w.reached_step)[:1500],
                evidence=self._evidence(self._by_key(culprit)), failed_at=self.started,
                before_first_step=True, host=self._by_key(culprit).plan.host.name,
            )

    def _check_hang(self) -> None:
        """No task heard from for ``timeouts.hang_s``. Until every task has reported a
        completed step, the start's budget holds as well (``timeouts.startup_s`` from the
        attempt's start): the first step compiles (XLA, tf.function's trace) and opens the
        collectives' connections after the task said it was training. Measured on 2 loaded
        cores: 7.8 s from a JAX task's 'resumed' to its first step (1.3 s idle), where the
        benchmarks' hang_s is 10 s."""
        if not all(w.reached_step for w in self.watched):
            return
        heard = max(w.last_heard for w in self.watched if not w.ended)
        now = time.time()
        if now - heard <= self.spec.timeouts.hang_s:
            return
        if self._reports_steps and any(w.first_progress_at is None
                                       for w in self.watched if not w.ended) and \
                self._starting_for() <= self.spec.timeouts.startup_s:
            return
        stuck = self._stuck()
        culprit = stuck[0] if stuck else min(self.watched, key=lambda w: w.last_heard).key
        w = self._by_key(culprit)
        raise AttemptFailed(
            Cause.HOST_LOST if culprit in self._lost_keys() else Cause.HUNG, culprit,
            f"no task reported progress for {self.spec.timeouts.hang_s:.0f}s (last step "
            f"{max(x.step for x in self.watched)})" + self._stuck_text(stuck),
            evidence=self._evidence(w), failed_at=heard, host=w.plan.host.name,
        )

    def _stuck(self) -> list[str]:
        """Tasks whose processes are stopped (SIGSTOP) or whose host does not answer."""
        def state(w: Watched) -> str:
            try:
                return self.launcher.process_states(w.runner, w.handle, self.python_for(w),
                                                    self.spec.timeouts.poll_s)
            except RemoteError as exc:
                w.unreachable = w.unreachable or str(exc).splitlines()[0]
                return "?"

        states = dict(zip((w.key for w in self.watched),
                          self._pool.map(state, self.watched), strict=True))
        self._states = states
        return [k for k, s in states.items() if "T" in s or s == "?"]

    def _lost_keys(self) -> set[str]:
        return {w.key for w in self.watched if w.unreachable}

    def _stuck_text(self, stuck: list[str]) -> str:
        if not stuck:
            return ""
        parts = [f"{k} is unreachable" if self._states.get(k) == "?" else f"{k} is stopped "
                 "(state T: SIGSTOP, or a debugger)" for k in stuck]
        return "; " + "; ".join(parts)

    def _by_key(self, key: str) -> Watched:
        return next(w for w in self.watched if w.key == key)

    @staticmethod
    def _evidence(w: Watched) -> str:
        lines = list(w.tail)[-15:]
        if w.error is not None and w.error.get("traceback"):
            lines += ["--- traceback (tail) ---", *str(w.error.get("traceback")).splitlines()[-12:]]
        return "\n".join(lines)


DISK_FULL = "No space left on device"  # strerror(ENOSPC), in TensorFlow's errors as in Python's


def _classify(w: Watched, make: Callable[..., AttemptFailed]) -> AttemptFailed:
    code = w.exit_code
    message = str(w.error.get("message", "")) if w.error else ""
    text = "\n".join(w.tail) + "\n" + message
    mismatch = MISMATCH.search(text)
    if mismatch:
        return make(Cause.CHECKPOINT_MISMATCH, w.key,
                    f"the tasks restored different checkpoints (TensorFlow: {mismatch.group(0)})")
    if w.error is not None and w.error.get("phase") == "storage":
        return make(Cause.USER_ERROR, w.key, message[:2000], fix=str(w.error.get("fix") or ""))
    if DISK_FULL in text:  # a failure of its own: the job's code is not to blame
        where = w.plan.env.get("ORCHESTRATE_CHECKPOINT_DIR", "")
        return make(Cause.CRASHED, w.key,
                    f"the disk is full on {w.plan.host.name} ({DISK_FULL}; exit {code})",
                    fix=f"free space on {w.plan.host.name}'s disk (its checkpoints are in "
                        f"{where}), or set checkpoint.dir to storage with room; the next "
                        "attempt resumes from the last checkpoint that was written whole")
    if any(mark in text for mark in PORT_CONFLICT_MARKS):
        return make(Cause.PORT_CONFLICT, w.key,
                    f"its gRPC port {w.plan.port} on {w.plan.host.address} was taken",
                    port=(w.plan.host.address, w.plan.port))
    if w.error is not None:
        kind = str(w.error.get("type", "")).rsplit(".", 1)[-1]
        first_line = message.splitlines()[0] if message else ""
        if w.error.get("phase") == "build" and not kind.endswith(PEER_ERRORS):
            return make(Cause.USER_ERROR, w.key, f"{kind}: {message}"[:2000])
        return make(Cause.CRASHED, w.key, f"exited {code}: {kind}: {first_line}".strip())
    if code is not None and code > 128:
        return make(Cause.CRASHED, w.key, f"killed by signal {code - 128} (exit {code})")
    return make(Cause.CRASHED, w.key, f"exited {code}")


def _secondary(failure: AttemptFailed) -> bool:
    """A peer's error: it failed because another task (or host) went away first."""
    return failure.cause is Cause.CRASHED and any(
        mark in failure.detail or mark in failure.evidence for mark in PEER_MARKS)


def _rank(failure: AttemptFailed) -> int:
    order = [Cause.HOST_LOST, Cause.CHECKPOINT_MISMATCH, Cause.ENGINE_ERROR, Cause.USER_ERROR,
             Cause.PORT_CONFLICT, Cause.CRASHED]
    if failure.vanished and failure.connection_lost:
        return 0  # its machine went away (the supervisor confirms it): first, as a lost host
    return order.index(failure.cause) if failure.cause in order else len(order)
