"""The Runner over SSH: paramiko with strict host keys, key-only auth and one reused connection."""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import os
import posixpath
import select
import shlex
import socket
import stat
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Literal

from tenacity import (
    Retrying,
    retry_if_exception,
    retry_if_exception_type,
    stop_after_delay,
    wait_exponential,
    wait_fixed,
)

from orchestrator.errors import AuthError, HostKeyError, HostUnreachableError, RemoteError
from orchestrator.files import write_atomic
from orchestrator.hosts import SSHEndpoint
from orchestrator.remote.base import (
    POLL_LOG_MAX,
    ExecResult,
    LogPoll,
    Runner,
    TaskHandle,
    parse_poll_log,
    poll_log_script,
)

# paramiko without ``invoke``: ``paramiko.config`` imports it (a required dependency) only to run
# an ssh_config ``Match exec``, which this controller never parses, and it is 55-75 ms of every
# command's start (over half of paramiko's import, which every SSH `train` waits for before
# its first task can start). Hidden only while paramiko loads: an ``import invoke`` after it
# works as usual, and one made before it is what paramiko gets.
_HIDE_INVOKE = "invoke" not in sys.modules
if _HIDE_INVOKE:
    sys.modules["invoke"] = None  # type: ignore[assignment]  # makes ``import invoke`` fail
try:
    import paramiko
    from paramiko.pkey import UnknownKeyType
finally:
    if _HIDE_INVOKE and "invoke" in sys.modules and sys.modules["invoke"] is None:
        del sys.modules["invoke"]

KEEPALIVE_S = 15
DEAD_PEER_S = 60  # unacknowledged data for this long means the host is gone (TCP_USER_TIMEOUT)
# A transfer that moves no byte for this long fails as lost, its connection closed: a host cut
# off mid-transfer otherwise holds it until TCP gives up on the unacknowledged data, and
# paramiko's own clean-up (closing the remote file) waits behind a writer stuck in a full
# socket buffer for as long.
BULK_STALL_S = 45
# Two connections per host. The control connection carries commands (at most 6 at once; the
# watch loop's polls are commands, each bringing its task's status and new log bytes) and the
# one SFTP session that reads logs (``read_log``); the bulk connection carries transfers (at
# most 2 at once, each on an SFTP session of its own). OpenSSH allows 10 sessions per connection
# (MaxSessions) and frees one only once our close has reached it: a session the host still
# counts after our close is waited for a little. Bulk bytes never share a TCP stream with a
# poll, so a poll on a slow link waits for no transfer's data ahead of it.
MAX_CHANNELS = 6
BULK_CHANNELS = 2
# One more session on the control connection: a shell that runs the watch loop's polls one
# after another (``_PollShell``), so that a poll starts no session on the host. A poll that
# finds it busy is a command as before.
POLL_SHELLS = 1
Link = Literal["control", "bulk"]
SESSION_WAIT_S = 5.0
READ_LOG_MAX = 8 << 20
_KNOWN_HOSTS_LOCK = threading.Lock()
KEY_FILE_MAX = 64 << 10  # an RSA-16384 private key in PEM is about 13 KiB
KNOWN_HOSTS_MAX = 16 << 20


