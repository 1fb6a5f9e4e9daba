"""A private network for the local provider's tasks: TensorFlow's gRPC server binds every
interface and has no authentication, so local tasks would be reachable from other machines.

One holder process per cluster lives in its own user and network namespace (``unshare --user
--map-root-user --net``: no privilege needed where the kernel allows unprivileged user
namespaces), with only the loopback interface, up. Every task enters it (``nsenter --target
HOLDER --user --net --preserve-credentials``), so the tasks reach each other on 127.0.0.1 and
nothing outside this machine, nor any other process of it, reaches them. The holder is
detached: it outlives the controller (``train --attach`` finds it by its pid file) and ``down``
stops it. Where the platform refuses (no ``unshare``/``nsenter``, user namespaces disabled or
restricted), the caller falls back to this machine's network and says why.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from orchestrator.files import write_atomic

START_S = 10.0  # how long a holder may take to say it is ready
ORPHAN_S = 5.0  # a holder its pid file never named (the controller died starting it) ends
# Run by the holder's interpreter (-S: stdlib only; argv[1]: its pid file): bring lo up, say
# so, then live while the pid file names it. 'down' removes the file, and so does removing the
# cluster's directory: either way the holder ends by itself within a second.
HOLD = f"""
import fcntl, os, socket, struct, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
flags = struct.unpack("16sh", fcntl.ioctl(s, 0x8913, struct.pack("16sh", b"lo", 0)))[1]
fcntl.ioctl(s, 0x8914, struct.pack("16sh", b"lo", flags | 1))
s.close()
sys.stdout.write("ready\\n")
sys.stdout.flush()
me, seen, born = str(os.getpid()), False, time.monotonic()
while True:
    time.sleep(1)
    try:
        with open(sys.argv[1]) as f:
            named = f.read().split()[:1] == [me]
    except OSError:
        named = False
    seen = seen or named
    if not named and (seen or time.monotonic() - born > {ORPHAN_S}):
        sys.exit(0)
"""


class Unavailable(Exception):
    """This machine cannot give the tasks a private network; the message says why."""


@dataclass(frozen=True)
class Holder:
    """The process that keeps the namespace: its pid and start time (against pid reuse)."""

    pid: int
    started: int

    def alive(self) -> bool:
        return start_time(self.pid) == self.started

    def enter(self) -> tuple[str, ...]:
        """The argv prefix that runs a command inside the namespace."""
        return ("nsenter", f"--target={self.pid}", "--user", "--net",
                "--preserve-credentials", "--")

    def stop(self) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


def found(pid_file: Path) -> Holder | None:
    """The cluster's holder recorded in ``pid_file``, if it still runs."""
    try:
        pid, started = (int(x) for x in pid_file.read_text().split())
    except (OSError, ValueError):
        return None
    holder = Holder(pid, started)
    return holder if holder.alive() else None


def ensure(pid_file: Path) -> Holder:
    """The cluster's holder: the one recorded, else a new one (recorded).

    Raises:
        Unavailable: the platform cannot make one (the reason is the message).
    """
    holder = found(pid_file)
    if holder is not None:
        return holder
    for tool in ("unshare", "nsenter"):
        if shutil.which(tool) is None:
            raise Unavailable(f"{tool} (util-linux) is not installed")
    holder = _start(pid_file)
    write_atomic(str(pid_file), f"{holder.pid} {holder.started}\n")
    return holder


def stop(pid_file: Path) -> bool:
    """Stop the cluster's holder, if any; whether one was running."""
    holder = found(pid_file)
    pid_file.unlink(missing_ok=True)
    if holder is None:
        return False
    holder.stop()
    return True


def _start(pid_file: Path) -> Holder:
    # --map-root-user: the holder is root in its namespace, so it keeps the capability to bring
    # lo up across exec (a mapped non-root uid loses it). Tasks enter with their own
    # credentials (--preserve-credentials): the same user, shown as uid 0 inside.
    errors = pid_file.with_name(pid_file.name + ".err")
    with open(errors, "wb") as err:
        proc = subprocess.Popen(
            ["unshare", "--user", "--map-root-user", "--net", "--", sys.executable, "-S", "-c",
             HOLD, str(pid_file)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
            start_new_session=True, close_fds=True)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], START_S)
    line = proc.stdout.readline() if ready else b""
    proc.stdout.close()  # it writes nothing after 'ready'
    if line.strip() == b"ready":
        started = start_time(proc.pid)
        if started is None:
            raise Unavailable("the namespace's holder ended at once")
        return Holder(proc.pid, started)
    proc.kill()
    proc.wait()
    said = errors.read_text(errors="replace").strip().splitlines()
    raise Unavailable(f"unshare --user --net failed: {said[-1][:300] if said else 'no answer'} "
                      "(user namespaces disabled or restricted on this machine?)")


def start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot), or None when it is gone (or a
    zombie, as a killed holder is until its parent reaps it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def wait_gone(holder: Holder, timeout_s: float = 5.0) -> bool:
    """Whether the holder is gone within ``timeout_s`` (after ``stop``)."""
    deadline = time.monotonic() + timeout_s
    while holder.alive():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True
