"""The watch loop's polls, with the supervisor and real local tasks (command mode, no TensorFlow).

While a task's output keeps coming its polls read the log alone (and the exit code its wrapper
records), not whether its process group lives; the end of a task is still seen: an exit at
once, a group killed as a whole once its log goes quiet, and one that vanished while a process
outside it goes on writing its log at the next periodic full poll. Only the launcher is
wrapped, to note each poll; it polls for real.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers import CountingRunner
from hostlab import HostLab, LabHost

from orchestrator import spec, watch
from orchestrator.causes import Cause
from orchestrator.errors import RunFailed
from orchestrator.events import Event
from orchestrator.hosts import Host
from orchestrator.launchers import ProcessLauncher
from orchestrator.plan import TaskPlan
from orchestrator.providers.local import LocalProvider
from orchestrator.remote.base import POLL_LOG_MAX, LogPoll, Runner, TaskHandle, TaskState
from orchestrator.remote.local import LocalRunner
from orchestrator.state import AttemptRecord, Store
from orchestrator.supervisor import Supervisor
from orchestrator.view import RunView, TaskView
from orchestrator.watch import AttemptFailed, AttemptWatch, Watched


@dataclass(frozen=True)
class Poll:
    log: str  # the log's file name: worker-0.log, worker-1.log
    status: bool  # whether it asked if the task's group lives
    at: float  # time.time() as it was sent
    got: LogPoll


class CountingLauncher(ProcessLauncher):
    """The process launcher, noting every poll of the watch loop."""

    def __init__(self) -> None:
        self.polls: list[Poll] = []

    def poll_log(self, runner: Runner, handle: TaskHandle, offset: int, *,
                 status: bool = True) -> LogPoll:
        at = time.time()
        got = super().poll_log(runner, handle, offset, status=status)
        self.polls.append(Poll(Path(handle.log_path).name, status, at, got))
        return got

    def of(self, log: str) -> list[Poll]:
        return [p for p in self.polls if p.log == log]


# worker:1 prints a line every 50 ms for 3 s, then ends as the case says; worker:0 prints
# nothing of its own and waits to be stopped.
CHATTY = """
import os, pathlib, signal, sys, time
if os.environ["ORCHESTRATE_TASK"] != "worker:1":
    time.sleep(60)
for i in range(60):
    print("line", i, flush=True)
    time.sleep(0.05)
ended = pathlib.Path(os.environ["ENDED"])
{end}
"""
EXIT = "ended.touch(); sys.exit(3)"
KILLED = "ended.touch(); os.killpg(os.getpgid(0), signal.SIGKILL)"
# A process that left the group (its own session) keeps writing the log after the group is
# killed: the log never goes quiet. It writes its pid once out, and ends by itself after 30 s.
ESCAPED = """
writer = pathlib.Path(os.environ["WRITER"])
if os.fork() == 0:
    os.setsid()
    writer.write_text(str(os.getpid()))
    for _ in range(600):
        print("outside the group", flush=True)
        time.sleep(0.05)
    os._exit(0)
while not writer.exists():
    time.sleep(0.01)
