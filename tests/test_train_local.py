"""Real TensorFlow: MultiWorkerMirroredStrategy over gRPC RING between local processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from orchestrator.api import Cluster
from orchestrator.errors import RunFailed
from orchestrator.events import Event, parse_line
from orchestrator.state import Store
from orchestrator.view import RunView

pytestmark = pytest.mark.tf
REPO = Path(__file__).resolve().parent.parent


def events_of(log: Path) -> list[Event]:
    return [e for e in map(parse_line, log.read_text().splitlines()) if e is not None]


def spec_file(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(f"workdir: {REPO}\n" + textwrap.dedent(body))
    return path


def test_cli_trains_the_example_on_two_workers(orchestrate_home: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "train", "cluster_specs/local.yaml"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "ORCHESTRATE_HOME": str(orchestrate_home)},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "succeeded" in proc.stdout and "final accuracy" in proc.stdout
    assert "step 160/160" in proc.stdout  # live progress lines, plain when not on a terminal

    run = Store(orchestrate_home / "state.db").runs("digits-local")[0]
    assert run.status == "succeeded" and len(run.attempts) == 1
    assert Path(run.model_path).is_file() and f"model saved by the chief: {run.model_path}" in (
        proc.stdout)
    logs = {t.task: Path(t.log) for t in run.attempts[0].tasks}
    losses = [e.get("loss") for e in events_of(logs["worker:0"]) if e.kind == "progress"]
    assert losses[-1] < losses[0] * 0.5  # it learned
    digests = {k: next(e.get("weights_sha256") for e in events_of(p) if e.kind == "finished")
               for k, p in logs.items()}
    assert len(set(digests.values())) == 1  # both workers hold identical final weights
    connected = [e for e in events_of(logs["worker:1"]) if e.kind == "connected"]
    assert connected[0].get("replicas") == 2


def test_killed_worker_resumes_from_the_chiefs_checkpoint(tmp_path: Path) -> None:
    path = spec_file(tmp_path, """\
        name: kill-test
        workers: 2
        job: {module: examples.digits, epochs: 3, steps_per_epoch: 40, progress_every_steps: 1}
        checkpoint: {every_steps: 10}
        retry: {max_restarts: 2, backoff_initial_s: 0.5, backoff_max_s: 2}
        timeouts: {startup_s: 180, stop_grace_s: 2}
        """)
    pids: dict[str, int] = {}
    killed_at: list[int] = []

    def kill_worker_1_mid_training(view: RunView, event: Event | None) -> None:
        if event is None or event.attempt != 1:
            return
        if event.kind == "started":
            pids[event.task] = int(event.get("pid"))
        if event.kind == "progress" and event.task == "worker:1" and event.get("step") >= 35 \
                and not killed_at:
            killed_at.append(int(event.get("step")))
            os.kill(pids["worker:1"], signal.SIGKILL)

    cluster = Cluster.from_spec(path)
    result = cluster.train(listener=kill_worker_1_mid_training).wait()

    assert killed_at, "the worker was never killed"
    assert result.status == "succeeded"
    first, second = result.attempts
    assert (first.cause, first.failed_task, first.exit_code) == ("crashed", "worker:1", 137)
    assert "signal 9" in first.detail
    checkpoints = [e.get("step") for e in events_of(Path(first.tasks[0].log))
                   if e.kind == "checkpoint"]
    assert second.resumed_from_step == checkpoints[-1] > 0  # not from step 0
    # At most one step past the last one reported: a survivor whose update of the step under
    # way was whole (the peer was lost in the step's later collective, the metrics') saves that
    # step, which fit never reported (FitTraining.snapshot).
    assert second.resumed_from_step <= first.last_step + 1
    assert first.last_step >= killed_at[0]
    resumed = [e for e in events_of(Path(second.tasks[1].log)) if e.kind == "resumed"]
    assert resumed and resumed[0].get("step") == second.resumed_from_step
    assert len(set(result.digests.values())) == 1
    assert Store().get_run(result.run_id).attempts[0].cause == "crashed"


def test_separate_chief_form_trains_and_the_chief_saves(tmp_path: Path) -> None:
    path = spec_file(tmp_path, """\
        name: chief-form
        workers: 1
        separate_chief: true
        job: {module: examples.digits, epochs: 1, steps_per_epoch: 20}
        """)
    result = Cluster.from_spec(path).train().wait()
    assert set(result.digests) == {"chief:0", "worker:0"}
    assert len(set(result.digests.values())) == 1
    assert "/model/model.keras" in result.model_path and Path(result.model_path).is_file()
    tf_config = json.loads(Cluster.from_spec(path).plan().tasks[0].env["TF_CONFIG"])
    assert tf_config["task"] == {"type": "chief", "index": 0}


def test_command_mode_runs_the_tutorial_script_unmodified(tmp_path: Path,
                                                          orchestrate_home: Path) -> None:
    model_dir = tmp_path / "model"
    path = spec_file(tmp_path, f"""\
        name: command-test
        workers: 2
        job:
          command: python examples/command_mode/train.py --model-dir {model_dir} --epochs 1
        """)
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", "train", str(path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "ORCHESTRATE_HOME": str(orchestrate_home)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (model_dir / "model.keras").is_file()
    assert not (model_dir / "workertemp_1").exists()  # the script's own cleanup ran
    logs = subprocess.run([sys.executable, "-m", "orchestrator.cli", "logs", "command-test"],
                          capture_output=True, text=True, check=True,
                          env={**os.environ, "ORCHESTRATE_HOME": str(orchestrate_home)}).stdout
    assert "[worker:0] final loss" in logs and "[worker:1] final loss" in logs


def test_broken_user_code_fails_fast_as_a_user_error(tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text(
        "def build_model():\n    raise RuntimeError('layer sizes do not match')\n"
        "def make_dataset(global_batch_size, seed=None):\n    return None\n")
    path = tmp_path / "cluster.yaml"
    path.write_text("name: broken\nworkers: 2\njob: {module: broken}\n"
                    "retry: {max_restarts: 3}\n")
    with pytest.raises(RunFailed) as info:
        Cluster.from_spec(path).train()
    assert "layer sizes do not match" in str(info.value)
    assert "fix the error in your training code" in (info.value.fix or "")
    run = Store().get_run(info.value.run_id)
    assert len(run.attempts) == 1 and run.attempts[0].cause == "user_error"
