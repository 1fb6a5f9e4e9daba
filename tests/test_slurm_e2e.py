"""The slurm provider end to end, against a real slurmctld and slurmd per node (tests/slurmlab.py):
an unprivileged user on a login node over SSH drives Slurm; every task is a job step, and
TensorFlow trains over gRPC between the nodes' own addresses."""

from __future__ import annotations

import json
import os
import pwd
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from helpers import REPO, release_run
from slurmlab import SlurmLab

from orchestrator.api import Cluster
from orchestrator.errors import RunFailed
from orchestrator.events import Event, parse_line
from orchestrator.problems import Problem
from orchestrator.state import Store
from orchestrator.view import RunView

pytestmark = [pytest.mark.slurm]


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
    # Under the full suite's load, the SSH connection to the login node was seen to drop once
    # (host_lost, recovered by a restart in the same allocation; cause not yet found): the
    # figures below are the successful attempt's.
    assert all(a.cause in ("", "host_lost") for a in run.attempts), \
        [(a.cause, a.detail) for a in run.attempts]
    tasks = run.attempts[-1].tasks
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
def test_training_outlives_its_controller_and_train_attach_takes_it_over(
        slurm: SlurmLab, tmp_path: Path, orchestrate_home: Path) -> None:
    """The controller SIGKILLed mid-run: the steps' sruns run on in their wrappers on the login
    node, 'train --attach' watches the same attempt to its end, and 'logs' reads every task."""
    path = slurm_spec(tmp_path, slurm, "slurm-reattach", """\
        job: {module: tests.workloads.paced_digits, epochs: 2, steps_per_epoch: 30,
              progress_every_steps: 1}
        env: {DIGITS_PACE_S: "0.2"}
        checkpoint: {every_steps: 10}
        """, workers=2)
    up = cli("up", str(path), home=orchestrate_home)
    assert up.returncode == 0, up.stdout + up.stderr
    store = Store(orchestrate_home / "state.db")
    controller = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli", "train", str(path), "--plain"], cwd=REPO,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "ORCHESTRATE_HOME": str(orchestrate_home)})
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            runs = store.runs("slurm-reattach")
            tasks = runs[0].attempts[0].tasks if runs and runs[0].attempts else []
            if len(tasks) == 2 and any(e.kind == "progress" for e in events_of(tasks[0].log)):
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"no step within 300 s: {store.runs('slurm-reattach')}")
    finally:
        controller.kill()
        controller.wait()
    try:
        attach = cli("train", str(path), "--attach", "--plain", home=orchestrate_home)
        assert attach.returncode == 0, attach.stdout + attach.stderr
        (run,) = store.runs("slurm-reattach")
        assert run.status == "succeeded" and len(run.attempts) == 1, run.message
        logs = cli("logs", "slurm-reattach", home=orchestrate_home)
        assert logs.returncode == 0, logs.stderr
        for task in ("worker:0", "worker:1"):
            assert f"[{task}]" in logs.stdout, logs.stdout[-2000:]
    finally:
        down = cli("down", str(path), home=orchestrate_home)
    assert down.returncode == 0, down.stdout + down.stderr
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


