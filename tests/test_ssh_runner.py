"""SSHRunner against real sshd hosts from the lab: commands, quoting, tasks, keys, auth, faults."""

from __future__ import annotations

import base64
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import paramiko
import pytest
from helpers import CountingRunner
from hostlab import HostLab, LabHost

from orchestrator.errors import AuthError, HostKeyError, HostUnreachableError, RemoteError
from orchestrator.remote.base import (
    POLL_LOG_MAX,
    LaunchSpec,
    TaskHandle,
    TaskState,
    TaskStatus,
    group_lives,
)
from orchestrator.remote.local import live_group_members
from orchestrator.remote.ssh import (
    BULK_CHANNELS,
    BULK_STALL_S,
    MAX_CHANNELS,
    READ_LOG_MAX,
    SSHRunner,
    fingerprint,
)
from worker.probes import process_stat

pytestmark = pytest.mark.ssh

PWNED = f"/tmp/pwned-{uuid.uuid4().hex}"
HOSTILE = (
    "two words",
    "semi;colon; echo injected",
    f"$(touch {PWNED})",
    f"`touch {PWNED}`",
    "it's",
    'say "hi"',
    "line1\nline2\n",
    "*",
    "~",
    "$HOME",
    "back\\slash",
    "--flag",
    "",
    "  padded  ",
    "héllo ✓",
    "&& echo x | cat > /dev/null",
    "'\"'",
    "!bang",
    "tab\there",
)


@pytest.fixture
def host(hostlab: HostLab) -> LabHost:
    return hostlab.hosts(1)[0]


@pytest.fixture
def runner(host: LabHost) -> Iterator[SSHRunner]:
    with SSHRunner(host.name, host.endpoint()) as r:
        yield r


def wait_for_exit(runner: SSHRunner, handle: TaskHandle, timeout_s: float = 15) -> TaskStatus:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = runner.poll(handle)
        if status.state is not TaskState.RUNNING:
            return status
        time.sleep(0.05)
    raise AssertionError(f"task {handle} still running after {timeout_s}s")


def host_key(line: str) -> paramiko.PKey:
    kind, b64 = line.split()[:2]
    return paramiko.PKey.from_type_string(kind, base64.b64decode(b64))


def group_alive(handle: TaskHandle) -> bool:
    """Checked here, not through the runner: lab hosts share this machine's pid namespace."""
    return bool(live_group_members(handle.pgid))


# -- commands and quoting ------------------------------------------------------
def test_run_returns_exit_code_stdout_and_stderr(runner: SSHRunner) -> None:
    result = runner.run("echo out; echo err >&2; exit 7", check=False)
    assert (result.exit_code, result.stdout, result.stderr) == (7, "out\n", "err\n")
    assert runner.run(["true"]).ok


def test_hostile_argv_arrives_byte_for_byte(runner: SSHRunner, host: LabHost, tmp_path: Path) -> None:
    remote_dir = f"{host.home}/argv-{uuid.uuid4().hex}"
    script = 'mkdir -p "$1"; d=$1; shift; i=0; for a; do i=$((i+1)); printf %s "$a" > "$d/$i"; done'
    runner.run(["sh", "-c", script, "sh", remote_dir, *HOSTILE])
    for i, value in enumerate(HOSTILE, start=1):
        local = tmp_path / str(i)
        runner.get_file(f"{remote_dir}/{i}", str(local))
        assert local.read_bytes() == value.encode()
    echoed = runner.run(["printf", "%s\\0", *HOSTILE]).stdout
    assert tuple(echoed.split("\0")[:-1]) == HOSTILE
    assert not os.path.exists(PWNED)


