"""The run state machine: launch every task, watch, classify, stop all, repair, restore, relaunch all.

MultiWorkerMirroredStrategy cannot re-admit one restarted task into a running group, so any
failure stops ALL tasks and relaunches ALL of them from the chief's latest good checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import posixpath
import random
import shlex
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NoReturn

from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
)

from orchestrator import cost, elastic, paths, secrets, warm
from orchestrator import plan as planning
from orchestrator.boards import BoardCopy
from orchestrator.causes import IMMEDIATE, PLANNED, RETRYABLE, Cause
from orchestrator.checkpoints import (
    CheckpointMirror,
    WorkerCommand,
    fetch_file,
    has_checkpoint,
    share_chief_checkpoint,
    verify_on,
)
from orchestrator.errors import OrchestratorError, ProviderError, RunFailed, StateError
from orchestrator.events import Event
from orchestrator.history import History
from orchestrator.hosts import Host
from orchestrator.launchers import ProcessLauncher, launcher_for, launcher_named
from orchestrator.metrics import Exporter, RunFigures, exposition
from orchestrator.plan import CheckpointLayout, ClusterPlan, TaskPlan
from orchestrator.providers.base import HostHealth, Provider
from orchestrator.remote.base import LaunchSpec, Runner, TaskHandle, TaskState, launch_script
from orchestrator.remote.fanout import fan_out
from orchestrator.spec import WARM_AFTER_S, ClusterSpec, StaticProvider, is_url
from orchestrator.state import AttemptRecord, Store, TaskRecord
from orchestrator.view import (
    Listener,
    RunResult,
    RunView,
    TaskView,
    describe_phases,
    human_bytes,
    safe,
)
from orchestrator.warm import WarmTasks
from orchestrator.watch import AttemptFailed, AttemptWatch, Watched

HEARTBEAT_S = 2.0
# After a crash, how long the chief's step may take to fail on the lost peer and the chief to
# say it saves a snapshot (retry.snapshot_on_crash); then timeouts.snapshot_s for the save.
SNAPSHOT_START_S = 3.0
# After these a survivor saves its state at the last step it completed (retry.snapshot_on_crash)
SNAPSHOT_AFTER = (Cause.CRASHED, Cause.HOST_LOST, Cause.HUNG)
# ... of which these leave a dead process whose connections reset at once (a hung task is
# killed first: Supervisor._end_the_hung_task), so the survivor's step fails within moments
DIED = (Cause.CRASHED, Cause.HUNG)
LAUNCH_SETTLE_S = 2.0  # how long a failed launch's pid file is looked for (see _start)
# How long the first attempt's warm tasks (Supervisor.prestart) wait for their go: a controller
# killed while its doctor ran leaves none waiting longer (a later go finds them gone: cold).
PRESTART_WAIT_S = 600.0
UNEXPECTED_FIX = ("this is a bug in orchestrate, or the state store (under ORCHESTRATE_HOME) "
                  "failed: run it again as 'orchestrate --debug ...' for the traceback; the "
                  "run's tasks were stopped")


def _with_env(plan: ClusterPlan, env: Mapping[str, str]) -> ClusterPlan:
    """``plan`` with ``env`` added to every task's environment."""
    return dataclasses.replace(plan, tasks=tuple(
        dataclasses.replace(t, env={**t.env, **env}) for t in plan.tasks))