""" + KILLED


def run_attempt(tmp_path: Path, end: str) -> tuple[CountingLauncher, AttemptRecord, float]:
    """Run one attempt to its failure; returns the polls, its record and when the job ended."""
    (tmp_path / "job.py").write_text(textwrap.dedent(CHATTY).replace("{end}", end))
    path = tmp_path / "c.yaml"
    path.write_text(
        "name: polls\nworkers: 2\nports: {start: 24400, end: 24420}\n"
        "job:\n  command: python job.py\nretry: {max_restarts: 0}\n"
        "timeouts: {startup_s: 60, stop_grace_s: 0.5}\n"
        "env: " + json.dumps({"ENDED": str(tmp_path / "ended"),
                              "WRITER": str(tmp_path / "writer")}) + "\n")
    s = spec.load(path)
    store = Store()
    sup = Supervisor(s, LocalProvider(s, path), store, workdir=path.parent,
                     backoff_sleep=lambda _: None, poll_s=0.05)
    launcher = sup.launcher = CountingLauncher()
    run_id = store.new_run(s.name)
    with pytest.raises(RunFailed):
        sup.run(run_id)
    (attempt,) = store.attempts(run_id)
    return launcher, attempt, (tmp_path / "ended").stat().st_mtime


@pytest.fixture
def escaped_writer(tmp_path: Path) -> Iterator[None]:
    """Kills the process that ESCAPED leaves writing, by the pid it wrote."""
    yield
    pid_file = tmp_path / "writer"
    if pid_file.exists():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


@pytest.mark.parametrize(("end", "every_s", "detail", "exit_code", "within_s", "full_s"), [
    # the exit code its wrapper wrote: seen by the next poll, log-only or not
    pytest.param(EXIT, watch.STATUS_EVERY_S, "exited 3", 3, 1.5, 0.0, id="exit"),
    # no exit code: seen by the first full poll once the log is quiet (POLL_QUIET_S)
    pytest.param(KILLED, watch.STATUS_EVERY_S, "vanished", None, watch.POLL_QUIET_S + 1.5,
                 watch.POLL_QUIET_S - 0.1, id="group-killed"),
    # the log never goes quiet: seen by the periodic full poll (STATUS_EVERY_S, 1 s here)
    pytest.param(ESCAPED, 1.0, "vanished", None, 1.0 + 1.5, 0.0,
                 id="group-killed-log-still-written"),
])
def test_polls_skip_the_status_while_output_comes_and_still_see_the_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, escaped_writer: None, end: str,
    every_s: float, detail: str, exit_code: int | None, within_s: float, full_s: float,
) -> None:
    monkeypatch.setattr(watch, "STATUS_EVERY_S", every_s)
    launcher, attempt, ended = run_attempt(tmp_path, end)

    assert (attempt.cause, attempt.failed_task, attempt.exit_code) == (
        "crashed", "worker:1", exit_code)
    assert detail in attempt.detail
    assert attempt.detected_at is not None
    assert full_s <= attempt.detected_at - ended < within_s
    if end is ESCAPED:  # the log never went quiet: every poll until the full one brought bytes
        polls = launcher.of("worker-1.log")
        lost = next(p.at for p in polls if p.got.status and p.got.status.state is TaskState.LOST)
        assert all(b"outside the group" in p.got.data for p in polls if ended < p.at < lost)

    chatty = launcher.of("worker-1.log")
    first = next(i for i, p in enumerate(chatty) if p.got.data)
    talking = [p for p in chatty[first + 1:] if p.at < ended]  # while its lines came
    assert len(talking) >= 10
    full = [p for p in talking if p.status]
    # one full poll every STATUS_EVERY_S at most; the others read the log alone
    span = talking[-1].at - talking[0].at
    assert len(full) <= span / every_s + 1, [round(p.at - talking[0].at, 2) for p in full]

    # worker:0 printed its start and then nothing: once quiet, every poll of it is a full one
    quiet = launcher.of("worker-0.log")
    spoke = max(p.at for p in quiet if p.got.data)
    since = [p for p in quiet if spoke + watch.POLL_QUIET_S + 0.2 < p.at < ended]
    assert len(since) >= 5 and all(p.status for p in since)



# -- over SSH: the watch loop alone, on a lab host ----------------------------------------------
def attempt_watch(tmp_path: Path, runner: Runner, host: LabHost, scripts: list[str],
                  launcher: CountingLauncher) -> AttemptWatch:
    """The watch of one attempt whose tasks (``sh -c SCRIPT`` each) run on ``host``."""
    path = tmp_path / "c.yaml"
    path.write_text(f"name: polls\nworkers: {len(scripts)}\njob:\n  command: sh\n"
                    "timeouts: {startup_s: 600}\n")
    s = spec.load(path)
    view = RunView(run_id="polls", cluster="polls")
    watched = []
    for i, script in enumerate(scripts):
        base = f"{host.home}/polls/{uuid.uuid4().hex}/worker-{i}"
        task = TaskPlan("worker", i, Host(host.name, host.address, host.home), 24400 + i, {},
                        {}, ("sh", "-c", script), host.home, f"{base}.log", f"{base}.rc")
        watched.append(Watched(task, launcher.start(runner, task), runner))
        view.tasks[task.key] = TaskView(task.key, host.name, task.endpoint)
    return AttemptWatch(s, watched, view, lambda view, event: None, launcher=launcher,
                        on_tick=lambda: None, on_event=lambda w, e: None,
                        python_for=lambda w: sys.executable, interval_s=0.05)


@pytest.mark.ssh
def test_over_ssh_a_poll_is_one_round_trip_and_an_exit_counts_once_the_log_is_read_to_it(
        tmp_path: Path, hostlab: HostLab) -> None:
    """3 MB printed at once, then a last line and exit 3, all before the first poll: the polls
    that say it exited but stopped at the cap (1 MiB) leave the exit for later, so the
    failure's evidence is the task's last lines. Every poll of either task is one round trip
    on the control connection: in its poll shell, or a command where that is busy."""
    (host,) = hostlab.hosts(1)
    launcher = CountingLauncher()
    with CountingRunner(host) as runner:
        watch_ = attempt_watch(tmp_path, runner, host, [
            "sleep 60",
            "yes 'a line of output, as a verbose task writes them' | head -c 3000000; "
            "echo; echo 'the last line'; exit 3",
        ], launcher)
        rc = Path(watch_.watched[1].handle.rc_path)  # the lab's hosts share this file system
        deadline = time.monotonic() + 30
        while not rc.exists():  # ended before the first poll: every poll of it sees the exit
            assert time.monotonic() < deadline
            time.sleep(0.05)
        runner.channels.clear()
        try:
            with pytest.raises(AttemptFailed) as failed:
                watch_.run()
            # a poll still out when the failure was seen has opened its channel already: let
            # it come back, so that it is counted with its channel (a busy machine shows it)
            futures.wait([w.pending for w in watch_.watched if w.pending is not None], 30)
            polls, channels = list(launcher.polls), list(runner.channels)
        finally:
            watch_.close()
            for w in watch_.watched:
                launcher.stop(runner, w.handle, 0)
    failure = failed.value
    assert (failure.cause, failure.task, failure.exit_code) == (Cause.CRASHED, "worker:1", 3)
    assert failure.evidence.splitlines()[-1] == "the last line"
    burst = [p for p in polls if p.log == "worker-1.log" and p.got.capped]
    assert len(burst) >= 2 and all(len(p.got.data) == POLL_LOG_MAX for p in burst)
    assert all(p.got.status is not None and p.got.status.exit_code == 3 for p in burst)
    # one command a poll, or none in the poll shell; no SFTP session
    assert set(channels) == {"control"} and len(channels) < len(polls)


# -- the primary failure behind a poll that does not come back -----------------------------------
class HeldLauncher(ProcessLauncher):
    """The process launcher, where worker:0's machine 'goes away' at its first poll after
    ``go``: its process group is killed and that poll hangs (as SSH does, reconnecting to a
    machine that is down) until ``back``, when the machine answers again and the poll goes
    through. A controller cannot make a real poll hang this long at will, so this is faked."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.back = threading.Event()
        self.killed_at: float | None = None

    def poll_log(self, runner: Runner, handle: TaskHandle, offset: int, *,
                 status: bool = True) -> LogPoll:
        if Path(handle.log_path).name == "worker-0.log" and self.go.is_set() \
                and self.killed_at is None:
            os.killpg(handle.pgid, signal.SIGKILL)
            self.killed_at = time.time()
            self.back.wait(60)
        return super().poll_log(runner, handle, offset, status=status)


