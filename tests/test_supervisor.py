"""The supervisor with real local processes (command mode, no TensorFlow): restart all, budgets,
causes, timeouts. Only the backoff sleep is replaced, so the tests do not wait for it."""

from __future__ import annotations

import os
import signal
import stat
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from orchestrator import spec
from orchestrator.errors import RunFailed
from orchestrator.events import Event
from orchestrator.providers.local import LocalProvider
from orchestrator.remote.base import TaskHandle, TaskStatus
from orchestrator.remote.local import LocalRunner, live_group_members
from orchestrator.state import Store
from orchestrator.supervisor import Supervisor
from orchestrator.view import RunView


def make(tmp_path: Path, script: str, extra: str = "") -> tuple[spec.ClusterSpec, Path]:
    (tmp_path / "job.py").write_text(textwrap.dedent(script))
    text = (
        "name: sup\nworkers: 2\njob:\n  command: python job.py\n"
        "retry: {max_restarts: 2, backoff_initial_s: 1, backoff_max_s: 8}\n"
        "timeouts: {startup_s: 60, stop_grace_s: 0.5}\n" + extra
    )
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return spec.load(path), path


def supervise(s: spec.ClusterSpec, path: Path, sleeps: list[float], listener: object = None
              ) -> tuple[Supervisor, Store, str]:
    store = Store()
    sup = Supervisor(s, LocalProvider(s, path), store, workdir=path.parent,
                     backoff_sleep=sleeps.append, poll_s=0.05,
                     listener=listener)  # type: ignore[arg-type]
    return sup, store, store.new_run(s.name)


CRASH_ONCE = """
import os, sys, time
if os.environ["ORCHESTRATE_ATTEMPT"] == "1":
    if os.environ["ORCHESTRATE_TASK"] == "worker:1":
        sys.exit(3)
    time.sleep(60)  # a peer left waiting: the supervisor must stop it
print("done", os.environ["ORCHESTRATE_TASK"], os.environ["ORCHESTRATE_ATTEMPT"])
"""


def test_one_crashed_task_restarts_the_whole_group(tmp_path: Path) -> None:
    s, path = make(tmp_path, CRASH_ONCE)
    sleeps: list[float] = []
    sup, store, run_id = supervise(s, path, sleeps)
    result = sup.run(run_id)

    assert result.status == "succeeded"
    first, second = store.attempts(run_id)
    assert (first.status, first.cause, first.failed_task, first.exit_code) == (
        "failed", "crashed", "worker:1", 3)
    assert "exited 3" in first.detail
    assert second.status == "succeeded" and second.cause == ""
    assert sleeps == [0.0]  # the first restart after a crash starts at once
    waiting_peer = next(t for t in first.tasks if t.task == "worker:0")
    assert live_group_members(waiting_peer.pgid) == []  # stopped, not left behind
    assert store.get_run(run_id).status == "succeeded"


def test_spent_budget_fails_with_a_report_of_every_attempt(tmp_path: Path) -> None:
    s, path = make(tmp_path, "import os, sys\n"
                   "print('boom', os.environ['ORCHESTRATE_ATTEMPT'], file=sys.stderr)\n"
                   "sys.exit(7)\n")  # a different failure each time: retried to the end
    sleeps: list[float] = []
    sup, store, run_id = supervise(s, path, sleeps)
    with pytest.raises(RunFailed) as info:
        sup.run(run_id)
    report = str(info.value)
    assert "failed after 3 attempt(s)" in report
    for n in (1, 2, 3):
        assert f"attempt {n}: crashed in worker:" in report
    assert info.value.fix and "orchestrate logs" in info.value.fix
    assert len(sleeps) == 2 and sleeps[0] == 0.0 and sleeps[1] > 0  # at once, then backoff
    assert store.get_run(run_id).status == "failed"
    assert [a.exit_code for a in store.attempts(run_id)] == [7, 7, 7]