# Why an elastic group's spare (a host past ``workers``, for ``elastic.max_workers``) is not in
# the group yet, as its attempts' ``resized`` records say.
SPARE = "a spare, not grown onto yet"


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
        secret_values: Mapping[str, str] | None = None,
    ) -> None:
        """``secret_values``: the spec's secrets (``secrets.resolve``, read from this process's
        environment when not given)."""
        self.spec = spec
        self._secrets = dict(secrets.resolve(spec) if secret_values is None else secret_values)
        self.provider = provider
        self.store = store
        self.workdir = workdir
        self._listener: Listener = safe(listener) if listener else (lambda view, event: None)
        self.backoff_sleep = backoff_sleep
        self.clock = clock
        self.poll_s = poll_s
        self.view = RunView(run_id="", cluster=spec.name)
        self._causes: Counter[Cause] = Counter()
        self._bad_ports: set[tuple[str, int]] = set()
        self._broken_hosts: set[str] = set()
        self._orphans: list[tuple[str, TaskHandle]] = []  # tasks left on unreachable hosts
        self._launched: list[Watched] = []  # the tasks of the attempt started so far
        self._last_prestep_failure = ""
        self._snapshot_source: str | None = None  # the host of a snapshot saved for the chief
        self._chief_host: Host | None = None
        self._chief_key = ""
        self._epoch_logs: dict[str, float] = {}  # the chief's last epoch's loss and metrics
        self._layout: CheckpointLayout | None = None
        self._relayed_bytes = 0  # checkpoint bytes relayed through here when hosts could not
        self._mirror: CheckpointMirror | None = None
        self._beat = 0.0
        self._noted = ""  # the waiting reasons last written to the run's record
        self._recovered: set[int] = set()  # attempts whose recovery figures are recorded
        self._resumed_at = 0  # the first attempt of a 'train --resume'; 0 when not resumed
        self.launcher = launcher_for(spec)
        self._notify_lock = threading.RLock()  # the mirror thread notifies the listener too
        # Per attempt, when each step of its start ended (time.time()): began, repaired,
        # checkpoint_ready, started, connected (the chief's strategy); see recovery_phases.
        self._marks: dict[int, dict[str, float]] = {}
        self._warm: WarmTasks | None = None  # the next attempt's tasks, waiting (retry.warm_tasks)
        self._current: dict[str, TaskHandle] = {}  # the running attempt's tasks, by key
        self._prestarted: ClusterPlan | None = None  # the first attempt, as prestart started it
        self._history: History | None = None  # the chief's progress, for the run's charts
        self._exporter: Exporter | None = None  # the run's Prometheus metrics (metrics:)
        self._boards: BoardCopy | None = None  # the chiefs' TensorBoard logs, copied here
        self._hosts_seen: dict[str, Host] = {}  # every attempt's hosts (the chiefs' logs)
        # static hosts: the GPUs each machine's tasks reported as they connected (the cost)
        self._gpus_seen: dict[str, int] = {}
        self._price_lock = threading.Lock()
        # elastic: the hosts the group goes on without (lost for good), and why; those of them
        # the grow check found back (for the next tick's planned stop), and the check's thread
        self._left_out: dict[str, str] = {}
        self._returned: dict[str, Host] = {}
        self._elastic_lock = threading.Lock()
        self._grow_stop = threading.Event()
        self._grow_thread: threading.Thread | None = None
        self._running = False  # what the metrics say: the run is being trained

    # -- the first attempt, started while the doctor checks -------------------------------
    def prestart(self) -> str | None:
        """Record a new run and start its first attempt's tasks as warm tasks now, so that
        they import TensorFlow and the job's module while the doctor checks the hosts (its
        report may change the job's ``collectives``: the go carries the final environment).
        The run's id; None where the run keeps no warm tasks (``warm.wanted``, the provider's
        ``warm_tasks``) or its first attempt cannot be planned yet: nothing is recorded, and
        the first attempt starts cold after the doctor, as before."""
        if not (warm.wanted(self.spec) and self.provider.warm_tasks):
            return None
        try:
            hosts = self.provider.hosts()
            python = self.provider.python(hosts[0])
        except OrchestratorError:  # the doctor says what is wrong; the attempt asks again
            return None
        run_id = self.store.new_run(self.spec.name, run_id=self.provider.early_run_id())
        try:
            # No look for taken ports (a command per host, before any task could start): a
            # warm task's environment has no TF_CONFIG, and the attempt's own plan, which the
            # go carries, takes its ports after such a look.
            first = planning.build(self.spec, hosts, run_id=run_id, attempt=1, python=python,
                                   local_workdir=str(self.workdir))
        except OrchestratorError:  # a plan error: the doctor reports it
            self.store.delete_run(run_id)
            return None
        self.store.note_run(run_id, "the doctor checks every host; the first attempt's tasks "
                                    "start meanwhile")
        self._warm = self._new_warm(run_id)
        self._warm.start(self._with_secrets(first), {}, wait_s=PRESTART_WAIT_S)
        self._prestarted = first
        self._remember_launches(run_id, first)
        return run_id

    def _remember_launches(self, run_id: str, first: ClusterPlan) -> None:
        """Hand the provider the launch scripts ``prestart`` runs (``Runner.start``'s), for the
        next ``train``'s CLI to run early (``orchestrator/early_claim.py``): none where a
        secret is in them (nothing keeps a secret) or another launcher than a process's."""
        if self._secrets or type(self.launcher) is not ProcessLauncher:
            self.provider.remember_launches(run_id, {}, {})
            return
        scripts: dict[str, list[tuple[str, list[str]]]] = {}
        for task in first.tasks:
            spec = ProcessLauncher.launch_spec(
                warm.as_warm(first, task, {}, PRESTART_WAIT_S, self.launcher))
            files = [spec.log_path, spec.pid_path, spec.rc_path, spec.go_path]
            scripts.setdefault(task.host.name, []).append((launch_script(spec), files))
        self.provider.remember_launches(
            run_id, scripts, {name: first.paths[name].run_dir for name in scripts})

    def _new_warm(self, run_id: str) -> WarmTasks:
        return WarmTasks(self.store, run_id, self.launcher,
                         lambda name: self.provider.runner(self._host(name)), self._say)

    def discard(self, run_id: str) -> None:
        """The run is not to be: stop what ``prestart`` started, remove its directory from
        every host, and forget the run (the doctor found a blocking problem, or a Ctrl-C came
        first), as if it never began."""
        try:
            if self._warm is not None:
                self._warm.stop(settle=True)  # before the directory its tasks log to goes
            first = self._prestarted
            if first is not None:
                machines = {(t.host.machine, t.host.root): t.host for t in first.tasks}
                fan_out([h for h in machines.values() if posixpath.isabs(h.root)],
                        lambda host: self.provider.runner(host).run(
                            ["rm", "-rf", "--", first.paths[host.name].run_dir], check=False),
                        name_of=lambda host: host.name)
        finally:
            self.store.delete_run(run_id)

    def use_spec(self, spec: ClusterSpec) -> None:
        """The spec as the doctor resolved it (``resolve_gpus``), before ``run``."""
        if spec.name != self.spec.name:
            raise ValueError(f"spec {spec.name!r} is not {self.spec.name!r}")
        self.spec = spec

    # -- the run ---------------------------------------------------------------------------
    def run(self, run_id: str, *, attach: bool = False, resume: bool = False) -> RunResult:
        """Supervise run ``run_id`` until it succeeds or its budget is spent.

        With ``attach``, first take over the run's last attempt as it is running now
        (after the controller that started it died), then go on as usual. With ``resume``,
        the ended run goes on from its newest checkpoint as its next attempt, with a fresh
        retry budget.

        However it ends, the run's record says so: succeeded, failed (with the report), or
        cancelled (Ctrl-C); an unexpected error (a bug, the state store failing) ends it as
        failed too, and its tasks are stopped first.
        """
        self.view.run_id = run_id
        exporter = Exporter(self.spec.metrics, lambda: self._metrics_text(run_id), self._say)
        exporter.start()
        self._exporter, self._running = exporter, True
        try:
            return self._run(run_id, attach, resume)
        finally:
            self._running = False
            exporter.close()  # the last textfile says the run ended

    def _run(self, run_id: str, attach: bool, resume: bool) -> RunResult:
        started = self.clock()
        try:
            try:
                self._history = History(self.store, run_id)
                self._price_in_background(run_id)
                if BoardCopy.wanted(self.spec):
                    self._boards = BoardCopy(self.spec, lambda: self.store.get_run(run_id),
                                             lambda: dict(self._hosts_seen), self.provider.runner,
                                             self._say)
                    self._boards.start()
                finished = self._attempts(run_id, attach, resume)
            finally:
                self._close()  # before the counts and the model download: the mirror is done
            return self._succeed(run_id, finished, started)
        except AttemptFailed as failure:
            if failure.cause is Cause.STOPPED:
                raise RunFailed(f"run {run_id} was stopped by 'orchestrate down'",
                                run_id=run_id) from None
            report = self._report_or(run_id, f"run {run_id} failed: {failure}")
            self._end_run(run_id, "failed", report)
            raise RunFailed(report, run_id=run_id, fix=_advice(failure)) from None
        except OrchestratorError as exc:  # repair, restore or launch failed: the run cannot go on
            message = f"run {run_id} failed: {exc.message}"
            self._end_run(run_id, "failed", message)
            raise RunFailed(message, run_id=run_id, fix=exc.fix) from exc
        except KeyboardInterrupt:
            self._end_run(run_id, "cancelled", "interrupted by the user (Ctrl-C)")
            raise
        except Exception as exc:
            message = (f"run {run_id} failed: the controller stopped on an unexpected error: "
                       f"{type(exc).__name__}: {str(exc)[:1000]}")
            self._end_run(run_id, "failed", message)
            raise RunFailed(message, run_id=run_id, fix=UNEXPECTED_FIX) from exc
        except BaseException as exc:  # SystemExit, GeneratorExit: the program is ending
            self._end_run(run_id, "cancelled", f"the controller ended ({type(exc).__name__})")
            raise

    def _metrics_text(self, run_id: str) -> str:
        points = self._history.points if self._history is not None else []
        return exposition(RunFigures(
            self.spec.name, run_id, self._running, self.view.attempt, self.view.total_steps,
            points[-1] if points else None, self.store.attempts(run_id)))

    def _price_in_background(self, run_id: str) -> None:
        """Record the cluster's price an hour for the run's cost (``status``). Reading the
        Billing Catalog may take seconds (and is read at most once a day): never on the way
        to the first step. A failure leaves the run without a cost; it never ends the run."""
        threading.Thread(target=self._price, args=(run_id,), kwargs={"online": True},
                         name="orchestrate-price", daemon=True).start()

    def _price(self, run_id: str, *, online: bool) -> None:
        """Price the cluster now (static hosts: with the GPUs their tasks reported so far). A
        failure is said and leaves the run without a cost; it never ends the run."""
        try:
            with self._price_lock:
                counted = sum(self._gpus_seen.values()) if self._gpus_seen else None
                found = cost.lookup_price(self.spec, online=online, gpus_counted=counted)
                if found is not None:
                    self.store.set_price(run_id, found.to_json())
        except Exception as exc:
            self._say(f"the run's cost is not counted: {type(exc).__name__}: {str(exc)[:300]}")

    def _count_gpus(self, run_id: str, w: Watched, event: Event) -> None:
        """A static host's task says the GPUs it sees as it connects: its machine's count (the
        most any of its tasks saw: tasks on one machine see its GPUs), and the price again."""
        gpus = event.get("gpus")
        machine = w.plan.host.machine
        if not isinstance(gpus, int) or self._gpus_seen.get(machine, -1) >= gpus:
            return
        self._gpus_seen[machine] = gpus
        self._price(run_id, online=False)

    def _attempts(self, run_id: str, attach: bool, resume: bool) -> dict[str, Event]:
        """Every attempt, restarting the group on a retryable failure, until one succeeds."""
        self._mirror = CheckpointMirror(
            paths.mirror_dir(self.spec.name, run_id), self.provider.runner, self._worker,
            mode=self.spec.checkpoint.mirror, on_mirrored=self._mirrored,
            on_pulling=self._pulling, on_off=self._say)
        previous = self.store.attempts(run_id) if attach or resume else []
        if warm.wanted(self.spec) and self.provider.warm_tasks and self._warm is None:
            self._warm = self._new_warm(run_id)
            if attach:  # the warm tasks the dead controller started (for its first attempt
                # while its doctor checked the hosts, when it had none yet)
                self._warm.adopt(self.store.get_run(run_id).warm,
                                 (previous[-1].number if previous else 0) + 1)
        if attach:
            self._causes.update(Cause(a.cause) for a in previous
                                if a.cause in Cause._value2member_map_)
            # (an attempt that records no resize but whose controller died before it was
            # written still left its spares out)
            if previous and self.spec.elastic is not None and \
                    (previous[-1].resized or self.spec.spares):
                self._left_out_by(previous[-1])
            attach = self._attachable(run_id, previous)
        else:
            self._await_spares()
        base = len(previous)
        self._resumed_at = base + 1 if resume else 0
        retrying = Retrying(
            stop=self._budget_spent,
            wait=self._backoff,
            retry=retry_if_exception(lambda e: isinstance(e, AttemptFailed)
                                     and e.cause in RETRYABLE),
            sleep=self.backoff_sleep,
            before_sleep=self._before_sleep,
            reraise=True,
        )
        for attempt in retrying:
            with attempt:
                n = attempt.retry_state.attempt_number
                if attach and n == 1:
                    finished = self._reattach(run_id, previous[-1])
                else:
                    finished = self._attempt(run_id, base + n - (1 if attach else 0))
        return finished

    def _attachable(self, run_id: str, previous: list[AttemptRecord]) -> bool:
        """Whether the run's last attempt is one to take over: recorded running with every
        task. One its controller left while launching it has its started tasks stopped and is
        recorded cancelled; with none (the controller died before it launched any), the run
        goes on with its next attempt."""
        last = previous[-1] if previous else None
        if last is not None and last.status == "running" and \
                len(last.tasks) >= self._sized()[0].num_tasks:
            return True
        if last is None or last.status != "running":
            self._say(f"run {run_id} has no attempt running to take over (its controller "
                      "ended before it launched one): starting the next attempt")
            return False
        self._say(f"attempt {last.number} of run {run_id} has {len(last.tasks)} of "
                  f"{self.spec.num_tasks} tasks: its controller ended while launching it. "
                  "Stopping them, then starting the next attempt")
        self._stop_records(last.tasks)
        self.store.update_attempt(
            run_id, last.number, status="cancelled", ended_at=time.time(),
            cause=Cause.CANCELLED.value, failed_task="-",
            detail="its controller ended while launching it; the tasks it started were stopped")
        return False

    def _stop_records(self, tasks: list[TaskRecord]) -> None:
        """Stop recorded tasks (of an attempt another controller left), as 'down' does."""
        hosts = {h.name: h for h in self.provider.all_hosts()}

        def stop(task: TaskRecord) -> None:
            if task.host in hosts:
                launcher = launcher_named(task.launcher)
                launcher.stop(self.provider.runner(hosts[task.host]), launcher.find(task),
                              self.spec.timeouts.stop_grace_s)

        if tasks:
            with ThreadPoolExecutor(max_workers=min(32, len(tasks))) as pool:
                list(pool.map(stop, tasks))

    def _end_run(self, run_id: str, status: str, message: str) -> None:
        """Record how the run ended; a store that cannot is said, not raised over the error
        that ended the run."""
        try:
            self.store.finish_run(run_id, status=status, message=message)
        except Exception as exc:
            self._say(f"could not record that run {run_id} {status}: {type(exc).__name__}: "
                      f"{exc}")

    def _report_or(self, run_id: str, fallback: str) -> str:
        try:
            return self.report(run_id)
        except Exception:
            return fallback

    def _close(self) -> None:
        """Stop the warm tasks and the checkpoint mirror, whatever ended the run."""
        try:
            if self._warm is not None:
                self._warm.stop()
        except Exception as exc:
            self._say(f"could not stop the warm tasks: {type(exc).__name__}: {exc}")
        finally:
            self._grow_stop.set()
            self._give_up_left_out()
            if self._mirror is not None:
                self._mirror.close()
            if self._boards is not None:
                self._boards.close()

    def _succeed(self, run_id: str, finished: dict[str, Event], started: float) -> RunResult:
        self._count_mirror()
        chief = finished[next(iter(finished))]
        # An attempt that resumed at the last step trained no epoch: the last one trained says.
        metrics = dict(chief.get("metrics") or {}) or dict(self._epoch_logs)
        model_path = self._fetch_model(run_id, str(chief.get("model_path") or ""))
        result = RunResult(
            run_id=run_id, status="succeeded", metrics=metrics, model_path=model_path,
            digests={k: str(e.get("weights_sha256", "")) for k, e in finished.items()},
            attempts=self.store.attempts(run_id), seconds=self.clock() - started,
            checkpoint_bytes=dict(self.view.checkpoint_bytes),
        )
        self.store.finish_run(run_id, status="succeeded", metrics=metrics, model_path=model_path)
        return result

    def _budget_spent(self, state: RetryCallState) -> bool:
        failure = state.outcome.exception() if state.outcome else None
        if not isinstance(failure, AttemptFailed):
            return True
        restarts = sum(self._causes.values())
        budget = self.spec.retry.per_cause.get(failure.cause.value)
        spent = restarts > self.spec.retry.max_restarts or (
            budget is not None and self._causes[failure.cause] > budget)
        if spent:
            self._say(f"retry budget spent ({failure.cause.value}: {self._causes[failure.cause]}"
                      f", all causes: {restarts} of {self.spec.retry.max_restarts})")
        return spent

    def _backoff(self, state: RetryCallState) -> float:
        failure = state.outcome.exception() if state.outcome else None
        cause = failure.cause if isinstance(failure, AttemptFailed) else None
        if cause is Cause.RESIZED:
            return 0.0  # planned, and the machine is there now
        return backoff(state.attempt_number, cause, self.spec.retry.backoff_initial_s,
                       self.spec.retry.backoff_max_s)

    def _before_sleep(self, state: RetryCallState) -> None:
        wait = state.next_action.sleep if state.next_action else 0.0
        self._say(f"restarting all tasks in {wait:.1f}s" if wait > 0 else
                  "restarting all tasks now")

    # -- one attempt -----------------------------------------------------------------------
    def _attempt(self, run_id: str, number: int) -> dict[str, Event]:
        marks = self._marks[number] = {"began": time.time()}
        self._check_stopped(run_id)
        with self._provider_says():
            renewed = self.provider.renew()
            if renewed:
                self._say(renewed)
            self._await_spares(gone_only=True)
            self._repair_hosts()
        marks["repaired"] = time.time()
        plan = self._plan(run_id, number)
        if number > 1 or plan.checkpoints.named_by == "job.checkpoint_dir":
            self._restore_checkpoint(plan)  # a script's own directory may hold a checkpoint
        marks["checkpoint_ready"] = time.time()
        self.store.start_attempt(run_id, number, [])  # _launch adds each task as it starts
        if self._left_out:
            self.store.update_attempt(run_id, number, resized=self._resized_text(plan))
        self._launched = []
        try:
            with self._provider_says():  # what the launch waits for (a group's deletion)
                watched = self._launch(run_id, plan)
            marks["started"] = time.time()
            return self._supervise(run_id, number, plan, watched)
        except BaseException as exc:
            # _launch and _supervise end the attempt on whatever stops them; a Ctrl-C that
            # lands between the two (seen under load) is ended here, with the tasks started.
            try:
                unended = self.store.attempts(run_id)[number - 1].status == "running"
            except Exception:  # the store failing: nothing can be recorded
                unended = False
            if unended:
                self._abandon(run_id, number, list(self._launched), None, exc)
            raise

    def _reattach(self, run_id: str, attempt: AttemptRecord) -> dict[str, Event]:
        """Watch a running attempt that another (dead) controller started."""
        plan = self._plan(run_id, attempt.number, busy=False)
        records = {t.task: t for t in attempt.tasks}
        missing = [task.key for task in plan.tasks if task.key not in records]
        if missing:
            raise StateError(
                f"attempt {attempt.number} of run {run_id} has no task {missing[0]}: the spec "
                "changed since the attempt started", fix="stop the run with 'orchestrate down "
                "SPEC', then train again")
        if attempt.tasks:  # found again the way they were started
            found = launcher_named(attempt.tasks[0].launcher)
            if found.kind != self.launcher.kind:
                self.launcher = found
                if self._warm is not None:
                    self._warm.launcher = found
        watched = [Watched(task, self.launcher.find(records[task.key]),
                           self.provider.runner(task.host)) for task in plan.tasks]
        self._say(f"attached to attempt {attempt.number} of run {run_id}")
        return self._supervise(run_id, attempt.number, plan, watched)

    def _plan(self, run_id: str, number: int, busy: bool = True) -> ClusterPlan:
        spec, hosts = self._sized()
        plan = planning.build(
            spec, hosts, run_id=run_id, attempt=number,
            python=self.provider.python(hosts[0]), local_workdir=str(self.workdir),
            busy_ports=(self.provider.busy_ports(hosts) | self._bad_ports) if busy else (),
        )
        plan = self._with_after(run_id, number, plan)
        plan = self._with_secrets(plan)
        self._chief_host = plan.chief.host
        self._hosts_seen.update({t.host.name: t.host for t in plan.tasks})
        self._chief_key = plan.chief_key
        self._layout = plan.checkpoints
        self.view.attempt = number
        self.view.tasks = {t.key: TaskView(t.key, t.host.name, t.endpoint) for t in plan.tasks}
        self._notify(self.view, None)
        return plan

    def _with_after(self, run_id: str, number: int, plan: ClusterPlan) -> ClusterPlan:
        """``plan`` with why the attempt before ended in every task's env (the chief marks it in
        its TensorBoard log, ``worker.tensorboard``)."""
        attempts = self.store.attempts(run_id)
        if number < 2 or len(attempts) < number - 1:
            return plan
        before = attempts[number - 2]
        after = " ".join(f"{before.failed_task} {before.cause}: {before.detail}".split())
        if before.snapshot:
            after += f"; {before.snapshot}"
        return _with_env(plan, {"ORCHESTRATE_RESTARTED_AFTER": self._redact(after)[:500]})

    def _with_secrets(self, plan: ClusterPlan) -> ClusterPlan:
        """``plan`` with the secrets in every task's env: only launches see this plan (the
        records keep no env, and ``plan``/``status`` build their own)."""
        return _with_env(plan, self._secrets) if self._secrets else plan

    def _supervise(self, run_id: str, number: int, plan: ClusterPlan,
                   watched: list[Watched]) -> dict[str, Event]:
        watch: AttemptWatch | None = None
        try:
            self._current = {w.key: w.handle for w in watched}
            watch = AttemptWatch(
                self.spec, watched, self.view, self._notify, launcher=self.launcher,
                on_tick=lambda: self._tick(run_id),
                on_event=lambda w, e: self._on_event(run_id, number, plan, w, e),
                python_for=lambda w: self.provider.python(w.plan.host), interval_s=self.poll_s,
            )
            finished = watch.run()
        except AttemptFailed as failure:
            self._failed(run_id, number, watched, watch, failure)
        except BaseException as exc:
            self._abandon(run_id, number, watched, watch, exc)
            raise
        finally:
            if watch is not None:
                watch.close()
        self._end_attempt(run_id, number, watched, "succeeded", None, None)
        return finished

    def _failed(self, run_id: str, number: int, watched: list[Watched], watch: AttemptWatch | None,
                failure: AttemptFailed) -> NoReturn:
        """Stop every task after the attempt's failure, say which it was, record it, raise it.
        An error meanwhile (a host, the store, a Ctrl-C) still leaves every task stopped."""
        detected = time.time()
        try:
            if failure.saved_step is not None and self.store.run_status(run_id) == "stopped":
                failure.cause = Cause.STOPPED  # 'down' TERMed the tasks before we noticed
            self._check_preempted(failure, watched)
            planned = failure.cause in PLANNED or failure.saved_step is not None \
                or failure.cause is Cause.PREEMPTED
            # Whether the host of a task that vanished as a whole answers, asked before the
            # snapshot is waited for: a machine that went away and came back within moments
            # would answer by then, and look like a task killed on a machine that stayed.
            gone = {failure.host} if failure.vanished and failure.cause is Cause.CRASHED and \
                failure.host and not failure.connection_lost and \
                not self._answers(failure.host) else set()
            if not planned:
                self._end_the_hung_task(failure, watched)
                self._await_snapshot(failure, watched, watch)
            silent = self._stop_all(watched, watch, planned=planned) | gone
            failure = self._confirm(failure, silent, watched)
        except BaseException as exc:
            self._abandon(run_id, number, watched, watch, exc)
            raise
        status = "stopped" if failure.cause in (Cause.STOPPED, Cause.RESIZED) else "failed"
        self._end_attempt(run_id, number, watched, status, failure, detected)
        raise failure from None

    @property
    def _snapshots(self) -> bool:
        """Whether the tasks save a snapshot after a crash (retry.snapshot_on_crash): managed
        jobs."""
        return self.spec.retry.snapshot_on_crash and self.spec.job.mode == "managed"

    def _snapshot_taker(self, failure: AttemptFailed,
                        watched: Sequence[Watched]) -> tuple[Watched | None, str]:
        """The survivor that saves the group's state after ``failure``, or why none does: the
        chief; or, when the chief's process died or its host was lost, the first other task
        still reachable (on another host, for a lost one) that had completed a step (asked to:
        ``_ask_for_snapshot``), into the chief's directory."""
        chief = next((w for w in watched if w.key == self._chief_key), None)
        if chief is None:
            return None, "the chief was not started"
        chief_host = chief.plan.host.name
        host_lost = chief.unreachable is not None or (
            failure.host == chief_host and failure.cause not in DIED)
        if chief.key == failure.task or host_lost:
            gone = f"the chief's host {chief_host} was lost" if host_lost else \
                f"the chief ({chief.key}) died"
            survivor = next((w for w in watched if w is not chief and w.unreachable is None
                             and w.reached_step
                             and not (host_lost and w.plan.host.name == chief_host)), None)
            if survivor is not None and survivor.plan.host.ephemeral:
                return None, (f"{gone}, and {survivor.key}'s run directory is its pod's own "
                              "(emptyDir): it cannot be asked to save in the chief's place")
            if survivor is None:
                where = " on another host" if host_lost else ""
                return None, f"{gone}, and no task{where} that had completed a step outlived it"
            return survivor, ""
        if not chief.reached_step:
            return None, "the group had not completed a step"
        return chief, ""

    def _await_snapshot(self, failure: AttemptFailed, watched: list[Watched],
                        watch: AttemptWatch | None) -> None:
        """After a task died or its host was lost: give the survivor that saves (the chief, or
        another task asked to when the chief died) up to timeouts.snapshot_s to save its state
        at the last completed step (it does so as its step fails on the lost peer) before the
        survivors are killed."""
        if not self._snapshots or watch is None or failure.cause not in SNAPSHOT_AFTER:
            return
        taker, _ = self._snapshot_taker(failure, watched)
        if taker is None or taker.ended or taker.snapshot is not None:
            return
        # The request names the task that saves; that task's worker aborts its collective ops
        # when it reads it, so a step waiting on a peer that will never answer (a machine
        # gone, a peer that died before it joined the step) fails at once.
        if not self._ask_for_snapshot(taker) and taker.key != self._chief_key:
            return
        # A dead process's connections reset, which fails the survivor's step within
        # milliseconds, and so does the request; without either (a lost machine's
        # connections may hang) there is nothing to wait for.
        if failure.cause in DIED or taker.snapshot_asked:
            watch.wait_for(taker, min(SNAPSHOT_START_S, self.spec.timeouts.snapshot_s),
                           until=lambda w: w.snapshotting)
        if taker.ended or not taker.snapshotting:
            return
        wait = self.spec.timeouts.snapshot_s
        self._say(f"{failure.task} failed: waiting up to {wait:.0f}s for {taker.key} to save "
                  "its state at the last step every task completed")
        # Saved (or refused) is enough: its exit, through TensorFlow's teardown, is not awaited.
        watch.wait_for(taker, wait, until=lambda w: w.snapshot is not None or
                       bool(w.snapshot_refused))

    def _end_the_hung_task(self, failure: AttemptFailed, watched: list[Watched]) -> None:
        """After a hang, kill the task blamed for it before the others: their step, waiting
        on it in a collective, then fails on a lost peer as after a crash, and a survivor
        saves the step it completed (``_await_snapshot``). A hang of another kind (a deadlock
        in the job's code) leaves them waiting, and the record says no step failed."""
        if failure.cause is not Cause.HUNG or not self._snapshots:
            return
        w = next((w for w in watched if w.key == failure.task), None)
        if w is None or w.ended or w.unreachable is not None:
            return
        self._say(f"killing {w.key} first, so that the others' step fails on it and a "
                  "survivor saves the step they completed")
        try:
            self.launcher.stop(w.runner, w.handle, 0.0)
        except OrchestratorError as exc:
            self._say(f"could not kill {w.key}: {exc.message}")

    def _ask_for_snapshot(self, w: Watched) -> bool:
        """Ask ``w`` (the chief, or a task in the dead chief's place) to save the group's
        state: its key in the file ORCHESTRATE_SNAPSHOT_REQUEST names on its host. Its worker
        then aborts its collective ops (``worker.runtimes.common.abort_when_asked``), so its
        step fails even where it would hang; every task but the chief waits for the file once
        its step has failed (``asked_for_snapshot``), and those finding another key there
        exit at once. Whether the request was made."""
        path = w.plan.env.get("ORCHESTRATE_SNAPSHOT_REQUEST")
        if not path or w.plan.host.ephemeral:  # a pod's own disk: a command cannot reach it
            return False
        target, key = shlex.quote(path), shlex.quote(w.key)
        script = f"printf '%s\\n' {key} > {target}.tmp && mv -f {target}.tmp {target}"
        try:
            self.provider.runner(w.plan.host).run(script, timeout_s=self.spec.timeouts.poll_s)
        except OrchestratorError as exc:
            self._say(f"could not ask {w.key} to save the group's state: {exc.message}")
            return False
        w.snapshot_asked = True
        return True

    def _snapshot_of(self, failure: AttemptFailed,
                     watched: Sequence[Watched]) -> tuple[int | None, str, Watched | None]:
        """The step of the survivor's snapshot after ``failure``, who saved it and the task
        that did; or (None, why not, None); (None, "", None) where none was to be taken."""
        if not self._snapshots or failure.cause not in SNAPSHOT_AFTER:
            return None, "", None
        taker, why = self._snapshot_taker(failure, watched)
        if taker is None:
            return None, why, None
        asked = taker.key == self._chief_key or taker.snapshot_asked
        if taker.snapshot is not None:
            step = int(taker.snapshot.get("step", 0))
            return step, f"{taker.key} saved its state at step {step} after {failure.task} " \
                         "failed", taker
        if taker.snapshot_refused:
            return None, f"{taker.key} could not save one: {taker.snapshot_refused}", None
        if taker.snapshotting:
            return None, (f"{taker.key} had not saved one within timeouts.snapshot_s "
                          f"({self.spec.timeouts.snapshot_s:.0f}s), and was killed"), None
        if not asked:
            how = "could not be reached" if taker.exit_code is None else \
                f"had ended (exit {taker.exit_code})"
            return None, (f"{taker.key}, which was to save one in the chief's place, {how} "
                          "before it was asked"), None
        if taker.exit_code is not None and taker.exit_code != 137:
            # A fault after the last step (a peer gone while the model is saved): nothing to
            # save, and nothing lost
            kept = f"; step {taker.step}, the last it reported, was checkpointed already" \
                if taker.step and (taker.checkpoint_step or 0) >= taker.step else ""
            return None, f"{taker.key} exited ({taker.exit_code}) without saving one{kept}", None
        if failure.cause is Cause.HUNG:
            return None, (f"{taker.key}'s step had not failed within {SNAPSHOT_START_S:.0f}s of "
                          f"{failure.task} being killed: it was not waiting on it in a "
                          "collective"), None
        if failure.cause is Cause.HOST_LOST:
            return None, (f"{taker.key}'s step had not failed on the lost host by the time its "
                          "loss was seen (connections to a machine that is gone can hang rather "
                          "than fail; timeouts.collective_s bounds them)"), None
        return None, (f"{taker.key}'s step had not failed on the lost peer within "
                      f"{SNAPSHOT_START_S:.0f}s (connections to a machine that is gone can hang "
                      "rather than fail; timeouts.collective_s bounds them), so it had nothing "
                      "to save"), None

    def _abandon(self, run_id: str, number: int, watched: list[Watched],
                 watch: AttemptWatch | None, exc: BaseException) -> None:
        """The attempt ends on something other than its tasks: a Ctrl-C (cancelled), or an
        error of the controller (failed). Every task is stopped as for a planned stop (it
        saves a checkpoint at the same step as the others) and the attempt recorded."""
        interrupted = not isinstance(exc, Exception)
        why = "interrupted" if interrupted else \
            f"the controller failed: {type(exc).__name__}: {str(exc)[:500]}"
        if watched:
            self._say(f"stopping every task ({why}): each saves a checkpoint at the same step "
                      f"(up to {self.spec.timeouts.stop_grace_s:.0f}s)")
        # Stopped, the attempt is recorded whatever comes next (a second Ctrl-C); stopped in
        # part, it stays 'running' in the record, and 'down' stops what is left.
        self._stop_tasks(watched, planned=True)
        try:
            self._drain(watch)
        finally:
            self._end_attempt(run_id, number, watched, "cancelled" if interrupted else "failed",
                              AttemptFailed(Cause.CANCELLED, "-", why), time.time())

    def _launch(self, run_id: str, plan: ClusterPlan) -> list[Watched]:
        """Start every task of the attempt; each is added to the attempt's record as soon as
        it runs, so that 'down' finds it whatever happens next. If a start fails or a Ctrl-C
        comes, the starts under way end, then every task started is stopped and the attempt
        recorded as ended, before the error goes on."""
        group = self.provider.start_group(plan)
        if group is not None:  # the scheduler started every task at once (one JobSet)
            watched = [Watched(task, handle, self.provider.runner(task.host))
                       for task, handle in zip(plan.tasks, group, strict=True)]
            self._launched = watched
            self.store.update_attempt(run_id, plan.attempt,
                                      tasks=[w.record(self.launcher) for w in watched])
            self._say(f"attempt {plan.attempt}: submitted {len(watched)} tasks as one group")
            return watched
        went = self._warm.go(plan) if self._warm is not None else {}
        started: dict[str, Watched] = {}
        lock = threading.Lock()

        def in_order() -> list[Watched]:
            return [started[t.key] for t in plan.tasks if t.key in started]

        def start(task: TaskPlan) -> Watched:
            runner = self.provider.runner(task.host)
            w = Watched(task, went.get(task.key) or self._start(runner, task), runner)
            with lock:
                started[task.key] = w
                self._launched = in_order()
                self.store.update_attempt(run_id, plan.attempt,
                                          tasks=[x.record(self.launcher) for x in self._launched])
            return w

        pool = ThreadPoolExecutor(max_workers=min(32, len(plan.tasks)))
        try:
            watched = list(pool.map(start, plan.tasks))
        except BaseException as exc:
            pool.shutdown(wait=True, cancel_futures=True)
            self._abandon(run_id, plan.attempt, in_order(), None, exc)
            raise
        finally:
            pool.shutdown(wait=True)
        how = f" ({len(went)} warm: told to go)" if went else ""
        self._say(f"attempt {plan.attempt}: started {len(watched)} tasks{how}")
        return watched

    def _start(self, runner: Runner, task: TaskPlan) -> TaskHandle:
        """Start one task. A launch that failed may have started it all the same: a Ctrl-C
        on a terminal reaches the launch script too, which may die after the task's own
        session began. Its pid file then names it, to be recorded and stopped like the rest."""
        try:
            return self.launcher.start(runner, task)
        except OrchestratorError:
            handle = self._started_anyway(runner, task)
            if handle is None:
                raise
            return handle

    def _started_anyway(self, runner: Runner, task: TaskPlan) -> TaskHandle | None:
        pid_path = LaunchSpec(task.argv, task.cwd, task.log_path, task.rc_path).pid_path
        deadline = time.monotonic() + LAUNCH_SETTLE_S
        while True:
            try:
                pid = runner.run(["cat", pid_path], check=False,
                                 timeout_s=self.spec.timeouts.poll_s).stdout.strip()
            except OrchestratorError:
                return None
            if pid.isdigit():
                return TaskHandle(runner.host_name, int(pid), task.log_path, task.rc_path)
            if time.monotonic() > deadline:
                return None
            time.sleep(0.1)

    def _maybe_warm(self, run_id: str, number: int, chief: Watched) -> None:
        """Start the next attempt's warm tasks once this attempt trains (``retry.warm_tasks``:
        at its first step, or after ``WARM_AFTER_S`` of training for ``auto``), while a restart
        is left in the budget."""
        warm = self._warm
        if warm is None or warm.off or warm.attempt > number or chief.first_progress_at is None:
            return
        if sum(self._causes.values()) >= self.spec.retry.max_restarts:
            return
        if self.spec.retry.warm_tasks == "auto" and \
                time.time() - chief.first_progress_at < WARM_AFTER_S:
            return
        spec, hosts = self._sized()
        try:
            following = planning.build(
                spec, hosts, run_id=run_id, attempt=number + 1,
                python=self.provider.python(hosts[0]), local_workdir=str(self.workdir))
        except OrchestratorError as exc:
            warm.off = f"the next attempt cannot be planned yet: {exc.message}"
            return
        warm.start(self._with_secrets(following), dict(self._current))

    def _tick(self, run_id: str) -> None:
        self._check_stopped(run_id)
        waiting = "; ".join(f"{t.key} is waiting: {t.waiting}"
                            for t in self.view.tasks.values() if t.waiting)
        if waiting != self._noted:  # 'status' shows why the tasks have not started
            self._noted = waiting
            self.store.note_run(run_id, self._redact(waiting))
        if time.monotonic() - self._beat >= HEARTBEAT_S:
            self._beat = time.monotonic()
            self.store.heartbeat(run_id)
        if self._exporter is not None:
            self._exporter.tick()
        chief = self.view.tasks.get(self._chief_key)
        # A group grows once it trains (a planned stop saves a step; one still starting has
        # none to save, and would lose its start for nothing).
        if self._returned and chief is not None and chief.state in ("training", "running"):
            with self._elastic_lock:
                back = sorted(self._returned)
            size = len(self._sized()[1]) + len(back)
            raise AttemptFailed(
                Cause.RESIZED, "-", f"{', '.join(back)} back: every task saves, and the group "
                f"grows to {elastic.describe(self.spec, size)}", failed_at=time.time())

    def _check_stopped(self, run_id: str) -> None:
        if self.store.run_status(run_id) == "stopped":
            raise AttemptFailed(Cause.STOPPED, "-", "the run was stopped by 'orchestrate down'")

    def _on_event(self, run_id: str, number: int, plan: ClusterPlan, w: Watched,
                  event: Event) -> None:
        if event.kind == "checkpoint" and w.key == plan.chief_key and self._mirror is not None \
                and plan.machines > 1 and plan.checkpoints.mirror != "never":
            self._mirror.request(plan, int(event.get("step", 0)))
        if event.kind == "epoch" and w.key == plan.chief_key:
            self._epoch_logs = {k: v for k, v in dict(event.get("logs") or {}).items()
                                if isinstance(v, (int, float))}
        if event.kind == "connected" and isinstance(self.spec.provider, StaticProvider):
            self._count_gpus(run_id, w, event)
        if event.kind == "connected" and w.key == plan.chief_key:
            # The strategy is created on every task at once: the group is connected.
            self._marks.setdefault(number, {}).setdefault("connected", event.time)
        if event.kind == "progress" and w.key == plan.chief_key:
            self._maybe_warm(run_id, number, w)
            if self._history is not None:
                self._history.add(number, event)
        if event.kind == "board":  # the chief's TensorBoard log or trace: turned off, written
            self._say(f"{w.key}: {event.get('message', '')}")
        if event.kind == "warm_unusable" and self._warm is not None:
            self._warm.unusable(str(event.get("reason", ""))[:300])
        # (An attempt resumed at the last step has no step to train: it saves and finishes.)
        resumed_at_end = event.kind == "resumed" and \
            event.get("step") == event.get("total_steps") is not None
        if (event.kind == "progress" or resumed_at_end) and number > 1 and \
                w.key == plan.chief_key and number not in self._recovered:
            self._recovered.add(number)
            self._record_recovery(run_id, number, w)

    # -- after a failure -------------------------------------------------------------------
    def _stop_all(self, watched: list[Watched], watch: AttemptWatch | None, *,
                  planned: bool) -> set[str]:
        """Stop every task, then read what they wrote last; returns the hosts that did not
        answer (during the attempt or now)."""
        self._stop_tasks(watched, planned=planned)
        self._drain(watch)
        return {w.plan.host.name for w in watched if w.unreachable is not None}

    def _stop_tasks(self, watched: list[Watched], *, planned: bool) -> None:
        """Stop every task.

        A planned stop (``down``, Ctrl-C, a task's saved stop) sends SIGTERM and waits up to
        ``timeouts.stop_grace_s`` for every task to save at the same step and exit; after a
        crash the group is broken (nothing to save), so the survivors are killed at once.
        """
        grace = self.spec.timeouts.stop_grace_s if planned else 0.0

        def stop(w: Watched) -> None:
            if w.unreachable is None:
                try:
                    status = self.launcher.stop(w.runner, w.handle, grace)
                    if status.state is TaskState.EXITED:
                        w.status = status  # the record keeps how it ended (75: saved on TERM)
                    return
                except OrchestratorError:
                    w.unreachable = "did not answer when it was being stopped"
            self._orphans.append((w.plan.host.name, w.handle))  # stopped once its host is back

        if watched:
            with ThreadPoolExecutor(max_workers=min(32, len(watched))) as pool:
                list(pool.map(stop, watched))

    def _drain(self, watch: AttemptWatch | None) -> None:
        if watch is None:
            return
        try:
            watch.drain()
        except Exception as exc:  # the tasks are stopped: their last lines are a bonus
            self._say(f"could not read the tasks' last output: {type(exc).__name__}: {exc}")

    def _check_preempted(self, failure: AttemptFailed, watched: list[Watched]) -> None:
        """Whether a VM the cloud is taking back (a spot VM stopping) is behind the failure.

        Its tasks got SIGTERM as its guest shut down, so every task is saving at the step they
        agreed on and must be given the grace, not killed; the VM is repaired first. After a
        saved stop, the hosts of the tasks that did not say so are asked too: a stopping VM's
        own 'stopped' event may never be read (its sshd is the first to go).
        """
        if failure.cause is Cause.HOST_LOST and failure.host:
            if not self.provider.reclaims_hosts:
                return  # a machine nobody takes back: lost, not preempted (no need to ask)
            suspects = [failure.host]
        elif failure.saved_step is not None:
            quiet = [w.plan.host.name for w in watched if w.stopped is None]
            suspects = list(dict.fromkeys([*quiet, failure.host or ""]))
        else:
            return
        health = {name: self.provider.host_health(self._host(name))
                  for name in filter(None, suspects)}
        if failure.saved_step is not None:  # any host not answering is repaired before the next
            self._broken_hosts.update(n for n, h in health.items() if h is not HostHealth.RUNNING)
        for name, state in health.items():
            if state is not HostHealth.PREEMPTED:
                continue
            self._broken_hosts.add(name)
            task = next(w.key for w in watched if w.plan.host.name == name)
            if failure.saved_step is not None:
                failure.detail = (f"{name} was preempted (spot VM reclaimed): {task} got SIGTERM "
                                  f"as it shut down; every task saved a checkpoint at step "
                                  f"{failure.saved_step}")
            else:
                failure.detail = f"{name} was preempted (spot VM reclaimed); " + failure.detail
            failure.cause, failure.task, failure.host = Cause.PREEMPTED, task, name
            return

    def _confirm(self, failure: AttemptFailed, silent: set[str],
                 watched: Sequence[Watched]) -> AttemptFailed:
        """Ask the provider about a lost host (preempted?), and spot code failing the same way.
        ``silent``: hosts that did not answer while the tasks were stopped."""
        if failure.cause in (Cause.CRASHED, Cause.HUNG, Cause.STARTUP_TIMEOUT,
                             Cause.HOST_LOST) and watched:
            self._blame_lost_host(failure, watched)
        # A task that vanished with its whole machine: the connection to its host dropped
        # since the task was last seen running, or the host did not answer when it was being
        # stopped, or does not now. (Asking only now is not enough: a machine that comes back
        # within the connect retries answers as if nothing happened.)
        if failure.vanished and failure.cause is Cause.CRASHED and failure.host and (
                failure.connection_lost or failure.host in silent
                or not self._answers(failure.host)):
            failure.cause = Cause.HOST_LOST
            failure.detail = f"host {failure.host} stopped answering as its task vanished"
        elif failure.cause is Cause.CRASHED:
            self._blame_dropped_host(failure, silent, watched)
        if failure.cause is Cause.HOST_LOST and failure.host:
            host = self._host(failure.host)
            self._broken_hosts.add(host.name)
            # Asking a host that stopped answering waits for the connect timeout: only worth
            # it where the answer may be 'preempted'.
            if self.provider.reclaims_hosts and \
                    self.provider.host_health(host) is HostHealth.PREEMPTED:
                failure.cause = Cause.PREEMPTED
                failure.detail = f"{host.name} was preempted (spot VM reclaimed); " + failure.detail
        if failure.before_first_step and failure.cause is Cause.CRASHED:
            if failure.signature == self._last_prestep_failure:
                failure.cause = Cause.USER_ERROR
                failure.detail = "fails the same way before the first step every time: " + \
                    failure.detail
            self._last_prestep_failure = failure.signature
        if failure.cause is Cause.CHECKPOINT_MISMATCH and self._layout is not None:
            failure.detail += "; " + _mismatch_reason(self._layout)
        if failure.cause is Cause.PORT_CONFLICT and failure.port:
            self._bad_ports.add(failure.port)
        if failure.cause in RETRYABLE and failure.cause is not Cause.RESIZED:
            self._causes[failure.cause] += 1  # (growing back costs no restart)
        return failure

    def _blame_lost_host(self, failure: AttemptFailed, watched: Sequence[Watched]) -> None:
        """A task that crashed or stalled because a host went away under the group (a
        scheduler's node that failed, whose peers' errors came first): the provider says
        which, and the failure becomes that host's loss, repaired before the relaunch."""
        lost = self.provider.lost_hosts([w.plan.host for w in watched])
        if not lost:
            return
        self._broken_hosts.update(lost)
        name = failure.host if failure.host in lost else next(iter(lost))
        task = next((w.key for w in watched if w.plan.host.name == name), failure.task)
        seen = failure.detail if task == failure.task else f"{failure.task}: {failure.detail}"
        failure.detail = f"{name} was lost under {task} ({lost[name]}); {seen}"[:2000]
        failure.cause, failure.task, failure.host = Cause.HOST_LOST, task, name

    @staticmethod
    def _blame_dropped_host(failure: AttemptFailed, silent: set[str],
                            watched: Sequence[Watched]) -> None:
        """A task that crashed because another task's machine went away under the group: its
        peer's error (a collective that failed at once) can be read before the poll that
        reconnects to a machine back within moments and finds its task gone. That machine is
        the one lost: its connection dropped since its task was last seen running (or it did
        not answer the stop), and its task did not end with an exit code of its own. Any
        provider's hosts, a scheduler's included: the provider need not have noticed."""
        for w in watched:
            name = w.plan.host.name
            if name == failure.host or w.stopped is not None or w.finished is not None or (
                    w.status is not None and w.status.state is TaskState.EXITED):
                continue
            if name in silent or w.runner.drops > w.drops_alive:
                how = "did not answer when its task was being stopped" if name in silent else \
                    "dropped its connection, and its task was gone when it answered again"
                failure.detail = (f"host {name} stopped answering under {w.key}: it {how}; "
                                  f"{failure.task}: {failure.detail}")[:2000]
                failure.cause, failure.task, failure.host = Cause.HOST_LOST, w.key, name
                return

    def _answers(self, host_name: str) -> bool:
        """Whether a host answers a command now (within ``timeouts.poll_s``)."""
        try:
            self.provider.runner(self._host(host_name)).run(
                "true", check=False, timeout_s=self.spec.timeouts.poll_s)
        except OrchestratorError:
            return False
        return True

    def _host(self, name: str) -> Host:
        return next(h for h in self.provider.all_hosts() if h.name == name)

    @contextlib.contextmanager
    def _provider_says(self) -> Iterator[None]:
        """What the provider waits for meanwhile (a scheduler's queue) goes to the run's
        messages."""
        before, self.provider.progress = self.provider.progress, self._say
        try:
            yield
        finally:
            self.provider.progress = before

    def _repair_hosts(self) -> None:
        with self._elastic_lock:
            back, self._returned = sorted(self._returned), {}
            for name in back:
                self._left_out.pop(name, None)
        if back:
            self._say(f"{', '.join(back)} back: the group grows to "
                      f"{elastic.describe(self.spec, len(self._sized()[1]))}")
        broken, self._broken_hosts = sorted(self._broken_hosts - set(self._left_out)), set()
        for name in broken:
            host = self._host(name)
            self._say(f"repairing {name}: waiting up to {self.spec.timeouts.repair_s:.0f}s")
            try:
                now = self.provider.repair(host, self.spec.timeouts.repair_s)
            except ProviderError as exc:
                self._leave_out(name, exc)
                continue
            self._say(f"{name} is back" if now.address == host.address else
                      f"{name} is back, at {now.address}")
        orphans, self._orphans = self._orphans, []
        for host_name, handle in orphans:
            if host_name in self._left_out:
                continue  # not reachable; nothing of this run is started there again
            host = self._host(host_name)
            try:  # a task that was cut off with its host may still run there, holding its port
                self.launcher.stop(self.provider.runner(host), handle, 0.0)
            except OrchestratorError as exc:
                self._say(f"could not stop an earlier task on {host_name}: {exc}")

    def _leave_out(self, name: str, failure: ProviderError) -> None:
        """An elastic group goes on without host ``name``, which its provider could not give
        back, while ``elastic.min_workers`` are left; else the failure stands.

        Raises:
            ProviderError: the spec is not elastic, or too few workers would be left.
        """
        policy = self.spec.elastic
        if policy is None:
            raise failure
        kept = self._sized()[1]
        left = len(kept) - 1
        if left < policy.min_workers:
            raise ProviderError(
                f"{failure.message}; without it {left} worker(s) would be left, fewer than "
                f"elastic.min_workers ({policy.min_workers})", fix=failure.fix) from None
        if self.provider.interchangeable_hosts:  # the group is the first N: the last goes
            name = kept[-1].name
        with self._elastic_lock:
            self._left_out[name] = failure.message
        self._say(f"going on without {name} (elastic): {elastic.describe(self.spec, left)}, "
                  f"instead of {self.spec.workers}")
        self._start_growing()

    def _await_spares(self, *, gone_only: bool = False) -> None:
        """A group that may grow past ``workers`` (``elastic.max_workers``) starts without its
        spares: each is left out until the grow check finds it ready (static: it answers;
        gcp: a zone created its VM; slurm: its one-node allocation runs), and the group then
        grows at a planned stop. ``gone_only`` (before each attempt): only a spare the group
        grew onto that its provider no longer has (a scheduler's allocation that ended)."""
        spares = [h.name for h in self.provider.spare_hosts() if h.name not in self._left_out
                  and (not gone_only or not self.provider.placed(h))]
        if not spares:
            return
        with self._elastic_lock:
            for name in spares:
                self._left_out[name] = SPARE if not gone_only else \
                    "its allocation ended; asked for again"
        if gone_only:
            self._say(f"going on without {', '.join(spares)} (elastic): "
                      f"{elastic.describe(self.spec, len(self._sized()[1]))}")
        else:
            self._say(f"{len(spares)} spare(s) to grow onto (elastic.max_workers "
                      f"{self.spec.max_workers}): {', '.join(spares)}"
                      + ("" if self.spec.elastic and self.spec.elastic.grow_check_s > 0 else
                         "; never looked for (elastic.grow_check_s is 0)"))
        self._start_growing()

    def _start_growing(self) -> None:
        """The grow check's thread, once (``elastic.grow_check_s``: 0 is never)."""
        policy = self.spec.elastic
        if policy is not None and policy.grow_check_s > 0 and self._grow_thread is None:
            self._grow_thread = threading.Thread(target=self._check_for_returns,
                                                 name="orchestrate-grow", daemon=True)
            self._grow_thread.start()

    def _left_out_by(self, attempt: AttemptRecord) -> None:
        """``train --attach`` to an attempt of an elastic group on fewer workers: the hosts it
        runs without are left out again, each with the reason its record gives, and the
        grow check goes on looking for them."""
        ran = {t.host for t in attempt.tasks}
        inside = attempt.resized.partition(" (without ")[2].removesuffix(")")
        starts = sorted((inside.find(f"{h.name}: "), h.name) for h in self.provider.all_hosts()
                        if h.name not in ran and inside.find(f"{h.name}: ") >= 0)
        reasons = {name: inside[at + len(name) + 2:(starts[i + 1][0] - 2 if i + 1 < len(starts)
                                                     else len(inside))]
                   for i, (at, name) in enumerate(starts)}
        # Those its record names, and the spares it has no task on (an attempt whose
        # controller died as it launched has tasks on some hosts only, and may record none)
        spares = [h.name for h in self.provider.spare_hosts()
                  if h.name not in ran and h.name not in reasons]
        names = [name for _, name in starts] + spares
        with self._elastic_lock:
            for name in names:
                self._left_out[name] = reasons.get(name) or SPARE
        if names:
            self._say(f"attempt {attempt.number} runs without {', '.join(names)} (elastic): "
                      "looking for them again")
            self._start_growing()

    def _check_for_returns(self) -> None:
        """Every ``elastic.grow_check_s``, off the training's path: ask the provider for each
        host the group goes on without (its repair, for at most the provider's
        ``return_probe_s``: on static hosts the SSH port, a login, the host prepared again; on
        gcp the VM re-created where a zone has room, booted, reached and prepared). One that is back waits in
        ``_returned`` for the next tick, which stops the group to grow it."""
        assert self.spec.elastic is not None
        while not self._grow_stop.wait(self.spec.elastic.grow_check_s):
            with self._elastic_lock:
                missing = set(self._left_out) - set(self._returned)
            for name in [h.name for h in self.provider.all_hosts() if h.name in missing]:
                try:
                    host = self.provider.repair(self._host(name), self.provider.return_probe_s)
                except Exception:  # not back yet (or the provider failing): the next check
                    if self.provider.interchangeable_hosts:
                        break  # the group grows onto them in order
                    continue
                with self._elastic_lock:
                    if name in self._left_out:
                        self._returned[name] = host

    def _give_up_left_out(self) -> None:
        """The run is over: its provider stops asking for the hosts it went on without (once
        the grow check in flight, if any, is done)."""
        if self._grow_thread is not None:
            self._grow_thread.join(min(self.provider.return_probe_s, 30.0) + 10.0)
        with self._elastic_lock:
            names = sorted(set(self._left_out) - set(self._returned))
        for name in names:
            try:
                self.provider.give_up(self._host(name))
            except OrchestratorError as exc:
                self._say(f"could not withdraw the request for {name}: {exc}")

    def _resized_text(self, plan: ClusterPlan) -> str:
        """What an attempt of an elastic group on fewer workers records: how many, and why."""
        left = len(plan.tasks)
        why = "; ".join(f"{name}: {' '.join(message.split())}"
                        for name, message in sorted(self._left_out.items()))
        return f"{left} of {self.spec.max_workers} workers (without {why})"

    def _sized(self) -> tuple[ClusterSpec, list[Host]]:
        """The spec and hosts of the group as it is now: every host, less those an elastic
        group goes on without, and the spec resized to them (``orchestrator.elastic``)."""
        hosts = [h for h in self.provider.all_hosts() if h.name not in self._left_out]
        return elastic.resized(self.spec, len(hosts)), hosts

    def _restore_checkpoint(self, plan: ClusterPlan) -> None:
        """Make the newest checkpoint that restores the one every task starts from."""
        chief = plan.chief.host
        runner, worker = self.provider.runner(chief), self._worker(chief)
        layout = plan.checkpoints
        directory = layout.of(chief)
        source, self._snapshot_source = self._snapshot_source, None
        if source is not None and not layout.shared:
            self._take_snapshot_from(plan, source)
        if layout.shared:
            self._say(f"checkpoints are on shared storage ({directory}): every task restores "
                      "from there, nothing is copied")
        elif not self._chief_has_checkpoint(plan):
            self._say("no checkpoint yet: the group starts from step 0")
            self._share(plan)  # clears copies the other hosts may still have
            return
        report = self._verified_already(plan) or verify_on(runner, worker, directory)
        for bad in report["rejected"]:
            self._say(f"checkpoint {bad['path']} does not restore ({bad['problem']}): "
                      "falling back to the one before")
        if not report["ok"]:
            self._say("no checkpoint restores: the group starts from step 0")
        elif report.get("path") is None:
            self._say("no checkpoint yet: the group starts from step 0")
        if not layout.shared:
            self._share(plan)

    def _take_snapshot_from(self, plan: ClusterPlan, name: str) -> None:
        """A task saved the group's state in the dead chief's place, in the chief's directory
        on its own host ``name``: copy it from there to every other machine (the chief's
        included), host to host, before the usual verify and share."""
        host = next((t.host for t in plan.tasks if t.host.name == name), None)
        if host is None or host.machine == plan.chief.host.machine:
            return  # written where the chief's checkpoints are: nothing to move
        self._say(f"copying the snapshot saved on {name} to the other hosts, host to host")
        try:
            copied = share_chief_checkpoint(plan, self.provider.runner, self._worker,
                                            source=host)
        except OrchestratorError as exc:
            self._say(f"could not copy the snapshot from {name} ({exc.message}): the chief's "
                      "last checkpoint is used")
            return
        self._moved("host_to_host", copied.host_to_host_bytes)
        self._relayed_bytes += copied.through_controller
        if copied.hosts:
            self._say(f"copied the snapshot from {name} to {', '.join(copied.hosts)} "
                      f"({copied.files} file(s), {human_bytes(copied.bytes)} each, "
                      f"{copied.seconds:.1f}s)")

    def _verified_already(self, plan: ClusterPlan) -> dict[str, Any] | None:
        """The chief's newest checkpoint, when its warm task has verified it (as the chief
        wrote it, or at once now): then nothing imports TensorFlow to check it again."""
        if self._warm is None:
            return None
        found = self._warm.verified(plan, self.provider.python(plan.chief.host))
        if not found or found.get("verified") is not True or not found.get("checkpoint"):
            return None
        path = str(found["checkpoint"])
        self._say(f"checkpoint {path} was verified by the chief's warm task "
                  f"({float(found.get('seconds') or 0):.2f}s to read it back): nothing to check now")
        return {"ok": True, "dir": posixpath.dirname(path), "path": path, "rejected": []}

    def _chief_has_checkpoint(self, plan: ClusterPlan) -> bool:
        """Whether the chief's disk has a checkpoint, pushing this machine's copy there first
        when the chief lost its own (a re-created VM)."""
        chief = plan.chief.host
        directory = plan.checkpoints.of(chief)
        present = has_checkpoint(self.provider.runner(chief), directory)
        mirror = self._mirror
        if present or mirror is None or plan.machines < 2 or not mirror.enabled:
            return present
        if not mirror.wait():
            self._say("the copy of the chief's checkpoint on this machine is still being "
                      "pulled: using the one it had")
        if not mirror.has_checkpoint():
            return False
        mirror.push(chief, directory)
        self._count_mirror()
        self._say(f"restored the chief's checkpoint on {chief.name} from this machine's "
                  f"copy (step {mirror.step})")
        return True

    def _share(self, plan: ClusterPlan) -> None:
        if plan.machines < 2:
            return
        self._say(f"copying the chief's checkpoint to {plan.machines - 1} other host(s), "
                  "host to host, where it changed")
        copied = share_chief_checkpoint(plan, self.provider.runner, self._worker)
        self._moved("host_to_host", copied.host_to_host_bytes)
        self._relayed_bytes += copied.through_controller
        self._count_mirror()
        if copied.chain_error:
            self._say(f"the hosts could not copy the checkpoint to each other, so it went "
                      f"through this machine ({human_bytes(copied.through_controller)}): "
                      f"{copied.chain_error}")
        if copied.cleared:
            self._say(f"removed older checkpoint copies on {', '.join(copied.cleared)}")
        if copied.hosts and not copied.chain_error:
            self._say(f"copied the chief's checkpoint to {', '.join(copied.hosts)} host to host "
                      f"({copied.files} file(s), {human_bytes(copied.bytes)} each, "
                      f"{copied.seconds:.1f}s)")
        if copied.up_to_date:
            self._say(f"{', '.join(copied.up_to_date)} already had the chief's checkpoint")

    def _worker(self, host: Host) -> WorkerCommand:
        return WorkerCommand(self.provider.python(host), paths.lib_dir(host.root),
                             self.spec.engine_container)

    def _moved(self, link: str, count: int) -> None:
        self.view.checkpoint_bytes[link] = self.view.checkpoint_bytes.get(link, 0) + count

    def _count_mirror(self) -> None:
        """Checkpoint bytes through this machine: the mirror's pulls and pushes, and relays."""
        mirror = self._mirror
        pulled = mirror.bytes_pulled + mirror.bytes_pushed if mirror is not None else 0
        self.view.checkpoint_bytes["through_controller"] = pulled + self._relayed_bytes

    def _fetch_model(self, run_id: str, remote_path: str) -> str:
        """The chief's saved model, downloaded to this machine when the chief is remote."""
        chief = self._chief_host
        if not remote_path or chief is None or chief.is_local:
            return remote_path
        if is_url(remote_path):  # in the bucket: read from there, nothing to download
            self._say(f"the model is at {remote_path}")
            return remote_path
        path = fetch_file(chief, self.provider.runner(chief), remote_path,
                          paths.fetched_model_dir(self.spec.name, run_id))
        self._say(f"fetched the model from {chief.name} to {path}")
        return path

    # -- records ---------------------------------------------------------------------------
    def _end_attempt(self, run_id: str, number: int, watched: list[Watched], status: str,
                     failure: AttemptFailed | None, detected_at: float | None) -> None:
        firsts = [w.first_progress_at for w in watched if w.first_progress_at is not None]
        snapshot_step, snapshot, saver = self._snapshot_of(failure, watched) if failure \
            else (None, "", None)
        # A snapshot saved in the chief's place is on that task's host: the relaunch takes it
        # from there (_restore_checkpoint).
        self._snapshot_source = saver.plan.host.name \
            if saver is not None and saver.key != self._chief_key else None
        if self._history is not None:
            self._history.flush()
        self.store.update_attempt(
            run_id, number, status=status, ended_at=time.time(),
            cause=failure.cause.value if failure else "",
            detail=self._redact(failure.detail if failure else "")[:4000],
            failed_task=failure.task if failure else "",
            exit_code=failure.exit_code if failure else None,
            evidence=self._redact(failure.evidence if failure else "")[-8000:],
            failed_at=failure.failed_at if failure else None,
            detected_at=detected_at,
            resumed_from_step=watched[0].start_step if watched else None,
            # The saver completed the step it saved, though its progress line for that step
            # may not have been read before the failure stopped the polls.
            last_step=max([w.step for w in watched] + [snapshot_step or 0]),
            first_step_at=min(firsts) if firsts else None,
            tasks=[w.record(self.launcher) for w in watched],
            snapshot_step=snapshot_step, snapshot=self._redact(snapshot)[:2000],
        )
        if failure is not None:
            self._say(f"attempt {number} {status}: {failure.cause.value} in {failure.task}: "
                      f"{failure.detail}")
        if snapshot:
            self._say(snapshot if snapshot_step is not None else
                      f"no snapshot: {snapshot}; the last checkpoint is used")

    def _record_recovery(self, run_id: str, number: int, chief: Watched) -> None:
        """Time from the last failure to this attempt's first step, and the steps redone."""
        previous = self.store.attempts(run_id)[number - 2]
        lost = max(0, (previous.last_step or 0) - (chief.start_step or 0))
        redone = f"{lost} step(s) redone"
        if previous.snapshot_step is not None and previous.snapshot_step == chief.start_step:
            redone = f"resumed from a survivor's snapshot at step {chief.start_step}, " + redone
        # The time since a stop is a person's, not ours (a 'train --resume'); an attempt that
        # resumed at the last step has no first step to time.
        if number == self._resumed_at or previous.failed_at is None or \
                chief.first_progress_at is None:
            self.store.update_attempt(run_id, number - 1, steps_lost=lost)
            self._say(f"resumed at step {chief.start_step or 0}; {redone}")
            return
        marks = self._marks.get(number, {})
        phases = recovery_phases([previous.failed_at, previous.detected_at, previous.ended_at,
                                  *(marks.get(m) for m in MARKS), chief.first_progress_at])
        recovery = chief.first_progress_at - previous.failed_at
        self.store.update_attempt(run_id, number - 1, recovery_s=recovery, steps_lost=lost,
                                  phases=phases)
        self._say(f"recovered in {recovery:.1f}s from {previous.cause} ({describe_phases(phases)}"
                  f"); {redone}")

    def report(self, run_id: str) -> str:
        attempts = self.store.attempts(run_id)
        lines = [f"run {run_id} failed after {len(attempts)} attempt(s):"]
        for a in attempts:
            code = f" (exit {a.exit_code})" if a.exit_code else ""
            lines.append(f"  attempt {a.number}: {a.cause or a.status} in {a.failed_task}: "
                         f"{a.detail}" + ("" if code.strip() in a.detail else code))
        last = attempts[-1] if attempts else None
        if last is not None and last.evidence:
            lines.append(f"  last output of {last.failed_task}:")
            lines += [f"    {line}" for line in last.evidence.splitlines()[-20:]]
        return "\n".join(lines)

    def _notify(self, view: RunView, event: Event | None) -> None:
        """Call the listener; the watch loop and the mirror thread both do, one at a time."""
        with self._notify_lock:
            self._listener(view, event)

    def _mirrored(self, step: int) -> None:
        self.view.mirrored_step = step
        self._count_mirror()
        self._notify(self.view, None)

    def _pulling(self, step: int | None) -> None:
        self.view.mirroring_step = step
        self._notify(self.view, None)

    def note(self, message: str) -> None:
        """Something the user should know before the run starts (e.g. a provider's note)."""
        self._say(message)

    def _redact(self, text: str) -> str:
        return secrets.redact(text, self._secrets) if self._secrets else text

    def _say(self, message: str) -> None:
        self.view.messages.append(self._redact(message))
        self._notify(self.view, None)


