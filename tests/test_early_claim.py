"""The CLI's early claim (orchestrator/early_claim.py): a kept cluster's hosts claimed, and read,
while the controller imports, over real sshd hosts in network namespaces, logged in as an
unprivileged user; an answer taken only for the same spec, endpoint and command."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import write_spec
from hostlab import HostLab

from orchestrator import early_claim, paths
from orchestrator import spec as specs
from orchestrator.providers import for_spec
from orchestrator.providers.ssh_hosts import SSHHostsProvider

pytestmark = [pytest.mark.ssh, pytest.mark.netns]

REPO = Path(__file__).resolve().parent.parent
BODY = "name: early\njob: {module: examples.digits}\n"


@pytest.fixture(autouse=True)
def no_claims_left() -> Iterator[None]:
    yield
    early_claim.reset(wait_s=10)


def provider_of(path: Path) -> SSHHostsProvider:
    provider = for_spec(specs.load(path), path)
    assert isinstance(provider, SSHHostsProvider)
    return provider


def up(path: Path) -> list[str]:
    """``up`` through a provider of its own, closed after; the hosts' names."""
    provider = provider_of(path)
    try:
        return [h.name for h in provider.up()]
    finally:
        provider.close()


def records() -> list[Path]:
    """The kept records (not a holder's pid file, ``orchestrator/holder.py``)."""
    folder = paths.home() / early_claim.DIRECTORY
    return sorted(folder.glob("*.json")) if folder.exists() else []


def test_up_keeps_each_roots_claim_and_the_next_up_takes_it_early(
        hostlab: HostLab, tmp_path: Path) -> None:
    user = hostlab.plain_user()
    path = write_spec(tmp_path, hostlab, hostlab.hosts(2), BODY, user=user)
    names = up(path)

    [record] = records()
    assert stat.S_IMODE(record.stat().st_mode) == 0o600
    assert stat.S_IMODE(record.parent.stat().st_mode) == 0o700
    kept = json.loads(record.read_text())
    assert [h["name"] for h in kept["hosts"]] == names
    assert all(h["ssh"]["user"] == user and len(h["commands"]) == 1
               and "mkdir" in h["commands"][0] for h in kept["hosts"])
    assert "BEGIN OPENSSH PRIVATE KEY" not in record.read_text()  # the key file's path, not the key

    # The next command claims early; the port probe it runs then is kept too
    assert early_claim.start(["train", "--plain", str(path)]) == 2
    provider = provider_of(path)
    try:
        hosts = provider.up()
        assert early_claim.used() == [(n, 1) for n in sorted(names)]
        assert [h.name for h in hosts] == names
        # the connection it opened is the provider's from now on, and works
        assert early_claim.runner(path, names[0], hosts[0].ssh) is None  # taken already
        assert provider.runner(hosts[0]).run("id -un").stdout.strip() == user
        assert provider.busy_ports(hosts) == set()
    finally:
        provider.close()
    commands = [h["commands"] for h in json.loads(record.read_text())["hosts"]]
    assert [len(c) for c in commands] == [2, 2] and all(" ports " in c[1] for c in commands)

    # ... and the one after runs both early, and takes both answers
    early_claim.reset()
    written = record.stat().st_mtime_ns
    assert early_claim.start(["up", str(path)]) == 2
    provider = provider_of(path)
    try:
        hosts = provider.up()
        assert provider.busy_ports(hosts) == set()
        assert early_claim.used() == [(n, 2) for n in sorted(names)]
    finally:
        provider.close()
    assert record.stat().st_mtime_ns == written  # the same commands: not written again


