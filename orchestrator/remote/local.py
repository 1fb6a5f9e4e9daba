"""The Runner for this machine: shell scripts through subprocess, files and signals directly."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from pathlib import Path

from orchestrator.remote.base import ExecResult, Runner, TaskHandle, TaskState, TaskStatus


class LocalRunner(Runner):
    def __init__(self, host_name: str = "localhost") -> None:
        super().__init__(host_name)

    def _exec(self, script: str, timeout_s: float | None = None) -> ExecResult:
        proc = subprocess.run(
            ["sh", "-c", script],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        )
        return ExecResult(proc.returncode, proc.stdout, proc.stderr)

    def put_file(self, local_path: str, remote_path: str, mode: int | None = None) -> None:
        Path(remote_path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(local_path, remote_path)
        if mode is not None:
            os.chmod(remote_path, mode)

    def get_file(self, remote_path: str, local_path: str) -> None:
        Path(local_path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(remote_path, local_path)

    def poll(self, handle: TaskHandle) -> TaskStatus:
        code = _read_rc(handle.rc_path)
        if code is not None:
            return TaskStatus(TaskState.EXITED, code)
        if self._group_alive(handle):
            return TaskStatus(TaskState.RUNNING)
        code = _read_rc(handle.rc_path)  # it may have ended between the two looks
        if code is not None:
            return TaskStatus(TaskState.EXITED, code)
        return TaskStatus(TaskState.LOST)

    def signal(self, handle: TaskHandle, sig: str) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(handle.pgid, getattr(signal, "SIG" + sig))

    def _group_alive(self, handle: TaskHandle) -> bool:
        return any(True for _ in live_group_members(handle.pgid))

    def read_log(self, handle: TaskHandle, offset: int) -> tuple[bytes, int]:
        try:
            with open(handle.log_path, "rb") as f:
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            return b"", offset
        return data, offset + len(data)


def _read_rc(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text.lstrip("-").isdigit() else None


def live_group_members(pgid: int) -> list[int]:
    """PIDs in process group ``pgid`` that are not zombies (a zombie still answers kill 0)."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...: comm may hold spaces or parens, so split after the last ')'
        fields = stat[stat.rindex(b")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] != b"Z":
            members.append(int(entry.name))
    return members
