"""The per-cluster SSH key pair: the private half stays here, the public half goes to the VMs."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

PRIVATE_NAME = "id_ed25519"


@dataclass(frozen=True)
class KeyPair:
    private_path: Path
    public_line: str  # "ssh-ed25519 AAAA..."


def ensure_key_pair(directory: Path) -> KeyPair:
    """The key pair in ``directory`` (mode 0700), made on first use; the private key is 0600."""
    private = directory / PRIVATE_NAME
    public = directory / f"{PRIVATE_NAME}.pub"
    if not (private.is_file() and public.is_file()):
        directory.mkdir(parents=True, exist_ok=True)
        os.chmod(directory, 0o700)
        key = ed25519.Ed25519PrivateKey.generate()
        _write(public, _public_line(key) + "\n", 0o644)
        _write(private, key.private_bytes(serialization.Encoding.PEM,
                                          serialization.PrivateFormat.OpenSSH,
                                          serialization.NoEncryption()).decode(), 0o600)
    return KeyPair(private, public.read_text().strip())


def remove_key_pair(directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)


def _public_line(key: ed25519.Ed25519PrivateKey) -> str:
    return key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                         serialization.PublicFormat.OpenSSH).decode()


def _write(path: Path, text: str, mode: int) -> None:
    """Atomically, and never readable by others while being written."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