def test_launch_spec_argv_env_and_cwd_arrive_literally(
    runner: SSHRunner, host: LabHost, tmp_path: Path
) -> None:
    cwd = f"{host.home}/cwd $(touch {PWNED}) 'q' \"d\" ;*\nnl"
    runner.run(["mkdir", "-p", cwd])
    hostile = "\x1f".join(HOSTILE)
    spec = LaunchSpec(
        argv=(
            "sh",
            "-c",
            'printf %s "$1" > argv.out; printf %s "$HOSTILE_VAR" > env.out; pwd > cwd.out',
            "sh",
            hostile,
        ),
        cwd=cwd,
        log_path=f"{cwd}/task.log",
        rc_path=f"{cwd}/task.rc",
        env={"HOSTILE_VAR": hostile},
    )
    status = wait_for_exit(runner, runner.start(spec))
    assert (status.state, status.exit_code) == (TaskState.EXITED, 0)
    for name, expected in (("argv.out", hostile), ("env.out", hostile), ("cwd.out", cwd + "\n")):
        runner.get_file(f"{cwd}/{name}", str(tmp_path / name))
        assert (tmp_path / name).read_bytes() == expected.encode()
    assert not os.path.exists(PWNED)


def test_command_past_its_timeout_raises_remote_error(runner: SSHRunner) -> None:
    with pytest.raises(RemoteError, match=re.escape("timed out after 0.5s: sleep 10")) as err:
        runner.run(["sleep", "10"], timeout_s=0.5)
    assert err.value.host == runner.host_name


def test_commands_from_many_threads_share_one_runner(runner: SSHRunner) -> None:
    outputs: dict[int, str] = {}

    def work(i: int) -> None:
        outputs[i] = runner.run(["echo", str(i)]).stdout

    threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outputs == {i: f"{i}\n" for i in range(16)}


# -- detached tasks ---------------------------------------------------------------
def task(host: LabHost, *argv: str) -> LaunchSpec:
    base = f"{host.home}/tasks/{uuid.uuid4().hex}"
    return LaunchSpec(argv=argv, cwd=host.home, log_path=f"{base}.log", rc_path=f"{base}.rc")


def test_task_output_is_read_as_raw_bytes_and_its_exit_code_recorded(
    runner: SSHRunner, host: LabHost
) -> None:
    spec = task(host, "sh", "-c", "printf 'héllo ✓\\n'; sleep 0.2; printf 'second\\n'; exit 3")
    handle = runner.start(spec)
    status = wait_for_exit(runner, handle)
    assert (status.state, status.exit_code) == (TaskState.EXITED, 3)
    assert status.ended_at is not None and abs(status.ended_at - time.time()) < 120
    expected = "héllo ✓\nsecond\n".encode()
    assert runner.read_log(handle, 0) == (expected, len(expected))
    assert runner.read_log(handle, 2) == (expected[2:], len(expected))  # inside 'é'
    assert runner.read_log(handle, len(expected)) == (b"", len(expected))


def test_read_log_before_the_file_exists_returns_nothing(runner: SSHRunner, host: LabHost) -> None:
    handle = TaskHandle(host.name, 1, f"{host.home}/no-such-{uuid.uuid4().hex}.log", "/x.rc")
    assert runner.read_log(handle, 5) == (b"", 5)


def test_stop_terminates_a_running_task(runner: SSHRunner, host: LabHost) -> None:
    handle = runner.start(task(host, "sleep", "60"))
    assert runner.poll(handle).state is TaskState.RUNNING
    assert runner.stop(handle, grace_s=5).state is not TaskState.RUNNING
    assert not group_alive(handle)


def test_task_that_ignores_sigterm_is_killed(runner: SSHRunner, host: LabHost) -> None:
    spec = task(host, "sh", "-c", "trap '' TERM; echo ready; while :; do sleep 0.1; done")
    handle = runner.start(spec)
    while b"ready" not in runner.read_log(handle, 0)[0]:
        time.sleep(0.05)
    assert runner.stop(handle, grace_s=0.5).state is not TaskState.RUNNING
    assert not group_alive(handle)


def test_task_outlives_its_runner_and_a_new_runner_stops_it(host: LabHost) -> None:
    with SSHRunner(host.name, host.endpoint()) as first:
        handle = first.start(task(host, "sleep", "60"))
    with SSHRunner(host.name, host.endpoint()) as second:
        assert second.poll(handle).state is TaskState.RUNNING
        assert second.stop(handle).state is not TaskState.RUNNING
        assert not group_alive(handle)