def test_command_failing_the_same_way_twice_right_after_start_is_not_retried_again(
        tmp_path: Path) -> None:
    """A command job reports no steps: the same failure twice in a row, each soon after its
    start, is deterministic (e.g. tasks restoring different checkpoints), not bad luck."""
    s, path = make(tmp_path, "import sys; print('boom', file=sys.stderr); sys.exit(7)\n")
    sleeps: list[float] = []
    sup, store, run_id = supervise(s, path, sleeps)
    with pytest.raises(RunFailed) as info:
        sup.run(run_id)
    attempts = store.attempts(run_id)
    assert [a.cause for a in attempts] == ["crashed", "user_error"]
    assert "fails the same way before the first step every time" in attempts[1].detail
    assert "failed after 2 attempt(s)" in str(info.value)
    assert len(sleeps) == 1


def test_task_killed_as_a_whole_group_is_a_crash(tmp_path: Path) -> None:
    s, path = make(tmp_path, CRASH_ONCE.replace("sys.exit(3)", "time.sleep(60)"))
    killed: list[int] = []

    def kill_worker_1(view: RunView, event: Event | None) -> None:
        if event and event.kind == "started" and event.task == "worker:1" and not killed:
            pgid = os.getpgid(int(event.get("pid")))
            killed.append(pgid)
            os.killpg(pgid, signal.SIGKILL)

    sleeps: list[float] = []
    sup, store, run_id = supervise(s, path, sleeps, kill_worker_1)
    # the point is attempt 1's cause: no retries
    sup.spec = s.model_copy(update={"retry": s.retry.model_copy(update={"max_restarts": 0})})
    with pytest.raises(RunFailed):
        sup.run(run_id)
    first = store.attempts(run_id)[0]
    assert (first.cause, first.failed_task) == ("crashed", "worker:1")
    assert "vanished" in first.detail


def test_startup_timeout_when_a_task_never_reports(tmp_path: Path) -> None:
    silent = tmp_path / "silent-python"
    silent.write_text("#!/bin/sh\nexec sleep 60\n")
    silent.chmod(silent.stat().st_mode | stat.S_IEXEC)
    s, path = make(tmp_path, "print('never runs')\n",
                   f"provider: {{kind: local, python: {silent}}}\n")
    s = s.model_copy(update={
        "timeouts": s.timeouts.model_copy(update={"startup_s": 1.0}),
        "retry": s.retry.model_copy(update={"max_restarts": 0}),
    })
    sup, store, run_id = supervise(s, path, [])
    started = time.monotonic()
    with pytest.raises(RunFailed) as info:
        sup.run(run_id)
    assert time.monotonic() - started < 30
    attempt = store.attempts(run_id)[0]
    assert attempt.cause == "startup_timeout"
    assert "did not reach the first step" in attempt.detail
    assert "timeouts.startup_s" in (info.value.fix or "")
    for task in attempt.tasks:
        assert live_group_members(task.pgid) == []


def test_worker_events_prefix_matches_the_parser() -> None:
    from orchestrator import events
    from worker import events as worker_events

    assert events.PREFIX == worker_events.PREFIX
    assert sys.modules["orchestrator.events"].parse_line(
        worker_events.PREFIX + '{"event": "progress", "task": "worker:0", "step": 3}'
    ) == Event("progress", "worker:0", 0, 0.0, {"step": 3})


LAST_WORDS = """
import os, pathlib, sys, time
marker = pathlib.Path(os.environ["MARKER"])
if os.environ["ORCHESTRATE_TASK"] == "worker:0":
    print('@orchestrate {"event": "checkpoint", "step": 7, "task": "worker:0", "attempt": 1}',
          flush=True)
    marker.touch()
    time.sleep(60)  # stopped by the supervisor when worker:1 fails
while not marker.exists():
    time.sleep(0.02)
time.sleep(0.3)
sys.exit(3)
"""


