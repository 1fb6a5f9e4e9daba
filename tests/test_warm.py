"""Warm tasks: the next attempt's processes wait imported, so a relaunch imports no TensorFlow
after the failure; the chief's warm task verifies checkpoints as they are written; a recovery's
phases add up to its total. Real TensorFlow, real processes."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from helpers import events_in, release_run, write_spec
from hostlab import HostLab

from orchestrator import paths
from orchestrator.api import Cluster
from orchestrator.doctor import DoctorFailed
from orchestrator.errors import RunFailed
from orchestrator.events import Event, parse_line
from orchestrator.state import Store
from orchestrator.supervisor import RECOVERY_PHASES, recovery_phases
from orchestrator.view import RunView

REPO = Path(__file__).resolve().parent.parent

WARM = """\
name: {name}
workers: 2
ports: {{start: {port}, end: {end}}}
job: {{module: {module}, epochs: {epochs}, steps_per_epoch: 40, progress_every_steps: 1}}
checkpoint: {{every_steps: 10}}
retry: {{max_restarts: 2, backoff_initial_s: 0.2, warm_tasks: {warm}}}
timeouts: {{stop_grace_s: 1, startup_s: 180}}
"""


def spec_file(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(f"workdir: {REPO}\n" + textwrap.dedent(body))
    return path


def events_of(log: Path) -> list[Event]:
    if not log.is_file():
        return []
    return [e for e in (parse_line(line) for line in log.read_text(errors="replace").splitlines())
            if e is not None]


def task_log(cluster: str, run_id: str, attempt: int, task: str) -> Path:
    run = paths.RunPaths.of(str(paths.cluster_home(cluster)), run_id)
    role, index = task.split(":")
    return Path(run.task_stem(attempt, role, int(index)) + ".log")


class KillWhenWarm:
    """A listener: once attempt 2's warm tasks say ``ready`` (or ``warm_unusable``; None: at
    attempt 1's first step), SIGKILL worker:1 of attempt 1, then release the paced run."""

    def __init__(self, wait_for: str | None = "ready") -> None:
        self.pids: dict[tuple[int, str], int] = {}
        self.killed_at: float | None = None
        self.wait_for = wait_for
        self.messages: list[str] = []
        self._thread: threading.Thread | None = None

    def __call__(self, view: RunView, event: Event | None) -> None:
        self.messages[:] = view.messages
        if event is None:
            return
        if event.kind == "started":
            self.pids[(event.attempt, event.task)] = int(event.get("pid"))
        if event.kind == "progress" and event.attempt == 1 and self._thread is None:
            self._thread = threading.Thread(target=self._kill, args=(view.cluster, view.run_id),
                                            daemon=True)
            self._thread.start()

    def _kill(self, cluster: str, run_id: str) -> None:
        logs = [task_log(cluster, run_id, 2, t) for t in ("worker:0", "worker:1")]
        deadline = time.monotonic() + 120
        while self.wait_for is not None and time.monotonic() < deadline:
            if all(any(e.kind == self.wait_for for e in events_of(log)) for log in logs):
                break
            time.sleep(0.1)
        self.killed_at = time.time()
        os.kill(self.pids[(1, "worker:1")], signal.SIGKILL)
        assert release_run(str(paths.cluster_home(cluster)), run_id)

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()


def test_recovery_phases_add_up_to_the_total() -> None:
    cases = [  # boundaries: failed, detected, stopped, began, repaired, ckpt, started, connected, first step
        [10.0, 10.5, 10.6, 10.6, 10.6, 10.7, 10.9, 11.5, 12.0],
        [10.0, 10.5, None, 10.6, None, 10.7, 10.9, None, 12.0],  # missing boundaries: 0 s phases
        [10.0, 10.5, 10.6, 10.6, 10.6, 10.7, 10.9, 9.0, 12.0],  # a host clock behind this one
        [10.0, 10.5, 10.6, 10.6, 10.6, 10.7, 10.9, 13.0, 12.0],  # ... and one ahead
    ]
    for bounds in cases:
        phases = recovery_phases(bounds)
        assert list(phases) == list(RECOVERY_PHASES)
        assert all(seconds >= 0 for seconds in phases.values()), (bounds, phases)
        assert sum(phases.values()) == pytest.approx(2.0), (bounds, phases)
    assert recovery_phases(cases[0])["connect"] == pytest.approx(0.6)
    assert recovery_phases(cases[1])["stop"] == 0.0 and recovery_phases(cases[1])["backoff"] == \
        pytest.approx(0.1)
    with pytest.raises(ValueError):
        recovery_phases([1.0, 2.0])


