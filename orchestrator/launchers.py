"""How a task is started, stopped and found on its host: the step between the plan and the runner.

The plan fixes what a task runs (argv, env, cwd, paths); a launcher decides how: today a plain
process group (``process``); a container launcher wraps the same task in ``docker run`` and
stops the container, not just its client. The kind is kept in each task's record, so a later
controller (``--attach``, ``down``, ``logs``) finds and stops the task the way it was started.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from orchestrator import containers
from orchestrator.errors import StateError
from orchestrator.hosts import Host
from orchestrator.plan import TaskPlan
from orchestrator.remote.base import LaunchSpec, LogPoll, Runner, TaskHandle, TaskStatus
from orchestrator.spec import ClusterSpec, Container
from orchestrator.state import TaskRecord


class Launcher(ABC):
    """Starts, polls, inspects and stops tasks of one kind through a host's runner."""

    kind: str

    @abstractmethod
    def start(self, runner: Runner, task: TaskPlan) -> TaskHandle:
        """Start ``task`` detached on the runner's host."""

    @abstractmethod
    def poll(self, runner: Runner, handle: TaskHandle) -> TaskStatus:
        """Running, exited (with its code) or lost."""

    def poll_log(self, runner: Runner, handle: TaskHandle, offset: int, *,
                 status: bool = True) -> LogPoll:
        """The watch loop's poll: ``poll`` (unless not ``status``: then None), then the task's
        log from ``offset`` (``Runner.poll_log``'s bytes). A launcher whose ``poll`` is the
        runner's answers both in one round trip (``ProcessLauncher``); this default takes two,
        and reports no status of its own without ``status``."""
        got = self.poll(runner, handle) if status else None
        log = runner.poll_log(handle, offset, status=False)
        return LogPoll(got, log.data, log.next_offset, log.capped)

    @abstractmethod
    def stop(self, runner: Runner, handle: TaskHandle, grace_s: float) -> TaskStatus:
        """Stop the task for good: politely, then after ``grace_s`` by force."""

    @abstractmethod
    def process_states(self, runner: Runner, handle: TaskHandle, python: str,
                       timeout_s: float) -> str:
        """State letters of the task's processes ('T' = stopped); empty when none is left."""

    def waiting(self, runner: Runner, handle: TaskHandle) -> str | None:
        """Why the task has not started yet, as its scheduler says (``Runner.waiting``)."""
        return runner.waiting(handle)

    def queued(self, runner: Runner, handle: TaskHandle) -> str | None:
        """Why the task's group waits in a scheduler's queue (``Runner.queued``)."""
        return runner.queued(handle)

    def unplaced(self, runner: Runner, handle: TaskHandle) -> str | None:
        """Why no machine can take the task now (``Runner.unplaced``)."""
        return runner.unplaced(handle)

    def engine_failure(self, host: Host, exit_code: int | None,
                       output: str) -> containers.EngineFailure | None:
        """Whether a task that exited ``exit_code`` with ``output`` and no event never started
        because what starts it failed (a container engine), not the task: what it said and the
        fix on ``host``. None: the exit is the task's own."""
        return None

    def find(self, record: TaskRecord) -> TaskHandle:
        """The handle of a task from its attempt record (to re-attach, stop or read it)."""
        return TaskHandle(record.host, record.pgid, record.log, record.rc)

    def record(self, task: TaskPlan, handle: TaskHandle) -> TaskRecord:
        """What the store keeps of a started task, for ``find`` to use later."""
        return TaskRecord(task=task.key, host=task.host.name, endpoint=task.endpoint,
                          pgid=handle.pgid, log=handle.log_path, rc=handle.rc_path,
                          launcher=self.kind)