def test_a_peers_error_is_not_blamed_while_a_hosts_poll_is_still_out(tmp_path: Path) -> None:
    """worker:0's machine goes away (its tasks killed, its poll hanging) and worker:1 fails
    with a peer's error a moment later: a secondary failure, which waits SETTLE_S for the
    primary. The machine is back only after that: probing then finds its host answering and
    nothing stuck. The watch must wait for worker:0's poll, which finds its group vanished,
    and blame worker:0, not the peer's error (a race the fault matrix once lost)."""
    path = tmp_path / "c.yaml"
    path.write_text("name: held\nworkers: 2\njob:\n  command: sh\n")
    s = spec.load(path)
    view = RunView(run_id="held", cluster="held")
    launcher, runner = HeldLauncher(), LocalRunner()
    scripts = ["sleep 60", "sleep 60"]
    watched = []
    for i, script in enumerate(scripts):
        base = tmp_path / f"worker-{i}"
        task = TaskPlan("worker", i, Host("localhost", "127.0.0.1", str(tmp_path)), 24400 + i,
                        {}, {}, ("sh", "-c", script), str(tmp_path), f"{base}.log",
                        f"{base}.rc")
        watched.append(Watched(task, launcher.start(runner, task), runner))
        view.tasks[task.key] = TaskView(task.key, "localhost", task.endpoint)
    attempt = AttemptWatch(s, watched, view, lambda view, event: None, launcher=launcher,
                           on_tick=lambda: None, on_event=lambda w, e: None,
                           python_for=lambda w: sys.executable, interval_s=0.05)
    peer = watched[1]

    def fault() -> None:
        launcher.go.set()
        while launcher.killed_at is None:
            time.sleep(0.01)
        # worker:1 fails of the peer's error, as TensorFlow's tasks do when one goes away
        with open(peer.handle.log_path, "a") as log:
            log.write("UnavailableError: Connection reset by peer\n")
        os.killpg(peer.handle.pgid, signal.SIGKILL)
        Path(peer.handle.rc_path).write_text("1\n")
        while attempt._first_failure_seen is None:
            time.sleep(0.01)
        # past the settle window, the machine comes back
        time.sleep(watch.SETTLE_S + 1.0)
        launcher.back.set()

    thread = threading.Thread(target=fault, daemon=True)
    try:
        thread.start()
        with pytest.raises(AttemptFailed) as failed:
            attempt.run()
    finally:
        launcher.back.set()
        attempt.close()
        thread.join(30)
        for w in watched:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(w.handle.pgid, signal.SIGKILL)
    failure = failed.value
    assert (failure.cause, failure.task, failure.vanished) == (Cause.CRASHED, "worker:0", True)
    assert "vanished" in failure.detail


