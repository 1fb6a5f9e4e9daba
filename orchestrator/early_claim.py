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

And for ``train`` (not ``--no-doctor``, ``--attach`` or ``--resume``: the runs whose first
attempt starts warm while the doctor checks, ``Supervisor.prestart``), the launches of that
attempt's warm tasks, as the last such ``train`` made them (``remember_launches``, the run's id
kept as a token): a new run id is picked, and each host's claim and its launches go as one
command (``_folded``), whose launches run only where the claim says the root is this
cluster's, so the tasks start importing TensorFlow some 0.2 s sooner, with no round trip
between the claim and the launches. The controller takes that id for its run (``run_id``),
and a task's launch takes the early one only where its script is byte-identical
(``launched``). An early task not taken is
stopped (``void``: its process group killed, its files removed) before anything else starts
on its host: where a launch differs, where the sync found the code or the worker changed (it
may have imported the old code); in the background where the host's endpoint changed; and
when the command ends, with the run's directory where the run never took the id. A task
nobody stops ends itself: it waits at most ``ORCHESTRATE_WARM_WAIT_S`` for its go.

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
import re
import shlex
import threading
import time
import uuid
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
LAUNCHING = "train"  # the command that also starts its first attempt's warm tasks early ...
NO_LAUNCH = ("--no-doctor", "--attach", "--resume")  # ... unless it starts no warm first attempt
TOKEN = "@ORCHESTRATE_EARLY_RUN_ID@"  # the run id, in a kept launch
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
    stopped: bool = False  # an early task's launch: its task was stopped, none took it
    files: tuple[str, ...] = ()  # an early task's launch: what its task writes (log, pid, rc)


@dataclass
class _Reach:
    """One host's early commands, over one runner."""

    name: str
    endpoint: SSHEndpoint
    runner: SSHRunner
    commands: dict[str, _Command]
    runner_taken: bool = False
    launches: list[_Command] = field(default_factory=list)  # warm tasks' launch scripts
    run_dir: str = ""  # where the launches' run keeps its files on the host
    voided: bool = False  # no launch is to run from now on (``void``)
    claimed: tuple[str, ...] = ()  # the claim's first lines that say the root is this cluster's


@dataclass
class _Launch:
    """The early start of one spec's first attempt: its run id, handed over once."""

    run_id: str
    handed: bool = False


_lock = threading.Lock()
_reaches: dict[tuple[str, str], _Reach] = {}  # by (the spec file's real path, host name)
_launches: dict[str, _Launch] = {}  # by the spec file's real path
_held: set[str] = set()  # the spec files whose early commands a holder took


def begin(argv: Sequence[str]) -> None:
    """``start``, as the program's first step: whatever fails leaves nothing started (the
    command then claims the hosts itself, as ever)."""
    try:
        start(argv)
    except Exception:
        reset()


def start(argv: Sequence[str]) -> int:
    """Reach the hosts of the spec ``argv`` names (``orchestrate`` ARGV), if it is ``train`` or
    ``up`` of a file whose commands are kept; returns how many hosts are being reached."""
    spec_path, found = _kept_for(argv)
    if spec_path is None or not found:
        return 0
    launch = _launches_for(argv, spec_path, {name for name, _, _ in found})
    commands = {name: {s: _Command(s) for s in scripts} for name, _, scripts in found}
    launches: dict[str, list[_Command]] = {name: [] for name in commands}
    claimed: tuple[str, ...] = ()
    if launch is not None:
        run_id, scripts, run_dirs, claimed = launch
        launches = {name: [_Command(script.replace(TOKEN, run_id),
                                    files=tuple(f.replace(TOKEN, run_id) for f in files))
                           for script, files in scripts[name]] for name in commands}
    # Where this cluster's connections are held (``orchestrator/holder.py``), the commands go
    # there first: no import of paramiko and no handshake before the tasks start
    held = _ask_holder(spec_path, found, commands, launches, claimed)
    # Imported here, before the controller is, so that no thread imports beside another
    from orchestrator.remote.ssh import SSHRunner

    reaches = [_Reach(name, endpoint, SSHRunner(name, endpoint, connect_deadline_s=CONNECT_S),
                      commands[name], claimed=claimed, launches=launches[name])
               for name, endpoint, _ in found]
    if launch is not None:
        for reach in reaches:
            reach.run_dir = run_dirs[reach.name].replace(TOKEN, run_id)
    with _lock:
        _reaches.update({(_key(spec_path), r.name): r for r in reaches})
        if launch is not None:
            _launches[_key(spec_path)] = _Launch(run_id)
    for reach in reaches:
        if held:  # the runner the provider takes over connects meanwhile
            threading.Thread(target=_connect, args=(reach.runner,), daemon=True,
                             name=f"early-{reach.name}-connect").start()
            continue
        claim, *reads = reach.commands.values()  # each on a channel of its own, one connection
        for i, command in enumerate(reads):
            threading.Thread(target=_run, args=(reach.runner, command), daemon=True,
                             name=f"early-{reach.name}-{i + 1}").start()
        # The claim, which makes and marks the root, and then the launches, in one command
        threading.Thread(target=_claim_and_launch, args=(reach, claim), daemon=True,
                         name=f"early-{reach.name}-0").start()
    return len(reaches)


