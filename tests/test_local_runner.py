"""Detached tasks on this machine: own session, log and exit-code files, TERM then KILL."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.remote.base import WRAPPER_FD, LaunchSpec, Runner, TaskHandle, TaskState
from orchestrator.remote.local import LocalRunner, live_group_members
from worker.probes import process_stat

SWALLOW_TERM = (
    "import os, signal, time; signal.signal(signal.SIGTERM, lambda *a: os.write(1, b'TERM ignored\\n'));"
    "print('up', flush=True); time.sleep(60)"
)


def launch(tmp_path: Path, code: str, **env: str) -> tuple[LocalRunner, LaunchSpec]:
    spec = LaunchSpec((sys.executable, "-c", code), str(tmp_path), str(tmp_path / "logs/t.log"),
                      str(tmp_path / "logs/t.rc"), env)
    return LocalRunner(), spec


def wait_for(predicate: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def test_exit_code_and_output_are_recorded(tmp_path: Path) -> None:
    runner, spec = launch(tmp_path, "import sys; print('hello'); sys.exit(3)")
    handle = runner.start(spec)
    wait_for(lambda: runner.poll(handle).state is TaskState.EXITED)
    assert runner.poll(handle).exit_code == 3
    data, offset = runner.read_log(handle, 0)
    assert data == b"hello\n" and offset == 6
    assert runner.read_log(handle, offset) == (b"", offset)


def test_task_runs_in_its_own_session(tmp_path: Path) -> None:
    runner, spec = launch(tmp_path, "import time; time.sleep(30)")
    handle = runner.start(spec)
    try:
        assert os.getsid(handle.pgid) == handle.pgid != os.getsid(0)
    finally:
        runner.stop(handle, grace_s=0.5)


def test_sigterm_swallowed_is_escalated_to_sigkill(tmp_path: Path) -> None:
    runner, spec = launch(tmp_path, SWALLOW_TERM)
    handle = runner.start(spec)
    wait_for(lambda: b"up" in runner.read_log(handle, 0)[0])
    status = runner.stop(handle, grace_s=0.5)
    assert status.state is TaskState.LOST  # killed as a group: nobody wrote an exit code
    assert live_group_members(handle.pgid) == []
    assert b"TERM ignored" in runner.read_log(handle, 0)[0]


def test_killed_child_is_reported_with_signal_exit_code(tmp_path: Path) -> None:
    runner, spec = launch(tmp_path, "import os; print(os.getpid(), flush=True); import time; "
                                    "time.sleep(30)")
    handle = runner.start(spec)
    wait_for(lambda: runner.read_log(handle, 0)[0].strip().isdigit())
    os.kill(int(runner.read_log(handle, 0)[0]), 9)
    wait_for(lambda: runner.poll(handle).state is TaskState.EXITED)
    assert runner.poll(handle).exit_code == 137


def test_hostile_env_and_argv_arrive_literally(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    hostile = f"a b; touch {marker}; $(touch {marker}) `touch {marker}` 'q' \"d\" \n*"
    code = "import os, sys; print(repr(os.environ['HOSTILE'])); print(repr(sys.argv[1]))"
    spec = LaunchSpec((sys.executable, "-c", code, hostile), str(tmp_path),
                      str(tmp_path / "t.log"), str(tmp_path / "t.rc"), {"HOSTILE": hostile})
    runner = LocalRunner()
    handle = runner.start(spec)
    wait_for(lambda: runner.poll(handle).state is TaskState.EXITED)
    lines = runner.read_log(handle, 0)[0].decode().splitlines()
    assert lines == [repr(hostile), repr(hostile)]
    assert not marker.exists()


def test_task_outlives_the_controller_that_started_it(tmp_path: Path) -> None:
    """A controller process that exits (or dies) leaves its tasks running."""
    repo, log, rc = Path(__file__).parent.parent, tmp_path / "t.log", tmp_path / "t.rc"
    script = (
        f"import sys; sys.path.insert(0, {str(repo)!r})\n"
        "from orchestrator.remote.local import LocalRunner\n"
        "from orchestrator.remote.base import LaunchSpec\n"
        f"h = LocalRunner().start(LaunchSpec(('sleep', '30'), {str(tmp_path)!r}, {str(log)!r}, "
        f"{str(rc)!r}))\n"
        "print(h.pgid)\n"
    )
    controller = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                check=True)
    pgid = int(controller.stdout)
    runner = LocalRunner()
    from orchestrator.remote.base import TaskHandle

    handle = TaskHandle("localhost", pgid, str(tmp_path / "t.log"), str(tmp_path / "t.rc"))
    try:
        assert runner.poll(handle).state is TaskState.RUNNING
    finally:
        runner.stop(handle, grace_s=0.5)
    assert live_group_members(pgid) == []


def test_a_task_that_saves_on_term_has_its_exit_code_recorded_and_hup_does_not_kill_it(
        tmp_path: Path) -> None:
    # A guest's shutdown sends the session TERM and then HUP at once: the task must live on
    # to save, and the wrapper must outlive it to write the exit code.
    code = ("import signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(0.5), sys.exit(75)))\n"
            "print('up', flush=True); time.sleep(60)")
    runner, spec = launch(tmp_path, code)
    handle = runner.start(spec)
    wait_for(lambda: b"up" in runner.read_log(handle, 0)[0])
    runner.signal(handle, "TERM")
    runner.signal(handle, "HUP")
    wait_for(lambda: runner.poll(handle).state is TaskState.EXITED)
    assert runner.poll(handle).exit_code == 75


def test_a_reused_group_id_is_never_signalled_nor_taken_for_the_task(tmp_path: Path) -> None:
    # The task's group is long gone and its id now leads someone else's group: a later
    # 'down' (or a stop after a reboot) must leave that group alone.
    stranger = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        wait_for(lambda: Path(f"/proc/{stranger.pid}/cmdline").read_bytes().startswith(b"sleep"))
        runner = LocalRunner()
        _, spec = launch(tmp_path, "pass")
        handle = TaskHandle("localhost", stranger.pid, spec.log_path, spec.rc_path)
        assert runner.poll(handle).state is TaskState.LOST
        assert Runner.poll(runner, handle).state is TaskState.LOST  # the shell version
        runner.stop(handle, grace_s=0)
        Runner.signal(runner, handle, "KILL")
        assert stranger.poll() is None  # alive: neither version touched it
        mine = TaskHandle("localhost", stranger.pid, spec.log_path, "sleep")  # in its cmdline
        assert Runner.poll(runner, mine).state is TaskState.RUNNING
    finally:
        stranger.kill()
        stranger.wait()


def test_the_shell_knows_its_task_by_the_pid_file_its_wrapper_holds(tmp_path: Path) -> None:
    # The status poll's test of ownership starts no process where the group's leader is this
    # task's wrapper: it holds the task's pid file open (remote.base.WRAPPER_FD), the task not.
    runner, spec = launch(tmp_path, "import time; time.sleep(30)")
    handle = runner.start(spec)
    try:
        fd = Path(f"/proc/{handle.pgid}/fd/{WRAPPER_FD}")
        assert os.path.samefile(fd, spec.pid_path)
        assert Runner.poll(runner, handle).state is TaskState.RUNNING  # the shell version
        task = [p for p in live_group_members(handle.pgid) if p != handle.pgid]
        assert task and not any(Path(f"/proc/{p}/fd/{WRAPPER_FD}").exists() for p in task)
        # another file under that descriptor, or the task's paths another task's: not ours
        other = dataclasses.replace(spec, rc_path=str(tmp_path / "logs/other.rc"))
        stranger = TaskHandle("localhost", handle.pgid, other.log_path, other.rc_path)
        assert Runner.poll(runner, stranger).state is TaskState.LOST
    finally:
        runner.stop(handle, grace_s=0)
    # a stranger holding another file under that descriptor is no task either
    (tmp_path / "held").write_text("")
    stranger_proc = subprocess.Popen(
        ["sh", "-c", f"exec {WRAPPER_FD}<\"$0\"; exec sleep 60", str(tmp_path / "held")],
        start_new_session=True)
    try:
        wait_for(lambda: os.path.exists(f"/proc/{stranger_proc.pid}/fd/{WRAPPER_FD}")
                 and Path(f"/proc/{stranger_proc.pid}/cmdline").read_bytes().startswith(b"sleep"))
        lookalike = TaskHandle("localhost", stranger_proc.pid, spec.log_path, spec.rc_path)
        assert Runner.poll(runner, lookalike).state is TaskState.LOST
    finally:
        stranger_proc.kill()
        stranger_proc.wait()


# -- polls without listing every process --------------------------------------------------------
@pytest.fixture
def proc_listings(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every listing of /proc from now on (os.listdir, spied on: it still lists)."""
    listings: list[str] = []
    listdir = os.listdir

    def spy(path: str = ".") -> list[str]:
        if os.fspath(path).rstrip("/") == "/proc":
            listings.append(os.fspath(path))
        return listdir(path)

    monkeypatch.setattr(os, "listdir", spy)
    return listings


