"""A cluster's own SSH key pair: the private half stays on this machine, the public half goes to
the machines a provider makes."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from orchestrator.files import private_dir, write_atomic

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
        private_dir(directory)
        key = ed25519.Ed25519PrivateKey.generate()
        write_atomic(public, _public_line(key) + "\n", mode=0o644)
        write_atomic(private, key.private_bytes(serialization.Encoding.PEM,
                                                serialization.PrivateFormat.OpenSSH,
                                                serialization.NoEncryption()).decode())
    return KeyPair(private, public.read_text().strip())


def remove_key_pair(directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)


def _public_line(key: ed25519.Ed25519PrivateKey) -> str:
    return key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                         serialization.PublicFormat.OpenSSH).decode()
