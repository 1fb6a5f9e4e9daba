"""GPUs without a GPU: the collectives, replicas, batch and learning rate planned from what
hosts answer, the doctor's GPU rules, the replicas the live view shows, and the worker's side
on real TensorFlow (CPU).

No GPU is on this machine. The hosts' answers come from the real preflight reading a stand-in
``nvidia-smi`` that prints what the real one prints on GPU machines: the driver, CUDA version,
GPU names and memory of real nvidia-smi output (an H100 80GB HBM3 machine with driver
535.129.03, CUDA 12.2, as posted in google/gvisor#10413; an A100-SXM4-40GB machine with driver
580.126.09, CUDA 13.0, as posted in bottlerocket-os/bottlerocket-core-kit#834), in the format of
``nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader,nounits``
and of the header of plain ``nvidia-smi``.
"""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from orchestrator import doctor as doctoring
from orchestrator import plan as planning
from orchestrator.api import Scaling
from orchestrator.console import PlainProgress, RunFrame, replicas_text
from orchestrator.doctor import DoctorReport, HostCheck, diagnose
from orchestrator.events import Event, parse_line
from orchestrator.hosts import Host, SSHEndpoint
from orchestrator.launchers import launcher_named
from orchestrator.plan import ClusterPlan
from orchestrator.remote.base import TaskHandle
from orchestrator.remote.local import LocalRunner
from orchestrator.runtimes import COLLECTIVES_ENV, resolve_gpus, runtime_for
from orchestrator.spec import ClusterSpec, parse
from orchestrator.view import RunView, TaskView
from orchestrator.watch import AttemptWatch, Watched
from worker.runtimes.common import DeviceError, prepare_devices

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Recording:
    """What nvidia-smi prints on one kind of machine: ``count`` GPUs of one model."""

    name: str
    memory_mib: int
    driver: str
    cuda: str
    count: int

    def script(self) -> str:
        row = f"{self.name}, {self.memory_mib}, {self.driver}"
        rule = "+" + "-" * 87 + "+"
        header = (f"| NVIDIA-SMI {self.driver}             Driver Version: {self.driver}     "
                  f"CUDA Version: {self.cuda}     |")
        return ("#!/bin/sh\ncase \"$1\" in\n"
                f"  --query-gpu=name,memory.total,driver_version) "
                f"for i in $(seq {self.count}); do echo '{row}'; done;;\n"
                f"  *) echo '{rule}'; echo '{header}'; echo '{rule}';;\nesac\n")


RECORDINGS = {
    "h100x8": Recording("NVIDIA H100 80GB HBM3", 81559, "535.129.03", "12.2", 8),
    "a100x8": Recording("NVIDIA A100-SXM4-40GB", 40960, "580.126.09", "13.0", 8),
    "a100x4": Recording("NVIDIA A100-SXM4-40GB", 40960, "580.126.09", "13.0", 4),
}


