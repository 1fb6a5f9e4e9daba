"""Checkpoints on real layouts, end to end on namespace hosts with real TensorFlow: a tutorial
script in command mode resumes from the chief's backup, shared storage copies nothing, a large
checkpoint goes host to host intact, and tasks that restored different checkpoints are
diagnosed instead of retried. Every host is logged into as an unprivileged user with a home of
its own on each host (``hostlab.plain_user()``)."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import write_spec
from hostlab import HostLab, LabHost

from orchestrator import paths
from orchestrator.api import Cluster
from orchestrator.checkpoints import WorkerCommand, share_chief_checkpoint
from orchestrator.errors import RunFailed
from orchestrator.events import Event
from orchestrator.plan import ClusterPlan, build
from orchestrator.state import AttemptRecord
from orchestrator.view import RunResult, RunView
from worker.transfer import listing

pytestmark = [pytest.mark.ssh, pytest.mark.tf, pytest.mark.netns]

TUTORIAL = """\
name: {name}
job:
  command: python tests/workloads/tutorial_backup.py
{job_extra}retry: {{max_restarts: 3, backoff_initial_s: 0.2, backoff_max_s: 1}}
timeouts: {{stop_grace_s: 1, poll_s: 4, hang_s: 60, startup_s: 120}}
env: {{TUTORIAL_EPOCHS: "5", {env}}}
{extra}"""
CACHES = "  sync_excludes: [.mypy_cache, .ruff_cache, .pytest_cache, backup]\n"


KillWhen = Callable[[RunView, Event], bool]


def first_backup(view: RunView, event: Event) -> bool:
    return event.attempt == 1 and event.kind == "checkpoint" and event.task == "worker:0"


def train_and_kill(cluster: Cluster, victim: str, when: KillWhen = first_backup,
                   on_view: Callable[[RunView], None] | None = None,
                   once_exists: Path | None = None) -> RunResult:
    """Train, killing ``victim``'s training process (SIGKILL) once ``when`` says so, or, with
    ``once_exists``, once that file exists (a checkpoint the orchestrator is not told of)."""
    started: dict[str, int] = {}
    killed: list[int] = []
    done = threading.Event()

    def kill() -> None:
        if not killed:
            os.kill(started[victim], signal.SIGKILL)  # the training process (a command's script)
            killed.append(started[victim])

    def listener(view: RunView, event: Event | None) -> None:
        if on_view is not None:
            on_view(view)
        if event is None:
            return
        if event.kind == "started" and event.attempt == 1:
            started[event.task] = int(event.get("pid"))
        if once_exists is None and when(view, event):
            kill()

    def watch_file() -> None:
        while once_exists is not None and not done.wait(0.1):
            if victim in started and once_exists.exists():
                kill()
                return

    watcher = threading.Thread(target=watch_file, daemon=True)
    watcher.start()
    try:
        return cluster.train(listener=listener).wait()
    finally:
        done.set()
        watcher.join()
        assert killed, "the fault was never injected"


@pytest.fixture
def clusters() -> Iterator[list[Cluster]]:
    """Clusters to take down after the test has read their hosts' files."""
    made: list[Cluster] = []
    yield made
    for cluster in made:
        cluster.down()


def cluster_for(made: list[Cluster], tmp_path: Path, hostlab: HostLab, hosts: list[LabHost],
                body: str) -> Cluster:
    cluster = Cluster.from_spec(write_spec(tmp_path, hostlab, hosts, body, provider_extra=CACHES,
                                           user=hostlab.plain_user()))
    made.append(cluster)
    return cluster


def planned(clusters: list[Cluster], tmp_path: Path, hostlab: HostLab, hosts: list[LabHost],
            name: str) -> tuple[Any, ClusterPlan]:
    """A digits cluster on ``hosts``, up, and the plan of a run of it (no task started)."""
    cluster = cluster_for(clusters, tmp_path, hostlab, hosts,
                          f"name: {name}\njob: {{module: examples.digits}}\n")
    up = cluster.up()
    return cluster.provider, build(cluster.spec, up, run_id=name, python=cluster.provider.python(up[0]),
                                   local_workdir=str(tmp_path))


def log_lines(hosts: list[LabHost], attempt: AttemptRecord) -> dict[str, list[str]]:
    out = {}
    for task in attempt.tasks:
        host = hosts[int(task.task.split(":")[1])]
        done = host.run(["cat", task.log])
        assert done.returncode == 0, (task.log, done.stderr)
        out[task.task] = done.stdout.splitlines()
    return out


