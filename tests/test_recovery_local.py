"""Nothing is lost: a controller that dies and re-attaches, checkpoints that do not restore, and
code that fails the same way every time. Real TensorFlow, local workers. (An exact resume after
every kind of fault, bit for bit, is the chaos soak's: benchmarks/chaos.py, run by
test_benchmarks.py.)"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import release_run

from orchestrator import paths
from orchestrator.api import Cluster
from orchestrator.errors import RunFailed
from orchestrator.events import Event, parse_line
from orchestrator.providers.local import LocalProvider
from orchestrator.remote.local import live_group_members
from orchestrator.spec import load
from orchestrator.state import Store
from orchestrator.supervisor import Supervisor
from orchestrator.view import RunView

REPO = Path(__file__).resolve().parent.parent


def spec_file(tmp_path: Path, body: str, name: str = "cluster.yaml") -> Path:
    path = tmp_path / name
    path.write_text(f"workdir: {REPO}\n" + textwrap.dedent(body))
    return path


def release(view: RunView) -> None:
    """Let a ``tests.workloads.paced_digits`` run go at full speed."""
    release_run(str(paths.cluster_home(view.cluster)), view.run_id)


def kill_at(task: str, step: int, pids: dict[str, int], log: list[str]) -> object:
    """A listener that SIGKILLs ``task`` once attempt 1 reports ``step``, then releases the run
    (a ``tests.workloads.paced_digits`` one is paced until then, so the kill lands mid-run
    however slow the machine or late the event)."""
    def listener(view: RunView, event: Event | None) -> None:
        if event is None or event.attempt != 1:
            if event is None and view.messages:
                log.append(view.messages[-1])
            return
        if event.kind == "started":
            pids[event.task] = int(event.get("pid"))
        if event.kind == "progress" and event.task == task and event.get("step") >= step \
                and "killed" not in pids:
            pids["killed"] = int(event.get("step"))
            os.kill(pids[task], signal.SIGKILL)
            release(view)
    return listener


@pytest.mark.tf
def test_newest_checkpoint_that_does_not_restore_falls_back_to_the_one_before(
        tmp_path: Path) -> None:
    path = spec_file(tmp_path, """\
        name: corrupt
        workers: 2
        job: {module: tests.workloads.paced_digits, epochs: 2, steps_per_epoch: 30,
              progress_every_steps: 1}
        checkpoint: {every_steps: 10}
        retry: {max_restarts: 2, backoff_initial_s: 0.2}
        timeouts: {stop_grace_s: 1}
        """)
    cluster = Cluster.from_spec(path)
    pids: dict[str, int] = {}
    said: list[str] = []
    corrupted: list[str] = []
    inner = kill_at("worker:1", 25, pids, said)

    def listener(view: RunView, event: Event | None) -> None:
        inner(view, event)  # type: ignore[operator]
        if event is None and view.messages and view.messages[-1].startswith("restarting") \
                and not corrupted:
            ckpt = Path(Store().get_run(view.run_id).attempts[0].tasks[0].log).parents[2]
            newest = sorted((ckpt / "checkpoints" / "chief").glob("ckpt-*.data-*"),
                            key=lambda p: int(p.name.split("-")[1].split(".")[0]))[-1]
            newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # torn write
            corrupted.append(newest.name)

    result = cluster.train(listener=listener).wait()
    assert corrupted, "the newest checkpoint was never corrupted"
    assert any("does not restore" in m and "falling back" in m for m in said), said
    first, second = result.attempts
    checkpoints = [e.get("step") for e in _events(first.tasks[0].log) if e.kind == "checkpoint"]
    assert second.resumed_from_step == checkpoints[-2]  # the one before the torn newest
    assert result.status == "succeeded" and len(set(result.digests.values())) == 1


@pytest.mark.tf
def test_controller_killed_mid_run_then_reattached_loses_nothing(
        tmp_path: Path, orchestrate_home: Path) -> None:
    path = spec_file(tmp_path, """\
        name: attach
        workers: 2
        job: {module: examples.digits, epochs: 8, steps_per_epoch: 50, progress_every_steps: 1}
        checkpoint: {every_steps: 25}
        """)
    env = {**os.environ, "ORCHESTRATE_HOME": str(orchestrate_home)}
    cli = [sys.executable, "-m", "orchestrator.cli"]
    controller = subprocess.Popen([*cli, "train", str(path)], env=env, cwd=REPO,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    store = Store(orchestrate_home / "state.db")
    log = _wait_for_step(store, "attach", 20)
    controller.kill()  # the controller dies (laptop closed, ssh dropped); the tasks do not
    controller.wait()

    run = store.runs("attach")[0]
    assert run.status == "running"
    tasks = run.attempts[0].tasks
    step_at_kill = _last_step(log)
    time.sleep(2)
    assert all(live_group_members(t.pgid) for t in tasks)  # still training
    assert _last_step(log) > step_at_kill

    again = subprocess.run([*cli, "train", str(path)], env=env, cwd=REPO, capture_output=True,
                           text=True, timeout=60)
    assert again.returncode == 2 and "--attach" in again.stderr and "Traceback" not in again.stderr

    attach = subprocess.run([*cli, "train", str(path), "--attach"], env=env, cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert attach.returncode == 0, attach.stdout + attach.stderr
    assert f"attached to attempt 1 of run {run.id}" in attach.stdout
    assert "succeeded" in attach.stdout
    record = store.get_run(run.id)
    assert record.status == "succeeded" and len(record.attempts) == 1  # no restart was needed
    assert record.attempts[0].last_step == 400 and Path(record.model_path).is_file()


def test_the_same_failure_before_the_first_step_twice_is_a_user_error(tmp_path: Path) -> None:
    broken = tmp_path / "broken-python"
    broken.write_text("#!/bin/sh\necho 'ImportError: libcudart.so.12: cannot open' >&2\nexit 1\n")
    broken.chmod(broken.stat().st_mode | stat.S_IEXEC)
    path = tmp_path / "c.yaml"
    path.write_text(f"name: same\nworkers: 2\nprovider: {{kind: local, python: {broken}}}\n"
                    "job: {command: python train.py}\nretry: {max_restarts: 5}\n")
    spec = load(path)
    store = Store()
    waits: list[float] = []
    supervisor = Supervisor(spec, LocalProvider(spec, path), store, workdir=tmp_path,
                            backoff_sleep=waits.append, poll_s=0.05)
    run_id = store.new_run("same")
    with pytest.raises(RunFailed) as info:
        supervisor.run(run_id)
    attempts = store.attempts(run_id)
    assert [a.cause for a in attempts] == ["crashed", "user_error"]  # not all 6 attempts
    assert waits == [0.0]  # the restart after a crash started at once (no backoff)
    assert "fails the same way before the first step" in attempts[1].detail
    assert "libcudart.so.12" in str(info.value)  # the evidence is in the report


def test_per_cause_budget_stops_before_max_restarts(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(  # a different failure each time: not a user error
        "import os, sys, time\ntime.sleep(0.3)\n"
        "print('attempt', os.environ['ORCHESTRATE_ATTEMPT'], file=sys.stderr)\nsys.exit(4)\n")
    path = tmp_path / "c.yaml"
    path.write_text("name: budget\nworkers: 1\njob: {command: python job.py}\n"
                    "retry: {max_restarts: 5, per_cause: {crashed: 1}}\n")
    spec = load(path)
    store = Store()
    supervisor = Supervisor(spec, LocalProvider(spec, path), store, workdir=tmp_path,
                            backoff_sleep=lambda s: None, poll_s=0.05)
    run_id = store.new_run("budget")
    with pytest.raises(RunFailed):
        supervisor.run(run_id)
    assert [a.cause for a in store.attempts(run_id)] == ["crashed", "crashed"]


def _events(log: object) -> list[Event]:
    text = Path(str(log)).read_text()
    return [e for e in map(parse_line, text.splitlines()) if e is not None]


def _last_step(log: Path) -> int:
    steps = [int(e.get("step")) for e in _events(log) if e.kind == "progress"]
    return max(steps, default=0)


def _wait_for_step(store: Store, cluster: str, step: int) -> Path:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        runs = store.runs(cluster)
        # the attempt is recorded before its tasks start, and each task as it starts
        chief = [t for t in (runs[0].attempts[0].tasks if runs and runs[0].attempts else [])
                 if t.task == "worker:0"]
        if chief:
            log = Path(str(chief[0].log))
            if log.exists() and _last_step(log) >= step:
                return log
        time.sleep(0.2)
    raise AssertionError(f"{cluster} never reached step {step}")
