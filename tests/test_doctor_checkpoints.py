"""`doctor` on checkpoint storage: every host must be able to create and write the checkpoint
directory, see there the same directory as the chief's machine (a file written from the chief's
machine read back on every other host), and write to a gs:// bucket within a deadline instead of
hanging. Real sshd test hosts (tests/hostlab.py: one file system, except each host's
``private_dir``), and the rules table-tested on hand-built answers. The lab tests that compare
hosts need network namespaces (``netns``): loopback hosts are one machine, checked once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import REPO, silent_listener, write_spec
from hostlab import HostLab, LabHost

from orchestrator import plan as planning
from orchestrator.api import Cluster
from orchestrator.doctor import GCS_FIX, HostCheck, Machine, StorageCheck, diagnose
from orchestrator.hosts import Host, SSHEndpoint
from orchestrator.spec import parse

PORTS = "ports: {start: 24130, end: 24140}\n"
NOT_SHARED_FIX = ("mount the same shared file system at {dir} on every host, or remove "
                  "checkpoint.dir so the chief's checkpoint is copied to every host before a "
                  "relaunch")


def cli(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "ORCHESTRATE_HOME": str(home), "COLUMNS": "200"})


def lab_spec(tmp_path: Path, lab: HostLab, hosts: list[LabHost], name: str,
             checkpoint_dir: str) -> Path:
    return write_spec(tmp_path, lab, hosts, f"name: {name}\njob: {{module: examples.digits}}\n"
                      f"{PORTS}checkpoint: {{dir: '{checkpoint_dir}'}}\n")


def markers_in(listing: str) -> list[str]:
    return [name for name in listing.split() if name.startswith(".orchestrate-doctor-")]


# -- real hosts ------------------------------------------------------------------------------
@pytest.mark.netns
def test_a_shared_directory_every_host_writes_passes(hostlab: HostLab, tmp_path: Path) -> None:
    hosts = hostlab.hosts(3)
    shared = tmp_path / "shared" / "ckpt"  # one file system: the same directory on every host
    report = Cluster.from_spec(lab_spec(tmp_path, hostlab, hosts, "ck-ok", str(shared))).doctor()
    assert report.ok and [p for p in report.problems if p.check == "checkpoint"] == []
    storage = [h.fact("storage") for h in report.hosts]
    assert [s["ok"] for s in storage] == [True] * 3 and {s["path"] for s in storage} == {
        str(shared)}
    assert storage[0]["marker"]["written"] is True
    assert [s["sees_chief_marker"]["ok"] for s in storage[1:]] == [True, True]
    assert list(shared.iterdir()) == []  # checkpoint.dir itself was checked; the marker is gone


@pytest.mark.netns
def test_a_directory_that_is_not_the_same_on_every_host_is_blocking(
        hostlab: HostLab, tmp_path: Path, orchestrate_home: Path) -> None:
    hosts = hostlab.hosts(3)
    private = hosts[0].private_dir  # each host has its own directory there
    assert private is not None
    proc = cli("doctor", str(lab_spec(tmp_path, hostlab, hosts, "ck-own", private)),
               home=orchestrate_home)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert (f"✗ blocking checkpoint: {private} on ck-own-1, ck-own-2 is not the directory that "
            f"ck-own-0 writes: a file ck-own-0 wrote there is missing on ck-own-1, ck-own-2, so "
            "the tasks there would not see the chief's checkpoints\n") in proc.stdout
    assert f"    fix: {NOT_SHARED_FIX.format(dir=private)}\n" in proc.stdout
    assert "1 blocking problem(s)" in proc.stdout
    for host in hosts:  # the chief's marker was removed; the others never had one
        assert markers_in(host.run(["ls", "-A", private]).stdout) == []


@pytest.mark.netns
def test_a_directory_no_host_can_create_is_blocking(hostlab: HostLab, tmp_path: Path,
                                                     orchestrate_home: Path) -> None:
    hosts = hostlab.hosts(2)
    in_the_way = tmp_path / "ckpt"
    in_the_way.write_text("a file where the directory should be\n")  # fails even for root
    proc = cli("doctor", str(lab_spec(tmp_path, hostlab, hosts, "ck-file", str(in_the_way))),
               home=orchestrate_home)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    for i, host in enumerate(hosts):  # each its own login user: one problem each
        assert (f"✗ blocking checkpoint: ck-file-{i} cannot write checkpoints to {in_the_way} "
                "(checkpoint.dir): it is a file, not a directory\n") in proc.stdout
        assert (f"    fix: create {in_the_way} on ck-file-{i} writable by user {host.user} "
                f"(sudo mkdir -p {in_the_way} && sudo chown {host.user} {in_the_way}), or mount "
                "the shared file system there\n") in proc.stdout
    assert "2 blocking problem(s)" in proc.stdout
    assert "is not the directory" not in proc.stdout  # no marker round without a writable dir


@pytest.fixture
def silent_proxy(hostlab: HostLab) -> Iterator[str]:
    """An HTTPS proxy on the controller, reachable from every host, that accepts connections
    and never answers: a storage client behind it waits as one without a route would."""
    address = hostlab.bridge_address or "127.0.0.1"
    with silent_listener(address) as port:
        yield f"http://{address}:{port}"


@pytest.mark.ssh
def test_a_bucket_the_host_cannot_reach_is_blocking_within_the_deadline(
        hostlab: HostLab, tmp_path: Path, silent_proxy: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    hosts = hostlab.hosts(1)  # one is enough: each host checks the bucket on its own
    python = tmp_path / "python"  # the host's interpreter, its HTTPS going to the silent proxy
    python.write_text(f"#!/bin/sh\nexport https_proxy={silent_proxy}\nexec {sys.executable} "
                      '"$@"\n')
    python.chmod(0o755)
    url = "gs://orchestrate-doctor-no-such-bucket/ckpt"
    path = lab_spec(tmp_path, hostlab, hosts, "ck-gs", url)
    path.write_text(path.read_text().replace(f"python: {sys.executable}", f"python: {python}"))
    monkeypatch.setenv("ORCHESTRATE_STORAGE_CHECK_S", "2")
    report = Cluster.from_spec(path).doctor()
    (problem,) = report.blocking
    assert (problem.check, problem.hosts) == ("checkpoint", ("ck-gs-0",))
    assert problem.message == (f"ck-gs-0 cannot write checkpoints to {url} (checkpoint.dir): "
                               "timed out after 2 s (TensorFlow's GCS client got no answer)")
    assert problem.fix == GCS_FIX
    (host,) = report.hosts  # TensorFlow's import aside, the host gave up at its deadline
    assert host.fact("storage", "timeout_s") == 2 and host.fact("storage", "seconds") < 5


# -- the preflight on this machine -----------------------------------------------------------
def preflight(*args: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "worker", "preflight", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    facts: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
    return facts


def test_preflight_writes_leaves_reads_and_removes_a_marker(tmp_path: Path) -> None:
    where = tmp_path / "a" / "b"
    storage = preflight(f"--write-check={where}", "--marker", ".orchestrate-doctor-m",
                        "--marker-content", "c0ffee", "--import-tensorflow", "never")["storage"]
    assert storage | {"seconds": 0, "user": ""} == {
        "path": str(where), "url": False, "user": "", "timeout_s": 20.0, "seconds": 0,
        "ok": True, "error": None, "skipped": None,
        "marker": {"name": ".orchestrate-doctor-m", "written": True}}
    assert [p.name for p in where.iterdir()] == [".orchestrate-doctor-m"]  # the probe is gone
    marker = f"{where}/.orchestrate-doctor-m"
    assert preflight(f"--read-marker={marker}")["marker"]["content"] == "c0ffee"
    assert preflight(f"--remove-marker={marker}")["marker"]["error"] is None
    assert preflight(f"--read-marker={marker}")["marker"] == {
        "path": marker, "content": None, "error": "No such file or directory"}
    (tmp_path / "file").write_text("")
    for path, error in ((tmp_path / "file", "it is a file, not a directory"),
                        (tmp_path / "file" / "sub", "cannot create it: Not a directory")):
        storage = preflight(f"--write-check={path}", "--import-tensorflow", "never")["storage"]
        assert (storage["ok"], storage["error"]) == (False, error)


# -- what is checked where -------------------------------------------------------------------
def ssh_hosts(n: int) -> list[Host]:
    return [Host(f"h{i}", f"10.0.0.{i + 1}", "/home/ml/.orchestrate/clusters/c",
                 ssh=SSHEndpoint(f"10.0.0.{i + 1}", "ml")) for i in range(n)]


def storage_check(text: str, hosts: int = 2) -> tuple[planning.ClusterPlan, StorageCheck | None]:
    spec = parse(f"name: c\nworkers: {hosts}\n{text}")
    plan = planning.build(spec, ssh_hosts(hosts), run_id="r", python="python3",
                          local_workdir="/w")
    machines = [Machine(t.host, (t,), "python3") for t in plan.tasks]
    return plan, StorageCheck.of(spec, plan, machines)


def test_checkpoint_dir_itself_is_checked_and_marked_where_it_is_a_shared_path() -> None:
    _, check = storage_check("job: {module: m}\ncheckpoint: {dir: /mnt/nfs/ckpt}\n")
    assert check is not None and check.named_by == "checkpoint.dir" and check.chief == "h0"
    assert check.dirs == {"h0": "/mnt/nfs/ckpt", "h1": "/mnt/nfs/ckpt"}  # not DIR/c/RUN
    assert check.marker is not None and check.marker.startswith(".orchestrate-doctor-")
    assert len(check.content) == 32
    _, alone = storage_check("job: {module: m}\ncheckpoint: {dir: /mnt/nfs/ckpt}\n", hosts=1)
    assert alone is not None and alone.marker is None  # one machine: nothing to compare
    _, bucket = storage_check("job: {module: m}\ncheckpoint: {dir: 'gs://bucket/ckpt'}\n")
    assert bucket is not None and bucket.dirs["h1"] == "gs://bucket/ckpt" and bucket.marker is None


def test_a_scripts_own_directory_is_checked_on_each_host_and_the_run_dir_is_not() -> None:
    plan, check = storage_check("job: {command: python train.py, checkpoint_dir: ckpt}\n")
    assert check is not None and check.named_by == "job.checkpoint_dir"
    assert check.dirs == {"h0": plan.checkpoints.of(plan.tasks[0].host),
                          "h1": plan.checkpoints.of(plan.tasks[1].host)}
    assert check.marker is None  # each host's own directory: copied, not shared
    assert storage_check("job: {module: m}\n")[1] is None  # the run's dir: the disk check


# -- the rules ---------------------------------------------------------------------------------
def answered(storage: dict[str, Any] | None = None) -> dict[str, Any]:
    facts: dict[str, Any] = {
        "python": {"version": "3.11.7"}, "tensorflow": {"version": "2.21.0"},
        "tf_keras": {"version": "2.21.0"}, "nvidia": {"gpus": []},
        "disk": {"path": "/home/ml", "free_bytes": 2**40}, "ports": [], "peers": []}
    return facts | ({"storage": storage} if storage is not None else {})


def wrote(path: str, ok: bool | None = True, error: str | None = None, user: str = "ml",
          **more: Any) -> dict[str, Any]:
    return {"path": path, "url": "://" in path, "user": user, "ok": ok, "error": error,
            "skipped": None, **more}


def problems_for(text: str, *storage: dict[str, Any] | None) -> list[tuple[bool, tuple[str, ...],
                                                                            str, str]]:
    """(blocking, hosts, message, fix) of the checkpoint problems for hosts h0, h1, ..."""
    spec = parse(f"name: c\nworkers: {len(storage)}\n{text}")
    plan = planning.build(spec, ssh_hosts(len(storage)), run_id="r", python="python3",
                          local_workdir="/w")
    checks = [HostCheck(t.host.name, t.host.address, (t.key,), "python3", True,
                        facts=answered(s)) for t, s in zip(plan.tasks, storage, strict=True)]
    return [(p.blocking, p.hosts, p.message, p.fix) for p in diagnose(spec, plan, checks, [])
            if p.check == "checkpoint"]


NFS = "job: {module: m}\ncheckpoint: {dir: /mnt/nfs/ckpt}\n"
SEEN = {"path": "/mnt/nfs/ckpt/.orchestrate-doctor-1", "chief": "h0", "ok": True, "error": None}


@pytest.mark.parametrize(("text", "storage", "expected"), [
    pytest.param(NFS, [wrote("/mnt/nfs/ckpt", marker={"written": True}),
                       wrote("/mnt/nfs/ckpt", sees_chief_marker=SEEN)], [], id="shared and seen"),
    pytest.param(NFS, [wrote("/mnt/nfs/ckpt"), wrote("/mnt/nfs/ckpt", False,
                                                     "cannot write a file in it: Permission denied")],
                 [(True, ("h1",), "h1 cannot write checkpoints to /mnt/nfs/ckpt (checkpoint.dir): "
                   "cannot write a file in it: Permission denied",
                   "create /mnt/nfs/ckpt on h1 writable by user ml (sudo mkdir -p /mnt/nfs/ckpt && "
                   "sudo chown ml /mnt/nfs/ckpt), or mount the shared file system there")],
                 id="one host cannot write"),
    pytest.param(NFS, [wrote("/mnt/nfs/ckpt", False, "cannot create it: Read-only file system")] * 2,
                 [(True, ("h0", "h1"), "h0, h1 cannot write checkpoints to /mnt/nfs/ckpt "
                   "(checkpoint.dir): cannot create it: Read-only file system",
                   "create /mnt/nfs/ckpt on h0, h1 writable by user ml (sudo mkdir -p "
                   "/mnt/nfs/ckpt && sudo chown ml /mnt/nfs/ckpt), or mount the shared file "
                   "system there")], id="the same failure on every host: one problem"),
    pytest.param(NFS, [wrote("/mnt/nfs/ckpt", marker={"written": True}),
                       wrote("/mnt/nfs/ckpt", sees_chief_marker=SEEN | {
                           "ok": False, "error": "No such file or directory"})],
                 [(True, ("h1",), "/mnt/nfs/ckpt on h1 is not the directory that h0 writes: a "
                   "file h0 wrote there is missing on h1, so the tasks there would not see the "
                   "chief's checkpoints", NOT_SHARED_FIX.format(dir="/mnt/nfs/ckpt"))],
                 id="another directory on one host"),
    pytest.param(NFS, [wrote("/mnt/nfs/ckpt", marker={"written": True}),
                       wrote("/mnt/nfs/ckpt", sees_chief_marker=SEEN | {
                           "ok": False, "error": "other content"})],
                 [(True, ("h1",), "/mnt/nfs/ckpt on h1 is not the directory that h0 writes: a "
                   "file h0 wrote there holds other content on h1, so the tasks there would not "
                   "see the chief's checkpoints", NOT_SHARED_FIX.format(dir="/mnt/nfs/ckpt"))],
                 id="a file of that name with other content"),
    pytest.param("job: {command: python t.py, checkpoint_dir: /data/ckpt}\n",
                 [wrote("/data/ckpt"), wrote("/data/ckpt", False, "cannot create it: Permission "
                                             "denied", user="ubuntu")],
                 [(True, ("h1",), "h1 cannot write checkpoints to /data/ckpt (job.checkpoint_dir): "
                   "cannot create it: Permission denied",
                   "create /data/ckpt on h1 writable by user ubuntu (sudo mkdir -p /data/ckpt && "
                   "sudo chown ubuntu /data/ckpt), or set job.checkpoint_dir to a directory "
                   "ubuntu can write")], id="a script's own directory on each host"),
    pytest.param("job: {module: m}\ncheckpoint: {dir: 'gs://bucket/ckpt'}\n",
                 [wrote("gs://bucket/ckpt", False, "timed out after 20 s (TensorFlow's GCS client got "
                        "no answer)", user="a"),
                  wrote("gs://bucket/ckpt", False, "timed out after 20 s (TensorFlow's GCS client got "
                        "no answer)", user="b")],
                 [(True, ("h0", "h1"), "h0, h1 cannot write checkpoints to gs://bucket/ckpt "
                   "(checkpoint.dir): timed out after 20 s (TensorFlow's GCS client got no answer)",
                   GCS_FIX)], id="a bucket without credentials"),
    pytest.param("job: {module: m}\ncheckpoint: {dir: 'gs://bucket/ckpt'}\n",
                 [wrote("gs://bucket/ckpt", None, skipped="TensorFlow is not installed"),
                  wrote("gs://bucket/ckpt")], [], id="no TensorFlow: the TensorFlow check says so"),
    pytest.param(NFS, [None, None], [], id="not asked"),
])
def test_rules(text: str, storage: list[dict[str, Any] | None],
               expected: list[tuple[bool, tuple[str, ...], str, str]]) -> None:
    assert problems_for(text, *storage) == expected