def test_a_poll_of_a_running_task_lists_no_processes(tmp_path: Path,
                                                     proc_listings: list[str]) -> None:
    runner, spec = launch(tmp_path, "print('up', flush=True); import time; time.sleep(30)")
    handle = runner.start(spec)
    try:
        wait_for(lambda: b"up" in runner.read_log(handle, 0)[0])
        proc_listings.clear()
        for _ in range(20):
            assert runner.poll(handle).state is TaskState.RUNNING
            got = runner.poll_log(handle, 0)
            assert got.status is not None and got.status.state is TaskState.RUNNING
            assert (got.data, got.next_offset) == (b"up\n", 3)
        assert proc_listings == []
    finally:
        runner.stop(handle, grace_s=0)
    assert runner.poll(handle).state is TaskState.LOST


def until_zombie(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGKILL)
    wait_for(lambda: (process_stat(proc.pid) or ("?", 0))[0] == "Z")  # exited, not reaped


@pytest.fixture
def group(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], subprocess.Popen[bytes],
                                            TaskHandle]]:
    """A process group of this test's children, so that it decides when each is reaped:
    its leader (whose command line holds the task's rc path, as the launch wrapper's does)
    and one more member."""
    rc = str(tmp_path / "t.rc")
    leader = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", rc],
                              process_group=0)
    member = subprocess.Popen(["sleep", "60"], process_group=leader.pid)
    handle = TaskHandle("localhost", leader.pid, str(tmp_path / "t.log"), rc)
    try:
        yield leader, member, handle
    finally:
        for proc in (leader, member):
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(("leader_is", "member_is", "alive", "lists"), [
    pytest.param("alive", "alive", True, False, id="leader-alive"),
    pytest.param("alive", "zombie", True, False, id="leader-alive-member-zombie"),
    pytest.param("zombie", "alive", True, True, id="zombie-leader-member-alive"),
    pytest.param("zombie", "zombie", False, True, id="only-zombies"),
    pytest.param("reaped", "alive", True, True, id="leaderless-member-alive"),
    pytest.param("reaped", "zombie", False, True, id="leaderless-member-zombie"),
    pytest.param("reaped", "reaped", False, True, id="nothing-left"),
])
def test_a_groups_leader_answers_for_it_and_only_without_one_are_processes_listed(
    group: tuple[subprocess.Popen[bytes], subprocess.Popen[bytes], TaskHandle],
    proc_listings: list[str], leader_is: str, member_is: str, alive: bool, lists: bool,
) -> None:
    leader, member, handle = group
    for proc, becomes in ((member, member_is), (leader, leader_is)):
        if becomes == "zombie":
            until_zombie(proc)
        elif becomes == "reaped":
            proc.kill()
            proc.wait()
    proc_listings.clear()
    assert LocalRunner().poll(handle).state is (TaskState.RUNNING if alive else TaskState.LOST)
    assert bool(proc_listings) is lists


