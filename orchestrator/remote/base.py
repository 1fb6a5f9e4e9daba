"""The Runner: one algorithm for detached tasks over any transport that can run `sh -c`.

A transport fills in ``_exec`` (run a shell script, return exit code and
output) and file transfer; everything else -- launching a task detached in its
own session, polling it, stopping its process group with TERM then KILL,
reading its log incrementally -- is built here from POSIX shell, quoted with
``shlex.quote`` at every value, so local and SSH share one code path. The watch
loop's poll (status, then the new log bytes) is one script too (``poll_log_script``),
so a transport that runs it with raw output answers a poll in one command.
"""

from __future__ import annotations

import enum
import functools
import shlex
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from orchestrator.errors import CommandError, RemoteError
from worker import probes


@dataclass(frozen=True)
class ExecResult:
    exit_code: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


@dataclass(frozen=True)
class LaunchSpec:
    """A task to start detached: argv run in ``cwd`` with ``env`` added.

    Output (stdout and stderr) goes to ``log_path``; the exit code is written to
    ``rc_path`` when the command ends by itself. Paths are on the host.
    """

    argv: tuple[str, ...]
    cwd: str
    log_path: str
    rc_path: str
    env: Mapping[str, str] = field(default_factory=dict)

    @property
    def pid_path(self) -> str:
        """Written by the task's session leader once it runs in its own session."""
        return sibling_of(self.rc_path, "pid")

    @property
    def go_path(self) -> str:
        """The go file a warm task waits for (``orchestrator/warm.py``): one an earlier task
        with these paths left would start this one at once, so the launch removes it."""
        return sibling_of(self.rc_path, "go")


def sibling_of(rc_path: str, suffix: str) -> str:
    """A task's file beside its exit-code file: the same name with ``suffix`` for ``rc``."""
    return rc_path.rsplit(".", 1)[0] + "." + suffix


@dataclass(frozen=True)
class TaskHandle:
    """A started task: its process-group id on the host, and where its output goes."""

    host: str
    pgid: int
    log_path: str
    rc_path: str


class TaskState(enum.Enum):
    RUNNING = "running"
    EXITED = "exited"  # ended by itself; exit_code is set (128+N for signal N)
    LOST = "lost"  # the whole process group is gone without writing an exit code


@dataclass(frozen=True)
class TaskStatus:
    state: TaskState
    exit_code: int | None = None
    ended_at: float | None = None  # when the exit code was written (the host's clock)


# Log bytes one poll's reply brings over a link at most; the rest comes with the next polls. A
# burst of output (a long traceback, verbose logging, a log re-read from its start by
# --attach) then holds a poll up for one MiB's transfer, not for all of it.
POLL_LOG_MAX = 1 << 20


@dataclass(frozen=True)
class LogPoll:
    """One poll of a task: its status, then its log's bytes from the offset asked to
    ``next_offset`` (taken after the status, so every line written before an exit is in it).

    ``status`` is None when the poll did not ask whether the task lives (``status=False``)
    and found no exit code recorded. ``capped``: the poll brought as many bytes as it may,
    so more may follow; a poll that says the task ended has then not read its log to the end.
    """

    status: TaskStatus | None
    data: bytes
    next_offset: int
    capped: bool = False


@functools.cache
def module_source(module: ModuleType) -> str:
    """The source of a stdlib-only ``worker`` module, to run on a host with ``python -c``."""
    return Path(str(module.__file__)).read_text()


def probe_argv(python: str, *args: str) -> list[str]:
    """The command line that runs ``worker/probes.py`` (stdlib only) with ``args`` on a host;
    this machine imports the same functions directly. Without ``site`` (``-S``: a third of a
    Python's start, where a virtual environment's ``.pth`` files are many) but where the probe
    imports TensorFlow."""
    site = () if args[:1] == ("tensorflow",) else ("-S",)
    return [python, *site, "-c", module_source(probes), *args]


