"""The gcp provider against the HTTP fake of Compute Engine, through the real google-cloud-compute client."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fake_compute import FakeCompute
from google.auth.credentials import AnonymousCredentials, Credentials
from google.auth.exceptions import RefreshError, TransportError
from helpers import GCP_PROJECT, as_from_a_terminal, write_gcp_spec

from orchestrator import spec as specs
from orchestrator.errors import ProviderError, SpecError
from orchestrator.hosts import Host
from orchestrator.providers import HostHealth, for_spec
from orchestrator.providers.gcp import config as gce
from orchestrator.providers.gcp.compute import ENDPOINT_ENV, Compute, compute_v1
from orchestrator.providers.gcp.instance import CapacityError
from orchestrator.providers.gcp.provider import GcpProvider
from orchestrator.providers.keys import PRIVATE_NAME

REPO = Path(__file__).resolve().parent.parent
PROJECT = GCP_PROJECT
LABEL = "orchestrate-cluster"


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCompute]:
    with FakeCompute(latency_s=0.05, boot_s=0.05, host_key_delay_s=0.1) as server:
        monkeypatch.setenv(ENDPOINT_ENV, server.url)
        yield server


write_spec = write_gcp_spec


def make_provider(path: Path, sleeps: list[float] | None = None) -> GcpProvider:
    record = sleeps.append if sleeps is not None else (lambda s: None)
    return GcpProvider(specs.load(path), path, sleep=record)


def cli(*args: str, home: Path, endpoint: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "orchestrator.cli", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "ORCHESTRATE_HOME": str(home),
                                 ENDPOINT_ENV: endpoint},
                            preexec_fn=as_from_a_terminal)


def test_vms_are_created_in_one_bulk_insert_with_the_spec_settings(fake: FakeCompute, tmp_path: Path,
                                                                    orchestrate_home: Path) -> None:
    path = write_spec(tmp_path, machine_type="n1-standard-8", spot=True, disk_size_gb=200,
                      accelerator={"type": "nvidia-tesla-t4", "count": 2}, labels={"team": "ml"},
                      metadata={"startup-note": "hi"}, ssh_user="trainer")
    vms = make_provider(path).provision()
    assert [vm.name for vm in vms] == ["gcp-test-0", "gcp-test-1", "gcp-test-2"]
    assert fake.calls["instances.bulkInsert"] == 1
    key_dir = orchestrate_home / "clusters" / "gcp-test" / "ssh"
    public = (key_dir / f"{PRIVATE_NAME}.pub").read_text().strip()
    assert oct((key_dir / PRIVATE_NAME).stat().st_mode & 0o777) == "0o600"
    for vm in fake.instances():
        assert vm["status"] == "RUNNING" and vm["labels"] == {LABEL: "gcp-test", "team": "ml"}
        assert vm["tags"]["items"] == ["orchestrate-gcp-test"]
        assert vm["machineType"].endswith("/zones/us-central1-a/machineTypes/n1-standard-8")
        assert [a["acceleratorType"].rsplit("/", 1)[1] for a in vm["guestAccelerators"]] == [
            "nvidia-tesla-t4"] and vm["guestAccelerators"][0]["acceleratorCount"] == 2
        metadata = {i["key"]: i["value"] for i in vm["metadata"]["items"]}
        assert metadata["ssh-keys"] == f"trainer:{public} orchestrate-gcp-test"
        assert metadata["enable-guest-attributes"] == "TRUE" and metadata["startup-note"] == "hi"
        assert vm["scheduling"] == {"onHostMaintenance": "TERMINATE", "automaticRestart": False,
                                    "preemptible": False, "provisioningModel": "SPOT",
                                    "instanceTerminationAction": "STOP"}
        assert vm["disks"][0]["boot"] and vm["disks"][0]["autoDelete"]
        assert vm["disks"][0]["diskSizeGb"] == "200"
        assert vm["networkInterfaces"][0]["network"].endswith("/global/networks/default")
        assert vm["networkInterfaces"][0]["accessConfigs"] == []  # no public IP unless asked
        assert "devstorage.read_write" in vm["serviceAccounts"][0]["scopes"][0]


def test_firewall_rule_opens_the_grpc_ports_between_the_cluster_vms_only(fake: FakeCompute,
                                                                        tmp_path: Path) -> None:
    make_provider(write_spec(tmp_path)).provision()
    (rule,) = fake.firewalls()
    assert rule["name"] == "orchestrate-gcp-test-grpc" and rule["direction"] == "INGRESS"
    assert rule["allowed"] == [{"IPProtocol": "tcp", "ports": ["23456-23655"]}]
    assert rule["sourceTags"] == rule["targetTags"] == ["orchestrate-gcp-test"]
    assert "sourceRanges" not in rule and "0.0.0.0/0" not in json.dumps(rule)


def test_zones_out_of_capacity_or_quota_fall_through_with_a_record_of_why(
        fake: FakeCompute, tmp_path: Path, orchestrate_home: Path) -> None:
    fake.exhaust("us-central1-a")
    fake.set_quota("us-east1", "NVIDIA_T4_GPUS", 0)
    path = write_spec(tmp_path, zones=["us-central1-a", "us-east1-b", "us-west1-a"])
    provider = make_provider(path)
    vms = provider.provision()
    assert {vm.zone for vm in vms} == {"us-west1-a"}
    assert [(f.zone, f.code) for f in provider.zone_failures] == [
        ("us-central1-a", "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS"),
        ("us-east1-b", "QUOTA_EXCEEDED")]
    assert "NVIDIA_T4_GPUS" in provider.zone_failures[1].message
    assert fake.calls["instances.bulkInsert"] == 3  # one per zone tried, not one per VM
    notes = provider.notes()  # what 'orchestrate up' prints
    assert notes[0].startswith(
        "zone us-central1-a refused the VMs (ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS)")
    assert "NVIDIA_T4_GPUS" in notes[1]


def test_a_quota_no_zone_can_satisfy_fails_naming_the_quota(fake: FakeCompute, tmp_path: Path) -> None:
    fake.set_quota("us-central1", "NVIDIA_A100_GPUS", 2)
    path = write_spec(tmp_path, zones=["us-central1-a", "us-central1-b"], machine_type="a2-highgpu-1g")
    with pytest.raises(CapacityError) as info:
        make_provider(path).provision()
    assert [f.zone for f in info.value.failures] == ["us-central1-a", "us-central1-b"]
    assert "Quota 'NVIDIA_A100_GPUS' exceeded" in str(info.value)
    assert info.value.fix and "NVIDIA_A100_GPUS quota in region us-central1" in info.value.fix
    assert fake.instances() == []


def test_429_and_503_bursts_are_retried_with_backoff(fake: FakeCompute, tmp_path: Path) -> None:
    fake.fail_next(3, 429, "instances.bulkInsert")
    fake.fail_next(2, 503, "zoneOperations.wait")
    fake.fail_next(1, 503, "instances.aggregatedList")
    sleeps: list[float] = []
    vms = make_provider(write_spec(tmp_path), sleeps).provision()
    assert len(vms) == 3 and len(fake.instances()) == 3  # retried creates were not doubled
    assert fake.calls["instances.bulkInsert"] == 4
    assert len(sleeps) == 6 and all(s > 0 for s in sleeps)
    assert sleeps[1] < sleeps[3]  # the bulkInsert's three: exponential (1-2 s, then 4-5 s)


def test_permission_denied_fails_at_once_with_the_api_message_and_the_fix(
        fake: FakeCompute, tmp_path: Path) -> None:
    fake.deny("compute.instances.create")
    sleeps: list[float] = []
    path = write_spec(tmp_path, zones=["us-central1-a", "us-central1-b"])
    with pytest.raises(ProviderError) as info:
        make_provider(path, sleeps).provision()
    assert "Required 'compute.instances.create' permission" in str(info.value)
    assert info.value.fix and "roles/compute.instanceAdmin.v1" in info.value.fix
    assert fake.calls["instances.bulkInsert"] == 1 and sleeps == []  # no retry, no other zone


def test_a_machine_type_the_zone_lacks_fails_at_once_naming_the_field(
        fake: FakeCompute, tmp_path: Path) -> None:
    fake.withhold("us-central1-f", "a2-highgpu-1g")
    path = write_spec(tmp_path, zones=["us-central1-f", "us-central1-a"], machine_type="a2-highgpu-1g")
    with pytest.raises(ProviderError) as info:
        make_provider(path).provision()
    assert "does not exist in zone 'us-central1-f'" in str(info.value)
    assert info.value.fix and "provider.machine_type" in info.value.fix
    assert fake.calls["instances.bulkInsert"] == 1


@pytest.mark.parametrize("count", [1, 64])
def test_up_of_many_vms_makes_one_create_call_per_zone(fake: FakeCompute, tmp_path: Path,
                                                       count: int) -> None:
    fake.exhaust("us-central1-a")
    path = write_spec(tmp_path, workers=count, zones=["us-central1-a", "us-central1-b"])
    vms = make_provider(path).provision()
    assert len(vms) == count and {vm.zone for vm in vms} == {"us-central1-b"}
    assert fake.calls["instances.bulkInsert"] == 2  # O(zones), whatever the count
    assert fake.calls["instances.get"] == 0  # VMs are watched with one list call per poll


def test_a_second_provision_creates_only_what_is_missing(fake: FakeCompute, tmp_path: Path) -> None:
    provider = make_provider(write_spec(tmp_path))
    first = provider.provision()
    assert [vm.name for vm in provider.provision()] == [vm.name for vm in first]
    assert fake.calls["instances.bulkInsert"] == 1 and fake.calls["firewalls.insert"] == 1
    provider.compute.wait(provider.compute.delete("us-central1-a", "gcp-test-1"), "delete")
    provider.provision()
    created = [body for method, _, body in fake.requests if method == "instances.bulkInsert"]
    assert len(created) == 2 and list(created[1]["perInstanceProperties"]) == ["gcp-test-1"]
    assert sorted(vm["name"] for vm in fake.instances()) == ["gcp-test-0", "gcp-test-1", "gcp-test-2"]


def test_host_health_tells_a_preempted_spot_vm_from_a_deleted_one(fake: FakeCompute,
                                                                   tmp_path: Path) -> None:
    provider = make_provider(write_spec(tmp_path, spot=True))
    vms = provider.provision()
    hosts = [Host(name=vm.name, address=vm.internal_ip, root="/r", labels=(("zone", vm.zone),))
             for vm in vms]
    fake.preempt("gcp-test-1")
    assert provider.host_health(hosts[1]) is HostHealth.PREEMPTED
    (preemption,) = fake.operations("compute.instances.preempted")
    assert preemption["targetLink"].endswith("/instances/gcp-test-1")
    provider.compute.wait(provider.compute.delete("us-central1-a", "gcp-test-2"), "delete")
    assert provider.host_health(hosts[2]) is HostHealth.GONE
    provider.provision()  # starts the preempted VM again and re-creates the deleted one
    assert {vm["name"]: vm["status"] for vm in fake.instances()} == {
        "gcp-test-0": "RUNNING", "gcp-test-1": "RUNNING", "gcp-test-2": "RUNNING"}
    assert fake.calls["instances.start"] == 1


def test_down_after_the_local_state_was_deleted_removes_every_vm_and_the_rule(
        fake: FakeCompute, tmp_path: Path, orchestrate_home: Path) -> None:
    path = write_spec(tmp_path, zones=["us-central1-a", "us-central1-b"])
    make_provider(path).provision()
    shutil.rmtree(orchestrate_home)
    down = cli("down", str(path), home=orchestrate_home, endpoint=fake.url)
    out, err = down.communicate(timeout=120)
    assert down.returncode == 0, out + err
    assert "removed VM us-central1-a/gcp-test-0" in out and "removed firewall rule" in out
    assert fake.instances((LABEL, "gcp-test")) == [] and fake.firewalls() == []


def wait_for_call(fake: FakeCompute, method: str, process: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 60
    while fake.calls[method] == 0:
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)


def test_down_after_ctrl_c_during_up_leaves_nothing_behind(tmp_path: Path,
                                                           orchestrate_home: Path) -> None:
    path = write_spec(tmp_path, zones=["us-central1-a"])
    with FakeCompute(latency_s=1.0) as fake:
        up = cli("up", str(path), home=orchestrate_home, endpoint=fake.url)
        try:
            wait_for_call(fake, "zoneOperations.wait", up)  # blocked in the create's long poll
            up.send_signal(signal.SIGINT)  # the create is in flight: its VMs appear after we left
            out, err = up.communicate(timeout=30)
        finally:
            up.kill()
        assert up.returncode == 130, out + err
        assert "interrupted: 'orchestrate down FILE' removes whatever was already made" in err
        assert "Traceback" not in err
        down = cli("down", str(path), home=orchestrate_home, endpoint=fake.url)
        out, err = down.communicate(timeout=120)
        assert down.returncode == 0, out + err
        assert out.count("removed VM ") == 3 and "removed firewall rule" in out
        fake.wait_idle()
        assert fake.instances() == [] and fake.firewalls() == []


def test_the_example_spec_validates_and_plans_without_touching_the_cloud(orchestrate_home: Path) -> None:
    spec = str(REPO / "cluster_specs" / "gcp.yaml")
    validate = cli("validate", spec, home=orchestrate_home, endpoint="http://127.0.0.1:9")
    assert validate.wait(timeout=60) == 0, validate.communicate()
    plan = cli("plan", spec, "--json", home=orchestrate_home, endpoint="http://127.0.0.1:9")
    out, err = plan.communicate(timeout=60)
    assert plan.returncode == 0, err
    document = json.loads(out)
    tasks = document["tasks"]
    assert [t["host"] for t in tasks] == [f"digits-gcp-{i}" for i in range(4)]
    assert document["creates"] == {
        "vms": [f"digits-gcp-{i}" for i in range(4)], "machine_type": "a2-highgpu-1g",
        "accelerator": None, "zones": ["us-central1-a", "us-central1-c"], "spot": True,
        "image": specs.DLVM_IMAGE, "disk_size_gb": 150, "firewall_rule": "orchestrate-digits-gcp-grpc"}
    assert tasks[0]["endpoint"] == "digits-gcp-0.us-central1-a.c.my-ml-project.internal:23456"
    assert isinstance(for_spec(specs.load(spec), Path(spec)), GcpProvider)


@pytest.mark.parametrize(("provider", "field", "says"), [
    ({"zones": []}, "provider.zones", "at least 1"),
    ({"zones": ["us-central1"]}, "provider.zones", "not a zone name"),
    ({"ssh_via": "external"}, "provider", "external_ip: true"),
    ({"labels": {LABEL: "x"}}, "provider.labels", "set by the orchestrator"),
    ({"metadata": {"ssh-keys": "me:ssh-rsa AAAA"}}, "provider.metadata", "set by the orchestrator"),
    ({"project": "My Project"}, "provider.project", "pattern"),
    ({"root": "relative/dir"}, "provider.root", "absolute"),
    ({"zone": "us-central1-a"}, "provider.zone", "did you mean 'zones'"),
])
def test_bad_gcp_settings_are_refused_naming_the_field(tmp_path: Path, provider: dict[str, object],
                                                       field: str, says: str) -> None:
    path = write_spec(tmp_path, **provider)
    with pytest.raises(SpecError) as info:
        specs.load(path)
    assert f": {field}: " in str(info.value) and says in str(info.value)


# -- Compute Engine as it really answers ---------------------------------------------------
def compute_for(fake: FakeCompute, credentials: Credentials | None = None, deadline_s: float = 30.0,
                sleep: Callable[[float], None] = lambda s: None) -> Compute:
    return Compute(PROJECT, credentials or AnonymousCredentials(), endpoint=fake.url,
                   deadline_s=deadline_s, sleep=sleep)


@pytest.mark.parametrize("summary_only", [False, True], ids=["with-reason", "summary-only"])
def test_a_stockout_behind_the_summary_code_moves_on_to_the_next_zone(
        fake: FakeCompute, tmp_path: Path, summary_only: bool) -> None:
    fake.exhaust("us-central1-a", summary_only=summary_only)
    path = write_spec(tmp_path, zones=["us-central1-a", "us-central1-b"])
    provider = make_provider(path)
    vms = provider.provision()
    assert {vm.zone for vm in vms} == {"us-central1-b"}
    (failure,) = provider.zone_failures
    # the real reason, not the summary: from the operation, or from the per-VM inserts
    assert failure.code == "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS"
    assert "does not have enough resources" in failure.message
    assert "VM_MIN_COUNT_NOT_REACHED" not in provider.notes()[0]
    assert fake.calls["zoneOperations.list"] == (1 if summary_only else 0)


def test_capacity_refused_at_the_request_is_a_zone_failure_not_retried(
        fake: FakeCompute, tmp_path: Path) -> None:
    fake.refuse_capacity("us-central1-a")
    sleeps: list[float] = []
    provider = make_provider(write_spec(tmp_path, zones=["us-central1-a", "us-central1-b"]), sleeps)
    vms = provider.provision()
    assert {vm.zone for vm in vms} == {"us-central1-b"}
    assert [(f.zone, f.code) for f in provider.zone_failures] == [
        ("us-central1-a", "insufficientCapacity")]
    assert fake.calls["instances.bulkInsert"] == 2 and sleeps == []  # no 90 s of retries


def test_a_global_gpu_quota_stops_the_zone_walk_and_says_how_to_request_it(
        fake: FakeCompute, tmp_path: Path) -> None:
    fake.set_global_quota("GPUS_ALL_REGIONS", 0)
    path = write_spec(tmp_path, zones=["us-central1-a", "us-east1-b", "europe-west4-a"],
                      accelerator={"type": "nvidia-tesla-t4", "count": 1})
    with pytest.raises(CapacityError) as info:
        make_provider(path).provision()
    assert fake.calls["instances.bulkInsert"] == 1  # no other region can help
    assert "Limit: 0.0 globally" in str(info.value)
    fix = info.value.fix or ""
    assert "GPUS_ALL_REGIONS" in fix and "global" in fix and "other regions" not in fix
    assert fake.instances() == []


def test_quota_refused_at_the_request_falls_through_to_another_region(
        fake: FakeCompute, tmp_path: Path) -> None:
    fake.set_quota("us-central1", "NVIDIA_T4_GPUS", 0, at_request=True)
    provider = make_provider(write_spec(tmp_path, zones=["us-central1-a", "us-east1-b"]))
    vms = provider.provision()
    assert {vm.zone for vm in vms} == {"us-east1-b"}
    (failure,) = provider.zone_failures
    assert failure.is_quota and "Quota 'NVIDIA_T4_GPUS' exceeded" in failure.message


def test_vms_opt_out_of_os_login_and_get_empty_per_instance_entries(
        fake: FakeCompute, tmp_path: Path) -> None:
    make_provider(write_spec(tmp_path)).provision()
    (create,) = [body for method, _, body in fake.requests if method == "instances.bulkInsert"]
    assert create["perInstanceProperties"] == {f"gcp-test-{i}": {} for i in range(3)}
    for vm in fake.instances():
        metadata = {i["key"]: i["value"] for i in vm["metadata"]["items"]}
        assert metadata["enable-oslogin"] == "FALSE"  # ssh-keys metadata counts only then


def test_host_keys_are_read_as_key_type_and_base64_only(fake: FakeCompute, tmp_path: Path) -> None:
    provider = make_provider(write_spec(tmp_path, workers=1))
    (vm,) = provider.provision()
    fake.wait_idle()
    keys: tuple[str, ...] = ()
    for _ in range(100):
        if keys := provider.compute.host_keys(vm.zone, vm.name):
            break
        time.sleep(0.05)
    assert keys == (fake.host_key("gcp-test-0"),)  # no newline, no key type paramiko lacks


def test_a_suspended_vm_is_resumed_not_started(fake: FakeCompute, tmp_path: Path) -> None:
    provider = make_provider(write_spec(tmp_path))
    provider.provision()
    fake.suspend("gcp-test-1")
    provider.provision()
    assert {vm["status"] for vm in fake.instances()} == {"RUNNING"}
    assert fake.calls["instances.resume"] == 1 and fake.calls["instances.start"] == 0


def test_operation_waits_that_return_early_pause_between_calls(fake: FakeCompute,
                                                               tmp_path: Path) -> None:
    fake.latency_s = 0.6
    fake.early_waits = True  # every operations.wait answers at once, before DONE
    pauses: list[float] = []

    def pause(seconds: float) -> None:
        pauses.append(seconds)
        time.sleep(seconds)

    make_provider(write_spec(tmp_path), pauses).provision()
    waits = [path for method, path, _ in fake.requests if method.endswith("Operations.wait")]
    assert len(waits) > len(set(waits))  # some operation was waited for more than once
    assert len(pauses) >= len(waits) - len(set(waits))  # and every call again came after a pause
    assert all(p > 0 for p in pauses)


def test_a_wait_past_its_deadline_says_the_operation_is_not_done(fake: FakeCompute) -> None:
    fake.latency_s = 8.0  # the operation outlives the deadline; its wait long-polls
    compute = compute_for(fake, deadline_s=1.0)
    rule = compute_v1.Firewall(name="slow-rule", network="global/networks/default")
    ref = compute.insert_firewall(rule)
    with pytest.raises(ProviderError) as info:
        compute.wait(ref, "create firewall rule slow-rule")
    assert "is not done after 1s" in str(info.value)
    assert "cannot reach" not in str(info.value)
    compute.close()


class _Refused(Credentials):  # type: ignore[misc]
    """Credentials whose refresh fails, as expired ADC or an unreachable metadata server do."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    def refresh(self, request: object) -> None:
        raise self.error


