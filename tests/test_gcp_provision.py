"""The gcp provider against the HTTP fake of Compute Engine, through the real google-cloud-compute client."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_compute import FakeCompute

from orchestrator import spec as specs
from orchestrator.errors import ProviderError, SpecError
from orchestrator.hosts import Host
from orchestrator.providers import HostHealth, for_spec
from orchestrator.providers.gcp.compute import ENDPOINT_ENV
from orchestrator.providers.gcp.instance import CapacityError
from orchestrator.providers.gcp.provider import GcpProvider
from orchestrator.providers.keys import PRIVATE_NAME

REPO = Path(__file__).resolve().parent.parent
PROJECT = "test-project"
LABEL = "orchestrate-cluster"


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCompute]:
    with FakeCompute(latency_s=0.05, boot_s=0.05) as server:
        monkeypatch.setenv(ENDPOINT_ENV, server.url)
        yield server


def write_spec(tmp_path: Path, name: str = "gcp-test", workers: int = 3, **provider: object) -> Path:
    settings = {"kind": "gcp", "project": PROJECT, "zones": ["us-central1-a"], **provider}
    path = tmp_path / f"{name}.yaml"
    path.write_text(json.dumps({
        "name": name, "workers": workers, "workdir": str(REPO),
        "provider": settings, "job": {"module": "examples.digits"},
    }))
    return path


def make_provider(path: Path, sleeps: list[float] | None = None) -> GcpProvider:
    record = sleeps.append if sleeps is not None else (lambda s: None)
    return GcpProvider(specs.load(path), path, sleep=record)


def cli(*args: str, home: Path, endpoint: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "orchestrator.cli", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "ORCHESTRATE_HOME": str(home),
                                 ENDPOINT_ENV: endpoint})


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
        ("us-central1-a", "ZONE_RESOURCE_POOL_EXHAUSTED"), ("us-east1-b", "QUOTA_EXCEEDED")]
    assert "NVIDIA_T4_GPUS" in provider.zone_failures[1].message
    assert fake.calls["instances.bulkInsert"] == 3  # one per zone tried, not one per VM
    notes = provider.notes()  # what 'orchestrate up' prints
    assert notes[0].startswith("zone us-central1-a refused the VMs (ZONE_RESOURCE_POOL_EXHAUSTED)")
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


def test_down_after_ctrl_c_during_up_leaves_nothing_behind(tmp_path: Path,
                                                           orchestrate_home: Path) -> None:
    path = write_spec(tmp_path, zones=["us-central1-a"])
    with FakeCompute(latency_s=1.0) as fake:
        up = cli("up", str(path), home=orchestrate_home, endpoint=fake.url)
        deadline = time.monotonic() + 60
        while fake.calls["instances.bulkInsert"] == 0:
            assert up.poll() is None and time.monotonic() < deadline, up.communicate()
            time.sleep(0.05)
        up.send_signal(signal.SIGINT)  # the create is in flight: its VMs appear after we left
        assert up.wait(timeout=60) == 130
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
