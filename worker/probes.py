"""Stdlib-only probes of a host: which task ports are taken, and the states of a process group.

The controller imports these for this machine and runs this file's source with ``python -c`` on
SSH hosts (``python -c SOURCE ports START END WANT`` or ``... states PGID``), so both agree.
"""

from __future__ import annotations

import os
import socket
import sys


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


def group_members(pgid: int) -> list[tuple[int, str]]:
    """(pid, state letter) of every process in process group ``pgid``, read from /proc."""
    members = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...: comm may hold spaces or parens, so split after the last ')'
        fields = stat[stat.rindex(b")") + 2 :].split()
        if int(fields[2]) == pgid:
            members.append((int(name), fields[0].decode()))
    return members


def main(argv: list[str]) -> int:
    command, *args = argv
    if command == "ports":
        start, end, want = map(int, args)
        print("\n".join(str(p) for p in taken_ports(start, end, want)))
    elif command == "states":
        print("".join(state for _, state in group_members(int(args[0]))))
    else:
        print(f"unknown probe {command!r}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