def quote_argv(argv: Sequence[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)


# How long a launch waits for the task's shell to write its pid: 10 ms polls for the first
# second, then 100 ms ones. A loaded host (a checkpoint being written, CI's parallel jobs) has
# been seen to take more than the 10 s this once was.
PID_POLLS_FAST, PID_POLLS_SLOW = 100, 590
PID_WAIT_S = PID_POLLS_FAST * 0.01 + PID_POLLS_SLOW * 0.1


WRAPPER_FD = 9  # the launch wrapper's descriptor of its task's pid file


def launch_script(spec: LaunchSpec) -> str:
    """The shell script that starts ``spec`` in a new session and prints its pid (= pgid).

    The session leader writes its own pid once ``setsid`` has happened; the
    script waits for that, so the printed pid is already a process-group id.
    Paths are taken relative to the directory the script starts in (the
    login directory over SSH); only the task itself runs in ``spec.cwd``.
    """
    for name in spec.env:
        if not name.replace("_", "a").isalnum() or name[0].isdigit():
            raise RemoteError(f"invalid environment variable name {name!r}")
    exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in spec.env.items())
    rc, rc_tmp = shlex.quote(spec.rc_path), shlex.quote(spec.rc_path + ".tmp")
    pid, go = shlex.quote(spec.pid_path), shlex.quote(spec.go_path)
    log = shlex.quote(spec.log_path)
    # ``trap : TERM``: a planned stop TERMs the whole group; the task saves and exits, and this
    # shell must outlive it to record its exit code (a trap with a command is not inherited).
    # ``trap '' HUP`` (inherited, as nohup does): a guest's shutdown (systemd, a spot VM's
    # ACPI soft off) sends its SSH session scope TERM and then HUP at once; HUP must not kill
    # a task that is saving on TERM. The shell keeps its pid file open (fd WRAPPER_FD, closed
    # for the task): a status poll knows the group is this task's from that fd alone (``_ours``,
    # no process started); it cannot write the file: it exits, and the launch says so.
    fd = WRAPPER_FD
    inner = (
        f"trap '' HUP; trap : TERM; exec {fd}>{pid}.tmp; echo $$ >&{fd} && mv -f {pid}.tmp {pid}; "
        f"( cd {shlex.quote(spec.cwd)} && exec {quote_argv(spec.argv)} {fd}>&- ) >>{log} 2>&1 "
        f"</dev/null; echo $? >{rc_tmp} && mv -f {rc_tmp} {rc}"
    )
    dirs = {p.rpartition("/")[0] or "." for p in (spec.log_path, spec.rc_path, spec.pid_path)}
    # The old files go, and only then does the task start: `A && B && C &` would put the whole
    # list in the background, and the wait below could read the pid a previous task with the
    # same paths left there (or lose it to the late `rm`: "cat: No such file"). The go file
    # too, in the same command: a warm task's launch is one round trip.
    return (
        f"mkdir -p {quote_argv(sorted(dirs))} && rm -f {rc} {rc_tmp} {pid} {go} || exit 1; "
        f"( {exports}exec setsid sh -c {shlex.quote(inner)} ) >/dev/null 2>&1 </dev/null & "
        f"i=0; while [ ! -s {pid} ] && [ $i -lt {PID_POLLS_FAST + PID_POLLS_SLOW} ]; do "
        f"if [ $i -lt {PID_POLLS_FAST} ]; then sleep 0.01; else sleep 0.1; fi; i=$((i+1)); "
        f"done; [ -s {pid} ] || {{ echo 'the task did not start: its shell wrote no pid in "
        f"{PID_WAIT_S:.0f}s (the host overloaded, or its disk stalled or full)' >&2; exit 1; }}; "
        f"cat {pid}"
    )