def preflight(path_dir: Path | None, tmp: Path) -> dict[str, Any]:
    """The real preflight's answer on this machine, with ``path_dir`` first on PATH."""
    path = os.environ["PATH"] if path_dir is None else f"{path_dir}:{os.environ['PATH']}"
    proc = subprocess.run([sys.executable, "-m", "worker", "preflight", "--dir", str(tmp),
                           "--import-tensorflow", "never"], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PATH": path})
    assert proc.returncode == 0, proc.stderr
    facts: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
    return facts


@pytest.fixture(scope="module")
def answers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The preflight's facts for each recording, and for this machine as it is ("cpu")."""
    found = {"cpu": preflight(None, tmp_path_factory.mktemp("cpu"))}
    assert found["cpu"]["nvidia"]["gpus"] == [], "this test expects a machine without nvidia-smi"
    for key, recording in RECORDINGS.items():
        bin_dir = tmp_path_factory.mktemp(key)
        smi = bin_dir / "nvidia-smi"
        smi.write_text(recording.script())
        smi.chmod(0o755)
        found[key] = preflight(bin_dir, bin_dir)
    return found


def test_the_preflight_reads_the_recorded_nvidia_smi(answers: dict[str, dict[str, Any]]) -> None:
    nvidia = answers["h100x8"]["nvidia"]
    assert (nvidia["driver"], nvidia["cuda"]) == ("535.129.03", "12.2")
    assert nvidia["gpus"] == [{"name": "NVIDIA H100 80GB HBM3", "memory_mib": 81559,
                               "driver": "535.129.03"}] * 8
    assert len(answers["a100x4"]["nvidia"]["gpus"]) == 4
    assert answers["a100x8"]["nvidia"]["cuda"] == "13.0"


# -- the planner table: spec + what each host answered -> what train runs --------------------
def cluster(machines: list[str], job: str, *, tasks_per_machine: int = 1
            ) -> tuple[ClusterSpec, ClusterPlan]:
    """A static cluster with a task per host, ``tasks_per_machine`` hosts per machine."""
    spec = parse(f"name: c\nworkers: {len(machines) * tasks_per_machine}\n"
                 f"job: {{module: m, per_replica_batch_size: 32, learning_rate: 0.001, {job}}}\n")
    hosts = [Host(f"h{i}-{t}", f"10.0.0.{i + 1}", "/r", ssh=SSHEndpoint(f"10.0.0.{i + 1}", "ml"))
             for i in range(len(machines)) for t in range(tasks_per_machine)]
    return spec, planning.build(spec, hosts, run_id="r", python="python3", local_workdir="/w")


def report_for(spec: ClusterSpec, plan: ClusterPlan, machines: list[str],
               answers: dict[str, dict[str, Any]]) -> DoctorReport:
    """The doctor's report had each machine answered what its recording says."""
    grouped = doctoring.machines_of(plan, lambda host: "python3")
    checks = [HostCheck(m.name, m.host.address, tuple(t.key for t in m.tasks), "python3", True,
                        facts=answers[kind]) for m, kind in zip(grouped, machines, strict=True)]
    return DoctorReport(spec.name, "static", tuple(checks), (),
                        tuple(diagnose(spec, plan, checks, [])), 0.0)


GPU_CHECKS = ("gpu", "collectives")


@dataclass(frozen=True)
class Row:
    machines: list[str]
    job: str
    collectives: str
    replicas: int
    global_batch: int
    learning_rate: float
    problems: list[tuple[str, bool, str]] = field(default_factory=list)


TABLE = {
    "two H100 hosts, auto: NCCL, 8 replicas each": Row(
        ["h100x8", "h100x8"], "collectives: auto", "nccl", 16, 512, 0.016),
    "two H100 hosts, ring by default: a warning": Row(
        ["h100x8", "h100x8"], "seed: 1", "ring", 16, 512, 0.016,
        [("collectives", False, "every host has GPUs but job.collectives is ring")]),
    "two H100 hosts, nccl": Row(["h100x8", "h100x8"], "collectives: nccl", "nccl", 16, 512, 0.016),
    "no scaling of the learning rate": Row(
        ["a100x8", "a100x8", "a100x8"], "collectives: auto, scale_learning_rate: false", "nccl",
        24, 768, 0.001),
    "CPU hosts, auto: RING, one replica each": Row(
        ["cpu", "cpu"], "collectives: auto", "ring", 2, 64, 0.002),
    "CPU hosts, nccl: blocking": Row(
        ["cpu", "cpu"], "collectives: nccl", "nccl", 2, 64, 0.002,
        [("collectives", True, "job.collectives: nccl, but h0-0, h1-0 have no GPU that "
          "TensorFlow can use")]),
    "a CPU host among GPU hosts, auto: RING, and the counts differ": Row(
        ["h100x8", "cpu"], "collectives: auto", "ring", 9, 288, 0.009,
        [("gpu", True, "the hosts have different numbers of GPUs: 8 GPU(s) on h0-0; no GPU on "
          "h1-0"), ("gpu", False, "h1-0 has no GPU while h0-0 do")]),
    "8 and 4 A100s: blocking, with the fix to use 4 everywhere": Row(
        ["a100x8", "a100x4"], "collectives: auto", "nccl", 12, 384, 0.012,
        [("gpu", True, "the hosts have different numbers of GPUs: 8 GPU(s) on h0-0; 4 GPU(s) on "
          "h1-0")]),
}


@pytest.mark.parametrize("row", TABLE.values(), ids=TABLE.keys())
def test_the_plan_from_the_gpus_each_host_has(row: Row, answers: dict[str, dict[str, Any]]) -> None:
    spec, plan = cluster(row.machines, row.job)
    report = report_for(spec, plan, row.machines, answers)
    resolved = resolve_gpus(spec, report.gpus_per_task)
    scaling = Scaling.of(plan, report.replicas)
    assert resolved.job.collectives == row.collectives
    assert (scaling.replicas, scaling.replicas_known) == (row.replicas, True)
    assert scaling.global_batch_size == row.global_batch
    assert scaling.scaled_learning_rate == pytest.approx(row.learning_rate)
    found = [(p.check, p.blocking, p.message) for p in report.problems if p.check in GPU_CHECKS]
    assert len(found) == len(row.problems), found
    for got, (check, blocking, start) in zip(found, row.problems, strict=True):
        assert got[:2] == (check, blocking) and got[2].startswith(start), got


def test_the_resolved_collectives_reach_every_task_of_the_plan(
        answers: dict[str, dict[str, Any]]) -> None:
    spec, plan = cluster(["h100x8", "h100x8"], "collectives: auto")
    resolved = resolve_gpus(spec, report_for(spec, plan, ["h100x8"] * 2, answers).gpus_per_task)
    again = planning.build(resolved, [t.host for t in plan.tasks], run_id="r", python="python3",
                           local_workdir="/w")
    for task in again.tasks:
        assert task.env[COLLECTIVES_ENV] == "nccl"
        assert json.loads(task.argv[-1])["collectives"] == "nccl"
    assert plan.tasks[0].env[COLLECTIVES_ENV] == "auto"  # unresolved: each task decides


def test_unknown_gpus_leave_auto_to_each_task() -> None:
    spec = parse("name: c\njob: {module: m, collectives: auto}\n")
    assert resolve_gpus(spec, None) is spec
    assert resolve_gpus(spec, [0, 8]).job.collectives == "ring"


def test_the_fix_for_different_counts_names_the_devices_every_task_can_use(
        answers: dict[str, dict[str, Any]]) -> None:
    spec, plan = cluster(["a100x8", "a100x4"], "collectives: auto")
    (problem,) = [p for p in report_for(spec, plan, ["a100x8", "a100x4"], answers).problems
                  if p.check == "gpu"]
    assert "CUDA_VISIBLE_DEVICES: '0,1,2,3'" in problem.fix


@pytest.mark.parametrize(("job", "blocking"), [("collectives: auto", True),
                                               ("collectives: ring", False)])
def test_two_tasks_on_one_gpu_machine_share_its_gpus(
        job: str, blocking: bool, answers: dict[str, dict[str, Any]]) -> None:
    spec, plan = cluster(["h100x8"], job, tasks_per_machine=2)
    report = report_for(spec, plan, ["h100x8"], answers)
    (shared,) = [p for p in report.problems if p.check == "gpu"]
    assert shared.blocking is blocking
    assert shared.message.startswith("h0-0 runs 2 tasks and each uses all 8 of its GPUs")
    assert ("Duplicate GPU detected" in shared.message) is blocking


# -- the spec, the runtimes' environment and the plan line ------------------------------------
def test_collectives_default_to_ring_and_memory_growth_to_on() -> None:
    for job in ("{module: m}", "{command: python train.py}"):
        spec = parse(f"name: c\njob: {job}\n")
        assert (spec.job.collectives, spec.job.gpu_memory_growth) == ("ring", True)


def test_a_command_job_reads_the_collectives_and_gets_tensorflows_memory_growth() -> None:
    spec = parse("name: c\njob: {command: python train.py, collectives: nccl}\n")
    env = runtime_for(spec.job).env(spec)
    assert (env[COLLECTIVES_ENV], env["TF_FORCE_GPU_ALLOW_GROWTH"]) == ("nccl", "true")
    off = parse("name: c\njob: {command: python train.py, gpu_memory_growth: false}\n")
    assert "TF_FORCE_GPU_ALLOW_GROWTH" not in runtime_for(off.job).env(off)
    mine = parse("name: c\nenv: {TF_FORCE_GPU_ALLOW_GROWTH: 'false'}\njob: {command: python t.py}\n")
    assert "TF_FORCE_GPU_ALLOW_GROWTH" not in runtime_for(mine.job).env(mine)


def test_plan_shows_the_collectives_and_memory_growth(tmp_path: Path,
                                                      orchestrate_home: Path) -> None:
    (tmp_path / "m.py").write_text("")
    spec = tmp_path / "c.yaml"
    spec.write_text("name: c\njob: {module: m, collectives: auto, gpu_memory_growth: false}\n")
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", "plan", str(spec)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    (line,) = [t for t in proc.stdout.splitlines() if t.startswith("  gpus ")]
    assert "collectives auto: NCCL if every task sees a GPU, else RING" in line
    assert "memory growth off" in line


def test_an_unknown_collectives_value_is_refused_naming_the_choices() -> None:
    from orchestrator.errors import SpecError

    with pytest.raises(SpecError) as caught:
        parse("name: c\njob: {module: m, collectives: nvlink}\n")
    assert caught.value.field == "job.collectives"
    assert "'ring', 'nccl' or 'auto'" in str(caught.value)


# -- the live view: replicas as the tasks report them -----------------------------------------
@pytest.fixture
def watch() -> Any:
    spec, plan = cluster(["cpu", "cpu"], "collectives: auto")
    view = RunView("r", "c", attempt=1,
                   tasks={t.key: TaskView(t.key, t.host.name, t.endpoint) for t in plan.tasks})
    watched = [Watched(t, TaskHandle(t.host.name, 0, t.log_path, t.rc_path), LocalRunner())
               for t in plan.tasks]
    out = io.StringIO()
    plain = PlainProgress(Console(file=out, width=200), every_s=0)
    attempt = AttemptWatch(spec, watched, view, plain, launcher=launcher_named("process"),
                           on_tick=lambda: None, on_event=lambda w, e: None,
                           python_for=lambda w: "python3")
    yield attempt, out
    attempt.close()


def say(attempt: AttemptWatch, task: int, event: str, **fields: Any) -> None:
    """One event line in a task's output, as the watch loop reads it."""
    w = attempt.watched[task]
    line = "@orchestrate " + json.dumps({"event": event, "task": w.key, "attempt": 1, **fields})
    attempt._feed(w, (line + "\n").encode())


def test_the_live_view_uses_the_replicas_the_tasks_report(watch: Any) -> None:
    attempt, out = watch
    for task in (0, 1):
        say(attempt, task, "connected", replicas=16, local_replicas=8, gpus=8,
            collectives="nccl", tf_version="2.21.0")
    say(attempt, 0, "built", global_batch_size=512, learning_rate=0.016, replicas=16,
        parameters=6922)
    view = attempt.view
    assert (view.replicas, view.collectives) == (16, "nccl")
    assert [t.replicas for t in view.tasks.values()] == [8, 8]
    expected = "16 replica(s) in sync (8 per task), NCCL collectives; global batch 512, " \
               "learning rate 0.016"
    assert replicas_text(view) == expected
    assert f"[worker:0] {expected}" in out.getvalue()
    frame = Console(file=io.StringIO(), width=200, record=True)
    frame.print(RunFrame().render(view))
    assert expected in frame.export_text()


def test_an_older_workers_connected_event_still_shows_the_replicas(watch: Any) -> None:
    attempt, _ = watch
    say(attempt, 0, "connected", replicas=2, tf_version="2.21.0")
    assert attempt.view.replicas == 2 and attempt.view.tasks["worker:0"].replicas is None
    assert replicas_text(attempt.view) == "2 replica(s) in sync"
    assert replicas_text(RunView("r", "c")) == ""


# -- the worker: memory growth and the collectives on this task's GPUs --------------------------
class FakeGpuConfig:
    """TensorFlow's tf.config as a task with GPUs sees it (this machine has none): the
    physical GPUs, and the memory growth set on each."""

    def __init__(self, gpus: int) -> None:
        self.gpus = [f"/physical_device:GPU:{i}" for i in range(gpus)]
        self.growth: list[str] = []
        self.experimental = self

    def list_physical_devices(self, kind: str) -> list[str]:
        return self.gpus if kind == "GPU" else []

    def set_memory_growth(self, device: str, enable: bool) -> None:
        assert enable
        self.growth.append(device)


class FakeTf:
    def __init__(self, gpus: int) -> None:
        self.config = FakeGpuConfig(gpus)


@pytest.mark.parametrize(("gpus", "asked", "growth", "chosen"), [
    (8, "auto", True, "nccl"), (8, "ring", True, "ring"), (8, "nccl", False, "nccl"),
    (0, "auto", True, "ring"), (0, "ring", True, "ring"),
])
def test_the_worker_sets_memory_growth_on_every_gpu_and_picks_the_collectives(
        gpus: int, asked: str, growth: bool, chosen: str) -> None:
    tf = FakeTf(gpus)
    devices = prepare_devices(tf, asked, growth)
    assert (devices.gpus, devices.collectives) == (gpus, chosen)
    assert tf.config.growth == (tf.config.gpus if growth else [])


def test_nccl_on_a_task_without_gpu_is_refused_with_the_fix() -> None:
    with pytest.raises(DeviceError, match=r"job\.collectives: auto"):
        prepare_devices(FakeTf(0), "nccl", True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_worker(tmp_path: Path, collectives: str) -> tuple[int, list[Event], str]:
    """``python -m worker managed`` as the controller starts it, as the one task of a cluster."""
    spec = parse(f"name: c\nworkers: 1\njob: {{module: examples.digits, epochs: 1, "
                 f"steps_per_epoch: 2, collectives: {collectives}}}\n")
    argv = runtime_for(spec.job).argv(spec, sys.executable)
    env = {**os.environ, **runtime_for(spec.job).env(spec),
           "TF_CONFIG": json.dumps({"cluster": {"worker": [f"127.0.0.1:{free_port()}"]},
                                    "task": {"type": "worker", "index": 0}}),
           "ORCHESTRATE_CHECKPOINT_DIR": str(tmp_path / "checkpoints"),
           "ORCHESTRATE_MODEL_DIR": str(tmp_path / "model"), "ORCHESTRATE_TASK": "worker:0"}
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    events = [e for e in map(parse_line, proc.stdout.splitlines()) if e is not None]
    return proc.returncode, events, proc.stdout + proc.stderr


@pytest.mark.tf
def test_a_task_on_real_tensorflow_connects_over_ring_and_reports_its_replicas(
        tmp_path: Path) -> None:
    code, events, output = run_worker(tmp_path, "ring")
    assert code == 0, output[-3000:]
    (connected,) = [e for e in events if e.kind == "connected"]
    assert {k: connected.get(k) for k in ("replicas", "local_replicas", "gpus", "collectives")} \
        == {"replicas": 1, "local_replicas": 1, "gpus": 0, "collectives": "ring"}
    (built,) = [e for e in events if e.kind == "built"]
    assert (built.get("global_batch_size"), built.get("learning_rate")) == (32, 0.001)


@pytest.mark.tf
def test_nccl_on_a_real_tensorflow_task_without_gpu_fails_as_a_build_error(tmp_path: Path) -> None:
    code, events, output = run_worker(tmp_path, "nccl")
    assert code == 1, output[-3000:]
    assert [e.kind for e in events] == ["started", "error"]
    error = events[-1]
    assert error.get("phase") == "build"  # the controller's user_error: not retried
    assert error.get("type") == "worker.runtimes.common.DeviceError"
    assert "TensorFlow sees no GPU in this task" in error.get("message")
