"""The per-container shim of tests/podlab.py (what conmon is to a CRI runtime); stdlib only.

Run as root with ``python -S podshim.py POD_DIR``; it reads ``POD_DIR/shim.json`` (written by
``podlab``) and:

1. joins the pod's network namespace (``setns``) and makes a PID namespace for its children
   (``unshare(CLONE_NEWPID)``), so that its one fork is the container's PID 1 and the shim is
   that process's parent: ``waitpid`` gives the exact exit code or signal;
2. in that child (PID 1): new mount, UTS and IPC namespaces; the host name; a root file system
   that is an overlay of the host's root (lower) and a tmpfs (upper: the container's writes
   stay in the pod), with the host's other top-level mounts bound as they are, a fresh /proc,
   /sys and /dev/shm, the host's /dev, the pod's /etc/hosts, /etc/hostname,
   /etc/resolv.conf and volumes bound at their paths (mount points made in the overlay, never
   on the host); ``chroot`` into it, the working directory, the user and group, then
   ``execvpe`` of the command with exactly the given environment. A failure on the way is
   reported through a close-on-exec pipe: the container then ends with exit code 128 and
   reason ``StartError`` (as a runtime that cannot start a container reports it);
3. owns the container's stdout and stderr pipes and writes ``container.log`` in the CRI
   format: ``<RFC 3339 UTC, nanoseconds> stdout|stderr F|P <content>``, one record per line
   (``P``: a piece of a line longer than ``PARTIAL_BYTES``), reading both pipes to their end
   (every process of the PID namespace is gone by then) before it reaps PID 1, so that no
   last line is lost;
4. writes ``status.json`` (atomically: a rename): ``{"state": "running", "startedAt"}`` once
   the command is executing, then ``{"state": "terminated", "exitCode", "reason", "signal",
   "message", "startedAt", "finishedAt"}`` when PID 1 has ended (killed by signal N:
   exitCode 128+N, signal N; reason ``Completed`` for 0, ``Error`` otherwise).

The container's PID (as this machine sees it) goes to ``container.pid`` as soon as it exists.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import json
import os
import pwd
import re
import selectors
import socket
import sys
import time
from pathlib import Path
from typing import Any

PARTIAL_BYTES = 16 * 1024  # containerd's maximum log line before it splits it with P records
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
OWN_MOUNTS = ("/proc", "/sys", "/dev", "/run/netns")  # not the host's in a container
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int,
           data: str | None = None) -> None:
    def c(text: str | None) -> bytes | None:
        return None if text is None else text.encode()

    _check(_libc.mount(c(source), c(target), c(fstype), ctypes.c_ulong(flags), c(data)),
           f"mount {source} on {target}")


def _rfc3339_nano(ns: int) -> str:
    """``2026-11-25T10:22:11.123456789Z`` (containerd's fixed-width RFC3339Nano)."""
    seconds, nanos = divmod(ns, 1_000_000_000)
    stamp = datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc)
    return f"{stamp:%Y-%m-%dT%H:%M:%S}.{nanos:09d}Z"


def _rfc3339(ns: int) -> str:
    """Seconds, as Kubernetes serialises a container state's times."""
    stamp = datetime.datetime.fromtimestamp(ns // 1_000_000_000, datetime.timezone.utc)
    return f"{stamp:%Y-%m-%dT%H:%M:%SZ}"


def _write_json(path: Path, value: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value), encoding="utf-8")
    os.replace(tmp, path)


# -- the container (PID 1, until it executes the command) ------------------------
def _top_level_mounts() -> list[str]:
    """Mount points of the host's mounts right on its root (not /proc, /sys, /dev, /run/netns)."""
    rows = [line.split() for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    root_ids = {row[0] for row in rows if row[4] == "/"}
    points = []
    for row in rows:
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), row[4])
        if row[1] in root_ids and point != "/" and not any(
                point == own or point.startswith(own + "/") for own in OWN_MOUNTS):
            points.append(point)
    return points


def _mount_point(path: str, like: str) -> None:
    """Make ``path`` (in the overlay) a directory, or an empty file when ``like`` is a file."""
    if os.path.isdir(like):
        os.makedirs(path, exist_ok=True)
    elif not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        Path(path).touch()