@pytest.mark.tf
def test_a_lost_node_is_replaced_by_a_one_node_allocation_joined_to_the_group(
        slurm: SlurmLab, tmp_path: Path) -> None:
    """n2's slurmd and every process on it killed (a node that died): the allocation survives
    (--no-kill), the task's peers fail first, a step on every node finds n2 gone well before
    slurmctld marks it DOWN, and the group goes on from the chief's checkpoint with n2's task
    on n3, a one-node allocation of its own."""
    path = slurm_spec(tmp_path, slurm, "slurm-node", """\
        job: {module: tests.workloads.paced_digits, epochs: 2, steps_per_epoch: 30,
              progress_every_steps: 1}
        env: {DIGITS_PACE_S: "0.2"}
        checkpoint: {every_steps: 10}
        retry: {max_restarts: 2, backoff_initial_s: 0.5, backoff_max_s: 2}
        timeouts: {stop_grace_s: 5, repair_s: 120}
        """, workers=2)
    cluster = Cluster.from_spec(path)
    cluster.up()
    (job,) = our_jobs(slurm)
    n1, n2, n3 = slurm.nodes
    killed: list[int] = []
    seen: list[RunView] = []

    def listener(view: RunView, event: Event | None) -> None:
        seen[:] = [view]
        if (event is not None and event.kind == "progress" and event.task == "worker:1"
                and event.attempt == 1 and event.get("step") >= 12 and not killed):
            killed.append(event.get("step"))
            slurm.kill_node(n2.name)

    try:
        result = cluster.train(listener=listener).wait()
        assert killed and result.status == "succeeded", \
            [(a.cause, a.detail) for a in result.attempts]
        first, *_, last = result.attempts
        assert (first.cause, first.failed_task) == ("host_lost", "worker:1"), first.detail
        assert f"node {n2.name}" in first.detail, first.detail
        assert [t.endpoint.rsplit(":", 1)[0] for t in last.tasks] == [n1.address, n3.address]
        assert last.resumed_from_step is not None and last.resumed_from_step >= 10
        # the recovery is measured in phases, the repair (the replacement's queue) among them
        assert first.recovery_s is not None and "repair" in first.phases, first.phases
        messages = seen[0].messages
        assert any("submitted replacement allocation" in m for m in messages), messages
        assert any(f"runs on node {n3.name}" in m for m in messages), messages
        jobs = {j["id"]: j for j in our_jobs(slurm)}
        assert job["id"] in jobs and len(jobs) == 2  # the allocation, and n3's of its own
        assert len(set(result.digests.values())) == 1
    finally:
        report = cluster.down()
    assert sum("allocation" in r for r in report.removed) == 2, report
    assert [j for j in our_jobs(slurm) if j["state"] not in ("COMPLETING", "CANCELLED")] == []


def test_a_lost_node_with_no_node_to_take_its_place_says_what_it_waited_for(
        slurm: SlurmLab, tmp_path: Path, orchestrate_home: Path) -> None:
    """Every node of the partition in use and one lost: its srun says 0 once slurmctld marks
    it DOWN (Slurm's way), which is no finished task; the replacement waits in the queue for
    timeouts.repair_s, saying why, and the run fails naming the node and what it waited for,
    with the allocation still held for 'train --resume'."""
    path = slurm_spec(tmp_path, slurm, "slurm-nonode", """\
        job: {command: sleep 600}
        retry: {max_restarts: 2, backoff_initial_s: 0.5, backoff_max_s: 2}
        timeouts: {stop_grace_s: 2, repair_s: 15}
        """)
    cluster = Cluster.from_spec(path)
    cluster.up()
    (job,) = our_jobs(slurm)
    started: list[str] = []
    seen: list[RunView] = []

    def listener(view: RunView, event: Event | None) -> None:
        seen[:] = [view]
        if event is not None and event.kind == "started":
            started.append(event.task)
            if len(started) == 3:
                slurm.kill_node(slurm.nodes[2].name)

    try:
        with pytest.raises(RunFailed) as failed:
            cluster.train(listener=listener).wait()
        message = failed.value.message
        assert "node n3 was lost and no node took its place" in message, message
        assert "did not start within 15s" in message, message
        assert "timeouts.repair_s" in (failed.value.fix or ""), failed.value.fix
        (run,) = Store(orchestrate_home / "state.db").runs("slurm-nonode")
        first = run.attempts[0]
        assert (first.cause, first.failed_task) == ("host_lost", "worker:2"), first.detail
        assert any("pending" in m for m in seen[0].messages), seen[0].messages
        left = [j["id"] for j in our_jobs(slurm) if j["state"] not in ("COMPLETING", "CANCELLED")]
        assert left == [job["id"]]  # the replacement was cancelled; the allocation is held
    finally:
        cluster.down()
    assert [j for j in our_jobs(slurm) if j["state"] not in ("COMPLETING", "CANCELLED")] == []


