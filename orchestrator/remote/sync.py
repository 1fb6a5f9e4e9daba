"""Idempotent directory upload: a deterministic tar.gz, a sha256 stamp, and a swap into place;
and what an upload would hold (``survey``), secrets left out."""

from __future__ import annotations

import contextlib
import fnmatch
import gzip
import hashlib
import json
import os
import shlex
import shutil
import stat
import tarfile
import tempfile
import threading
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from orchestrator import paths
from orchestrator import spec as specs
from orchestrator.errors import RemoteError, SpecError
from orchestrator.files import write_atomic
from orchestrator.remote.base import Runner
from orchestrator.view import human_bytes

STAMP = ".orchestrate-sync"
ALWAYS_EXCLUDED = (".git", "__pycache__", "*.pyc", ".venv", STAMP)
# Keys, credentials and this machine's own state: never uploaded unless named in
# ``allowed_secrets`` (``provider.sync_secrets``).
# A pattern with a slash matches the last components of a path (``.config/gcloud`` at any depth);
# one without matches any file or directory name.
SECRET_EXCLUDES = (
    ".ssh", ".orchestrate", ".aws", ".azure", ".gnupg", ".kube", "kubeconfig*", "*.kubeconfig",
    ".docker/config.json",
    ".config/gcloud", ".config/gh", ".netrc", ".git-credentials", ".pypirc", ".npmrc",
    ".vault-token", ".boto", ".env", ".env.*", ".envrc", "*.pem", "*.key", "*.p12", "*.pfx",
    "id_rsa*", "id_dsa*", "id_ecdsa*", "id_ed25519*", "credentials.json",
    "application_default_credentials.json", "service-account*.json",
)
DIGESTS_KEPT = 32  # trees a ``Packer``'s digests file remembers, the newest kept
MAX_UPLOAD_BYTES = 2 << 30  # an upload larger than this is refused: data belongs elsewhere
LARGEST_SHOWN = 5  # top-level entries ``survey`` names, largest first
SECRETS_SHOWN = 20  # secret paths ``survey`` names (the count covers every one)
FIXED_MTIME = 946684800  # 2000-01-01T00:00:00Z: the same tree always packs to the same bytes


@dataclass(frozen=True)
class Upload:
    """What uploading a directory sends (``survey``): files, bytes, the largest top-level
    entries, and the secret paths left out. ``complete`` is False when the count stopped at
    the size limit (the real total is larger still)."""

    local_dir: str
    files: int
    bytes: int
    largest: tuple[tuple[str, int], ...]
    secrets_left_out: tuple[str, ...]
    secrets_count: int
    complete: bool = True
    limit: int | None = MAX_UPLOAD_BYTES
    allowed_secrets: tuple[str, ...] = ()  # secret paths uploaded anyway, as asked
    broad: str | None = None  # why the directory is refused whole (``broad_workdir``); not walked

    def refusal(self) -> str | None:
        """Why ``up`` refuses this upload, and what to do; None when it does not."""
        if self.broad:
            return (f"workdir is {self.broad}: point it at the training code, or set "
                    "provider.allow_home_workdir: true")
        if not self.complete and self.limit is not None:
            return (f"over the {human_bytes(self.limit)} limit: leave data out with "
                    "provider.sync_excludes")
        return None

    def to_dict(self) -> dict[str, Any]:
        return {"dir": self.local_dir, "files": self.files, "bytes": self.bytes,
                "complete": self.complete, "refused": self.refusal(),
                "largest": [{"path": p, "bytes": b} for p, b in self.largest],
                "secrets_left_out": list(self.secrets_left_out),
                "secrets_left_out_count": self.secrets_count}

    def check(self, spec_path: str | Path) -> None:
        """Raise what ``up`` refuses this upload for.

        Raises:
            SpecError: the workdir is ``/`` or a home directory (``broad_workdir``).
            RemoteError: it is over the size limit (``too_large``).
        """
        if self.broad:
            raise SpecError(
                f"{self.local_dir} is {self.broad}: 'up' would copy all of it to every host",
                file=str(spec_path), field="workdir",
                fix="point workdir at the directory that holds the training code, or set "
                "provider.allow_home_workdir: true to upload it anyway (keys and credentials, "
                "SECRET_EXCLUDES, are still left out)")
        if not self.complete and self.limit is not None:
            raise too_large(self.local_dir, self.bytes, self.limit, complete=False,
                            largest=self.largest)


