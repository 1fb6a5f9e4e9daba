"""The gcp provider end to end: fake Compute Engine VMs backed by namespace hosts, real sshd and TF."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_billing import FakeBilling
from fake_compute import FakeCompute, LabBacking
from helpers import events_in, release_run
from hostlab import HostLab, LabHost

from orchestrator import paths
from orchestrator.api import Cluster
from orchestrator.events import Event
from orchestrator.providers.base import HostHealth
from orchestrator.providers.gcp.billing import ENDPOINT_ENV as BILLING_ENDPOINT_ENV
from orchestrator.providers.gcp.compute import ENDPOINT_ENV
from orchestrator.providers.gcp.provider import GcpProvider
from orchestrator.view import RunResult, RunView

pytestmark = [pytest.mark.ssh, pytest.mark.netns]
REPO = Path(__file__).resolve().parent.parent
LABEL = ("orchestrate-cluster", "gcp-e2e")


@pytest.fixture
def lab_hosts(hostlab: HostLab) -> list[LabHost]:
    return hostlab.hosts(3)


@pytest.fixture
def fake(lab_hosts: list[LabHost], monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCompute]:
    with FakeCompute(latency_s=0.1, boot_s=0.1, host_key_delay_s=0.5,
                     backing=[LabBacking(h) for h in lab_hosts]) as server:
        monkeypatch.setenv(ENDPOINT_ENV, server.url)
        yield server


@pytest.fixture
def billing(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeBilling]:
    with FakeBilling() as server:
        monkeypatch.setenv(BILLING_ENDPOINT_ENV, server.url)
        yield server


def write_spec(tmp_path: Path, lab: HostLab, workers: int = 3, boot_timeout_s: int = 60,
               **extra: object) -> Path:
    path = tmp_path / "gcp-e2e.yaml"
    path.write_text(json.dumps({
        "name": "gcp-e2e", "workers": workers, "workdir": str(REPO),
        "provider": {"kind": "gcp", "project": "test-project", "zones": ["us-central1-a"],
                     "spot": True, "ssh_user": lab.shared_user(), "python": sys.executable,
                     "connect_timeout_s": 2, "boot_timeout_s": boot_timeout_s},
        **extra,
    }))
    return path


def cli(*args: str, home: Path, endpoint: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "ORCHESTRATE_HOME": str(home), ENDPOINT_ENV: endpoint})


def test_up_reaches_each_vm_with_its_published_host_key_and_a_second_up_attaches(
        hostlab: HostLab, lab_hosts: list[LabHost], fake: FakeCompute, tmp_path: Path) -> None:
    path = write_spec(tmp_path, hostlab, job={"module": "examples.digits"})
    hosts = Cluster.from_spec(path).up()
    labs = {lab.address: lab for lab in lab_hosts}
    assert [h.name for h in hosts] == ["gcp-e2e-0", "gcp-e2e-1", "gcp-e2e-2"]  # the chief first
    assert sorted(labs) == sorted(h.address for h in hosts)
    for host in hosts:  # strict host keys: the one each VM published, no trust on first use
        lab = labs[host.address]
        assert host.ssh and host.ssh.host_keys == (lab.host_key_line,)
        assert not host.ssh.trust_on_first_use and host.root.startswith(lab.home)
        code = f"{host.root}/code/examples/digits.py"  # in the VM's own home, as on its own disk
        assert lab.run(["test", "-f", code]).returncode == 0

    assert Cluster.from_spec(path).up() == hosts
    assert fake.calls["instances.bulkInsert"] == 1

    cluster = Cluster.from_spec(path)
    provider = cluster.provider
    assert isinstance(provider, GcpProvider)
    old_key = labs[hosts[1].address].host_key_line
    provider.compute.wait(provider.compute.delete("us-central1-a", "gcp-e2e-1"), "delete a VM")
    again = cluster.up()
    creates = [body for method, _, body in fake.requests if method == "instances.bulkInsert"]
    assert [sorted(body["perInstanceProperties"]) for body in creates] == [
        ["gcp-e2e-0", "gcp-e2e-1", "gcp-e2e-2"], ["gcp-e2e-1"]]
    new_key = labs[again[1].address].host_key_line  # a re-created VM is a new machine
    assert again[1].ssh and again[1].ssh.host_keys == (new_key,) and new_key != old_key
    cluster.down()
    assert fake.instances() == [] and fake.firewalls() == []


@pytest.mark.tf
@pytest.mark.parametrize("job", [{"module": "examples.digits"},
                                 {"module": "examples.keras3_digits", "backend": "jax"}],
                         ids=["tf_keras", "jax"])
def test_up_train_preempt_recover_down(hostlab: HostLab, lab_hosts: list[LabHost],
                                       fake: FakeCompute, tmp_path: Path,
                                       orchestrate_home: Path, job: dict[str, str],
                                       billing: FakeBilling) -> None:
    """A spot VM preempted mid-training: its guest shuts down (SIGTERM to the task, as the ACPI
    soft off makes systemd do), every task saves at the step they agree on and stops, the VM is
    started again and the next attempt resumes at exactly that step: no step is redone. On
    TensorFlow (tf_keras) and on JAX (the Keras 3 module, JAX's preemption service). The run's
    cost is counted at the Billing Catalog's spot prices."""
    path = write_spec(tmp_path, hostlab,
                      job={**job, "epochs": 2, "steps_per_epoch": 40, "progress_every_steps": 1},
                      checkpoint={"every_steps": 10},
                      retry={"max_restarts": 2, "backoff_initial_s": 0.5, "backoff_max_s": 2},
                      timeouts={"stop_grace_s": 20})
    up = cli("up", str(path), home=orchestrate_home, endpoint=fake.url)
    assert up.returncode == 0, up.stdout + up.stderr
    preempted: list[int] = []
    stopped: dict[str, int] = {}  # task -> the step it saved at, from its "stopped" event
    checkpoints: list[int] = []  # the chief's checkpoint steps in attempt 1 (it alone saves)

    def listener(view: RunView, event: Event | None) -> None:
        if event is None or event.attempt != 1:
            return
        if event.kind == "stopped":
            stopped[event.task] = event.get("step")
        if event.kind == "checkpoint":
            checkpoints.append(event.get("step"))
        if (event.kind == "progress" and event.task == "worker:2"
                and event.get("step") >= 25 and not preempted):
            preempted.append(event.get("step"))
            fake.preempt("gcp-e2e-2")  # the guest has the real 30 s to shut down

    cluster = Cluster.from_spec(path)
    result = cluster.train(listener=listener).wait()
    assert preempted and result.status == "succeeded", result
    first, second = result.attempts[:2]
    seen = [(a.number, a.cause, a.failed_task, a.detail, a.last_step, a.resumed_from_step,
             a.steps_lost) for a in result.attempts]
    assert (first.cause, first.failed_task) == ("preempted", "worker:2"), seen
    # Every task saved at one step (worker:2's own event is on its VM, whose sshd stopped at
    # the shutdown), and that is the chief's last checkpoint.
    assert stopped and len(set(stopped.values())) == 1, (stopped, seen)
    (saved,) = set(stopped.values())
    assert saved >= preempted[0] and checkpoints and checkpoints[-1] == saved, (checkpoints, seen)
    assert second.resumed_from_step == saved, seen
    assert first.steps_lost == 0, seen  # nothing redone
    assert len(set(result.digests.values())) == 1
    assert fake.calls["instances.start"] == 1 and fake.calls["instances.bulkInsert"] == 1
    assert len(fake.operations("compute.instances.preempted")) == 1
    # What it cost: 3 spot n1-standard-8 VMs and their disks, at the catalog's prices, for the
    # run's time; the restarts' share is the recovery (no step was redone).
    (run,) = cluster.status().to_dict()["runs"]
    price, spent = run["price"], run["cost"]
    assert price["spot"] and price["machines"] == 3 and price["per_hour"] > 0, price
    assert price["source"].startswith("Cloud Billing Catalog, read "), price
    assert spent["money"] == pytest.approx(price["per_hour"] * run["seconds"] / 3600, rel=0.05)
    assert spent["recovery_s"] == pytest.approx(first.recovery_s) and spent["steps_redone"] == 0
    assert spent["lost_money"] == pytest.approx(price["per_hour"] * first.recovery_s / 3600)
    assert spent["summary"].startswith("cost $") and "; restarts $" in spent["summary"]

    down = cli("down", str(path), home=orchestrate_home, endpoint=fake.url)
    assert down.returncode == 0, down.stdout + down.stderr
    assert "removed VM us-central1-a/gcp-e2e-2" in down.stdout
    assert fake.instances(LABEL) == [] and fake.firewalls() == []


# Writes its pid, then each signal it gets, to the file $1; never exits by itself.
SIGNAL_LOG = """trap 'echo TERM >>"$1"' TERM
trap 'echo HUP >>"$1"' HUP
echo "ready $$" >>"$1"
while :; do sleep 1 & wait $!; done
"""


def wait_for(check: Callable[[], Any], what: str, timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)
    return value


def signals_in(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_preempted_vm_signals_its_guest_processes_then_powers_off(
        hostlab: HostLab, lab_hosts: list[LabHost], fake: FakeCompute, tmp_path: Path) -> None:
    path = write_spec(tmp_path, hostlab, workers=1, boot_timeout_s=30,
                      job={"module": "examples.digits"})
    cluster = Cluster.from_spec(path)
    (host,) = cluster.up()
    provider = cluster.provider
    assert isinstance(provider, GcpProvider)
    log = Path(host.root, "signals")  # the VM's own disk, seen from here (hosts share files)
    provider.runner(host).run(  # over SSH, detached in a session of its own, as a task is
        f"setsid sh -c {shlex.quote(SIGNAL_LOG)} sh {log} >/dev/null 2>&1 </dev/null &")
    pid = int(wait_for(lambda: signals_in(log)[1:2], "the task started")[0])

    fake.preempt("gcp-e2e-0", after_s=10)  # the task ignores SIGTERM: forced off after 10 s
    assert [vm["status"] for vm in fake.instances()] == ["STOPPING"]
    assert provider.host_health(host) is HostHealth.PREEMPTED
    wait_for(lambda: {"TERM", "HUP"} <= set(signals_in(log)), "SIGTERM and SIGHUP reached the task")
    assert running(pid)  # told, not killed: the machine is still on
    wait_for(lambda: [vm["status"] for vm in fake.instances()] == ["TERMINATED"], "TERMINATED")
    wait_for(lambda: not running(pid), "the power off killed the task")
    cluster.down()
    assert fake.instances() == []


def test_a_project_with_os_login_on_still_takes_the_cluster_key(
        hostlab: HostLab, lab_hosts: list[LabHost], fake: FakeCompute, tmp_path: Path) -> None:
    fake.os_login(True)  # the project's enable-oslogin: the VMs' own FALSE overrides it
    path = write_spec(tmp_path, hostlab, workers=1, boot_timeout_s=20,
                      job={"module": "examples.digits"})
    cluster = Cluster.from_spec(path)
    (host,) = cluster.up()
    assert cluster.provider.runner(host).run(["true"]).exit_code == 0
    cluster.down()


def test_os_login_forced_by_policy_is_named_with_the_fix(
        hostlab: HostLab, lab_hosts: list[LabHost], fake: FakeCompute, tmp_path: Path,
        orchestrate_home: Path) -> None:
    fake.os_login(True, enforced=True)  # constraints/compute.requireOsLogin: nothing overrides it
    path = write_spec(tmp_path, hostlab, workers=1, boot_timeout_s=20,
                      job={"module": "examples.digits"})
    up = cli("up", str(path), home=orchestrate_home, endpoint=fake.url)
    assert up.returncode == 2 and "Traceback" not in up.stderr, up.stdout + up.stderr
    assert "refuses the SSH key" in up.stderr and "OS Login" in up.stderr
    assert "constraints/compute.requireOsLogin" in up.stderr and "firewall" not in up.stderr
    down = cli("down", str(path), home=orchestrate_home, endpoint=fake.url)
    assert down.returncode == 0 and fake.instances() == [], down.stdout + down.stderr


def test_a_restarted_vm_is_reached_with_the_host_key_recorded_at_creation(
        hostlab: HostLab, lab_hosts: list[LabHost], fake: FakeCompute, tmp_path: Path) -> None:
    path = write_spec(tmp_path, hostlab, workers=2, boot_timeout_s=30,
                      job={"module": "examples.digits"})
    cluster = Cluster.from_spec(path)
    hosts = cluster.up()
    provider = cluster.provider
    assert isinstance(provider, GcpProvider)
    fake.preempt("gcp-e2e-1", after_s=5)  # STOPPING, TERMINATED; no host keys on the restart
    repaired = provider.repair(hosts[1], deadline_s=30)
    assert repaired.ssh and hosts[1].ssh and repaired.ssh.host_keys == hosts[1].ssh.host_keys
    assert provider.runner(repaired).run(["true"]).exit_code == 0
    assert fake.calls["instances.start"] == 1 and fake.calls["instances.bulkInsert"] == 1
    cluster.down()


def elastic_run(tmp_path: Path, hostlab: HostLab, lab_hosts: list[LabHost],
                lose: Callable[[], None], back: Callable[[], None],
                **job: object) -> tuple[Cluster, Path, RunResult, list[str]]:
    """A paced elastic run of 3 spot VMs: ``lose`` at worker:2's step 15 (gcp-e2e-2 must not
    come back), ``back`` once the group trains on 2, and the run released once it is 3 again;
    its cluster, spec path, result and what was done."""
    path = write_spec(tmp_path, hostlab,
                      job={"module": "tests.workloads.paced_digits", "epochs": 1,
                           "steps_per_epoch": 120, "progress_every_steps": 1, **job},
                      checkpoint={"every_steps": 10},
                      retry={"max_restarts": 2, "backoff_initial_s": 0.5, "backoff_max_s": 2},
                      timeouts={"stop_grace_s": 20, "repair_s": 5},
                      elastic={"min_workers": 2, "grow_check_s": 1},
                      env={"DIGITS_PACE_S": "0.25"})
    done: list[str] = []

    def listener(view: RunView, event: Event | None) -> None:
        if event is None or event.kind not in ("progress", "started"):
            return
        if event.attempt == 1 and event.kind == "progress" and event.task == "worker:2" \
                and event.get("step") >= 15 and "lost" not in done:
            done.append("lost")
            lose()
        elif event.attempt == 2 and event.kind == "progress" and "back" not in done:
            done.append("back")  # the group trains on 2
            back()
        elif event.attempt == 3 and event.kind == "started" and "released" not in done:
            done.append("released")
            for lab in lab_hosts:
                release_run(paths.host_root(lab.home, "gcp-e2e"), view.run_id)

    cluster = Cluster.from_spec(path)
    return cluster, path, cluster.train(listener=listener).wait(), done


@pytest.mark.tf
def test_an_elastic_group_goes_on_without_a_vm_no_zone_can_restart_and_grows_back_when_one_can(
        hostlab: HostLab, lab_hosts: list[LabHost], fake: FakeCompute, tmp_path: Path,
        orchestrate_home: Path) -> None:
    """A spot VM preempted while its zone is out of capacity (the fake answers
    ZONE_RESOURCE_POOL_EXHAUSTED as Compute Engine does): every task saves at one step, no zone
    of the spec can start the VM again, and the run goes on with 2 workers from that step, at
    each replica's batch (keep_per_replica: the global batch and the learning rate shrink).
    Capacity back, the grow check re-creates the VM and the group grows to 3 again at a planned
    stop. No step redone, one model."""
    zone = "us-central1-a"

    def lose() -> None:
        fake.exhaust(zone)
        fake.preempt("gcp-e2e-2")

    try:
        cluster, path, result, done = elastic_run(
            tmp_path, hostlab, lab_hosts, lose, lambda: fake.exhaust(zone, False),
            per_replica_batch_size=16)
    finally:
        fake.exhaust(zone, False)
    assert done == ["lost", "back", "released"], done
    first, second, third = result.attempts
    seen = [(a.number, a.status, a.cause, a.failed_task, a.detail, a.resized, a.last_step,
             a.resumed_from_step, a.steps_lost) for a in result.attempts]
    assert (first.cause, first.failed_task, first.steps_lost) == ("preempted", "worker:2", 0), seen
    assert second.resized.startswith("2 of 3 workers (without gcp-e2e-2: no zone could create "
                                     "1 VM(s) of n1-standard-8: us-central1-a: "
                                     "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS: "), seen
    assert [t.host for t in second.tasks] == ["gcp-e2e-0", "gcp-e2e-1"], seen
    assert (second.status, second.cause, second.steps_lost) == ("stopped", "resized", 0), seen
    assert third.resumed_from_step == second.last_step and not third.resized, seen
    assert [t.host for t in third.tasks] == ["gcp-e2e-0", "gcp-e2e-1", "gcp-e2e-2"], seen
    # the VM was deleted where it could not start, and re-created once the zone had room
    creates = [body for method, _, body in fake.requests if method == "instances.bulkInsert"]
    assert [sorted(body["perInstanceProperties"]) for body in creates][-1] == ["gcp-e2e-2"]
    # each replica's batch kept: the global batch and the learning rate follow the group
    labs = {lab.address: lab for lab in lab_hosts}
    hosts = {h.name: h for h in cluster.provider.hosts()}
    sizes = [(3, 48, 0.003), (2, 32, 0.002), (3, 48, 0.003)]
    for number, attempt in enumerate(result.attempts):
        task = attempt.tasks[0]  # the chief's host stayed
        built = next(e for e in events_in(labs[hosts[task.host].address], task.log)
                     if e.kind == "built")
        assert (built.get("replicas"), built.get("global_batch_size")) == sizes[number][:2]
        assert built.get("learning_rate") == pytest.approx(sizes[number][2])
    assert result.status == "succeeded" and len(set(result.digests.values())) == 1
    assert len(result.digests) == 3
    down = cli("down", str(path), home=orchestrate_home, endpoint=fake.url)
    assert down.returncode == 0, down.stdout + down.stderr
    assert fake.instances(LABEL) == []

@pytest.mark.tf
def test_an_elastic_group_goes_on_without_a_vm_the_quota_cannot_start_and_grows_back_after(
        hostlab: HostLab, lab_hosts: list[LabHost], fake: FakeCompute, tmp_path: Path) -> None:
    """The quota case: a spot VM preempted while the region's quota is taken by other VMs (its
    start fails inside the operation with QUOTA_EXCEEDED, as Compute Engine's does: a stopped
    VM holds no CPU quota). The run goes on with 2 workers; the quota raised, the grow check
    starts the same VM again, and the group grows back to 3 at a planned stop."""
    region = "us-central1"

    def lose() -> None:
        fake.set_quota(region, "CPUS", 2)  # the two VMs left use it all
        fake.preempt("gcp-e2e-2")

    cluster, _, result, done = elastic_run(tmp_path, hostlab, lab_hosts, lose,
                                           lambda: fake.set_quota(region, "CPUS", 3))
    try:
        assert done == ["lost", "back", "released"], done
        first, second, third = result.attempts
        seen = [(a.number, a.status, a.cause, a.detail, a.resized) for a in result.attempts]
        assert (first.cause, first.failed_task, first.steps_lost) == \
            ("preempted", "worker:2", 0), seen
        assert second.resized.startswith(
            "2 of 3 workers (without gcp-e2e-2: starting VM gcp-e2e-2 failed: QUOTA_EXCEEDED: "
            "Quota 'CPUS' exceeded. Limit: 2.0 in region us-central1."), seen
        assert [t.host for t in second.tasks] == ["gcp-e2e-0", "gcp-e2e-1"], seen
        assert (second.status, second.cause, second.steps_lost) == ("stopped", "resized", 0), seen
        assert third.resumed_from_step == second.last_step, seen
        assert [t.host for t in third.tasks] == ["gcp-e2e-0", "gcp-e2e-1", "gcp-e2e-2"], seen
        # the same VM started again, never deleted nor re-created
        assert fake.calls["instances.bulkInsert"] == 1 and fake.calls["instances.start"] >= 2
        assert result.status == "succeeded" and len(set(result.digests.values())) == 1
        assert len(result.digests) == 3
    finally:
        cluster.down()
    assert fake.instances(LABEL) == []


# A command job that reports its group's size, and ends once the group is 3 (else waits to
# be stopped: the planned stop that grows it).
SIZED = ("python -c 'import json, os, time; n = len(json.loads(os.environ[\"TF_CONFIG\"])"
         "[\"cluster\"][\"worker\"]); print(\"workers\", n, flush=True); "
         "n < 3 and time.sleep(600)'")


def test_a_group_grows_past_workers_onto_a_vm_created_once_the_quota_allows(
        hostlab: HostLab, lab_hosts: list[LabHost], fake: FakeCompute, tmp_path: Path,
        orchestrate_home: Path) -> None:
    """workers 2, elastic.max_workers 3: 'up' creates 2 VMs, never the spare; the region's
    quota takes no third, so the grow check's creates of gcp-e2e-2 fail inside the operation
    (QUOTA_EXCEEDED, as Compute Engine's do) and the group trains on 2. The quota raised, the
    next grow check creates the VM, reaches it with the host key it publishes, prepares it,
    and the group grows to 3 at a planned stop. 'down' deletes the grown VM with the others.
    (A command job: the growth itself is TensorFlow's in test_elastic; this is the VM's.)"""
    region = "us-central1"
    fake.set_quota(region, "CPUS", 2)
    path = write_spec(tmp_path, hostlab, workers=2, job={"command": SIZED},
                      retry={"max_restarts": 1, "backoff_initial_s": 0.2, "backoff_max_s": 1},
                      timeouts={"stop_grace_s": 5},
                      elastic={"min_workers": 2, "max_workers": 3, "grow_check_s": 1})
    plan = cli("plan", str(path), home=orchestrate_home, endpoint=fake.url)
    assert plan.returncode == 0, plan.stderr
    assert "spares gcp-e2e-2, created as the group grows" in plan.stdout, plan.stdout
    raised: list[int] = []

    def listener(view: RunView, event: Event | None) -> None:
        if event is not None and event.kind == "started" and event.attempt == 1 and \
                event.task == "worker:1" and not raised:
            raised.append(fake.calls["instances.bulkInsert"])
            # let a grow check or two fail on the quota first
            timer = threading.Timer(3.0, lambda: fake.set_quota(region, "CPUS", 3))
            timer.daemon = True
            timer.start()

    cluster = Cluster.from_spec(path)
    try:
        result = cluster.train(listener=listener, doctor=False).wait()
        assert raised, "attempt 1 never started worker:1"
        first, second = result.attempts
        seen = [(a.number, a.status, a.cause, a.detail, a.resized) for a in result.attempts]
        assert first.resized == "2 of 3 workers (without gcp-e2e-2: a spare, not grown onto yet)", \
            seen
        assert [t.host for t in first.tasks] == ["gcp-e2e-0", "gcp-e2e-1"], seen
        assert (first.status, first.cause) == ("stopped", "resized"), seen
        assert first.detail.startswith("gcp-e2e-2 back: every task saves, and the group grows "
                                       "to 3 worker(s)"), seen
        assert [t.host for t in second.tasks] == ["gcp-e2e-0", "gcp-e2e-1", "gcp-e2e-2"], seen
        assert not second.resized and result.status == "succeeded", seen
        creates = [sorted(body["perInstanceProperties"])
                   for method, _, body in fake.requests if method == "instances.bulkInsert"]
        assert creates[0] == ["gcp-e2e-0", "gcp-e2e-1"], creates
        # the quota refused the spare at least once before it was made
        assert len(creates) >= 3 and set(map(tuple, creates[1:])) == {("gcp-e2e-2",)}, creates
        assert sorted(vm["name"] for vm in fake.instances(LABEL)) == \
            ["gcp-e2e-0", "gcp-e2e-1", "gcp-e2e-2"]
    finally:
        cluster.down()
    assert fake.instances(LABEL) == []