def _connect(runner: SSHRunner) -> None:
    with contextlib.suppress(Exception):  # its owner's first command meets the error itself
        runner.connect()


def _run(runner: SSHRunner, command: _Command) -> None:
    try:
        command.stdout = runner.run(command.script, timeout_s=RUN_S).stdout
        command.at = time.monotonic()
    except Exception:  # whatever it was, the provider meets it again itself
        pass
    finally:
        command.done.set()


def _claim_and_launch(reach: _Reach, claim: _Command) -> None:
    """The claim; with launches, one command that runs them where the claim exited 0 and its
    first line says the root is this cluster's (``_folded``): a round trip and a session less
    before the tasks start than a launch sent once the claim's answer is back."""
    if not reach.launches or reach.voided:  # none to run (``void`` came first: no launch)
        _run(reach.runner, claim)
        for command in reach.launches:
            command.done.set()
        return
    nonce = uuid.uuid4().hex
    parts: list[tuple[str, int]] = []
    try:
        script = _folded(claim.script, reach.claimed, [c.script for c in reach.launches], nonce)
        # as Runner.start runs a launch script: on stdin (its exports: the task's secrets)
        result = reach.runner.run(["sh", "-s"], input=script, check=False, timeout_s=RUN_S)
        parts = _parts(result.stdout, nonce)  # what ran, even where the command ended early
    except Exception:  # whatever it was, the provider meets it again itself
        pass
    finally:
        _took([claim, *reach.launches], parts)


def _took(commands: list[_Command], parts: list[tuple[str, int]]) -> None:
    """Each of ``commands`` answered by its part of a ``_folded`` script's output where it
    exited 0 (fewer parts: the claim said no, or the command ended early); all done."""
    now = time.monotonic()
    with _lock:
        for command, (stdout, code) in zip(commands, parts, strict=False):
            if code == 0 and not command.done.is_set():
                command.stdout, command.at = stdout, now
    for command in commands:
        command.done.set()


def _ask_holder(spec_path: Path, found: list[tuple[str, SSHEndpoint, list[str]]],
                commands: dict[str, dict[str, _Command]], launches: dict[str, list[_Command]],
                claimed: Sequence[str]) -> bool:
    """Hand each host's commands to the holder of this cluster's connections, if one runs;
    whether it took them (a thread then fills in each answer as it comes)."""
    from orchestrator import holder

    nonce = uuid.uuid4().hex
    request = []
    for name, endpoint, _ in found:
        claim, *reads = commands[name].values()
        first = ({"stdin": _folded(claim.script, claimed, [c.script for c in launches[name]],
                                   nonce)} if launches[name] else {"script": claim.script})
        request.append({"name": name, "ssh": asdict(endpoint),
                        "jobs": [first, *({"script": r.script} for r in reads)]})
    sock = holder.ask(_record(spec_path), request)
    if sock is None:
        return False
    with _lock:
        _held.add(_key(spec_path))

    def read() -> None:
        try:
            for got in holder.answers(sock):
                name, job = got.get("host"), got.get("job")
                if name not in commands or not isinstance(job, int):
                    continue
                claim, *reads = commands[name].values()
                out, code = got.get("out"), got.get("code")
                if job == 0:
                    parts = ([(out, code)] if not launches[name] else
                             _parts(out, nonce)) if isinstance(out, str) else []
                    _took([claim, *launches[name]], [(o, c) for o, c in parts
                                                      if isinstance(c, int)])
                elif 0 < job <= len(reads):
                    _took([reads[job - 1]], [(out, code)] if isinstance(out, str)
                          and isinstance(code, int) else [])
        finally:  # what no answer came for, the provider runs itself
            for name in commands:
                _took([*commands[name].values(), *launches[name]], [])

    threading.Thread(target=read, daemon=True, name="early-held").start()
    return True