# -- a peer's own error read before the poll that finds its machine gone ------------------------
# worker:0 exits 3 (an error of its own, no peer's mark) once GO exists; worker:1 prints a line
# every 50 ms, so its polls read the log alone.
BLINK = """\
if [ "$ORCHESTRATE_TASK" = worker:0 ]; then
  while [ ! -e {go} ]; do sleep 0.05; done
  echo 'an error of its own' >&2; exit 3
fi
while :; do echo line; sleep 0.05; done
"""


@pytest.mark.ssh
def test_a_peers_exit_read_before_a_machine_came_back_blames_that_machine(
        tmp_path: Path, hostlab: HostLab) -> None:
    """worker:1's machine dies whole (sshd too) and worker:0 exits of an error of its own at
    once: its exit is read while worker:1's poll still reconnects. The machine is back a
    second later, well within the connect retries, so worker:1's host answers the stop as if
    nothing happened. The connection that dropped since worker:1 was last seen running names
    its machine the one lost (as on a real cluster, where the survivor's collective fails as
    the machine goes), and it is repaired before a relaunch, never blamed on worker:0."""
    from helpers import write_spec  # (not at the top: the local tests above need no lab)

    from orchestrator.api import Cluster

    hosts = hostlab.hosts(2)
    go = tmp_path / "go"
    job = tmp_path / "job.sh"
    job.write_text(BLINK.format(go=go))
    path = write_spec(tmp_path, hostlab, hosts,
                      f"name: blink\njob: {{command: sh {job}}}\nretry: {{max_restarts: 0}}\n"
                      "timeouts: {startup_s: 60, stop_grace_s: 0.5, poll_s: 8}\n")
    started: set[str] = set()
    both = threading.Event()
    fired = threading.Event()

    def listener(view: RunView, event: Event | None) -> None:
        if event is not None and event.kind == "started":
            started.add(event.task)
            if len(started) == 2:
                both.set()

    def fault() -> None:
        if not both.wait(60):
            return
        time.sleep(0.5)  # worker:1's lines come: its polls read the log alone
        hosts[1].kill()
        go.touch()
        fired.set()
        time.sleep(1.0)  # worker:0's exit is read meanwhile; worker:1's poll reconnects
        hosts[1].heal()

    cluster = Cluster.from_spec(path)
    thread = threading.Thread(target=fault, daemon=True)
    thread.start()
    try:
        with pytest.raises(RunFailed) as failed:
            cluster.train(listener=listener, doctor=False).wait()
    finally:
        thread.join(30)
        hosts[1].heal()
        cluster.down()
    assert fired.is_set()
    (attempt,) = Store().attempts(failed.value.run_id)
    assert (attempt.cause, attempt.failed_task) == ("host_lost", "worker:1"), attempt.detail
    assert "worker:0: exited 3" in attempt.detail, attempt.detail
    # back within the connect retries: it answered the stop, over a new connection
    assert "dropped its connection" in attempt.detail, attempt.detail