def test_a_group_left_as_zombies_counts_as_gone_over_ssh(runner: SSHRunner) -> None:
    """A killed task's processes stay zombies until the host's init reaps them (seconds under
    some inits, never under a container's first process that does not reap); ``kill -0``
    answers for them, so a stop that asked it waited on nothing. The shell test reads each
    process's state in /proc instead (readable across users), here with zombies this test
    holds: it does not reap its child until the end."""
    leader = subprocess.Popen(["setsid", "sh", "-c", "sleep 60 & sleep 60; :"])
    try:
        wait_until(lambda: len(live_group_members(leader.pid)) == 3)
        assert runner.run(group_lives(leader.pid), check=False).ok  # all three live
        os.kill(leader.pid, signal.SIGKILL)  # the leader a zombie, its children alive
        wait_until(lambda: process_stat(leader.pid) is not None
                   and process_stat(leader.pid)[0] == "Z")
        assert runner.run(group_lives(leader.pid), check=False).ok
        os.killpg(leader.pid, signal.SIGKILL)
        wait_until(lambda: not live_group_members(leader.pid))
        os.killpg(leader.pid, 0)  # the zombie leader still answers kill 0 ...
        assert not runner.run(group_lives(leader.pid), check=False).ok  # ... and counts as gone
        here = subprocess.run(["sh", "-c", group_lives(leader.pid)], check=False)
        assert here.returncode == 1  # by this test's own user too, whose kill 0 would answer
        assert not runner.run(group_lives(2 ** 22 + 1), check=False).ok  # no such group
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(leader.pid, signal.SIGKILL)
        leader.wait()


# -- the watch loop's poll: one command -------------------------------------------------------
# Bytes no decoding survives: invalid UTF-8, a NUL, half of a two-byte character.
ODD = b"a\xff\xfeb\x00z\n\xc3"
ODD_PRINTF = r"a\377\376b\000z\n\303"


