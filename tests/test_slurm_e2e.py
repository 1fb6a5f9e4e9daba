"""The slurm provider end to end, against a real slurmctld and slurmd per node (tests/slurmlab.py):
an unprivileged user on a login node over SSH drives Slurm; every task is a job step, and
TensorFlow trains over gRPC between the nodes' own addresses."""

from __future__ import annotations

import os
import pwd
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import REPO
from slurmlab import SlurmLab

from orchestrator.api import Cluster
from orchestrator.events import Event, parse_line
from orchestrator.state import Store
from orchestrator.view import RunView

pytestmark = [pytest.mark.slurm, pytest.mark.xdist_group("slurm")]


def slurm_spec(tmp_path: Path, lab: SlurmLab, name: str, body: str, *, workers: int = 3,
               provider_extra: str = "") -> Path:
    """A spec whose controller drives Slurm on the lab's login node as its unprivileged user."""
    path = tmp_path / "cluster.yaml"
    path.write_text(
        f"name: {name}\nworkdir: {REPO}\nworkers: {workers}\n"
        f"provider:\n  kind: slurm\n  python: {sys.executable}\n  partition: main\n"
        f"  queue_timeout_s: 120\n"
        f"  login: {{address: {lab.login.address}, user: {lab.user}, key_file: {lab.key_file}, "
        f"host_key: '{lab.login_host_key()}'}}\n{provider_extra}"
        + textwrap.dedent(body))
    return path


def cli(*args: str, home: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "ORCHESTRATE_HOME": str(home)})


def events_of(path: str) -> list[Event]:
    """The worker events of a task's log (on the file system the lab's machines share)."""
    text = Path(path).read_text(errors="replace")
    return [e for e in map(parse_line, text.splitlines()) if e is not None]


def our_jobs(lab: SlurmLab) -> list[dict[str, str]]:
    return [job for job in lab.squeue() if job["user"] == lab.user]


@pytest.mark.tf
def test_up_train_down_as_job_steps_of_one_allocation(slurm: SlurmLab, tmp_path: Path,
                                                      orchestrate_home: Path) -> None:
    path = slurm_spec(tmp_path, slurm, "slurm-e2e", """\
        job: {module: examples.digits, epochs: 2, steps_per_epoch: 20, progress_every_steps: 5}
        checkpoint: {every_steps: 10}
        """)
    up = cli("up", str(path), home=orchestrate_home)
    assert up.returncode == 0, up.stdout + up.stderr
    assert "submitted allocation" in up.stdout
    (job,) = our_jobs(slurm)
    assert job["state"] == "RUNNING" and job["name"] == "orchestrate-slurm-e2e"

    train = cli("train", str(path), home=orchestrate_home)
    assert train.returncode == 0, train.stdout + train.stderr
    run = Store(orchestrate_home / "state.db").runs("slurm-e2e")[0]
    assert run.status == "succeeded", run.message
    tasks = run.attempts[0].tasks
    assert [t.endpoint.rsplit(":", 1)[0] for t in tasks] == [n.address for n in slurm.nodes]
    logs = [events_of(t.log) for t in tasks]
    # every task joined the one group over gRPC between the nodes' addresses
    assert all(next(e for e in log if e.kind == "connected").get("replicas") == 3 for log in logs)
    digests = {next(e.get("weights_sha256") for e in log if e.kind == "finished") for log in logs}
    assert len(digests) == 1
    assert Path(run.model_path).is_file()
    assert our_jobs(slurm) == [job]  # the steps ended; the allocation holds on for the next train

    status = cli("status", "slurm-e2e", home=orchestrate_home)
    assert "slurm-e2e (slurm) up" in status.stdout and "succeeded" in status.stdout

    down = cli("down", str(path), home=orchestrate_home)
    assert down.returncode == 0, down.stdout + down.stderr
    assert f"allocation {job['id']}" in down.stdout
    assert [j for j in our_jobs(slurm) if j["state"] not in ("COMPLETING", "CANCELLED")] == []


@pytest.mark.tf
def test_a_killed_task_restarts_the_group_inside_the_allocation(
        slurm: SlurmLab, tmp_path: Path, orchestrate_home: Path) -> None:
    path = slurm_spec(tmp_path, slurm, "slurm-kill", """\
        job: {module: examples.digits, epochs: 2, steps_per_epoch: 30, progress_every_steps: 1}
        checkpoint: {every_steps: 10}
        retry: {max_restarts: 2, backoff_initial_s: 0.5, backoff_max_s: 2}
        timeouts: {stop_grace_s: 5}
        """)
    cluster = Cluster.from_spec(path)
    cluster.up()
    (job,) = our_jobs(slurm)
    pids: dict[str, int] = {}
    killed: list[int] = []
    where: list[object] = []  # the killed task's network namespace and uid

    def listener(view: RunView, event: Event | None) -> None:
        if event is None:
            return
        if event.kind == "started" and event.attempt == 1:
            pids[event.task] = int(event.get("pid"))
        if (event.kind == "progress" and event.task == "worker:2" and event.attempt == 1
                and event.get("step") >= 15 and not killed):
            killed.append(event.get("step"))
            pid = pids["worker:2"]
            where.append(subprocess.run(["ip", "netns", "identify", str(pid)],
                                        capture_output=True, text=True).stdout.strip())
            where.append(Path(f"/proc/{pid}").stat().st_uid)
            os.kill(pid, signal.SIGKILL)  # the task's process on its node

    try:
        result = cluster.train(listener=listener).wait()
        assert killed and result.status == "succeeded", result
        # it ran on n3 (its network namespace), as the user: a step, not a process of ours
        assert where == [str(slurm.nodes[2].host.namespace), pwd.getpwnam(slurm.user).pw_uid]
        assert len(result.attempts) == 2, [(a.cause, a.failed_task, a.detail) for a in result.attempts]
        first, second = result.attempts
        assert (first.cause, first.failed_task) == ("crashed", "worker:2")
        assert second.resumed_from_step and second.resumed_from_step >= 10
        assert our_jobs(slurm) == [job]  # the same allocation: no second trip through the queue
        assert len(set(result.digests.values())) == 1
    finally:
        cluster.down()
    assert [j for j in our_jobs(slurm) if j["state"] not in ("COMPLETING", "CANCELLED")] == []