class ProcessLauncher(Launcher):
    """The task as a process group of its own session (``setsid``), its output in a log file."""

    kind = "process"

    def start(self, runner: Runner, task: TaskPlan) -> TaskHandle:
        return runner.start(self.launch_spec(task))

    @staticmethod
    def launch_spec(task: TaskPlan) -> LaunchSpec:
        """What ``start`` hands the runner: the task's argv, directory, files and env."""
        return LaunchSpec(task.argv, task.cwd, task.log_path, task.rc_path, task.env)

    def poll(self, runner: Runner, handle: TaskHandle) -> TaskStatus:
        return runner.poll(handle)

    def poll_log(self, runner: Runner, handle: TaskHandle, offset: int, *,
                 status: bool = True) -> LogPoll:
        return runner.poll_log(handle, offset, status=status)

    def stop(self, runner: Runner, handle: TaskHandle, grace_s: float) -> TaskStatus:
        return runner.stop(handle, grace_s=grace_s)

    def process_states(self, runner: Runner, handle: TaskHandle, python: str,
                       timeout_s: float) -> str:
        return runner.process_states(handle, python, timeout_s=timeout_s)


class ContainerLauncher(ProcessLauncher):
    """The task in a container of the spec's image (``docker run`` / ``podman run`` in the
    foreground of the same launch wrapper, see ``orchestrator/containers.py``).

    Poll and output are the client's; stop and ``process_states`` go to the container, which
    outlives a client that is killed. The kind is the engine's name, so a later controller
    finds the container with the engine that started it; it needs no spec to stop one.
    """

    def __init__(self, runtime: str, container: Container | None = None) -> None:
        self.kind = runtime
        self.container = container

    def start(self, runner: Runner, task: TaskPlan) -> TaskHandle:
        if self.container is None:
            raise StateError("a container task cannot be started without the spec's container")
        argv = containers.run_argv(self.container, task)
        return runner.start(LaunchSpec(tuple(argv), task.cwd, task.log_path, task.rc_path, task.env))

    def engine_failure(self, host: Host, exit_code: int | None,
                       output: str) -> containers.EngineFailure | None:
        if self.container is None:
            return None
        return containers.engine_failure(self.container, host, exit_code, output)

    def stop(self, runner: Runner, handle: TaskHandle, grace_s: float) -> TaskStatus:
        runner.run(containers.stop_script(self.kind, handle.rc_path, grace_s),
                   check=False, timeout_s=grace_s + 120)
        return runner.stop(handle, grace_s=min(grace_s, 10.0))

    def process_states(self, runner: Runner, handle: TaskHandle, python: str,
                       timeout_s: float) -> str:
        words = runner.run(containers.states_script(self.kind, handle.rc_path),
                           timeout_s=timeout_s).stdout
        return containers.state_letters(words)


class PodLauncher(ProcessLauncher):
    """A task that is a pod of the attempt's group (a Kubernetes JobSet): the provider starts
    every task at once (``Provider.start_group``); the pod's runner polls it from the pod
    watch, reads its log through the API and stops it by deleting it with the grace."""

    kind = "pod"

    def start(self, runner: Runner, task: TaskPlan) -> TaskHandle:
        raise StateError(f"task {task.key} is a pod of its attempt's JobSet: the provider "
                         "starts the group, not the launcher", fix="report this as a bug")


LAUNCHERS: dict[str, type[Launcher]] = {ProcessLauncher.kind: ProcessLauncher,
                                        PodLauncher.kind: PodLauncher}


def launcher_named(kind: str) -> Launcher:
    """The launcher that started a recorded task.

    Raises:
        StateError: the record names a launcher this version does not have.
    """
    if kind in containers.RUNTIMES:
        return ContainerLauncher(kind)
    cls = LAUNCHERS.get(kind)
    if cls is None:
        raise StateError(f"a task was started by launcher {kind!r}, which this version lacks",
                         fix=f"use the orchestrate version that started it (launchers here: "
                         f"{', '.join([*LAUNCHERS, *containers.RUNTIMES])})")
    return cls()


def launcher_for(spec: ClusterSpec) -> Launcher:
    """The launcher a spec's tasks start with: a pod on Kubernetes, else in a container of
    ``spec.container``'s image, else a plain process group."""
    if spec.provider.kind == "kubernetes":  # the image is the pods'
        return PodLauncher()
    if spec.container is not None:
        return ContainerLauncher(spec.container.runtime, spec.container)
    return ProcessLauncher()
