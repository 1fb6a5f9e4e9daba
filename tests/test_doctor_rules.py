"""The doctor's rules, table-tested on what hosts answer; and the preflight's reading of
nvidia-smi, with a stand-in that prints what the real one prints on a GPU machine (this
machine has none)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from orchestrator import plan as planning
from orchestrator.console import doctor_line, render_doctor
from orchestrator.doctor import DoctorReport, HostCheck, diagnose
from orchestrator.hosts import Host, SSHEndpoint
from orchestrator.problems import Problem
from orchestrator.spec import parse
from worker import preflight

REPO = Path(__file__).resolve().parent.parent
A100 = {"smi": "/usr/bin/nvidia-smi", "driver": "570.124.06", "cuda": "12.8", "error": None,
        "gpus": [{"name": "NVIDIA A100-SXM4-40GB", "memory_mib": 40960, "driver": "570.124.06"}]}
T4 = {"smi": "/usr/bin/nvidia-smi", "driver": "470.256.02", "cuda": "11.4", "error": None,
      "gpus": [{"name": "Tesla T4", "memory_mib": 15360, "driver": "470.256.02"}]}
NO_GPU: dict[str, Any] = {"smi": None, "driver": None, "cuda": None, "gpus": [],
                          "error": "nvidia-smi not found"}


def facts(tf: str | None = "2.21.0", keras: str | None = "2.21.0", nvidia: Any = NO_GPU,
          tf_gpus: list[str] | None = None, free_gib: float = 100.0, python: str = "3.11.7",
          port_free: bool = True) -> dict[str, Any]:
    return {
        "python": {"version": python, "executable": "/opt/venv/bin/python"},
        "tensorflow": {"version": tf, "cuda_build": True, "cuda": "12.5.1", "cudnn": "9",
                       "imported": tf_gpus is not None, "error": None if tf else "No module",
                       "gpus": None if tf_gpus is None else [{"name": n} for n in tf_gpus]},
        "tf_keras": {"version": keras},
        "nvidia": nvidia,
        "disk": {"path": "/home/ml/.orchestrate/clusters/c", "free_bytes": int(free_gib * 2**30),
                 "total_bytes": 2**40},
        "ports": [{"port": 23456, "free": port_free, "error": None if port_free else
                   "OSError: Address already in use", "heard_from": []}],
        "peers": [],
    }


def problems_for(*answers: dict[str, Any], job: str = "{module: m}") -> list[tuple[str, bool, str]]:
    """(check, blocking, message) of every problem diagnosed for hosts h0, h1, ... that answered."""
    spec = parse(f"name: c\nworkers: {len(answers)}\njob: {job}\n")
    hosts = [Host(f"h{i}", f"10.0.0.{i + 1}", "/r", ssh=SSHEndpoint(f"10.0.0.{i + 1}", "ml"))
             for i in range(len(answers))]
    plan = planning.build(spec, hosts, run_id="r", python="python3", local_workdir="/w")
    checks = [HostCheck(h.name, h.address, (t.key,), "python3", True, facts=a)
              for h, t, a in zip(hosts, plan.tasks, answers, strict=True)]
    return [(p.check, p.blocking, p.message) for p in diagnose(spec, plan, checks, [])]


@pytest.mark.parametrize(("answers", "expected"), [
    pytest.param([facts(), facts()], [], id="healthy CPU hosts"),
    pytest.param([facts(tf=None), facts()],
                 [("tensorflow", True, "TensorFlow is not installed for python3 on h0")],
                 id="no TensorFlow"),
    pytest.param([facts(keras=None), facts()],
                 [("tf_keras", True, "tf_keras is not installed on h0")], id="no tf_keras"),
    pytest.param([facts(keras="2.20.1"), facts()],
                 [("tf_keras", True, "tf_keras 2.20.1 does not match TensorFlow 2.21.0 on h0")],
                 id="tf_keras of another release"),
    pytest.param([facts(nvidia=A100), facts(nvidia=T4)],
                 [("cuda", True, "the NVIDIA driver 470.256.02 on h1 supports CUDA up to 11.4, "
                   "but TensorFlow 2.21.0 is built for CUDA 12.5.1"),
                  ("collectives", False, "every host has GPUs but job.collectives is ring"),
                  ("gpu", False, "GPU models differ: NVIDIA A100-SXM4-40GB on h0; Tesla T4 on h1"),
                  ("gpu", False, "NVIDIA driver versions differ: 570.124.06 on h0; 470.256.02 on h1")],
                 id="mixed GPUs, a driver too old"),
    pytest.param([facts(nvidia=A100 | {"cuda": "12.4"}), facts(nvidia=A100)],
                 [("collectives", False, "every host has GPUs but job.collectives is ring"),
                  ("cuda", False, "the NVIDIA driver 570.124.06 on h0 supports CUDA up to 12.4, "
                   "but TensorFlow 2.21.0 is built for CUDA 12.5.1: it runs by CUDA's")],
                 id="a driver one CUDA minor behind"),
    pytest.param([facts(nvidia=A100, tf_gpus=[]), facts(nvidia=A100, tf_gpus=["A100"])],
                 [("gpu", True, "TensorFlow on h0 sees none of its 1 GPU(s)")],
                 id="TensorFlow blind to its GPU"),
    pytest.param([facts(nvidia=A100), facts()],
                 [("gpu", False, "h1 has no GPU while h0 do: every step runs at CPU speed")],
                 id="a CPU host among GPU hosts"),
    pytest.param([facts(free_gib=0.5), facts(free_gib=4)],
                 [("disk", True, "only 512.0 MiB free on h0"),
                  ("disk", False, "only 4.0 GiB free on h1")], id="little disk"),
    pytest.param([facts(python="3.10.12"), facts()],
                 [("python", False, "Python versions differ: 3.10 on h0; 3.11 on h1")],
                 id="two Pythons"),
    pytest.param([facts(port_free=False), facts()],
                 [("port", False, "port 23456 on h0 is in use (OSError: Address already in use); "
                   "train will take the next free port of the range")], id="a taken port"),
])
def test_rules(answers: list[dict[str, Any]], expected: list[tuple[str, bool, str]]) -> None:
    found = problems_for(*answers)
    assert len(found) == len(expected), found
    for (check, blocking, message), want in zip(found, expected, strict=True):
        assert (check, blocking) == want[:2] and message.startswith(want[2]), message


def test_command_jobs_need_no_tf_keras_and_only_warn_without_tensorflow() -> None:
    found = problems_for(facts(tf=None, keras=None), facts(keras=None),
                         job="{command: python train.py}")
    assert found == [("tensorflow", False, "TensorFlow is not installed for python3 on h0 "
                      "(No module)")]


NVIDIA_SMI = """\
#!/bin/sh
case "$1" in
  --query-gpu=*) for i in 0 1; do echo 'NVIDIA H100 80GB HBM3, 81559, 550.90.07'; done;;
  *) printf '| NVIDIA-SMI 550.90.07    Driver Version: 550.90.07    CUDA Version: 12.4     |\\n';;