# -- the progress watchdog and the first step ---------------------------------------------------
class Clock:
    """``time`` as the watch loop reads it, with ``time()`` set by the test."""

    def __init__(self) -> None:
        self.now = time.time()

    def time(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def say(attempt: AttemptWatch, w: Watched, event: str, **fields: Any) -> None:
    """One event line of a task, as the watch loop reads it from the task's log."""
    line = "@orchestrate " + json.dumps({"event": event, "task": w.key, "attempt": 1, **fields})
    attempt._feed(w, (line + "\n").encode())


@pytest.fixture
def trained(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[AttemptWatch, Clock]]:
    """The watch of a module job's attempt (hang_s 10, startup_s 120) over two real processes
    (``sleep 60``) that have said they are training at the step a checkpoint holds, as a
    resumed task does before its first step compiles; the clock is the test's."""
    clock = Clock()
    monkeypatch.setattr(watch, "time", clock)
    (tmp_path / "m.py").write_text("")
    path = tmp_path / "c.yaml"
    path.write_text("name: dog\nworkers: 2\njob: {module: m}\n"
                    "timeouts: {hang_s: 10, startup_s: 120, poll_s: 5}\n")
    s = spec.load(path)
    view = RunView(run_id="dog", cluster="dog")
    launcher, runner = ProcessLauncher(), LocalRunner()
    watched = []
    for i in range(2):
        base = tmp_path / f"worker-{i}"
        task = TaskPlan("worker", i, Host("localhost", "127.0.0.1", str(tmp_path)), 24400 + i,
                        {}, {}, ("sh", "-c", "sleep 60"), str(tmp_path), f"{base}.log",
                        f"{base}.rc")
        watched.append(Watched(task, launcher.start(runner, task), runner))
        view.tasks[task.key] = TaskView(task.key, "localhost", task.endpoint)
    attempt = AttemptWatch(s, watched, view, lambda view, event: None, launcher=launcher,
                           on_tick=lambda: None, on_event=lambda w, e: None,
                           python_for=lambda w: sys.executable)
    try:
        for w in watched:
            say(attempt, w, "resumed", step=50, total_steps=160)
        yield attempt, clock
    finally:
        attempt.close()
        for w in watched:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(w.handle.pgid, signal.SIGKILL)


def test_the_first_step_after_the_start_has_the_start_up_budget_not_the_watchdogs(
        trained: tuple[AttemptWatch, Clock]) -> None:
    """A resumed JAX task said 'resumed' 7.8 s before its first step on 2 loaded cores (its
    step compiles then): a hang_s of 10 s called such a group hung, twice in a row, in a
    benchmark's smoke run. Until every task has completed a step, the attempt has
    timeouts.startup_s from its start as well; past both, it is hung."""
    attempt, clock = trained
    clock.now += 11  # past hang_s, within startup_s: still starting
    attempt._check_hang()
    clock.now = attempt.started + 121  # past startup_s as well
    with pytest.raises(AttemptFailed) as failed:
        attempt._check_hang()
    assert failed.value.cause is Cause.HUNG
    assert "no task reported progress for 10s (last step 50)" in failed.value.detail


def test_once_every_task_has_stepped_the_watchdog_is_hang_s_alone(
        trained: tuple[AttemptWatch, Clock]) -> None:
    attempt, clock = trained
    clock.now += 2
    say(attempt, attempt.watched[0], "progress", step=51, loss=1.0)
    attempt._check_hang()
    clock.now += 11  # worker:1 has not stepped: the start's budget still holds
    attempt._check_hang()
    say(attempt, attempt.watched[1], "progress", step=51, loss=1.0)
    clock.now += 10.5  # within startup_s, but every task has stepped: hang_s alone
    with pytest.raises(AttemptFailed) as failed:
        attempt._check_hang()
    assert failed.value.cause is Cause.HUNG
    assert "(last step 51)" in failed.value.detail
