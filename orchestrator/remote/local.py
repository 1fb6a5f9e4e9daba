"""The Runner for this machine: shell scripts through subprocess, files and signals directly."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from dataclasses import replace
from pathlib import Path

from orchestrator.errors import RemoteError
from orchestrator.remote.base import (
    POLL_LOG_MAX,
    ExecResult,
    LaunchSpec,
    LogPoll,
    Runner,
    TaskHandle,
    TaskState,
    TaskStatus,
    owns_group,
)
from orchestrator.remote.netns import Holder
from worker.probes import group_members, process_stat

# States of a process that is no more: a zombie (exited, not yet reaped; it still answers
# kill 0, and a container's PID 1 may never reap it) and a dead one on its way out.
GONE = ("Z", "X", "x")
PRIVATE_UMASK = 0o077


class LocalRunner(Runner):
    """Every command runs with umask 077: what the controller makes here (run and log
    directories, logs, exit code files, staged checkpoints) is private whatever this process's
    umask; a task gets this process's umask back for what it writes itself."""

    def __init__(self, host_name: str = "localhost") -> None:
        super().__init__(host_name)
        self.netns: Holder | None = None  # tasks start inside it (see remote/netns.py)

    def _exec(self, script: str, timeout_s: float | None = None,
              input: str | None = None) -> ExecResult:
        stdin = {"input": input} if input is not None else {"stdin": subprocess.DEVNULL}
        try:
            proc = subprocess.run(["sh", "-c", f"umask {PRIVATE_UMASK:03o}; {script}"],
                                  capture_output=True, text=True, timeout=timeout_s, **stdin)
        except subprocess.TimeoutExpired:
            raise RemoteError(f"command did not finish within {timeout_s}s: {script[:200]}",
                              host=self.host_name) from None
        return ExecResult(proc.returncode, proc.stdout, proc.stderr)

    def start(self, spec: LaunchSpec) -> TaskHandle:
        restore = ("sh", "-c", f'umask {process_umask():03o} && exec "$@"', "sh")
        enter = self.netns.enter() if self.netns is not None else ()
        return super().start(replace(spec, argv=(*enter, *restore, *spec.argv)))

    def process_states(self, handle: TaskHandle, python: str, timeout_s: float = 15.0) -> str:
        return "".join(state for _, state in group_members(handle.pgid))

    def put_file(self, local_path: str, remote_path: str, mode: int | None = None) -> None:
        Path(remote_path).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        shutil.copyfile(local_path, remote_path)
        os.chmod(remote_path, 0o600 if mode is None else mode)

    def get_file(self, remote_path: str, local_path: str) -> None:
        Path(local_path).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        shutil.copyfile(remote_path, local_path)
        os.chmod(local_path, 0o600)

    def poll(self, handle: TaskHandle) -> TaskStatus:
        exited = _exited(handle.rc_path)
        if exited is not None:
            return exited
        if self._group_alive(handle):
            return TaskStatus(TaskState.RUNNING)
        return _exited(handle.rc_path) or TaskStatus(TaskState.LOST)  # it may just have ended

    def signal(self, handle: TaskHandle, sig: str) -> None:
        if not owns_group(handle):
            return  # the id now leads someone else's group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(handle.pgid, getattr(signal, "SIG" + sig))

    def _group_alive(self, handle: TaskHandle) -> bool:
        """Whether any process of the task's group lives (zombies do not).

        The group's leader is the launch wrapper, which waits for the task (and traps TERM to
        outlive it), so while the leader lives one read of its ``/proc/PGID/stat`` answers,
        with no look at other processes. Only a group whose leader is gone or a zombie (killed,
        or a wrapper that died first) needs every process listed (``group_members``).
        """
        if not owns_group(handle):
            return False
        leader = process_stat(handle.pgid)
        if leader is not None and leader[0] not in GONE and leader[1] == handle.pgid:
            return True
        return any(True for _ in live_group_members(handle.pgid))

    def read_log(self, handle: TaskHandle, offset: int) -> tuple[bytes, int]:
        try:
            with open(handle.log_path, "rb") as f:
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            return b"", offset
        return data, offset + len(data)

    def poll_log(self, handle: TaskHandle, offset: int, *, status: bool = True,
                 limit: int = POLL_LOG_MAX) -> LogPoll:
        """``poll`` (or, without ``status``, the rc file alone), then ``read_log``: direct
        reads, no round trip. The log is read in place, so it comes whole (``limit`` bounds
        what a reply carries over a link; cutting a read here would only read the rest again
        on every later poll). It goes through ``read_log``, which subclasses may wrap."""
        got = self.poll(handle) if status else _exited(handle.rc_path)
        data, next_offset = self.read_log(handle, offset)
        return LogPoll(got, data, next_offset)


def _exited(rc_path: str) -> TaskStatus | None:
    try:
        text = Path(rc_path).read_text().strip()
        ended = os.stat(rc_path).st_mtime
    except FileNotFoundError:
        return None
    code = int(text) if text.lstrip("-").isdigit() else None
    return TaskStatus(TaskState.EXITED, code, ended) if code is not None else None


def process_umask() -> int:
    """This process's umask, read without changing it (``os.umask`` sets it, for every thread)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(PRIVATE_UMASK)
    os.umask(mask)
    return mask


def live_group_members(pgid: int) -> list[int]:
    """PIDs in process group ``pgid`` that are not zombies (a zombie still answers kill 0)."""
    return [pid for pid, state in group_members(pgid) if state not in GONE]