def test_an_early_answer_is_taken_only_for_the_same_spec_endpoint_and_command(
        hostlab: HostLab, tmp_path: Path) -> None:
    path = write_spec(tmp_path, hostlab, hostlab.hosts(2), BODY, user=hostlab.plain_user())
    up(path)
    [record] = records()
    kept = json.loads(record.read_text())

    # The spec file changed (even by a comment): nothing is reached early
    original = path.read_text()
    path.write_text(original + "# edited\n")
    assert early_claim.start(["train", str(path)]) == 0
    path.write_text(original)
    # Commands that claim nothing, and a train that attaches, reach for nothing
    assert early_claim.start(["status", str(path)]) == 0
    assert early_claim.start(["train", "--attach", str(path)]) == 0

    # Another command than the one the claim would run: it runs, its answer is not taken
    other = {**kept, "hosts": [{**h, "commands": ["printf 'marked %s\\n' someone-else"]}
                               for h in kept["hosts"]]}
    record.write_text(json.dumps(other))
    assert early_claim.start(["up", str(path)]) == 2
    up(path)  # 'someone-else' would have been refused: the provider claimed for itself
    assert early_claim.used() == [(h["name"], 0) for h in kept["hosts"]]

    # Another endpoint (a user of the record, not the spec's): its connection is not adopted
    early_claim.reset(wait_s=10)
    moved = {**kept, "hosts": [{**h, "ssh": {**h["ssh"], "user": "root"}} for h in kept["hosts"]]}
    record.write_text(json.dumps(moved))
    assert early_claim.start(["up", str(path)]) == 2
    provider = provider_of(path)
    try:
        hosts = provider.up()
        assert early_claim.used() == [(h["name"], 0) for h in kept["hosts"]]
        assert all(provider.runner(h).endpoint.user == hostlab.plain_user() for h in hosts)
    finally:
        provider.close()
    # up wrote its own claims back
    assert json.loads(record.read_text())["hosts"] == kept["hosts"]


def test_down_forgets_the_claims(hostlab: HostLab, tmp_path: Path) -> None:
    path = write_spec(tmp_path, hostlab, hostlab.hosts(1), BODY, user=hostlab.plain_user())
    up(path)
    assert len(records()) == 1
    provider = provider_of(path)
    try:
        provider.down()
    finally:
        provider.close()
    assert records() == []
    assert early_claim.start(["up", str(path)]) == 0


def test_an_unreadable_record_reaches_for_nothing(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text("name: early\n")
    for text in ("", "{", json.dumps({"version": 1}), json.dumps([1])):
        early_claim.forget(path)
        folder = paths.home() / early_claim.DIRECTORY
        folder.mkdir(parents=True, exist_ok=True)
        (folder / early_claim._record(path).name).write_text(text)
        assert early_claim.start(["train", str(path)]) == 0
    assert early_claim.start(["train", str(tmp_path / "missing.yaml")]) == 0
    assert early_claim.start([]) == 0


def test_the_cli_claims_a_kept_cluster_while_it_imports(hostlab: HostLab, tmp_path: Path) -> None:
    """``orchestrate up`` twice, each in a process of its own: the first keeps its claims,
    the second takes both hosts' answers early."""
    path = write_spec(tmp_path, hostlab, hostlab.hosts(2), BODY, user=hostlab.plain_user())
    code = ("import sys\nfrom orchestrator import cli, early_claim\n"
            "reset = early_claim.reset\n"
            "def report(*args, **kwargs):  # what the command took, before main() forgets it\n"
            "    print('early:', ','.join(n for n, taken in early_claim.used() if taken))\n"
            "    reset(*args, **kwargs)\n"
            "early_claim.reset = report\n"
            f"sys.argv = ['orchestrate', 'up', {str(path)!r}]\ncli.main()\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=env, cwd=REPO, timeout=120)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "early: \n" in first.stdout  # nothing kept before the first up
    second = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, cwd=REPO, timeout=120)
    assert second.returncode == 0, second.stdout + second.stderr
    [record] = records()
    names = sorted(h["name"] for h in json.loads(record.read_text())["hosts"])
    assert len(names) == 2 and f"early: {','.join(names)}\n" in second.stdout