@pytest.mark.tf
def test_a_relaunch_with_warm_tasks_imports_no_tensorflow_after_the_failure(
        tmp_path: Path, orchestrate_home: Path) -> None:
    path = spec_file(tmp_path, WARM.format(name="warm-local", port=24600, end=24640,
                                           module="tests.workloads.paced_digits", warm="true",
                                           epochs=3))
    killer = KillWhenWarm()
    result = Cluster.from_spec(path).train(listener=killer).wait()
    killer.join()
    assert result.status == "succeeded" and len(result.attempts) == 2
    first = result.attempts[0]
    assert (first.cause, first.failed_task) == ("crashed", "worker:1")
    assert len(set(result.digests.values())) == 1
    assert first.failed_at is not None and killer.killed_at is not None
    for task in ("worker:0", "worker:1"):
        events = {e.kind: e for e in events_of(task_log("warm-local", result.run_id, 2, task))}
        # The process that trained attempt 2 is the one that was waiting before the kill:
        # started and done importing TensorFlow and the module before the failure.
        assert {"warming", "ready", "go", "started", "finished"} <= set(events), sorted(events)
        assert events["warming"].get("pid") == events["started"].get("pid")
        assert events["go"].get("since") < events["ready"].time < first.failed_at
        assert events["ready"].time <= killer.killed_at
        assert events["go"].time >= first.failed_at
        assert events["ready"].get("rss_mib") > 0
    assert any("started 2 tasks (2 warm: told to go)" in m for m in killer.messages), \
        killer.messages
    # The chief's warm task had checked the newest checkpoint: nothing imports TF to do it.
    assert any("was verified by the chief's warm task" in m for m in killer.messages), \
        killer.messages
    # Its phases are recorded, add up to its total, and status --json shows them.
    assert list(first.phases) == list(RECOVERY_PHASES)
    assert first.recovery_s is not None
    assert sum(first.phases.values()) == pytest.approx(first.recovery_s, abs=1e-6)
    assert all(seconds >= 0 for seconds in first.phases.values())
    status = subprocess.run([sys.executable, "-m", "orchestrator.cli", "status", "warm-local",
                             "--json"], cwd=REPO, capture_output=True, text=True, timeout=60,
                            env={**os.environ, "ORCHESTRATE_HOME": str(orchestrate_home)})
    assert status.returncode == 0, status.stderr
    shown = json.loads(status.stdout)
    attempts = shown["clusters"][0]["runs"][0]["attempts"]
    assert attempts[0]["phases"] == pytest.approx(first.phases)
    # No warm task outlives the run: attempt 3's were stopped, and the record lists none.
    assert Store().get_run(result.run_id).warm == []
    leftovers = [e.get("pid") for t in ("worker:0", "worker:1")
                 for e in events_of(task_log("warm-local", result.run_id, 3, t))
                 if e.kind == "warming"]
    for pid in leftovers:
        assert not Path(f"/proc/{pid}").exists() or \
            Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"