esac
"""


def test_preflight_reads_nvidia_smi_where_there_is_one(tmp_path: Path) -> None:
    (tmp_path / "nvidia-smi").write_text(NVIDIA_SMI)
    (tmp_path / "nvidia-smi").chmod(0o755)
    proc = subprocess.run([sys.executable, "-m", "worker", "preflight", "--dir", str(tmp_path),
                           "--import-tensorflow", "never"], cwd=REPO, capture_output=True,
                          text=True, timeout=60,
                          env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"})
    assert proc.returncode == 0, proc.stderr
    (line,) = proc.stdout.splitlines()
    nvidia = json.loads(line)["nvidia"]
    assert nvidia["driver"] == "550.90.07" and nvidia["cuda"] == "12.4"
    assert nvidia["gpus"] == [{"name": "NVIDIA H100 80GB HBM3", "memory_mib": 81559,
                               "driver": "550.90.07"}] * 2


JAX = "{command: [python, t.py], backend: jax}"


def named(name: str, *addresses: str, bindable: str | None = "first",
          error: str | None = None) -> dict[str, Any]:
    """Preflight facts whose host name ``name`` resolves to ``addresses`` (``bindable``: the
    first this host can bind; by default the first of them)."""
    bound = addresses[0] if bindable == "first" and addresses else bindable
    return facts() | {"hostname": name, "hostname_lookup": {
        "addresses": list(addresses), "bindable": bound, "error": error}}


@pytest.mark.parametrize(("answers", "job", "expected"), [
    pytest.param([named("vm0", "10.0.0.1"), named("vm1", "10.0.0.2")], JAX, [],
                 id="names resolve to the hosts' addresses"),
    pytest.param([named("vm0", "127.0.1.1"), named("vm1", "10.0.0.2")], JAX,
                 [("hostname", True, "h0's host name 'vm0' resolves to 127.0.1.1, a loopback "
                   "address: the other hosts would connect to themselves")],
                 id="Debian's 127.0.1.1 line"),
    pytest.param([named("vm0", "10.0.0.1"),
                  named("vm1", error="Name or service not known (errno -2)")], JAX,
                 [("hostname", True, "h1's host name 'vm1' does not resolve (Name or service "
                   "not known (errno -2))")], id="a name that does not resolve"),
    pytest.param([named("vm0", "10.9.9.9", bindable=None), named("vm1", "10.0.0.2")], JAX,
                 [("hostname", True, "h0's host name 'vm0' resolves to 10.9.9.9, none of them "
                   "an address of h0")], id="a stale address"),
    pytest.param([named("vm0", "127.0.1.1") | {"nvidia": A100},
                  named("vm1", "10.0.0.2") | {"nvidia": A100}], JAX,
                 [("hostname", False, "h0's host name 'vm0' resolves to 127.0.1.1")],
                 id="a GPU host: NCCL does not use the name"),
    pytest.param([named("vm0", "127.0.1.1"), named("vm1", "127.0.1.1")],
                 "{command: [python, t.py]}", [], id="TensorFlow: task addresses only"),
    pytest.param([named("vm0", "127.0.1.1")], JAX, [], id="one machine: loopback is enough"),
    pytest.param([facts(), facts()], JAX, [], id="not reported: nothing guessed"),
])
def test_on_jax_every_hosts_name_must_resolve_to_an_address_its_peers_reach(
        answers: list[dict[str, Any]], job: str, expected: list[tuple[str, bool, str]]) -> None:
    found = [p for p in problems_for(*answers, job=job) if p[0] != "collectives"]
    assert len(found) == len(expected), found
    for (check, blocking, message), want in zip(found, expected, strict=True):
        assert (check, blocking) == want[:2] and message.startswith(want[2]), message


def jax_problems(addresses: list[str], answers: list[dict[str, Any]]) -> list[Problem]:
    """The problems diagnosed for a JAX job on hosts h0, h1, ... at ``addresses``."""
    spec = parse(f"name: c\nworkers: {len(addresses)}\njob: {JAX}\n")
    hosts = [Host(f"h{i}", a, "/r", ssh=SSHEndpoint(a, "ml")) for i, a in enumerate(addresses)]
    plan = planning.build(spec, hosts, run_id="r", python="python3", local_workdir="/w")
    checks = [HostCheck(h.name, h.address, (t.key,), "python3", True, facts=a)
              for h, t, a in zip(hosts, plan.tasks, answers, strict=True)]
    return diagnose(spec, plan, checks, [])


def test_the_hostname_fix_names_the_line_and_the_address_peers_reach() -> None:
    (problem,) = jax_problems(["10.0.0.1", "10.0.0.2"],
                              [named("vm0", "127.0.1.1"), named("vm1", "10.0.0.2")])
    assert problem.hosts == ("h0",)
    assert problem.fix == ("in /etc/hosts on h0, map vm0 to the address the other hosts reach it "
                           "at (10.0.0.1): replace the line '127.0.1.1 ... vm0' with '10.0.0.1 vm0'")


def test_hosts_at_loopback_addresses_may_have_a_name_on_loopback() -> None:
    assert jax_problems(["127.0.0.2", "127.0.0.3"],  # one machine's sshds, as in a test lab
                        [named("vm", "127.0.0.1"), named("vm", "127.0.0.1")]) == []


def test_preflight_reports_what_this_hosts_name_resolves_to() -> None:
    proc = subprocess.run([sys.executable, "-m", "worker", "preflight", "--dir", str(REPO),
                           "--import-tensorflow", "never"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    expected = list(dict.fromkeys(i[4][0] for i in socket.getaddrinfo(
        report["hostname"], None, type=socket.SOCK_STREAM)))
    assert report["hostname_lookup"] == {"addresses": expected, "bindable": expected[0],
                                         "error": None}


# -- a job on JAX: JAX, jaxlib and Keras 3 instead of TensorFlow; the devices JAX sees ----------
A100_ON_GPU = {"backend": "gpu", "count": 1, "kinds": ["NVIDIA A100-SXM4-40GB"]}
ON_CPU = {"backend": "cpu", "count": 1, "kinds": ["cpu"]}


def on_jax(jax: str | None = "0.10.2", jaxlib: str | None = "0.10.2",
           keras: str | None = "3.15.1", nvidia: Any = NO_GPU,
           devices: dict[str, Any] | None = None, plugin: str | None = None,
           error: str | None = None) -> dict[str, Any]:
    """Preflight facts of a host without TensorFlow that has ``jax`` (with ``jaxlib``, and
    jax-cuda12-plugin ``plugin``), Keras ``keras``, and where JAX listed ``devices``."""
    return facts(tf=None, keras=None, nvidia=nvidia) | {
        "jax": {"version": jax, "jaxlib_version": jaxlib,
                "minimum_jaxlib": "0.10.1" if jax else None,
                "cuda_plugin": None if plugin is None else {"name": "jax-cuda12-plugin",
                                                            "version": plugin},
                "devices": devices, "error": error},
        "keras": {"version": keras}}


@pytest.mark.parametrize(("answers", "expected"), [
    pytest.param([on_jax(), on_jax()], [], id="healthy CPU hosts, no TensorFlow"),
    pytest.param([on_jax(jax=None, jaxlib=None), on_jax()],
                 [("jax", True, "JAX is not installed for python3 on h0: the job's tasks run on "
                   "JAX (job.backend: jax)")], id="no JAX"),
    pytest.param([on_jax(jax=None, jaxlib=None, keras=None), on_jax()],
                 [("jax", True, "JAX is not installed for python3 on h0, nor Keras 3")],
                 id="neither JAX nor Keras"),
    pytest.param([on_jax(), on_jax(jax="0.10.1", jaxlib="0.10.1")],
                 [("jax", True, "JAX versions differ: jax 0.10.2 with jaxlib 0.10.2 on h0; "
                   "jax 0.10.1 with jaxlib 0.10.1 on h1")], id="two JAX releases"),
    pytest.param([on_jax(jaxlib="0.10.1"), on_jax(jaxlib="0.10.1")], [],
                 id="jaxlib a release behind, which JAX still imports with"),
    pytest.param([on_jax(jax="0.10.1", jaxlib="0.10.2"), on_jax(jax="0.10.1", jaxlib="0.10.2")],
                 [("jax", True, "jaxlib 0.10.2 on h0 is newer than JAX 0.10.1: JAX does not "
                   "import"),
                  ("jax", True, "jaxlib 0.10.2 on h1 is newer than JAX 0.10.1")],
                 id="jaxlib newer than JAX"),
    pytest.param([on_jax(jaxlib="0.9.0"), on_jax(jaxlib="0.9.0")],
                 [("jax", True, "jaxlib 0.9.0 on h0 is older than JAX 0.10.2 imports with "
                   "(>= 0.10.1)"), ("jax", True, "jaxlib 0.9.0 on h1 is older")],
                 id="jaxlib older than JAX's minimum"),
    pytest.param([on_jax(jaxlib=None), on_jax()],
                 [("jax", True, "jaxlib is not installed on h0: JAX 0.10.2 does not import")],
                 id="no jaxlib"),
    pytest.param([on_jax(keras="2.15.0"), on_jax(keras=None)],
                 [("keras", True, "Keras on h0 is 2.15.0, not Keras 3"),
                  ("keras", True, "Keras on h1 is not installed")], id="no Keras 3"),
    pytest.param([on_jax(nvidia=A100, devices=ON_CPU), on_jax(nvidia=A100, devices=A100_ON_GPU,
                                                              plugin="0.10.2")],
                 [("gpu", False, "JAX on h0 sees none of its 1 GPU(s) (NVIDIA A100-SXM4-40GB): "
                   "JAX is installed without CUDA (the CPU wheel, no jax-cuda12-plugin): its "
                   "tasks would train on the CPU, with gloo's collectives")],
                 id="JAX's CPU wheel on a GPU host"),
    pytest.param([on_jax(nvidia=A100, plugin="0.10.1"), on_jax(nvidia=A100, plugin="0.10.2")],
                 [("gpu", False, "JAX on h0 would see none of its 1 GPU(s) (NVIDIA A100-SXM4-40GB)"
                   ": its jax-cuda12-plugin 0.10.1 is not jaxlib's version (0.10.2), so JAX does "
                   "not load it")], id="a CUDA plugin of another release, devices not listed"),
    pytest.param([on_jax(nvidia=A100, devices=A100_ON_GPU, plugin="0.10.2")] * 2, [],
                 id="GPU hosts: no job.collectives rule on JAX"),
    pytest.param([on_jax(nvidia=A100, error="JAX did not list its devices within 60 s",
                         plugin="0.10.2"), on_jax()],
                 [("jax", False, "JAX did not list its devices on h0: JAX did not list its "
                   "devices within 60 s"),
                  ("gpu", False, "h1 has no GPU while h0 do")], id="devices not listed in time"),
    pytest.param([facts(), facts()], [], id="JAX not reported: nothing guessed"),
])
def test_on_jax_every_host_has_one_jax_a_jaxlib_it_imports_with_and_keras_3(
        answers: list[dict[str, Any]], expected: list[tuple[str, bool, str]]) -> None:
    found = problems_for(*answers, job=JAX)
    assert len(found) == len(expected), found
    for (check, blocking, message), want in zip(found, expected, strict=True):
        assert (check, blocking) == want[:2] and message.startswith(want[2]), message


def written(location: str, *, skipped: str | None = None) -> dict[str, Any]:
    """The preflight's write check of ``location``: done, or ``skipped`` and why."""
    return {"path": location, "url": "://" in location, "user": "ml", "ok": None if skipped
            else True, "error": None, "skipped": skipped, "marker": None}


