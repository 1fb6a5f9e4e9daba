"""A kept cluster's SSH connections, held between commands, so that the next ``train`` starts
its tasks without a Python import of paramiko or an SSH handshake first.

The CLI's early claim (``orchestrator/early_claim.py``) runs a kept cluster's first commands
(each host's claim and its warm tasks' launches, the reads the start needs) while the
controller imports; before it can, it imports paramiko and connects to every host: some 0.15 s
of the 0.25 s from the program's start to the tasks' launch. After a ``train`` or ``up`` whose
hosts are kept, the CLI leaves one holder per spec file (as OpenSSH's ``ControlPersist`` leaves
a master connection): a detached process with a connection to each kept host, made with the
same ``SSHRunner`` and the same host-key checks, that runs what the next command's early
claim asks of it and nothing else happens there.

- **Who may ask.** It listens on an abstract Unix socket named by the record's path (no file
  on disk; no path-length limit) and answers only a peer of its own user (``SO_PEERCRED``); a
  client sends its request only to a peer of its own user whose pid the holder's pid file (in
  the private ``early/`` directory) names. What it can be asked to run on the hosts is what
  that user could run there with the cluster's key anyway.
- **What it runs.** A request names each host, its endpoint, and its commands (a script, or one
  for ``sh -s`` whose stdin carries it: a launch's secrets are in no command line); a host
  whose endpoint differs from the one held gets no answer, and the client runs its commands
  itself. Each answer is a line of JSON: the command's output and exit code.
- **How long it lives.** Until ``ORCHESTRATE_HOLD_S`` (600 s by default; 0: no holder) pass
  with no request, the kept record goes or keeps other hosts or endpoints (``down`` forgets it;
  the spec's hosts changed), or its pid file no longer names it (``stop``, or the directory
  removed): it looks every second. A connection found dropped is made again by the next
  command that uses it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from orchestrator.files import write_atomic
from orchestrator.hosts import SSHEndpoint
from orchestrator.remote.netns import start_time

HOLD_S = 600.0  # how long a holder waits for its next request, by default
CONNECT_S = 5.0  # how long it tries to reach a host when it starts; it ends if one does not answer
STOP_S = 2.0  # how long ``stop`` waits for a killed holder to be gone
ORPHAN_S = 5.0  # a holder its pid file does not name this long after its start ends
ASK_S = 0.2  # how long a client waits for the holder to take its request
ANSWER_S = 30.0  # how long a client waits for the answers (each command's own deadline is less)
RUN_S = 15.0  # each command's deadline on the holder
MAX_REQUEST = 16 << 20  # bytes


def hold_s() -> float:
    """How long a holder waits for its next request (``ORCHESTRATE_HOLD_S``); 0: none starts."""
    try:
        return max(0.0, float(os.environ.get("ORCHESTRATE_HOLD_S", HOLD_S)))
    except ValueError:
        return HOLD_S


def address(record: Path) -> bytes:
    """The abstract socket of the holder of ``record`` (a kept cluster's record file)."""
    return b"\0orchestrate-held-" + hashlib.sha256(os.fsencode(record)).hexdigest()[:32].encode()


def pid_file(record: Path) -> Path:
    return record.with_suffix(".held")


def running(record: Path) -> int | None:
    """The pid of the holder of ``record`` that its pid file names, if that process lives."""
    try:
        pid, started = (int(x) for x in pid_file(record).read_text().split())
    except (OSError, ValueError):
        return None
    return pid if start_time(pid) == started else None


def _peer(sock: socket.socket) -> tuple[int, int]:
    """The pid and uid of the process at the other end of ``sock``."""
    pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                      struct.calcsize("3i")))
    return pid, uid


# -- the client's side -------------------------------------------------------------------------
def ask(record: Path, hosts: list[dict[str, Any]]) -> socket.socket | None:
    """Hand ``hosts`` (each ``{"name", "ssh": endpoint fields, "jobs": [{"script", "stdin"}]}``)
    to the holder of ``record``; the socket its answers come on, or None where no holder of this
    user's took them (the caller runs the commands itself)."""
    pid = running(record)
    if pid is None:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(ASK_S)
        sock.connect(address(record))
        if _peer(sock) != (pid, os.getuid()):
            raise OSError("not this user's holder")
        sock.sendall(json.dumps({"hosts": hosts}).encode() + b"\n")
        sock.settimeout(ANSWER_S)
        return sock
    except OSError:
        sock.close()
        return None


def answers(sock: socket.socket) -> Iterator[dict[str, Any]]:
    """Each answer the holder sends on ``sock`` (``{"host", "job", "out", "code"}``), until it
    has sent them all or stops answering; closes ``sock``."""
    with sock, sock.makefile("rb") as lines:
        try:
            for line in lines:
                got = json.loads(line)
                if isinstance(got, dict):
                    yield got
        except (OSError, ValueError):
            return