@pytest.mark.parametrize(("error", "says"), [
    (RefreshError("invalid_grant: Token has been expired or revoked."), "expired or revoked"),
    (TransportError("Failed to retrieve http://metadata.google.internal/ from the Google "
                    "Compute Engine metadata service."), "metadata service"),
])
def test_credentials_that_cannot_refresh_are_a_clear_error(fake: FakeCompute, error: Exception,
                                                           says: str) -> None:
    compute = compute_for(fake, credentials=_Refused(error))
    with pytest.raises(ProviderError) as info:
        compute.get_vm("us-central1-a", "gcp-test-0")
    assert says in str(info.value)
    assert info.value.fix and "gcloud auth application-default login" in info.value.fix
    compute.close()


def test_a_disabled_compute_api_says_to_enable_it(fake: FakeCompute, tmp_path: Path) -> None:
    fake.disable_api()
    with pytest.raises(ProviderError) as info:
        make_provider(write_spec(tmp_path)).provision()
    assert "has not been used in project" in str(info.value)
    fix = info.value.fix or ""
    assert f"gcloud services enable compute.googleapis.com --project {PROJECT}" in fix
    assert "roles/" not in fix


def test_a_lost_answer_to_a_create_does_not_create_twice(fake: FakeCompute, tmp_path: Path) -> None:
    fake.lose_next("instances.bulkInsert")  # it ran; the retry carries the same requestId
    vms = make_provider(write_spec(tmp_path)).provision()
    assert len(vms) == 3 and fake.calls["instances.bulkInsert"] == 2
    assert len(fake.operations("bulkInsert")) == 1 and len(fake.instances()) == 3