class SlowLinkRunner(LocalRunner):
    """The chief's host behind a slow link: the log read that carries its checkpoint event
    returns only once the supervisor has begun to stop the tasks (the poll is in flight when
    the failure is seen). Everything else is the real local runner."""

    def __init__(self, chief_log: str) -> None:
        super().__init__("slow-link")
        self.chief_log = chief_log
        self.stopping = threading.Event()
        self.held = threading.Event()

    def read_log(self, handle: TaskHandle, offset: int) -> tuple[bytes, int]:
        data, next_offset = super().read_log(handle, offset)
        if handle.log_path.endswith(self.chief_log) and b'"checkpoint"' in data:
            self.held.set()
            self.stopping.wait(30)
        return data, next_offset

    def stop(self, handle: TaskHandle, grace_s: float = 5.0) -> TaskStatus:
        self.stopping.set()
        return super().stop(handle, grace_s)


def test_the_last_event_before_a_task_is_killed_is_in_the_attempt_record(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s, path = make(tmp_path, LAST_WORDS, "env: {MARKER: " + str(tmp_path / "printed") + "}\n")
    s = s.model_copy(update={"retry": s.retry.model_copy(update={"max_restarts": 0})})
    runner = SlowLinkRunner("attempt-1/worker-0.log")
    provider = LocalProvider(s, path)
    monkeypatch.setattr(provider, "runner", lambda host: runner)
    store = Store()
    sup = Supervisor(s, provider, store, workdir=path.parent, backoff_sleep=lambda _: None,
                     poll_s=0.05)
    run_id = store.new_run(s.name)
    with pytest.raises(RunFailed):
        sup.run(run_id)

    assert runner.held.is_set()  # the chief's event was still in flight when worker:1 failed
    (attempt,) = store.attempts(run_id)
    assert (attempt.cause, attempt.failed_task) == ("crashed", "worker:1")
    chief = next(t for t in attempt.tasks if t.task == "worker:0")
    assert chief.checkpoint_step == 7
    # After the checkpoint, the chief printed only the command wrapper's report of its death.
    assert chief.last_event in ("checkpoint", "error") and chief.last_event_at is not None


# -- backoff -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("failures", "cause", "low", "high"), [
    (1, "crashed", 0.0, 0.0),  # a crash: the first restart starts at once
    (1, "preempted", 0.0, 0.0),
    (2, "crashed", 0.16, 0.24),  # then as any repeated failure: initial, 2x initial, ...
    (3, "crashed", 0.32, 0.48),
    (1, "hung", 0.16, 0.24),  # what may clear up with time waits from the first restart
    (1, "host_lost", 0.16, 0.24),
    (2, "port_conflict", 0.32, 0.48),
    (9, "crashed", 0.8, 1.0),  # capped at backoff_max_s, jittered below it
])
def test_backoff_waits_in_proportion_to_its_delay(failures: int, cause: str, low: float,
                                                  high: float) -> None:
    from orchestrator.causes import Cause
    from orchestrator.supervisor import backoff

    for draw in (lambda a, b: a, lambda a, b: b, lambda a, b: (a + b) / 2):
        wait = backoff(failures, Cause(cause), 0.2, 1.0, draw=draw)
        assert low - 1e-9 <= wait <= high + 1e-9
    spread = {round(backoff(failures, Cause(cause), 0.2, 1.0), 6) for _ in range(50)}
    assert max(spread) <= high + 1e-9 and min(spread) >= low - 1e-9


def test_a_ctrl_c_between_the_launch_and_the_watch_still_ends_the_attempt(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C lands between the bytecodes of one step and the next (seen under load: after
    every task had started, before the watch began); no real part can aim it there, so the
    watch is made to raise it as it is entered. Every task started is stopped and recorded."""
    s, path = make(tmp_path, "import time\ntime.sleep(60)\n")
    sup, store, run_id = supervise(s, path, [])

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(sup, "_supervise", interrupted)
    with pytest.raises(KeyboardInterrupt):
        sup.run(run_id)
    (attempt,) = store.attempts(run_id)
    assert attempt.status == "cancelled" and len(attempt.tasks) == 2
    assert all(live_group_members(t.pgid) == [] for t in attempt.tasks)
    assert store.get_run(run_id).status == "cancelled"