@pytest.mark.tf
def test_a_lost_node_with_no_spare_shrinks_an_elastic_group_and_its_return_grows_it_back(
        slurm: SlurmLab, tmp_path: Path) -> None:
    """3 workers on the partition's 3 nodes, n3 killed (elastic, keep_per_replica): no node can
    take its place within timeouts.repair_s, so the group goes on with 2 from the chief's
    snapshot while the one-node replacement stays queued; n3's slurmd back, Slurm returns it to
    service and starts the replacement there, the grow check finds it running, every task saves
    at one step and the group goes on with 3 from that step: one model on all three."""
    path = slurm_spec(tmp_path, slurm, "slurm-elastic", """\
        job: {module: tests.workloads.paced_digits, epochs: 1, steps_per_epoch: 200,
              progress_every_steps: 1, per_replica_batch_size: 16}
        env: {DIGITS_PACE_S: "0.2"}
        checkpoint: {every_steps: 10}
        retry: {max_restarts: 1, backoff_initial_s: 0.5, backoff_max_s: 2}
        timeouts: {stop_grace_s: 30, repair_s: 10}
        elastic: {min_workers: 2, grow_check_s: 2}
        """)
    cluster = Cluster.from_spec(path)
    cluster.up()
    (job,) = our_jobs(slurm)
    n1, n2, n3 = slurm.nodes
    done: list[str] = []
    seen: list[RunView] = []

    def listener(view: RunView, event: Event | None) -> None:
        seen[:] = [view]
        if event is None or event.kind not in ("progress", "started"):
            return
        if (event.attempt == 1 and event.kind == "progress" and event.task == "worker:2"
                and event.get("step") >= 12 and "killed" not in done):
            done.append("killed")
            slurm.kill_node(n3.name)
        elif event.attempt == 2 and event.kind == "progress" and "back" not in done:
            done.append("back")  # the group trains on 2: n3's slurmd starts again
            slurm.start_node(n3.name)
        elif event.attempt == 3 and event.kind == "started" and "released" not in done:
            done.append("released")
            release_run(cluster.provider.hosts()[0].root, view.run_id)

    try:
        result = cluster.train(listener=listener).wait()
        assert done == ["killed", "back", "released"], done
        first, second, third = result.attempts
        assert (first.cause, first.failed_task) == ("host_lost", "worker:2"), first.detail
        assert second.resized.startswith("2 of 3 workers (without slurm-elastic-2: "), \
            second.resized
        assert "it stays queued, and the group grows back when it runs" in second.resized
        assert [t.endpoint.rsplit(":", 1)[0] for t in second.tasks] == [n1.address, n2.address]
        assert (second.status, second.cause) == ("stopped", "resized"), second.detail
        assert third.resumed_from_step == second.last_step and second.steps_lost == 0
        # the replacement ran where the lost node came back: n3, an allocation of its own
        assert [t.endpoint.rsplit(":", 1)[0] for t in third.tasks] == \
            [n1.address, n2.address, n3.address]
        jobs = {j["id"]: j for j in our_jobs(slurm)}
        assert job["id"] in jobs and len(jobs) == 2, jobs
        sizes = [(3, 48), (2, 32), (3, 48)]  # keep_per_replica: the global batch follows
        for number, attempt in enumerate(result.attempts):
            for task in attempt.tasks:
                built = next(e for e in events_of(task.log) if e.kind == "built")
                assert (built.get("replicas"), built.get("global_batch_size")) == sizes[number]
        assert result.status == "succeeded" and len(result.digests) == 3
        assert len(set(result.digests.values())) == 1
        messages = seen[0].messages
        assert any("going on without slurm-elastic-2" in m for m in messages), messages
    finally:
        report = cluster.down()
    assert sum("allocation" in r for r in report.removed) == 2, report
    assert [j for j in our_jobs(slurm) if j["state"] not in ("COMPLETING", "CANCELLED")] == []