@pytest.mark.tf
@pytest.mark.ssh
def test_warm_tasks_on_ssh_hosts_as_an_unprivileged_user_and_down_stops_them(
        hostlab: HostLab, tmp_path: Path, orchestrate_home: Path) -> None:
    """Two sshd hosts in their own network namespaces, logged into as a plain user: a killed
    worker's relaunch goes warm on both hosts; then, while attempt 3's warm tasks wait,
    ``down`` stops them along with the run."""
    hosts = hostlab.hosts(2)
    user = hostlab.plain_user()
    path = write_spec(tmp_path, hostlab, hosts, WARM.format(
        name="warm-ssh", port=24650, end=24690, module="tests.workloads.paced_digits",
        warm="true", epochs=8).replace("workers: 2\n", ""), user=user)
    cluster = Cluster.from_spec(path)
    roots = [paths.host_root(h.plain_home, "warm-ssh") for h in hosts]

    def logs(run_id: str, attempt: int) -> list[list[Event]]:
        return [events_in(h, paths.RunPaths.of(root, run_id).task_stem(attempt, "worker", i)
                          + ".log") for i, (h, root) in enumerate(zip(hosts, roots, strict=True))]

    def wait_for(run_id: str, attempt: int, kind: str) -> list[list[Event]]:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            found = logs(run_id, attempt)
            if all(any(e.kind == kind for e in events) for events in found):
                return found
            time.sleep(0.2)
        raise AssertionError(f"no {kind} event in every attempt-{attempt} log: "
                             f"{[[e.kind for e in events] for events in logs(run_id, attempt)]}; "
                             f"said: {said}")

    pids: dict[tuple[int, str], int] = {}
    state: dict[str, float] = {}
    said: list[str] = []

    def listener(view: RunView, event: Event | None) -> None:
        said[:] = view.messages
        if event is not None and event.kind == "started":
            pids[(event.attempt, event.task)] = int(event.get("pid"))

    run = cluster.train(listener=listener, wait=False)
    try:
        run_id = run.id
        wait_for(run_id, 2, "ready")
        state["killed_at"] = time.time()
        hosts[1].run(["kill", "-KILL", str(pids[(1, "worker:1")])])
        again = wait_for(run_id, 3, "ready")  # attempt 2 trains, paced; attempt 3's wait
        second = logs(run_id, 2)  # read now: down removes the cluster's files from the hosts
        warm_pids = [next(int(e.get("pid")) for e in events if e.kind == "warming")
                     for events in again]
    finally:
        report = cluster.down()
        with contextlib.suppress(RunFailed):
            run.wait(timeout=120)
    record = Store().get_run(run_id)
    assert record.status == "stopped" and record.warm == []
    first = record.attempts[0]
    assert (first.cause, first.failed_task) == ("crashed", "worker:1")
    assert first.failed_at is not None and first.failed_at >= state["killed_at"] - 1
    for events in second:
        kinds = {e.kind: e for e in events}
        assert {"warming", "ready", "go", "started"} <= set(kinds), sorted(kinds)
        assert kinds["warming"].get("pid") == kinds["started"].get("pid")
        # (failed_at comes from the rc file's mtime, whole seconds over SSH: the kill's time)
        assert kinds["ready"].time <= state["killed_at"] <= kinds["go"].time
    assert sum(first.phases.values()) == pytest.approx(first.recovery_s or -1, abs=1e-6)
    # down stopped the waiting warm tasks too: no process of theirs is left on either host.
    for h, pid in zip(hosts, warm_pids, strict=True):
        assert h.run(["sh", "-c", f"kill -0 {pid} 2>/dev/null && echo alive || echo gone"]
                     ).stdout.strip() == "gone"
    # ... and says so: attempt 2's two tasks and attempt 3's two warm ones.
    assert sorted(line for line in report.stopped if line.startswith(run_id)) == \
        [f"{run_id} worker:0", f"{run_id} worker:0", f"{run_id} worker:1", f"{run_id} worker:1"]


@pytest.mark.tf
def test_a_module_that_runs_ops_at_import_turns_warm_tasks_off_and_starts_cold(
        tmp_path: Path, orchestrate_home: Path) -> None:
    """The first attempt's tasks start warm while the doctor checks: importing the module
    starts TensorFlow's runtime, so each waits unfit and at the go starts the task afresh in its
    place; no warm task is started for a later attempt, and the relaunch starts cold."""
    path = spec_file(tmp_path, WARM.format(name="warm-eager", port=24700, end=24740,
                                           module="tests.workloads.eager_digits", warm="true",
                                           epochs=3))
    killer = KillWhenWarm(wait_for=None)
    result = Cluster.from_spec(path).train(listener=killer).wait()
    killer.join()
    assert result.status == "succeeded" and len(result.attempts) == 2
    assert len(set(result.digests.values())) == 1
    assert any(m.startswith("warm tasks are off for this run: importing "
                            "tests.workloads.eager_digits runs TensorFlow ops")
               for m in killer.messages), killer.messages
    for task in ("worker:0", "worker:1"):
        events = events_of(task_log("warm-eager", result.run_id, 1, task))
        kinds = [e.kind for e in events]
        # it waited unfit, and at the go started the task afresh in its place
        assert "ready" not in kinds and kinds.index("warm_unusable") < kinds.index("go") < \
            kinds.index("started"), kinds
        assert next(e for e in events if e.kind == "go").get("cold") is True
        # the relaunch started cold: no warm task was started for attempt 2
        again = [e.kind for e in events_of(task_log("warm-eager", result.run_id, 2, task))]
        assert "warming" not in again and "started" in again and "finished" in again, again