def hold(argv: Sequence[str]) -> None:
    """After ``train`` or ``up`` of a spec file whose hosts are kept, leave a holder of their
    connections for the next command (``orchestrator/holder.py``), if none runs."""
    with contextlib.suppress(Exception):  # the next command then connects itself, as ever
        spec_path, found = _kept_for(argv)
        if spec_path is not None and found:
            from orchestrator import holder

            holder.start(_record(spec_path))


def _folded(claim: str, claimed: Sequence[str], launches: Sequence[str], nonce: str) -> str:
    """One script for ``sh -s``: ``claim``, then, where it exited 0 and printed one of
    ``claimed`` first, each of ``launches``; each in a subshell with no stdin, and each one's
    output followed by a line ``NONCE EXIT-CODE`` (``_parts`` reads them back)."""
    patterns = "|".join(shlex.quote(c) for c in claimed) or "''"
    lines = [  # the claim's output whole: its trailing newlines kept by a last "."
        f"o=$( ( {claim}\n) </dev/null; r=$?; echo .; exit $r ); r=$?",
        f"printf '%s\\n{nonce} %s\\n' \"${{o%.}}\" \"$r\"",
        '[ "$r" = 0 ] || exit 0',
        f'case "${{o%%"\n"*}}" in {patterns}) ;; *) exit 0 ;; esac',
    ]
    lines += [f"( {launch}\n) </dev/null; printf '\\n{nonce} %s\\n' \"$?\""
              for launch in launches]
    return "\n".join(lines) + "\n"


def _parts(text: str, nonce: str) -> list[tuple[str, int]]:
    """The output and exit code of each part of a ``_folded`` script, from what it printed:
    a part ends at a line of the nonce and a number (a line of the nonce and anything else is
    output: no part can know the nonce, but none can end another early either)."""
    found, start = [], 0
    for end in re.finditer(rf"\n{re.escape(nonce)} (\d+)\n", text):
        found.append((text[start:end.start()], int(end.group(1))))
        start = end.end()
    return found


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


def run_id(spec_path: Path) -> str | None:
    """The run id the early launches of the spec at ``spec_path`` used (once), for the new run
    to take: its tasks' paths are then the ones those launches wrote."""
    with _lock:
        launch = _launches.get(_key(spec_path))
        if launch is None or launch.handed:
            return None
        launch.handed = True
        return launch.run_id


def launched(spec_path: Path, name: str, endpoint: SSHEndpoint, script: str) -> str | None:
    """What the launch ``script`` printed (its task's pid) if exactly it ran early on host
    ``name`` over a connection to ``endpoint`` (once; waits for it to end). Else None, and
    every early task on the host not taken yet is stopped first, so that the launch about to
    run is the only task with these paths."""
    with _lock:
        reach = _reaches.get((_key(spec_path), name))
    if reach is None or not reach.launches:
        return None
    command = next((c for c in reach.launches if c.script == script), None)
    if command is not None and reach.endpoint == endpoint:
        command.done.wait(CONNECT_S + 2 * RUN_S)
        with _lock:
            if command.stdout is not None and not command.taken:
                command.taken = True
                return command.stdout
    _stop(reach)
    return None


def void(spec_path: Path, name: str | None = None, *, wait: bool = True) -> int:
    """Stop the early tasks of the spec at ``spec_path`` not taken yet (on host ``name``, or on
    every host); how many were stopped. Without ``wait``, in the background (a host whose
    endpoint changed: its early tasks, if any, share no paths with what starts at the new
    one), and none is launched from now on."""
    key = _key(spec_path)
    with _lock:
        reaches = [r for (k, n), r in _reaches.items() if k == key and name in (None, n)]
        for reach in reaches:
            reach.voided = True
    if not wait:  # its files are left: what starts meanwhile may have the same paths
        for reach in reaches:
            threading.Thread(target=_stop, args=(reach, False, False), daemon=True,
                             name=f"early-{reach.name}-void").start()
        return 0
    return sum(_stop(r) for r in reaches)