def start(record: Path) -> None:
    """Leave a holder for ``record`` unless one runs or holding is off; its own start (the
    imports, the connections) happens after the command that starts it has ended."""
    if hold_s() <= 0 or running(record) is not None:
        return
    try:
        proc = subprocess.Popen([sys.executable, "-m", "orchestrator.holder", str(record)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True,
                                close_fds=True)
    except OSError:
        return
    # Named at once, so that ``stop`` finds it from now on; it ends if it is not (ORPHAN_S)
    started = start_time(proc.pid)
    if started is not None:
        write_atomic(pid_file(record), f"{proc.pid} {started}\n")


def stop(record: Path) -> bool:
    """Stop the holder of ``record``, if any (by its pid file), and wait until it is gone (its
    connections closed with it); whether one was running."""
    pid = running(record)
    pid_file(record).unlink(missing_ok=True)
    if pid is None:
        return False
    started = start_time(pid)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + STOP_S
    while started is not None and start_time(pid) == started and time.monotonic() < deadline:
        time.sleep(0.01)
    return True


# -- the holder's side -------------------------------------------------------------------------
def serve(record: Path) -> None:
    """Hold a connection to each host of ``record`` and answer requests, until it is time to
    end (see the module's docstring)."""
    me, born = os.getpid(), time.monotonic()
    while running(record) != me:  # its starter names it in the pid file just after the start
        if time.monotonic() - born > ORPHAN_S:
            return
        time.sleep(0.01)
    held = _hosts(record)
    if not held:
        return
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(address(record))  # taken: another holder holds this record
    except OSError:
        return
    listener.listen(16)
    from orchestrator.remote.ssh import SSHRunner

    runners = {n: SSHRunner(n, e, connect_deadline_s=CONNECT_S) for n, e in held.items()}
    try:
        for runner in runners.values():
            runner.connect()
        last = time.monotonic()
        listener.settimeout(1.0)
        while True:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                conn = None
            if conn is not None:
                if _peer(conn)[1] != os.getuid():
                    conn.close()
                else:
                    last = time.monotonic()
                    threading.Thread(target=_answer, args=(conn, held, runners),
                                     daemon=True).start()
            if time.monotonic() - last > hold_s() or running(record) != me \
                    or _hosts(record) != held:
                break
    finally:
        listener.close()
        for runner in runners.values():
            runner.close()
        with contextlib.suppress(OSError):
            if running(record) == os.getpid():
                pid_file(record).unlink()


def _hosts(record: Path) -> dict[str, SSHEndpoint] | None:
    """The kept hosts of ``record`` by name (the commands kept with them change from one
    command to the next: what the holder holds is the connections); None: none kept."""
    try:
        return {str(h["name"]): SSHEndpoint.from_json(h["ssh"])
                for h in json.loads(record.read_text(encoding="utf-8"))["hosts"]}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _answer(conn: socket.socket, held: dict[str, SSHEndpoint], runners: dict[str, Any]) -> None:
    """Run one request's commands, each in a thread of its own, and send each answer as it
    comes; a host not held at the endpoint asked for gets none."""
    lock = threading.Lock()

    def send(answer: dict[str, Any]) -> None:
        with lock, contextlib.suppress(OSError):
            conn.sendall(json.dumps(answer).encode() + b"\n")

    def run(name: str, job: int, script: str, stdin: str | None) -> None:
        try:
            got = (runners[name].run(["sh", "-s"], input=stdin, check=False, timeout_s=RUN_S)
                   if stdin is not None else runners[name].run(script, check=False,
                                                                timeout_s=RUN_S))
            send({"host": name, "job": job, "out": got.stdout, "code": got.exit_code})
        except Exception:  # the client runs it again itself
            send({"host": name, "job": job, "out": None, "code": None})

    threads = []
    try:
        conn.settimeout(ANSWER_S)  # a client that sends nothing is not waited for
        with conn.makefile("rb") as lines:
            request = json.loads(lines.readline(MAX_REQUEST))
        for host in request["hosts"]:
            name = str(host["name"])
            if name not in held or SSHEndpoint.from_json(host["ssh"]) != held[name]:
                continue
            for job, item in enumerate(host["jobs"]):
                stdin = item.get("stdin")
                thread = threading.Thread(target=run, daemon=True, args=(
                    name, job, str(item.get("script", "")),
                    None if stdin is None else str(stdin)))
                thread.start()
                threads.append(thread)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    finally:
        for thread in threads:
            thread.join()
        conn.close()


if __name__ == "__main__":
    with contextlib.suppress(Exception):
        serve(Path(sys.argv[1]))
