"""Stdlib-only probes of a host: which task ports are taken, and the states of a process group;
and, importing TensorFlow only when asked, what an interpreter's TensorFlow is and sees.

The controller imports these for this machine and runs this file's source with ``python -c`` on
SSH hosts (``python -c SOURCE ports START END WANT``, ``... states PGID`` or ``... tensorflow``),
so both agree.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
from typing import Any


def port_taken(port: int, address: str = "") -> bool:
    """Whether a gRPC server could not bind ``port`` (on every interface, as TF's does).

    Bound with SO_REUSEADDR, as gRPC binds: a port whose old connections linger in
    TIME_WAIT is free for the next task.
    """
    sock = socket.socket()
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
    except OSError:
        return True
    finally:
        sock.close()
    return False


def taken_ports(start: int, end: int, want: int) -> list[int]:
    """Taken ports of ``start..end``, probed in order until ``want`` free ones were seen."""
    taken, free = [], 0
    for port in range(start, end + 1):
        if free >= want:
            break
        if port_taken(port):
            taken.append(port)
        else:
            free += 1
    return taken


def process_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, process-group id) of process ``pid``, or None when there is none.

    One read of ``/proc/PID/stat``: how the controller asks after a task's group leader
    without listing every process (``group_members``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return _state_and_group(f.read())
    except (OSError, ValueError, IndexError):
        return None


def _state_and_group(stat: bytes) -> tuple[str, int]:
    # pid (comm) state ppid pgrp ...: comm may hold spaces or parens, so split after the last ')'
    fields = stat[stat.rindex(b")") + 2 :].split()
    return fields[0].decode(), int(fields[2])


def group_members(pgid: int) -> list[tuple[int, str]]:
    """(pid, state letter) of every process in process group ``pgid``, read from /proc.

    Lists every process of the machine: ``process_stat`` of the group's leader is the cheap
    question while the leader lives."""
    members = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                state, group = _state_and_group(f.read())
        except (OSError, ValueError, IndexError):
            continue
        if group == pgid:
            members.append((int(name), state))
    return members


def tensorflow_facts() -> dict[str, Any]:
    """This interpreter's Python version, and its TensorFlow's version and GPUs (or why it
    does not import)."""
    out: dict[str, Any] = {"python": platform.python_version()}
    try:
        import tensorflow as tf

        out["tensorflow"] = tf.__version__
        out["gpus"] = [d.name for d in tf.config.list_physical_devices("GPU")]
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def main(argv: list[str]) -> int:
    command, *args = argv
    if command == "ports":
        start, end, want = map(int, args)
        print("\n".join(str(p) for p in taken_ports(start, end, want)))
    elif command == "states":
        print("".join(state for _, state in group_members(int(args[0]))))
    elif command == "tensorflow":
        print(json.dumps(tensorflow_facts()))
    else:
        print(f"unknown probe {command!r}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