def _build_root(cfg: dict[str, Any]) -> str:
    """The container's root file system, mounted at ``cfg["rootfs"]``; returns that path."""
    host_mounts = _top_level_mounts()
    rootfs, layer = cfg["rootfs"], cfg["layer"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", layer, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")
    os.mkdir(f"{layer}/upper", 0o755)
    os.mkdir(f"{layer}/work", 0o755)
    _mount("overlay", rootfs, "overlay", 0,
           f"lowerdir=/,upperdir={layer}/upper,workdir={layer}/work")
    for point in host_mounts:
        _mount(point, rootfs + point, None, MS_BIND | MS_REC)
    _mount("proc", f"{rootfs}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _mount("sysfs", f"{rootfs}/sys", "sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _mount("/dev", f"{rootfs}/dev", None, MS_BIND | MS_REC)
    os.makedirs(f"{rootfs}/dev/shm", exist_ok=True)
    _mount("shm", f"{rootfs}/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777,size=65536k")
    for source, target, read_only in cfg["binds"]:
        inside = rootfs + target
        _mount_point(inside, source)
        _mount(source, inside, None, MS_BIND | MS_REC)
        if read_only:
            _mount(None, inside, None, MS_BIND | MS_REMOUNT | MS_RDONLY)
    return str(rootfs)


def _user(cfg: dict[str, Any]) -> tuple[int, int]:
    uid = 0 if cfg["uid"] is None else int(cfg["uid"])
    if cfg["gid"] is not None:
        return uid, int(cfg["gid"])
    try:
        return uid, pwd.getpwuid(uid).pw_gid  # as a runtime reads the image's /etc/passwd
    except KeyError:
        return uid, 0


def _become_container(cfg: dict[str, Any], out_w: int, err_w: int, fail_w: int) -> None:
    """PID 1: make the container's world, then execute its command (never returns)."""
    try:
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC), "unshare")
        socket.sethostname(cfg["hostname"])
        uid, gid = _user(cfg)
        rootfs = _build_root(cfg)
        os.chroot(rootfs)
        os.chdir("/")
        os.makedirs(cfg["working_dir"], exist_ok=True)  # as runc does, before the user changes
        os.chdir(cfg["working_dir"])
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        command = cfg["command"]
        os.execvpe(command[0], command, cfg["env"])
    except BaseException as exc:  # any failure is the container's start error
        with contextlib.suppress(OSError):
            os.write(fail_w, f"{type(exc).__name__}: {exc}".encode(errors="replace"))
    os._exit(128)


# -- the shim ------------------------------------------------------------------------
class _LogWriter:
    """CRI log records from two pipes, a line (or a PARTIAL_BYTES piece) at a time."""

    def __init__(self, path: str) -> None:
        self.file = open(path, "ab", buffering=0)  # noqa: SIM115 - open for the shim's life
        self.pending = {"stdout": b"", "stderr": b""}

    def feed(self, stream: str, data: bytes) -> None:
        buffer = self.pending[stream] + data
        records = []
        while True:
            newline = buffer.find(b"\n", 0, PARTIAL_BYTES + 1)
            if newline >= 0:
                records.append((b"F", buffer[:newline]))
                buffer = buffer[newline + 1:]
            elif len(buffer) > PARTIAL_BYTES:
                records.append((b"P", buffer[:PARTIAL_BYTES]))
                buffer = buffer[PARTIAL_BYTES:]
            else:
                break
        self.pending[stream] = buffer
        self._write(stream, records)

    def finish(self, stream: str) -> None:
        if self.pending[stream]:
            self._write(stream, [(b"F", self.pending[stream])])
            self.pending[stream] = b""

    def _write(self, stream: str, records: list[tuple[bytes, bytes]]) -> None:
        if records:
            stamp = f"{_rfc3339_nano(time.time_ns())} {stream} ".encode()
            self.file.write(b"".join(stamp + tag + b" " + text + b"\n" for tag, text in records))


def _pump(log: _LogWriter, out_r: int, err_r: int) -> None:
    """Copy both pipes into the log until each is at its end."""
    selector = selectors.DefaultSelector()
    selector.register(out_r, selectors.EVENT_READ, "stdout")
    selector.register(err_r, selectors.EVENT_READ, "stderr")
    open_streams = 2
    while open_streams:
        for key, _ in selector.select():
            data = os.read(key.fd, 65536)
            if data:
                log.feed(key.data, data)
            else:
                log.finish(key.data)
                selector.unregister(key.fd)
                os.close(key.fd)
                open_streams -= 1


def _ended(status: int, started: int, message: str | None) -> dict[str, Any]:
    signal_number = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    code = 128 + signal_number if signal_number is not None else os.WEXITSTATUS(status)
    reason = "StartError" if message is not None else "Completed" if code == 0 else "Error"
    return {"state": "terminated", "exitCode": code, "reason": reason, "signal": signal_number,
            "message": message, "startedAt": _rfc3339(started),
            "finishedAt": _rfc3339(time.time_ns())}


def main(pod_dir: str) -> int:
    base = Path(pod_dir)
    cfg: dict[str, Any] = json.loads((base / "shim.json").read_text(encoding="utf-8"))
    log = _LogWriter(str(base / "container.log"))
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    fail_r, fail_w = os.pipe()  # close-on-exec (PEP 446): EOF alone means the exec worked
    started = time.time_ns()
    try:
        netns = os.open(cfg["netns"], os.O_RDONLY)
        _check(_libc.setns(netns, CLONE_NEWNET), "setns")
        os.close(netns)
        _check(_libc.unshare(CLONE_NEWPID), "unshare(CLONE_NEWPID)")
    except OSError as exc:
        _write_json(base / "status.json", _ended(128 << 8, started, f"shim: {exc}"))
        return 1
    pid = os.fork()
    if pid == 0:
        _become_container(cfg, out_w, err_w, fail_w)
    for fd in (out_w, err_w, fail_w):
        os.close(fd)
    (base / "container.pid.tmp").write_text(str(pid))
    os.replace(base / "container.pid.tmp", base / "container.pid")
    failure = b""
    while chunk := os.read(fail_r, 4096):
        failure += chunk
    os.close(fail_r)
    if not failure:
        _write_json(base / "status.json", {"state": "running", "startedAt": _rfc3339(started)})
    _pump(log, out_r, err_r)
    _, status = os.waitpid(pid, 0)
    message = failure.decode(errors="replace") if failure else None
    _write_json(base / "status.json", _ended(status, started, message))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
