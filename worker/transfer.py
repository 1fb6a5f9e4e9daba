"""`python -m worker.transfer list|receive|send|install`: copy a checkpoint directory host to host.

Stdlib only: it runs on training hosts whose python may have nothing else, so it imports nothing
from TensorFlow, paramiko, google-* or ``orchestrator``. The controller starts the pieces over
SSH and passes secrets (the token) on stdin, never in argv, which every user of a host sees in
``ps``. Each command prints one JSON line on stdout (its result) and nothing else.

Why a chain. The chief's host sends to h1, h1 stores and forwards each chunk to h2 as it
arrives, and so on (a pipelined broadcast). Every host's uplink carries the bytes once, so
copying to N hosts takes about the time of one copy, where a star from the chief would take N.

Why one round. The controller starts every piece at once (one SSH command per host) and the
pieces agree on what to send among themselves: the sender lists its directory and sends that
manifest down the chain, each receiver compares it with its own directory, and the union of
what the hosts lack comes back up. A relaunch so waits for one start of the pieces, not for a
listing round trip to every host first.

Why no gzip. Checkpoints are float tensors, which hardly compress, and gzip would spend the
chief's CPU while it trains. Only files that changed are sent: the controller compares the
listings (``needed``) and each receiver hard-links the unchanged files from its current copy.

Why only the newest checkpoint. A relaunch restores the checkpoint the index names (the
controller verified it first, and pointed the index at an older one if it did not restore), so
``list --newest`` leaves out the files of the older checkpoints the index still lists: a
relaunch moves one checkpoint, not the three that are kept. Files in flight (TF's
``*.tempstate*``, ``*_temp/``, ``checkpoint.tmp*``) are never listed.

Why a token and a CRC-32. The port range is reachable from inside the VPC (as TF's gRPC ports
are, which are unauthenticated too). A receiver accepts only a connection whose first line is
the secret token, so nobody else can inject a checkpoint or make it give up; the CRC-32 of
every file (with its size) catches a corrupted or truncated stream. A CRC, as Cloud Storage
checks objects with CRC32C, because the check is against accidents: an unkeyed SHA-256 would
stop no attacker who can rewrite the stream (they would rewrite the digest too) and costs
four times the CPU per byte (1.7 GB/s against 4 GB/s on one core) on hosts that train. Only
the sender and the LAST receiver compute it: a host in the middle writes exactly the buffer
it forwards and swaps its copy in only after the last host acked, so the last host's check
covers it too. The data itself is NOT encrypted: anyone who can read the VPC's traffic can
read the checkpoint, as they can read TF's own traffic.

Why staging + rename. A receiver writes into ``<parent>/.orchestrate-incoming-<name>-<random>``,
then renames DIR away and the staging dir into place, so a host never sees a half-copied one:
on any failure the staging dir is removed and DIR is left as it was; one that a SIGKILL left
behind is removed by the next receive into DIR.

Frames (one TCP connection per hop; "line" = UTF-8 text ending in ``\\n``, one JSON object):

    upstream -> downstream  token line          the token's hex
    downstream -> upstream  proof line          the hex HMAC-SHA256 of "orchestrate-transfer
                                                receiver" keyed by the token (a port squatter
                                                gets nothing)
    upstream -> downstream  manifest line       ``{"manifest": [{"path", "size", "mtime_ns"}]}``,
                                                the sender's listing, forwarded unchanged
    downstream -> upstream  needs line          ``{"needs": [path]}``: what this host and the
                                                hosts after it lack (or an error ack)
    upstream -> downstream  send line           ``{"send": [path]}``, the union in manifest order
                            per file sent:      header line ``{"path": p, "size": n, "mtime_ns": m}``
                                                exactly n raw bytes
                                                digest line, the hex CRC-32 of those bytes
                            end line            ``{"end": true}``
    downstream -> upstream  one ack line        ``{"ok": true}`` or ``{"ok": false, "error": e}``

A manifest without a checkpoint index (the chief has none yet) makes every receiver move a
checkpoint it still has aside (``DIR.stale-<time>``: a relaunch from step 0 must not restore
it) and nothing is sent. A receiver forwards the frames downstream and acks upstream only
after its downstream acked and it swapped its copy in, so the sender's ack means the whole
chain has the files. An error that happened further down is passed up prefixed with that
host's HOST:PORT and marked ``"located": true`` so that hosts above pass it on unchanged. A
receiver sends nothing after its needs line but its ack, so anything readable from a peer
mid-stream is its error (or its close).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import hmac
import json
import os
import re
import resource
import secrets
import select
import shutil
import signal
import socket
import stat
import sys
import time
import zlib
from collections.abc import Iterator
from typing import Any, NoReturn

CHUNK = 1 << 20  # read, hash, write and forward in 1 MiB pieces
EXCLUDED = ("workertemp_", ".orchestrate-")  # TF's non-chief temp dirs; our staging
# What TF writes and then renames or deletes: a bundle's files while they are written
# (``.tempstate<N>``), a sharded save's staging dir (``ckpt-5_temp``), an index being replaced
# (``checkpoint.tmp<hex>``). Listing them would make a copy fail when they vanish.
IN_FLIGHT_FILE = re.compile(r"\.tempstate\d+$|\.tmp[0-9a-f]{32}$")
IN_FLIGHT_DIR = re.compile(r"_temp(_[0-9a-f]+)?$")
INDEX = "checkpoint"  # TF's index of a checkpoint directory
INDEXES = (INDEX, f"chief/{INDEX}")  # at the top, or in chief/ (BackupAndRestore's layout)
CONNECT_FOR_S = 60.0  # keep retrying a refused connection this long (the peer may not listen yet)
CONNECT_EVERY_S = (0.01, 0.2)  # retry a refused connection after 10 ms, doubling up to 200 ms
TOKEN_WITHIN_S = 10.0  # an accepted connection must send its token line this soon
MAX_LINE = 64 * 1024
MAX_MANIFEST = 16 << 20  # a manifest, needs or send line (a sharded checkpoint lists many files)
MAX_PENDING = 64  # connections waiting to send their token line
LINGER_S = 5.0  # after an error ack, read what the peer still sends this long, then close
EXIT_PORT_TAKEN = 75
SIGNALS = {signal.SIGTERM, signal.SIGHUP, signal.SIGINT}


class TransferError(Exception):
    """A failure whose message goes in the JSON result and the ack upstream."""


class PeerError(TransferError):
    """A failure that already names the host where it happened (passed upstream unchanged)."""


class Closed(TransferError):
    """The peer closed the connection."""


# -- listings ----------------------------------------------------------------------------------
def listing(directory: str, newest: bool = False) -> dict[str, Any]:
    """``{"exists", "files": [{"path", "size", "mtime_ns"}], "bytes"}`` of ``directory``, sorted;
    with ``newest``, without the files of the checkpoints an index lists but does not name as
    its current one (see ``older_checkpoints``)."""
    if not os.path.isdir(directory):
        return {"exists": False, "files": [], "bytes": 0}
    files = sorted(_walk(directory, ""), key=lambda f: str(f["path"]))
    if newest:
        older = older_checkpoints(directory, [str(f["path"]) for f in files])
        files = [f for f in files if _prefix_of(str(f["path"])) not in older]
    return {"exists": True, "files": files, "bytes": sum(f["size"] for f in files)}


def older_checkpoints(directory: str, paths: list[str]) -> set[str]:
    """The checkpoint prefixes (relative to ``directory``, like ``chief/ckpt-5``) that an index
    file lists in ``all_model_checkpoint_paths`` besides its ``model_checkpoint_path``."""
    older: set[str] = set()
    for rel in paths:
        if rel.rsplit("/", 1)[-1] != INDEX:
            continue
        try:
            with open(os.path.join(directory, rel), encoding="utf-8", errors="replace") as f:
                text = f.read(MAX_LINE)
        except OSError:
            continue
        current = re.findall(r'^model_checkpoint_path:\s*"([^"]*)"', text, re.M)
        if not current:
            continue
        base = rel[: -len(INDEX)]
        keep = os.path.basename(current[0])
        older |= {base + os.path.basename(name)
                  for name in re.findall(r'^all_model_checkpoint_paths:\s*"([^"]*)"', text, re.M)
                  if os.path.basename(name) != keep}
    return older


def _prefix_of(rel: str) -> str:
    """The checkpoint prefix of a bundle file: ``chief/ckpt-5`` for ``chief/ckpt-5.index`` and
    ``chief/ckpt-5.data-00000-of-00001``; other files are their own."""
    head, _, name = rel.rpartition("/")
    stem = re.sub(r"\.(index|data-\d+-of-\d+)$", "", name)
    return f"{head}/{stem}" if head else stem


def _walk(root: str, prefix: str) -> Iterator[dict[str, Any]]:
    """Regular files under ``root/prefix``: no symlinks, nothing excluded, vanished ones skipped."""
    try:
        entries = list(os.scandir(os.path.join(root, prefix)))
    except FileNotFoundError:  # deleted while we walk (TF removing an old checkpoint)
        return
    for entry in entries:
        if entry.name.startswith(EXCLUDED) or entry.is_symlink():
            continue
        rel = prefix + entry.name
        try:
            if entry.is_dir(follow_symlinks=False):
                if not IN_FLIGHT_DIR.search(entry.name):
                    yield from _walk(root, rel + "/")
            elif entry.is_file(follow_symlinks=False) and not IN_FLIGHT_FILE.search(entry.name):
                st = entry.stat(follow_symlinks=False)
                yield {"path": rel, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        except FileNotFoundError:
            continue


def needed(source: list[dict[str, Any]], present: list[dict[str, Any]]) -> list[str]:
    """Paths of ``source`` files that ``present`` lacks with the same size and mtime_ns."""
    have = {f["path"]: (f["size"], f["mtime_ns"]) for f in present}
    return [f["path"] for f in source if have.get(f["path"]) != (f["size"], f["mtime_ns"])]


def holds_checkpoint(files: list[dict[str, Any]]) -> bool:
    """Whether a listing has a checkpoint index (``INDEXES``)."""
    return any(f["path"] in INDEXES for f in files)


def _safe(rel: Any) -> str:
    """``rel`` if it is a relative POSIX path that stays inside its directory."""
    if not isinstance(rel, str) or "\0" in rel or any(p in ("", ".", "..") for p in rel.split("/")):
        raise TransferError(f"unsafe path {rel!r}")
    return rel


class Crc32:
    """The CRC-32 of a stream, in hashlib's shape (``update``, ``hexdigest``)."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: bytes | memoryview) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def cpu_seconds() -> float:
    """This process's CPU time so far (user + system), for the result's figures."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return round(usage.ru_utime + usage.ru_stime, 3)


# -- the swap ----------------------------------------------------------------------------------
def swap_in(staging: str, dest: str) -> None:
    """Put directory ``staging`` in place of ``dest`` (renames in one parent), then delete the old."""
    dest = os.path.abspath(dest)
    old = None
    if os.path.lexists(dest):
        old = _sibling(dest, "old")
        os.rename(dest, old)
    try:
        os.rename(staging, dest)
    except OSError:
        if old:
            os.rename(old, dest)
        raise
    if old:
        shutil.rmtree(old, ignore_errors=True)


def _sibling(dest: str, kind: str) -> str:
    return os.path.join(os.path.dirname(dest),
                        f".orchestrate-{kind}-{os.path.basename(dest)}-{secrets.token_hex(6)}")


def remove_leftovers(dest: str) -> list[str]:
    """Delete the staging and old directories of ``dest`` that an earlier receive left behind
    (a receiver killed by SIGKILL cannot clean up; the next one does). Only one receive into
    ``dest`` runs at a time: the controller copies once per relaunch."""
    parent, name = os.path.split(os.path.abspath(dest))
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.listdir(parent):
            if any(entry.startswith(f".orchestrate-{kind}-{name}-") for kind in ("incoming", "old")):
                shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)
                removed.append(entry)
    return removed


# -- connections -------------------------------------------------------------------------------
class Channel:
    """A socket with a read buffer: lines for frames and acks, ``read_into`` for file bytes."""

    def __init__(self, sock: socket.socket, where: str, data: bytes = b"") -> None:
        self.sock, self.where, self.buf = sock, where, bytearray(data)

    def line(self, limit: int = MAX_LINE) -> bytes:
        start = 0
        while (end := self.buf.find(b"\n", start)) < 0:
            if len(self.buf) > limit:
                raise TransferError(f"{self.where}: line longer than {limit} bytes")
            start = len(self.buf)
            self.buf += self._recv()
        line = bytes(self.buf[:end])
        del self.buf[: end + 1]
        return line

    def frame(self, limit: int = MAX_LINE) -> dict[str, Any]:
        return parse_frame(self.line(limit), self.where)

    def answer(self, what: str) -> dict[str, Any]:
        """The peer's ``what`` line (a manifest, needs or send line); its error ack raises."""
        try:
            frame = self.frame(MAX_MANIFEST)
        except Closed as exc:
            raise PeerError(f"{self.where}: closed the connection before its {what} line") from exc
        if frame.get("ok") is False:
            raise ack_error(frame, self.where)
        return frame

    def read_into(self, view: memoryview) -> int:
        if self.buf:
            n = min(len(view), len(self.buf))
            view[:n] = self.buf[:n]
            del self.buf[:n]
            return n
        try:
            n = self.sock.recv_into(view)
        except OSError as exc:
            raise TransferError(f"{self.where}: {exc}") from exc
        if not n:
            raise Closed(f"{self.where} closed the connection")
        return n

    def _recv(self) -> bytes:
        try:
            data = self.sock.recv(65536)
        except OSError as exc:
            raise TransferError(f"{self.where}: {exc}") from exc
        if not data:
            raise Closed(f"{self.where} closed the connection")
        return data

    def push(self, data: bytes | memoryview, *, last: bool = False) -> None:
        """Send ``data``; a peer that answered mid-stream (its error) or went away fails us.

        After the ``last`` frame the peer's answer is its ack, read by the caller.
        """
        try:
            self.sock.sendall(data)
        except OSError as exc:
            raise self.failure(exc) from exc
        if not last and (self.buf or select.select([self.sock], [], [], 0)[0]):
            raise self.failure()  # (an answer read along with the receiver's proof is in buf)

    def failure(self, exc: OSError | None = None) -> TransferError:
        """What went wrong at the peer: its error ack when it sent one, else the lost connection."""
        try:
            self.sock.settimeout(LINGER_S)
            ack = self.frame()
            if ack.get("ok") is False:
                return ack_error(ack, self.where)
        except (TransferError, OSError):
            pass
        return PeerError(f"{self.where}: connection lost" + (f" ({exc})" if exc else ""))

    def send_ack(self, error: TransferError | None) -> None:
        """Ack upstream (best effort); after an error, let the peer read it before we close."""
        ack: dict[str, Any] = {"ok": True}
        if error is not None:
            ack = {"ok": False, "error": str(error), "located": isinstance(error, PeerError)}
        try:
            self.sock.sendall(json.dumps(ack).encode() + b"\n")
            if error is not None:
                self._linger()
        except OSError:
            pass
        self.close()

    def _linger(self) -> None:
        """Drain until the peer closes (it stops sending once it reads our ack), at most LINGER_S."""
        self.sock.shutdown(socket.SHUT_WR)
        until = time.monotonic() + LINGER_S
        while (left := until - time.monotonic()) > 0:
            self.sock.settimeout(left)
            if not self.sock.recv(CHUNK):
                return

    def close(self) -> None:
        self.sock.close()


