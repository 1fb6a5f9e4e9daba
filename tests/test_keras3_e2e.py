"""Keras 3 across workers and stops that lose no step, driven through the orchestrator the way a
user drives it: real TensorFlow, MultiWorkerMirroredStrategy over gRPC RING, local processes
and sshd hosts in network namespaces logged into as an unprivileged user.

The worker's side alone (hand-launched tasks, the loop's arithmetic) is in
tests/test_keras3_worker.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from helpers import (
    REPO,
    as_from_a_terminal,
    events_in,
    only_tf_aborts_before_the_last,
    orchestrate_home_at,
    png_size,
    release_run,
    scalar_steps,
    tensorboard_logs,
    traced_names,
    write_spec,
)
from hostlab import HostLab

from orchestrator import paths
from orchestrator.api import Cluster
from orchestrator.errors import RunFailed
from orchestrator.events import Event, parse_line
from orchestrator.state import Store
from orchestrator.view import RunResult, RunView

pytestmark = pytest.mark.tf

KERAS3 = ("{module: examples.keras3_digits, keras: 3, epochs: 2, steps_per_epoch: 40, "
          "progress_every_steps: 1, deterministic: true}")
# The same job, every batch taking at least 0.2 s until the test releases the run (right after it
# acted), so that a test acting at a step acts while training still runs, however slow the
# machine or late the event (the pace adds 0.0: the weights come out bit-identical).
PACED_KERAS3 = KERAS3.replace("examples.keras3_digits", "tests.workloads.paced_keras3_digits")
PACED_TF_KERAS = ("{module: tests.workloads.paced_digits, epochs: 2, steps_per_epoch: 40, "
                  "progress_every_steps: 1}")


def local_spec(tmp_path: Path, name: str, job: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(textwrap.dedent(f"""\
        name: {name}
        workdir: {REPO}
        workers: 2
        job: {job}
        checkpoint: {{every_steps: 10}}
        retry: {{max_restarts: 2, backoff_initial_s: 0.2, backoff_max_s: 1}}
        timeouts: {{startup_s: 180, stop_grace_s: 30}}
        """))
    return path


def events_of(log: str) -> list[Event]:
    return [e for e in map(parse_line, Path(log).read_text().splitlines()) if e is not None]


def at_step(step: int, act: Callable[[int], object], task: str = "worker:1",
            roots: Sequence[str] | None = None) -> Callable[[RunView, Event | None], None]:
    """A listener that calls ``act(pid of task)`` once, when ``task`` of attempt 1 reports
    ``step``, then releases the paced run (the steps after the act need no pacing) under the
    local provider's root, or under the host roots ``roots``."""
    pids: dict[str, int] = {}
    done: list[int] = []

    def listener(view: RunView, event: Event | None) -> None:
        if event is None or event.attempt != 1:
            return
        if event.kind == "started":
            pids[event.task] = int(event.get("pid"))
        if event.kind == "progress" and event.task == task and event.get("step") >= step \
                and not done:
            done.append(event.get("step"))
            act(pids[task])
            for root in roots or [str(paths.cluster_home(view.cluster))]:
                release_run(root, view.run_id)

    return listener


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    """The deterministic Keras 3 job, never interrupted: what every broken run must end as."""
    tmp = tmp_path_factory.mktemp("unbroken")
    home = tmp / "home"
    with orchestrate_home_at(home):
        return Cluster.from_spec(local_spec(tmp, "k3-unbroken", KERAS3)).train(doctor=False).wait()


def test_a_keras3_model_trains_on_two_workers_to_one_model_that_loads_anywhere(
        unbroken: RunResult) -> None:
    assert unbroken.status == "succeeded" and len(unbroken.attempts) == 1
    assert len(set(unbroken.digests.values())) == 1  # every worker holds the same weights
    chief_log = unbroken.attempts[0].tasks[0].log
    losses = [e.get("loss") for e in events_of(chief_log) if e.kind == "progress"]
    assert losses[-1] < losses[0] * 0.5  # it learned
    built = next(e for e in events_of(chief_log) if e.kind == "built")
    assert built.get("replicas") == 2 and built.get("global_batch_size") == 64
    assert unbroken.model_path.endswith("model.keras")
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, keras; m = keras.saving.load_model(sys.argv[1]); "
         "print(type(m).__name__, m.count_params())", unbroken.model_path],
        capture_output=True, text=True, timeout=120)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert loaded.stdout.split() == ["Functional", str(built.get("parameters"))]


def killed_at(log: str) -> int:
    """The last step a killed task said it completed."""
    return max(e.get("step") for e in events_of(log) if e.kind == "progress")


