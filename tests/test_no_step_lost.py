"""What a crash costs where the chief's snapshot cannot help or is not needed: a task that dies
after the last step (while the model is saved) makes the group go on from the last step, for
every managed runtime; a model whose state cannot be saved without its lost peer falls back to
the last checkpoint, saying why. Real TensorFlow (and JAX), local processes. (A crash mid-run
resuming from the chief's snapshot is tested with the runtimes: tests/test_recovery_local.py,
tests/test_keras3_e2e.py, tests/test_faults.py, tests/test_container_e2e.py.)"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from helpers import (
    REPO,
    free_port,
    prometheus_samples,
    release_run,
    scalar_steps,
    tensorboard_logs,
    traced_names,
)

from orchestrator import paths
from orchestrator.api import Cluster
from orchestrator.events import Event
from orchestrator.view import RunView

pytestmark = pytest.mark.tf

JOBS = {
    "tf_keras": "{module: tests.workloads.held_save, epochs: 1, steps_per_epoch: 25, "
                "deterministic: true, seed: 7}",
    "keras3": "{module: tests.workloads.held_save, keras: 3, epochs: 1, steps_per_epoch: 25, "
              "deterministic: true}",
    "jax": "{module: tests.workloads.held_save, backend: jax, epochs: 1, steps_per_epoch: 25, "
           "deterministic: true}",
}
# What each runtime's trace shows running: its compiled training step.
TRAINED = {"tf_keras": "__inference_train_function", "keras3": "__inference__train",
           "jax": "PjitFunction(train_step)"}
BASES = {"tf_keras": "tests.workloads.paced_digits",
         "keras3": "tests.workloads.paced_keras3_digits",
         "jax": "tests.workloads.paced_jax_digits"}


def kill_when_held(cluster: str, stop: threading.Event) -> list[int]:
    """Once worker:1 waits before its final save (its ``held`` file), SIGKILL it and release
    the run; the pid killed."""
    killed: list[int] = []

    def watch() -> None:
        runs = paths.cluster_home(cluster) / "runs"
        while not stop.is_set():
            for held in runs.glob("*/held"):
                pid = int(held.read_text())
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                release_run(str(paths.cluster_home(cluster)), held.parent.name)
                return
            time.sleep(0.05)

    threading.Thread(target=watch, daemon=True).start()
    return killed


@pytest.mark.parametrize("runtime", list(JOBS))
def test_a_task_killed_after_the_last_step_costs_no_step(
        tmp_path: Path, orchestrate_home: Path, runtime: str) -> None:
    name = f"end-{runtime.replace('_', '')}"
    path = tmp_path / f"{name}.yaml"
    port, textfile = free_port(), tmp_path / "run.prom"
    path.write_text(textwrap.dedent(f"""\
        name: {name}
        workdir: {REPO}
        workers: 2
        job: {JOBS[runtime]}
        checkpoint: {{every_steps: 10}}
        retry: {{max_restarts: 2, backoff_initial_s: 0.2, backoff_max_s: 1}}
        timeouts: {{startup_s: 180, stop_grace_s: 30}}
        env: {{HELD_SAVE_OF: {BASES[runtime]}, DIGITS_PACE_S: "0.05"}}
        metrics: {{prometheus_port: {port}, textfile: {textfile}}}
        tensorboard: {{profile_steps: [4, 6]}}
        """))
    stop = threading.Event()
    killed = kill_when_held(name, stop)
    scraped: list[dict[str, float]] = []

    said: list[str] = []

    def scrape(view: RunView, event: Event | None) -> None:
        """Prometheus' view of the run while it trains: once, at a step of attempt 1."""
        said[:] = view.messages
        if event is not None and event.kind == "progress" and event.get("step") >= 10 \
                and not scraped:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as got:
                scraped.append({**prometheus_samples(got.read().decode()),
                                "seen": event.get("step")})

    try:
        result = Cluster.from_spec(path).train(listener=scrape, doctor=False).wait()
    finally:
        stop.set()
    assert killed, "worker:1 never reached its final save"
    first, second = result.attempts
    assert (first.cause, first.failed_task) == ("crashed", "worker:1"), first.detail
    # Trained to the end: the group goes on from the last step (25, not the checkpoint at 20,
    # nor 0 where tf_keras' BackupAndRestore deleted its checkpoint), and only saves.
    assert first.last_step == 25 and second.resumed_from_step == 25 and first.steps_lost == 0
    # and the record says why the chief saved no snapshot: it had nothing more to save
    assert first.snapshot.startswith("worker:0 exited (") and first.snapshot.endswith(
        ") without saving one; step 25, the last it reported, was checkpointed already"), \
        first.snapshot
    assert result.status == "succeeded" and Path(result.model_path).is_file()
    assert result.metrics.get("loss") is not None  # the last epoch trained says, not attempt 2
    # The chief's TensorBoard log, as TensorBoard loads it: one file an attempt, every step's
    # loss once, and where attempt 2 began and why.
    board = paths.cluster_home(name) / "runs" / first.run_id / "tensorboard"
    assert len(list(board.glob("events.out.tfevents.*"))) == 2
    logs = tensorboard_logs(board)
    assert [step for step, _ in scalar_steps(logs, "train/loss")] == list(range(1, 26))
    rates = [rate for _, rate in scalar_steps(logs, "train/learning_rate")]
    assert len(rates) == 25 and rates[0] > 0 and rates == [pytest.approx(rates[0])] * 25
    assert scalar_steps(logs, "run/attempt") == [(0, 1.0), (25, 2.0)]
    marks = [(e.step, e.tensor_proto.string_val[0].decode()) for e in logs.Tensors("run/attempts")]
    assert marks[0] == (0, "attempt 1 began at step 0")
    assert marks[1][0] == 25 and marks[1][1].startswith(
        "attempt 2 began at step 25, after:\n\n    worker:1 crashed: "), marks
    assert Cluster.from_spec(path).tensorboard().directory == board  # written here: no copy
    # Steps 4-6 traced by the framework's own profiler, once (attempt 2 began after them).
    traces = list(board.glob("plugins/profile/*/*.xplane.pb"))
    assert len(traces) == 1, traces
    names = traced_names(traces[0])
    assert any(TRAINED[runtime] in name for name in names), sorted(names)[:50]
    chief_log = Path(next(t.log for t in first.tasks if t.task == "worker:0")).read_text()
    assert f"steps 4-6 profiled into {board}/plugins/profile" in chief_log
    assert f"worker:0: steps 4-6 profiled into {board}/plugins/profile " \
           "(TensorBoard's Profile tab)" in said, said
    # Prometheus saw it train, and the textfile says how it ended: one crash, no step redone.
    assert scraped and scraped[0]["orchestrate_run_running"] == 1.0, scraped
    assert scraped[0]["orchestrate_attempt"] == 1.0
    assert 1 <= scraped[0]["orchestrate_step"] <= scraped[0]["seen"]  # (a step or two behind)
    ended = prometheus_samples(textfile.read_text())
    assert ended["orchestrate_run_running"] == 0.0 and ended["orchestrate_attempt"] == 2.0
    assert ended['orchestrate_restarts_total{cause="crashed"}'] == 1.0
    assert ended["orchestrate_step"] == 25.0 and ended["orchestrate_steps_redone_total"] == 0.0
    assert ended["orchestrate_recovery_seconds_total"] == pytest.approx(first.recovery_s or 0.0)
    if runtime == "tf_keras":
        served_loss_is_the_logs(path, scalar_steps(logs, "train/loss"))