def _mismatch_reason(layout: CheckpointLayout) -> str:
    where = next(iter(layout.dirs.values()), "")
    if layout.shared:
        return (f"they share {where}, so the script restores something else that differs "
                "between hosts")
    if not layout.named_by:
        return ("the orchestrator does not know the directory the script checkpoints to, so "
                "it was not copied from the chief and each host restored what its own disk had")
    return (f"{where} was copied from the chief to every host, so the script restores from "
            "another directory as well, which was not")


def _advice(failure: AttemptFailed) -> str:
    if failure.fix:
        return failure.fix
    if failure.cause is Cause.CHECKPOINT_MISMATCH:
        return ("name the directory your script checkpoints to (BackupAndRestore's backup_dir, "
                "a CheckpointManager's directory) in job.checkpoint_dir, relative to the code "
                "dir, so the chief's checkpoint is given to every host before a relaunch; or "
                "put it on storage every host shares (checkpoint.dir, a gs:// URL)")
    if failure.cause is Cause.USER_ERROR:
        return "fix the error in your training code shown above; it fails before training starts"
    if failure.cause is Cause.STARTUP_TIMEOUT:
        return ("check that every host can reach every other host's port "
                "('orchestrate doctor'), or raise timeouts.startup_s")
    if failure.cause in (Cause.HOST_LOST, Cause.PREEMPTED):
        return "check the hosts named above, or raise retry.max_restarts / timeouts.repair_s"
    if failure.cause is Cause.HUNG:
        return "look for a stuck task in 'orchestrate logs', or raise timeouts.hang_s"
    return ("read the task logs with 'orchestrate logs', then raise retry.max_restarts "
            "if the cause was transient")