def wait_until(predicate: Callable[[], bool], timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


@pytest.mark.parametrize("status", [True, False], ids=["with-status", "log-only"])
@pytest.mark.parametrize(("case", "then", "state", "code"), [
    pytest.param("running", "sleep 60", TaskState.RUNNING, None, id="running"),
    pytest.param("exited", "exit 3", TaskState.EXITED, 3, id="exited-3"),
    # its whole group killed: no exit code
    pytest.param("lost", "sleep 60", TaskState.LOST, None, id="lost"),
])
def test_a_poll_is_one_command_with_the_status_then_the_exact_log_bytes(
    host: LabHost, case: str, then: str, state: TaskState, code: int | None, status: bool
) -> None:
    with CountingRunner(host) as runner:
        spec = task(host, "sh", "-c", f"printf '{ODD_PRINTF}'; {then}")
        handle = runner.start(spec)
        try:
            # start() returns once the task's session has its pid; the shell opens the log
            # just after, so a busy machine may not have made the file yet
            log = Path(spec.log_path)
            wait_until(lambda: log.is_file() and log.read_bytes() == ODD)
            if case == "exited":
                wait_until(lambda: Path(spec.rc_path).exists())
            if case == "lost":
                runner.signal(handle, "KILL")  # zombies answer kill 0 until they are reaped
                wait_until(lambda: not runner.run(f"kill -0 -{handle.pgid}", check=False).ok)
            runner.channels.clear()
            got = runner.poll_log(handle, 0, status=status)
            assert runner.channels == ["control"]  # the poll shell; no SFTP session either
            assert runner._control is None
            assert (got.data, got.next_offset, got.capped) == (ODD, len(ODD), False)
            if status or state is TaskState.EXITED:  # a log-only poll still sees an exit code
                assert got.status is not None
                assert (got.status.state, got.status.exit_code) == (state, code)
                if state is TaskState.EXITED:
                    assert got.status.ended_at is not None
                    assert abs(got.status.ended_at - time.time()) < 120
            else:
                assert got.status is None  # not asked whether the group lives
            inside = runner.poll_log(handle, 5, status=status)  # from the middle of the bytes
            assert (inside.data, inside.next_offset) == (ODD[5:], len(ODD))
            assert runner.poll_log(handle, len(ODD), status=status).data == b""
            assert runner.channels == ["control"]  # every poll in the same shell
        finally:
            runner.stop(handle, grace_s=0)


@pytest.mark.parametrize(("size", "limit", "polls"), [
    # the default cap: 1 MiB, 1 MiB, the rest
    pytest.param(2 * POLL_LOG_MAX + 12345, POLL_LOG_MAX, 3, id="2MiB-and-more"),
    # an exact multiple: the fourth poll finds nothing more
    pytest.param(3000, 1000, 4, id="exact-multiple"),
    pytest.param(999, 1000, 1, id="under-the-cap"),
])
def test_a_log_longer_than_the_cap_comes_over_several_polls_byte_for_byte(
    host: LabHost, size: int, limit: int, polls: int
) -> None:
    with CountingRunner(host) as runner:
        spec = task(host, "sh", "-c", f"head -c {size} /dev/urandom; exit 0")
        handle = runner.start(spec)
        wait_until(lambda: Path(spec.rc_path).exists())
        written = Path(spec.log_path).read_bytes()
        assert len(written) == size
        runner.channels.clear()
        got, offset, seen = b"", 0, []
        while True:
            poll = runner.poll_log(handle, offset, limit=limit)
            assert poll.status is not None  # the end is reported with every part
            assert (poll.status.state, poll.status.exit_code) == (TaskState.EXITED, 0)
            assert len(poll.data) <= limit and poll.next_offset == offset + len(poll.data)
            got, offset = got + poll.data, poll.next_offset
            seen.append(poll.capped)
            if not poll.capped:
                break
        assert got == written
        assert seen == [True] * (polls - 1) + [False]
        assert runner.channels == ["control"]  # one poll shell for all of them


def test_a_poll_of_a_log_not_written_yet_returns_no_bytes(host: LabHost) -> None:
    with CountingRunner(host) as runner:
        handle = TaskHandle(host.name, 1, f"{host.home}/no-such-{uuid.uuid4().hex}.log", "/x.rc")
        got = runner.poll_log(handle, 5)
        assert (got.status, got.data, got.next_offset, got.capped) == (
            TaskStatus(TaskState.LOST), b"", 5, False)  # pid 1 does not hold the rc path
        assert runner.poll_log(handle, 5, status=False).status is None
        assert runner.channels == ["control"]


def shell_pid(runner: SSHRunner) -> int:
    """The process id of the runner's poll shell on the host (a subshell's ``$$`` is its
    shell's)."""
    got = runner._in_poll_shell("echo $$")
    assert got is not None and got[0] == 0
    return int(got[1])


def test_polls_share_a_shell_that_is_replaced_once_it_is_gone(host: LabHost) -> None:
    """The polls of a runner run in one shell on the host, not a session each. A shell killed
    on the host costs no poll its answer (that poll runs as a command), and the next poll
    opens another; a log whose bytes look like the shell's end-of-poll line is read exactly."""
    fake_end = b"\n" + b"f" * 32 + b" 0\n"
    with CountingRunner(host) as runner:
        spec = task(host, "sh", "-c", f"printf '{ODD_PRINTF}'; printf '\\n{'f' * 32} 0\\n'; sleep 60")
        handle = runner.start(spec)
        try:
            wait_until(lambda: Path(spec.log_path).read_bytes() == ODD + fake_end)
            runner.channels.clear()
            first = shell_pid(runner)
            for status in (True, False, True):
                got = runner.poll_log(handle, 0, status=status)
                assert got.data == ODD + fake_end
            assert shell_pid(runner) == first and runner.channels == ["control"]
            os.kill(first, signal.SIGKILL)  # the lab's hosts share this machine's processes
            got = runner.poll_log(handle, 0)
            assert got.status is not None and got.status.state is TaskState.RUNNING
            assert got.data == ODD + fake_end
            assert runner.channels == ["control", "control"]  # the poll, as a command
            second = shell_pid(runner)
            assert second != first and runner.channels == ["control"] * 3
            assert runner.poll_log(handle, len(ODD)).data == fake_end
        finally:
            runner.stop(handle, grace_s=0)
        assert runner._shells_open == 1
    assert runner._shells_open == 0  # closed with the runner
    wait_until(lambda: not Path(f"/proc/{second}").exists())  # and its shell ended on the host


def test_concurrent_polls_each_get_their_own_task_s_bytes(host: LabHost) -> None:
    """Polls from many threads at once, as the watch loop's pool makes them for the tasks of
    one host: one at a time in the shell, the others as commands, each its own answer."""
    with SSHRunner(host.name, host.endpoint()) as runner:
        specs = [task(host, "sh", "-c", f"printf 'task {i}\\n'; sleep 60") for i in range(6)]
        handles = [runner.start(spec) for spec in specs]
        try:
            for spec, i in zip(specs, range(6), strict=True):
                wait_until(lambda s=spec, i=i: Path(s.log_path).read_bytes() == f"task {i}\n".encode())
            errors: list[BaseException] = []
            answers: dict[int, list[bytes]] = {i: [] for i in range(6)}

            def poll(i: int) -> None:
                try:
                    for _ in range(10):
                        answers[i].append(runner.poll_log(handles[i], 0).data)
                except BaseException as exc:
                    errors.append(exc)

            threads = [threading.Thread(target=poll, args=(i,)) for i in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert not errors
            assert answers == {i: [f"task {i}\n".encode()] * 10 for i in range(6)}
            assert runner._shells_open == 1
        finally:
            for handle in handles:
                runner.stop(handle, grace_s=0)


# -- files ----------------------------------------------------------------------
def test_put_and_get_file_keep_bytes_and_mode(runner: SSHRunner, host: LabHost, tmp_path: Path) -> None:
    payload = bytes(range(256)) * 1000
    (tmp_path / "up.bin").write_bytes(payload)
    remote = f"{host.home}/files/{uuid.uuid4().hex}/deep/up.bin"
    runner.put_file(str(tmp_path / "up.bin"), remote, mode=0o750)
    assert runner.run(["stat", "-c", "%a", remote]).stdout.strip() == "750"
    runner.get_file(remote, str(tmp_path / "back" / "down.bin"))
    assert (tmp_path / "back" / "down.bin").read_bytes() == payload


def test_get_of_a_missing_file_names_it(runner: SSHRunner, host: LabHost, tmp_path: Path) -> None:
    missing = f"{host.home}/missing-{uuid.uuid4().hex}"
    with pytest.raises(RemoteError, match=missing):
        runner.get_file(missing, str(tmp_path / "x"))
    assert list(tmp_path.iterdir()) == []


# -- bulk transfers beside the control path ---------------------------------------------------
def download_in_progress(local_dir: Path, thread: threading.Thread) -> None:
    """Wait until bytes of a download have arrived in ``local_dir`` (or the thread ended)."""
    deadline = time.monotonic() + 30
    while thread.is_alive() and time.monotonic() < deadline:
        if any(p.stat().st_size > 0 for p in local_dir.glob(".download-*")):
            return
        time.sleep(0.02)
    raise AssertionError("the download never got under way")


# A link like a controller's outside the cloud: BIG takes several seconds over it.
RATE = "160mbit"
BIG = 96 << 20


def download_under_way(runner: SSHRunner, remote: str, local_dir: Path
                       ) -> tuple[threading.Thread, list[BaseException]]:
    """A thread downloading ``remote`` into ``local_dir``, once its first bytes are there, and
    the list that gets what it raises."""
    errors: list[BaseException] = []

    def download() -> None:
        try:
            runner.get_file(remote, str(local_dir / Path(remote).name))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=download)
    thread.start()
    download_in_progress(local_dir, thread)
    return thread, errors


def stacks_of_threads() -> str:
    """Every thread's stack, for a test that finds one still running."""
    frames = sys._current_frames()
    return "\n".join(f"thread {t.name}:\n" + "".join(traceback.format_stack(frames[t.ident]))
                     for t in threading.enumerate() if t.ident in frames)


def random_file(runner: SSHRunner, host: LabHost, size: int) -> str:
    path = f"{host.home}/files/{uuid.uuid4().hex}.bin"
    runner.run(["sh", "-c", 'mkdir -p "${1%/*}" && head -c "$2" /dev/urandom >"$1"', "sh", path, str(size)])
    return path


@pytest.mark.netns
def test_log_reads_and_commands_go_on_while_a_slow_download_runs(
    hostlab: HostLab, runner: SSHRunner, host: LabHost, tmp_path: Path
) -> None:
    big = random_file(runner, host, BIG)
    handle = runner.start(task(host, "echo", "hello"))
    wait_for_exit(runner, handle)
    order: list[str] = []
    local = tmp_path / "down"

    def download() -> None:
        runner.get_file(big, str(local / "big.bin"))
        order.append("downloaded")

    host.throttle(RATE, to=str(hostlab.bridge_address))
    try:
        downloader = threading.Thread(target=download)
        downloader.start()
        download_in_progress(local, downloader)
        assert runner.read_log(handle, 0)[0] == b"hello\n"
        order.append("log read")
        assert runner.run(["echo", "ok"]).stdout == "ok\n"
        order.append("command")
        downloader.join(60)
    finally:
        host.heal()
    assert order == ["log read", "command", "downloaded"]
    assert (local / "big.bin").read_bytes() == Path(big).read_bytes()


@pytest.mark.netns
def test_polls_on_a_slow_link_wait_for_no_transfer_data_ahead_of_them(
    hostlab: HostLab, runner: SSHRunner, host: LabHost, tmp_path: Path
) -> None:
    """Transfers have a connection of their own: a poll's bytes never queue behind theirs in
    one TCP stream. (On one shared connection, a poll at 16 Mbit/s took 3.5 s of a 13.5 s
    download; on its own, 0.1-0.5 s.)"""
    big = random_file(runner, host, 24 << 20)
    handle = runner.start(task(host, "echo", "hello"))
    wait_for_exit(runner, handle)
    polls: list[float] = []
    host.throttle("16mbit", to=str(hostlab.bridge_address))
    try:
        downloader = threading.Thread(target=runner.get_file, args=(big, str(tmp_path / "big.bin")))
        started = time.monotonic()
        downloader.start()
        download_in_progress(tmp_path, downloader)
        while downloader.is_alive():
            before = time.monotonic()
            runner.poll(handle)
            runner.read_log(handle, 0)
            polls.append(time.monotonic() - before)
            time.sleep(0.2)
        took = time.monotonic() - started
    finally:
        host.heal()
    assert len(polls) >= 5, f"the download ended after {len(polls)} polls"
    assert max(polls) < took / 6, f"a poll took {max(polls):.1f}s of a {took:.1f}s download"


@pytest.mark.netns
# paramiko's prefetch thread, still sending read requests, dies with the connection
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_closing_the_runner_fails_a_download_in_flight_as_lost_and_leaves_nothing(
    hostlab: HostLab, runner: SSHRunner, host: LabHost, tmp_path: Path
) -> None:
    big = random_file(runner, host, BIG)
    host.throttle(RATE, to=str(hostlab.bridge_address))
    try:
        downloader, errors = download_under_way(runner, big, tmp_path)
        runner.close()
        downloader.join(BULK_STALL_S + 30)
    finally:
        host.heal()
    assert not downloader.is_alive(), stacks_of_threads()
    assert len(errors) == 1 and isinstance(errors[0], HostUnreachableError), errors
    assert "lost" in str(errors[0]) and big in str(errors[0])
    assert list(tmp_path.iterdir()) == []
    assert runner.run(["echo", "back"]).stdout == "back\n"


@pytest.mark.netns
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # as above
def test_a_download_from_a_host_cut_off_fails_as_lost_once_no_byte_came_for_the_stall_bound(
    hostlab: HostLab, runner: SSHRunner, host: LabHost, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host cut off mid-download sends nothing more and no error: the transfer fails as
    lost once no byte has come for BULK_STALL_S (shortened here), not after TCP's minutes."""
    monkeypatch.setattr("orchestrator.remote.ssh.BULK_STALL_S", 2)
    big = random_file(runner, host, BIG)
    host.throttle(RATE, to=str(hostlab.bridge_address))
    try:
        downloader, errors = download_under_way(runner, big, tmp_path)
        host.cut()
        downloader.join(60)
    finally:
        host.heal()
    assert not downloader.is_alive(), stacks_of_threads()
    assert len(errors) == 1 and isinstance(errors[0], HostUnreachableError), errors
    assert "no byte moved for 2 s" in str(errors[0]) and big in str(errors[0])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.netns
def test_transfers_beyond_the_bulk_sessions_wait_while_commands_fill_theirs(
    hostlab: HostLab, runner: SSHRunner, host: LabHost, tmp_path: Path
) -> None:
    """Every command slot, the log reader, the poll shell and more transfers than bulk slots,
    all at once, stay within sshd's MaxSessions (10) on each connection: the extra transfers wait instead
    of being refused."""
    files = [random_file(runner, host, BIG // 8) for _ in range(BULK_CHANNELS + 2)]
    base = f"{host.home}/held-{uuid.uuid4().hex}"
    script = 'touch "$1.$2"; while [ ! -e "$1.release" ]; do sleep 0.05; done'
    errors: list[BaseException] = []

    def started(work: Callable[[], object]) -> threading.Thread:
        def run() -> None:
            try:
                work()
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    def hold(i: int) -> Callable[[], object]:
        return lambda: runner.run(["sh", "-c", script, "sh", base, str(i)])

    def fetch(remote: str) -> Callable[[], object]:
        return lambda: runner.get_file(remote, str(tmp_path / Path(remote).name))

    commands = [started(hold(i)) for i in range(MAX_CHANNELS)]
    try:
        host.throttle(RATE, to=str(hostlab.bridge_address))  # the transfers overlap
        while not all(os.path.exists(f"{base}.{i}") for i in range(MAX_CHANNELS)) and not errors:
            time.sleep(0.02)
        transfers = [started(fetch(f)) for f in files]
        held = TaskHandle(host.name, 1, files[0], "/x.rc")
        assert runner.read_log(held, 0)[1] == READ_LOG_MAX
        assert runner.poll_log(held, 0, limit=16).data == Path(files[0]).read_bytes()[:16]
        assert runner._shells_open == 1  # the poll shell: a session of its own
        for t in transfers:
            t.join(60)
    finally:
        Path(f"{base}.release").touch()
        host.heal()
    for t in commands:
        t.join(60)
    assert not errors
    for f in files:
        assert (tmp_path / Path(f).name).read_bytes() == Path(f).read_bytes()


# -- host keys --------------------------------------------------------------------
def test_unknown_host_key_is_refused_with_fingerprint_and_fix(host: LabHost, tmp_path: Path) -> None:
    known_hosts = str(tmp_path / "known_hosts")
    with (
        SSHRunner(host.name, host.endpoint(known_hosts=known_hosts)) as r,
        pytest.raises(HostKeyError) as err,
    ):
        r.run(["true"])
    message, fix = err.value.message, err.value.fix or ""
    assert host.name in message and "ssh-ed25519" in message
    assert fingerprint(host_key(host.host_key_line)) in message
    assert f"ssh-keyscan -p {host.port} {host.address} >> {known_hosts}" in fix
    assert host.host_key_line in fix and "trust_on_first_use: true" in fix
    assert not os.path.exists(known_hosts)


def test_changed_host_key_is_refused_as_a_possible_attack(hostlab: HostLab) -> None:
    host, other = hostlab.hosts(2)
    endpoint = host.endpoint(host_keys=(other.host_key_line,))
    with SSHRunner(host.name, endpoint) as r, pytest.raises(HostKeyError) as err:
        r.run(["true"])
    message = err.value.message
    assert "CHANGED" in message and "attack" in message
    assert fingerprint(host_key(other.host_key_line)) in message  # expected
    assert fingerprint(host_key(host.host_key_line)) in message  # got


def test_host_key_given_in_the_spec_is_accepted(host: LabHost) -> None:
    endpoint = host.endpoint(host_keys=(host.host_key_line + " comment",), known_hosts=None)
    with SSHRunner(host.name, endpoint) as r:
        assert r.run(["echo", "ok"]).stdout == "ok\n"


def test_hashed_known_hosts_entries_are_honoured(hostlab: HostLab, host: LabHost, tmp_path: Path) -> None:
    hashed = tmp_path / "known_hosts"
    hashed.write_text(Path(hostlab.known_hosts_path).read_text())
    subprocess.run(["ssh-keygen", "-q", "-H", "-f", str(hashed)], check=True, capture_output=True)
    assert host.address not in hashed.read_text()
    with SSHRunner(host.name, host.endpoint(known_hosts=str(hashed))) as r:
        assert r.run(["echo", "ok"]).stdout == "ok\n"


def test_trust_on_first_use_records_the_key_then_refuses_a_changed_one(
    hostlab: HostLab, tmp_path: Path
) -> None:
    host = hostlab.hosts(2)[1]
    known_hosts = tmp_path / "new" / "known_hosts"
    endpoint = host.endpoint(known_hosts=str(known_hosts), trust_on_first_use=True)
    with SSHRunner(host.name, endpoint) as r:
        r.run(["true"])
    name = host.address if host.port == 22 else f"[{host.address}]:{host.port}"
    assert known_hosts.read_text() == f"{name} {host.host_key_line}\n"
    with SSHRunner(host.name, endpoint) as r:
        r.run(["true"])
    assert known_hosts.read_text().count("\n") == 1
    host.rotate_host_key()
    with SSHRunner(host.name, endpoint) as r, pytest.raises(HostKeyError, match="CHANGED"):
        r.run(["true"])


def test_trust_on_first_use_without_a_known_hosts_file_is_refused(host: LabHost) -> None:
    endpoint = host.endpoint(known_hosts=None, trust_on_first_use=True)
    with SSHRunner(host.name, endpoint) as r, pytest.raises(HostKeyError, match="known_hosts"):
        r.run(["true"])


# -- authentication -----------------------------------------------------------------
def test_wrong_user_key_is_refused_with_auth_error(host: LabHost, tmp_path: Path) -> None:
    key = tmp_path / "stranger"
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)],
        check=True,
        capture_output=True,
    )
    with (
        SSHRunner(host.name, host.endpoint(key_file=str(key))) as r,
        pytest.raises(AuthError) as err,
    ):
        r.run(["true"])
    assert f"{host.user}@{host.address}:{host.port}" in err.value.message
    assert str(key) in err.value.message and "ssh-copy-id" in (err.value.fix or "")


def test_missing_key_file_is_named(host: LabHost, tmp_path: Path) -> None:
    missing = str(tmp_path / "nope")
    with (
        SSHRunner(host.name, host.endpoint(key_file=missing)) as r,
        pytest.raises(AuthError, match=f"{missing} .* does not exist"),
    ):
        r.run(["true"])


# -- unreachable and lost hosts ---------------------------------------------------------
def test_address_without_a_host_is_unreachable(hostlab: HostLab, host: LabHost) -> None:
    address, port = hostlab.unused_address()
    endpoint = host.endpoint(address=address, port=port, connect_timeout_s=1.0)
    with (
        SSHRunner("ghost", endpoint, connect_deadline_s=2.0) as r,
        pytest.raises(HostUnreachableError) as err,
    ):
        r.run(["true"])
    assert f"{address}:{port}" in err.value.message and err.value.host == "ghost"


@pytest.mark.netns
def test_cut_host_is_unreachable(hostlab: HostLab) -> None:
    host = hostlab.hosts(2)[1]
    host.cut()
    try:
        endpoint = host.endpoint(connect_timeout_s=1.0)
        with (
            SSHRunner(host.name, endpoint, connect_deadline_s=2.0) as r,
            pytest.raises(HostUnreachableError, match=host.address),
        ):
            r.run(["true"])
    finally:
        host.restore()


@pytest.mark.netns
def test_killed_host_mid_command_is_unreachable_and_runner_reconnects(
    hostlab: HostLab, host: LabHost
) -> None:
    errors: list[BaseException] = []
    with SSHRunner(host.name, host.endpoint(connect_timeout_s=1.0)) as r:
        r.run(["true"])

        def long_command() -> None:
            try:
                r.run(["sleep", "30"], timeout_s=20)
            except BaseException as exc:
                errors.append(exc)

        worker = threading.Thread(target=long_command)
        worker.start()
        time.sleep(0.3)
        host.kill()
        worker.join(25)
        assert len(errors) == 1 and isinstance(errors[0], HostUnreachableError)
        assert "lost" in str(errors[0])
        hostlab.hosts(1)  # heals: sshd starts again
        assert r.run(["echo", "back"]).stdout == "back\n"