def parse_frame(line: bytes, where: str) -> dict[str, Any]:
    try:
        frame = json.loads(line)
    except ValueError:
        frame = None
    if not isinstance(frame, dict):
        raise TransferError(f"{where}: bad frame {line[:80]!r}")
    return frame


def ack_error(ack: dict[str, Any], where: str) -> PeerError:
    message = str(ack.get("error") or "failed")
    return PeerError(message if ack.get("located") else f"{where}: {message}")


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise TransferError(f"bad address {address!r} (want HOST:PORT)")
    return host.strip("[]"), int(port)


def connect(address: str, token: str, timeout: float) -> Channel:
    """Connect to ``address`` (retrying while refused), and send the token line."""
    host, port = _split(address)
    limit = min(CONNECT_FOR_S, timeout)
    deadline = time.monotonic() + limit
    pause, most = CONNECT_EVERY_S
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=max(1.0, min(10.0, limit)))
            break
        except OSError as exc:
            if time.monotonic() + pause > deadline:
                raise TransferError(f"could not connect to {address} within {limit:g} s: {exc}") from exc
            time.sleep(pause)  # the receiver is starting: it listens within a few tens of ms
            pause = min(most, pause * 2)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    channel = Channel(sock, address)
    channel.push(token.encode() + b"\n", last=True)  # what comes back now is the proof
    sock.settimeout(TOKEN_WITHIN_S)  # a receiver proves at once that it holds the token too
    try:
        proof = channel.line()
    except (TransferError, OSError) as exc:
        channel.close()
        raise TransferError(f"{address} did not answer the token: not our receiver "
                            f"(another process on that port?): {exc}") from None
    if not hmac.compare_digest(proof, receiver_proof(token)):
        channel.close()
        raise TransferError(f"{address} answered without the token: not our receiver (another "
                            "process on that port?); nothing was sent")
    sock.settimeout(timeout)
    return channel