def upload_of(workdir: Path, config: specs.SSHHosts) -> Upload:
    """What ``up`` sends of ``workdir`` to each host of a provider section, as ``plan`` shows
    it and ``up`` checks it.

    ``provider.sync_secrets`` (patterns of secret paths to upload anyway) and
    ``provider.allow_home_workdir`` are read only where the spec has them (issue 15).
    """
    allowed = tuple(getattr(config, "sync_secrets", ()))
    try:
        home: Path | None = Path.home().resolve()
    except (RuntimeError, KeyError, OSError):
        home = None
    broad = broad_workdir(workdir, home)
    if broad and not getattr(config, "allow_home_workdir", False):
        return Upload(str(workdir), 0, 0, (), (), 0, complete=False, broad=broad)
    return survey(str(workdir), config.sync_excludes, allowed_secrets=allowed)


def sync_dir(runner: Runner, local_dir: str, remote_dir: str, excludes: Sequence[str], *,
             allowed_secrets: Sequence[str] = (),
             max_bytes: int | None = MAX_UPLOAD_BYTES, packer: Packer | None = None,
             stamp: str | None = None) -> bool:
    """Make ``remote_dir`` on the host hold exactly the tree under ``local_dir``.

    ``remote_dir`` is owned by the sync: anything else in it is replaced. It is
    absolute or relative to the login directory of the runner's user; the directories it makes
    there are private to that user (umask 077).

    Args:
        excludes: glob patterns, matched against each relative path and each of
            its components; ``.git``, ``__pycache__``, ``*.pyc`` and ``.venv``
            are always left out, and so are ``SECRET_EXCLUDES``.
        allowed_secrets: patterns (as ``excludes``) of secret paths to upload anyway.
        max_bytes: refuse a tree whose files add up to more (None: no limit).
        packer: the ``Packer`` of a sync to several hosts (each tree packed once for all of
            them); without one, the tree is packed for this host alone.
        stamp: the stamp of the host's tree, already read with others (``remote_stamps``: one
            command for several trees); without it, it is read here.

    Returns:
        False when the host already had this exact tree, True when it was uploaded.

    Raises:
        RemoteError: the tree is over ``max_bytes``, or the upload or the unpacking on the
            host failed.
    """
    target = remote_dir.rstrip("/")
    if not target:
        raise RemoteError(f"refusing to sync into {remote_dir!r}", host=runner.host_name)
    own = packer is None
    packs = packer or Packer()
    try:
        tree = packs.tree(local_dir, excludes, allowed_secrets=allowed_secrets,
                          max_bytes=max_bytes)
        found = remote_stamps(runner, [target])[0] if stamp is None else stamp
        if found == tree.digest():
            return False
        archive, digest = tree.archive()
        token = uuid.uuid4().hex[:12]
        remote_archive = f"{target}.sync-{token}.tar.gz"
        runner.put_file(archive, remote_archive)
    finally:
        if own:
            packs.close()
    runner.run(_swap_script(remote_archive, target, token, digest))
    return True