class SSHRunner(Runner):
    """Runs commands and detached tasks on one host over lazily opened SSH connections: one for
    commands and log reads, one for bulk transfers.

    Args:
        host_name: the host's name in messages.
        endpoint: address, user, key file and accepted host keys.
        connect_deadline_s: how long connecting may retry in all (default: three
            times ``endpoint.connect_timeout_s``).
    """

    def __init__(
        self, host_name: str, endpoint: SSHEndpoint, *, connect_deadline_s: float | None = None
    ) -> None:
        super().__init__(host_name)
        self.endpoint = endpoint
        self.connect_deadline_s = (
            connect_deadline_s if connect_deadline_s is not None else 3 * endpoint.connect_timeout_s
        )
        self._clients: dict[Link, paramiko.SSHClient] = {}
        self._pkey: paramiko.PKey | None = None
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(MAX_CHANNELS)
        # Log reads share one SFTP session (the control path); every bulk transfer opens its
        # own, so a long download never holds up a log read or a command.
        self._control_lock = threading.Lock()
        self._bulk_slots = threading.BoundedSemaphore(BULK_CHANNELS)
        self._sessions_lock = threading.Lock()  # guards the two fields below, never held for I/O
        self._control: paramiko.SFTPClient | None = None
        self._bulk: set[paramiko.SFTPClient] = set()
        self._shells: list[_PollShell] = []  # idle poll shells (guarded by _sessions_lock)
        self._shells_open = 0

    @property
    def target(self) -> str:
        return f"{self.endpoint.user}@{self.endpoint.address}:{self.endpoint.port}"

    def __enter__(self) -> SSHRunner:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- connection ------------------------------------------------------
    def connect(self, link: Link = "control") -> paramiko.Transport:
        """The live transport of ``link``, connecting (or reconnecting after a drop) first."""
        with self._lock:
            client = self._clients.get(link)
            transport = client.get_transport() if client else None
            if transport is not None and transport.is_active():
                return transport
            if client is not None:  # dead: its sessions died with it and are reopened on use
                client.close()
                self.drops += 1
            client = self._clients[link] = self._connect_with_retries()
            transport = client.get_transport()
            assert transport is not None
            transport.set_keepalive(KEEPALIVE_S)
            return transport

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        """Close the connections, the idle poll shells and every SFTP session, without waiting
        for their users.

        A transfer or log read in flight fails at once (as a lost connection): closing the
        transport first makes sure none of them sees a live transport and reports a
        RemoteError instead.
        """
        self.end_polls()
        with self._sessions_lock:
            sessions = [*self._bulk, *([self._control] if self._control else [])]
            self._bulk.clear()
            self._control = None
        for client in self._clients.values():
            client.close()
        self._clients.clear()
        for sftp in sessions:
            with contextlib.suppress(Exception):
                sftp.close()

    def _connect_with_retries(self) -> paramiko.SSHClient:
        pkey = self._load_key()
        started = time.monotonic()
        deadline = started + self.connect_deadline_s
        retrying = Retrying(
            retry=retry_if_exception(_is_transient),
            stop=stop_after_delay(self.connect_deadline_s),
            wait=wait_exponential(multiplier=0.25, max=2.0),
            reraise=True,
        )
        try:
            return retrying(self._connect_once, pkey, deadline)
        except Exception as exc:
            if not _is_transient(exc):
                raise
            raise self._unreachable(exc, time.monotonic() - started) from exc

    def _connect_once(self, pkey: paramiko.PKey, deadline: float) -> paramiko.SSHClient:
        ep = self.endpoint
        timeout = max(0.5, min(ep.connect_timeout_s, deadline - time.monotonic()))
        sock = socket.create_connection((ep.address, ep.port), timeout=timeout)
        _tune_socket(sock)
        client = paramiko.SSHClient()
        try:
            self._load_host_keys(client.get_host_keys())
            client.set_missing_host_key_policy(_HostKeyPolicy(self))
            client.connect(
                ep.address,
                port=ep.port,
                username=ep.user,
                pkey=pkey,
                sock=sock,
                timeout=timeout,
                banner_timeout=timeout,
                auth_timeout=timeout,
                allow_agent=False,
                look_for_keys=False,
            )
        except BaseException as exc:
            client.close()
            sock.close()
            if isinstance(exc, paramiko.BadHostKeyException):
                raise self._changed_key(exc.expected_key, exc.key) from None
            if isinstance(exc, paramiko.AuthenticationException):
                raise self._auth_failed(exc) from None
            raise
        return client

    def _unreachable(self, exc: BaseException, elapsed: float) -> HostUnreachableError:
        return HostUnreachableError(
            f"cannot connect to {self.target}: tried for {elapsed:.1f}s "
            f"({self.endpoint.connect_timeout_s:g}s per try); last error: {_describe(exc)}",
            host=self.host_name,
            fix=f"check that the host is up, that {self.endpoint.address} port "
            f"{self.endpoint.port} is right, and that sshd is reachable from this machine",
        )

    def _auth_failed(self, exc: paramiko.AuthenticationException) -> AuthError:
        ep = self.endpoint
        return AuthError(
            f"SSH authentication failed for {self.target} with key {ep.key_file}: {exc}",
            host=self.host_name,
            fix=f"authorise the public key of {ep.key_file} for {ep.user} on the host "
            f"(ssh-copy-id -i {ep.key_file} -p {ep.port} {ep.user}@{ep.address}), "
            "or set the right user and key_file",
        )

    # -- credentials and host keys ------------------------------------------
    def _load_key(self) -> paramiko.PKey:
        if self._pkey is None:
            self._pkey = _read_private_key(self)
        return self._pkey

    def _load_host_keys(self, keys: paramiko.HostKeys) -> None:
        ep = self.endpoint
        name = _known_hosts_name(ep)
        for line in ep.host_keys:
            entry = _parse_host_key_line(name, line)
            if entry is None or entry.key is None:
                raise HostKeyError(
                    f"invalid host key for {name}: received {line[:80]!r}",
                    host=self.host_name,
                    fix="use an OpenSSH public-key line such as 'ssh-ed25519 AAAA...' "
                    "(the host's /etc/ssh/ssh_host_ed25519_key.pub)",
                )
            keys.add(name, entry.key.get_name(), entry.key)
        if not ep.host_keys and ep.known_hosts and os.path.lexists(ep.known_hosts):
            try:
                _load_known_hosts(keys, ep.known_hosts)
            except (OSError, ValueError, paramiko.hostkeys.InvalidHostKey) as exc:
                raise HostKeyError(
                    f"cannot read known_hosts file {ep.known_hosts}: {_describe(exc)}",
                    host=self.host_name,
                    fix="point known_hosts at an OpenSSH known_hosts file (UTF-8, one "
                    "'HOST TYPE KEY' per line), or list the host key in the spec's host_key",
                ) from None

    def _unknown_key(self, key: paramiko.PKey) -> HostKeyError:
        ep = self.endpoint
        line = f"{key.get_name()} {key.get_base64()}"
        known_hosts = ep.known_hosts or "~/.ssh/known_hosts"
        return HostKeyError(
            f"unknown SSH host key for {ep.address}:{ep.port}: {key.get_name()} "
            f"{fingerprint(key)}; refusing to connect",
            host=self.host_name,
            fix=f"check that fingerprint out of band, then put '{line}' in the host's "
            f"host_key in the spec, or add it to known_hosts "
            f"(ssh-keyscan -p {ep.port} {ep.address} >> {known_hosts}), "
            "or set trust_on_first_use: true to record it on first connect",
        )

    def _changed_key(self, expected: paramiko.PKey, got: paramiko.PKey) -> HostKeyError:
        ep = self.endpoint
        source = "the spec's host_key" if ep.host_keys else f"known_hosts {ep.known_hosts}"
        return HostKeyError(
            f"SSH host key of {ep.address}:{ep.port} CHANGED: expected {expected.get_name()} "
            f"{fingerprint(expected)} (from {source}), got {got.get_name()} {fingerprint(got)}. "
            "This may be a man-in-the-middle attack; refusing to connect",
            host=self.host_name,
            fix=f"if the host was re-created on purpose, verify the new fingerprint out of band "
            f"and replace the old key in {source}",
        )

    def _trust_first_use(self, hostname: str, key: paramiko.PKey) -> None:
        ep = self.endpoint
        if not ep.trust_on_first_use or ep.host_keys:
            raise self._unknown_key(key)
        if not ep.known_hosts:
            raise HostKeyError(
                f"trust_on_first_use is set for {ep.address}:{ep.port} but no known_hosts "
                "file is given to record the key in",
                host=self.host_name,
                fix="set known_hosts to a file path (it is created if missing)",
            )
        try:
            recorded = _record_host_key(ep.known_hosts, hostname, key)
        except (OSError, ValueError, paramiko.hostkeys.InvalidHostKey) as exc:
            raise HostKeyError(
                f"cannot record the host key of {ep.address}:{ep.port} in {ep.known_hosts}: {_describe(exc)}",
                host=self.host_name,
                fix="make that file (and its directory) writable, or list the host key in "
                "the spec's host_key",
            ) from None
        if recorded is not None and recorded != key:
            raise self._changed_key(recorded, key)

    # -- commands --------------------------------------------------------
    def _exec(self, script: str, timeout_s: float | None = None,
              input: str | None = None) -> ExecResult:
        code, out, err = self._exec_raw(script, timeout_s, input)
        return ExecResult(code, _text(out), _text(err))

    def _exec_raw(self, script: str, timeout_s: float | None = None,
                  input: str | None = None) -> tuple[int, bytes, bytes]:
        """``_exec`` with the output as the host wrote it: exit code, stdout, stderr."""
        deadline = time.monotonic() + timeout_s if timeout_s is not None else None
        with self._slots, self._session() as chan:
            try:
                # No EOF may follow the command's end: paramiko sends a channel's EOF after it
                # lets go of the channel's lock, so the transport thread may have answered the
                # host's CLOSE first, and OpenSSH drops the whole connection on an EOF for a
                # channel it freed (paramiko#1115). So a command without input reads
                # /dev/null, and one with input reads its stdin to the end before it exits.
                if input is None:
                    chan.exec_command("sh -c " + shlex.quote(script) + " </dev/null")
                else:
                    chan.exec_command("sh -c " + shlex.quote(
                        f"( {script}\n); rc=$?; cat >/dev/null; exit $rc"))
                    chan.sendall(input.encode())
                    chan.shutdown_write()
                out, err = _collect(chan, deadline)
            except _Timeout:
                raise RemoteError(
                    f"command timed out after {timeout_s:g}s: {_short(script)}",
                    host=self.host_name,
                    fix="the command may still run on the host; raise the timeout or look at the host",
                ) from None
            except (OSError, EOFError, paramiko.SSHException) as exc:
                raise self._lost(script, exc) from None
            if chan.exit_status == -1 and not self._alive(chan):
                raise self._lost(script, None)
            code = chan.exit_status if chan.exit_status != -1 else 255
        return code, out, err

    def poll_log(self, handle: TaskHandle, offset: int, *, status: bool = True,
                 limit: int = POLL_LOG_MAX) -> LogPoll:
        """The status and the new log bytes in one command on the control connection (one
        session channel), not a command and then an SFTP read (open, read, close)."""
        script = poll_log_script(handle, offset, limit, status)
        got = self._in_poll_shell(script)
        code, out, err = got if got is not None else self._exec_raw(script)
        try:
            if code != 0:
                raise ValueError(f"exit {code}: {_text(err).strip()[:300]}")
            return parse_poll_log(out, offset, limit)
        except ValueError as exc:
            raise RemoteError(f"poll of {handle.log_path} failed: {exc}", host=self.host_name,
                              fix="the host needs a POSIX sh with tail and head") from None

    def _in_poll_shell(self, script: str) -> tuple[int, bytes, bytes] | None:
        """``_exec_raw(script)`` in an idle poll shell (one is opened while fewer than
        POLL_SHELLS are). None where none is free, or where the shell ended or its connection
        dropped before the script was sent: a command then runs it, over a new connection if
        need be, as a poll always did. A connection lost once it was sent raises as a
        command's would (the script may or may not have run)."""
        shell = self._idle_shell()
        if shell is None:
            return None
        try:
            got = shell.run(script)
        except BaseException as exc:
            self._discard(shell)
            if isinstance(exc, _Unsent):
                return None
            if isinstance(exc, (OSError, EOFError, paramiko.SSHException)):
                raise self._lost(script, exc) from None
            raise
        if got is None:  # it ended after the script was sent: killed on the host, or dropped
            self._discard(shell)
            if not self._alive(shell.chan):
                raise self._lost(script, None)
            return None
        with self._sessions_lock:
            self._shells.append(shell)
        return got

    def _idle_shell(self) -> _PollShell | None:
        """An idle poll shell whose connection lives, taken; else a new one while fewer than
        POLL_SHELLS are open; else None."""
        with self._sessions_lock:
            while self._shells:
                shell = self._shells.pop()
                if not shell.chan.closed and self._alive(shell.chan):
                    return shell
                self._shells_open -= 1
                shell.close()
            if self._shells_open >= POLL_SHELLS:
                return None
            self._shells_open += 1
        try:  # the channel's own errors raise as a command's would
            return _PollShell(self._open_channel("control"))
        except BaseException as exc:
            with self._sessions_lock:
                self._shells_open -= 1
            if isinstance(exc, (OSError, EOFError, paramiko.SSHException)):
                return None  # no shell: a command instead
            raise

    def end_polls(self) -> None:
        """End the idle poll shells: each is told to exit, and not waited for (a host cut off
        would hold the end of an attempt up), so none outlives the watch on a host that
        answers."""
        with self._sessions_lock:
            shells, self._shells = self._shells, []
            self._shells_open -= len(shells)
        for shell in shells:
            shell.end()

    def _discard(self, shell: _PollShell) -> None:
        with self._sessions_lock:
            self._shells_open -= 1
        shell.close()

    @contextlib.contextmanager
    def _session(self) -> Iterator[paramiko.Channel]:
        chan = self._open_channel("control")
        try:
            yield chan
        finally:
            chan.close()

    def _open_channel(self, link: Link) -> paramiko.Channel:
        """A new session channel on ``link``, waiting while the host still counts just-closed
        sessions."""
        retrying = Retrying(
            retry=retry_if_exception_type(paramiko.ChannelException),
            stop=stop_after_delay(SESSION_WAIT_S),
            wait=wait_fixed(0.05),
            reraise=True,
        )
        try:
            return retrying(self._open_channel_once, link)
        except paramiko.ChannelException as exc:
            raise RemoteError(
                f"{self.target} refused a new SSH session for {SESSION_WAIT_S:g}s: {exc}",
                host=self.host_name,
                fix="run fewer commands at once on this host, or raise MaxSessions in its sshd_config",
            ) from None

    def _open_channel_once(self, link: Link) -> paramiko.Channel:
        """Open a session; a dead transport is replaced once (nothing has run yet)."""
        timeout = self.endpoint.connect_timeout_s
        transport = self.connect(link)
        try:
            return transport.open_session(timeout=timeout)
        except paramiko.ChannelException:
            raise
        except (OSError, EOFError, paramiko.SSHException):
            self._forget(link, transport)
        try:
            return self.connect(link).open_session(timeout=timeout)
        except paramiko.ChannelException:
            raise
        except (OSError, EOFError, paramiko.SSHException) as exc:
            raise self._lost("open an SSH session", exc) from None

    def _forget(self, link: Link, transport: paramiko.Transport) -> None:
        with self._lock:
            client = self._clients.get(link)
            if client is not None and client.get_transport() is transport:
                client.close()
                del self._clients[link]
                self.drops += 1  # a transport that looked alive but was not: dropped all the same

    @staticmethod
    def _alive(chan: paramiko.Channel) -> bool:
        transport = chan.get_transport()
        return transport is not None and transport.is_active()

    def _lost(self, what: str, exc: BaseException | None) -> HostUnreachableError:
        # the cause first: the command may be long, and a record keeps a message's start
        cause = _describe(exc) if exc is not None else "the connection closed"
        return HostUnreachableError(
            f"connection to {self.target} lost ({cause}) while running: {_short(what)}",
            host=self.host_name,
            fix="check whether the host is still up; the command may or may not have run",
        )

    # -- files -----------------------------------------------------------
    def put_file(self, local_path: str, remote_path: str, mode: int | None = None) -> None:
        """Upload on a bulk session of its own; the file appears whole or not at all."""
        parent = posixpath.dirname(remote_path)
        if parent:
            self.run(["mkdir", "-p", "--", parent])
        part = f"{remote_path}.part-{uuid.uuid4().hex[:12]}"
        with self._bulk_sftp(f"upload of {local_path} to {remote_path}") as (sftp, moved):
            try:
                sftp.put(local_path, part, callback=moved, confirm=True)
                if mode is not None:
                    sftp.chmod(part, mode)
                sftp.posix_rename(part, remote_path)
            except BaseException:
                with contextlib.suppress(Exception):
                    sftp.remove(part)
                raise

    def get_file(self, remote_path: str, local_path: str) -> None:
        """Download on a bulk session of its own; the file appears whole or not at all."""
        directory = os.path.dirname(os.path.abspath(local_path))
        os.makedirs(directory, exist_ok=True)
        fd, part = tempfile.mkstemp(dir=directory, prefix=".download-")
        os.close(fd)
        try:
            with self._bulk_sftp(f"download of {remote_path} to {local_path}") as (sftp, moved):
                sftp.get(remote_path, part, callback=moved)
            os.replace(part, local_path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(part)

    def read_log(self, handle: TaskHandle, offset: int) -> tuple[bytes, int]:
        """Bytes of the task's log from ``offset`` (at most 8 MiB a call), read over SFTP.

        Reads use the runner's control session, which no bulk transfer ever holds. A read
        ends at the size the file had when opened: SFTP reads until a request finds nothing
        more, which never comes while a task writes more than once a round trip (measured: a
        line every 10 ms over a 20 ms round trip, still reading after 20 s). The watch loop
        polls with ``poll_log`` instead: one command.
        """
        what = f"read of {handle.log_path}"
        with self._control_lock:
            sftp = self._control_sftp(what)
            with self._sftp_errors(what, sftp.get_channel()):
                try:
                    f = sftp.open(handle.log_path, "rb")
                except FileNotFoundError:
                    return b"", offset
                with f:
                    size = f.stat().st_size or 0
                    f.seek(offset)
                    data = f.read(max(0, min(READ_LOG_MAX, size - offset)))
        return data, offset + len(data)

    def _control_sftp(self, what: str) -> paramiko.SFTPClient:
        """The control session, (re)opened when missing or closed; call under _control_lock."""
        with self._sessions_lock:
            sftp = self._control
        chan = sftp.get_channel() if sftp is not None else None
        if sftp is not None and chan is not None and not chan.closed and self._alive(chan):
            return sftp
        if sftp is not None:
            with contextlib.suppress(Exception):
                sftp.close()
        sftp = self._open_sftp(what, "control")
        with self._sessions_lock:
            self._control = sftp
        return sftp

    @contextlib.contextmanager
    def _bulk_sftp(self, what: str) -> Iterator[tuple[paramiko.SFTPClient, Callable[[int, int], None]]]:
        """A fresh SFTP session for one transfer, at most BULK_CHANNELS of them at once, and the
        callback the transfer calls as bytes move: once none has moved for BULK_STALL_S, the
        session's connection is closed and the transfer fails as lost."""
        with self._bulk_slots:
            sftp = self._open_sftp(what, "bulk")
            chan = sftp.get_channel()
            transport = chan.get_transport() if chan is not None else None

            def close() -> None:
                if transport is not None:
                    self._forget("bulk", transport)

            guard = _StallGuard(close)
            with self._sessions_lock:
                self._bulk.add(sftp)
            try:
                with self._sftp_errors(what, chan, guard):
                    yield sftp, guard.moved
            finally:
                guard.stop()
                with self._sessions_lock:
                    self._bulk.discard(sftp)
                with contextlib.suppress(Exception):
                    sftp.close()

    def _open_sftp(self, what: str, link: Link) -> paramiko.SFTPClient:
        chan = self._open_channel(link)
        try:
            with self._sftp_errors(what, chan):
                chan.invoke_subsystem("sftp")
                return paramiko.SFTPClient(chan)
        except BaseException:
            chan.close()
            raise

    @contextlib.contextmanager
    def _sftp_errors(self, what: str, chan: paramiko.Channel | None,
                     guard: _StallGuard | None = None) -> Iterator[None]:
        """SFTP failures as RemoteError, or as HostUnreachableError once the connection is gone."""
        try:
            yield
        except (EOFError, paramiko.SSHException, OSError) as exc:
            if guard is not None and guard.stalled:
                raise self._lost(f"{what}: no byte moved for {BULK_STALL_S} s", exc) from exc
            if chan is not None and self._alive(chan):
                raise RemoteError(
                    f"{what} failed: {_describe(exc)}",
                    host=self.host_name,
                    fix="check the paths and their permissions, here and on the host",
                ) from exc
            raise self._lost(what, exc) from exc


class _PollShell:
    """A ``sh`` on a session of its own, running one poll script after another.

    A poll as a command of its own costs the host a session (sshd forks, a shell starts) for a
    script whose own work is a few shell builtins and ``tail | head``: 7.5 ms of CPU for a
    status poll and 5.6 ms for a log-only one, against 3.4 and 2.1 ms in this shell, for the
    host and this machine together (200 polls each of a namespace host's task, measured). Each
    script runs in a subshell with no stdin (no command reads the scripts after it), and after
    it the shell prints a line that only this poll can know (a random nonce) with its exit
    code; its output is everything before that line. Only one poll at a time uses a shell."""

    def __init__(self, chan: paramiko.Channel) -> None:
        self.chan = chan
        try:
            chan.exec_command("sh -s")
        except BaseException:
            chan.close()
            raise

    def run(self, script: str) -> tuple[int, bytes, bytes] | None:
        """Exit code, stdout and stderr of ``script``; None when the shell ended before its
        end. Raises ``_Unsent`` where the script could not be sent."""
        nonce = uuid.uuid4().hex
        try:
            if self.chan.closed or self.chan.eof_received:
                raise _Unsent
            self.chan.sendall(f"( {script}\n) </dev/null; printf '\\n%s %s\\n' {nonce} $?\n"
                              .encode())
        except (OSError, EOFError, paramiko.SSHException):
            raise _Unsent from None
        end = f"\n{nonce} ".encode()
        out, err = bytearray(), bytearray()
        while True:
            _drain(self.chan, out, err)
            at = out.rfind(end, max(0, len(out) - 4096))
            if at >= 0 and out.endswith(b"\n"):
                code = out[at + len(end):-1]
                if code.isdigit():
                    return int(code), bytes(out[:at]), bytes(err)
            if self.chan.closed or self.chan.eof_received:
                return None
            select.select([self.chan], [], [], 1.0)

    def end(self) -> None:
        """Tell the shell to exit, then close its channel."""
        with contextlib.suppress(Exception):
            if not self.chan.closed:
                self.chan.sendall(b"exit\n")
        self.close()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.chan.close()


class _Unsent(Exception):
    """A poll shell took no script: it had ended, or its connection had."""


class _StallGuard:
    """Calls ``close`` once ``moved`` has not been called for BULK_STALL_S (from a thread of its
    own, looking every second), and says so in ``stalled``."""

    def __init__(self, close: Callable[[], object]) -> None:
        self._close, self._last, self.stalled = close, time.monotonic(), False
        self._done = threading.Event()
        threading.Thread(target=self._watch, name="ssh-transfer-stall", daemon=True).start()

    def moved(self, done: int, total: int) -> None:
        self._last = time.monotonic()

    def stop(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        while not self._done.wait(min(1.0, BULK_STALL_S)):
            if time.monotonic() - self._last > BULK_STALL_S:
                self.stalled = True
                self._close()
                return


class _HostKeyPolicy(paramiko.MissingHostKeyPolicy):
    """Refuses unknown keys, unless trust-on-first-use is on: then records them."""

    def __init__(self, runner: SSHRunner) -> None:
        self.runner = runner

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        self.runner._trust_first_use(hostname, key)


class _Timeout(Exception):
    """A command ran past its deadline."""


def _collect(chan: paramiko.Channel, deadline: float | None) -> tuple[bytes, bytes]:
    """Read stdout and stderr until the command has exited and both streams are closed."""
    out, err = bytearray(), bytearray()
    while True:
        _drain(chan, out, err)
        if chan.closed or (chan.eof_received and chan.exit_status_ready()):
            break
        wait = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
        if wait <= 0:
            raise _Timeout
        if chan.eof_received:
            chan.status_event.wait(wait)
        else:
            select.select([chan], [], [], wait)
    _drain(chan, out, err)
    return bytes(out), bytes(err)


def _drain(chan: paramiko.Channel, out: bytearray, err: bytearray) -> None:
    while chan.recv_ready():
        out += chan.recv(65536)
    while chan.recv_stderr_ready():
        err += chan.recv_stderr(65536)


def _read_private_key(runner: SSHRunner) -> paramiko.PKey:
    ep = runner.endpoint
    path = ep.key_file
    if not path:
        raise AuthError(
            f"no SSH key_file given for {runner.target}",
            host=runner.host_name,
            fix="set key_file to a private key authorised on the host (agents and ~/.ssh keys are not used)",
        )
    try:
        data = read_small_file(path, KEY_FILE_MAX)
        if data.lstrip().startswith((b"ssh-", b"ecdsa-", b"sk-")):
            problem = "is a public key (one 'TYPE AAAA...' line)"
            fix = f"set key_file to the private key: {path.removesuffix('.pub')}" \
                if path.endswith(".pub") else "set key_file to the private key of that pair"
        else:
            return paramiko.PKey.from_path(path)
    except SmallFileError as exc:
        problem, fix = str(exc), "set key_file to the private key file of a key authorised on the host"
    except FileNotFoundError:
        problem, fix = "does not exist", "check the key_file path"
    except OSError as exc:
        problem, fix = f"cannot be read ({exc.strerror or exc})", "make it readable by this user"
    except (TypeError, paramiko.PasswordRequiredException):
        problem = "is protected by a passphrase"
        fix = f"use a key without a passphrase, e.g. ssh-keygen -p -N '' -f {path}"
    except UnknownKeyType as exc:
        kind = getattr(exc, "key_type", None)
        problem = f"is a key type paramiko does not use ({getattr(kind, '__name__', kind)})"
        fix = "use an ed25519, ECDSA or RSA key (ssh-keygen -t ed25519); DSA and Ed448 are not supported"
    except Exception as exc:  # cryptography's loaders: ValueError, UnsupportedAlgorithm, ...
        problem = f"is not a private key paramiko can load ({type(exc).__name__}: {str(exc)[:100]})"
        fix = "use an OpenSSH or PEM ed25519, ECDSA or RSA private key"
    raise AuthError(f"SSH key file {path} for {runner.target} {problem}", host=runner.host_name, fix=fix)


class SmallFileError(OSError):
    """A file that is not a regular file of a sane size (a FIFO, a device, a directory, huge)."""


def read_small_file(path: str, limit: int) -> bytes:
    """Read ``path`` if it is a regular file of at most ``limit`` bytes. Opening does not block
    (a FIFO) and reading stops at the limit (``/dev/zero``), so neither hangs nor fills memory."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise SmallFileError("is a directory, not a file")
        if not stat.S_ISREG(st.st_mode):
            raise SmallFileError("is not a regular file (a FIFO, socket or device)")
        if st.st_size > limit:
            raise SmallFileError(f"is {st.st_size} bytes, larger than any such file "
                                 f"({limit} bytes at most)")
        chunks, total = [], 0
        while chunk := os.read(fd, 65536):
            total += len(chunk)
            if total > limit:
                raise SmallFileError(f"grew past {limit} bytes while being read")
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _load_known_hosts(keys: paramiko.HostKeys, path: str) -> str:
    """``keys.load(path)`` once the file is known to be a regular UTF-8 file of a sane size;
    returns its text. Malformed lines raise ``InvalidHostKey`` naming the line."""
    text = read_small_file(path, KNOWN_HOSTS_MAX).decode("utf-8")
    try:
        keys.load(path)
    except (OSError, paramiko.hostkeys.InvalidHostKey):
        raise
    except Exception as exc:  # key data paramiko's parser chokes on in other ways
        raise paramiko.hostkeys.InvalidHostKey(f"a malformed line ({type(exc).__name__})",
                                               exc) from exc
    return text


def fingerprint(key: paramiko.PKey) -> str:
    """The OpenSSH SHA256 fingerprint of a public key: ``SHA256:<base64, unpadded>``."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def _known_hosts_name(ep: SSHEndpoint) -> str:
    return ep.address if ep.port == 22 else f"[{ep.address}]:{ep.port}"


def _parse_host_key_line(name: str, line: str) -> paramiko.hostkeys.HostKeyEntry | None:
    try:
        return paramiko.hostkeys.HostKeyEntry.from_line(f"{name} {line.strip()}")
    except Exception:  # any malformed key data: the caller reports the line
        return None


def _record_host_key(path: str, hostname: str, key: paramiko.PKey) -> paramiko.PKey | None:
    """Append ``key`` for ``hostname`` to known_hosts atomically; return a key already there."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, mode=0o700, exist_ok=True)
    with _KNOWN_HOSTS_LOCK, _locked_dir(directory):
        keys = paramiko.HostKeys()
        existing = ""
        if os.path.lexists(path):
            existing = _load_known_hosts(keys, path)
        known = keys.lookup(hostname)
        if known is not None and len(known):
            same_type = known.get(key.get_name())
            return same_type if same_type is not None else next(iter(known.values()))
        if existing and not existing.endswith("\n"):
            existing += "\n"
        write_atomic(path, f"{existing}{hostname} {key.get_name()} {key.get_base64()}\n")
    return None


@contextlib.contextmanager
def _locked_dir(directory: str) -> Iterator[None]:
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _tune_socket(sock: socket.socket) -> None:
    """Make a silently vanished peer fail the socket instead of hanging it for ~15 minutes."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    user_timeout = getattr(socket, "TCP_USER_TIMEOUT", None)
    if user_timeout is not None:
        sock.setsockopt(socket.IPPROTO_TCP, user_timeout, DEAD_PEER_S * 1000)


def _is_transient(exc: BaseException) -> bool:
    """Connection-level failures worth another try; never auth or host-key errors."""
    if isinstance(exc, (OSError, EOFError)):
        return True
    if isinstance(exc, (paramiko.AuthenticationException, paramiko.BadHostKeyException)):
        return False
    return isinstance(exc, paramiko.SSHException) and "banner" in str(exc).lower()


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _short(script: str, limit: int = 300) -> str:
    return script if len(script) <= limit else script[:limit] + "..."


def _text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")