class Runner(ABC):
    """Runs commands and detached tasks on one host.

    Subclasses implement ``_exec``, ``put_file``, ``get_file`` and ``close``;
    they may override the task methods with faster direct versions.
    """

    # What a launch script printed where exactly it ran before this runner was handed over
    # (the CLI's early start, ``orchestrator/early_claim.py``), else None: set by the owner.
    early_start: Callable[[str], str | None] | None = None

    def __init__(self, host_name: str) -> None:
        self.host_name = host_name
        # Connections to the host found dead and made again: a machine that went away and came
        # back between two commands shows here, when its answers alone look normal.
        self.drops = 0

    # -- transport hooks -------------------------------------------------
    @abstractmethod
    def _exec(self, script: str, timeout_s: float | None = None,
              input: str | None = None) -> ExecResult:
        """Run ``script`` with ``sh -c`` on the host and wait for it; ``input`` is its stdin
        (secrets go there, never on a command line that ``ps`` shows)."""

    @abstractmethod
    def put_file(self, local_path: str, remote_path: str, mode: int | None = None) -> None:
        """Copy a file from the controller to the host, creating parent directories."""

    @abstractmethod
    def get_file(self, remote_path: str, local_path: str) -> None:
        """Copy a file from the host to the controller."""

    def close(self) -> None:
        """Release the transport (idempotent)."""

    def end_polls(self) -> None:
        """Let go of what this runner keeps open for a watch's polls, once the watch ended
        (nothing, but for ``SSHRunner``'s poll shell); the next poll opens it again."""

    # -- commands --------------------------------------------------------
    def run(
        self, argv: Sequence[str] | str, *, check: bool = True, timeout_s: float | None = None,
        input: str | None = None,
    ) -> ExecResult:
        """Run a command to completion. A sequence is quoted word by word; a str is a script.
        ``input`` is written to its stdin (then closed); without it stdin is empty."""
        script = argv if isinstance(argv, str) else quote_argv(argv)
        result = self._exec(script, timeout_s=timeout_s, input=input)
        if check and not result.ok:
            raise CommandError(
                self.host_name, script, result.exit_code, result.stdout + result.stderr
            )
        return result

    # -- detached tasks --------------------------------------------------
    def start(self, spec: LaunchSpec) -> TaskHandle:
        # The script (its exports: the task's env, secrets included) goes on stdin, so it is
        # in no command line that ps shows and in no error that quotes the command.
        script = launch_script(spec)
        early = self.early_start
        stdout = early(script) if early is not None else None
        if stdout is None:
            stdout = self.run(["sh", "-s"], input=script).stdout
        try:
            pgid = int(stdout.strip().splitlines()[-1])
        except (ValueError, IndexError) as exc:
            raise RemoteError(
                f"task launch printed no pid: {stdout!r}", host=self.host_name
            ) from exc
        return TaskHandle(self.host_name, pgid, spec.log_path, spec.rc_path)

    def poll(self, handle: TaskHandle) -> TaskStatus:
        return _parse_status(self.run(_status_script(handle)).stdout)

    def poll_log(self, handle: TaskHandle, offset: int, *, status: bool = True,
                 limit: int = POLL_LOG_MAX) -> LogPoll:
        """The task's status, then the bytes of its log from ``offset``.

        Without ``status`` the poll does not ask whether the task's group lives (the costly
        part: its ownership and every process of it); it still reports an exit code the
        wrapper recorded (one look at the rc file), else its status is None.

        ``limit`` bounds the bytes one reply carries where they cross a link (SSH: one
        command's output, ``poll_log_script``); a runner that reads the file in place returns
        what its ``read_log`` does. This fallback is two commands (``poll``, ``read_log``),
        reports no exit code without ``status``, and its log is ``read_log``'s.
        """
        got = self.poll(handle) if status else None
        data, next_offset = self.read_log(handle, offset)
        return LogPoll(got, data, next_offset)

    def waiting(self, handle: TaskHandle) -> str | None:
        """Why a task that has not started yet waits, as its scheduler says it (a pod that no
        node can hold, an image that cannot be pulled), with what to do; None when nothing
        holds it up that anyone reports (the default: a process starts at once)."""
        return None

    def unplaced(self, handle: TaskHandle) -> str | None:
        """Why no machine can take the task now, as its scheduler says (a pod no node has
        room for), where the wait is for a machine rather than a turn: an elastic group goes
        on without it past ``timeouts.repair_s``; None (the default) when it has one."""
        return None

    def queued(self, handle: TaskHandle) -> str | None:
        """Why the task's whole group waits in a scheduler's queue for its turn (quota), not
        yet placed: a wait that does not count against ``timeouts.startup_s``, whose clock
        starts once the group leaves the queue; None when it is not queued (the default)."""
        return None

    def process_states(self, handle: TaskHandle, python: str, timeout_s: float = 15.0) -> str:
        """State letters of the task's processes ('T' = stopped); empty when none is left."""
        return self.run(probe_argv(python, "states", str(handle.pgid)),
                        timeout_s=timeout_s).stdout.strip()

    def signal(self, handle: TaskHandle, sig: str) -> None:
        self.run(f"{_ours(handle)} && kill -{sig} -{handle.pgid} 2>/dev/null; true")

    def stop(self, handle: TaskHandle, grace_s: float = 5.0) -> TaskStatus:
        """TERM the task's process group, then KILL it if still alive after ``grace_s``;
        ``grace_s`` 0 kills it at once (a broken group has nothing to save).

        A managed task saves a checkpoint on TERM (every task at the same step) and exits.
        """
        status = self.poll(handle)
        if status.state is not TaskState.RUNNING:
            if status.state is TaskState.EXITED and self._group_alive(handle):
                # The task ended by itself; what it started is left in its group (JAX's
                # coordination service outlives a chief by design, for the survivors' save):
                # nothing there has anything to save, and it must hold no port into the next
                # attempt (a dead chief's service took the next chief's connection for 70 s).
                self._kill_group(handle)
            return status
        if grace_s > 0:
            self.signal(handle, "TERM")
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if not self._group_alive(handle):
                return self.poll(handle)
            time.sleep(0.1)
        self._kill_group(handle)
        return self.poll(handle)

    def _kill_group(self, handle: TaskHandle) -> None:
        """KILL the task's group, and wait up to 5 s for none of it to be left."""
        self.signal(handle, "KILL")
        for _ in range(50):
            if not self._group_alive(handle):
                break
            time.sleep(0.1)

    def _group_alive(self, handle: TaskHandle) -> bool:
        return self.run(f"{_ours(handle)} && {group_lives(handle.pgid)}", check=False).ok

    def read_log(self, handle: TaskHandle, offset: int) -> tuple[bytes, int]:
        """Bytes of the task's log from ``offset``; returns them and the new offset."""
        log = shlex.quote(handle.log_path)
        result = self.run(f"[ -f {log} ] && tail -c +{offset + 1} {log} || true")
        data = result.stdout.encode()
        return data, offset + len(data)