class Packer:
    """The archives of one sync to many hosts (``up``): each tree is packed once, by the
    first host that lacks it, and the others are sent the same file.

    With ``digests`` (a private JSON file of this machine's), a tree listed as it was when it
    was last packed (every path, kind, mode, size and nanosecond modification time the same:
    rsync's quick check) is known by that digest without being packed again, so a host that
    already holds it costs a walk of the local tree and one command; a tree is only packed
    for a host that lacks it. As with rsync, an edit that keeps a file's size and mtime is
    not seen: ``touch`` the file to send it.
    """

    def __init__(self, digests: Path | None = None) -> None:
        self.digests_file = digests
        self.packed = 0  # trees packed so far (a tree known by its listing is not)
        self._lock = threading.Lock()
        self._trees: dict[tuple[object, ...], _Tree] = {}
        self._scratch: str | None = None

    def tree(self, local_dir: str, excludes: Sequence[str], *,
             allowed_secrets: Sequence[str] = (),
             max_bytes: int | None = MAX_UPLOAD_BYTES) -> _Tree:
        """The tree under ``local_dir`` as ``sync_dir`` uploads it (listed once per packer).

        Raises:
            RemoteError: ``local_dir`` is not a directory or cannot be listed, or its files add
                up to over ``max_bytes``.
        """
        key = (local_dir, tuple(excludes), tuple(allowed_secrets), max_bytes)
        with self._lock:
            found = self._trees.get(key)
            if found is None:
                found = self._trees[key] = _Tree(self, *key)
        return found

    def close(self) -> None:
        """Remove the archives packed (a sync in progress must have finished)."""
        with self._lock:
            scratch, self._scratch = self._scratch, None
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)

    def _archive_path(self) -> str:
        with self._lock:
            if self._scratch is None:
                self._scratch = tempfile.mkdtemp(prefix="orchestrate-sync-")
            return os.path.join(self._scratch, f"tree-{uuid.uuid4().hex[:12]}.tar.gz")

    def _known(self, listing: str) -> str | None:
        return self._read_digests().get(listing) if self.digests_file is not None else None

    def _packed(self, listing: str, digest: str) -> None:
        """Count a tree packed, and remember its digest by its listing."""
        with self._lock:  # the hosts' threads of this packer; another process's write may be lost
            self.packed += 1
            if self.digests_file is None:
                return
            known = self._read_digests()
            known.pop(listing, None)
            known[listing] = digest
            kept = dict(list(known.items())[-DIGESTS_KEPT:])
            with contextlib.suppress(OSError):  # only a cache: the next sync packs again
                write_atomic(self.digests_file, json.dumps({"trees": kept}, indent=1) + "\n")

    def _read_digests(self) -> dict[str, str]:
        assert self.digests_file is not None
        try:
            trees = json.loads(self.digests_file.read_text(encoding="utf-8")).get("trees", {})
        except (OSError, ValueError, AttributeError):
            return {}
        return {k: v for k, v in trees.items() if isinstance(k, str) and isinstance(v, str)} \
            if isinstance(trees, dict) else {}


class _Tree:
    """One tree of a ``Packer``: its listing (taken once), its digest, its archive (made once)."""

    def __init__(self, packer: Packer, local_dir: str, excludes: tuple[str, ...],
                 allowed: tuple[str, ...], max_bytes: int | None) -> None:
        self.packer = packer
        self.local_dir = local_dir
        self.excludes = excludes
        self.allowed = allowed
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._listing = _listing(local_dir, _patterns(excludes), allowed, max_bytes)
        self._known = packer._known(self._listing)
        self._packed: tuple[str, str] | None = None

    def digest(self) -> str:
        """The archive's sha256: known from an earlier packing of the same listing, or packed."""
        return self._known if self._known is not None else self.archive()[1]

    def archive(self) -> tuple[str, str]:
        """The archive's path and sha256, packed by the first caller; the others wait for it."""
        with self._lock:
            if self._packed is None:
                path = self.packer._archive_path()
                digest = pack_dir(self.local_dir, path, self.excludes, allowed_secrets=self.allowed,
                                  max_bytes=self.max_bytes)
                self._packed = (path, digest)
                self.packer._packed(self._listing, digest)
            return self._packed


