"""The run state machine: launch every task, watch events and exits, classify, restart the whole group.

MultiWorkerMirroredStrategy cannot re-admit one restarted task into a running
group, so any failure stops ALL tasks and relaunches ALL of them, and they
resume from the chief's latest checkpoint.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential_jitter,
)

from orchestrator import plan as planning
from orchestrator.checkpoints import fetch_file, share_chief_checkpoint
from orchestrator.errors import RunFailed
from orchestrator.events import Event, LineBuffer, parse_line
from orchestrator.hosts import Host
from orchestrator.plan import ClusterPlan, TaskPlan
from orchestrator.providers.base import Provider
from orchestrator.remote.base import LaunchSpec, TaskHandle, TaskState
from orchestrator.spec import ClusterSpec, CommandJob
from orchestrator.state import AttemptRecord, Store, home

# Errors a task raises because a PEER failed: the task that raised them is not the cause.
PEER_ERRORS = ("UnavailableError", "CancelledError", "AbortedError", "DeadlineExceededError")
PORT_CONFLICT_MARKS = ("Could not start gRPC server", "Address already in use")
STEP_EVENTS = ("training", "resumed", "progress")


class Cause(str, enum.Enum):
    CRASHED = "crashed"  # a task exited non-zero or was killed
    STARTUP_TIMEOUT = "startup_timeout"  # not every task reached its first step in time
    PORT_CONFLICT = "port_conflict"  # a task's gRPC port was taken
    USER_ERROR = "user_error"  # the user's code failed before training: not retried
    CANCELLED = "cancelled"  # Ctrl-C
    STOPPED = "stopped"  # 'orchestrate down' (maybe from another process) stopped the run


RETRYABLE = {Cause.CRASHED, Cause.STARTUP_TIMEOUT, Cause.PORT_CONFLICT}


class AttemptFailed(Exception):
    def __init__(self, cause: Cause, task: str, detail: str, exit_code: int | None = None) -> None:
        super().__init__(f"{cause.value}: {task}: {detail}")
        self.cause = cause
        self.task = task
        self.detail = detail
        self.exit_code = exit_code


@dataclass
class TaskView:
    """What the operator sees of one task; updated as events arrive."""

    key: str
    host: str
    endpoint: str
    state: str = "starting"
    step: int = 0
    loss: float | None = None
    steps_per_s: float | None = None
    last_event: str = ""
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class RunView:
    run_id: str
    cluster: str
    attempt: int = 0
    total_steps: int | None = None
    tasks: dict[str, TaskView] = field(default_factory=dict)
    messages: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class RunResult:
    run_id: str
    status: str
    metrics: dict[str, float]
    model_path: str
    digests: dict[str, str]
    attempts: list[AttemptRecord]
    seconds: float


Listener = Callable[[RunView, Event | None], None]


@dataclass
class _Watched:
    plan: TaskPlan
    handle: TaskHandle
    buffer: LineBuffer = field(default_factory=LineBuffer)
    offset: int = 0
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=30))
    error: Event | None = None
    finished: Event | None = None
    exit_code: int | None = None
    reached_step: bool = False


class Supervisor:
    """Runs one training run to completion, or to a RunFailed with a report."""

    def __init__(
        self,
        spec: ClusterSpec,
        provider: Provider,
        store: Store,
        *,
        workdir: Path,
        listener: Listener | None = None,
        backoff_sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        poll_s: float = 0.25,
    ) -> None:
        self.spec = spec
        self.provider = provider
        self.store = store
        self.workdir = workdir
        self.listener = listener or (lambda view, event: None)
        self.backoff_sleep = backoff_sleep
        self.clock = clock
        self.poll_s = poll_s
        self.view = RunView(run_id="", cluster=spec.name)
        self._chief_key = ""
        self._chief_host: Host | None = None
        self._first_progress: dict[str, float] = {}  # task -> wall time of its first step
        self._start_steps: dict[str, int] = {}  # task -> step it started (or resumed) at

    # -- the run -------------------------------------------------------------------------
    def run(self, run_id: str) -> RunResult:
        """Supervise run ``run_id`` (from ``Store.new_run``) until it succeeds or its budget is spent."""
        started = self.clock()
        self.view.run_id = run_id
        retry = self.spec.retry
        retrying = Retrying(
            stop=stop_after_attempt(retry.max_restarts + 1),
            wait=wait_exponential_jitter(multiplier=retry.backoff_initial_s, max=retry.backoff_max_s),
            retry=retry_if_exception(
                lambda e: isinstance(e, AttemptFailed) and e.cause in RETRYABLE
            ),
            sleep=self.backoff_sleep,
            before_sleep=self._before_sleep,
            reraise=True,
        )
        try:
            for attempt in retrying:
                with attempt:
                    finished = self._attempt(run_id, attempt.retry_state.attempt_number)
        except AttemptFailed as failure:
            if failure.cause is Cause.STOPPED:
                raise RunFailed(f"run {run_id} was stopped by 'orchestrate down'",
                                run_id=run_id) from None
            report = self.report(run_id, failure)
            self.store.finish_run(run_id, status="failed", message=report)
            raise RunFailed(report, run_id=run_id, fix=_advice(failure)) from None
        except KeyboardInterrupt:
            self.store.finish_run(run_id, status="cancelled", message="interrupted by the user")
            raise
        chief = finished[self._chief_key]
        metrics = dict(chief.get("metrics") or {})
        model_path = self._fetch_model(run_id, str(chief.get("model_path") or ""))
        self.store.finish_run(run_id, status="succeeded", metrics=metrics, model_path=model_path)
        return RunResult(
            run_id=run_id,
            status="succeeded",
            metrics=metrics,
            model_path=model_path,
            digests={k: str(e.get("weights_sha256", "")) for k, e in finished.items()},
            attempts=self.store.attempts(run_id),
            seconds=self.clock() - started,
        )

    def _before_sleep(self, state: RetryCallState) -> None:
        wait = state.next_action.sleep if state.next_action else 0.0
        self._say(f"restarting all tasks in {wait:.1f}s (attempt {state.attempt_number + 1})")

    # -- one attempt -----------------------------------------------------------------------
    def _attempt(self, run_id: str, number: int) -> dict[str, Event]:
        self._check_stopped(run_id)
        hosts = self.provider.hosts()
        plan = planning.build(
            self.spec,
            hosts,
            run_id=run_id,
            attempt=number,
            python=self.provider.python(hosts[0]),
            local_workdir=str(self.workdir),
            busy_ports=self.provider.busy_ports(hosts),
        )
        self._chief_key = plan.chief_key
        self._chief_host = plan.chief.host
        self._reset_view(plan)
        if number > 1:
            self._share_checkpoint(plan)
        watched = self._launch(plan)
        self.store.start_attempt(run_id, number, [_task_record(w) for w in watched])
        try:
            finished = self._watch(run_id, watched)
        except AttemptFailed as failure:
            self._stop_all(watched)
            status = "stopped" if failure.cause is Cause.STOPPED else "failed"
            self._end_attempt(run_id, number, watched, status, failure)
            raise
        except BaseException:
            self._stop_all(watched)
            cancelled = AttemptFailed(Cause.CANCELLED, "-", "interrupted")
            self._end_attempt(run_id, number, watched, "cancelled", cancelled)
            raise
        self._end_attempt(run_id, number, watched, "succeeded", None)
        return finished

    def _share_checkpoint(self, plan: ClusterPlan) -> None:
        others = {t.host.machine for t in plan.tasks} - {plan.chief.host.machine}
        if not others:
            return
        self._say(f"copying the chief's checkpoint to {len(others)} other host(s)")
        copied = share_chief_checkpoint(plan, self.provider.runner)
        self._say(f"copied the chief's checkpoint to {', '.join(copied)}" if copied
                  else "no checkpoint yet: the group starts from step 0")

    def _fetch_model(self, run_id: str, remote_path: str) -> str:
        """The chief's saved model, downloaded to this machine when the chief is remote."""
        chief = self._chief_host
        if not remote_path or chief is None or chief.is_local:
            return remote_path
        local_dir = home() / "clusters" / self.spec.name / "runs" / run_id / "model"
        path = fetch_file(chief, self.provider.runner(chief), remote_path, local_dir)
        self._say(f"fetched the model from {chief.name} to {path}")
        return path

    def _launch(self, plan: ClusterPlan) -> list[_Watched]:
        def start(task: TaskPlan) -> _Watched:
            runner = self.provider.runner(task.host)
            spec = LaunchSpec(task.argv, task.cwd, task.log_path, task.rc_path, task.env)
            return _Watched(task, runner.start(spec))

        with ThreadPoolExecutor(max_workers=min(32, len(plan.tasks))) as pool:
            watched = list(pool.map(start, plan.tasks))
        self._say(f"attempt {plan.attempt}: started {len(watched)} tasks")
        return watched

    def _check_stopped(self, run_id: str) -> None:
        if self.store.run_status(run_id) == "stopped":
            raise AttemptFailed(Cause.STOPPED, "-", "the run was stopped by 'orchestrate down'")

    def _watch(self, run_id: str, watched: list[_Watched]) -> dict[str, Event]:
        launched = self.clock()
        startup_s = self.spec.timeouts.startup_s
        while True:
            self._check_stopped(run_id)
            failures: list[AttemptFailed] = []
            for w in watched:
                self._drain(w)
                failure = self._check(w)
                if failure is not None:
                    failures.append(failure)
            if failures:
                self._check_stopped(run_id)  # tasks that down killed are not a failure
                raise _primary(failures)
            if all(w.exit_code == 0 for w in watched):
                return {w.plan.key: w.finished or _empty_finish(w) for w in watched}
            if self.clock() - launched > startup_s:
                late = [w.plan.key for w in watched if not w.reached_step]
                if late:
                    raise AttemptFailed(
                        Cause.STARTUP_TIMEOUT,
                        late[0],
                        f"{', '.join(late)} did not reach the first step within {startup_s:.0f}s"
                        " (a peer that never connected, or a slow start)",
                    )
            time.sleep(self.poll_s)

    def _drain(self, w: _Watched) -> None:
        runner = self.provider.runner(w.plan.host)
        data, w.offset = runner.read_log(w.handle, w.offset)
        for line in w.buffer.feed(data):
            event = parse_line(line)
            if event is None:
                if line.strip():
                    w.tail.append(line)
                continue
            self._on_event(w, event)

    def _on_event(self, w: _Watched, event: Event) -> None:
        view = self.view.tasks[w.plan.key]
        view.last_event = event.kind
        if event.kind in ("training", "resumed"):
            self._start_steps[w.plan.key] = int(event.get("step", 0))
        if event.kind == "progress":
            self._first_progress.setdefault(w.plan.key, time.time())
        if event.kind in STEP_EVENTS:
            w.reached_step = True
            view.state = "training"
            view.step = int(event.get("step", view.step))
            self.view.total_steps = event.get("total_steps", self.view.total_steps)
        if event.kind == "started" and isinstance(self.spec.job, CommandJob):
            w.reached_step = True  # command mode reports no steps: being up is all we see
            view.state = "running"
        if event.kind == "progress":
            view.loss = event.get("loss")
            view.steps_per_s = event.get("steps_per_s")
            view.metrics = dict(event.get("metrics") or {})
        elif event.kind == "error":
            w.error = event
            view.state = "error"
        elif event.kind == "finished":
            w.finished = event
            view.state = "finished"
            view.metrics = dict(event.get("metrics") or {})
        elif event.kind == "connected":
            view.state = "connected"
        self.listener(self.view, event)

    def _check(self, w: _Watched) -> AttemptFailed | None:
        if w.exit_code is not None:
            return None
        status = self.provider.runner(w.plan.host).poll(w.handle)
        if status.state is TaskState.RUNNING:
            return None
        self._drain(w)  # the last lines it wrote before ending
        if status.state is TaskState.LOST:
            w.exit_code = -1
            return AttemptFailed(
                Cause.CRASHED, w.plan.key, "its process group vanished without an exit code "
                "(killed as a whole, or its host lost it)"
            )
        w.exit_code = status.exit_code
        if w.exit_code == 0:
            return None
        self.view.tasks[w.plan.key].state = "failed"
        return self._classify(w)

    def _classify(self, w: _Watched) -> AttemptFailed:
        code = w.exit_code
        text = "\n".join(w.tail) + "\n" + str(w.error.get("message", "") if w.error else "")
        if any(mark in text for mark in PORT_CONFLICT_MARKS):
            return AttemptFailed(Cause.PORT_CONFLICT, w.plan.key,
                                 f"its gRPC port {w.plan.port} was taken", code)
        if w.error is not None:
            kind, message = str(w.error.get("type", "")), str(w.error.get("message", ""))
            detail = f"{kind.rsplit('.', 1)[-1]}: {message}".strip()
            if w.error.get("phase") == "build" and not kind.endswith(PEER_ERRORS):
                return AttemptFailed(Cause.USER_ERROR, w.plan.key, detail, code)
            return AttemptFailed(Cause.CRASHED, w.plan.key, f"exited {code}: {detail}", code)
        if code is not None and code > 128:
            return AttemptFailed(Cause.CRASHED, w.plan.key,
                                 f"killed by signal {code - 128} (exit {code})", code)
        return AttemptFailed(Cause.CRASHED, w.plan.key, f"exited {code}", code)

    def _stop_all(self, watched: list[_Watched]) -> None:
        grace = self.spec.timeouts.stop_grace_s

        def stop(w: _Watched) -> None:
            self.provider.runner(w.plan.host).stop(w.handle, grace_s=grace)

        with ThreadPoolExecutor(max_workers=min(32, len(watched))) as pool:
            list(pool.map(stop, watched))
        for w in watched:
            self._drain(w)

    def _end_attempt(
        self, run_id: str, number: int, watched: list[_Watched], status: str,
        failure: AttemptFailed | None,
    ) -> None:
        chief = watched[0]
        first_steps = list(self._first_progress.values())
        self.store.update_attempt(
            run_id,
            number,
            status=status,
            ended_at=time.time(),
            cause=failure.cause.value if failure else "",
            detail=(failure.detail if failure else "")[:4000],
            failed_task=failure.task if failure else "",
            exit_code=failure.exit_code if failure else None,
            resumed_from_step=self._start_steps.get(chief.plan.key),
            last_step=max((self.view.tasks[w.plan.key].step for w in watched), default=0),
            first_step_at=min(first_steps) if first_steps else None,
            tasks=[_task_record(w) for w in watched],
        )
        if failure is not None:
            self._say(f"attempt {number} {status}: {failure.cause.value}: "
                      f"{failure.task}: {failure.detail}")

    # -- view --------------------------------------------------------------------------
    def _reset_view(self, plan: ClusterPlan) -> None:
        self.view.attempt = plan.attempt
        self.view.tasks = {
            t.key: TaskView(key=t.key, host=t.host.name, endpoint=t.endpoint) for t in plan.tasks
        }
        self._first_progress = {}
        self._start_steps = {}
        self.listener(self.view, None)

    def _say(self, message: str) -> None:
        self.view.messages.append(message)
        self.listener(self.view, None)

    def report(self, run_id: str, last: AttemptFailed) -> str:
        lines = [f"run {run_id} failed after {len(self.store.attempts(run_id))} attempt(s):"]
        for a in self.store.attempts(run_id):
            lines.append(f"  attempt {a.number}: {a.cause or a.status} in {a.failed_task}: "
                         f"{a.detail}")
        return "\n".join(lines)


def _primary(failures: list[AttemptFailed]) -> AttemptFailed:
    """The failure that caused the others: peers of a dead task fail with UnavailableError."""
    def secondary(f: AttemptFailed) -> bool:
        return any(name in f.detail for name in PEER_ERRORS)

    return sorted(failures, key=secondary)[0]


def _advice(failure: AttemptFailed) -> str:
    if failure.cause is Cause.USER_ERROR:
        return "fix the error in your training code above; it fails before training starts"
    if failure.cause is Cause.STARTUP_TIMEOUT:
        return "check that every host can reach every other host's port, or raise timeouts.startup_s"
    return (
        "read the task logs with 'orchestrate logs', then raise retry.max_restarts "
        "if the cause was transient"
    )


def _empty_finish(w: _Watched) -> Event:
    return Event("finished", w.plan.key, 0, 0.0, {})


def _task_record(w: _Watched) -> dict[str, object]:
    return {
        "task": w.plan.key,
        "host": w.plan.host.name,
        "endpoint": w.plan.endpoint,
        "pgid": w.handle.pgid,
        "log": w.plan.log_path,
        "rc": w.plan.rc_path,
        "exit_code": w.exit_code,
    }