def _exited_script(handle: TaskHandle) -> str:
    rc = shlex.quote(handle.rc_path)
    return f"echo exited $(cat {rc}) $(stat -c %Y {rc})"


def _status_script(handle: TaskHandle) -> str:
    """Prints one line: ``exited CODE MTIME``, ``running`` or ``lost`` (see ``_parse_status``).

    The rc file is looked at again after a group found gone: the wrapper may have written it
    in between."""
    rc, exited = shlex.quote(handle.rc_path), _exited_script(handle)
    return (
        f"if [ -f {rc} ]; then {exited}; "
        f"elif {_ours(handle)} && {group_lives(handle.pgid)}; then echo running; "
        f"elif [ -f {rc} ]; then {exited}; else echo lost; fi"
    )


def poll_log_script(handle: TaskHandle, offset: int, limit: int, status: bool = True) -> str:
    """One command for one poll: a status line, then the log's raw bytes from ``offset``.

    The line is ``_status_script``'s, or without ``status`` the rc file's alone (``exited
    CODE MTIME``, else ``-``). The bytes follow it unchanged (at most ``limit``; none when the
    log does not exist yet), so the output must be read as bytes (``parse_poll_log``). The
    status comes first: a task seen ended has written its last line before the log is read.
    """
    rc, log = shlex.quote(handle.rc_path), shlex.quote(handle.log_path)
    line = (_status_script(handle) if status
            else f"if [ -f {rc} ]; then {_exited_script(handle)}; else echo -; fi")
    return f"{line}; tail -c +{offset + 1} {log} 2>/dev/null | head -c {limit}"