# Where a recovery's time goes, from the failure to the first step of the next attempt: each
# phase ends where the next begins. detect: until the controller saw it; stop: every task
# stopped (and the failure classified); backoff: the wait before the next attempt; repair: lost
# hosts back; checkpoint: the chief's checkpoint verified and copied to every host; launch:
# every task started (or a warm one told to go); connect: the tasks' strategy connected (the
# chief's ``connected`` event); first_step: the model built, restored, and a step trained.
RECOVERY_PHASES = ("detect", "stop", "backoff", "repair", "checkpoint", "launch", "connect",
                   "first_step")
MARKS = ("began", "repaired", "checkpoint_ready", "started", "connected")


def recovery_phases(bounds: list[float | None]) -> dict[str, float]:
    """Seconds per phase from its boundaries: the failure, its detection, the tasks stopped,
    then ``MARKS`` of the next attempt, then its first step (``len(RECOVERY_PHASES) + 1``).

    A missing boundary ends its phase where it began (0 s). The boundaries come from more
    than one clock (the hosts' event times, this machine's), so each is held between the one
    before and the last: the phases are never negative and add up to last minus first.
    """
    if len(bounds) != len(RECOVERY_PHASES) + 1 or bounds[0] is None or bounds[-1] is None:
        raise ValueError(f"recovery_phases needs {len(RECOVERY_PHASES) + 1} boundaries, the "
                         "first and last known")
    first, last = bounds[0], max(bounds[0], bounds[-1])
    held, previous = [], first
    for bound in bounds[1:-1]:
        previous = previous if bound is None else min(last, max(previous, bound))
        held.append(previous)
    edges = [first, *held, last]
    return {name: edges[i + 1] - edges[i] for i, name in enumerate(RECOVERY_PHASES)}


JITTER = 0.2  # the backoff is drawn from delay x (1 +- JITTER)


def backoff(failures: int, cause: Cause | None, initial_s: float, max_s: float,
            draw: Callable[[float, float], float] = random.uniform) -> float:
    """Seconds to wait before the restart after the ``failures``-th failed attempt in a row.

    The first restart after a crash or a preemption (``IMMEDIATE``) starts at once; every other
    waits ``initial_s x 2^(n-1)`` (n counting the restarts that waited), capped at ``max_s``,
    with a jitter in proportion to it (+-20%) so that clusters that failed together do not
    restart in lockstep, and a delay of 0.2 s stays about 0.2 s (tenacity's own jitter adds
    up to 1 s whatever the delay).
    """
    immediate = cause in IMMEDIATE
    if immediate and failures == 1:
        return 0.0
    n = failures - 1 if immediate else failures
    delay = min(max_s, initial_s * 2.0 ** (n - 1))
    return min(max_s, max(0.0, delay * draw(1 - JITTER, 1 + JITTER)))
