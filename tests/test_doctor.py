"""`orchestrate doctor`: every host checked in parallel over real SSH, and each problem (an
unreachable host, a port blocked between two hosts, another TensorFlow on one host) named with
its fix."""

from __future__ import annotations

import importlib.metadata
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import REPO, write_spec
from hostlab import HostLab, LabHost

from orchestrator.api import Cluster
from orchestrator.state import Store
from orchestrator.supervisor import Supervisor

PORTS = "ports: {start: 24110, end: 24120}\n"


def cli(*args: str, home: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "ORCHESTRATE_HOME": str(home), "COLUMNS": "200"})


def lab_spec(tmp_path: Path, lab: HostLab, hosts: list[LabHost], name: str) -> Path:
    return write_spec(tmp_path, lab, hosts, f"name: {name}\njob: {{module: examples.digits}}\n"
                      + PORTS)


def test_doctor_checks_this_machine_once_for_the_local_provider(
        tmp_path: Path, orchestrate_home: Path) -> None:
    spec = tmp_path / "c.yaml"
    spec.write_text(f"name: here\nworkers: 2\nworkdir: {REPO}\n"
                    "ports: {start: 24190, end: 24199}\njob: {module: examples.digits}\n")
    proc = cli("doctor", str(spec), home=orchestrate_home)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("doctor: here (local), 1 machine(s) checked in ")
    assert lines[1] == "local-0  127.0.0.1  tasks worker:0, worker:1"
    assert f"python {sys.version.split()[0]} ({sys.executable})" in lines[2]
    assert "tensorflow 2.21" in lines[2] and "tf_keras 2.21" in lines[2]
    assert "GPUs: none (nvidia-smi not found" in proc.stdout  # this machine has no GPU
    assert "ports: 24190 free, 24191 free" in proc.stdout
    assert "global batch 64" in proc.stdout and "network" not in proc.stdout
    assert lines[-1] == "✓ ready to train"


def test_on_jax_the_doctor_checks_jax_and_keras_and_says_what_jax_all_reduces_with(
        tmp_path: Path, orchestrate_home: Path) -> None:
    """No TensorFlow line for a job on JAX: JAX, jaxlib and Keras; with --import-tf, the
    devices JAX lists in a child process of the preflight, and TensorFlow is not imported."""
    spec = tmp_path / "c.yaml"
    spec.write_text(f"name: here-jax\nworkers: 2\nworkdir: {REPO}\n"
                    "ports: {start: 24180, end: 24189}\n"
                    "job: {command: [python, train.py], backend: jax}\n")
    proc = cli("doctor", str(spec), home=orchestrate_home)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    jax, jaxlib, keras = (importlib.metadata.version(d) for d in ("jax", "jaxlib", "keras"))
    assert f"jax {jax} (jaxlib {jaxlib}), keras {keras}" in proc.stdout
    assert "tensorflow" not in proc.stdout
    assert "tasks train on the CPU, collectives gloo" in proc.stdout
    assert proc.stdout.splitlines()[-1] == "✓ ready to train"
    proc = cli("doctor", str(spec), "--json", "--import-tf", home=orchestrate_home)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    (host,) = report["hosts"]
    assert report["backend"] == "jax" and report["problems"] == []
    assert host["facts"]["jax"]["devices"]["backend"] == "cpu"
    assert host["facts"]["tensorflow"]["imported"] is False


def test_a_taken_local_port_is_a_warning_since_train_picks_another(
        tmp_path: Path, orchestrate_home: Path) -> None:
    spec = tmp_path / "c.yaml"
    spec.write_text(f"name: busy\nworkers: 2\nworkdir: {REPO}\n{PORTS}"
                    "job: {module: examples.digits}\n")
    with socket.socket() as taken:
        taken.bind(("", 24110))
        taken.listen()
        proc = cli("doctor", str(spec), "--json", home=orchestrate_home)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] is True and report["replicas"] == 2
    (port_problem,) = report["problems"]
    assert port_problem["check"] == "port" and port_problem["blocking"] is False
    assert "port 24110 on local-0 is in use" in port_problem["message"]
    assert "ss -ltnp" in port_problem["fix"]


