"""The CLI's early claim: a kept cluster's SSH hosts reached while the controller imports.

``orchestrate train FILE`` and ``up FILE`` spend their first 0.15 to 0.25 s importing the
controller (pydantic's models, the CLI), on one of this machine's CPUs, and only then connect
to each SSH host and claim its root (``SSHHostsProvider.claim_root``: one command that checks
the root is this cluster's and reads its stamps): 0.08 s more before any task can start. Then,
while the new tasks import TensorFlow, two more commands per host read what the start needs (a
kept doctor pass's stamp of the host's Python, the free task ports), each a Python started on
the host beside them. Those commands are the same every time for a cluster that is up, so the
CLI runs them early, while it imports:

- ``remember``: once ``up`` has claimed every host, each host's name, SSH endpoint and exact
  commands (the claim, and the reads run through ``run_repeatable``) are kept in
  ``ORCHESTRATE_HOME/early/`` by the spec file's path, with the file's digest (private, written
  whole, and only when it changed).
- ``start``: before anything else is imported, ``main`` hands over its arguments. For ``train``
  or ``up`` of a file whose digest is the kept one, each host gets a runner (the same
  ``SSHRunner``, the same host-key checks) and each command a thread that runs it on a channel
  of its own.
- ``runner`` and ``answer``: the provider's runner to a host is the early one only where the
  endpoint is the same, and a command takes an early answer only for the same host and a
  byte-identical command, which it has just built itself, at most once and at most
  ``FRESH_S`` old. Anything else (the spec or a host's record changed, the host did not answer,
  the command failed) is left unused, and the provider runs its commands as it always did,
  raising its own errors.

Every command kept is idempotent (the claim makes and marks the root, or finds it marked, and
reads stamp files; the others only read), so running it early changes nothing that the command
would not change a moment later. ``down`` forgets the record (``forget``), so nothing is run
early once a cluster is down. What the record holds is this user's own: it lives beside the
cluster's private keys.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator import paths
from orchestrator.files import PRIVATE_DIR, write_atomic
from orchestrator.hosts import SSHEndpoint

if TYPE_CHECKING:
    from orchestrator.remote.ssh import SSHRunner

COMMANDS = ("train", "up")  # the commands that claim every host first
DIRECTORY = "early"  # under ORCHESTRATE_HOME
CONNECT_S = 5.0  # an early connection retries this long at most; the provider then tries its own
RUN_S = 15.0  # and each command this long
FRESH_S = 30.0  # an answer older than this is not taken (a port probe's, a stamp's)
VERSION = 1


@dataclass
class _Command:
    """One command run early on a host, and what it printed once ``done`` is set (None: it
    failed)."""

    script: str
    done: threading.Event = field(default_factory=threading.Event)
    stdout: str | None = None
    at: float = 0.0  # time.monotonic() when it ended
    taken: bool = False


@dataclass
class _Reach:
    """One host's early commands, over one runner."""

    name: str
    endpoint: SSHEndpoint
    runner: SSHRunner
    commands: dict[str, _Command]
    runner_taken: bool = False


_lock = threading.Lock()
_reaches: dict[tuple[str, str], _Reach] = {}  # by (the spec file's real path, host name)


def start(argv: Sequence[str]) -> int:
    """Reach the hosts of the spec ``argv`` names (``orchestrate`` ARGV), if it is ``train`` or
    ``up`` of a file whose commands are kept; returns how many hosts are being reached."""
    spec_path, found = _kept_for(argv)
    if spec_path is None or not found:
        return 0
    # Imported here, before the controller is, so that no thread imports beside another
    from orchestrator.remote.ssh import SSHRunner

    reaches = [_Reach(name, endpoint, SSHRunner(name, endpoint, connect_deadline_s=CONNECT_S),
                      {s: _Command(s) for s in scripts})
               for name, endpoint, scripts in found]
    with _lock:
        _reaches.update({(_key(spec_path), r.name): r for r in reaches})
    for reach in reaches:  # each command on a channel of its own, over the one connection
        for i, command in enumerate(reach.commands.values()):
            threading.Thread(target=_run, args=(reach.runner, command), daemon=True,
                             name=f"early-{reach.name}-{i}").start()
    return len(reaches)


def _run(runner: SSHRunner, command: _Command) -> None:
    try:
        command.stdout = runner.run(command.script, timeout_s=RUN_S).stdout
        command.at = time.monotonic()
    except Exception:  # whatever it was, the provider meets it again itself
        pass
    finally:
        command.done.set()