def _listing(local_dir: str, patterns: tuple[str, ...], allowed: tuple[str, ...],
             max_bytes: int | None) -> str:
    """A digest of what an upload of ``local_dir`` holds, from the file system's metadata alone
    (path, kind, mode, size, nanosecond mtime, a link's target): the quick check's key.

    Raises:
        RemoteError: as ``pack_dir``, for a missing or unreadable directory and a tree over
            ``max_bytes``.
    """
    root = _directory(local_dir)
    digest = hashlib.sha256(json.dumps([str(root.resolve()), patterns, allowed]).encode())
    total = 0
    for rel in _walk(root, PurePosixPath(), patterns, allowed, []):
        path = root / rel
        try:
            st = path.lstat()
            link = os.readlink(path) if stat.S_ISLNK(st.st_mode) else ""
        except OSError as exc:
            raise _unreadable(path, exc) from None
        size = st.st_size if stat.S_ISREG(st.st_mode) else 0
        total += size
        if max_bytes is not None and total > max_bytes:
            raise too_large(local_dir, total, max_bytes, complete=False)
        digest.update(json.dumps([rel.as_posix(), st.st_mode, size, st.st_mtime_ns, link])
                      .encode() + b"\n")
    return digest.hexdigest()


def pack_dir(local_dir: str, archive_path: str, excludes: Sequence[str], *,
             allowed_secrets: Sequence[str] = (), max_bytes: int | None = None) -> str:
    """Write a deterministic tar.gz of ``local_dir`` to ``archive_path``; return its sha256.

    Raises:
        RemoteError: ``local_dir`` is not a directory, or its files add up to over ``max_bytes``.
    """
    root = _directory(local_dir)
    patterns = _patterns(excludes)
    total = 0
    with (
        open(archive_path, "wb") as raw,
        gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.GNU_FORMAT) as tar,
    ):
        for rel in _walk(root, PurePosixPath(), patterns, tuple(allowed_secrets), []):
            try:
                total += _add(tar, root, rel)
            except OSError as exc:
                raise _unreadable(root / rel, exc) from None
            if max_bytes is not None and total > max_bytes:
                raise too_large(local_dir, total, max_bytes, complete=False)
    return _sha256(archive_path)


def survey(local_dir: str, excludes: Sequence[str], *, allowed_secrets: Sequence[str] = (),
           max_bytes: int | None = MAX_UPLOAD_BYTES) -> Upload:
    """What ``sync_dir`` would upload of ``local_dir``, without reading a file: it stops
    counting once over ``max_bytes``, so a huge tree (a workdir of ``/``) is not walked whole.

    Raises:
        RemoteError: ``local_dir`` is not a directory.
    """
    root = _directory(local_dir)
    left_out: list[str] = []
    sizes: dict[str, int] = {}
    files = total = 0
    complete = True
    allowed = tuple(allowed_secrets)
    for rel in _walk(root, PurePosixPath(), _patterns(excludes), allowed, left_out):
        size = _size(root / rel)
        files += (root / rel).is_symlink() or not (root / rel).is_dir()
        total += size
        sizes[rel.parts[0]] = sizes.get(rel.parts[0], 0) + size
        if max_bytes is not None and total > max_bytes:
            complete = False
            break
    largest = sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0]))[:LARGEST_SHOWN]
    return Upload(str(root), files, total, tuple(largest), tuple(left_out[:SECRETS_SHOWN]),
                  len(left_out), complete, max_bytes, tuple(allowed_secrets))


def files_of(local_dir: str, excludes: Sequence[str], *,
             max_bytes: int) -> dict[str, tuple[bytes, int]]:
    """The regular files an upload of ``local_dir`` holds (secrets left out, as ``survey``),
    read: relative path -> (bytes, mode). Links and empty directories are not carried.

    Raises:
        RemoteError: ``local_dir`` is not a directory, a file cannot be read, or the files
            are over ``max_bytes``.
    """
    root = _directory(local_dir)
    out: dict[str, tuple[bytes, int]] = {}
    total = 0
    for rel in _walk(root, PurePosixPath(), _patterns(excludes), (), []):
        path = root / rel
        try:
            st = path.lstat()
            if not stat.S_ISREG(st.st_mode):
                continue
            total += st.st_size
            if total > max_bytes:
                raise too_large(local_dir, total, max_bytes, complete=False)
            out[rel.as_posix()] = (path.read_bytes(), stat.S_IMODE(st.st_mode))
        except OSError as exc:
            raise _unreadable(path, exc) from None
    return out


