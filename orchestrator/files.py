"""Files this machine keeps for itself (keys, host caches, known_hosts, the state store): private
whatever the umask, and written whole, or not at all."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from pathlib import Path

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600


def write_atomic(path: str | os.PathLike[str], text: str, *, mode: int = PRIVATE_FILE) -> None:
    """Replace ``path`` with ``text``: a reader sees the old file or the new one, never a part.

    The file has ``mode`` from its first byte (``mkstemp`` creates it 0600, whatever the umask),
    so others never read a private file while it is written, and it reaches the disk (fsync)
    before it replaces the old one. The directory must exist.
    """
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    sync_dir_entry(target.parent)


def sync_dir_entry(directory: Path) -> None:
    """fsync ``directory``, so that a file just renamed into it survives a power loss."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def private_dir(path: Path) -> Path:
    """``path`` as a directory only its owner may enter (0700), made (with the parents it lacks,
    0700 too) if missing.

    An existing one of ours that others may enter is closed to them: it holds keys and state.

    Raises:
        OSError: it cannot be made (a file is in the way, no permission).
    """
    for missing in reversed([p for p in (path, *path.parents) if not p.exists()]):
        with contextlib.suppress(FileExistsError):  # made meanwhile by another process
            missing.mkdir(mode=PRIVATE_DIR)
            os.chmod(missing, PRIVATE_DIR)  # whatever the umask
    if not path.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path))
    private(path, PRIVATE_DIR)
    return path


def private(path: Path, mode: int = PRIVATE_FILE) -> None:
    """Take away others' access to ``path`` if it exists, is ours and they have some."""
    with contextlib.suppress(OSError):
        st = path.lstat()
        if (st.st_uid == os.geteuid() and not stat.S_ISLNK(st.st_mode)
                and stat.S_IMODE(st.st_mode) & 0o077):
            os.chmod(path, mode)