# A command job that ends once its group is 3 (else waits to be stopped: the planned stop
# that grows it).
SIZED = ("python -c 'import json, os, time; n = len(json.loads(os.environ[\"TF_CONFIG\"])"
         "[\"cluster\"][\"worker\"]); print(\"workers\", n, flush=True); "
         "n < 3 and time.sleep(600)'")


def test_a_group_grows_past_workers_onto_a_one_node_allocation_once_it_runs(
        slurm: SlurmLab, tmp_path: Path) -> None:
    """workers 2, elastic.max_workers 3, the partition's third node held by another job of the
    user's: the spare's one-node allocation (on neither of the group's nodes) waits in the
    queue, kept past each grow check's few seconds, while the group runs on 2. The other job
    cancelled, it starts on the third node, the grow check finds it running, and the group
    grows to 3 at a planned stop. 'down' cancels it with the group's allocation."""
    n1, n2, n3 = slurm.nodes
    hog = slurm.run("sbatch", "--parsable", f"--nodelist={n3.name}", "--exclusive", "--wrap",
                    "sleep 300", user=slurm.user).stdout.strip()
    path = slurm_spec(tmp_path, slurm, "slurm-spare", f"job: {{command: {json.dumps(SIZED)}}}\n"
                      "retry: {max_restarts: 1, backoff_initial_s: 0.5, backoff_max_s: 2}\n"
                      "timeouts: {stop_grace_s: 5}\n"
                      "elastic: {min_workers: 2, max_workers: 3, grow_check_s: 1}\n", workers=2)
    cluster = Cluster.from_spec(path)
    queued: list[str] = []
    seen: list[RunView] = []

    def listener(view: RunView, event: Event | None) -> None:
        seen[:] = [view]
        if event is not None and event.kind == "started" and event.attempt == 1 and \
                event.task == "worker:1" and not queued:
            queued.append(event.task)
            # a grow check or two find the spare's allocation pending first
            timer = threading.Timer(8.0, lambda: slurm.run("scancel", hog, user=slurm.user))
            timer.daemon = True
            timer.start()

    try:
        cluster.up()
        (job,) = [j for j in our_jobs(slurm) if j["id"] != hog]
        result = cluster.train(listener=listener, doctor=False).wait()
        assert queued, "attempt 1 never started worker:1"
        first, second = result.attempts
        seen_ = [(a.number, a.status, a.cause, a.detail, a.resized) for a in result.attempts]
        assert first.resized == "2 of 3 workers (without slurm-spare-2: a spare, not grown " \
            "onto yet)", seen_
        assert [t.endpoint.rsplit(":", 1)[0] for t in first.tasks] == [n1.address, n2.address]
        assert (first.status, first.cause) == ("stopped", "resized"), seen_
        assert [t.endpoint.rsplit(":", 1)[0] for t in second.tasks] == \
            [n1.address, n2.address, n3.address], seen_
        assert result.status == "succeeded" and not second.resized, seen_
        assert any(m.startswith("slurm-spare-2 back: the group grows to 3 worker(s)")
                   for m in seen[0].messages), seen[0].messages
        jobs = sorted(int(j["id"]) for j in our_jobs(slurm) if j["state"] == "RUNNING")
        # the group's and the spare's: submitted once, kept queued while the node was held,
        # never cancelled and submitted again (the lab's job ids follow each other)
        assert jobs == [int(job["id"]), int(job["id"]) + 1], (jobs, job, hog)
    finally:
        slurm.run("scancel", hog, user=slurm.user, check=False)
        report = cluster.down()
    assert sum("allocation" in r for r in report.removed) == 2, report
    assert [j for j in our_jobs(slurm) if j["state"] not in ("COMPLETING", "CANCELLED")] == []