def served_loss_is_the_logs(spec: Path, loss: list[tuple[int, float]]) -> None:
    """`orchestrate tensorboard FILE` serves the run's logs: its scalars endpoint returns
    ``loss``."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cli = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "tensorboard", str(spec),
                            "--port", str(port)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert cli.stdout is not None
        assert cli.stdout.readline().startswith(f"TensorBoard at http://127.0.0.1:{port}/ on ")
        url = (f"http://127.0.0.1:{port}/data/plugin/scalars/scalars?"
               + urllib.parse.urlencode({"tag": "train/loss", "run": "."}))
        deadline = time.monotonic() + 120
        served: list[list[float]] = []
        while not served:  # (an error, or nothing, until TensorBoard has loaded the logs)
            try:
                with urllib.request.urlopen(url, timeout=5) as answer:
                    served = json.loads(answer.read())
            except (OSError, ValueError):
                pass
            assert cli.poll() is None and time.monotonic() < deadline, "TensorBoard never served"
            time.sleep(0.5)
        assert [(step, value) for _, step, value in served] == \
            [(step, pytest.approx(value)) for step, value in loss]
    finally:
        cli.send_signal(signal.SIGINT)  # Ctrl-C: TensorBoard is ended with it
        assert cli.wait(30) == 130


def test_a_model_with_statistics_synchronized_on_read_falls_back_to_the_last_checkpoint(
        tmp_path: Path, orchestrate_home: Path) -> None:
    """tf_keras' BatchNormalization keeps its statistics per task; saving them averages them
    over every task, which the lost one cannot join: no snapshot, and the record says why."""
    path = tmp_path / "bn.yaml"
    path.write_text(textwrap.dedent(f"""\
        name: bn-snap
        workdir: {REPO}
        workers: 2
        job: {{module: tests.workloads.paced_bn_digits, epochs: 1, steps_per_epoch: 30,
               progress_every_steps: 1}}
        checkpoint: {{every_steps: 10}}
        retry: {{max_restarts: 2, backoff_initial_s: 0.2, backoff_max_s: 1}}
        timeouts: {{startup_s: 180, stop_grace_s: 30}}
        """))
    pids: dict[str, int] = {}

    def listener(view: RunView, event: Event | None) -> None:
        if event is None or event.attempt != 1:
            return
        if event.kind == "started":
            pids[event.task] = int(event.get("pid"))
        if event.kind == "progress" and event.task == "worker:1" and event.get("step") >= 15 \
                and "killed" not in pids:
            pids["killed"] = int(event.get("step"))
            os.kill(pids["worker:1"], signal.SIGKILL)
            release_run(str(paths.cluster_home(view.cluster)), view.run_id)

    result = Cluster.from_spec(path).train(listener=listener, doctor=False).wait()
    first, second = result.attempts
    assert (first.cause, first.failed_task, first.snapshot_step) == ("crashed", "worker:1", None)
    assert first.snapshot.startswith("worker:0 could not save one: the model has variables "
                                     "synchronized on read"), first.snapshot
    resumed = second.resumed_from_step or 0
    assert resumed > 0 and resumed % 10 == 0 and result.status == "succeeded"  # a periodic one