def receiver_proof(token: str) -> bytes:
    """What a receiver answers to the right token: it holds the token as well, so a process
    that took the receiver's port first cannot collect the checkpoint."""
    return hmac.new(token.encode(), b"orchestrate-transfer receiver", hashlib.sha256) \
        .hexdigest().encode()


def listen(address: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(16)
    except OSError:
        sock.close()
        raise
    return sock


class Gate:
    """Accepts connections until one sends the right token line; the others are closed and counted.

    Connections are read side by side (select), so a silent or slow one delays nobody and a
    wrong token only closes that connection: nobody but the token's holder can end the wait.
    """

    def __init__(self, listener: socket.socket, token: str) -> None:
        self.listener, self.token = listener, token.encode()
        self.pending: dict[socket.socket, tuple[bytearray, float]] = {}
        self.rejected = 0

    def accept(self, deadline: float, timeout: float) -> Channel:
        try:
            while (left := deadline - time.monotonic()) > 0:
                for sock in select.select([self.listener, *self.pending], [], [], min(left, 1.0))[0]:
                    if sock is self.listener:
                        self._new()
                    elif (channel := self._read(sock)) is not None:
                        channel.sock.settimeout(timeout)
                        return channel
                self._expire()
        finally:
            for sock in self.pending:
                sock.close()
            self.pending.clear()
        raise TransferError(f"timed out after {timeout:g} s waiting for the upstream sender"
                            f" ({self.rejected} connections with a wrong token)")

    def _new(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except OSError:  # gone before we took it, or out of descriptors: keep waiting
            return
        if len(self.pending) >= MAX_PENDING:
            self._reject(next(iter(self.pending)))
        self.pending[sock] = (bytearray(), time.monotonic() + TOKEN_WITHIN_S)

    def _read(self, sock: socket.socket) -> Channel | None:
        buf = self.pending[sock][0]
        try:
            data = sock.recv(4096)
        except OSError:
            data = b""
        buf += data
        line, newline, rest = bytes(buf).partition(b"\n")
        if data and not newline and len(buf) <= len(self.token):
            return None  # not all of the line yet
        if not newline or not hmac.compare_digest(line, self.token):
            self._reject(sock)
            return None
        del self.pending[sock]
        try:
            host, port = sock.getpeername()[:2]
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(receiver_proof(self.token.decode()) + b"\n")
        except OSError:
            sock.close()
            return None
        return Channel(sock, f"upstream {host}:{port}", rest)

    def _expire(self) -> None:
        now = time.monotonic()
        for sock in [s for s, (_, until) in self.pending.items() if until < now]:
            self._reject(sock)

    def _reject(self, sock: socket.socket) -> None:
        self.rejected += 1
        del self.pending[sock]
        sock.close()


# -- receive -----------------------------------------------------------------------------------
class Receiver:
    """One receive: accept upstream, connect downstream, agree on the files, link, stream,
    swap, ack."""

    def __init__(self, args: argparse.Namespace, token: str) -> None:
        self.dest = os.path.abspath(args.dest)
        self.forward: str | None = args.forward
        self.timeout: float = args.timeout
        self.token = token
        self.manifest: dict[str, dict[str, Any]] = {}
        self.send: list[str] = []
        self.keep = False  # this host lacked files: it takes what is sent and swaps it in
        self.cleared = ""  # where a checkpoint the source no longer has was moved
        self.staging: str | None = None
        self.up: Channel | None = None
        self.down: Channel | None = None
        self.bytes = 0
        self.linked = 0

    def run(self, listener: socket.socket) -> dict[str, Any]:
        started = time.monotonic()
        gate = Gate(listener, self.token)
        try:
            self.up = gate.accept(started + self.timeout, self.timeout)
            listener.close()
            started = time.monotonic()  # "seconds" is the transfer's, not the wait for it
            if self.forward:
                self.down = connect(self.forward, self.token, self.timeout)
            self._agree()
            self._prepare()
            self._stream()
            self._finish()
        except Exception as exc:
            error = exc if isinstance(exc, TransferError) else TransferError(str(exc) or repr(exc))
            self._fail(error)
            return {"ok": False, "error": str(error), "rejected": gate.rejected}
        return {"ok": True, "files": len(self.manifest), "received": len(self.send) if self.keep else 0,
                "bytes": self.bytes if self.keep else 0, "streamed": self.bytes,
                "linked": self.linked,
                "up_to_date": not self.keep and holds_checkpoint(list(self.manifest.values())),
                "cleared": self.cleared, "rejected": gate.rejected,
                "seconds": round(time.monotonic() - started, 3), "cpu_s": cpu_seconds()}

    def _agree(self) -> None:
        """Read the manifest (forwarding it), answer what this host and those after it lack,
        read the list of files that will be sent (forwarding it)."""
        assert self.up is not None
        line = self.up.line(MAX_MANIFEST)
        manifest = check_manifest(parse_frame(line, self.up.where).get("manifest"))
        self.manifest = {f["path"]: f for f in manifest}
        if self.down is not None:
            self.down.push(line + b"\n", last=True)  # its answer is its needs line
        present = listing(self.dest)["files"]
        mine: list[str] = []
        if holds_checkpoint(manifest):
            mine = needed(manifest, present)
        elif holds_checkpoint(present):  # a relaunch from step 0 must not restore it
            self.cleared = f"{self.dest}.stale-{int(time.time())}"
            os.rename(self.dest, self.cleared)
        self.keep = bool(mine)
        lacking = set(mine)
        if self.down is not None:
            lacking |= set(check_paths(self.down.answer("needs").get("needs"), self.manifest,
                                       f"the needs of {self.down.where}"))
        needs = [rel for rel in self.manifest if rel in lacking]
        self.up.push(json.dumps({"needs": needs}).encode() + b"\n", last=True)
        line = self.up.line(MAX_MANIFEST)
        self.send = check_paths(parse_frame(line, self.up.where).get("send"), self.manifest, "send")
        if not set(mine) <= set(self.send):
            raise TransferError(f"the sender leaves out {sorted(set(mine) - set(self.send))[:5]}")
        if self.down is not None:
            self.down.push(line + b"\n")

    def _prepare(self) -> None:
        """The staging dir, with every manifest file that is not sent hard-linked from DIR."""
        if not self.keep:
            return
        parent = os.path.dirname(self.dest)
        os.makedirs(parent, exist_ok=True)
        remove_leftovers(self.dest)
        staging = _sibling(self.dest, "incoming")
        os.mkdir(staging, 0o755)
        self.staging = staging
        sending = set(self.send)
        for rel, entry in self.manifest.items():
            if rel not in sending:
                _link(os.path.join(self.dest, rel), os.path.join(staging, rel), entry)
                self.linked += 1

    def _stream(self) -> None:
        assert self.up is not None
        view = memoryview(bytearray(CHUNK))
        for rel in self.send:
            size = self._header(rel)
            self._file(rel, size, view)
            self.bytes += size
        line = self.up.line()
        if parse_frame(line, self.up.where) != {"end": True}:
            raise TransferError(f"expected the end of the stream after {len(self.send)} files, "
                                f"got {line[:80]!r}")
        if self.down is not None:
            self.down.push(line + b"\n", last=True)

    def _header(self, rel: str) -> int:
        assert self.up is not None
        line = self.up.line()
        frame = parse_frame(line, self.up.where)
        want = self.manifest[rel]
        if frame.get("end"):
            raise TransferError(f"stream ended before {rel}")
        if frame.get("path") != rel:
            raise TransferError(f"expected {rel} next, got {str(frame.get('path'))[:200]!r}")
        if (frame.get("size"), frame.get("mtime_ns", want["mtime_ns"])) != (want["size"], want["mtime_ns"]):
            raise TransferError(f"{rel} changed since it was listed (size {frame.get('size')}, mtime_ns "
                                f"{frame.get('mtime_ns')}; listed {want['size']}, {want['mtime_ns']})")
        self._push(line + b"\n")
        return int(want["size"])

    def _file(self, rel: str, size: int, view: memoryview) -> None:
        """Write ``size`` bytes of ``rel`` as they arrive (forwarding each piece), then check them."""
        assert self.up is not None
        path = os.path.join(self.staging, rel) if self.staging is not None else None
        if path is not None:
            os.makedirs(os.path.dirname(path), 0o755, exist_ok=True)
        # The last host checks the digest, whether or not it keeps the files; one in the
        # middle writes what it forwards, which the last host's check covers (see the module's
        # docstring).
        digest, left = (Crc32() if self.down is None else None), size
        with open(path, "wb") if path is not None else contextlib.nullcontext() as f:
            while left:
                try:
                    n = self.up.read_into(view[: min(left, CHUNK)])
                except Closed as exc:
                    raise TransferError(f"short stream: {exc} after {size - left} of {size} bytes "
                                        f"of {rel}") from exc
                self._push(view[:n])  # first, so the next host works on it while we write
                if digest is not None:
                    digest.update(view[:n])
                if f is not None:
                    f.write(view[:n])
                left -= n
        line = self.up.line()
        self._push(line + b"\n")
        if digest is not None and not hmac.compare_digest(line.strip(), digest.hexdigest().encode()):
            raise TransferError(f"checksum mismatch for {rel} (CRC-32)")
        if path is not None:
            mtime = int(self.manifest[rel]["mtime_ns"])
            os.utime(path, ns=(mtime, mtime))

    def _push(self, data: bytes | memoryview) -> None:
        if self.down is not None:
            self.down.push(data)

    def _finish(self) -> None:
        """Wait for the downstream's ack, swap the staging dir in, ack upstream."""
        assert self.up is not None
        if self.down is not None:
            ack = self.down.frame()
            if ack.get("ok") is not True:
                raise ack_error(ack, self.down.where)
            self.down.close()
        if self.staging is not None:
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)  # no half-done swap
            try:
                swap_in(self.staging, self.dest)
                self.staging = None
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        self.up.send_ack(None)

    def _fail(self, error: TransferError) -> None:
        if self.staging is not None:
            shutil.rmtree(self.staging, ignore_errors=True)
        if self.down is not None:
            self.down.close()  # the downstream sees the stream end early and cleans up too
        if self.up is not None:
            self.up.send_ack(error)


def _link(source: str, target: str, entry: dict[str, Any]) -> None:
    """Hard-link ``source`` (which must still match ``entry``) to ``target``; copy if links fail."""
    try:
        st = os.lstat(source)
    except FileNotFoundError:
        raise TransferError(f"missing {entry['path']}") from None
    if not stat.S_ISREG(st.st_mode) or (st.st_size, st.st_mtime_ns) != (entry["size"], entry["mtime_ns"]):
        raise TransferError(f"missing {entry['path']} (here: size {st.st_size}, mtime_ns {st.st_mtime_ns};"
                            f" the source's: {entry['size']}, {entry['mtime_ns']})")
    os.makedirs(os.path.dirname(target), 0o755, exist_ok=True)
    try:
        os.link(source, target)
    except OSError:  # a filesystem without hard links
        shutil.copy2(source, target)


# -- send --------------------------------------------------------------------------------------
def send_checkpoint(source: str, to: str, token: str, timeout: float,
                    newest: bool = False) -> dict[str, Any]:
    """List ``source`` (``newest``: its current checkpoint only), agree with the chain at
    ``to`` on what the hosts lack, stream those files; return after the chain's ack."""
    started = time.monotonic()
    files = listing(source, newest=newest)["files"]
    channel = connect(to, token, timeout)
    try:
        channel.push(json.dumps({"manifest": files}).encode() + b"\n", last=True)
        lacking = set(check_paths(channel.answer("needs").get("needs"),
                                  {f["path"]: f for f in files}, f"the needs of {to}"))
        paths = [f["path"] for f in files if f["path"] in lacking]
        channel.push(json.dumps({"send": paths}).encode() + b"\n")
        view = memoryview(bytearray(CHUNK))
        total = sum(_send_file(channel, source, rel, view) for rel in paths)
        channel.push(b'{"end": true}\n', last=True)
        try:
            ack = channel.frame()
        except Closed as exc:
            raise PeerError(f"{to}: closed the connection before acknowledging") from exc
        if ack.get("ok") is not True:
            raise ack_error(ack, to)
    finally:
        channel.close()
    return {"ok": True, "files": len(paths), "bytes": total, "listed": len(files),
            "checkpoint": holds_checkpoint(files),
            "seconds": round(time.monotonic() - started, 3), "cpu_s": cpu_seconds()}


def _send_file(channel: Channel, source: str, rel: str, view: memoryview) -> int:
    """Header, bytes and digest of one file; fails if the file changes while it is read."""
    try:
        f = open(os.path.join(source, _safe(rel)), "rb", buffering=0)  # noqa: SIM115
    except FileNotFoundError:
        raise TransferError(f"{rel} is missing from {source}") from None
    with f:
        before = os.fstat(f.fileno())
        channel.push(json.dumps({"path": rel, "size": before.st_size, "mtime_ns": before.st_mtime_ns})
                     .encode() + b"\n")
        digest, left = Crc32(), before.st_size
        while left:
            n = f.readinto(view[: min(left, CHUNK)])
            if not n:
                raise TransferError(f"{rel} shrank while being sent (a checkpoint being rewritten?)")
            channel.push(view[:n])
            digest.update(view[:n])
            left -= n
        after = os.fstat(f.fileno())
    if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
        raise TransferError(f"{rel} changed while being sent (a checkpoint being rewritten?)")
    channel.push(digest.hexdigest().encode() + b"\n")
    return before.st_size


# -- command line ------------------------------------------------------------------------------
def read_request(*keys: str) -> dict[str, Any]:
    """One JSON object from stdin (the controller need not close stdin after it)."""
    text = ""
    for line in sys.stdin:
        text += line
        try:
            request = json.loads(text)
            break
        except ValueError:
            continue
    else:
        request = json.loads(text) if text.strip() else None
    if not isinstance(request, dict) or any(key not in request for key in keys):
        raise TransferError(f"stdin must be a JSON object with {', '.join(keys)}")
    return request


def check_token(request: dict[str, Any]) -> str:
    token = request["token"]
    if not isinstance(token, str) or len(token) < 16:
        raise TransferError("the token must be a string of at least 16 characters")
    return token


def check_manifest(manifest: Any) -> list[dict[str, Any]]:
    """A manifest line's files, each a safe path with an integer size and mtime, no path twice."""
    if not isinstance(manifest, list) or not all(
            isinstance(f, dict) and isinstance(f.get("size"), int) and isinstance(f.get("mtime_ns"), int)
            and f["size"] >= 0 for f in manifest):
        raise TransferError("the manifest must be a list of {path, size, mtime_ns}")
    paths = [_safe(f.get("path")) for f in manifest]
    if len(set(paths)) != len(paths):
        raise TransferError("duplicate paths in the manifest")
    return [{"path": f["path"], "size": f["size"], "mtime_ns": f["mtime_ns"]} for f in manifest]


def check_paths(paths: Any, manifest: dict[str, Any], what: str) -> list[str]:
    """A needs or send line's paths: strings of the manifest, none twice."""
    if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
        raise TransferError(f"{what} must be a list of paths")
    if len(set(paths)) != len(paths):
        raise TransferError(f"duplicate paths in {what}")
    if not set(paths) <= set(manifest):
        raise TransferError(f"{what} lists paths not in the manifest: "
                            f"{sorted(set(paths) - set(manifest))[:5]}")
    return paths


def _interrupted(signum: int, _frame: object) -> NoReturn:
    raise TransferError(f"interrupted by signal {signum}")


def _receive(args: argparse.Namespace) -> int:
    token = check_token(read_request("token"))
    try:
        listener = listen(args.bind, args.port)
    except OSError as exc:
        _print({"ok": False, "error": f"port {args.port} is taken: {exc}"})
        return EXIT_PORT_TAKEN
    for signum in SIGNALS:
        signal.signal(signum, _interrupted)
    with listener:
        result = Receiver(args, token).run(listener)
    _print(result)
    return 0 if result["ok"] else 1


def _send(args: argparse.Namespace) -> int:
    token = check_token(read_request("token"))
    _print(send_checkpoint(args.source, args.to, token, args.timeout, newest=args.newest))
    return 0


def _install(args: argparse.Namespace) -> int:
    staging = read_request("staging")["staging"]
    if not isinstance(staging, str) or not os.path.isabs(staging) or not os.path.isdir(staging):
        raise TransferError(f"staging must be an absolute path of a directory: {staging!r}")
    swap_in(staging, args.dest)
    _print({"ok": True})
    return 0


def _list(args: argparse.Namespace) -> int:
    _print(listing(args.dir, newest=args.newest))
    return 0


def _print(result: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m worker.transfer", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    list_ = sub.add_parser("list", help="one JSON line: the files of DIR")
    list_.add_argument("dir")
    list_.add_argument("--newest", action="store_true",
                       help="leave out the older checkpoints an index lists")
    receive = sub.add_parser("receive", help="receive (and forward) files into DEST; stdin: token")
    receive.add_argument("--dest", required=True)
    receive.add_argument("--port", type=int, required=True)
    receive.add_argument("--bind", default="")
    receive.add_argument("--forward", metavar="HOST:PORT")
    receive.add_argument("--timeout", type=float, default=600.0)
    receive.add_argument("--pid-file", help="a file holding this process's pid: removed at exit")
    send = sub.add_parser("send", help="send what the receivers lack of SOURCE; stdin: token")
    send.add_argument("--source", required=True)
    send.add_argument("--to", required=True, metavar="HOST:PORT")
    send.add_argument("--newest", action="store_true",
                      help="only the checkpoint the index names, not the older ones it keeps")
    send.add_argument("--timeout", type=float, default=600.0)
    send.add_argument("--pid-file", help="a file holding this process's pid: removed at exit")
    install = sub.add_parser("install", help="swap a staging dir in; stdin: staging")
    install.add_argument("--dest", required=True)
    return parser


COMMANDS = {"list": _list, "receive": _receive, "send": _send, "install": _install}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (TransferError, OSError, ValueError) as exc:
        _print({"ok": False, "error": str(exc)})
        return 1
    finally:
        _remove_pid_file(getattr(args, "pid_file", None))


def _remove_pid_file(path: str | None) -> None:
    """Remove the pid file the controller's command wrote for us, if it still names us (the
    controller stops a piece of a failed chain by it)."""
    if not path:
        return
    with contextlib.suppress(OSError, ValueError), open(path, encoding="ascii") as f:
        if int(f.read().strip() or 0) == os.getpid():
            os.remove(path)


if __name__ == "__main__":
    sys.exit(main())