def _pgid(command: _Command) -> int | None:
    """The process group an early launch printed last, as ``Runner.start`` reads it."""
    try:
        return int((command.stdout or "").strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


def _stop(reach: _Reach, remove: bool = False, files: bool = True) -> int:
    """Kill the process group of each early task of ``reach`` not taken (each launch printed
    its pgid, as ``Runner.start`` reads it), once, and remove its files (unless not ``files``);
    with ``remove``, the run's directory on the host instead. How many were stopped."""
    for command in reach.launches:
        command.done.wait(CONNECT_S + 2 * RUN_S)
    with _lock:
        mine = [c for c in reach.launches if not c.taken]
        for command in mine:  # from now on no launch takes it
            command.taken = command.stopped = True
    from orchestrator.remote.base import TaskHandle, _ours

    words: list[str] = []
    written: list[str] = []
    for command in mine:
        pgid = _pgid(command)
        rc = command.files[2] if len(command.files) > 2 else ""
        if pgid is not None and pgid > 1:  # the group, while its leader is this rc's wrapper
            words.append(f"{{ {_ours(TaskHandle(reach.name, pgid, '', rc))} && "
                         f"kill -KILL -{pgid} 2>/dev/null; }}")
        written.extend(command.files)  # a launch with these paths starts afresh, its log too
    stopped = len(words)
    if remove and reach.run_dir:
        words.append(f"rm -rf -- {shlex.quote(reach.run_dir)}")
    elif words and files:
        words.append(f"rm -f -- {' '.join(shlex.quote(f) for f in written)}")
    if words:
        with contextlib.suppress(Exception):  # it waits ORCHESTRATE_WARM_WAIT_S at most anyway
            reach.runner.run("; ".join([*words, "true"]), timeout_s=RUN_S)
    return stopped


def kept(spec_path: Path, name: str, endpoint: SSHEndpoint) -> list[str]:
    """The commands kept for host ``name`` at ``endpoint`` that this process ran early."""
    with _lock:
        reach = _reaches.get((_key(spec_path), name))
        return list(reach.commands) if reach is not None and reach.endpoint == endpoint else []


def held(spec_path: Path) -> bool:
    """Whether the holder of the kept connections took this process's early commands for the
    spec at ``spec_path``."""
    with _lock:
        return _key(spec_path) in _held


def used() -> list[tuple[str, int]]:
    """For each host reached early, by name, how many of its early answers were taken."""
    with _lock:
        return sorted((r.name, sum(c.taken for c in r.commands.values()))
                      for r in _reaches.values())


def early_tasks(wait_s: float = 0.0) -> list[tuple[str, list[tuple[int, str]]]]:
    """For each host with early launches, by name, the process group of each task they
    started, and what became of it: "waiting" (no launch took it yet), "taken" or "stopped";
    after waiting up to ``wait_s`` for the launches to end."""
    with _lock:
        reaches = [r for r in _reaches.values() if r.launches]
    found = []
    for reach in sorted(reaches, key=lambda r: r.name):
        tasks = []
        for command in reach.launches:
            command.done.wait(wait_s)
            pgid = _pgid(command)
            if pgid is not None:
                tasks.append((pgid, "stopped" if command.stopped else
                              "taken" if command.taken else "waiting"))
        found.append((reach.name, tasks))
    return found


def reset(wait_s: float = 0.0) -> None:
    """Forget every early command of this process, closing the runners nobody adopted (after
    waiting up to ``wait_s`` for their commands)."""
    with _lock:
        reaches = list(_reaches.items())
        launches = dict(_launches)
        _reaches.clear()
        _launches.clear()
        _held.clear()
    for (key, _), reach in reaches:
        for command in reach.commands.values():
            command.done.wait(wait_s)
        if reach.launches:  # what no launch took is stopped; a run that never began, removed
            launch = launches.get(key)
            _stop(reach, remove=launch is not None and not launch.handed)
        if not reach.runner_taken or reach.launches:
            reach.runner.close()


# -- the record ------------------------------------------------------------------------------
def remember(spec_path: Path, hosts: Sequence[tuple[str, SSHEndpoint, Sequence[str]]]) -> None:
    """Keep ``hosts`` (each host's name, endpoint and commands) for the next command of the
    spec at ``spec_path`` as it is now: written only where it differs from what is kept."""
    if not _keep(spec_path, _record(spec_path),
                 {"hosts": [{"name": n, "ssh": asdict(e), "commands": list(c)}
                            for n, e, c in hosts]}):
        forget(spec_path)


def _keep(spec_path: Path, path: Path, entries: dict[str, Any]) -> bool:
    """Write ``entries`` at ``path`` for the spec at ``spec_path`` as it is now (its digest),
    private and whole, unless that is what ``path`` holds; False: the spec cannot be read."""
    try:
        digest = _digest(spec_path)
    except OSError:
        return False
    text = json.dumps({"version": VERSION, "spec": _key(spec_path), "digest": digest, **entries})
    with contextlib.suppress(OSError):
        if path.read_text(encoding="utf-8") == text:
            return True
    path.parent.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR)
    write_atomic(path, text)
    return True