def test_on_jax_a_bucket_needs_tensorflow_for_its_file_systems_on_every_host() -> None:
    """Keras on JAX reaches gs:// only through tf.io.gfile: a host where the write check found
    no TensorFlow to try it with is blocking, with the fix; a JAX job on disk needs none."""
    bucket = "gs://ckpt/runs"
    job = f"{{module: m, backend: jax}}\ncheckpoint: {{dir: '{bucket}'}}"
    without = on_jax() | {"storage": written(
        bucket, skipped="TensorFlow is not installed: gs:// cannot be checked")}
    with_tf = on_jax() | {"tensorflow": facts()["tensorflow"], "storage": written(bucket)}
    found = problems_for(without, with_tf, job=job)
    assert found == [("checkpoint", True, "h0: TensorFlow is not installed, and this JAX job's "
                      "checkpoints go to gs://ckpt/runs (checkpoint.dir): Keras on JAX reaches a "
                      "gs:// URL only through TensorFlow's file systems (tf.io.gfile)")]
    broken = on_jax() | {"storage": written(
        bucket, skipped="TensorFlow does not import (ImportError: libcudart.so.12: cannot open)")}
    assert problems_for(broken, with_tf, job=job) == [
        ("checkpoint", True, "h0: TensorFlow does not import (ImportError: libcudart.so.12: "
         "cannot open), and this JAX job's checkpoints go to gs://ckpt/runs (checkpoint.dir): "
         "Keras on JAX reaches a gs:// URL only through TensorFlow's file systems (tf.io.gfile)")]
    on_disk = on_jax() | {"storage": written("/mnt/shared/runs")}
    assert problems_for(on_disk, on_jax(), job="{module: m, backend: jax}\n"
                        "checkpoint: {dir: /mnt/shared/runs}") == []