def test_an_elastic_run_that_ends_small_withdraws_its_queued_replacement(
        slurm: SlurmLab, tmp_path: Path) -> None:
    """A command job, elastic: n3 killed, the group goes on with 2 while n3's replacement waits
    in the queue; the run ends before the node is back, and the replacement is cancelled then
    (nothing starts later to hold a node for no task), the allocation held for 'down'."""
    path = slurm_spec(tmp_path, slurm, "slurm-withdraw", """\
        job: {command: "sleep 8"}
        retry: {max_restarts: 1, backoff_initial_s: 0.5, backoff_max_s: 2}
        timeouts: {stop_grace_s: 2, repair_s: 5}
        elastic: {min_workers: 2, grow_check_s: 1}
        """)
    cluster = Cluster.from_spec(path)
    cluster.up()
    (job,) = our_jobs(slurm)
    started: list[str] = []

    def listener(view: RunView, event: Event | None) -> None:
        if event is not None and event.kind == "started" and event.attempt == 1:
            started.append(event.task)
            if len(started) == 3:
                slurm.kill_node(slurm.nodes[2].name)

    try:
        result = cluster.train(listener=listener).wait()
        assert result.status == "succeeded", [(a.cause, a.detail) for a in result.attempts]
        first, second = result.attempts
        assert first.cause == "host_lost" and "it stays queued" in second.resized, \
            (first.detail, second.resized)
        left = [j["id"] for j in our_jobs(slurm) if j["state"] not in ("COMPLETING", "CANCELLED")]
        assert left == [job["id"]]  # the replacement withdrawn; the allocation held
    finally:
        cluster.down()
    assert [j for j in our_jobs(slurm) if j["state"] not in ("COMPLETING", "CANCELLED")] == []


@pytest.mark.tf
def test_slurms_sigterm_to_the_steps_saves_every_task_at_one_step(
        slurm: SlurmLab, tmp_path: Path) -> None:
    """As a preemption with GraceTime (or ``scancel --signal=TERM``) does: TERM to every step
    of the allocation, not to its holder; every task saves at one step, exits 75, and the group
    goes on in the same allocation from that step, none redone."""
    path = slurm_spec(tmp_path, slurm, "slurm-term", """\
        job: {module: examples.digits, epochs: 2, steps_per_epoch: 30, progress_every_steps: 1}
        checkpoint: {every_steps: 100}
        retry: {max_restarts: 2, backoff_initial_s: 0.5, backoff_max_s: 2}
        timeouts: {stop_grace_s: 30}
        """)
    cluster = Cluster.from_spec(path)
    cluster.up()
    (job,) = our_jobs(slurm)
    signalled: list[int] = []

    def listener(view: RunView, event: Event | None) -> None:
        if (event is not None and event.kind == "progress" and event.attempt == 1
                and event.get("step") >= 12 and not signalled):
            signalled.append(event.get("step"))
            slurm.run("scancel", "--signal=TERM", job["id"], user=slurm.user)

    try:
        result = cluster.train(listener=listener).wait()
        assert signalled and result.status == "succeeded", result
        assert len(result.attempts) == 2, [(a.cause, a.detail) for a in result.attempts]
        first, second = result.attempts
        assert first.cause == "preempted", first.detail
        assert first.exit_code == 75
        # saved at the step they agreed on (no periodic checkpoint before it), none redone
        assert second.resumed_from_step is not None and second.resumed_from_step >= 12
        assert first.steps_lost == 0
        assert our_jobs(slurm) == [job]
        assert len(set(result.digests.values())) == 1
    finally:
        cluster.down()


