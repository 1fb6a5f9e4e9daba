"""The doctor of a gcp cluster: the spec against Compute Engine's catalog (through the real
google-cloud-compute client and the HTTP fake), and no SSH to VMs that do not exist yet."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_compute import FakeCompute
from helpers import GCP_PROJECT, write_gcp_spec

from orchestrator import doctor as doctoring
from orchestrator import spec as specs
from orchestrator.api import Cluster
from orchestrator.doctor import DoctorReport
from orchestrator.hosts import Host
from orchestrator.problems import Problem
from orchestrator.providers.gcp import exposure
from orchestrator.providers.gcp.catalog import CHECK
from orchestrator.providers.gcp.compute import ENDPOINT_ENV
from orchestrator.providers.gcp.provider import GcpProvider

REPO = Path(__file__).resolve().parent.parent
PROJECT = GCP_PROJECT
FAMILY = "common-cu128-ubuntu-2204-nvidia-570"
T4 = {"type": "nvidia-tesla-t4", "count": 2}


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCompute]:
    with FakeCompute(latency_s=0.05, boot_s=0.05) as server:
        monkeypatch.setenv(ENDPOINT_ENV, server.url)
        yield server


write_spec = write_gcp_spec


def doctor(path: Path) -> DoctorReport:
    return Cluster.from_spec(path).doctor()


def doctor_cli(path: Path, home: Path, fake: FakeCompute
               ) -> tuple[subprocess.CompletedProcess[str], str]:
    """``orchestrate doctor PATH`` as a user runs it, against the fake: (process, its output)."""
    done = subprocess.run([sys.executable, "-m", "orchestrator.cli", "doctor", str(path)],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "ORCHESTRATE_HOME": str(home),
                               ENDPOINT_ENV: fake.url})
    return done, done.stdout + done.stderr


def catalog(report: DoctorReport) -> list[Problem]:
    return [p for p in report.problems if p.check == CHECK]


@pytest.mark.parametrize(("state", "says", "blocking"), [
    ("DEPRECATED", "is DEPRECATED", False),  # still boots: a warning
    ("OBSOLETE", "is OBSOLETE", True),
    (None, "does not exist", True),
])
def test_a_retired_image_family_is_named_with_provider_image(
        fake: FakeCompute, tmp_path: Path, state: str | None, says: str, blocking: bool) -> None:
    fake.retire_image(FAMILY, state)
    report = doctor(write_spec(tmp_path))
    (problem,) = catalog(report)
    assert problem.blocking is blocking
    assert f"provider.image {specs.DLVM_IMAGE}" in problem.message and says in problem.message
    assert "gcloud compute images list --project deeplearning-platform-release " \
           "--no-standard-images" in problem.fix
    if state is None:
        assert f"describe-from-family {FAMILY}" in problem.fix
    assert fake.calls["images.getFromFamily"] == 1 and fake.calls["images.get"] == 0


def test_a_deprecated_image_names_its_replacement(fake: FakeCompute, tmp_path: Path) -> None:
    image = "projects/debian-cloud/global/images/debian-12-bookworm-v20240110"
    fake.retire_image(image, "DEPRECATED", replacement="projects/debian-cloud/global/images/new")
    (problem,) = catalog(doctor(write_spec(tmp_path, image=image)))
    assert not problem.blocking and f"provider.image {image}: it is DEPRECATED" in problem.message
    assert problem.fix == "use its replacement projects/debian-cloud/global/images/new"
    assert fake.calls["images.get"] == 1 and fake.calls["images.getFromFamily"] == 0


@pytest.mark.parametrize(("withhold", "field", "listing"), [
    ("accelerator", "provider.accelerator.type",
     "gcloud compute accelerator-types list --filter=zone:us-central1-a"),
    ("machine_type", "provider.machine_type", "gcloud compute machine-types list --zones us-central1-a"),
])
def test_a_zone_without_the_gpu_or_machine_type_warns_while_another_zone_has_it(
        fake: FakeCompute, tmp_path: Path, withhold: str, field: str, listing: str) -> None:
    zones = ["us-central1-a", "us-central1-b"]
    path = write_spec(tmp_path, zones=zones, accelerator=T4)
    lack = ((lambda z: fake.withhold_accelerator(z, "nvidia-tesla-t4")) if withhold == "accelerator"
            else (lambda z: fake.withhold(z, "n1-standard-8")))
    lack("us-central1-a")
    (problem,) = catalog(doctor(path))
    assert not problem.blocking
    assert "zone us-central1-a" in problem.message and field in problem.message
    assert "it can in us-central1-b" in problem.message
    assert listing in problem.fix and "remove us-central1-a from provider.zones" in problem.fix
    lack("us-central1-b")
    problems = catalog(doctor(path))
    assert [p.blocking for p in problems] == [True, True]
    assert [z for p in problems for z in zones if f"zone {z} " in p.message] == zones
    assert all(field in p.message for p in problems)


def test_more_gpus_than_a_vm_takes_is_blocking(fake: FakeCompute, tmp_path: Path) -> None:
    path = write_spec(tmp_path, accelerator={"type": "nvidia-tesla-t4", "count": 16})
    (problem,) = catalog(doctor(path))
    assert problem.blocking
    assert "at most 8 nvidia-tesla-t4" in problem.message
    assert "provider.accelerator.count is 16" in problem.message
    assert "set provider.accelerator.count to 8 or fewer" in problem.fix


def test_permission_denied_is_one_clear_blocking_problem(fake: FakeCompute, tmp_path: Path) -> None:
    fake.deny("compute.images.getFromFamily")
    report = doctor(write_spec(tmp_path, zones=["us-central1-a", "us-central1-b"], accelerator=T4))
    (problem,) = catalog(report)
    assert problem.blocking and problem.message.startswith(
        "cannot check the Compute Engine catalog: ")
    assert "Required 'compute.images.getFromFamily' permission" in problem.message
    assert "roles/compute.instanceAdmin.v1" in problem.fix
    assert fake.calls["images.getFromFamily"] == 1  # 403 is not retried
    assert fake.calls["machineTypes.get"] == 0  # one problem, not one per call


def test_an_unreachable_api_is_one_blocking_problem(monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path) -> None:
    monkeypatch.setenv(ENDPOINT_ENV, "http://127.0.0.1:9")  # nothing listens there
    path = write_spec(tmp_path)
    sleeps: list[float] = []
    check = GcpProvider(specs.load(path), path, sleep=sleeps.append).cloud_check()
    problem = next(p for p in check.problems if p.check == CHECK)
    assert problem.blocking and "cannot reach Compute Engine" in problem.message
    assert problem.fix == "check this machine's network and try again"
    assert sleeps  # retried (with the recorder's backoff) before giving up


def test_a_healthy_catalog_gives_no_catalog_problem(fake: FakeCompute, tmp_path: Path) -> None:
    zones = ["us-central1-a", "us-central1-b"]
    report = doctor(write_spec(tmp_path, zones=zones, accelerator=T4))
    assert catalog(report) == []
    assert fake.calls["images.getFromFamily"] == 1
    assert fake.calls["machineTypes.get"] == fake.calls["acceleratorTypes.get"] == len(zones)
    (missing,) = report.problems  # only: the VMs are not made yet
    assert missing.check == "gcp vms" and missing.blocking
    assert report.hosts == () and report.links == ()  # no SSH to the planned names


def test_doctor_before_up_says_run_up_and_tries_no_ssh(fake: FakeCompute, tmp_path: Path,
                                                       orchestrate_home: Path) -> None:
    path = write_spec(tmp_path)
    done, out = doctor_cli(path, orchestrate_home, fake)
    assert done.returncode == 1, out
    assert "Traceback" not in out
    assert "the VMs of cluster 'gcp-test' do not exist yet" in out
    assert f"run 'orchestrate up {path}' first" in out
    assert "0 machine(s) checked" in out and "cannot be reached" not in out
    assert fake.calls["images.getFromFamily"] == 1  # the catalog was checked


def test_vms_up_has_reached_are_not_reported_missing(fake: FakeCompute, tmp_path: Path) -> None:
    path = write_spec(tmp_path)
    provider = GcpProvider(specs.load(path), path)
    provider.remember(Host(name="gcp-test-0", address="10.128.0.2", root="/r"))
    check = provider.cloud_check()
    assert check.unprovisioned == ("gcp-test-1", "gcp-test-2")
    (missing,) = [p for p in check.problems if p.check == "gcp vms"]
    assert missing.message.startswith("VM(s) gcp-test-1, gcp-test-2 of cluster 'gcp-test' ")
    for name in ("gcp-test-1", "gcp-test-2"):
        provider.remember(Host(name=name, address="10.128.0.3", root="/r"))
    assert provider.cloud_check().problems == ()
    fake.retire_image(FAMILY, "OBSOLETE")  # the VMs exist: it matters only for a re-created one
    (retired,) = provider.cloud_check().problems
    assert not retired.blocking and "when one is re-created" in retired.message


def test_the_doctor_checks_only_the_machines_that_exist(fake: FakeCompute, tmp_path: Path) -> None:
    cluster = Cluster.from_spec(write_spec(tmp_path))
    plan = cluster.plan()
    machines = doctoring.machines_of(plan, cluster.provider.python)
    assert [m.name for m in doctoring.existing(plan, machines, ())] == [
        "gcp-test-0", "gcp-test-1", "gcp-test-2"]
    assert [m.name for m in doctoring.existing(plan, machines, {"gcp-test-1"})] == [
        "gcp-test-0", "gcp-test-2"]
    assert doctoring.existing(plan, machines, {"gcp-test-0"}) == []  # the chief's is missing


# -- firewall rules wider than the cluster's own -------------------------------------------------
TAG = "orchestrate-gcp-test"
PORTS = f"{specs.PortRange().start}-{specs.PortRange().end}"  # the spec's default range


def firewall_problems(report: DoctorReport) -> list[Problem]:
    return [p for p in report.problems if p.check == exposure.CHECK]


def rule(name: str, **fields: object) -> dict[str, object]:
    return {"name": name, "allowed": [{"IPProtocol": "tcp", "ports": [PORTS]}], **fields}


@pytest.mark.parametrize(("rules", "named", "sources"), [
    pytest.param([rule("open-all", sourceRanges=["0.0.0.0/0"])], "open-all", "0.0.0.0/0",
                 id="every-instance-from-anywhere"),
    pytest.param([rule("to-us", sourceRanges=["192.168.0.0/16"], targetTags=[TAG])], "to-us",
                 "192.168.0.0/16", id="the-cluster-tag-from-a-range"),
    pytest.param([rule("peers", sourceTags=["web"], targetTags=[TAG])], "peers", "tag web",
                 id="from-another-tag"),
    pytest.param([rule("one-port", sourceRanges=["10.0.0.0/8"],
                       allowed=[{"IPProtocol": "all"}])], "one-port", "10.0.0.0/8",
                 id="all-protocols"),
    pytest.param([rule("other-vms", sourceRanges=["0.0.0.0/0"], targetTags=["web"])], None, "",
                 id="other-targets"),
    pytest.param([rule("elsewhere", sourceRanges=["0.0.0.0/0"], network="other")], None, "",
                 id="another-network"),
    pytest.param([rule("off", sourceRanges=["0.0.0.0/0"], disabled=True)], None, "",
                 id="disabled"),
    pytest.param([rule("ssh", sourceRanges=["0.0.0.0/0"],
                       allowed=[{"IPProtocol": "tcp", "ports": ["22", "8080-8090"]}])], None, "",
                 id="other-ports"),
    pytest.param([rule("cluster-only", sourceTags=[TAG], targetTags=[TAG])], None, "",
                 id="the-cluster-to-itself"),
    pytest.param([rule("open", sourceRanges=["0.0.0.0/0"], priority=2000),
                  {"name": "closed", "priority": 1500, "sourceRanges": ["0.0.0.0/0"],
                   "denied": [{"IPProtocol": "tcp"}]}], None, "", id="denied-above-it"),
    pytest.param([rule("open", sourceRanges=["0.0.0.0/0"], priority=1000),
                  {"name": "too-low", "priority": 1500, "sourceRanges": ["0.0.0.0/0"],
                   "denied": [{"IPProtocol": "tcp"}]}], "open", "0.0.0.0/0",
                 id="denied-below-it"),
    # the list comes in pages of 500: a rule on the third page still counts
    pytest.param([*(rule(f"a-{i:04}", sourceTags=[TAG], targetTags=[TAG]) for i in range(1100)),
                  rule("z-wide", sourceRanges=["0.0.0.0/0"])], "z-wide", "0.0.0.0/0",
                 id="third-page"),
])
def test_a_rule_that_opens_the_task_ports_beyond_the_cluster_is_a_warning(
        fake: FakeCompute, tmp_path: Path, rules: list[dict[str, object]], named: str | None,
        sources: str) -> None:
    for r in rules:
        fake.add_firewall(PROJECT, r)
    found = firewall_problems(doctor(write_spec(tmp_path)))
    if named is None:
        assert found == []
        return
    (problem,) = found
    assert not problem.blocking
    assert problem.message.startswith(f"firewall rule {named} (network default, ")
    assert f"to {sources}: TensorFlow's gRPC server" in problem.message
    assert f"--target-tags {TAG} --priority 1100" in problem.fix
    assert fake.calls["firewalls.list"] == (3 if len(rules) > 1000 else 1)


def test_the_default_networks_internal_rule_is_named_until_the_fixs_deny_rule_exists(
        fake: FakeCompute, tmp_path: Path, orchestrate_home: Path) -> None:
    """A new project's default network lets all of 10.128.0.0/9 reach every port. The doctor
    says so through the CLI, with a gcloud command; the rule that command makes (created here
    through the same client) closes it and the warning goes."""
    fake.add_default_network_rules(PROJECT)
    path = write_spec(tmp_path)
    _, out = doctor_cli(path, orchestrate_home, fake)
    assert "Traceback" not in out
    assert "firewall rule default-allow-internal (network default, priority 65534) also opens " \
           f"TCP {PORTS} of the cluster's VMs to 10.128.0.0/9" in out, out
    assert "default-allow-ssh" not in out and "default-allow-rdp" not in out
    (problem,) = firewall_problems(doctor(path))
    command = problem.fix.split(" (the cluster's")[0].split()
    assert command[:4] == ["gcloud", "compute", "firewall-rules", "create"]
    flags = dict(zip(command[5::2], command[6::2], strict=True))
    assert flags["--action"] == "DENY" and flags["--project"] == PROJECT
    protocol, ports = flags["--rules"].split(":")
    fake.add_firewall(PROJECT, {
        "name": command[4], "network": flags["--network"], "direction": flags["--direction"],
        "priority": int(flags["--priority"]), "sourceRanges": [flags["--source-ranges"]],
        "targetTags": [flags["--target-tags"]],
        "denied": [{"IPProtocol": protocol, "ports": [ports]}]})
    assert firewall_problems(doctor(path)) == []