def test_a_tensorflow_job_keeps_its_tensorflow_rules_on_hosts_with_jax() -> None:
    assert problems_for(on_jax(), on_jax(), job="{module: m}") == [
        ("tensorflow", True, "TensorFlow is not installed for python3 on h0 (No module)"),
        ("tensorflow", True, "TensorFlow is not installed for python3 on h1 (No module)")]


def fixes_for(*answers: dict[str, Any]) -> list[str]:
    return [p.fix for p in jax_problems([f"10.0.0.{i + 1}" for i in range(len(answers))],
                                        list(answers))]


def test_the_jax_fixes_name_what_to_install_in_which_version() -> None:
    assert fixes_for(on_jax(jax=None, jaxlib=None, keras=None), on_jax()) == [
        "install it there: python3 -m pip install 'jax==0.10.2' 'keras>=3.15,<4' (or, from "
        "this project's checkout on the host: pip install -e '.[jax]')"]
    assert fixes_for(on_jax(jax=None, jaxlib=None)) == [
        "install it there: python3 -m pip install 'jax>=0.10,<0.11' (or, from this project's "
        "checkout on the host: pip install -e '.[jax]')"]
    assert fixes_for(on_jax(), on_jax(), on_jax(jax="0.10.1", jaxlib="0.10.1", plugin="0.10.1")
                     ) == ["install jax 0.10.2 and jaxlib 0.10.2 on h2 (python3 -m pip install "
                           "'jax==0.10.2' 'jaxlib==0.10.2' 'jax-cuda12-plugin==0.10.2'), or build "
                           "the hosts from one image"]
    assert fixes_for(on_jax(jaxlib="0.9.0"), on_jax(jax="0.10.1", jaxlib="0.10.2",
                                                    plugin="0.10.2")) == [
        "install a JAX and jaxlib that match there: python3 -m pip install 'jax==0.10.2' "
        "'jaxlib==0.10.2'",  # with no host's pair to follow, jaxlib in JAX's version
        "install a JAX and jaxlib that match there: python3 -m pip install 'jax==0.10.1' "
        "'jaxlib==0.10.1' 'jax-cuda12-plugin==0.10.1'"]
    assert fixes_for(on_jax(jaxlib="0.9.0"), on_jax(jax="0.10.1", jaxlib="0.10.1")) == [
        "install a JAX and jaxlib that match there: python3 -m pip install 'jax==0.10.1' "
        "'jaxlib==0.10.1'"]  # the pair of a host whose JAX imports, not its own version
    assert fixes_for(on_jax(nvidia=A100, devices=ON_CPU)) == [
        "install JAX with CUDA there: python3 -m pip install 'jax[cuda12]==0.10.2'"]
    assert fixes_for(on_jax(nvidia=T4, devices=ON_CPU)) == [
        "upgrade the NVIDIA driver on h0 (it supports CUDA up to 11.4; JAX's CUDA wheels need "
        "12 or newer), then install JAX with CUDA there: python3 -m pip install "
        "'jax[cuda12]==0.10.2'"]


