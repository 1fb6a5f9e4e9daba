"""The provider registry, and what every SSH-reached provider shares: the host cache, the cluster's
key pair and private files written whole."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import write_spec
from hostlab import HostLab

from orchestrator import paths
from orchestrator import spec as specs
from orchestrator.errors import ProviderError
from orchestrator.files import write_atomic
from orchestrator.hosts import Host, SSHEndpoint
from orchestrator.providers import REGISTRY, Provider, for_spec, provider_class
from orchestrator.providers.gcp.provider import GcpProvider
from orchestrator.providers.local import LocalProvider
from orchestrator.providers.ssh_hosts import host_from_json, host_to_json, port_opens
from orchestrator.providers.static import StaticProvider

REPO = Path(__file__).resolve().parent.parent


def gcp_spec(tmp_path: Path, **provider: object) -> Path:
    path = tmp_path / "gcp.yaml"
    path.write_text(json.dumps({
        "name": "cached", "workers": 2, "workdir": str(REPO), "job": {"module": "examples.digits"},
        "provider": {"kind": "gcp", "project": "test-project", "zones": ["us-central1-a"], **provider},
    }))
    return path


def test_the_registry_names_exactly_the_spec_provider_models() -> None:
    assert {r.model for r in REGISTRY.values()} == set(specs.PROVIDER_MODELS)
    for kind, registered in REGISTRY.items():
        assert registered.model.model_fields["kind"].default == kind
        assert specs.UNION_MEMBERS[kind] is registered.model
        cls = provider_class(kind)
        assert issubclass(cls, Provider) and cls.kind == kind


def test_an_unknown_kind_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ProviderError) as info:
        provider_class("azure")
    assert "'azure'" in str(info.value) and info.value.fix and "local, static, gcp" in info.value.fix


def test_importing_the_providers_loads_no_cloud_or_ssh_package() -> None:
    code = ("import sys\nimport orchestrator.providers\n"
            "print(sorted(n for n in ('paramiko', 'google.cloud.compute_v1') if n in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.stdout.strip() == "[]", proc.stderr


def test_for_spec_builds_the_provider_of_the_spec_kind(tmp_path: Path) -> None:
    local = specs.parse("name: here\njob: {module: examples.digits}\n")
    assert isinstance(for_spec(local, tmp_path / "c.yaml"), LocalProvider)
    path = gcp_spec(tmp_path)
    assert isinstance(for_spec(specs.load(path), path), GcpProvider)


def test_only_gcp_describes_machines_it_creates(tmp_path: Path) -> None:
    local = specs.parse("name: here\njob: {module: examples.digits}\n")
    assert for_spec(local, tmp_path / "c.yaml").describe() is None
    path = gcp_spec(tmp_path, accelerator={"type": "nvidia-l4"})
    described = for_spec(specs.load(path), path).describe()
    assert described is not None
    assert described["vms"] == ["cached-0", "cached-1"]
    assert described["accelerator"] == {"type": "nvidia-l4", "count": 1}
    assert described["firewall_rule"] == "orchestrate-cached-grpc"


def test_a_host_survives_its_round_trip_through_json() -> None:
    host = Host(name="h-0", address="10.0.0.2", root="/home/u/.orchestrate/clusters/c",
                ssh=SSHEndpoint(address="34.1.2.3", user="u", port=2222, key_file="/k",
                                host_keys=("ssh-ed25519 AAAA",), connect_timeout_s=3.0),
                task_port=24000, labels=(("zone", "us-central1-a"),))
    assert host_from_json(json.loads(json.dumps(host_to_json(host)))) == host
    local = Host(name="local-0", address="127.0.0.1", root="/r")
    assert host_from_json(json.loads(json.dumps(host_to_json(local)))) == local


def test_a_later_command_reads_the_vms_up_reached_from_the_host_cache(tmp_path: Path) -> None:
    path = gcp_spec(tmp_path)
    first = GcpProvider(specs.load(path), path)
    reached = Host(name="cached-1", address="10.0.0.7", root="/home/orchestrate/x",
                   ssh=SSHEndpoint(address="10.0.0.7", user="orchestrate", key_file=first.key_file,
                                   host_keys=("ssh-ed25519 AAAA",)),
                   labels=(("zone", "us-central1-a"),))
    first.remember(reached)
    first.save_hosts(first.vm_names)
    assert paths.hosts_cache("cached", "gcp") == first.hosts_file

    path.write_text(path.read_text().replace('"zones"', '"connect_timeout_s": 4, "zones"'))
    later = GcpProvider(specs.load(path), path).hosts()
    assert later[0].address == "cached-0.us-central1-a.c.test-project.internal"  # never reached
    assert later[1] == Host(  # as cached, reached the way the spec says now
        name="cached-1", address="10.0.0.7", root="/home/orchestrate/x",
        ssh=SSHEndpoint(address="10.0.0.7", user="orchestrate", key_file=first.key_file,
                        host_keys=("ssh-ed25519 AAAA",), connect_timeout_s=4.0),
        labels=(("zone", "us-central1-a"),))


def test_a_host_cache_written_by_the_earlier_gcp_provider_is_still_read(tmp_path: Path) -> None:
    path = gcp_spec(tmp_path)
    provider = GcpProvider(specs.load(path), path)
    provider.hosts_file.parent.mkdir(parents=True)
    provider.hosts_file.write_text(json.dumps({"hosts": [
        {"name": "cached-0", "address": "10.0.0.5", "root": "/home/orchestrate/r",
         "zone": "us-central1-a", "ssh_address": "10.0.0.5", "host_keys": ["ssh-ed25519 AAAA"]}],
        "zone_failures": []}))
    assert provider.hosts()[0] == Host(
        name="cached-0", address="10.0.0.5", root="/home/orchestrate/r",
        ssh=SSHEndpoint(address="10.0.0.5", user="orchestrate", key_file=provider.key_file,
                        host_keys=("ssh-ed25519 AAAA",)),
        labels=(("zone", "us-central1-a"),))


def test_an_unreadable_host_cache_counts_as_none(tmp_path: Path) -> None:
    path = gcp_spec(tmp_path)
    provider = GcpProvider(specs.load(path), path)
    provider.hosts_file.parent.mkdir(parents=True)
    provider.hosts_file.write_text('{"hosts": [{"name": "cached-0"}]}')
    assert [h.address for h in provider.hosts()] == [
        f"cached-{i}.us-central1-a.c.test-project.internal" for i in range(2)]


def test_the_roots_up_recorded_list_static_hosts_at_the_same_address_and_user(
        tmp_path: Path) -> None:
    """A later command lists a host that is down by the root 'up' recorded for it, while the
    spec still reaches it at that address as that user; a moved host, another user or a
    provider.root of the spec's own is asked (or read from the spec) again."""
    key = tmp_path / "id"
    key.write_text("not read here")
    path = tmp_path / "static.yaml"
    text = (f"name: s\nworkers: 3\nworkdir: {REPO}\njob: {{module: examples.digits}}\n"
            "provider:\n  kind: static\n  hosts:\n"
            + "".join(f"    - {{address: 192.0.2.{i}, user: u, key_file: {key}}}\n"
                      for i in (1, 2, 3)))
    path.write_text(text)
    provider = StaticProvider(specs.load(path), path)
    root = "/home/u/.orchestrate/clusters/s"
    provider.save_hosts([], extra={"roots": {
        "s-0": {"address": "192.0.2.1", "user": "u", "root": root},
        "s-1": {"address": "192.0.2.9", "user": "u", "root": root},  # the host moved since
        "s-2": {"address": "192.0.2.3", "user": "v", "root": "/home/v/x"}}})  # another user
    assert provider._recorded_roots(provider._unrooted()) == {"s-0": root}
    path.write_text(text.replace("  kind: static\n", "  kind: static\n  root: /data/s\n"))
    rooted = StaticProvider(specs.load(path), path)
    assert rooted._recorded_roots(rooted._unrooted()) == {}
    assert {h.root for h in rooted.hosts()} == {"/data/s"}  # no host asked