def test_a_second_vm_of_a_name_in_another_zone_is_removed_by_up_and_down(
        fake: FakeCompute, tmp_path: Path, orchestrate_home: Path) -> None:
    path = write_spec(tmp_path, zones=["us-central1-a", "us-central1-b"])
    provider = make_provider(path)
    provider.provision()
    # a create that landed late in the other zone: the same name, the cluster's label
    properties = gce.instance_properties(provider.config, "gcp-test", "us-central1-b", "")
    provider.compute.wait(provider.compute.bulk_insert(
        "us-central1-b", gce.bulk_request(properties, ["gcp-test-1"])), "a late create")
    assert len(fake.instances((LABEL, "gcp-test"))) == 4  # names are unique per zone only
    vms = provider.provision()
    assert {vm.zone for vm in vms} == {"us-central1-a"}
    assert sorted((vm["name"], vm["zone"].rsplit("/", 1)[1]) for vm in fake.instances()) == [
        (f"gcp-test-{i}", "us-central1-a") for i in range(3)]
    provider.compute.wait(provider.compute.bulk_insert(
        "us-central1-b", gce.bulk_request(properties, ["gcp-test-2"])), "another late create")
    down = cli("down", str(path), home=orchestrate_home, endpoint=fake.url)
    out, err = down.communicate(timeout=120)
    assert down.returncode == 0, out + err
    assert out.count("removed VM ") == 4 and fake.instances() == []


def test_ctrl_c_while_up_waits_for_the_vms_to_boot_ends_it_at_once(tmp_path: Path,
                                                                  orchestrate_home: Path) -> None:
    path = write_spec(tmp_path, zones=["us-central1-a"], boot_timeout_s=600)
    with FakeCompute(latency_s=0.05, host_key_delay_s=3600) as fake:  # keys never come
        up = cli("up", str(path), home=orchestrate_home, endpoint=fake.url)
        try:
            wait_for_call(fake, "instances.getGuestAttributes", up)  # three threads polling
            up.send_signal(signal.SIGINT)
            out, err = up.communicate(timeout=30)  # not when the 600 s boot timeout ends
        finally:
            up.kill()
        assert up.returncode == 130, out + err
        assert "Traceback" not in err
        down = cli("down", str(path), home=orchestrate_home, endpoint=fake.url)
        out, err = down.communicate(timeout=120)
        assert down.returncode == 0 and out.count("removed VM ") == 3, out + err