def test_a_killed_keras3_worker_resumes_from_the_chiefs_snapshot_bit_identical(
        tmp_path: Path, orchestrate_home: Path, unbroken: RunResult) -> None:
    path = local_spec(tmp_path, "k3-kill", PACED_KERAS3)
    listener = at_step(25, lambda pid: os.kill(pid, signal.SIGKILL))
    result = Cluster.from_spec(path).train(listener=listener, doctor=False).wait()

    first, second, *later = result.attempts
    only_tf_aborts_before_the_last([second, *later])
    assert (first.cause, first.failed_task) == ("crashed", "worker:1")
    # The chief saved its state as its step failed on the lost peer: at the step under way at
    # most one away from worker:1's last (the one it did not say, or the one the chief lacked).
    snapshots = [e.get("step") for e in events_of(first.tasks[0].log)
                 if e.kind == "checkpoint" and e.get("reason") == "snapshot"]
    killed = killed_at(first.tasks[1].log)
    assert snapshots == [first.snapshot_step] and abs(first.snapshot_step - killed) <= 1, \
        (snapshots, killed, first.snapshot)
    assert first.snapshot == f"worker:0 saved its state at step {snapshots[0]} after worker:1 failed"
    assert second.resumed_from_step == first.snapshot_step and first.steps_lost <= 1
    resumed = [e for e in events_of(second.tasks[1].log) if e.kind == "resumed"]
    assert resumed[0].get("step") == snapshots[0]  # the other worker restored the chief's
    assert set(result.digests.values()) == set(unbroken.digests.values())  # bit-identical


def test_with_snapshots_off_a_killed_worker_resumes_from_the_last_periodic_checkpoint(
        tmp_path: Path, orchestrate_home: Path, unbroken: RunResult) -> None:
    path = local_spec(tmp_path, "k3-nosnap", PACED_KERAS3)
    path.write_text(path.read_text().replace("retry: {", "retry: {snapshot_on_crash: false, "))
    listener = at_step(25, lambda pid: os.kill(pid, signal.SIGKILL))
    result = Cluster.from_spec(path).train(listener=listener, doctor=False).wait()

    first, second, *later = result.attempts
    only_tf_aborts_before_the_last([second, *later])
    checkpoints = [e.get("step") for e in events_of(first.tasks[0].log) if e.kind == "checkpoint"]
    assert all(step % 10 == 0 for step in checkpoints) and (first.snapshot_step,
                                                           first.snapshot) == (None, "")
    assert second.resumed_from_step == checkpoints[-1] > 0  # from the chief's, not from 0
    assert second.resumed_from_step <= first.last_step < 80
    assert set(result.digests.values()) == set(unbroken.digests.values())  # bit-identical


def test_sigterm_to_one_keras3_worker_saves_every_task_at_one_step_and_redoes_none(
        tmp_path: Path, orchestrate_home: Path, unbroken: RunResult) -> None:
    path = local_spec(tmp_path, "k3-term", PACED_KERAS3)
    listener = at_step(25, lambda pid: os.kill(pid, signal.SIGTERM))
    result = Cluster.from_spec(path).train(listener=listener, doctor=False).wait()

    first, second, *later = result.attempts
    only_tf_aborts_before_the_last([second, *later])
    stops = {t.task: [e.get("step") for e in events_of(t.log) if e.kind == "stopped"]
             for t in first.tasks}
    saved = stops["worker:1"][0]
    assert stops == {"worker:0": [saved], "worker:1": [saved]} and saved >= 25
    assert (first.cause, first.failed_task, first.exit_code) == ("preempted", "worker:1", 75)
    assert f"every task saved a checkpoint at step {saved}" in first.detail
    assert second.resumed_from_step == saved == first.last_step
    assert first.steps_lost == 0
    assert set(result.digests.values()) == set(unbroken.digests.values())


def test_sigterm_to_one_tf_keras_worker_redoes_no_step(tmp_path: Path,
                                                      orchestrate_home: Path) -> None:
    path = local_spec(tmp_path, "k2-term", PACED_TF_KERAS)
    listener = at_step(25, lambda pid: os.kill(pid, signal.SIGTERM))
    result = Cluster.from_spec(path).train(listener=listener, doctor=False).wait()

    first, second, *later = result.attempts
    only_tf_aborts_before_the_last([second, *later])
    assert (first.cause, first.failed_task) == ("preempted", "worker:1")
    saved = [e.get("step") for e in events_of(first.tasks[0].log) if e.kind == "stopped"]
    assert saved and second.resumed_from_step == saved[0] == first.last_step
    assert first.steps_lost == 0 and len(set(result.digests.values())) == 1


