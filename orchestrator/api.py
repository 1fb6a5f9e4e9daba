"""The Python API: `Cluster` and `Run`. The CLI is a thin layer over these; notebooks use them directly."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from orchestrator import plan as planning
from orchestrator import spec as specs
from orchestrator.errors import StateError
from orchestrator.events import LineBuffer, parse_line
from orchestrator.hosts import Host
from orchestrator.plan import ClusterPlan
from orchestrator.providers import DownReport, Provider, for_spec
from orchestrator.remote.base import TaskHandle, TaskState
from orchestrator.spec import ClusterSpec
from orchestrator.state import ClusterRecord, RunRecord, Store
from orchestrator.supervisor import Listener, RunResult, Supervisor

HEARTBEAT_STALE_S = 10.0


@dataclass(frozen=True)
class ClusterStatus:
    name: str
    record: ClusterRecord | None
    runs: list[RunRecord]


class Cluster:
    """A cluster spec bound to its provider and the state store.

    Example::

        with Cluster.from_spec("cluster_specs/local.yaml") as cluster:
            run = cluster.train()
            print(run.metrics())
    """

    def __init__(
        self, spec: ClusterSpec, *, spec_path: str | Path | None = None, store: Store | None = None
    ) -> None:
        self.spec = spec
        self.spec_path = Path(spec_path).resolve() if spec_path else Path.cwd() / "<in-memory>"
        self.store = store or Store()
        self._provider: Provider | None = None

    @classmethod
    def from_spec(cls, source: str | Path | ClusterSpec, *, store: Store | None = None) -> Cluster:
        """From a spec file path (validated, errors as SpecError) or a ClusterSpec built in code."""
        if isinstance(source, ClusterSpec):
            return cls(source, store=store)
        return cls(specs.load(source), spec_path=source, store=store)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def workdir(self) -> Path:
        return specs.workdir_of(self.spec, self.spec_path)

    @property
    def provider(self) -> Provider:
        if self._provider is None:
            self._provider = for_spec(self.spec, self.spec_path)
        return self._provider

    # -- lifecycle -----------------------------------------------------------------------
    def up(self) -> list[Host]:
        """Create or attach to the hosts and prepare them; idempotent."""
        self._record("provisioning")
        hosts = self.provider.up()
        self._record("up", hosts)
        return hosts

    def plan(self) -> ClusterPlan:
        """What ``train`` would launch, without touching any host."""
        hosts = self.provider.hosts()
        return planning.build(
            self.spec,
            hosts,
            run_id="<next-run>",
            python=self.provider.python(hosts[0]),
            local_workdir=str(self.workdir),
        )

    def train(self, *, listener: Listener | None = None, wait: bool = True,
              attach: bool = False) -> Run:
        """Run the job, restarting the whole group on failure; with ``wait=False``, in a thread.

        With ``attach``, take over the cluster's running run whose controller died (its
        tasks kept training) and supervise it to the end.

        Raises:
            StateError: a run is already in progress (attach to it or stop it), or
                ``attach`` found nothing to attach to.
        """
        active = [r for r in self.store.runs(self.name, limit=20) if r.status == "running"]
        live = [r for r in active if _controller_alive(r)]
        if live:
            raise StateError(
                f"run {live[0].id} of cluster {self.name!r} is being supervised by a live "
                f"controller (pid {live[0].controller_pid})",
                fix=f"follow it with 'orchestrate logs {self.name} -f', or stop it with "
                f"'orchestrate down {self.spec_path.name}'",
            )
        if attach and not active:
            raise StateError(f"cluster {self.name!r} has no running run to attach to",
                             fix=f"start one with 'orchestrate train {self.spec_path.name}'")
        if active and not attach:
            raise StateError(
                f"run {active[0].id} of cluster {self.name!r} has no live controller; "
                "its tasks may still be training",
                fix=f"take it over with 'orchestrate train {self.spec_path.name} --attach', "
                f"or stop it with 'orchestrate down {self.spec_path.name}'",
            )
        if not attach:
            self.up()  # idempotent: re-syncs only what changed since the last up
        supervisor = Supervisor(
            self.spec, self.provider, self.store, workdir=self.workdir, listener=listener
        )
        run = Run(self, supervisor, active[0].id if attach else self.store.new_run(self.name),
                  attach=attach)
        if wait:
            run._run()
        else:
            run._start_thread()
        return run

    def down(self) -> DownReport:
        """Stop every task this cluster started, then remove what ``up`` made."""
        stopped = self.stop_tasks()
        report = self.provider.down()
        self._record("down")
        self.provider.close()
        return DownReport(report.removed, (*stopped, *report.stopped), report.notes)

    def stop_tasks(self) -> list[str]:
        """Stop the tasks of every run the store still marks running, wherever its controller is.

        The run is marked stopped first, so its supervisor (in this process or
        another) does not take the stopped tasks for a failure and restart them.
        """
        stopped = []
        hosts = {h.name: h for h in self.provider.hosts()}
        for run in self.store.runs(self.name, limit=50):
            if run.status != "running":
                continue
            self.store.finish_run(run.id, status="stopped", message="stopped by down")
            for attempt in run.attempts:
                for task in attempt.tasks:
                    host = hosts.get(str(task["host"]))
                    if host is None:
                        continue
                    runner = self.provider.runner(host)
                    handle = TaskHandle(host.name, int(task["pgid"]), str(task["log"]),
                                        str(task["rc"]))
                    if runner.poll(handle).state is TaskState.RUNNING:
                        runner.stop(handle, grace_s=self.spec.timeouts.stop_grace_s)
                        stopped.append(f"{run.id} {task['task']}")
        return stopped

    # -- inspection ----------------------------------------------------------------------
    def status(self) -> ClusterStatus:
        return ClusterStatus(self.name, self.store.get_cluster(self.name), self.store.runs(self.name))

    def run(self, run_id: str | None = None) -> RunRecord:
        """A recorded run: the newest when ``run_id`` is None."""
        if run_id is not None:
            return self.store.get_run(run_id)
        runs = self.store.runs(self.name, limit=1)
        if not runs:
            raise StateError(f"cluster {self.name!r} has no runs yet",
                             fix=f"start one with 'orchestrate train {self.spec_path.name}'")
        return runs[0]

    def logs(
        self, run_id: str | None = None, task: str | None = None, attempt: int | None = None,
        *, follow: bool = False, poll_s: float = 0.5,
    ) -> Iterator[tuple[str, str]]:
        """(task, line) pairs of a run's output, event lines left out.

        Without ``follow``: one attempt (the last by default). With ``follow``: every
        attempt from ``attempt`` (default: the last) on, as it is written, until the run ends.
        """
        record = self.run(run_id)
        hosts = {h.name: h for h in self.provider.hosts()}
        readers: dict[tuple[int, str], tuple[int, LineBuffer]] = {}
        first = attempt or max(len(record.attempts), 1)
        while True:
            record = self.store.get_run(record.id)
            chosen = record.attempts[first - 1 :] if follow else record.attempts[first - 1 : first]
            for a in chosen:
                for entry in a.tasks:
                    if task is None or entry["task"] == task:
                        yield from self._new_lines(hosts, a.number, entry, readers)
            if not follow or record.status != "running":
                return
            time.sleep(poll_s)

    def _new_lines(
        self, hosts: dict[str, Host], number: int, entry: dict[str, Any],
        readers: dict[tuple[int, str], tuple[int, LineBuffer]],
    ) -> Iterator[tuple[str, str]]:
        host = hosts.get(str(entry["host"]))
        if host is None:
            return
        key = (number, str(entry["task"]))
        offset, buffer = readers.get(key, (0, LineBuffer()))
        handle = TaskHandle(host.name, int(entry["pgid"]), str(entry["log"]), str(entry["rc"]))
        data, offset = self.provider.runner(host).read_log(handle, offset)
        readers[key] = (offset, buffer)
        for line in buffer.feed(data):
            if parse_line(line) is None:
                yield key[1], line

    def _record(self, status: str, hosts: list[Host] | None = None) -> None:
        self.store.put_cluster(
            self.name,
            provider=self.provider.kind,
            spec_path=str(self.spec_path),
            status=status,
            hosts=[{"name": h.name, "address": h.address} for h in hosts or []],
        )

    def __enter__(self) -> Cluster:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.down()


def _controller_alive(run: RunRecord) -> bool:
    """A controller heartbeats every 2 s; one silent for 10 s, or whose pid is gone, is dead.

    The store is per user and per machine, so the recorded pid is one of this machine's.
    """
    if run.heartbeat_at is None or time.time() - run.heartbeat_at >= HEARTBEAT_STALE_S:
        return False
    if run.controller_pid is None or run.controller_pid == os.getpid():
        return run.controller_pid is not None
    try:
        os.kill(run.controller_pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Run:
    """One training run; ``wait()`` for its result, or inspect it while it runs."""

    def __init__(self, cluster: Cluster, supervisor: Supervisor, run_id: str,
                 attach: bool = False) -> None:
        self.cluster = cluster
        self.supervisor = supervisor
        self.id = run_id
        self.attach = attach
        self._result: RunResult | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        try:
            self._result = self.supervisor.run(self.id, attach=self.attach)
        except BaseException as exc:
            self._error = exc
            if self._thread is None:
                raise

    def _start_thread(self) -> None:
        self._thread = threading.Thread(target=self._run, name="orchestrate-run", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> RunResult:
        """Block until the run ends; raises RunFailed if it failed."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"run {self.id} still running after {timeout}s")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def status(self) -> RunRecord:
        return self.cluster.store.get_run(self.id)

    def metrics(self) -> dict[str, float]:
        return self.wait().metrics

    def logs(self, task: str | None = None) -> list[str]:
        return [f"[{t}] {line}" for t, line in self.cluster.logs(self.id, task=task)]