def test_a_task_whose_wrapper_was_killed_alone_is_still_seen_running(tmp_path: Path) -> None:
    # The group's leader (the launch wrapper) gone: the task lives on, leaderless.
    runner, spec = launch(tmp_path, "import os; print(os.getpid(), flush=True); "
                                    "import time; time.sleep(30)")
    handle = runner.start(spec)
    wait_for(lambda: runner.read_log(handle, 0)[0].strip().isdigit())
    task_pid = int(runner.read_log(handle, 0)[0])
    os.kill(handle.pgid, signal.SIGKILL)
    wait_for(lambda: (process_stat(handle.pgid) or ("Z", 0))[0] == "Z")
    try:
        for _ in range(5):
            assert runner.poll(handle).state is TaskState.RUNNING
            time.sleep(0.05)
    finally:
        os.kill(task_pid, signal.SIGKILL)
    wait_for(lambda: runner.poll(handle).state is TaskState.LOST)  # no wrapper: no exit code


def test_a_start_never_reads_the_pid_a_previous_task_left_at_the_same_paths(
        tmp_path: Path) -> None:
    """A task started again at the same paths (the benchmark's second runner, a relaunch that
    reuses a stem) gets its own pgid, not the one the old pid file names. The launch once put
    its `mkdir && rm` in the background with the task, and its wait read the old file first."""
    runner, spec = launch(tmp_path, "import time; time.sleep(30)")
    Path(spec.pid_path).parent.mkdir(parents=True)
    for _ in range(5):
        Path(spec.pid_path).write_text("999999\n")
        handle = runner.start(spec)
        try:
            assert handle.pgid != 999999
            assert os.getsid(handle.pgid) == handle.pgid
        finally:
            runner.stop(handle, grace_s=0.5)


