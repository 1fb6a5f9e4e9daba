"""sync_dir: deterministic archives, excludes, idempotent uploads over SSH and locally."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from hostlab import HostLab, LabHost

from orchestrator.remote.local import LocalRunner
from orchestrator.remote.ssh import SSHRunner
from orchestrator.remote.sync import STAMP, Packer, pack_dir, survey, sync_dir
from orchestrator.state import Store

EXCLUDES = ("*.bin", "secrets", "data/raw")


def make_tree(root: Path) -> Path:
    files = {
        "train.py": "print('train')\n",
        "pkg/__init__.py": "",
        "pkg/model.py": "W = 1\n",
        "pkg/__pycache__/model.cpython-311.pyc": "junk",
        "pkg/old.pyc": "junk",
        ".git/HEAD": "ref: refs/heads/main\n",
        ".venv/bin/python": "",
        "data/keep.txt": "keep\n",
        "data/raw/big.csv": "1,2\n",
        "weights.bin": "\0\1",
        "conf/secrets/token": "hunter2\n",
        "run.sh": "#!/bin/sh\necho run\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    os.chmod(root / "run.sh", 0o755)
    os.symlink("train.py", root / "link.py")
    return root


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    return make_tree(tmp_path / "project")


def test_same_tree_packs_to_the_same_bytes(tree: Path, tmp_path: Path) -> None:
    first = pack_dir(str(tree), str(tmp_path / "a.tar.gz"), EXCLUDES)
    os.utime(tree / "train.py", (1, 1))
    second = pack_dir(str(tree), str(tmp_path / "b.tar.gz"), EXCLUDES)
    assert first == second
    assert (tmp_path / "a.tar.gz").read_bytes() == (tmp_path / "b.tar.gz").read_bytes()
    (tree / "train.py").write_text("print('changed')\n")
    assert pack_dir(str(tree), str(tmp_path / "c.tar.gz"), EXCLUDES) != first


def test_archive_leaves_out_excluded_paths(tree: Path, tmp_path: Path) -> None:
    pack_dir(str(tree), str(tmp_path / "a.tar.gz"), EXCLUDES)
    with tarfile.open(tmp_path / "a.tar.gz") as tar:
        names = set(tar.getnames())
        members = {m.name: m for m in tar.getmembers()}
    assert names == {
        "conf",
        "data",
        "data/keep.txt",
        "link.py",
        "pkg",
        "pkg/__init__.py",
        "pkg/model.py",
        "run.sh",
        "train.py",
    }
    assert members["run.sh"].mode == 0o755 and members["train.py"].mode == 0o644
    assert members["link.py"].issym() and members["link.py"].linkname == "train.py"
    assert {m.uid for m in members.values()} == {0}


def test_an_orchestrate_home_inside_the_workdir_is_never_uploaded(
        tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ORCHESTRATE_HOME under the workdir (any name, even with every secret allowed): its keys
    stay here, and its live store is not read, which would drop this process's SQLite locks
    on it. Found as a disk I/O error (SQLITE_IOERR_SHORT_READ): another process, taking itself
    for the store's last user, checkpointed and removed the write-ahead log under ours."""
    home = tree / "state-here"
    monkeypatch.setenv("ORCHESTRATE_HOME", str(home))
    store = Store()
    store.put_cluster("first", provider="local", spec_path="a.yaml", status="up")
    (home / "clusters" / "first").mkdir(parents=True)
    (home / "clusters" / "first" / "id_key").write_text("PRIVATE\n")

    pack_dir(str(tree), str(tmp_path / "a.tar.gz"), EXCLUDES, allowed_secrets=("*",))
    with tarfile.open(tmp_path / "a.tar.gz") as tar:
        assert not [n for n in tar.getnames() if n.startswith("state-here")]
    assert "state-here" in survey(str(tree), EXCLUDES).secrets_left_out

    writes = ("from orchestrator.state import Store\n"
              "store = Store()\n"
              "for i in range(30):\n"
              "    store.put_cluster(f'c{i}', provider='local', spec_path='a.yaml', status='up')\n"
              "store.close()\n")
    subprocess.run([sys.executable, "-c", writes], check=True, timeout=60)
    assert len(store.clusters()) == 31
    store.put_cluster("last", provider="local", spec_path="a.yaml", status="up")
    assert len(Store().clusters()) == 32


