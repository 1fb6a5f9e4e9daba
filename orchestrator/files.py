"""Files this machine keeps for itself (keys, host caches, known_hosts): written whole, or not at all."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def write_atomic(path: str | os.PathLike[str], text: str, *, mode: int = 0o600) -> None:
    """Replace ``path`` with ``text``: a reader sees the old file or the new one, never a part.

    The file has ``mode`` from its first byte, so others never read a private file while it is
    written, and it reaches the disk (fsync) before it replaces the old one. The directory must
    exist.
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