@pytest.mark.parametrize("keras", ["3", "2"])
def test_down_mid_run_saves_the_current_step_and_train_resume_redoes_none(
        tmp_path: Path, orchestrate_home: Path, unbroken: RunResult, keras: str) -> None:
    path = local_spec(tmp_path, "k3-down", PACED_KERAS3 if keras == "3" else PACED_TF_KERAS)

    def down(pid: int) -> None:  # from another controller, as 'orchestrate down' would
        Cluster.from_spec(path).down()

    listener = at_step(25, down)
    with pytest.raises(RunFailed, match="stopped by 'orchestrate down'"):
        Cluster.from_spec(path).train(listener=listener, doctor=False).wait()
    run = Store().runs("k3-down")[0]
    (attempt,) = run.attempts
    assert run.status == attempt.status == "stopped"
    saved = {t.task: [e.get("step") for e in events_of(t.log) if e.kind == "stopped"]
             for t in attempt.tasks}
    assert saved["worker:0"] == saved["worker:1"] and saved["worker:0"][0] >= 25
    assert {t.exit_code for t in attempt.tasks} == {75}

    result = Cluster.from_spec(path).train(resume="last", doctor=False).wait()
    assert result.run_id == run.id and result.status == "succeeded"
    first, second, *later = result.attempts
    only_tf_aborts_before_the_last([second, *later])
    assert second.resumed_from_step == saved["worker:0"][0] == first.last_step
    assert first.steps_lost == 0
    if keras == "3":  # deterministic: as if never stopped
        assert set(result.digests.values()) == set(unbroken.digests.values())


def test_ctrl_c_on_train_saves_every_task_and_train_resume_redoes_none(
        tmp_path: Path, orchestrate_home: Path) -> None:
    path = local_spec(tmp_path, "k2-ctrl-c", PACED_TF_KERAS)
    train = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli", "train", str(path), "--plain", "--no-doctor"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=as_from_a_terminal)
    try:
        logs = orchestrate_home / "clusters" / "k2-ctrl-c" / "runs"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not any(
                e.kind == "progress" and e.get("step") >= 25
                for log in logs.glob("*/logs/attempt-1/worker-0.log") for e in events_of(str(log))):
            time.sleep(0.2)
        train.send_signal(signal.SIGINT)
        output, _ = train.communicate(timeout=120)
    finally:
        if train.poll() is None:
            train.kill()
    assert train.returncode == 130, output
    assert "each saves a checkpoint at the same step" in output
    run = Store().runs("k2-ctrl-c")[0]
    assert run.status == "cancelled"
    saved = {e.get("step") for t in run.attempts[0].tasks for e in events_of(t.log)
             if e.kind == "stopped"}
    assert len(saved) == 1 and {t.exit_code for t in run.attempts[0].tasks} == {75}

    release_run(str(paths.cluster_home("k2-ctrl-c")), run.id)
    again = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "train", str(path), "--plain", "--no-doctor",
         "--resume", "last"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    (step,) = saved
    assert f"resumed at step {step}; 0 step(s) redone" in again.stdout
    first, second, *later = Store().get_run(run.id).attempts
    only_tf_aborts_before_the_last([second, *later])
    assert second.resumed_from_step == step and first.steps_lost == 0