def test_sync_with_local_runner_is_idempotent(tree: Path, tmp_path: Path) -> None:
    target = tmp_path / "remote" / "code"
    runner = LocalRunner()
    assert sync_dir(runner, str(tree), str(target), EXCLUDES) is True
    assert (target / "pkg" / "model.py").read_text() == "W = 1\n"
    assert sync_dir(runner, str(tree), str(target), EXCLUDES) is False
    assert sorted(p.name for p in target.parent.iterdir()) == ["code"]


def test_a_packer_packs_each_tree_once_for_every_host(tree: Path, tmp_path: Path) -> None:
    runner, packer = LocalRunner(), Packer()
    targets = [tmp_path / f"host{i}" / "code" for i in range(3)]
    try:
        assert [sync_dir(runner, str(tree), str(t), EXCLUDES, packer=packer)
                for t in targets] == [True, True, True]
        assert packer.packed == 1
        scratch = Path(packer._archive_path()).parent
    finally:
        packer.close()
    assert {(t / "pkg" / "model.py").read_text() for t in targets} == {"W = 1\n"}
    assert not scratch.exists()  # the archives are gone with the packer


def test_an_unchanged_tree_is_known_by_its_listing_and_not_packed_again(
        tree: Path, tmp_path: Path) -> None:
    digests, runner = tmp_path / "state" / "digests.json", LocalRunner()
    digests.parent.mkdir()
    first, second = tmp_path / "host0" / "code", tmp_path / "host1" / "code"

    def sync(target: Path) -> tuple[bool, int]:
        packer = Packer(digests)
        try:
            return sync_dir(runner, str(tree), str(target), EXCLUDES, packer=packer), packer.packed
        finally:
            packer.close()

    assert sync(first) == (True, 1)
    assert oct(digests.stat().st_mode & 0o777) == "0o600"
    assert "hunter2" not in digests.read_text() and "W = 1" not in digests.read_text()
    assert sync(first) == (False, 0)  # listed as when packed: the digest is known
    assert sync(second) == (True, 1)  # a host without it: packed, and sent

    model = tree / "pkg" / "model.py"
    before = model.stat().st_mtime_ns
    model.write_text("W = 2\n")  # the same size: seen by its modification time
    assert sync(first) == (True, 1)
    assert (first / "pkg" / "model.py").read_text() == "W = 2\n"

    model.write_text("W = 1\n")
    os.utime(model, ns=(before, before))  # listed as the first time: W = 1's digest is known,
    assert sync(first) == (True, 1)  # host0 holds W = 2's: packed, and sent
    assert (first / "pkg" / "model.py").read_text() == "W = 1\n"

    digests.write_text("{not json")  # a damaged file is only a cache: packed again
    assert sync(first) == (False, 1)


@pytest.fixture
def ssh_host(hostlab: HostLab) -> LabHost:
    return hostlab.hosts(1)[0]


@pytest.fixture
def ssh_runner(ssh_host: LabHost) -> Iterator[SSHRunner]:
    with SSHRunner(ssh_host.name, ssh_host.endpoint()) as runner:
        yield runner


def remote_exists(runner: SSHRunner, path: str) -> bool:
    return runner.run(["test", "-e", path], check=False).ok


@pytest.mark.ssh
def test_sync_over_ssh_uploads_once_and_then_only_changes(
    tree: Path, ssh_runner: SSHRunner, ssh_host: LabHost
) -> None:
    parent = f"{ssh_host.home}/sync-{uuid.uuid4().hex}"
    target = f"{parent}/code dir"
    assert sync_dir(ssh_runner, str(tree), target, EXCLUDES) is True
    assert ssh_runner.run(["cat", f"{target}/pkg/model.py"]).stdout == "W = 1\n"
    assert ssh_runner.run(["sh", "-c", f"cd '{target}' && ./run.sh"]).stdout == "run\n"
    assert sync_dir(ssh_runner, str(tree), target, EXCLUDES) is False

    (tree / "pkg" / "model.py").write_text("W = 2\n")
    (tree / "train.py").unlink()
    assert sync_dir(ssh_runner, str(tree), target, EXCLUDES) is True
    assert ssh_runner.run(["cat", f"{target}/pkg/model.py"]).stdout == "W = 2\n"
    assert not remote_exists(ssh_runner, f"{target}/train.py")
    for excluded in (
        ".git",
        ".venv",
        "pkg/__pycache__",
        "pkg/old.pyc",
        "weights.bin",
        "conf/secrets",
        "data/raw",
    ):
        assert not remote_exists(ssh_runner, f"{target}/{excluded}"), excluded
    assert remote_exists(ssh_runner, f"{target}/{STAMP}")
    assert ssh_runner.run(["ls", "-A", parent]).stdout == "code dir\n"