FIRST = """\
name: {name}
workers: 2
ports: {{start: {port}, end: {end}}}
job: {{module: examples.digits, epochs: 1, steps_per_epoch: 5, progress_every_steps: 1}}
checkpoint: {{every_steps: 5{dir}}}
timeouts: {{stop_grace_s: 1, startup_s: 180}}
"""


def warming_now(cluster: str) -> tuple[str, dict[str, int]]:
    """While the doctor runs: the cluster's one run (recorded before the doctor) and the pid of
    each first-attempt task once it has said ``warming`` (within 60 s)."""
    (run,) = Store().runs(cluster)
    assert run.status == "running" and run.attempts == []
    assert run.message == "the doctor checks every host; the first attempt's tasks start meanwhile"
    deadline = time.monotonic() + 60
    while True:
        found = {t: next((int(e.get("pid")) for e in events_of(task_log(cluster, run.id, 1, t))
                          if e.kind == "warming"), 0) for t in ("worker:0", "worker:1")}
        if all(found.values()) or time.monotonic() > deadline:
            return run.id, found
        time.sleep(0.05)


def gone(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().split(") ")[1][0] == "Z"


@pytest.mark.tf
def test_the_first_attempt_starts_warm_while_the_doctor_checks_and_goes_after_it(
        tmp_path: Path, orchestrate_home: Path) -> None:
    """The doctor and the tasks' start overlap: by the time the doctor's report is in, both
    tasks of attempt 1 are running (importing TensorFlow); they go once it passed, as the
    processes that train."""
    path = spec_file(tmp_path, FIRST.format(name="warm-first", port=24750, end=24790, dir=""))
    seen: dict[str, object] = {}
    said: list[str] = []

    def on_doctor(report: object) -> None:
        seen["run"], seen["pids"] = warming_now("warm-first")

    def listener(view: RunView, event: Event | None) -> None:
        said[:] = view.messages

    result = Cluster.from_spec(path).train(on_doctor=on_doctor, listener=listener).wait()
    assert result.status == "succeeded" and result.run_id == seen["run"]
    assert len(result.attempts) == 1
    pids = seen["pids"]
    assert isinstance(pids, dict) and all(pids.values()), pids
    for task in ("worker:0", "worker:1"):
        events = {e.kind: e for e in events_of(task_log("warm-first", result.run_id, 1, task))}
        assert {"warming", "go", "started", "finished"} <= set(events), sorted(events)
        assert events["go"].get("cold") is False
        assert events["started"].get("pid") == pids[task]  # the process started before the report
    assert any("started 2 tasks (2 warm: told to go)" in m for m in said), said
    assert Store().get_run(result.run_id).warm == []


def warm_processes(run_dir: Path) -> list[int]:
    """Pids of live processes started as warm tasks of the run at ``run_dir``."""
    marker = f"\0ORCHESTRATE_WARM={run_dir}/".encode()
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if marker in b"\0" + Path(entry.path, "environ").read_bytes() and \
                        not gone(int(entry.name)):
                    found.append(int(entry.name))
    return found


@pytest.mark.tf
@pytest.mark.parametrize("how", ["blocking problem", "ctrl-c", "ctrl-c at once"])
def test_a_doctor_that_stops_the_run_stops_its_first_tasks_and_leaves_no_run(
        tmp_path: Path, orchestrate_home: Path, how: str) -> None:
    """The doctor finds a blocking problem (checkpoints cannot be written under /proc), or a
    Ctrl-C comes while it checks (once the tasks run, or at once, while they may still be
    starting): the first attempt's warm tasks are stopped, their run directory removed, and no
    run is recorded, as before they started early."""
    checkpoint = ", dir: /proc/orchestrate-no-such-dir" if how == "blocking problem" else ""
    path = spec_file(tmp_path, FIRST.format(name="warm-refused", port=24800, end=24840,
                                            dir=checkpoint))
    seen: dict[str, object] = {}

    def on_doctor(report: object) -> None:
        if how == "ctrl-c at once":
            (seen["run"],) = (r.id for r in Store().runs("warm-refused"))
            raise KeyboardInterrupt
        seen["run"], seen["pids"] = warming_now("warm-refused")
        if how == "ctrl-c":
            raise KeyboardInterrupt

    expected: type[BaseException] = DoctorFailed if how == "blocking problem" \
        else KeyboardInterrupt
    with pytest.raises(expected) as raised:
        Cluster.from_spec(path).train(on_doctor=on_doctor)
    if how == "blocking problem":
        assert "/proc/orchestrate-no-such-dir" in str(raised.value)
    pids = seen.get("pids", {})
    assert isinstance(pids, dict)
    assert how == "ctrl-c at once" or (len(pids) == 2 and all(pids.values())), pids
    assert all(gone(pid) for pid in pids.values()), pids
    assert Store().runs("warm-refused") == []
    run_dir = Path(paths.RunPaths.of(str(paths.cluster_home("warm-refused")), str(seen["run"])
                                     ).run_dir)
    time.sleep(1)  # a start still under way would have made its log (and the directory) by now
    assert not run_dir.exists()
    assert warm_processes(run_dir) == []


def test_a_warm_task_with_no_predecessor_waits_for_its_go_only_so_long(tmp_path: Path) -> None:
    """A first-attempt warm task whose controller never says go (killed while its doctor ran)
    exits by itself after ORCHESTRATE_WARM_WAIT_S, saying why, with the code a go written
    too late reads as no task."""
    go = tmp_path / "worker-0.go"
    proc = subprocess.run(
        [sys.executable, "-m", "worker", "command", "--", "true"], cwd=REPO, capture_output=True,
        text=True, timeout=60, env={**os.environ, "ORCHESTRATE_WARM": str(go),
                                    "ORCHESTRATE_WARM_WAIT_S": "0.5"})
    events = [e for e in map(parse_line, proc.stdout.splitlines()) if e is not None]
    assert proc.returncode == 76, proc.stdout + proc.stderr
    assert [e.kind for e in events] == ["warming", "warm_unusable", "warm_expired"]
    assert events[-1].get("reason") == "no go within 0.5s of its start"


def test_warm_tasks_that_finish_starting_after_their_go_are_stopped_not_kept(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A relaunch waits START_WAIT_S for its warm tasks to be started; past it, the attempt
    starts cold. Warm tasks whose start ends after that are stopped at once, never recorded as
    the run's warm tasks (they would wait for a go that never comes, or, in a container, hold
    the name the cold task needs)."""
    from types import SimpleNamespace
    from typing import Any, cast

    from orchestrator import warm
    from orchestrator.launchers import ProcessLauncher
    from orchestrator.remote.base import TaskHandle

    monkeypatch.setattr(warm, "START_WAIT_S", 0.2)
    release, stopped = threading.Event(), []

    class SlowLauncher(ProcessLauncher):
        def start(self, runner: Any, task: Any) -> TaskHandle:
            release.wait(30)
            return TaskHandle(task.host.name, 4242, task.rc_path + ".log", task.rc_path)

        def stop(self, runner: Any, handle: TaskHandle, grace_s: float) -> Any:
            stopped.append(handle.rc_path)

    @dataclasses.dataclass(frozen=True)
    class Task:  # what WarmTasks reads of a TaskPlan
        key: str
        rc_path: str
        host: Any = dataclasses.field(default_factory=lambda: SimpleNamespace(name="h0"))
        env: dict[str, str] = dataclasses.field(default_factory=dict)
        argv: tuple[str, ...] = ("python", "-m", "worker")

    runner = SimpleNamespace(run=lambda *a, **k: SimpleNamespace(stdout="go"))
    tasks = [Task(f"worker:{i}", f"/r/w{i}.rc") for i in range(2)]
    plan = cast(Any, SimpleNamespace(
        attempt=2, tasks=tasks, chief=tasks[0], chief_key="worker:0",
        checkpoints=SimpleNamespace(of=lambda h: "gs://b/ckpt")))
    store = Store(tmp_path / "state.db")
    said: list[str] = []
    keeper = warm.WarmTasks(store, "run-1", SlowLauncher(), lambda name: cast(Any, runner),
                            said.append)
    saved: list[object] = []
    monkeypatch.setattr(store, "set_warm", lambda run_id, records: saved.append(records))

    keeper.start(plan, {})
    assert keeper.go(plan) == {}  # not started within START_WAIT_S: the attempt starts cold
    release.set()
    assert keeper._thread is not None
    keeper._thread.join(30)
    assert sorted(stopped) == ["/r/w0.rc", "/r/w1.rc"]
    assert [r for r in saved if r] == []  # never the run's warm tasks
    keeper.stop()
    assert sorted(stopped) == ["/r/w0.rc", "/r/w1.rc"]  # nothing left to stop twice