@pytest.mark.ssh
def test_keras3_on_three_ssh_hosts_as_a_plain_user_recovers_a_killed_chief(
        hostlab: HostLab, tmp_path: Path, orchestrate_home: Path) -> None:
    hosts = hostlab.hosts(3)
    path = write_spec(tmp_path, hostlab, hosts, """\
        name: k3-static
        job: {module: tests.workloads.paced_keras3_digits, epochs: 2, steps_per_epoch: 30,
              progress_every_steps: 1}
        checkpoint: {every_steps: 10}
        retry: {max_restarts: 2, backoff_initial_s: 0.5, backoff_max_s: 2}
        timeouts: {stop_grace_s: 30}
        tensorboard: {profile_steps: [3, 4]}
        """, user=hostlab.plain_user())
    cluster = Cluster.from_spec(path)
    cluster.up()
    listener = at_step(15, lambda pid: hosts[0].run(["kill", "-9", str(pid)]), task="worker:0",
                       roots=[paths.host_root(h.plain_home, "k3-static") for h in hosts])
    result = cluster.train(listener=listener).wait()
    first, second, *later = result.attempts
    only_tf_aborts_before_the_last([second, *later])
    assert (first.cause, first.failed_task) == ("crashed", "worker:0")
    # worker:1, asked in the dead chief's place, saved the step the crash broke on its own
    # host's disk; the relaunch copied it from there to the chief's host and the third
    assert first.snapshot == (f"worker:1 saved its state at step {first.snapshot_step} after "
                              "worker:0 failed"), first.snapshot
    assert second.resumed_from_step == first.snapshot_step and first.steps_lost <= 1
    for h, task in zip(hosts, second.tasks, strict=True):
        assert task.log.startswith(h.plain_home)  # the unprivileged user's own home
        resumed = [e for e in events_in(h, task.log) if e.kind == "resumed"]
        assert resumed and resumed[0].get("step") == second.resumed_from_step
    losses = [e.get("loss") for e in events_in(hosts[0], result.attempts[-1].tasks[0].log)
              if e.kind == "progress"]
    assert losses[-1] < 1.0
    assert len(set(result.digests.values())) == 1
    assert Path(result.model_path).is_file()  # fetched from the chief host
    # The run's history, as 'status' draws it: every step of each attempt the chief reported,
    # from the step it resumed from (progress_every_steps: 1). (The step a survivor's snapshot
    # saved after the chief died may be one the chief never reported.)
    points = cluster.history()
    for attempt in result.attempts:
        steps = [p.step for p in points if p.attempt == attempt.number]
        assert steps == list(range((attempt.resumed_from_step or 0) + 1, (steps or [0])[-1] + 1))
    assert max(p.step for p in points if p.attempt == 1) >= 15 and points[-1].step == 60
    assert all(p.loss is not None and p.steps_per_s is not None for p in points)
    # The chief's TensorBoard logs, copied from its host during the run and once more at its
    # end (nothing is left to copy now): a file an attempt, every step's loss it reported once
    # (the steps redone after the crash are drawn from the attempt that redid them).
    logs = cluster.tensorboard()
    assert logs.copied == 0 and not logs.notes
    assert len(list(logs.directory.glob("events.out.tfevents.*"))) == len(result.attempts)
    assert logs.directory == paths.run_home("k3-static", first.run_id) / "tensorboard"
    board = tensorboard_logs(logs.directory)
    assert [s for s, _ in scalar_steps(board, "train/loss")] == sorted({p.step for p in points})
    assert [v for _, v in scalar_steps(board, "run/attempt")] == \
        [float(a.number) for a in result.attempts]
    # and the trace of steps 3-4 by attempt 1's chief, the killed one, copied with them
    (trace,) = logs.directory.glob("plugins/profile/*/*.xplane.pb")
    assert "__inference__train" in " ".join(traced_names(trace))
    # 'status' draws the run, the restarts marked, and 'status --plot' as an image.
    shown = subprocess.run([sys.executable, "-m", "orchestrator.cli", "status", "k3-static"],
                           cwd=REPO, capture_output=True, text=True, timeout=120,
                           env={**os.environ, "COLUMNS": "120"})
    assert shown.returncode == 0 and "┤" in shown.stdout, shown.stderr
    assert "attempt 2 at " in shown.stdout and ", after crashed in worker:0" in shown.stdout
    plotted = subprocess.run([sys.executable, "-m", "orchestrator.cli", "status", "k3-static",
                              "--plot", str(tmp_path / "k3.png")], cwd=REPO, timeout=120)
    assert plotted.returncode == 0 and png_size(tmp_path / "k3.png") == (1000, 600)
    cluster.down()


COMPILED = """
import keras
def build_model():
    model = keras.Sequential([keras.Input(shape=(4,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    return model
def make_dataset(global_batch_size, seed=None):
    raise AssertionError("never reached")
"""
NOT_A_MODEL = """
def build_model():
    return "a model"
def make_dataset(global_batch_size, seed=None):
    raise AssertionError("never reached")
"""


@pytest.mark.parametrize(("module", "keras", "says"), [
    (COMPILED, "auto", "compiled"),
    (NOT_A_MODEL, "auto", "str"),
    (None, "2", "job.keras is 2"),
], ids=["compiled", "not a model", "keras mismatch"])
def test_a_module_that_returns_the_wrong_thing_is_a_user_error_not_retried(
        tmp_path: Path, orchestrate_home: Path, module: str | None, keras: str,
        says: str) -> None:
    if module is not None:
        (tmp_path / "wrong.py").write_text(textwrap.dedent(module))
    name = "examples.keras3_digits" if module is None else "wrong"
    path = tmp_path / "cluster.yaml"
    path.write_text(f"name: wrong\nworkers: 1\nworkdir: {tmp_path if module else REPO}\n"
                    f"job: {{module: {name}, keras: '{keras}'}}\nretry: {{max_restarts: 3}}\n")
    with pytest.raises(RunFailed) as info:
        Cluster.from_spec(path).train(doctor=False)
    assert says in str(info.value)
    run = Store().get_run(info.value.run_id)
    assert len(run.attempts) == 1 and run.attempts[0].cause == "user_error"