@pytest.mark.tf
def test_a_requeued_allocation_is_followed_not_taken_for_its_end(
        slurm: SlurmLab, tmp_path: Path) -> None:
    """``scontrol requeue`` (as PreemptMode=REQUEUE does): Slurm ends every step, the holder
    job goes back to PENDING and runs again; train waits for that same job and goes on."""
    path = slurm_spec(tmp_path, slurm, "slurm-requeue", """\
        job: {module: tests.workloads.paced_digits, epochs: 2, steps_per_epoch: 30,
              progress_every_steps: 1}
        env: {DIGITS_PACE_S: "0.3"}
        checkpoint: {every_steps: 10}
        retry: {max_restarts: 2, backoff_initial_s: 0.5, backoff_max_s: 2}
        timeouts: {stop_grace_s: 5}
        """, workers=2)
    cluster = Cluster.from_spec(path)
    cluster.up()
    (job,) = our_jobs(slurm)
    requeued: list[int] = []
    answers: list[str] = []
    seen: list[RunView] = []

    def listener(view: RunView, event: Event | None) -> None:
        seen[:] = [view]
        if (event is not None and event.kind == "progress" and event.attempt == 1
                and event.get("step") >= 12 and not requeued):
            requeued.append(event.get("step"))
            said = slurm.run("scontrol", "requeue", job["id"], user=slurm.user, check=False)
            requeued.append(said.returncode)
            answers.append(f"{said.stdout}{said.stderr} {slurm.squeue()}")

    try:
        result = cluster.train(listener=listener).wait()
        assert requeued[1:] == [0], answers  # scontrol requeue said yes
        assert result.status == "succeeded", [(a.cause, a.detail) for a in result.attempts]
        assert len(result.attempts) == 2, (answers, seen[0].messages)
        messages = seen[0].messages
        assert any(f"allocation {job['id']} is pending again" in m for m in messages), messages
        assert [j["id"] for j in our_jobs(slurm)] == [job["id"]]  # the same job, not a new one
        assert result.attempts[-1].resumed_from_step is not None
        assert result.attempts[-1].resumed_from_step >= 10
        assert len(set(result.digests.values())) == 1
    finally:
        cluster.down()
    assert [j for j in our_jobs(slurm) if j["state"] not in ("COMPLETING", "CANCELLED")] == []


@pytest.mark.tf
def test_a_time_limit_saves_every_task_and_goes_on_in_a_new_allocation(
        slurm: SlurmLab, tmp_path: Path) -> None:
    """A 3-minute allocation: the steps get TERM before its limit (sbatch --signal), every
    task saves at one step, and train goes on by itself in a new allocation from that step."""
    path = slurm_spec(tmp_path, slurm, "slurm-time", """\
        job: {module: tests.workloads.paced_digits, epochs: 2, steps_per_epoch: 40,
              progress_every_steps: 1}
        env: {DIGITS_PACE_S: "3"}
        checkpoint: {every_steps: 1000}
        retry: {max_restarts: 4, backoff_initial_s: 0.5, backoff_max_s: 2}
        timeouts: {stop_grace_s: 5}
        """, provider_extra="  time: '3'\n").read_text()
    # 80 steps at 3 s cannot end inside the 3-minute allocation however fast the machine:
    # the TERM before its limit always comes first (at 1.5 s a fast run once finished first).
    path_file = tmp_path / "cluster.yaml"
    path_file.write_text(path.replace("partition: main", "partition: short"))
    cluster = Cluster.from_spec(path_file)
    cluster.up()
    (first_job,) = our_jobs(slurm)
    root = cluster.provider.hosts()[0].root
    released: list[int] = []

    seen: list[RunView] = []

    def listener(view: RunView, event: Event | None) -> None:
        seen[:] = [view]
        if (event is not None and event.kind == "progress" and event.attempt >= 2
                and not released and release_run(root, view.run_id)):
            released.append(event.attempt)  # in the new allocation: full speed to the end

    try:
        result = cluster.train(listener=listener).wait()
        assert result.status == "succeeded", [(a.cause, a.detail) for a in result.attempts]
        first = result.attempts[0]
        assert first.cause == "preempted" and first.exit_code == 75, first.detail
        assert first.steps_lost == 0, [(a.cause, a.detail, a.resumed_from_step, a.last_step)
                                       for a in result.attempts]  # saved at one step
        later = our_jobs(slurm)
        assert len(later) == 1 and later[0]["id"] != first_job["id"]  # a new allocation
        assert any(f"allocation {first_job['id']}" in m and "going on in allocation" in m
                   for m in seen[0].messages), seen[0].messages
        assert len(set(result.digests.values())) == 1
    finally:
        cluster.down()