@pytest.mark.netns
def test_healthy_hosts_reach_each_others_task_ports_and_ports_open_beyond_them_are_named(
        hostlab: HostLab, tmp_path: Path, orchestrate_home: Path) -> None:
    """This machine is none of the lab's hosts and reaches their task ports: TensorFlow's
    unauthenticated gRPC would be open to it, which is a warning with the firewall rules that
    close it. Applied as written on every host, the rules keep the cluster's own connections
    open and this machine out: no warning is left."""
    hosts = hostlab.hosts(3)
    path = lab_spec(tmp_path, hostlab, hosts, "doc-ok")
    proc = cli("doctor", str(path), "--json", home=orchestrate_home)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    (exposure,) = report["problems"]
    assert exposure["check"] == "exposure" and exposure["blocking"] is False
    assert exposure["hosts"] == [f"doc-ok-{i}" for i in range(3)]
    assert all(f"{h.address}:24110" in exposure["message"] for h in hosts)
    rules = exposure["fix"].split("e.g. on each host: ")[1].split(" (or ")[0].split("; ")
    assert len(rules) == 4 and all(r.startswith("sudo iptables -A INPUT") for r in rules)

    # The report passed: it is kept with its warning, which the next train shows again (as
    # found then) instead of checking every host again.
    cluster = Cluster.from_spec(path)
    kept = cluster.kept_pass()
    assert kept is not None and [(w.check, w.message, w.fix, w.hosts) for w in kept.warnings] \
        == [("exposure", exposure["message"], exposure["fix"], tuple(exposure["hosts"]))]
    supervisor = Supervisor(cluster.spec, cluster.provider, cluster.store,
                            workdir=cluster.workdir)
    assert cluster._checked(supervisor, recheck=False, on_doctor=None) == [0, 0, 0]
    said, warning = supervisor.view.messages
    assert "doctor: passed" in said and "with 1 warning(s), shown again below" in said
    assert warning == f"! warning exposure: {exposure['message']}\n    fix: {exposure['fix']}"
    cluster.provider.close()
    try:
        for h in hosts:
            for rule in rules:
                done = h.run(rule.removeprefix("sudo ").split())
                assert done.returncode == 0, done.stderr
        proc = cli("doctor", str(path), home=orchestrate_home)
    finally:
        for h in hosts:
            h.run(["iptables", "-F", "INPUT"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "network: 6 of 6 connections open" in proc.stdout
    for i, h in enumerate(hosts):
        assert f"doc-ok-{i}  {h.address}  tasks worker:{i}" in proc.stdout
    assert proc.stdout.count("ports: 24110 free") == 3
    assert proc.stdout.rstrip().endswith("✓ ready to train")
    provider = Cluster.from_spec(path).provider  # the doctor's connections left the ports free
    assert provider.busy_ports(provider.hosts()) == set()
    kept = Cluster.from_spec(path).kept_pass()  # the clean report replaced the kept one
    assert kept is not None and kept.warnings == ()


@pytest.mark.netns
def test_an_unreachable_host_is_named_with_the_fix(hostlab: HostLab, tmp_path: Path,
                                                   orchestrate_home: Path) -> None:
    hosts = hostlab.hosts(3)
    path = lab_spec(tmp_path, hostlab, hosts, "doc-cut")
    hosts[2].cut()
    try:
        report = Cluster.from_spec(path).doctor()
    finally:
        hosts[2].restore()
    (problem,) = report.blocking
    assert problem.check == "ssh" and problem.hosts == ("doc-cut-2",)
    assert problem.message.startswith(f"doc-cut-2 ({hosts[2].address}) cannot be reached over SSH")
    assert "check that the host is up" in problem.fix
    checked = {link.source: link.ok for link in report.links if link.ok is not None}
    assert checked == {"doc-cut-0": True, "doc-cut-1": True}  # the other two still checked
    assert [link.error for link in report.links if link.target == "worker:2"] == [
        "not checked: doc-cut-2 did not answer"] * 2


@pytest.fixture
def blocked_port(hostlab: HostLab) -> Iterator[tuple[LabHost, LabHost]]:
    """Host 0 cannot open TCP connections to port 24110 of host 1 (a policy-routing rule in
    host 0's namespace); every other path stays open."""
    hostlab.require_partition()
    source, target = hostlab.hosts(2)
    rule = ["rule", "add", "to", target.address, "ipproto", "tcp", "dport", "24110", "prohibit"]
    added = subprocess.run(["ip", "-n", str(source.namespace), *rule], capture_output=True,
                           text=True)
    if added.returncode != 0:
        pytest.skip(f"this kernel or iproute2 cannot block one port: {added.stderr.strip()}")
    try:
        yield source, target
    finally:
        rule[1] = "del"
        subprocess.run(["ip", "-n", str(source.namespace), *rule], check=True)


@pytest.mark.netns
def test_a_port_blocked_between_two_hosts_fails_doctor_and_train(
        blocked_port: tuple[LabHost, LabHost], hostlab: HostLab, tmp_path: Path,
        orchestrate_home: Path) -> None:
    source, target = blocked_port
    path = lab_spec(tmp_path, hostlab, [source, target], "doc-port")
    (tmp_path / "code").mkdir()  # a small workdir: 'train' syncs it before the doctor runs
    (tmp_path / "code" / "digits.py").write_text("")
    path.write_text(path.read_text().replace(f"workdir: {REPO}", f"workdir: {tmp_path / 'code'}")
                    .replace("module: examples.digits", "module: digits"))
    proc = cli("doctor", str(path), home=orchestrate_home)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "network: 1 of 2 connections open, 1 blocked" in proc.stdout
    assert (f"✗ blocking network: doc-port-0 cannot open a TCP connection to worker:1 at "
            f"{target.address}:24110: Permission denied") in proc.stdout
    assert f"fix: allow TCP from {source.address} to {target.address} on ports 24110-24120" \
        in proc.stdout
    train = cli("train", str(path), home=orchestrate_home)
    assert train.returncode == 2 and "Traceback" not in train.stderr
    assert "error: doctor found 1 blocking problem(s) in cluster 'doc-port'" in train.stderr
    assert "--no-doctor" in train.stderr
    assert Store(orchestrate_home / "state.db").runs("doc-port") == []  # no task was started


def fake_tensorflow(root: Path, version: str) -> Path:
    """A directory holding another TensorFlow install, as ``pip install --target`` leaves it."""
    (root / "tensorflow").mkdir(parents=True)
    (root / "tensorflow" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    dist = root / f"tensorflow-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: tensorflow\nVersion: {version}\n")
    return root


@pytest.mark.ssh
def test_another_tensorflow_on_one_host_is_blocking(hostlab: HostLab, tmp_path: Path,
                                                    orchestrate_home: Path) -> None:
    hosts = hostlab.hosts(3)
    old = fake_tensorflow(tmp_path / "tf-old", "2.20.0")
    python = tmp_path / "python"  # one interpreter path for every host, as a spec gives it
    python.write_text(
        "#!/bin/sh\n"
        f'case "$SSH_CONNECTION" in *" {hosts[2].address} "*)\n'
        f'  export PYTHONPATH="{old}${{PYTHONPATH:+:$PYTHONPATH}}";; esac\n'
        f'exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    path = lab_spec(tmp_path, hostlab, hosts, "doc-tf")
    path.write_text(path.read_text().replace(f"python: {sys.executable}", f"python: {python}"))
    report = Cluster.from_spec(path).doctor()
    assert [h.tf_version for h in report.hosts] == ["2.21.0", "2.21.0", "2.20.0"]
    versions = next(p for p in report.blocking if p.check == "tensorflow")
    assert versions.message.startswith(
        "TensorFlow versions differ: 2.21.0 on doc-tf-0, doc-tf-1; 2.20.0 on doc-tf-2")
    assert versions.hosts == ("doc-tf-2",)
    assert versions.fix.startswith("install TensorFlow 2.21.0 on doc-tf-2")
    assert f"({python} -m pip install 'tensorflow==2.21.0')" in versions.fix
    # its tf_keras follows from it; the lab's task ports are open to this machine (see above)
    assert [p.check for p in report.problems] == ["tensorflow", "exposure"]


@pytest.mark.netns
def test_on_jax_a_host_whose_name_resolves_to_loopback_is_blocking(
        hostlab: HostLab, tmp_path: Path, orchestrate_home: Path) -> None:
    hosts = hostlab.hosts(2)
    path = write_spec(tmp_path, hostlab, hosts, "name: doc-jax\n"
                      "job: {command: [python, train.py], backend: jax}\n" + PORTS)
    hosts[1].map_hostname("127.0.1.1")  # as Debian's installer leaves /etc/hosts
    try:
        report = Cluster.from_spec(path).doctor()
    finally:
        hosts[1].map_hostname()
    name = socket.gethostname()  # the lab's hosts share this machine's
    (problem,) = report.blocking
    assert problem.check == "hostname" and problem.hosts == ("doc-jax-1",)
    assert problem.message.startswith(f"doc-jax-1's host name {name!r} resolves to 127.0.1.1, "
                                      "a loopback address")
    assert problem.fix == (f"in /etc/hosts on doc-jax-1, map {name} to the address the other "
                           f"hosts reach it at ({hosts[1].address}): replace the line "
                           f"'127.0.1.1 ... {name}' with '{hosts[1].address} {name}'")
    assert report.hosts[0].fact("hostname_lookup", "bindable") == hosts[0].address