def test_a_start_removes_the_go_file_an_earlier_task_left_before_the_task_runs(
        tmp_path: Path) -> None:
    """A warm task waits for its go file (orchestrator/warm.py): one left at its paths by an
    earlier task would start it at once, with that task's TF_CONFIG. The launch removes it in
    the same command, before the task starts: the task never sees it."""
    runner, spec = launch(tmp_path, "import os, sys; print(os.path.exists(sys.argv[1]))")
    spec = dataclasses.replace(spec, argv=(*spec.argv, spec.go_path))
    Path(spec.go_path).parent.mkdir(parents=True)
    Path(spec.go_path).write_text("{}\n")
    handle = runner.start(spec)
    try:
        wait_for(lambda: Path(spec.rc_path).exists(), timeout=30)
        assert Path(spec.log_path).read_text() == "False\n"
        assert not Path(spec.go_path).exists()
    finally:
        runner.stop(handle, grace_s=0.5)


def test_stopping_a_task_that_exited_kills_what_it_left_running_in_its_group(
        tmp_path: Path) -> None:
    """A task that ended by itself may leave a child in its group: JAX's coordination service
    outlives a dead chief by design, so that a survivor can save. Once the attempt is stopped,
    that child must go: it held the chief's port into the next attempt, whose chief's
    connection it took."""
    code = ("import subprocess, sys; p = subprocess.Popen(['sleep', '300']); "
            "print(p.pid, flush=True)")
    runner, spec = launch(tmp_path, code)
    handle = runner.start(spec)
    try:
        wait_for(lambda: Path(spec.rc_path).exists(), timeout=30)
        child = int(Path(spec.log_path).read_text().split()[0])
        assert process_stat(child) is not None  # left running in the task's group
        status = runner.stop(handle, grace_s=5.0)
        assert (status.state, status.exit_code) == (TaskState.EXITED, 0)
        wait_for(lambda: (process_stat(child) or ("Z", 0))[0] == "Z")  # gone, or a zombie
        assert live_group_members(handle.pgid) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(handle.pgid, signal.SIGKILL)