def test_doctor_checks_the_partition_before_any_node(slurm: SlurmLab, tmp_path: Path) -> None:
    body = "job: {module: examples.digits}\n"
    cases = {
        "partition: main": ("partition 'nope' does not exist", "main, short", "  partition: nope\n"),
        "time": ("over partition short's limit", "set provider.time to", "  time: '10'\n"),
        "gpus": ("GPU(s)", "provider.gpus_per_node", "  gpus_per_node: 2\n"),
    }
    for key, (says, fix, extra) in cases.items():
        text = slurm_spec(tmp_path, slurm, "slurm-doc", body, provider_extra=extra).read_text()
        if key == "partition: main":
            text = text.replace("  partition: main\n", "")
        if key == "time":
            text = text.replace("partition: main", "partition: short")
        (tmp_path / "cluster.yaml").write_text(text)
        report = Cluster.from_spec(tmp_path / "cluster.yaml").doctor(tensorflow="never")
        found = [p for p in report.problems if says in p.message]
        assert found and found[0].blocking and fix in found[0].fix, report.problems
        # before 'up' there are no nodes: said, not blocking, and no node is asked
        assert any("no allocation yet" in p.message and not p.blocking for p in report.problems)
    # the spares: 3 tasks on the partition's 3 nodes leave none for a lost node's task
    spares: dict[str, list[Problem]] = {}
    for case, workers, extra in (("none", 3, ""), ("elastic", 3, "elastic: {min_workers: 2}\n"),
                                 ("one", 2, ""), ("a node down", 2, "")):
        if case == "a node down":
            slurm.run("scontrol", "update", "NodeName=n3", "State=DOWN", "Reason=test")
        path = slurm_spec(tmp_path, slurm, "slurm-doc", body + extra, workers=workers)
        report = Cluster.from_spec(path).doctor(tensorflow="never")
        spares[case] = [p for p in report.problems if "none to spare" in p.message]
    assert not spares["one"] and all(not p.blocking for ps in spares.values() for p in ps)
    (none,), (elastic,), (down,) = spares["none"], spares["elastic"], spares["a node down"]
    assert none.message == ("partition main has 3 node(s) up for the group's 3: none to spare, "
                            "so a lost node's task has no node to go to, and the run fails "
                            "after timeouts.repair_s (600s)"), none.message
    assert "add 'elastic: {min_workers: 2}'" in none.fix, none.fix
    assert "the group goes on with fewer meanwhile (elastic, down to 2)" in elastic.message
    assert down.message.startswith("partition main has 2 node(s) up for the group's 2:")


