"""The CLI's early launch (orchestrator/early_claim.py): the next ``train`` of a kept cluster
starts its first attempt's warm tasks while the controller imports, and the run takes each only
where its launch is byte-identical; what no launch takes is stopped. Real sshd hosts in network
namespaces, logged in as an unprivileged user; real TensorFlow where a run trains."""

from __future__ import annotations

import json
import os
import shlex
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import REPO, first_attempt_pgids, private_examples, write_spec
from hostlab import HostLab

from orchestrator import early_claim, paths
from orchestrator import spec as specs
from orchestrator.api import Cluster
from orchestrator.events import parse_line
from orchestrator.hosts import Host
from orchestrator.providers import for_spec
from orchestrator.providers.ssh_hosts import SSHHostsProvider
from orchestrator.remote.base import LaunchSpec, group_lives, launch_script
from orchestrator.state import Store

pytestmark = [pytest.mark.ssh, pytest.mark.netns]

TRAIN = "name: early-go\njob: {module: examples.digits, epochs: 1, steps_per_epoch: 6}\n"
MARK = "EARLY_LAUNCH_MARK"


@pytest.fixture(autouse=True)
def nothing_left() -> Iterator[None]:
    yield
    early_claim.reset(wait_s=20)


def provider_of(path: Path) -> SSHHostsProvider:
    provider = for_spec(specs.load(path), path)
    assert isinstance(provider, SSHHostsProvider)
    return provider


def launch_record(path: Path) -> Path:
    return early_claim._launch_record(path)


def alive(provider: SSHHostsProvider, host: Host, pgid: int) -> bool:
    """Whether a process of group ``pgid`` lives on ``host`` (zombies not counted)."""
    return provider.runner(host).run(group_lives(pgid), check=False).exit_code == 0


