"""Idempotent directory upload: a deterministic tar.gz, a sha256 stamp, and a swap into place."""

from __future__ import annotations

import fnmatch
import gzip
import hashlib
import os
import shlex
import tarfile
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path, PurePosixPath

from orchestrator.errors import RemoteError
from orchestrator.remote.base import Runner

STAMP = ".orchestrate-sync"
ALWAYS_EXCLUDED = (".git", "__pycache__", "*.pyc", ".venv", STAMP)
FIXED_MTIME = 946684800  # 2000-01-01T00:00:00Z: the same tree always packs to the same bytes


def sync_dir(runner: Runner, local_dir: str, remote_dir: str, excludes: Sequence[str]) -> bool:
    """Make ``remote_dir`` on the host hold exactly the tree under ``local_dir``.

    ``remote_dir`` is owned by the sync: anything else in it is replaced. It is
    absolute or relative to the login directory of the runner's user.

    Args:
        excludes: glob patterns, matched against each relative path and each of
            its components; ``.git``, ``__pycache__``, ``*.pyc`` and ``.venv``
            are always left out.

    Returns:
        False when the host already had this exact tree, True when it was uploaded.

    Raises:
        RemoteError: the upload or the unpacking on the host failed.
    """
    target = remote_dir.rstrip("/")
    if not target:
        raise RemoteError(f"refusing to sync into {remote_dir!r}", host=runner.host_name)
    with tempfile.TemporaryDirectory(prefix="orchestrate-sync-") as scratch:
        archive = os.path.join(scratch, "tree.tar.gz")
        digest = pack_dir(local_dir, archive, excludes)
        if _remote_stamp(runner, target) == digest:
            return False
        token = uuid.uuid4().hex[:12]
        remote_archive = f"{target}.sync-{token}.tar.gz"
        runner.put_file(archive, remote_archive)
    runner.run(_swap_script(remote_archive, target, token, digest))
    return True


def pack_dir(local_dir: str, archive_path: str, excludes: Sequence[str]) -> str:
    """Write a deterministic tar.gz of ``local_dir`` to ``archive_path``; return its sha256."""
    root = Path(local_dir)
    if not root.is_dir():
        raise RemoteError(
            f"cannot sync {local_dir}: not a directory",
            fix="point the sync at the directory that holds the training code",
        )
    patterns = tuple(p.rstrip("/") for p in (*ALWAYS_EXCLUDED, *excludes))
    with (
        open(archive_path, "wb") as raw,
        gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.GNU_FORMAT) as tar,
    ):
        for rel in _walk(root, PurePosixPath(), patterns):
            _add(tar, root, rel)
    return _sha256(archive_path)


def is_excluded(rel: PurePosixPath, patterns: Sequence[str]) -> bool:
    """True if ``rel`` or any of its components matches one of the glob ``patterns``."""
    text = rel.as_posix()
    return any(
        fnmatch.fnmatchcase(text, p) or any(fnmatch.fnmatchcase(part, p) for part in rel.parts)
        for p in patterns
    )


def _walk(root: Path, rel: PurePosixPath, patterns: Sequence[str]) -> Iterator[PurePosixPath]:
    with os.scandir(root / rel) as it:
        entries = sorted(it, key=lambda e: e.name)
    for entry in entries:
        child = rel / entry.name
        if is_excluded(child, patterns):
            continue
        yield child
        if entry.is_dir(follow_symlinks=False):
            yield from _walk(root, child, patterns)


def _add(tar: tarfile.TarFile, root: Path, rel: PurePosixPath) -> None:
    path = root / rel
    info = tarfile.TarInfo(rel.as_posix())
    info.mtime, info.uid, info.gid, info.uname, info.gname = FIXED_MTIME, 0, 0, "", ""
    if path.is_symlink():
        info.type, info.linkname, info.mode = tarfile.SYMTYPE, os.readlink(path), 0o777
        tar.addfile(info)
    elif path.is_dir():
        info.type, info.mode = tarfile.DIRTYPE, 0o755
        tar.addfile(info)
    elif path.is_file():
        info.size = path.stat().st_size
        info.mode = 0o755 if os.access(path, os.X_OK) else 0o644
        with open(path, "rb") as f:
            tar.addfile(info, f)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _remote_stamp(runner: Runner, target: str) -> str:
    result = runner.run(["cat", f"{target}/{STAMP}"], check=False)
    return result.stdout.strip() if result.ok else ""


def _swap_script(archive: str, target: str, token: str, digest: str) -> str:
    """Unpack into a fresh sibling, then swap it in: the host never sees a mixed tree."""
    new, old = (shlex.quote(f"{target}.sync-{token}.{s}") for s in ("new", "old"))
    arc, dst = shlex.quote(archive), shlex.quote(target)
    stamp = shlex.quote(f"{target}.sync-{token}.new/{STAMP}")
    cleanup = shlex.quote(f"rm -rf -- {new} {arc}")
    return (
        f"set -e; trap {cleanup} EXIT; "
        f"rm -rf -- {new}; mkdir -p -- {new}; "
        f"tar -x -z -o -f {arc} -C {new}; "
        f"printf '%s\\n' {shlex.quote(digest)} > {stamp}; "
        f"if [ -e {dst} ] || [ -L {dst} ]; then mv -- {dst} {old}; fi; "
        f"mv -- {new} {dst}; rm -rf -- {old}"
    )
