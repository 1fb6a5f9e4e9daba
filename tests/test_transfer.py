"""worker.transfer: host-to-host checkpoint copies, run as real processes on 127.0.0.1 sockets."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from worker.transfer import listing, needed, receiver_proof, remove_leftovers

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
TOKEN = secrets.token_hex(16)
INDEX = b'model_checkpoint_path: "ckpt-3"\n'


# -- helpers ---------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def write(path: Path, data: bytes, mtime_ns: int | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    if mtime_ns is not None:
        os.utime(path, ns=(mtime_ns, mtime_ns))


def checkpoint(root: Path, big: int = 20 << 20) -> None:
    """A chief's checkpoint dir: an index file, a nested subdir, one large random file, TF's junk."""
    write(root / "checkpoint", INDEX, 1_700_000_000_123_456_789)
    write(root / "chief" / "ckpt-3.index", os.urandom(3000))
    write(root / "chief" / "ckpt-3.data-00000-of-00001", os.urandom(big))
    write(root / "chief" / "nested" / "deeper" / "meta.json", b"{}")
    write(root / "chief" / "empty", b"")
    write(root / "workertemp_1" / "ckpt-3.index", b"temp")
    write(root / ".orchestrate-incoming-abc" / "x", b"staging")


def digests(root: Path) -> dict[str, str]:
    return {f["path"]: hashlib.sha256((root / f["path"]).read_bytes()).hexdigest()
            for f in listing(str(root))["files"]}


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith(".orchestrate-")]


class Procs:
    """Every process a test starts, killed at teardown if it is still running."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen[str]] = []

    def start(self, *args: str, stdin: dict[str, Any] | None = None) -> subprocess.Popen[str]:
        proc = subprocess.Popen([sys.executable, "-m", "worker.transfer", *args], cwd=REPO, env=ENV,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        self.started.append(proc)
        assert proc.stdin is not None
        if stdin is not None:
            proc.stdin.write(json.dumps(stdin))
        proc.stdin.close()
        proc.stdin = None  # so that communicate() does not flush it
        return proc

    def receiver(self, dest: Path, port: int, *extra: str, token: str = TOKEN,
                 timeout: float = 20) -> subprocess.Popen[str]:
        return self.start("receive", "--dest", str(dest), "--port", str(port), "--bind", "127.0.0.1",
                          "--timeout", str(timeout), *extra, stdin={"token": token})

    def sender(self, source: Path, port: int, *extra: str, timeout: float = 20) -> subprocess.Popen[str]:
        return self.start("send", "--source", str(source), "--to", f"127.0.0.1:{port}",
                          "--timeout", str(timeout), *extra, stdin={"token": TOKEN})


def result(proc: subprocess.Popen[str], timeout: float = 30) -> tuple[int, dict[str, Any]]:
    out, err = proc.communicate(timeout=timeout)
    lines = out.strip().splitlines()
    assert len(lines) == 1, (out, err)
    return proc.returncode, json.loads(lines[0])


@pytest.fixture
def procs() -> Iterator[Procs]:
    procs = Procs()
    yield procs
    for proc in procs.started:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def chain(procs: Procs, source: Path, dests: list[Path], *sender_args: str,
          ) -> tuple[tuple[int, dict[str, Any]], list[tuple[int, dict[str, Any]]]]:
    """sender -> dests[0] -> dests[1] -> ..., all started at once; the results of the sender
    and of every receiver."""
    ports = [free_port() for _ in dests]
    receivers: list[subprocess.Popen[str]] = []
    for i in reversed(range(len(dests))):
        forward = ["--forward", f"127.0.0.1:{ports[i + 1]}"] if i + 1 < len(dests) else []
        receivers.insert(0, procs.receiver(dests[i], ports[i], *forward))
    sent = result(procs.sender(source, ports[0], *sender_args))
    return sent, [result(r) for r in receivers]


def upstream(port: int, manifest: list[dict[str, Any]]) -> tuple[socket.socket, Any, list[str]]:
    """A test's own sender, up to the send line: token, proof, manifest; returns the socket,
    its line reader and the needs the chain answered."""
    sock = _connect(port)
    sock.sendall(TOKEN.encode() + b"\n")
    lines = sock.makefile("rb")
    assert lines.readline().strip() == receiver_proof(TOKEN)  # it holds the token too
    sock.sendall(json.dumps({"manifest": manifest}).encode() + b"\n")
    return sock, lines, json.loads(lines.readline())["needs"]


# -- list and needed ---------------------------------------------------------------------------
def test_list_files_sizes_mtimes_and_exclusions(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    checkpoint(root, big=5000)
    (root / "chief" / "link").symlink_to(root / "checkpoint")
    (root / "linkdir").symlink_to(root / "chief")
    proc = subprocess.run([sys.executable, "-m", "worker.transfer", "list", str(root)], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=30, check=True)
    assert len(proc.stdout.splitlines()) == 1
    listed = json.loads(proc.stdout)
    paths = [f["path"] for f in listed["files"]]
    assert paths == ["checkpoint", "chief/ckpt-3.data-00000-of-00001", "chief/ckpt-3.index", "chief/empty",
                     "chief/nested/deeper/meta.json"]
    assert listed["exists"] is True
    assert listed["bytes"] == sum(f["size"] for f in listed["files"]) == len(INDEX) + 5000 + 3000 + 0 + 2
    first = listed["files"][0]
    assert first == {"path": "checkpoint", "size": len(INDEX), "mtime_ns": 1_700_000_000_123_456_789}
    assert listed == listing(str(root))

    missing = subprocess.run([sys.executable, "-m", "worker.transfer", "list", str(tmp_path / "nope")],
                             cwd=REPO, env=ENV, capture_output=True, text=True, timeout=30)
    assert missing.returncode == 0
    assert json.loads(missing.stdout) == {"exists": False, "files": [], "bytes": 0}


def test_list_newest_leaves_out_the_older_checkpoints_and_never_lists_files_in_flight(
        tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    index = ('model_checkpoint_path: "ckpt-3"\nall_model_checkpoint_paths: "ckpt-1"\n'
             'all_model_checkpoint_paths: "/elsewhere/chief/ckpt-2"\n'
             'all_model_checkpoint_paths: "ckpt-3"\n')
    write(root / "chief" / "checkpoint", index.encode())
    for n in (1, 2, 3):
        write(root / "chief" / f"ckpt-{n}.index", b"i" * n)
        write(root / "chief" / f"ckpt-{n}.data-00000-of-00001", b"d" * n)
    write(root / "chief" / "ckpt-10.index", b"a name that only starts like ckpt-1")
    write(root / "chief" / "notes.txt", b"the user's")
    # TF's files while a save is under way: a bundle being written, a sharded save's staging
    # dir, an index being replaced.
    write(root / "chief" / "ckpt-4.data-00000-of-00001.tempstate8812730414352", b"partial")
    write(root / "chief" / "ckpt-4_temp" / "part-00000-of-00001.index", b"partial")
    write(root / "chief" / f"checkpoint.tmp{'ab' * 16}", b"partial")
    write(root / "chief" / "my_temp.txt", b"a user's file that only looks temporary")

    every = [f["path"] for f in listing(str(root))["files"]]
    assert every == ["chief/checkpoint", *[f"chief/ckpt-{n}.{kind}" for n in (1,)
                                           for kind in ("data-00000-of-00001", "index")],
                     "chief/ckpt-10.index",
                     *[f"chief/ckpt-{n}.{kind}" for n in (2, 3)
                       for kind in ("data-00000-of-00001", "index")],
                     "chief/my_temp.txt", "chief/notes.txt"]
    proc = subprocess.run([sys.executable, "-m", "worker.transfer", "list", "--newest", str(root)],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=30, check=True)
    newest = json.loads(proc.stdout)
    assert [f["path"] for f in newest["files"]] == [
        "chief/checkpoint", "chief/ckpt-10.index", "chief/ckpt-3.data-00000-of-00001",
        "chief/ckpt-3.index", "chief/my_temp.txt", "chief/notes.txt"]
    assert newest["bytes"] == sum(f["size"] for f in newest["files"])
    # An index without a current checkpoint, or none at all: nothing is left out.
    write(root / "chief" / "checkpoint", b'all_model_checkpoint_paths: "ckpt-1"\n')
    assert len(listing(str(root), newest=True)["files"]) == len(every)


def test_needed_compares_size_and_mtime() -> None:
    source = [{"path": "a", "size": 1, "mtime_ns": 10}, {"path": "b", "size": 2, "mtime_ns": 20},
              {"path": "c", "size": 3, "mtime_ns": 30}, {"path": "d", "size": 4, "mtime_ns": 40}]
    present = [{"path": "a", "size": 1, "mtime_ns": 10}, {"path": "b", "size": 2, "mtime_ns": 21},
               {"path": "c", "size": 4, "mtime_ns": 30}, {"path": "old", "size": 9, "mtime_ns": 9}]
    assert needed(source, present) == ["b", "c", "d"]
    assert needed(source, source) == []
    assert needed(source, []) == ["a", "b", "c", "d"]
    assert needed([], present) == []


# -- copies ------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_chain_of_two_copies_everything(tmp_path: Path, procs: Procs) -> None:
    source = tmp_path / "chief-host" / "ckpt"
    checkpoint(source)
    dests = [tmp_path / "h1" / "ckpt", tmp_path / "h2" / "ckpt"]
    manifest = listing(str(source))["files"]

    (rc, sent), received = chain(procs, source, dests)

    total = sum(f["size"] for f in manifest)
    assert (rc, sent["ok"]) == (0, True), (sent, received)
    assert (sent["files"], sent["bytes"], sent["listed"], sent["checkpoint"]) == (5, total, 5, True)
    for dest, (rc, got) in zip(dests, received, strict=True):
        assert rc == 0, got
        assert got["ok"] is True and got["up_to_date"] is False
        assert (got["files"], got["received"], got["linked"], got["bytes"]) == (5, 5, 0, total)
        assert listing(str(dest))["files"] == manifest  # same paths, sizes and mtimes
        assert digests(dest) == digests(source)
        assert leftovers(dest.parent) == []


@pytest.mark.timeout(60)
def test_delta_sends_only_the_changed_file(tmp_path: Path, procs: Procs) -> None:
    source = tmp_path / "chief-host" / "ckpt"
    checkpoint(source, big=2 << 20)
    dests = [tmp_path / "h1" / "ckpt", tmp_path / "h2" / "ckpt"]
    for dest in dests:
        shutil.copytree(source, dest)  # copy2: same mtimes
        write(dest / "chief" / "ckpt-2.index", b"an older checkpoint")
    write(source / "checkpoint", b'model_checkpoint_path: "ckpt-4"\n', 1_700_000_100_000_000_000)
    manifest = listing(str(source))["files"]

    (rc, sent), received = chain(procs, source, dests)

    assert (rc, sent["files"], sent["bytes"]) == (0, 1, len(INDEX))
    for dest, (rc, got) in zip(dests, received, strict=True):
        assert rc == 0, got
        assert (got["files"], got["received"], got["linked"], got["bytes"]) == (5, 1, 4, len(INDEX))
        assert listing(str(dest))["files"] == manifest  # the older file and TF's junk are gone
        assert digests(dest) == digests(source)
        assert leftovers(dest.parent) == []


@pytest.mark.timeout(60)
def test_a_host_that_lacks_nothing_forwards_and_keeps_its_copy(tmp_path: Path, procs: Procs) -> None:
    """h1 is up to date, h2 has nothing: h1 passes the files on without touching its own."""
    source = tmp_path / "chief-host" / "ckpt"
    checkpoint(source, big=2 << 20)
    dests = [tmp_path / "h1" / "ckpt", tmp_path / "h2" / "ckpt"]
    shutil.copytree(source, dests[0])
    write(dests[0] / "chief" / "ckpt-2.index", b"an older checkpoint it keeps")
    before = listing(str(dests[0]))
    inode = (dests[0] / "chief" / "ckpt-3.data-00000-of-00001").stat().st_ino

    (rc, sent), [(rc1, h1), (rc2, h2)] = chain(procs, source, dests)

    manifest = listing(str(source))["files"]
    assert (rc, rc1, rc2) == (0, 0, 0), (sent, h1, h2)
    assert sent["files"] == 5
    assert (h1["up_to_date"], h1["received"], h1["bytes"]) == (True, 0, 0)
    assert h1["streamed"] == sent["bytes"]  # it forwarded every byte
    assert listing(str(dests[0])) == before
    assert (dests[0] / "chief" / "ckpt-3.data-00000-of-00001").stat().st_ino == inode
    assert (h2["up_to_date"], h2["received"]) == (False, 5)
    assert listing(str(dests[1]))["files"] == manifest and digests(dests[1]) == digests(source)


@pytest.mark.timeout(60)
def test_everyone_up_to_date_sends_nothing(tmp_path: Path, procs: Procs) -> None:
    source = tmp_path / "chief-host" / "ckpt"
    checkpoint(source, big=1 << 20)
    dests = [tmp_path / "h1" / "ckpt", tmp_path / "h2" / "ckpt"]
    for dest in dests:
        shutil.copytree(source, dest)

    (rc, sent), received = chain(procs, source, dests)

    assert (rc, sent["files"], sent["bytes"]) == (0, 0, 0)
    assert [(r[0], r[1]["up_to_date"], r[1]["streamed"]) for r in received] == [(0, True, 0)] * 2
    assert all(leftovers(d.parent) == [] for d in dests)


@pytest.mark.timeout(60)
def test_newest_sends_only_the_checkpoint_the_index_names(tmp_path: Path, procs: Procs) -> None:
    source = tmp_path / "src"
    write(source / "checkpoint", b'model_checkpoint_path: "ckpt-4"\n'
                                 b'all_model_checkpoint_paths: "ckpt-3"\n'
                                 b'all_model_checkpoint_paths: "ckpt-4"\n')
    for n in (3, 4):
        write(source / f"ckpt-{n}.index", b"i" * n)
        write(source / f"ckpt-{n}.data-00000-of-00001", os.urandom(1000 + n))
    dest = tmp_path / "h1" / "ckpt"

    (rc, sent), [(rc1, got)] = chain(procs, source, [dest], "--newest")

    assert (rc, rc1) == (0, 0), (sent, got)
    assert sorted(f["path"] for f in listing(str(dest))["files"]) == [
        "checkpoint", "ckpt-4.data-00000-of-00001", "ckpt-4.index"]
    assert (sent["files"], sent["listed"]) == (3, 3)


@pytest.mark.timeout(60)
def test_a_source_without_a_checkpoint_moves_the_hosts_stale_copies_aside(
        tmp_path: Path, procs: Procs) -> None:
    """A relaunch from step 0: a copy a host kept from before must not be restored."""
    source = tmp_path / "src"
    source.mkdir()
    dests = [tmp_path / "h1" / "ckpt", tmp_path / "h2" / "ckpt"]
    checkpoint(dests[0], big=1000)
    write(dests[1] / "notes.txt", b"no index here")

    (rc, sent), [(rc1, h1), (rc2, h2)] = chain(procs, source, dests)

    assert (rc, rc1, rc2, sent["checkpoint"], sent["files"]) == (0, 0, 0, False, 0), (sent, h1, h2)
    assert h1["cleared"].startswith(f"{dests[0]}.stale-") and not dests[0].exists()
    assert Path(h1["cleared"], "checkpoint").read_bytes() == INDEX
    assert (h2["cleared"], h2["up_to_date"]) == ("", False)
    assert (dests[1] / "notes.txt").read_bytes() == b"no index here"


@pytest.mark.timeout(60)
def test_wrong_token_is_ignored_and_the_real_sender_succeeds(tmp_path: Path, procs: Procs) -> None:
    source, dest = tmp_path / "src", tmp_path / "h1" / "ckpt"
    write(source / "checkpoint", INDEX)
    port = free_port()
    receiver = procs.receiver(dest, port)
    with _connect(port) as rogue:
        rogue.sendall(b"0" * 32 + b"\n" + b'{"manifest": [{"path": "a", "size": 4, "mtime_ns": 1}]}\nevil')
        assert rogue.recv(100) == b""  # closed on us, without an answer
    assert receiver.poll() is None  # still waiting for the real sender

    with _connect(port):  # a connection that never sends its token holds up nobody
        rc, sent = result(procs.sender(source, port))
    assert (rc, sent["ok"]) == (0, True)
    rc, got = result(receiver)
    assert (rc, got["ok"], got["received"], got["rejected"]) == (0, True, 1, 1)
    assert (dest / "checkpoint").read_bytes() == INDEX


def frames(path: str, data: bytes, digest: str, *, cut: int | None = None) -> bytes:
    """What a sender sends after the needs line: the send line, one file, the end."""
    header = json.dumps({"path": path, "size": len(data)}).encode() + b"\n"
    send = json.dumps({"send": ["a"]}).encode() + b"\n"
    if cut is not None:
        return send + header + data[:cut]
    return send + header + data + digest.encode() + b"\n" + b'{"end": true}\n'


A_NEW = {"path": "a", "size": 11, "mtime_ns": 1_700_000_000_000_000_000}


def indexed(*dests: Path) -> dict[str, Any]:
    """The same index in every one of ``dests``: its manifest entry (a manifest without an
    index has no checkpoint, and nobody lacks anything of it)."""
    for dest in dests:
        write(dest / "checkpoint", INDEX, 1_700_000_000_000_000_000)
    return {"path": "checkpoint", "size": len(INDEX), "mtime_ns": 1_700_000_000_000_000_000}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("stream", "error"), [
    (frames("a", b"new payload", "0" * 64), "checksum mismatch for a (CRC-32)"),
    (frames("a", b"new payload", "", cut=4), "short stream"),
    (frames("b", b"new payload", "0" * 64), "expected a next"),
], ids=["bad-digest", "short", "wrong-path"])
def test_a_bad_stream_leaves_the_destination_untouched(
        tmp_path: Path, procs: Procs, stream: bytes, error: str) -> None:
    dest = tmp_path / "h1" / "ckpt"
    write(dest / "a", b"old payload")
    write(dest / "checkpoint", INDEX)
    before = listing(str(dest))
    manifest = [A_NEW, next(f for f in before["files"] if f["path"] == "checkpoint")]
    receiver = procs.receiver(dest, free_port())
    sock, lines, needs = upstream(int(receiver.args[receiver.args.index("--port") + 1]), manifest)
    with sock:
        assert needs == ["a"]
        sock.sendall(stream)
        if b'"end"' not in stream:
            sock.shutdown(socket.SHUT_WR)
        ack = json.loads(lines.readline())
    rc, got = result(receiver)
    assert rc == 1
    assert got["ok"] is False and error in got["error"]
    assert ack["ok"] is False and error in ack["error"]
    assert listing(str(dest)) == before
    assert (dest / "a").read_bytes() == b"old payload"
    assert leftovers(dest.parent) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("manifest", "error"), [
    ([{"path": "../outside", "size": 1, "mtime_ns": 1}], "unsafe path '../outside'"),
    ([{"path": "/etc/passwd", "size": 1, "mtime_ns": 1}], "unsafe path '/etc/passwd'"),
    ([A_NEW, A_NEW], "duplicate paths in the manifest"),
    ([{"path": "a", "size": "11", "mtime_ns": 1}], "the manifest must be a list"),
    ("not a list", "the manifest must be a list"),
], ids=["dotdot", "absolute", "duplicate", "size-type", "not-a-list"])
def test_a_hostile_manifest_is_refused_before_anything_is_written(
        tmp_path: Path, procs: Procs, manifest: Any, error: str) -> None:
    dest = tmp_path / "h1" / "ckpt"
    write(dest / "a", b"old payload")
    before = listing(str(dest))
    port = free_port()
    receiver = procs.receiver(dest, port)
    with _connect(port) as sock:
        sock.sendall(TOKEN.encode() + b"\n" + json.dumps({"manifest": manifest}).encode() + b"\n")
        lines = sock.makefile("rb")
        assert lines.readline().strip() == receiver_proof(TOKEN)
        answer = json.loads(lines.readline())
    assert answer["ok"] is False and error in answer["error"], answer
    rc, got = result(receiver)
    assert rc == 1 and error in got["error"]
    assert listing(str(dest)) == before and leftovers(tmp_path / "h1") == []
    assert not (tmp_path / "outside").exists()


@pytest.mark.timeout(60)
def test_a_failure_down_the_chain_names_its_host(tmp_path: Path, procs: Procs) -> None:
    source = tmp_path / "src"
    write(source / "checkpoint", INDEX)
    write(source / "a", os.urandom(3 << 20))
    dests = [tmp_path / "h1" / "ckpt", tmp_path / "h2" / "ckpt"]
    write(dests[0] / "a", b"stale")
    write(tmp_path / "h2", b"a file where h2's parent directory should be")
    ports = [free_port(), free_port()]
    tail = procs.receiver(dests[1], ports[1])
    head = procs.receiver(dests[0], ports[0], "--forward", f"127.0.0.1:{ports[1]}")

    rc, sent = result(procs.sender(source, ports[0]))

    assert rc == 1
    assert sent["error"].startswith(f"127.0.0.1:{ports[1]}: "), sent
    rc_tail, got_tail = result(tail)
    assert rc_tail == 1 and sent["error"].endswith(got_tail["error"])
    rc, got = result(head)
    assert (rc, got["error"]) == (1, sent["error"])
    assert (dests[0] / "a").read_bytes() == b"stale"
    assert leftovers(dests[0].parent) == []


@pytest.mark.timeout(60)
def test_the_last_host_checks_the_digest_for_the_hosts_before_it(tmp_path: Path,
                                                                 procs: Procs) -> None:
    """A host in the middle does not hash (it writes what it forwards); a bad digest is caught
    by the last host, and the host in the middle, which swaps in only after the last one's
    ack, keeps its old copy too."""
    dests = [tmp_path / "h1" / "ckpt", tmp_path / "h2" / "ckpt"]
    for dest in dests:
        write(dest / "a", b"old payload")
    ports = [free_port(), free_port()]
    tail = procs.receiver(dests[1], ports[1])
    head = procs.receiver(dests[0], ports[0], "--forward", f"127.0.0.1:{ports[1]}")
    sock, lines, needs = upstream(ports[0], [A_NEW, indexed(*dests)])
    with sock:
        assert needs == ["a"]  # the union: both lack it
        sock.sendall(frames("a", b"new payload", "0" * 64))
        ack = json.loads(lines.readline())

    assert ack["ok"] is False and ack["error"] == f"127.0.0.1:{ports[1]}: checksum mismatch for a (CRC-32)"
    assert result(tail)[1]["error"] == "checksum mismatch for a (CRC-32)"
    assert result(head)[0] == 1
    for dest in dests:
        assert (dest / "a").read_bytes() == b"old payload"
        assert leftovers(dest.parent) == []


@pytest.mark.timeout(60)
def test_each_piece_removes_its_pid_file_as_it_exits(tmp_path: Path, procs: Procs) -> None:
    source, dest = tmp_path / "src", tmp_path / "h1" / "ckpt"
    write(source / "a", b"payload")
    port = free_port()
    pid_file = tmp_path / "receiver.pid"
    receiver = procs.receiver(dest, port, "--pid-file", str(pid_file))
    pid_file.write_text(f"{receiver.pid}\n")  # as the controller's shell writes it, before exec
    other = tmp_path / "someone-else.pid"
    other.write_text("1\n")
    sender = procs.sender(source, port, "--pid-file", str(other))

    assert result(sender)[0] == 0 and result(receiver)[0] == 0
    assert not pid_file.exists()
    assert other.read_text() == "1\n"  # not its own pid: left alone


# -- failing fast ------------------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_a_taken_port_exits_75_at_once(tmp_path: Path, procs: Procs) -> None:
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        receiver = procs.start("receive", "--dest", str(tmp_path / "ckpt"), "--port", str(port),
                               stdin={"token": TOKEN})
        rc, got = result(receiver)
    assert time.monotonic() - started < 10
    assert rc == 75
    assert got["ok"] is False and got["error"].startswith(f"port {port} is taken: ")
    assert leftovers(tmp_path) == []


@pytest.mark.timeout(30)
def test_a_sender_with_nobody_listening_fails_clearly(tmp_path: Path, procs: Procs) -> None:
    write(tmp_path / "src" / "a", b"x")
    port = free_port()
    started = time.monotonic()
    rc, got = result(procs.sender(tmp_path / "src", port, timeout=1))
    assert time.monotonic() - started < 10
    assert rc == 1
    assert got["ok"] is False and got["error"].startswith(f"could not connect to 127.0.0.1:{port} within 1 s")


@pytest.mark.timeout(30)
def test_a_receiver_nobody_connects_to_gives_up_at_its_timeout(tmp_path: Path, procs: Procs) -> None:
    dest = tmp_path / "ckpt"
    write(dest / "a", b"old")
    started = time.monotonic()
    rc, got = result(procs.receiver(dest, free_port(), timeout=1))
    assert time.monotonic() - started < 10
    assert rc == 1
    assert got["error"].startswith("timed out after 1 s waiting for the upstream sender")
    assert (dest / "a").read_bytes() == b"old"
    assert leftovers(tmp_path) == []


@pytest.mark.timeout(30)
def test_a_sender_that_leaves_out_a_needed_file_fails_both_ends(tmp_path: Path, procs: Procs) -> None:
    dest = tmp_path / "h1" / "ckpt"
    write(dest / "a", b"old")
    receiver = procs.receiver(dest, free_port())
    sock, lines, needs = upstream(int(receiver.args[receiver.args.index("--port") + 1]),
                                  [A_NEW, indexed(dest)])
    with sock:
        assert needs == ["a"]
        sock.sendall(b'{"send": []}\n{"end": true}\n')
        ack = json.loads(lines.readline())
    assert ack["ok"] is False and "the sender leaves out ['a']" in ack["error"]
    rc, got = result(receiver)
    assert rc == 1 and "the sender leaves out ['a']" in got["error"]
    assert (dest / "a").read_bytes() == b"old"
    assert leftovers(dest.parent) == []


@pytest.mark.timeout(30)
def test_install_swaps_a_staging_dir_in(tmp_path: Path) -> None:
    dest, staging = tmp_path / "ckpt", tmp_path / ".orchestrate-upload-1"
    write(dest / "old", b"old")
    write(staging / "new", b"new")
    with subprocess.Popen([sys.executable, "-m", "worker.transfer", "install", "--dest", str(dest)], cwd=REPO,
                          env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps({"staging": str(staging)}) + "\n")
        proc.stdin.flush()  # and left open, as an SSH channel may leave it
        line = proc.stdout.readline()
        proc.stdin.close()
        rc, got = proc.wait(), json.loads(line)
    assert (rc, got) == (0, {"ok": True})
    assert [f["path"] for f in listing(str(dest))["files"]] == ["new"]
    assert leftovers(tmp_path) == []


def _connect(port: int) -> socket.socket:
    """A test's own upstream connection, once the receiver listens."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=10)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_a_receive_removes_what_an_earlier_killed_receive_left(tmp_path: Path) -> None:
    dest = tmp_path / "ckpt"
    dest.mkdir()
    stale = [tmp_path / ".orchestrate-incoming-ckpt-0123456789ab",
             tmp_path / ".orchestrate-old-ckpt-ba9876543210"]
    other = tmp_path / ".orchestrate-incoming-another-0123456789ab"  # another directory's
    for path in [*stale, other]:
        path.mkdir()
        (path / "big").write_bytes(b"x" * 1000)
    assert sorted(remove_leftovers(str(dest))) == sorted(p.name for p in stale)
    assert not any(p.exists() for p in stale) and other.exists() and dest.exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("answer", [b"", b"0" * 64 + b"\n"], ids=["silent", "wrong-proof"])
def test_a_port_squatter_gets_nothing_but_the_token(tmp_path: Path, procs: Procs,
                                                    answer: bytes) -> None:
    """A process that took the receiver's port cannot prove it holds the token: the sender
    stops before any file byte leaves."""
    source = tmp_path / "src"
    write(source / "a", b"secret weights")
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        sender = procs.sender(source, squatter.getsockname()[1])
        conn, _ = squatter.accept()
        with conn:
            conn.settimeout(30)
            got = conn.recv(4096)
            if answer:
                conn.sendall(answer)
            rc, sent = result(sender)
            conn.settimeout(1)
            rest = b""
            with contextlib.suppress(OSError):
                while chunk := conn.recv(4096):
                    rest += chunk
    assert rc == 1 and "not our receiver" in sent["error"], sent
    assert got + rest == TOKEN.encode() + b"\n"  # no header, no file bytes