def runner(spec_path: Path, name: str, endpoint: SSHEndpoint) -> SSHRunner | None:
    """The early runner of host ``name`` of the spec at ``spec_path``, if it goes to exactly
    ``endpoint`` (once: its new owner closes it). Its connection may still be opening: the
    owner's first command waits for it rather than opening another."""
    with _lock:
        reach = _reaches.get((_key(spec_path), name))
        if reach is None or reach.endpoint != endpoint or reach.runner_taken:
            return None
        reach.runner_taken = True
        return reach.runner


def answer(spec_path: Path, name: str, endpoint: SSHEndpoint, script: str) -> str | None:
    """What ``script`` printed on host ``name`` of the spec at ``spec_path`` if exactly it ran
    early there, over a connection to ``endpoint`` (once; waits for it to end); else None."""
    with _lock:
        reach = _reaches.get((_key(spec_path), name))
    command = None if reach is None or reach.endpoint != endpoint else reach.commands.get(script)
    if command is None:
        return None
    command.done.wait(CONNECT_S + RUN_S)  # its own deadlines end it sooner
    with _lock:
        if command.stdout is None or command.taken or time.monotonic() - command.at > FRESH_S:
            return None
        command.taken = True
        return command.stdout


def kept(spec_path: Path, name: str, endpoint: SSHEndpoint) -> list[str]:
    """The commands kept for host ``name`` at ``endpoint`` that this process ran early."""
    with _lock:
        reach = _reaches.get((_key(spec_path), name))
        return list(reach.commands) if reach is not None and reach.endpoint == endpoint else []


def used() -> list[tuple[str, int]]:
    """For each host reached early, by name, how many of its early answers were taken."""
    with _lock:
        return sorted((r.name, sum(c.taken for c in r.commands.values()))
                      for r in _reaches.values())


def reset(wait_s: float = 0.0) -> None:
    """Forget every early command of this process, closing the runners nobody adopted (after
    waiting up to ``wait_s`` for their commands)."""
    with _lock:
        reaches = list(_reaches.values())
        _reaches.clear()
    for reach in reaches:
        for command in reach.commands.values():
            command.done.wait(wait_s)
        if not reach.runner_taken:
            reach.runner.close()


# -- the record ------------------------------------------------------------------------------
def remember(spec_path: Path, hosts: Sequence[tuple[str, SSHEndpoint, Sequence[str]]]) -> None:
    """Keep ``hosts`` (each host's name, endpoint and commands) for the next command of the
    spec at ``spec_path`` as it is now: written only where it differs from what is kept."""
    try:
        digest = _digest(spec_path)
    except OSError:
        forget(spec_path)
        return
    text = json.dumps({"version": VERSION, "spec": _key(spec_path), "digest": digest,
                       "hosts": [{"name": n, "ssh": asdict(e), "commands": list(c)}
                                 for n, e, c in hosts]})
    path = _record(spec_path)
    with contextlib.suppress(OSError):
        if path.read_text(encoding="utf-8") == text:
            return
    path.parent.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR)
    write_atomic(path, text)


def forget(spec_path: Path) -> None:
    """Keep no claims for the spec at ``spec_path``."""
    with contextlib.suppress(OSError):
        _record(spec_path).unlink(missing_ok=True)


def _kept_for(argv: Sequence[str]) -> tuple[Path | None, list[tuple[str, SSHEndpoint, list[str]]]]:
    words = [a for a in argv if not a.startswith("-")]
    if not words or words[0] not in COMMANDS or "--attach" in argv:
        return None, []
    for word in words[1:]:  # the FILE (an option's value may come first: tried, not found)
        try:
            return Path(word), _read(Path(word))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None, []


def _read(spec_path: Path) -> list[tuple[str, SSHEndpoint, list[str]]]:
    data: dict[str, Any] = json.loads(_record(spec_path).read_text(encoding="utf-8"))
    if data["version"] != VERSION or data["spec"] != _key(spec_path) \
            or data["digest"] != _digest(spec_path):
        raise ValueError("kept for another spec")
    found = []
    for host in data["hosts"]:
        ssh = dict(host["ssh"])
        endpoint = SSHEndpoint(**{**ssh, "host_keys": tuple(str(k) for k in ssh["host_keys"])})
        found.append((str(host["name"]), endpoint, [str(c) for c in host["commands"]]))
    return found


def _key(spec_path: Path) -> str:
    return str(spec_path.resolve())


def _digest(spec_path: Path) -> str:
    return hashlib.sha256(spec_path.read_bytes()).hexdigest()


def _record(spec_path: Path) -> Path:
    key = hashlib.sha256(os.fsencode(spec_path.resolve())).hexdigest()[:32]
    return paths.home() / DIRECTORY / f"{key}.json"