def forget(spec_path: Path) -> None:
    """Keep no claims (and no launches) for the spec at ``spec_path``, and hold none of its
    connections."""
    from orchestrator import holder

    with contextlib.suppress(OSError):
        _record(spec_path).unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        holder.stop(_record(spec_path))
    forget_launches(spec_path)


def remember_launches(spec_path: Path, run_id: str,
                      scripts: dict[str, list[tuple[str, list[str]]]],
                      run_dirs: dict[str, str], claimed: Sequence[str]) -> None:
    """Keep the launch scripts of run ``run_id``'s first-attempt warm tasks, by host name, each
    with the files its task writes, and each host's run directory, for the next ``train`` of
    the spec at ``spec_path`` as it is now (the run id kept as ``TOKEN``), to run where a
    host's claim printed one of the ``claimed`` lines first (the root is this cluster's):
    written only where it differs from what is kept."""
    texts = [t for host in scripts.values() for script, files in host for t in (script, *files)]
    texts += list(run_dirs.values())
    if not run_id or any(TOKEN in t for t in texts) or set(scripts) != set(run_dirs):
        forget_launches(spec_path)
        return
    entries = {"launches": {n: [{"script": script.replace(run_id, TOKEN),
                                 "files": [f.replace(run_id, TOKEN) for f in files]}
                                for script, files in launches]
                            for n, launches in sorted(scripts.items())},
               "run_dirs": {n: d.replace(run_id, TOKEN) for n, d in sorted(run_dirs.items())},
               "claimed": list(claimed)}
    if not _keep(spec_path, _launch_record(spec_path), entries):
        forget_launches(spec_path)


def forget_launches(spec_path: Path) -> None:
    """Keep no launches for the spec at ``spec_path``."""
    with contextlib.suppress(OSError):
        _launch_record(spec_path).unlink(missing_ok=True)


def _launches_for(argv: Sequence[str], spec_path: Path, names: set[str]
                  ) -> tuple[str, dict[str, list[tuple[str, list[str]]]], dict[str, str],
                             tuple[str, ...]] | None:
    """A new run id and the kept launches of the spec for ``argv``, if it is a ``train`` that
    starts its first attempt warm and every host with a launch is reached; else None."""
    words = [a for a in argv if not a.startswith("-")]
    if words[:1] != [LAUNCHING] or any(a.split("=")[0] in NO_LAUNCH for a in argv):
        return None
    try:
        data = _kept(spec_path, _launch_record(spec_path))
        scripts = {str(n): [(str(t["script"]), [str(f) for f in t["files"]]) for t in ts]
                   for n, ts in data["launches"].items()}
        run_dirs = {str(n): str(d) for n, d in data["run_dirs"].items()}
        claimed = tuple(str(c) for c in data["claimed"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if set(scripts) != names or set(run_dirs) != names:
        return None
    # as Store.new_run names a run
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6], scripts, run_dirs, claimed


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


def _kept(spec_path: Path, path: Path) -> dict[str, Any]:
    """What ``_keep`` wrote at ``path`` for the spec at ``spec_path`` as it is now.

    Raises:
        OSError, ValueError: nothing readable there, or kept for another spec or digest.
    """
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    if data["version"] != VERSION or data["spec"] != _key(spec_path) \
            or data["digest"] != _digest(spec_path):
        raise ValueError("kept for another spec")
    return data


def _read(spec_path: Path) -> list[tuple[str, SSHEndpoint, list[str]]]:
    data = _kept(spec_path, _record(spec_path))
    found = []
    for host in data["hosts"]:
        found.append((str(host["name"]), SSHEndpoint.from_json(dict(host["ssh"])),
                      [str(c) for c in host["commands"]]))
    return found


def _key(spec_path: Path) -> str:
    return str(spec_path.resolve())


def _digest(spec_path: Path) -> str:
    return hashlib.sha256(spec_path.read_bytes()).hexdigest()


def _record(spec_path: Path) -> Path:
    key = hashlib.sha256(os.fsencode(spec_path.resolve())).hexdigest()[:32]
    return paths.home() / DIRECTORY / f"{key}.json"


def _launch_record(spec_path: Path) -> Path:
    return _record(spec_path).with_suffix(".launch.json")