def marked_processes() -> list[int]:
    """This machine's processes (every namespace host's too) with MARK in their environment."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if f"{MARK}=1".encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.mark.tf  # it trains: in a TF lane (tests/conftest.py)
def test_the_next_train_takes_the_tasks_started_early_and_stops_one_whose_launch_differs(
        hostlab: HostLab, tmp_path: Path) -> None:
    path = write_spec(tmp_path, hostlab, hostlab.hosts(2), TRAIN, user=hostlab.plain_user())
    private_examples(path, tmp_path)
    first = Cluster.from_spec(path).train()
    assert first.wait().status == "succeeded"
    record = launch_record(path)
    assert stat.S_IMODE(record.stat().st_mode) == 0o600
    kept = json.loads(record.read_text())
    assert first.id not in record.read_text() and early_claim.TOKEN in record.read_text()
    names = sorted(kept["launches"])
    assert len(names) == 2 and all(len(kept["launches"][n]) == 1 for n in names)

    # The next train's CLI starts both tasks early; the run takes them, under their run id
    assert early_claim.start(["train", "--plain", str(path)]) == 2
    second = Cluster.from_spec(path).train()
    assert second.wait().status == "succeeded"
    tasks = early_claim.early_tasks()
    assert [n for n, _ in tasks] == names and all(
        [state for _, state in found] == ["taken"] for _, found in tasks)
    assert first_attempt_pgids(second.id) == sorted(g for _, f in tasks for g, _ in f)
    early_claim.reset(wait_s=20)

    # A kept launch that differs from the one the run builds (one more variable): it starts,
    # is not taken, and is stopped before the run's own launch on that host
    tampered = {**kept, "launches": {
        n: [{**t, "script": t["script"].replace("export ", f"export {MARK}=1; export ", 1)}
            for t in ts] for n, ts in kept["launches"].items()}}
    record.write_text(json.dumps(tampered))
    assert early_claim.start(["train", str(path)]) == 2
    third = Cluster.from_spec(path).train()
    assert third.wait().status == "succeeded"
    tasks = early_claim.early_tasks()
    assert [n for n, _ in tasks] == names and all(
        [state for _, state in found] == ["stopped"] for _, found in tasks)
    assert marked_processes() == []
    # the logs the run read are its own tasks' alone: the stopped ones' went with them
    store = Store()
    try:
        attempt = store.get_run(third.id).attempts[0]
    finally:
        store.close()
    provider = provider_of(path)
    try:
        for task in attempt.tasks:
            host = next(h for h in provider.hosts() if h.name == task.host)
            log = provider.runner(host).run(["cat", task.log]).stdout
            assert [e.kind for e in map(parse_line, log.splitlines())
                    if e is not None].count("warming") == 1, log[-2000:]
    finally:
        provider.close()
    # the run wrote the launches it did make back, for the next train
    assert json.loads(record.read_text())["launches"] == kept["launches"]


def test_an_early_task_is_stopped_when_the_code_changed_and_when_no_run_takes_it(
        hostlab: HostLab, tmp_path: Path) -> None:
    code = tmp_path / "code"
    code.mkdir()
    (code / "job.py").write_text("VERSION = 1\n")
    path = write_spec(tmp_path, hostlab, hostlab.hosts(2), "name: early-void\njob: {module: job}\n",
                      user=hostlab.plain_user())
    path.write_text(path.read_text().replace(f"workdir: {REPO}", f"workdir: {code}"))
    provider = provider_of(path)
    try:
        hosts = {h.name: h for h in provider.up()}
        # As a run's first attempt would keep its launches: here, a task that sleeps
        run_id = "20261204-000000-abcdef"
        launches, run_dirs = {}, {}
        for name, host in hosts.items():
            run_dir = paths.RunPaths.of(host.root, run_id).run_dir
            spec = LaunchSpec(["sleep", "300"], ".", f"{run_dir}/task.log", f"{run_dir}/task.rc",
                              {MARK: "1"})
            launches[name] = [(launch_script(spec),
                               [spec.log_path, spec.pid_path, spec.rc_path, spec.go_path])]
            run_dirs[name] = run_dir
        early_claim.remember_launches(path, run_id, launches, run_dirs,
                                      ("created", "adopted", "foreign", "marked early-void"))
    finally:
        provider.close()
    text = launch_record(path).read_text()
    assert run_id not in text

    # Flags that start no warm first attempt, and other commands: nothing is launched early
    for argv in (["train", "--no-doctor", str(path)], ["train", "--resume", "last", str(path)],
                 ["train", "--attach", str(path)], ["up", str(path)]):
        early_claim.start(argv)
        assert early_claim.early_tasks(wait_s=20) == [] and early_claim.run_id(path) is None, argv
        early_claim.reset(wait_s=20)

    # A claim whose answer does not say the root is this cluster's: nothing is launched there
    kept = json.loads(text)
    launch_record(path).write_text(json.dumps({**kept, "claimed": ["marked someone-else"]}))
    assert early_claim.start(["train", str(path)]) == 2
    assert [t for _, t in early_claim.early_tasks(wait_s=20)] == [[], []]
    early_claim.reset(wait_s=20)
    launch_record(path).write_text(text)

    # The code changed since: up's sync stops the early tasks before anything else starts
    assert early_claim.start(["train", str(path)]) == 2
    tasks = dict(early_claim.early_tasks(wait_s=20))
    assert sorted(tasks) == sorted(hosts) and all(len(t) == 1 for t in tasks.values())
    provider = provider_of(path)
    try:
        assert all(alive(provider, hosts[n], g) for n, t in tasks.items() for g, _ in t)
        (code / "job.py").write_text("VERSION = 2\n")
        provider.up()
        after = dict(early_claim.early_tasks())
        assert all([s for _, s in t] == ["stopped"] for t in after.values())
        assert not any(alive(provider, hosts[n], g) for n, t in tasks.items() for g, _ in t)
        # its files went with it (a launch with these paths starts a fresh log)
        log = shlex.quote(launches[next(iter(hosts))][0][1][0])
        assert provider.runner(next(iter(hosts.values()))).run(
            f"test -e {log}", check=False).exit_code != 0
    finally:
        provider.close()
    early_claim.reset(wait_s=20)

    # Nothing changed, and the command ends without a run taking them (its doctor failed, a
    # run already going, ...): they are stopped and the run's directory removed
    assert early_claim.start(["train", str(path)]) == 2
    tasks = dict(early_claim.early_tasks(wait_s=20))
    assert all([s for _, s in t] == ["waiting"] for t in tasks.values())
    early_claim.reset(wait_s=20)
    provider = provider_of(path)
    try:
        for name, found in tasks.items():
            assert not any(alive(provider, hosts[name], g) for g, _ in found)
            assert provider.runner(hosts[name]).run(
                f"test -e {shlex.quote(run_dirs[name])}", check=False).exit_code != 0
    finally:
        provider.close()
    assert marked_processes() == []


def test_a_kept_launch_is_refused_when_it_is_not_this_specs_or_holds_the_token(
        tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text("name: early\n")
    early_claim.remember_launches(path, "run-1", {"h": [("echo run-1", ["run-1/log"])]},
                                  {"h": "runs/run-1"}, ["marked early"])
    assert early_claim._launches_for(["train", str(path)], path, {"h"}) is not None
    assert early_claim._launches_for(["train", str(path)], path, {"h", "other"}) is None
    path.write_text("name: early\n# edited\n")  # the spec changed: nothing is kept for it
    assert early_claim._launches_for(["train", str(path)], path, {"h"}) is None
    # a script that holds the token, or a host without its run directory: nothing is kept
    early_claim.remember_launches(path, "run-2", {"h": [(early_claim.TOKEN, [])]}, {"h": "d"},
                                  ["marked early"])
    assert not launch_record(path).exists()
    early_claim.remember_launches(path, "run-3", {"h": [("echo", [])]}, {}, ["marked early"])
    assert not launch_record(path).exists()
    for text in ("", "{", json.dumps({"version": 1}), json.dumps([1])):
        launch_record(path).parent.mkdir(parents=True, exist_ok=True)
        launch_record(path).write_text(text)
        assert early_claim._launches_for(["train", str(path)], path, {"h"}) is None
    early_claim.forget(path)
    assert not launch_record(path).exists()
    assert os.listdir(launch_record(path).parent) == []


def test_a_claim_and_its_launches_go_as_one_script_whose_parts_read_back_exactly() -> None:
    """``_folded`` under a real ``sh``: each part's output byte for byte with its exit code;
    the launches run only after a claim that exited 0 and printed a claimed line first, matched
    literally; nothing a part prints can end a part early."""
    import subprocess

    def run(claim: str, claimed: list[str], launches: list[str]) -> list[tuple[str, int]]:
        nonce = "0123abcd"
        script = early_claim._folded(claim, claimed, launches, nonce)
        out = subprocess.run(["sh", "-s"], input=script, capture_output=True, text=True,
                             timeout=30, check=True).stdout
        return early_claim._parts(out, nonce)

    launches = ["echo 4242", "printf 'no newline'", "echo started; exit 3"]
    ours = "printf 'created\\nstamp a\\n\\n\\n'"
    assert run(ours, ["created", "adopted"], launches) == [
        ("created\nstamp a\n\n\n", 0), ("4242\n", 0), ("no newline", 0), ("started\n", 3)]
    # Another cluster's root, a claim that failed, a claimed line only as a prefix or a glob:
    # the claim's part alone, and nothing launched
    assert run("echo 'marked other'", ["created", "marked mine"], launches) == [
        ("marked other\n", 0)]
    assert run("echo created; exit 1", ["created"], launches) == [("created\n", 1)]
    assert run("echo 'marked mine too'", ["marked mine"], launches) == [("marked mine too\n", 0)]
    assert run("echo 'marked m1'", ["marked m*", "marked m?"], launches) == [("marked m1\n", 0)]
    assert run("echo created", [], launches) == [("created\n", 0)]
    # Names with quotes and spaces match as they are
    assert run("echo \"marked it's\"", ["marked it's"], ["echo 7"]) == [
        ("marked it's\n", 0), ("7\n", 0)]
    # A claim that prints lines shaped like a part's end (another nonce, a bad code) and reads
    # stdin: the launches still run, and stdin is no script's
    forged = "echo created; printf '\\nfeedbeef 0\\n0123abcd x\\n'; cat"
    assert run(forged, ["created"], ["cat; echo 9"]) == [
        ("created\n\nfeedbeef 0\n0123abcd x\n", 0), ("9\n", 0)]
    # What a command cut off mid-way printed: the parts that ended
    assert early_claim._parts("created\n\n0123abcd 0\n4242\n", "0123abcd") == [("created\n", 0)]
    assert early_claim._parts("created\n\n0123abcd 0", "0123abcd") == []