def first_epochs(hosts: list[LabHost], attempt: AttemptRecord) -> dict[str, int]:
    """The epoch each task's script began with in ``attempt``."""
    logs = log_lines(hosts, attempt)
    epochs = {task: [int(line.split()[1]) for line in lines if line.startswith("EPOCH-BEGIN")]
              for task, lines in logs.items()}
    assert all(epochs.values()), logs
    return {task: numbers[0] for task, numbers in epochs.items()}


def final_weights(hosts: list[LabHost], attempt: AttemptRecord) -> set[str]:
    return {next(line.split()[1] for line in lines if line.startswith("WEIGHTS "))
            for lines in log_lines(hosts, attempt).values()}


def test_tutorial_script_with_a_relative_backup_dir_resumes_from_the_chiefs_backup(
        hostlab: HostLab, tmp_path: Path, clusters: list[Cluster]) -> None:
    hosts = hostlab.hosts(2)
    body = TUTORIAL.format(name="ck-tutorial", job_extra="  checkpoint_dir: backup\n",
                           env='TUTORIAL_BACKUP_DIR: "backup"', extra="")
    cluster = cluster_for(clusters, tmp_path, hostlab, hosts, body)
    result = train_and_kill(cluster, "worker:1")

    assert result.status == "succeeded"
    first, second = result.attempts  # one restart
    assert (first.cause, first.failed_task) == ("crashed", "worker:1"), first.detail
    resumed = first_epochs(hosts, second)
    assert len(set(resumed.values())) == 1 and resumed["worker:0"] >= 1, resumed
    assert len(final_weights(hosts, second)) == 1  # the group trained as one
    assert result.checkpoint_bytes["host_to_host"] > 0  # the chief's backup went to worker:1


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory every lab host sees (they share this file system), writable by all; not
    under tmp_path, whose parents only root may enter."""
    path = Path(tempfile.mkdtemp(prefix="orchestrate-shared-ckpt-"))
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path)


def test_shared_checkpoint_dir_copies_nothing_and_resumes(
        hostlab: HostLab, tmp_path: Path, clusters: list[Cluster], shared_dir: Path) -> None:
    hosts = hostlab.hosts(2)
    shared = shared_dir
    body = TUTORIAL.format(name="ck-shared", job_extra="", env="",
                           extra=f"checkpoint: {{dir: {shared}}}\n")
    cluster = cluster_for(clusters, tmp_path, hostlab, hosts, body)
    messages: list[str] = []
    result = train_and_kill(cluster, "worker:1", on_view=lambda v: messages.extend(
        m for m in v.messages if m not in messages))

    assert result.status == "succeeded"
    first, second = result.attempts
    assert (first.cause, first.failed_task) == ("crashed", "worker:1"), first.detail
    resumed = first_epochs(hosts, second)
    assert len(set(resumed.values())) == 1 and resumed["worker:0"] >= 1, resumed
    assert result.checkpoint_bytes == {"through_controller": 0, "host_to_host": 0}
    assert any("shared storage" in m and str(shared) in m for m in messages), messages


def test_large_checkpoint_goes_host_to_host_intact(
        hostlab: HostLab, tmp_path: Path, clusters: list[Cluster]) -> None:
    hosts = hostlab.hosts(3)
    # far over every buffer on the way (a pipe's, SSH's window, a piece's 1 MiB read): a copy
    # that holds a whole file, or cuts one short, shows at this size as at 300 MiB (the size
    # before 8116e59: 65 CPU-s of the suite's most costly lane for this test alone)
    mib = 96
    body = f"""\
        name: ck-large
        job: {{module: tests.workloads.big_state, epochs: 1, steps_per_epoch: 60,
               progress_every_steps: 1}}
        checkpoint: {{every_steps: 20, mirror: never}}
        retry: {{max_restarts: 2, backoff_initial_s: 0.2, backoff_max_s: 1}}
        timeouts: {{stop_grace_s: 1, poll_s: 8, hang_s: 120, startup_s: 240}}
        env: {{BIG_STATE_MIB: "{mib}"}}
        """
    cluster = cluster_for(clusters, tmp_path, hostlab, hosts, body)
    digests: list[dict[str, dict[str, str]]] = []
    newest: list[str] = []  # the chief's index and the checkpoint it names

    def after_the_copy(view: RunView) -> None:
        """Right after the relaunch's copy (the tasks are not started yet): every file of
        every host's copy, by digest."""
        if digests or not any(m.startswith("copied the chief's checkpoint") for m in view.messages):
            return
        root = f".orchestrate/clusters/ck-large/runs/{view.run_id}/checkpoints"
        digests.append({h.name: _digests(Path(h.plain_home) / root) for h in hosts})
        newest.extend(f["path"] for f in
                      listing(str(Path(hosts[0].plain_home) / root), newest=True)["files"])

    result = train_and_kill(cluster, "worker:2", on_view=after_the_copy)

    assert result.status == "succeeded"
    assert [a.cause for a in result.attempts] == ["crashed", ""]
    (copies,) = digests
    chief = copies[hosts[0].name]
    # The chief keeps its older checkpoints; the others get the one the relaunch restores.
    assert sum(1 for name in newest if ".data-" in name) == 1 and set(newest) <= set(chief)
    for host in hosts[1:]:
        assert copies[host.name] == {name: chief[name] for name in newest}, host.name
    assert result.checkpoint_bytes["host_to_host"] >= 2 * mib * 2**20  # to each of 2 hosts
    assert result.checkpoint_bytes["through_controller"] == 0  # mirror: never
    assert len(set(result.digests.values())) == 1


