"""Warm tasks (``retry.warm_tasks``): the next attempt's processes, started on every host while
the current attempt trains, TensorFlow and the job's module imported, each waiting for its go
file (``worker/warm.py``). A relaunch writes the go files (the final TF_CONFIG, env, argv)
instead of starting cold, so the time from a failure to the next first step is the strategy's
handshake, the build and the restore, not a process start and a TensorFlow import.

A warm task is started exactly as the task it becomes (the same launcher, command line, log and
exit-code file: the next attempt's), so once it goes, nothing tells it from a cold one; until
then the run's record lists it (``Store.set_warm``) for ``down`` and ``train --attach``. The
chief's warm task also checks each new checkpoint as the chief writes it
(``worker.verified``), so the relaunch finds the newest one already verified.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shlex
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from orchestrator.errors import OrchestratorError
from orchestrator.launchers import Launcher, ProcessLauncher
from orchestrator.plan import ClusterPlan, TaskPlan
from orchestrator.remote.base import (
    Runner,
    TaskHandle,
    _ours,
    group_lives,
    module_source,
    sibling_of,
)
from orchestrator.spec import ClusterSpec, CommandJob, is_url
from orchestrator.state import Store, TaskRecord
from worker import verified as verified_module
from worker.warm import GO_ENV, PEER_ENV, VERIFY_ENV, WAIT_ENV

Started = tuple[str, TaskHandle]  # a warm task: its host's name, its handle
START_WAIT_S = 30.0  # how long a relaunch waits for warm tasks still being started
VERIFY_WAIT_S = 120.0  # how long it waits for the chief's warm task to check a checkpoint


def wanted(spec: ClusterSpec) -> bool:
    """Whether the spec's runs keep warm tasks: managed jobs (a command job's script is a
    process of its own, which no warm process can import ahead), unless switched off."""
    return spec.retry.warm_tasks is not False and not isinstance(spec.job, CommandJob)


def go_path(task: TaskPlan) -> str:
    """The file ``task``'s warm task waits for (``LaunchSpec.go_path``: its launch removes one
    an earlier task left)."""
    return sibling_of(task.rc_path, "go")


def verify_files(plan: ClusterPlan) -> tuple[str, str]:
    """(result, request) of the chief's background checkpoint checks, on the chief's host."""
    run_dir = plan.paths[plan.chief.host.name].run_dir
    return f"{run_dir}/verified.json", f"{run_dir}/verify-now"


def as_warm(plan: ClusterPlan, task: TaskPlan, peers: Mapping[str, TaskHandle],
            wait_s: float | None, launcher: Launcher) -> TaskPlan:
    """``task`` as its warm task starts: its env less ``TF_CONFIG`` (the go brings it), with
    its go file, the running attempt's task it outlives (``peers``), the chief's checkpoint
    checks, and with no peer how long it waits (``wait_s``)."""
    env = {k: v for k, v in task.env.items() if k != "TF_CONFIG"}
    env[GO_ENV] = go_path(task)
    peer = peers.get(task.key)
    if peer is not None and type(launcher) is ProcessLauncher:
        env[PEER_ENV] = str(peer.pgid)  # a container's processes see other pids
    chief_dir = plan.checkpoints.of(plan.chief.host)
    if task.key == plan.chief_key and not is_url(chief_dir):
        env[VERIFY_ENV] = json.dumps([chief_dir, *verify_files(plan)])
    if wait_s is not None:
        env[WAIT_ENV] = f"{wait_s:g}"
    return dataclasses.replace(task, env=env)


class WarmTasks:
    """The warm tasks of one run: started in the background, told to go, or stopped."""

    def __init__(self, store: Store, run_id: str, launcher: Launcher,
                 runner_for: Callable[[str], Runner], say: Callable[[str], None]) -> None:
        self.store = store
        self.run_id = run_id
        self.launcher = launcher
        self.runner_for = runner_for
        self.say = say
        self.off = ""  # why this run keeps no warm tasks any more
        self._lock = threading.Lock()
        self._tasks: dict[str, Started] = {}  # by task key, for attempt self._attempt
        self._attempt = 0  # the attempt the warm tasks are (being) started for
        self._went = 0  # the last attempt told to go: a start of it still under way is too late
        self._verifier: TaskHandle | None = None  # the chief's, when it checks checkpoints
        self._thread: threading.Thread | None = None

    @property
    def attempt(self) -> int:
        return self._attempt

    # -- start -----------------------------------------------------------------------------
    def start(self, plan: ClusterPlan, peers: dict[str, TaskHandle],
              wait_s: float | None = None) -> None:
        """Start ``plan``'s tasks warm, in the background (``peers``: the running attempt's
        tasks by key, whose end a warm task outlives by ``worker.warm.ORPHAN_S`` at most; with
        none, ``wait_s``: how long each waits for its go from its start)."""
        with self._lock:
            if self._attempt >= plan.attempt or self.off:
                return
            self._attempt = plan.attempt
        self._thread = threading.Thread(target=self._start, args=(plan, peers, wait_s),
                                        daemon=True, name="orchestrate-warm")
        self._thread.start()

    def _start(self, plan: ClusterPlan, peers: dict[str, TaskHandle],
               wait_s: float | None) -> None:
        def one(task: TaskPlan) -> tuple[TaskPlan, TaskHandle] | None:
            runner = self.runner_for(task.host.name)
            try:  # the launch removes a go file an earlier task with these paths left
                return task, self.launcher.start(runner, as_warm(plan, task, peers, wait_s,
                                                                 self.launcher))
            except OrchestratorError as exc:
                self.say(f"no warm task on {task.host.name}: {exc.message}")
                return None

        with ThreadPoolExecutor(max_workers=min(32, len(plan.tasks))) as pool:
            started = [s for s in pool.map(one, plan.tasks) if s is not None]
        with self._lock:
            current = self._attempt == plan.attempt and self._went < plan.attempt
            if current:
                self._tasks = {task.key: (task.host.name, handle) for task, handle in started}
                self._verifier = next((h for t, h in started if t.key == plan.chief_key
                                       and not is_url(plan.checkpoints.of(plan.chief.host))),
                                   None)
        if not current:  # the attempt started (or the run ended) while these were starting
            self._stop([(task.host.name, handle) for task, handle in started])
            return
        self.store.set_warm(self.run_id,
                            [self.launcher.record(task, handle) for task, handle in started])

    def adopt(self, records: list[TaskRecord], attempt: int) -> None:
        """Take over the warm tasks a controller that died started for ``attempt``."""
        with self._lock:
            self._attempt = attempt
            self._tasks = {r.task: (r.host, self.launcher.find(r)) for r in records}

    # -- use -------------------------------------------------------------------------------
    def verified(self, plan: ClusterPlan, python: str) -> dict[str, Any] | None:
        """The chief's newest checkpoint as the chief's warm task checked it, asking it to check
        it now if it has not (``worker.verified.check``); None when nothing can say."""
        self._wait_started()
        with self._lock:
            verifier = self._verifier if self._attempt == plan.attempt else None
        directory = plan.checkpoints.of(plan.chief.host)
        if is_url(directory):
            return None
        result, request = verify_files(plan)
        argv = [python, "-S", "-c", module_source(verified_module), "check", directory, result]
        if verifier is not None:
            argv += ["--request", request, "--wait", str(VERIFY_WAIT_S),
                     "--pgid", str(verifier.pgid)]
        runner = self.runner_for(plan.chief.host.name)
        try:
            out = runner.run(argv, timeout_s=VERIFY_WAIT_S + 30).stdout
            report: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
        except (OrchestratorError, ValueError, IndexError):
            return None
        return report

    def go(self, plan: ClusterPlan) -> dict[str, TaskHandle]:
        """Tell the warm tasks of ``plan``'s attempt to go with its TF_CONFIG, env and argv;
        the handles of those that went (the others start cold). Warm tasks left over are
        stopped."""
        self._wait_started()
        with self._lock:
            tasks = self._tasks if self._attempt == plan.attempt else {}
            self._tasks, self._verifier = {}, None
            self._attempt = max(self._attempt, plan.attempt)
            self._went = max(self._went, plan.attempt)  # a late starter stops its own tasks
        if not tasks:
            return {}

        def one(task: TaskPlan) -> tuple[str, str]:
            host, handle = tasks.get(task.key, ("", None))
            if handle is None or host != task.host.name or handle.rc_path != task.rc_path \
                    or task.argv[1:3] != ("-m", "worker"):
                return task.key, "cold"
            payload = json.dumps({"argv": list(task.argv[3:]), "env": dict(task.env),
                                  "cwd": task.cwd})
            go, rc = shlex.quote(go_path(task)), shlex.quote(handle.rc_path)
            script = (f"if {_ours(handle)} && {group_lives(handle.pgid)} && "
                      f"[ ! -f {rc} ]; then (umask 077 && cat >{go}.tmp) && mv -f {go}.tmp {go} "
                      f"&& echo go; else echo cold; fi")
            try:
                return task.key, self.runner_for(task.host.name).run(
                    script, input=payload).stdout.strip()
            except OrchestratorError:
                return task.key, "cold"

        with ThreadPoolExecutor(max_workers=min(32, len(plan.tasks))) as pool:
            answers = dict(pool.map(one, plan.tasks))
        went = {key: tasks[key][1] for key, answer in answers.items() if answer == "go"}
        self._stop([started for key, started in tasks.items() if key not in went])
        self.store.set_warm(self.run_id, [])
        return went

    def unusable(self, reason: str) -> None:
        """A warm task found the job's module unfit (it runs TensorFlow ops when imported): it
        starts cold in its place when told to go, and no more warm tasks are started."""
        if not self.off:
            self.off = reason
            self.say(f"warm tasks are off for this run: {reason}")

    def stop(self, *, settle: bool = False) -> None:
        """Stop every warm task (the run ended). With ``settle``, starts still under way end
        first, so that none of them starts (and writes its log) after this returns."""
        if settle:
            self._wait_started()
        with self._lock:
            self._attempt = max(self._attempt, 1 << 30)  # a starter still running stops its own
            tasks, self._tasks = self._tasks, {}
        if tasks:
            self._stop(list(tasks.values()))
            self.store.set_warm(self.run_id, [])

    # -- helpers ---------------------------------------------------------------------------
    def _wait_started(self) -> None:
        thread = self._thread
        if thread is not None:
            thread.join(START_WAIT_S)

    def _stop(self, tasks: list[Started]) -> None:
        def one(started: Started) -> None:
            host, handle = started
            # A host that does not answer: its warm task exits by itself (worker.warm.ORPHAN_S).
            with contextlib.suppress(OrchestratorError, StopIteration):
                self.launcher.stop(self.runner_for(host), handle, 0.0)

        if tasks:
            with ThreadPoolExecutor(max_workers=min(32, len(tasks))) as pool:
                list(pool.map(one, tasks))