def too_large(local_dir: str, size: int, max_bytes: int, *, complete: bool = True,
              largest: Sequence[tuple[str, int]] = ()) -> RemoteError:
    """The error of an upload over ``max_bytes``, naming its size and what to leave out."""
    top = ", ".join(f"{p} {human_bytes(b)}" for p, b in largest)
    return RemoteError(
        f"the upload of {local_dir} is {'' if complete else 'over '}{human_bytes(size)}, more than "
        f"the {human_bytes(max_bytes)} 'up' sends to each host" + (f" (largest: {top})" if top else ""),
        fix="leave data, checkpoints and environments out with provider.sync_excludes (e.g. "
        "['data', '*.ckpt']) and let the tasks read them from shared storage, or point workdir "
        "at the directory that holds only the training code")


def broad_workdir(workdir: Path, home: Path | None) -> str | None:
    """Why uploading ``workdir`` to every host is refused by default, or None: it is ``/``,
    the home directory ``home``, or one of its ancestors (all of a user's files and keys)."""
    if workdir == Path("/"):
        return "the file system's root"
    if home is None:
        return None
    if workdir == home:
        return f"your home directory {home}"
    if workdir in home.parents:
        return f"an ancestor of your home directory {home}"
    return None


def is_excluded(rel: PurePosixPath, patterns: Sequence[str]) -> bool:
    """True if ``rel`` or any of its components matches one of the glob ``patterns``."""
    text = rel.as_posix()
    return any(
        fnmatch.fnmatchcase(text, p) or any(fnmatch.fnmatchcase(part, p) for part in rel.parts)
        for p in patterns
    )


def is_secret(rel: PurePosixPath) -> bool:
    """True if ``rel`` ends with one of ``SECRET_EXCLUDES`` (its name, or its last components
    for a pattern with a slash)."""
    for pattern in SECRET_EXCLUDES:
        want = PurePosixPath(pattern).parts
        tail = rel.parts[-len(want):]
        if len(tail) == len(want) and all(map(fnmatch.fnmatchcase, tail, want)):
            return True
    return False


def _directory(local_dir: str) -> Path:
    root = Path(local_dir)
    if not root.is_dir():
        raise RemoteError(
            f"cannot sync {local_dir}: not a directory",
            fix="point the sync at the directory that holds the training code",
        )
    return root


def _unreadable(path: Path, exc: OSError) -> RemoteError:
    return RemoteError(f"cannot read {path} to upload it: {exc.strerror or exc}",
                       fix="make it readable, or leave it out with provider.sync_excludes")


def _patterns(excludes: Sequence[str]) -> tuple[str, ...]:
    return tuple(p.rstrip("/") for p in (*ALWAYS_EXCLUDED, *excludes))


def _walk(root: Path, rel: PurePosixPath, patterns: Sequence[str], allowed: Sequence[str],
          left_out: list[str], home: tuple[int, int] | None = None) -> Iterator[PurePosixPath]:
    """Every path to upload, parents first; the secret ones left out are added to ``left_out``.

    The orchestrate home (``ORCHESTRATE_HOME``, wherever it points: ``home`` is its device and
    inode, found once) is never uploaded, whatever ``allowed`` says: it holds the clusters'
    keys, and reading its live state store would drop this process's SQLite locks on it.

    Raises:
        RemoteError: a directory cannot be read.
    """
    if not rel.parts:
        home = _home_identity()
    try:
        with os.scandir(root / rel) as it:
            entries = sorted(it, key=lambda e: e.name)
    except OSError as exc:
        raise _unreadable(root / rel, exc) from None
    for entry in entries:
        child = rel / entry.name
        if is_excluded(child, patterns):
            continue
        is_dir = entry.is_dir(follow_symlinks=False)
        if (is_secret(child) and not is_excluded(child, allowed)) or (
                is_dir and home is not None and _identity(Path(entry.path)) == home):
            left_out.append(child.as_posix())
            continue
        yield child
        if is_dir:
            yield from _walk(root, child, patterns, allowed, left_out, home)


