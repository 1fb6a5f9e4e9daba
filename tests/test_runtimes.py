"""Job runtimes, table-tested: which runtime runs which job, and what each gives a task (argv,
env), the plan (description, batch and learning rate) and the doctor (rules)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, get_args

import pytest

from orchestrator import spec as specs
from orchestrator.runtimes import RUNTIMES, BatchScaling, runtime_for
from orchestrator.runtimes.command import CommandRuntime
from orchestrator.runtimes.tf_keras import TfKerasFit
from worker.runtimes import RUNTIMES as WORKER_RUNTIMES

REPO = Path(__file__).resolve().parent.parent
MANAGED = "job: {module: m, epochs: 3, steps_per_epoch: 10, per_replica_batch_size: 16}\n"
COMMAND = "job: {command: python3 train.py --epochs 3}\n"


def parse(job: str, extra: str = "") -> specs.ClusterSpec:
    return specs.parse(f"name: c\n{job}{extra}")


def job_models() -> list[type[Any]]:
    union = get_args(specs.Job)[0]
    return list(get_args(union))


@pytest.mark.parametrize(("job", "runtime"), [
    (MANAGED, TfKerasFit), (COMMAND, CommandRuntime), ("job: {mode: managed, module: m}\n", TfKerasFit),
])
def test_the_jobs_mode_picks_its_runtime(job: str, runtime: type[Any]) -> None:
    assert isinstance(runtime_for(parse(job).job), runtime)


def test_every_kind_of_job_in_the_spec_has_a_runtime_on_both_sides() -> None:
    modes = {model.model_fields["mode"].default for model in job_models()}
    assert set(RUNTIMES) == modes == set(WORKER_RUNTIMES)
    for model in job_models():
        assert RUNTIMES[model.model_fields["mode"].default].job_type is model


@pytest.mark.parametrize(("job", "extra", "argv"), [
    (MANAGED, "", ("/py", "-m", "worker", "managed", "--job")),
    (COMMAND, "", ("/py", "-m", "worker", "command", "--", "/py", "train.py", "--epochs", "3")),
    ("job: {command: python train.py}\n", "", ("/py", "-m", "worker", "command", "--", "/py",
                                               "train.py")),
    ("job: {command: bash run.sh}\n", "", ("/py", "-m", "worker", "command", "--", "bash",
                                           "run.sh")),
])
def test_argv_runs_the_worker_in_the_jobs_mode(job: str, extra: str, argv: tuple[str, ...]) -> None:
    spec = parse(job, extra)
    got = runtime_for(spec.job).argv(spec, "/py")
    assert got[:len(argv)] == argv
    if spec.job.mode == "command":
        assert got == argv


def test_the_managed_job_reaches_the_worker_as_json_with_checkpoint_and_collective_timeout() -> None:
    spec = parse(MANAGED, "checkpoint: {every_steps: 7}\ntimeouts: {collective_s: 45}\n")
    argv = runtime_for(spec.job).argv(spec, "/py")
    job = json.loads(argv[5])
    assert len(argv) == 6 and "mode" not in job
    assert (job["checkpoint_every_steps"], job["collective_timeout_s"]) == (7, 45)
    assert (job["module"], job["epochs"], job["per_replica_batch_size"]) == ("m", 3, 16)


@pytest.mark.parametrize(("job", "legacy"), [
    (MANAGED, "1"), (COMMAND, "1"),
    ("job: {module: m, keras: auto}\n", "1"), ("job: {module: m, keras: 2}\n", "1"),
    ("job: {module: m, keras: 3}\n", "0"), ("job: {command: python3 t.py, keras: 3}\n", "0"),
    ("job: {command: python3 t.py, keras: '2'}\n", "1"),
])
def test_tf_keras_is_tf_keras_in_tasks_unless_the_job_says_keras_3(job: str, legacy: str) -> None:
    spec = parse(job)
    assert runtime_for(spec.job).env(spec)["TF_USE_LEGACY_KERAS"] == legacy


@pytest.mark.parametrize(("job", "field"), [
    ("job: {module: m, keras: 4}\n", "job.keras"),
    ("job: {module: m, keras: true}\n", "job.keras"),
    ("job: {command: python3 t.py, keras: auto}\n", "job.command.keras"),
])
def test_a_keras_that_does_not_exist_is_refused_naming_the_field(job: str, field: str) -> None:
    with pytest.raises(specs.SpecError) as caught:
        parse(job)
    assert field.rsplit(".", 1)[-1] in str(caught.value) and "keras" in str(caught.value)


@pytest.mark.parametrize(("job", "reports_steps"), [(MANAGED, True), (COMMAND, False)])
def test_only_the_managed_runtime_reports_steps(job: str, reports_steps: bool) -> None:
    assert runtime_for(parse(job).job).reports_steps is reports_steps


@pytest.mark.parametrize(("job", "runtime", "total_steps", "summary"), [
    (MANAGED, "tf_keras", 30, "managed: m, 3 epoch(s) x 10 steps = 30 steps, optimizer adam, "
     "Keras auto (by the model build_model() returns)"),
    (COMMAND, "command", None, "command: python3 train.py --epochs 3 (TF_CONFIG set for it)"),
])
def test_describe_gives_the_plan_the_job_its_length_and_one_line(
        job: str, runtime: str, total_steps: int | None, summary: str) -> None:
    spec = parse(job)
    described = runtime_for(spec.job).describe(spec.job)
    assert (described.runtime, described.total_steps, described.summary) == (
        runtime, total_steps, summary)
    assert described.settings == spec.job.model_dump(mode="json")


@pytest.mark.parametrize(("job", "replicas", "figures"), [
    (MANAGED, 4, (16, 64, 0.001, 0.004)),
    (MANAGED.replace("}", ", scale_learning_rate: false, learning_rate: 0.01}"), 4,
     (16, 64, 0.01, 0.01)),
    (COMMAND, 4, (None, None, None, None)),
])
def test_batch_and_learning_rate_follow_the_replicas_as_the_runtime_says(
        job: str, replicas: int, figures: tuple[Any, ...]) -> None:
    spec = parse(job)
    rule = runtime_for(spec.job).scaling(spec.job)
    assert (rule.per_replica_batch_size, rule.global_batch_size(replicas), rule.learning_rate,
            rule.scaled_learning_rate(replicas)) == pytest.approx(figures)


def test_no_scaling_is_the_default() -> None:
    assert BatchScaling().global_batch_size(8) is None
    assert BatchScaling(learning_rate=0.1).scaled_learning_rate(8) == 0.1


@pytest.mark.parametrize(("job", "needs_tensorflow", "matching"), [
    (MANAGED, True, ["tf_keras"]), (COMMAND, False, []),
])
def test_each_runtime_names_its_doctor_rules(job: str, needs_tensorflow: bool,
                                             matching: list[str]) -> None:
    rules = runtime_for(parse(job).job).doctor_rules
    assert rules.needs_tensorflow is needs_tensorflow
    assert [p.module for p in rules.matching] == matching


def test_a_runtime_refuses_another_kind_of_job() -> None:
    with pytest.raises(TypeError, match="tf_keras runtime runs ManagedJob jobs, received CommandJob"):
        TfKerasFit().argv(parse(COMMAND), "/py")


def worker_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "worker", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60)


def test_the_worker_cli_offers_every_runtime_and_the_checkpoint_check() -> None:
    proc = worker_cli("--help")
    assert proc.returncode == 0, proc.stderr
    assert "{managed,command,verify-checkpoint,preflight}" in proc.stdout


def test_the_worker_command_runtime_needs_a_command() -> None:
    proc = worker_cli("command", "--")
    assert proc.returncode == 2
    assert "python -m worker: error: command mode needs the command after --" in proc.stderr


def test_the_worker_command_runtime_reports_start_and_exit_code() -> None:
    proc = worker_cli("command", "--", sys.executable, "-c", "import os, sys; "
                      "print(os.environ['TF_USE_LEGACY_KERAS']); sys.exit(3)")
    assert proc.returncode == 3
    events = [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines()
              if line.startswith("@orchestrate ")]
    assert [e["event"] for e in events] == ["started", "error"]
    assert events[0]["mode"] == "command" and events[1]["exit_code"] == 3
    assert "1" in proc.stdout.splitlines()


def test_a_sigterm_after_the_script_ended_leaves_its_exit_code(tmp_path: Path) -> None:
    """'down' TERMs every group; a script that had already stopped at its peer's step (exit
    75) must be recorded 75 even when the TERM reaches its wrapper while the wrapper's Python
    shuts down, which a loaded host makes last: CI once recorded 143. A sitecustomize makes
    this wrapper's shutdown last, and says when it has begun."""
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent("""
        import sys, time
        class _Slow:
            def __del__(self):
                print("shutting down", file=sys.stderr, flush=True)
                time.sleep(3)
        _slow = _Slow()
        """))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    proc = subprocess.Popen([sys.executable, "-m", "worker", "command", "--", "sh", "-c",
                             "exit 75"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None and proc.stdout is not None
        assert proc.stderr.readline() == "shutting down\n"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 75
        assert '"exit_code": 75' in proc.stdout.read()
    finally:
        proc.kill()
        proc.wait()