@pytest.mark.tf
def test_doctor_checks_every_node_of_the_allocation_through_a_step(
        slurm: SlurmLab, tmp_path: Path) -> None:
    """After 'up': each node's Python and TensorFlow and the task ports between the nodes,
    through steps; the nodes as Slurm sees them (an attached allocation without the GPUs the
    spec asks for is refused, naming the node)."""
    path = slurm_spec(tmp_path, slurm, "slurm-nodes", "job: {module: examples.digits}\n")
    cluster = Cluster.from_spec(path)
    cluster.up()
    try:
        report = cluster.doctor(tensorflow="always")
        assert report.ok, report.problems
        assert not any("no allocation yet" in p.message for p in report.problems)
        assert sorted(h.address for h in report.hosts) == sorted(n.address for n in slurm.nodes)
        assert all(h.reachable and h.python_version == sys.version.split()[0]
                   and h.tf_version for h in report.hosts), report.to_dict()["hosts"]
        assert len(report.links) == 6 and all(link.ok for link in report.links), report.links
        # the checkpoint directory is one every node sees: the chief's marker, read on the others
        assert [h.fact("storage", "sees_chief_marker", "ok") for h in report.hosts
                if h.fact("storage", "sees_chief_marker")] == [True, True]
    finally:
        cluster.down()
    held = slurm.run("sbatch", "--parsable", "-N3", "--wrap", "sleep 300",
                     user=slurm.user).stdout.strip()
    text = slurm_spec(tmp_path, slurm, "slurm-nodes", "job: {module: examples.digits}\n",
                      provider_extra="  gpus_per_node: 1\n").read_text()
    path.write_text(text)
    cluster = Cluster.from_spec(path)
    cluster.up(attach=held)
    try:
        report = cluster.doctor(tensorflow="never")
        found = [p for p in report.problems if "'s node n" in p.message
                 and "not the 1 of provider.gpus_per_node" in p.message]
        assert len(found) == 3 and all(p.blocking for p in found), report.problems
        assert "slurm-nodes-0's node n1 has 0 GPU(s) (GRES (null))" in found[0].message
        assert "salloc --gpus-per-node" in found[0].fix
    finally:
        cluster.down()


def test_up_says_why_it_waits_in_the_queue_and_gives_up_at_its_timeout(
        slurm: SlurmLab, tmp_path: Path, orchestrate_home: Path) -> None:
    blocker = slurm.run("sbatch", "--parsable", "-N3", "--exclusive", "--wrap", "sleep 300",
                        user=slurm.user).stdout.strip()
    path = slurm_spec(tmp_path, slurm, "slurm-queue", "job: {module: examples.digits}\n")
    path.write_text(path.read_text().replace("queue_timeout_s: 120", "queue_timeout_s: 4"))
    up = cli("up", str(path), home=orchestrate_home, timeout=120)
    assert up.returncode != 0 and "Traceback" not in up.stdout + up.stderr
    assert "pending: Resources (waiting for nodes to become free)" in up.stdout, up.stdout
    assert "did not start within 4s" in up.stderr and "it was cancelled" in up.stderr, up.stderr
    assert "provider.queue_timeout_s" in up.stderr
    left = [j["id"] for j in our_jobs(slurm) if j["state"] not in ("COMPLETING", "CANCELLED")]
    assert left == [blocker]  # ours is gone; the user's own job is left alone


def test_up_attach_adopts_your_allocation_and_down_leaves_it_running(
        slurm: SlurmLab, tmp_path: Path, orchestrate_home: Path) -> None:
    held = slurm.run("sbatch", "--parsable", "-N3", "--wrap", "sleep 300",
                     user=slurm.user).stdout.strip()
    path = slurm_spec(tmp_path, slurm, "slurm-attach", "job: {module: examples.digits}\n",
                      provider_extra="  setup: ['echo \"$(hostname)\" >> setup-ran']\n")
    up = cli("up", str(path), "--attach", held, home=orchestrate_home, timeout=120)
    assert up.returncode == 0, up.stdout + up.stderr
    for node in slurm.nodes:
        assert node.address in up.stdout
    assert [j["id"] for j in our_jobs(slurm)] == [held]  # nothing submitted
    # setup ran once, as a step on the first node, in the synced code; not again on a second up
    ran = Path(Cluster.from_spec(path).provider.hosts()[0].root) / "code" / "setup-ran"
    assert ran.read_text() == "n1\n"
    again = cli("up", str(path), home=orchestrate_home, timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    assert ran.read_text() == "n1\n"
    bad = cli("up", str(path), "--attach", "999999", home=orchestrate_home, timeout=120)
    assert bad.returncode != 0 and "job 999999 is not in Slurm's queue" in bad.stderr
    down = cli("down", str(path), home=orchestrate_home, timeout=120)
    assert down.returncode == 0, down.stdout + down.stderr
    assert f"allocation {held} is yours" in down.stdout
    assert [(j["id"], j["state"]) for j in our_jobs(slurm)] == [(held, "RUNNING")]