def _home_identity() -> tuple[int, int] | None:
    try:
        return _identity(paths.home())
    except (RuntimeError, KeyError):  # no home directory to know
        return None


def _identity(path: Path) -> tuple[int, int] | None:
    """A directory's device and inode (None when it is not there)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _size(path: Path) -> int:
    """The bytes a path adds to an upload: a regular file's size (a link's target is not sent)."""
    try:
        st = path.lstat()
    except FileNotFoundError:  # gone since it was listed
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) else 0


def _add(tar: tarfile.TarFile, root: Path, rel: PurePosixPath) -> int:
    """Add one path; return the bytes of file content added."""
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
        return info.size
    return 0


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def remote_stamps(runner: Runner, targets: Sequence[str], files: Sequence[str] = ()) -> list[str]:
    """In one command: the stamp of the tree each of ``targets`` holds, then the first line of
    each of ``files`` ("" for one that is missing or unreadable). First the directory that will
    hold each tree is made private (umask 077) if missing, so an archive lands in a directory of
    ours. ``up`` reads a host's two trees and its setup stamp so: one round trip, not three
    (on SSH hosts, in the same command as the root's claim: ``SSHHostsProvider.claim_root``).
    Where the directories cannot be made, every answer is "" (the upload then fails, saying
    why).
    """
    result = runner.run(stamps_script(targets, files), check=False)
    return read_stamps(result.stdout if result.ok else "", len(targets) + len(files))


def stamps_script(targets: Sequence[str], files: Sequence[str] = ()) -> str:
    """The shell of ``remote_stamps``: one line per stamp, or exit 1 with none printed where
    the trees' directories cannot be made."""
    targets = [t.rstrip("/") for t in targets]
    parents = " ".join(shlex.quote(os.path.dirname(t) or ".") for t in targets)
    reads = [*(f"{t}/{STAMP}" for t in targets), *files]
    # One line per file: a stamp is one line, and a hostile file's others are not read.
    return f"umask 077 && mkdir -p -- {parents} || exit 1; " + "".join(
        f"printf '%s\\n' \"$(head -n 1 -- {shlex.quote(f)} 2>/dev/null)\"; " for f in reads)


def read_stamps(stdout: str, count: int) -> list[str]:
    """The ``count`` stamps ``stamps_script`` printed; all "" where it printed fewer lines."""
    lines = stdout.split("\n")
    if len(lines) < count:
        return [""] * count
    return [line.strip() for line in lines[:count]]


def _swap_script(archive: str, target: str, token: str, digest: str) -> str:
    """Unpack into a fresh sibling, then swap it in: the host never sees a mixed tree."""
    new, old = (shlex.quote(f"{target}.sync-{token}.{s}") for s in ("new", "old"))
    arc, dst = shlex.quote(archive), shlex.quote(target)
    stamp = shlex.quote(f"{target}.sync-{token}.new/{STAMP}")
    cleanup = shlex.quote(f"rm -rf -- {new} {arc}")
    return (
        f"set -e; umask 077; trap {cleanup} EXIT; "
        f"rm -rf -- {new}; mkdir -p -- {new}; "
        f"tar -x -z -o -f {arc} -C {new}; "
        f"printf '%s\\n' {shlex.quote(digest)} > {stamp}; "
        f"if [ -e {dst} ] || [ -L {dst} ]; then mv -- {dst} {old}; fi; "
        f"mv -- {new} {dst}; rm -rf -- {old}"
    )