def test_on_jax_two_tasks_on_one_gpu_machine_are_blocking() -> None:
    spec = parse(f"name: c\nworkers: 2\njob: {JAX}\n")
    hosts = [Host(f"h0-{t}", "10.0.0.1", "/r", ssh=SSHEndpoint("10.0.0.1", "ml")) for t in (0, 1)]
    plan = planning.build(spec, hosts, run_id="r", python="python3", local_workdir="/w")
    check = HostCheck("h0-0", "10.0.0.1", tuple(t.key for t in plan.tasks), "python3", True,
                      facts=on_jax(nvidia=A100, devices=A100_ON_GPU, plugin="0.10.2"))
    (problem,) = diagnose(spec, plan, [check], [])
    assert (problem.check, problem.blocking) == ("gpu", True)
    assert problem.message == ("h0-0 runs 2 tasks and each uses all 1 of its GPUs: with "
                               "job.backend: jax the GPUs all-reduce with NCCL, which refuses two "
                               "ranks on one GPU ('Duplicate GPU detected')")


def test_the_doctor_shows_what_jax_sees_and_its_collectives_on_each_host() -> None:
    spec = parse(f"name: c\nworkers: 2\njob: {JAX}\n")
    hosts = [Host(f"h{i}", f"10.0.0.{i + 1}", "/r", ssh=SSHEndpoint(f"10.0.0.{i + 1}", "ml"))
             for i in range(2)]
    plan = planning.build(spec, hosts, run_id="r", python="python3", local_workdir="/w")
    answers = [on_jax(nvidia=A100, devices=A100_ON_GPU, plugin="0.10.2"), on_jax()]
    checks = [HostCheck(h.name, h.address, (t.key,), "python3", True, facts=a)
              for h, t, a in zip(hosts, plan.tasks, answers, strict=True)]
    report = DoctorReport("c", "static", tuple(checks), (), tuple(diagnose(spec, plan, checks, [])),
                          0.0, spec.job.backend)
    console = Console(record=True, width=200, color_system=None)
    render_doctor(console, report)
    text = console.export_text()
    assert text.count("python 3.11.7 (python3), jax 0.10.2 (jaxlib 0.10.2), keras 3.15.1") == 2
    assert "driver 570.124.06, CUDA 12.8; JAX sees 1, collectives NCCL" in text
    assert "tasks train on the CPU, collectives gloo" in text
    assert "tensorflow" not in text
    assert doctor_line(report).startswith("doctor: 2 machine(s) ok in 0.0s: python 3.11.7, jax "
                                          "0.10.2, keras 3.15.1, 1 GPU(s)")