def _digests(directory: Path) -> dict[str, str]:
    out = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        if "workertemp_" in str(path.relative_to(directory)):
            continue
        digest = hashlib.sha256()
        with path.open("rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        out[path.relative_to(directory).as_posix()] = digest.hexdigest()
    return out


def test_tasks_that_restored_different_checkpoints_are_diagnosed_not_retried(
        hostlab: HostLab, tmp_path: Path, clusters: list[Cluster]) -> None:
    """The script backs up to ./backup, which the spec does not name: nothing copies the
    chief's backup, so after the restart the chief resumes and worker:1 starts afresh."""
    hosts = hostlab.hosts(2)
    body = TUTORIAL.format(name="ck-mismatch", job_extra="", env='TUTORIAL_BACKUP_DIR: "backup"',
                           extra="")
    cluster = cluster_for(clusters, tmp_path, hostlab, hosts, body)
    backup = Path(hosts[0].plain_home,
                  ".orchestrate/clusters/ck-mismatch/code/backup/chief/checkpoint")
    with pytest.raises(RunFailed) as info:
        train_and_kill(cluster, "worker:1", once_exists=backup)

    text = str(info.value)
    assert "restored different checkpoints" in text, text
    assert "does not know the directory the script checkpoints to" in text
    assert info.value.fix is not None and "job.checkpoint_dir" in info.value.fix
    assert "failed after 2 attempt(s)" in text  # the budget (3 restarts) was not burnt
    assert "attempt 2: checkpoint_mismatch" in text


def test_hosts_that_cannot_reach_each_other_get_the_checkpoint_through_the_controller(
        hostlab: HostLab, tmp_path: Path, clusters: list[Cluster]) -> None:
    """The receiving host's port is taken (as a firewall between hosts would also stop the
    chain): the copy is relayed through this machine instead, and says so."""
    hosts = hostlab.hosts(2)
    provider, plan = planned(clusters, tmp_path, hostlab, hosts, "ck-relay")
    chief, other = (t.host for t in plan.tasks)
    source = plan.checkpoints.of(chief)
    provider.runner(chief).run(
        f"mkdir -p {source}/chief && head -c 3000000 /dev/urandom > {source}/chief/ckpt-1.data"
        f" && echo 'model_checkpoint_path: \"ckpt-1\"' > {source}/chief/checkpoint")
    blocker = subprocess.Popen(
        ["ip", "netns", "exec", str(hosts[1].namespace), sys.executable, "-c",
         "import socket, time; s = socket.socket(); "
         "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
         f"s.bind(('', {plan.task('worker:1').port})); s.listen(); time.sleep(120)"])
    try:
        time.sleep(0.5)
        copied = share_chief_checkpoint(
            plan, provider.runner,
            lambda h: WorkerCommand(provider.python(h), paths.lib_dir(h.root)))
    finally:
        blocker.kill()
        blocker.wait()
    assert "taken" in copied.chain_error, copied
    assert copied.hosts == [other.name] and copied.host_to_host_bytes == 0
    size = 3000000 + len('model_checkpoint_path: "ckpt-1"\n')
    assert copied.through_controller == 2 * size  # down from the chief, up to the other
    relative = Path(source).relative_to(hosts[0].plain_home)  # the same under each home
    copy, original = (_digests(Path(h.plain_home) / relative) for h in (hosts[1], hosts[0]))
    assert copy == original and len(copy) == 2
    leftovers = list(Path(hosts[0].plain_home).rglob(".transfer-*.pid"))
    assert leftovers == []  # the sender was stopped and its pid file removed


def test_one_round_copy_skips_the_host_that_has_it_and_counts_every_hop(
        hostlab: HostLab, tmp_path: Path, clusters: list[Cluster]) -> None:
    """Three hosts in one round: the first target already has the chief's checkpoint, the
    second has an older one. The first forwards without touching its copy, the second gets the
    newest checkpoint only, and the bytes are counted on both hops; the same copy again sends
    nothing. With no checkpoint at the chief, the targets' copies are moved aside."""
    hosts = hostlab.hosts(3)
    provider, plan = planned(clusters, tmp_path, hostlab, hosts, "ck-round")
    chief, first, second = (t.host for t in plan.tasks)
    dirs = [Path(plan.checkpoints.of(h)) for h in (chief, first, second)]

    def share() -> Any:
        return share_chief_checkpoint(
            plan, provider.runner, lambda h: WorkerCommand(provider.python(h), paths.lib_dir(h.root)))

    def make(host: Any, directory: Path, numbers: list[int]) -> None:
        """The layout tf_keras leaves: data and index per checkpoint, an index naming the
        newest and the kept ones; made as the host's user, as the tasks would."""
        provider.runner(host).run(["mkdir", "-p", str(directory)])
        files = {"checkpoint": (f'model_checkpoint_path: "ckpt-{numbers[-1]}"\n' + "".join(
            f'all_model_checkpoint_paths: "ckpt-{n}"\n' for n in numbers)).encode()}
        for n in numbers:
            files[f"ckpt-{n}.data-00000-of-00001"] = bytes([n]) * (1 << 20)
            files[f"ckpt-{n}.index"] = b"index %d" % n
        for name, data in files.items():
            path = directory / name
            path.write_bytes(data)
            shutil.chown(path, user=hostlab.plain_user())
            stamp = int(name.split("-")[1].split(".")[0]) if name != "checkpoint" else numbers[-1]
            os.utime(path, ns=(stamp * 10**9, stamp * 10**9))

    make(chief, dirs[0] / "chief", [2, 3, 4])
    make(first, dirs[1] / "chief", [2, 3, 4])  # as an earlier relaunch left it: the newest only
    for old in ("ckpt-2", "ckpt-3"):
        for path in (dirs[1] / "chief").glob(f"{old}.*"):
            path.unlink()
    make(second, dirs[2] / "chief", [1, 2])
    first_data = dirs[1] / "chief" / "ckpt-4.data-00000-of-00001"
    inode = first_data.stat().st_ino

    copied = share()

    assert not copied.chain_error, copied
    # The index and ckpt-4 only: not ckpt-2 and ckpt-3, which the chief keeps beside it.
    index = len((dirs[0] / "chief" / "checkpoint").read_bytes())
    assert (copied.hosts, copied.up_to_date) == ([second.name], [first.name])
    assert copied.bytes == index + (1 << 20) + len(b"index 4")
    assert copied.host_to_host_bytes == 2 * copied.bytes  # chief -> first -> second
    assert first_data.stat().st_ino == inode  # the first host kept its own copy
    assert sorted(p.name for p in (dirs[2] / "chief").iterdir()) == [
        "checkpoint", "ckpt-4.data-00000-of-00001", "ckpt-4.index"]
    assert _digests(dirs[2]) == {k: v for k, v in _digests(dirs[0]).items()
                                 if "ckpt-4" in k or k.endswith("checkpoint")}

    again = share()
    assert (again.hosts, sorted(again.up_to_date), again.bytes) == (
        [], sorted([first.name, second.name]), 0)

    shutil.rmtree(dirs[0])  # the chief has no checkpoint: a relaunch from step 0
    cleared = share()
    assert sorted(cleared.cleared) == sorted([first.name, second.name]), cleared
    assert not dirs[1].exists() and not dirs[2].exists()
    assert all(any(p.name.startswith(f"{d.name}.stale-") for p in d.parent.iterdir())
               for d in dirs[1:])