def parse_poll_log(out: bytes, offset: int, limit: int) -> LogPoll:
    """What ``poll_log_script`` printed, as a ``LogPoll`` of the bytes from ``offset``.

    Raises:
        ValueError: no status line (the script did not run to its end).
    """
    line, newline, data = out.partition(b"\n")
    if not newline:
        raise ValueError(f"a poll printed no status line: {out[:200]!r}")
    text = line.decode("utf-8", errors="replace")
    status = None if text.strip() == "-" else _parse_status(text)
    return LogPoll(status, data, offset + len(data), len(data) >= limit)


def _ours(handle: TaskHandle) -> str:
    """A shell test: process group ``handle.pgid`` is still the task's, not a reused id.

    A task's group outlives a controller that remembers it (``down`` of an old run, a task
    left on a host that was cut off, a rebooted VM); its id may by then lead someone else's
    group. The group's leader is the launch wrapper, which holds the task's pid file open
    (``WRAPPER_FD``: the test shell's own ``-ef``, no process started, the poll's costly part
    before: 15 of its 22 ms of CPU) and whose command line holds the task's rc path (read where
    the descriptor is not that file: a wrapper of an earlier version, a leader gone or a
    zombie): while a process with the id lives and holds neither, the id is someone else's.
    (Linux hands out no pid that is still a group's id, so a leaderless group is the task's.)
    """
    rc = shlex.quote(handle.rc_path)
    pid = shlex.quote(sibling_of(handle.rc_path, "pid"))
    cmdline = f"/proc/{handle.pgid}/cmdline"
    return (f"{{ [ /proc/{handle.pgid}/fd/{WRAPPER_FD} -ef {pid} ] || "
            f"{{ c=$(tr '\\0' ' ' <{cmdline} 2>/dev/null); [ -z \"$c\" ] || "
            f"printf %s \"$c\" | grep -qF -- {rc}; }}; }}")


def group_lives(pgid: int) -> str:
    """A shell test: a process of group ``pgid`` lives, zombies not counted (the shell's
    twin of ``local.LocalRunner._group_alive``).

    ``kill -0 -PGID`` answers for zombies too, and a killed task's processes stay zombies
    until the host's init reaps them: at once under systemd, 1.4 to 1.9 s under the init of
    the machines the tests run on, never where a container's first process does not reap. A
    stop that waited for that would wait on nothing that holds a port or a GPU. The leader's
    ``/proc/PGID/stat`` is read first (the wrapper, alive for as long as its task is); only
    a group whose leader is gone or a zombie is looked for in every process's. The fields
    after the command name's closing parenthesis are the state, the parent and the group.
    """
    return (f"(for f in /proc/{pgid}/stat /proc/[0-9]*/stat; do "
            f"{{ read -r l <\"$f\"; }} 2>/dev/null || continue; set -- ${{l##*) }}; "
            f"[ \"$3\" = {pgid} ] && [ \"$1\" != Z ] && [ \"$1\" != X ] && exit 0; "
            "done; exit 1)")


def owns_group(handle: TaskHandle) -> bool:
    """``_ours`` for this machine, read directly."""
    try:
        with open(f"/proc/{handle.pgid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return True  # no leader: the group, if any, is leaderless, so the task's
    return not cmdline or handle.rc_path.encode() in cmdline


def _parse_status(text: str) -> TaskStatus:
    words = text.split()
    if words[:1] == ["running"]:
        return TaskStatus(TaskState.RUNNING)
    if words[:1] == ["exited"] and len(words) >= 2 and words[1].lstrip("-").isdigit():
        ended = float(words[2]) if len(words) > 2 and words[2].isdigit() else None
        return TaskStatus(TaskState.EXITED, int(words[1]), ended)
    return TaskStatus(TaskState.LOST)