def preflight_json(*args: str, path: str | None = None) -> dict[str, Any]:
    """What the real preflight prints here, with ``path`` first on PATH."""
    env = {**os.environ, "PATH": f"{path}:{os.environ['PATH']}" if path else os.environ["PATH"]}
    proc = subprocess.run([sys.executable, "-m", "worker", "preflight", "--dir", str(REPO),
                           "--import-tensorflow", "never", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    report: dict[str, Any] = json.loads(proc.stdout)
    return report


def test_preflight_reports_jax_jaxlib_and_keras_from_what_is_installed() -> None:
    from jax import version  # this test's own reading; the preflight imports nothing of JAX

    report = preflight_json()
    assert report["jax"] == {"version": importlib.metadata.version("jax"),
                             "jaxlib_version": importlib.metadata.version("jaxlib"),
                             "minimum_jaxlib": version._minimum_jaxlib_version,
                             "cuda_plugin": None, "devices": None, "error": None}
    assert report["keras"] == {"version": importlib.metadata.version("keras")}
    assert report["keras"]["version"].startswith("3.")


def test_preflight_lists_the_devices_jax_sees_in_a_child_process() -> None:
    import jax

    report = preflight_json("--import-jax", "always")
    assert report["jax"]["devices"] == {"backend": "cpu", "count": jax.device_count(),
                                        "kinds": ["cpu"]}
    assert report["jax"]["error"] is None


# The error's own child has the default limit: under a loaded suite a Python's start alone
# once took longer than 0.5 s, and the error read "did not list its devices within 0.5 s".
@pytest.mark.parametrize(("child", "limit_s", "error"), [
    pytest.param("import time; time.sleep(30)", 0.5, "JAX did not list its devices within 0.5 s",
                 id="a hung CUDA start is cut at the deadline"),
    pytest.param("raise RuntimeError('Unable to initialize backend cuda')",
                 preflight.JAX_DEVICES_LIMIT_S, "RuntimeError: Unable to initialize backend cuda",
                 id="JAX's own error line"),
])
def test_the_jax_listing_is_bounded_and_says_why_it_failed(
        monkeypatch: pytest.MonkeyPatch, child: str, limit_s: float, error: str) -> None:
    monkeypatch.setattr(preflight, "JAX_DEVICES", child)
    monkeypatch.setattr(preflight, "JAX_DEVICES_LIMIT_S", limit_s)
    facts = preflight.jax_facts(list_devices=True)
    assert (facts["version"], facts["devices"], facts["error"]) == (
        importlib.metadata.version("jax"), None, error)


def test_on_a_gpu_host_with_jaxs_cpu_wheel_the_doctor_warns_from_the_real_preflight(
        tmp_path: Path) -> None:
    """This machine's JAX is the CPU wheel; a stand-in nvidia-smi lists two H100s: "auto"
    lists JAX's devices, which are the CPU, and the doctor says so with the fix."""
    (tmp_path / "nvidia-smi").write_text(NVIDIA_SMI)
    (tmp_path / "nvidia-smi").chmod(0o755)
    assert preflight_json("--import-jax", "auto")["jax"]["devices"] is None  # no GPU here
    report = preflight_json("--import-jax", "auto", path=str(tmp_path))
    assert report["jax"]["devices"]["backend"] == "cpu"
    (problem,) = jax_problems(["10.0.0.1"], [report])
    assert (problem.check, problem.blocking) == ("gpu", False)
    assert problem.message.startswith("JAX on h0 sees none of its 2 GPU(s) (NVIDIA H100 80GB "
                                      "HBM3): JAX is installed without CUDA")
    assert problem.fix == ("install JAX with CUDA there: python3 -m pip install "
                           f"'jax[cuda12]=={importlib.metadata.version('jax')}'")


def installed(root: Path, module: str, metadata: str, name: str, body: str) -> None:
    """A package ``module`` in ``root`` with its metadata at ``root/metadata`` (a directory
    ``name``d METADATA or PKG-INFO inside, or a file when ``name`` is empty)."""
    (root / module).mkdir(parents=True)
    (root / module / "__init__.py").write_text("")
    if name:
        (root / metadata).mkdir()
        (root / metadata / name).write_text(body)
    else:
        (root / metadata).write_text(body)


@pytest.mark.parametrize(("module", "dists", "metadata", "name", "body", "expected"), [
    ("tensorflow", ("tensorflow-cpu",), "tensorflow_cpu-2.20.1.dist-info", "METADATA",
     "Metadata-Version: 2.1\nName: tensorflow-cpu\nVersion: 2.20.1\n\nName: not-this\n", "2.20.1"),
    ("tf_keras", ("tf-keras",), "tf_keras-2.21.0.dist-info", "METADATA",
     "Name: tf_keras\nVersion: 2.21.0\n", "2.21.0"),
    ("oldpkg", (), "oldpkg-0.9-py3.11.egg-info", "PKG-INFO",
     "Metadata-Version: 1.0\nName: OldPkg\nVersion: 0.9\n", "0.9"),
    ("flatpkg", (), "flatpkg-1.2.egg-info", "", "Name: flatpkg\nVersion: 1.2\n", "1.2"),
    # a metadata directory named otherwise: found by the full scan
    ("renamed", ("renamed",), "something_else-3.1.dist-info", "METADATA",
     "Metadata-Version: 2.1\nName: renamed\nVersion: 3.1\n", "3.1"),
    ("bare", (), "unrelated-1.0.dist-info", "METADATA", "Name: unrelated\nVersion: 1.0\n", None),
])
def test_the_preflight_reads_the_version_of_the_distribution_a_module_comes_from(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str, dists: tuple[str, ...],
        metadata: str, name: str, body: str, expected: str | None) -> None:
    installed(tmp_path, module, metadata, name, body)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert preflight.installed_version(module, *dists) == expected
    if expected is not None:  # the same answer as importlib.metadata's own
        found = [d.version for d in importlib.metadata.distributions(path=[str(tmp_path)])]
        assert found == [expected]