def test_the_cluster_key_pair_is_private_and_made_once(tmp_path: Path) -> None:
    path = gcp_spec(tmp_path)
    provider = GcpProvider(specs.load(path), path)
    keys = provider.key_pair()
    assert str(keys.private_path) == provider.key_file and keys.public_line.startswith("ssh-ed25519 ")
    assert stat.S_IMODE(os.stat(provider.key_file).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(keys.private_path.parent).st_mode) == 0o700
    assert provider.key_pair() == keys
    provider.remove_key_pair()
    assert not keys.private_path.parent.exists()


def test_write_atomic_replaces_the_file_whole_and_private(tmp_path: Path) -> None:
    target = tmp_path / "known_hosts"
    target.write_text("old\n")
    os.chmod(target, 0o644)
    write_atomic(target, "new\n")
    assert target.read_text() == "new\n" and stat.S_IMODE(target.stat().st_mode) == 0o600
    write_atomic(target, "public\n", mode=0o644)
    assert stat.S_IMODE(target.stat().st_mode) == 0o644


def test_write_atomic_that_fails_leaves_the_old_file_and_no_temp_file(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    target.write_text("old")
    with pytest.raises(UnicodeEncodeError):
        write_atomic(target, "\udcff")
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["state.json"]


@pytest.mark.ssh
@pytest.mark.netns
def test_busy_ports_of_ssh_hosts_name_the_port_another_program_holds(hostlab: HostLab,
                                                                      tmp_path: Path) -> None:
    hosts = hostlab.hosts(2)
    path = write_spec(tmp_path, hostlab, hosts,
                      "name: probe\nports: {start: 24130, end: 24140}\njob: {module: examples.digits}\n")
    code = ("import socket, time; s = socket.socket(); s.bind(('', 24131)); s.listen(); "
            "print('bound', flush=True); time.sleep(600)")
    squatter = subprocess.Popen(["ip", "netns", "exec", str(hosts[1].namespace), sys.executable,
                                 "-c", code], stdout=subprocess.PIPE)
    provider = for_spec(specs.load(path), path)
    try:
        assert squatter.stdout is not None and squatter.stdout.readline()
        assert provider.busy_ports(provider.hosts()) == {(hosts[1].address, 24131)}
    finally:
        provider.close()
        squatter.kill()
        squatter.wait()


def test_port_opens_sees_a_listener_and_gives_up_on_a_closed_port_at_its_deadline() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        assert port_opens("127.0.0.1", listener.getsockname()[1], time.monotonic() + 5)
        port = listener.getsockname()[1]
    assert not port_opens("127.0.0.1", port, time.monotonic() + 0.6)  # refused every time


@pytest.mark.ssh
@pytest.mark.netns
def test_a_static_host_cut_off_is_repaired_once_back_and_one_cut_for_good_is_named(
        hostlab: HostLab, tmp_path: Path) -> None:
    """The static provider's repair waits for the host (its SSH port probed afresh, not one
    connect waiting on the kernel's SYN resends) and prepares it alone."""
    hosts = hostlab.hosts(2)
    path = write_spec(tmp_path, hostlab, hosts, "name: mend\njob: {module: examples.digits}\n")
    provider = for_spec(specs.load(path), path)
    try:
        provider.up()
        cut = provider.hosts()[1]
        marker = f"{cut.root}/code/examples/digits.py"
        provider.runner(cut).run(f"rm -rf {cut.root}/code")  # as a wiped machine would have
        hosts[1].cut()
        back = threading.Timer(1.0, hosts[1].restore)
        back.start()
        try:
            repaired = provider.repair(cut, deadline_s=30)
        finally:
            back.join()
        assert repaired.name == cut.name and repaired.address == cut.address
        assert provider.runner(repaired).run(f"test -f {marker}", check=False).ok
        hosts[1].cut()
        try:
            with pytest.raises(ProviderError) as caught:
                provider.repair(cut, deadline_s=1)
        finally:
            hosts[1].restore()
        assert f"host {cut.name} ({cut.address}) did not come back within 1s" in caught.value.message
        assert caught.value.fix and "bring the machine back" in caught.value.fix
    finally:
        provider.close()
