"""Key and known_hosts files that are not what they should be, through `orchestrate up` on a
static cluster as a user runs it: one clear error naming the file and the fix, never a
traceback, never a hang on a FIFO, never a read of /dev/zero until memory runs out.

The host is a plain TCP listener that accepts and says nothing: the private key is read before
any connection, and known_hosts once the connection is made and before the SSH handshake, so
no case here gets further than that."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import dsa, ed448
from helpers import REPO, silent_listener

NO_ENCRYPTION = serialization.NoEncryption()


@pytest.fixture
def listener() -> Iterator[int]:
    """A TCP port that accepts connections and never answers them."""
    with silent_listener() as port:
        yield port


def keygen(path: Path, *args: str) -> Path:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-f", str(path), *args], check=True,
                   capture_output=True)
    return path


def fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def pem(key: dsa.DSAPrivateKey | ed448.Ed448PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             NO_ENCRYPTION)


def written(data: bytes) -> Callable[[Path], Path]:
    def make(path: Path) -> Path:
        path.write_bytes(data)
        path.chmod(0o600)
        return path
    return make


# (id, make the key_file at the given path, what the error says about it, what the fix says)
KEY_FILES = [
    ("fifo", fifo, "not a regular file", "private key file"),
    ("dev-zero", lambda p: Path("/dev/zero"), "not a regular file", "private key file"),
    ("directory", lambda p: (p.mkdir(), p)[1], "is a directory", "private key file"),
    ("public-key", lambda p: keygen(p, "-N", "").with_suffix(".pub"), "is a public key",
     "set key_file to the private key: "),
    ("passphrase", lambda p: keygen(p, "-N", "secret words"), "protected by a passphrase",
     "ssh-keygen -p"),
    ("ed448", lambda p: written(pem(ed448.Ed448PrivateKey.generate()))(p),
     "key type paramiko does not use", "ssh-keygen -t ed25519"),
    ("dsa", lambda p: written(pem(dsa.generate_private_key(1024)))(p),
     "key type paramiko does not use", "ssh-keygen -t ed25519"),
    ("empty", written(b""), "not a private key paramiko can load", "ed25519"),
    ("garbage", written(b"\xff\xfe not a key \x00\x01"), "not a private key paramiko can load",
     "ed25519"),
    ("huge", written(b"A" * (2 << 20)), "larger than any such file", "private key file"),
    ("missing", lambda p: p, "does not exist", "key_file path"),
]

# (id, make the known_hosts file, what the error says)
KNOWN_HOSTS = [
    ("fifo", fifo, "not a regular file"),
    ("dev-zero", lambda p: Path("/dev/zero"), "not a regular file"),
    ("directory", lambda p: (p.mkdir(), p)[1], "is a directory"),
    ("latin-1", written(b"# h\xf4te\n"), "can't decode"),
    ("bad-key-data", written(b"127.0.0.1 ssh-ed25519 AAAA!!!notbase64\n"), "cannot read"),
    ("huge", written(b"#" * (17 << 20)), "larger than any such file"),
]


def up(tmp_path: Path, port: int, key_file: Path, known_hosts: Path | None = None,
       ) -> subprocess.CompletedProcess[str]:
    spec = tmp_path / "c.yaml"
    known = f"  known_hosts: {known_hosts}\n" if known_hosts else ""
    spec.write_text(
        "name: keys\nworkers: 1\njob: {command: 'true'}\n"
        "provider:\n  kind: static\n  connect_timeout_s: 2\n  wait_for_host_s: 0\n" + known +
        f"  hosts:\n    - {{address: 127.0.0.1, ssh_port: {port}, user: ml, "
        f"key_file: '{key_file}'}}\n")
    home = tmp_path / "home"
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", "up", str(spec)],
                          capture_output=True, text=True, timeout=60, cwd=REPO,
                          env={**os.environ, "ORCHESTRATE_HOME": str(home)})


@pytest.mark.parametrize(("make", "says", "fix"), [pytest.param(*case[1:], id=case[0])
                                                   for case in KEY_FILES])
def test_a_key_file_that_is_not_a_usable_private_key_is_named_with_the_fix(
        tmp_path: Path, listener: int, make: Callable[[Path], Path], says: str,
        fix: str) -> None:
    key = make(tmp_path / "id_test")
    done = up(tmp_path, listener, key)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr + done.stdout, done.stderr
    assert f"SSH key file {key} " in done.stderr and says in done.stderr, done.stderr
    assert "fix: " in done.stderr and fix in done.stderr, done.stderr


@pytest.mark.parametrize(("make", "says"), [pytest.param(*case[1:], id=case[0])
                                            for case in KNOWN_HOSTS])
def test_a_known_hosts_file_that_cannot_be_read_is_named_with_the_fix(
        tmp_path: Path, listener: int, make: Callable[[Path], Path], says: str) -> None:
    known = make(tmp_path / "known_hosts")
    done = up(tmp_path, listener, keygen(tmp_path / "id_ok", "-N", ""), known)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr + done.stdout, done.stderr
    assert f"cannot read known_hosts file {known}" in done.stderr, done.stderr
    assert says in done.stderr, done.stderr
    assert "fix: " in done.stderr and "host_key" in done.stderr, done.stderr
