"""The managed runtime on JAX (``job.backend: jax``) driven as a user drives it: the Keras 3
digits module that the TensorFlow loop trains (``examples.keras3_digits``), on real JAX
processes (the distributed service, gloo collectives on CPU), started, killed and stopped by
the orchestrator on local processes.

The command-mode JAX tests (a script of Keras's own guide) are in tests/test_keras_jax.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from helpers import REPO, events_in, orchestrate_home_at, write_spec
from hostlab import HostLab
from test_keras3_e2e import at_step, events_of

from orchestrator import paths
from orchestrator.api import Cluster
from orchestrator.errors import RunFailed
from orchestrator.state import AttemptRecord, Store
from orchestrator.view import RunResult

pytestmark = pytest.mark.tf  # JAX keeps the cores busy as TensorFlow does

JOB = ("{module: examples.keras3_digits, backend: jax, epochs: 2, steps_per_epoch: 40, "
       "progress_every_steps: 1, deterministic: true, per_replica_batch_size: %d}")
# The same job, every batch taking at least 0.2 s until the test releases the run.
PACED = JOB.replace("examples.keras3_digits", "tests.workloads.paced_jax_digits")


def local_spec(tmp_path: Path, name: str, job: str, workers: int = 2, batch: int = 32,
               warm: bool | str = "auto") -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(textwrap.dedent(f"""\
        name: {name}
        workdir: {REPO}
        workers: {workers}
        job: {job % batch}
        checkpoint: {{every_steps: 10}}
        retry: {{max_restarts: 2, backoff_initial_s: 0.2, backoff_max_s: 1,
                 warm_tasks: {str(warm).lower()}}}
        timeouts: {{startup_s: 180, stop_grace_s: 30}}
        """))
    return path


def train(path: Path, **kwargs: object) -> RunResult:
    return Cluster.from_spec(path).train(doctor=False, **kwargs).wait()  # type: ignore[arg-type]


def epoch_losses(attempt: AttemptRecord) -> list[float]:
    return [e.get("logs")["loss"] for e in events_of(attempt.tasks[0].log) if e.kind == "epoch"]


def step_losses(attempt: AttemptRecord, last: int) -> list[tuple[int, float]]:
    """(step, loss) the chief reported for each step up to ``last``."""
    return [(e.get("step"), e.get("loss")) for e in events_of(attempt.tasks[0].log)
            if e.kind == "progress" and e.get("step") <= last]


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    """The deterministic job on 2 processes, never interrupted: what every broken run must end
    as."""
    tmp = tmp_path_factory.mktemp("unbroken")
    with orchestrate_home_at(tmp / "home"):
        return train(local_spec(tmp, "jax-unbroken", JOB))


def test_a_keras3_module_trains_on_jax_processes_to_one_model_that_loads_anywhere(
        unbroken: RunResult) -> None:
    assert unbroken.status == "succeeded" and len(unbroken.attempts) == 1
    assert len(unbroken.digests) == 2 and len(set(unbroken.digests.values())) == 1
    events = events_of(unbroken.attempts[0].tasks[0].log)
    connected = next(e for e in events if e.kind == "connected")
    assert connected.get("replicas") == 2 and connected.get("collectives") == "gloo"
    built = next(e for e in events if e.kind == "built")
    assert built.get("replicas") == 2 and built.get("global_batch_size") == 64
    losses = [e.get("loss") for e in events if e.kind == "progress"]
    assert len(losses) == 80 and losses[-1] < losses[0] * 0.5  # it learned
    checkpoints = [e.get("step") for e in events if e.kind == "checkpoint"]
    assert checkpoints == [10, 20, 30, 40, 50, 60, 70, 80]
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, keras; m = keras.saving.load_model(sys.argv[1]); "
         "print(keras.backend.backend(), type(m).__name__, m.count_params())",
         unbroken.model_path],
        capture_output=True, text=True, timeout=120, env={**os.environ, "KERAS_BACKEND": "jax"})
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert loaded.stdout.split() == ["jax", "Functional", str(built.get("parameters"))]


def test_two_processes_reproduce_one_process_at_the_same_global_batch(
        tmp_path: Path, orchestrate_home: Path, unbroken: RunResult) -> None:
    # 2 replicas train at 2 x the learning rate (job.scale_learning_rate); so does the 1 here.
    job = JOB.replace("backend: jax,", "backend: jax, learning_rate: 0.002,")
    one = train(local_spec(tmp_path, "jax-one", job, workers=1, batch=64))
    assert one.status == "succeeded"
    # The same examples in every global batch, the same seeds: the same training, up to the
    # order in which the gradients' sums are added.
    np.testing.assert_allclose(epoch_losses(unbroken.attempts[0]), epoch_losses(one.attempts[0]),
                               rtol=1e-4)


def killed_at(log: str) -> int:
    """The last step a killed task said it completed."""
    return max(e.get("step") for e in events_of(log) if e.kind == "progress")


def snapshots_in(attempt: AttemptRecord) -> list[int]:
    """The steps of the snapshots the chief saved in ``attempt``."""
    return [e.get("step") for e in events_of(attempt.tasks[0].log)
            if e.kind == "checkpoint" and e.get("reason") == "snapshot"]


# With warm tasks, the relaunch's processes were started, JAX, Keras and the module imported,
# before the kill.
def test_a_killed_process_resumes_from_the_chiefs_snapshot_at_the_step_it_broke_bit_identical(
        tmp_path: Path, orchestrate_home: Path, unbroken: RunResult) -> None:
    path = local_spec(tmp_path, "jax-kill", PACED, warm=True)
    listener = at_step(25, lambda pid: os.kill(pid, signal.SIGKILL))
    result = train(path, listener=listener)

    assert result.status == "succeeded"
    first, second = result.attempts
    assert (first.cause, first.failed_task) == ("crashed", "worker:1")
    # The chief's step failed at once on the lost peer (gloo: the connection reset), and it
    # saved the state of the last step it completed, kept on its devices: at most one away
    # from worker:1's last (the one it did not say, or the one the chief lacked).
    killed = killed_at(first.tasks[1].log)
    assert snapshots_in(first) == [first.snapshot_step] and \
        abs(first.snapshot_step - killed) <= 1, (snapshots_in(first), killed, first.snapshot)
    assert first.snapshot == \
        f"worker:0 saved its state at step {first.snapshot_step} after worker:1 failed"
    assert second.resumed_from_step == first.snapshot_step and first.steps_lost <= 1
    resumed = [e for e in events_of(second.tasks[1].log) if e.kind == "resumed"]
    assert resumed[0].get("step") == first.snapshot_step  # the other process restored it
    assert set(result.digests.values()) == set(unbroken.digests.values())  # bit-identical
    gone = [[e.get("cold") for e in events_of(t.log) if e.kind == "go"] for t in second.tasks]
    assert gone == [[False], [False]]


def test_the_chief_killed_worker_1_saves_in_its_place_and_the_group_resumes_there_bit_identical(
        tmp_path: Path, orchestrate_home: Path, unbroken: RunResult) -> None:
    """worker:0 is JAX's process 0, whose process JAX runs the coordination service in; the
    runtime runs it in a process of its own beside the chief's, so the other process lives on
    when the chief dies (with the service in it, it aborted 0.1 s later), its step fails on the
    lost peer, and, asked by the controller, it saves the state of the last step it completed
    into the chief's directory. The relaunch starts cold."""
    path = local_spec(tmp_path, "jax-kill0", PACED, warm=False)
    listener = at_step(25, lambda pid: os.kill(pid, signal.SIGKILL), task="worker:0")
    result = train(path, listener=listener)

    assert result.status == "succeeded"
    first, second = result.attempts
    assert (first.cause, first.failed_task) == ("crashed", "worker:0")
    killed = killed_at(first.tasks[0].log)
    saved = [e.get("step") for e in events_of(first.tasks[1].log)
             if e.kind == "checkpoint" and e.get("reason") == "snapshot"]
    assert saved == [first.snapshot_step] and abs(first.snapshot_step - killed) <= 1, \
        (saved, killed, first.snapshot)
    assert first.snapshot == \
        f"worker:1 saved its state at step {first.snapshot_step} after worker:0 failed"
    assert second.resumed_from_step == first.snapshot_step and first.steps_lost <= 1
    resumed = [e for e in events_of(second.tasks[0].log) if e.kind == "resumed"]
    assert resumed[0].get("step") == first.snapshot_step  # the new chief restored worker:1's
    assert set(result.digests.values()) == set(unbroken.digests.values())  # bit-identical
    gone = [[e.get("cold") for e in events_of(t.log) if e.kind == "go"] for t in second.tasks]
    assert gone == [[], []]


def test_with_snapshots_off_a_killed_process_resumes_from_the_last_periodic_checkpoint(
        tmp_path: Path, orchestrate_home: Path, unbroken: RunResult) -> None:
    path = local_spec(tmp_path, "jax-nosnap", PACED, warm=False)
    path.write_text(path.read_text().replace("retry: {", "retry: {snapshot_on_crash: false, "))
    listener = at_step(25, lambda pid: os.kill(pid, signal.SIGKILL))
    result = train(path, listener=listener)

    assert result.status == "succeeded"
    first, second = result.attempts
    checkpoints = [e.get("step") for e in events_of(first.tasks[0].log) if e.kind == "checkpoint"]
    assert all(step % 10 == 0 for step in checkpoints) and \
        (first.snapshot_step, first.snapshot) == (None, "")
    assert second.resumed_from_step == checkpoints[-1] > 0
    assert second.resumed_from_step <= first.last_step < 80
    assert set(result.digests.values()) == set(unbroken.digests.values())  # bit-identical


def test_sigterm_to_one_process_saves_every_process_at_one_step_and_redoes_none(
        tmp_path: Path, orchestrate_home: Path, unbroken: RunResult) -> None:
    path = local_spec(tmp_path, "jax-term", PACED)
    listener = at_step(25, lambda pid: os.kill(pid, signal.SIGTERM))
    result = train(path, listener=listener)

    first, second = result.attempts
    stops = {t.task: [(e.get("step"), e.get("signal")) for e in events_of(t.log)
                      if e.kind == "stopped"] for t in first.tasks}
    saved = stops["worker:1"][0][0]
    assert stops == {"worker:0": [(saved, "peer")], "worker:1": [(saved, "SIGTERM")]}
    assert saved >= 25
    assert (first.cause, first.failed_task, first.exit_code) == ("preempted", "worker:1", 75)
    assert f"every task saved a checkpoint at step {saved}" in first.detail
    assert second.resumed_from_step == saved == first.last_step
    assert first.steps_lost == 0
    assert set(result.digests.values()) == set(unbroken.digests.values())


def test_down_mid_run_saves_the_current_step_and_train_resume_redoes_none(
        tmp_path: Path, orchestrate_home: Path, unbroken: RunResult) -> None:
    path = local_spec(tmp_path, "jax-down", PACED)

    def down(pid: int) -> None:  # from another controller, as 'orchestrate down' would
        Cluster.from_spec(path).down()

    with pytest.raises(RunFailed, match="stopped by 'orchestrate down'"):
        train(path, listener=at_step(25, down))
    run = Store().runs("jax-down")[0]
    (attempt,) = run.attempts
    assert run.status == attempt.status == "stopped"
    saved = {t.task: [e.get("step") for e in events_of(t.log) if e.kind == "stopped"]
             for t in attempt.tasks}
    assert saved["worker:0"] == saved["worker:1"] and saved["worker:0"][0] >= 25
    assert {t.exit_code for t in attempt.tasks} == {75}

    result = Cluster.from_spec(path).train(resume="last", doctor=False).wait()
    assert result.run_id == run.id and result.status == "succeeded"
    first, second = result.attempts
    assert second.resumed_from_step == saved["worker:0"][0] == first.last_step
    assert first.steps_lost == 0
    assert set(result.digests.values()) == set(unbroken.digests.values())


# The same model, its input a tf.data pipeline of global batches (tests/workloads). Unpaced, so
# 2 x 60 steps: the kill at step 25 lands mid-run, well before the end, however late the
# listener sees that step. (Each step of 2 processes reading the pipeline costs some 50 ms of
# CPU on a 2-core machine: 2 x 150 steps cost a 2-process run some 14 CPU-s more than 10 did.)
TFDATA = JOB.replace("examples.keras3_digits", "tests.workloads.tfdata_jax_digits").replace(
    "steps_per_epoch: 40", "steps_per_epoch: 60")


def test_a_tf_data_pipeline_trains_on_jax_and_a_killed_process_resumes_bit_identical(
        tmp_path: Path, orchestrate_home: Path) -> None:
    """A TensorFlow user's make_dataset (a tf.data.Dataset of global batches): each process
    keeps its rows of every batch (so 2 processes train as 1 does on the whole batch), and a
    resume skips the batches already trained on, so a killed run ends as the unbroken one."""
    unbroken = train(local_spec(tmp_path, "jax-tfdata", TFDATA))
    job = TFDATA.replace("backend: jax,", "backend: jax, learning_rate: 0.002,")
    one = train(local_spec(tmp_path, "jax-tfdata-one", job, workers=1, batch=64))
    # Step by step, while the two trainings differ only by the order in which the gradients'
    # sums are added: that difference grows with every step (measured: 1e-7 at step 1, 5e-7 at
    # step 10, 7e-5 at step 30; the second epoch's mean loss 1% apart on one CPU, within 1e-4
    # on another), while rows taken wrongly would change the loss of the first step already.
    first = [step_losses(r.attempts[0], 10) for r in (unbroken, one)]
    assert [s for s, _ in first[0]] == [s for s, _ in first[1]] == list(range(1, 11))
    np.testing.assert_allclose([x for _, x in first[0]], [x for _, x in first[1]], rtol=1e-5)
    listener = at_step(25, lambda pid: os.kill(pid, signal.SIGKILL), task="worker:1")
    result = train(local_spec(tmp_path, "jax-tfdata-kill", TFDATA), listener=listener)

    assert unbroken.status == result.status == "succeeded"
    first, second = result.attempts
    assert first.cause == "crashed" and (second.resumed_from_step or 0) >= 20
    assert len(set(unbroken.digests.values())) == 1
    assert set(result.digests.values()) == set(unbroken.digests.values())


BAD_MODULE = '''\
import keras
import numpy as np


def build_model():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    return model


def make_dataset(global_batch_size, seed=None):
    return {"x": np.zeros((64, 4), "float32")}
'''


# Weights drawn from an unseeded NumPy generator: different in each process.
UNSEEDED_MODULE = '''\
import keras
import numpy as np


def build_model():
    start = float(np.random.default_rng().normal())
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(
        1, kernel_initializer=keras.initializers.Constant(start))])


def make_dataset(global_batch_size, seed=None):
    return np.zeros((64, 4), "float32"), np.zeros((64, 1), "float32")
'''


@pytest.mark.parametrize(("module", "said"), [
    (BAD_MODULE, "on job.backend jax, return a tuple (features, labels) of NumPy arrays"),
    (UNSEEDED_MODULE, "are not the same in process(es) 1 as in process 0: build_model() and "
                      "what it calls must make the same weights in every process"),
], ids=["a dict for a dataset", "weights that differ between processes"])
def test_a_module_that_returns_what_jax_cannot_train_is_a_user_error_not_retried(
        tmp_path: Path, orchestrate_home: Path, module: str, said: str) -> None:
    (tmp_path / "bad_jax.py").write_text(module)
    path = tmp_path / "bad.yaml"
    path.write_text(textwrap.dedent(f"""\
        name: jax-bad
        workdir: {tmp_path}
        workers: 2
        job: {{module: bad_jax, backend: jax, loss: mse, metrics: []}}
        retry: {{max_restarts: 2, backoff_initial_s: 0}}
        """))
    with pytest.raises(RunFailed) as info:
        Cluster.from_spec(path).train(doctor=False)
    assert said in str(info.value)
    run = Store().get_run(info.value.run_id)
    assert len(run.attempts) == 1 and run.attempts[0].cause == "user_error"


def test_a_torn_newest_checkpoint_is_dropped_for_the_one_before_without_tensorflow(
        tmp_path: Path, unbroken: RunResult) -> None:
    """``verify-checkpoint`` on the JAX runtime's checkpoints (Keras's .weights.h5 and the
    .state.npz), on a host where TensorFlow cannot be imported."""
    events = events_of(unbroken.attempts[0].tasks[0].log)
    chief_dir = Path(next(e for e in events if e.kind == "checkpoint").get("path"))
    base = tmp_path / "checkpoints"
    shutil.copytree(chief_dir, base / "chief")
    newest = base / "chief" / "ckpt-80.weights.h5"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # a save cut short
    verify = subprocess.run(
        [sys.executable, "-c", "import sys; sys.modules['tensorflow'] = None; "
         "from worker.__main__ import main; sys.exit(main())", "verify-checkpoint",
         "--dir", str(base)], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert verify.returncode == 0, verify.stderr[-2000:]
    result = json.loads(verify.stdout)
    assert result["path"] == str(base / "chief" / "ckpt-70")
    assert [r["path"] for r in result["rejected"]] == [str(base / "chief" / "ckpt-80")]
    index = (base / "chief" / "checkpoint").read_text()
    assert 'model_checkpoint_path: "ckpt-70"' in index and "ckpt-80" not in index
    assert sorted(p.name for p in (base / "chief").iterdir()) == [
        "checkpoint", "ckpt-60.state.npz", "ckpt-60.weights.h5", "ckpt-70.state.npz",
        "ckpt-70.weights.h5"]


@pytest.mark.ssh
def test_on_three_ssh_hosts_as_a_plain_user_a_killed_process_resumes_from_the_copied_snapshot(
        hostlab: HostLab, tmp_path: Path, orchestrate_home: Path) -> None:
    """Each host checkpoints to its own disk: before the relaunch the controller verifies the
    chief's newest (its snapshot: Keras's .weights.h5 and the .state.npz) and copies it to the
    others."""
    hosts = hostlab.hosts(3)
    path = write_spec(tmp_path, hostlab, hosts, """\
        name: jax-static
        job: {module: tests.workloads.paced_jax_digits, backend: jax, epochs: 2,
              steps_per_epoch: 30, progress_every_steps: 1}
        checkpoint: {every_steps: 10}
        retry: {max_restarts: 2, backoff_initial_s: 0.5, backoff_max_s: 2}
        timeouts: {stop_grace_s: 30}
        """, user=hostlab.plain_user())
    cluster = Cluster.from_spec(path)
    listener = at_step(15, lambda pid: hosts[2].run(["kill", "-9", str(pid)]), task="worker:2",
                       roots=[paths.host_root(h.plain_home, "jax-static") for h in hosts])
    result = cluster.train(listener=listener).wait()
    first, second = result.attempts
    assert (first.cause, first.failed_task) == ("crashed", "worker:2")
    # Of 3 processes in gloo's ring, the chief's step waits on worker:1, whose own waits on
    # the dead one: it neither completes nor fails. The controller's request, read on a thread
    # of the chief's, saved the state of the last step it completed while the step waited.
    killed = max(e.get("step") for e in events_in(hosts[2], first.tasks[2].log)
                 if e.kind == "progress")
    assert first.snapshot == \
        f"worker:0 saved its state at step {first.snapshot_step} after worker:2 failed", \
        first.snapshot
    assert abs(first.snapshot_step - killed) <= 1, (first.snapshot_step, killed)
    assert second.resumed_from_step == first.snapshot_step
    for h, task in zip(hosts, second.tasks, strict=True):
        assert task.log.startswith(h.plain_home)  # the unprivileged user's own home
        resumed = [e for e in events_in(h, task.log) if e.kind == "resumed"]
        assert resumed and resumed[0].get("step") == second.resumed_from_step
    assert len(result.digests) == 3 and len(set(result.digests.values())) == 1
    assert Path(result.model_path).is_file()  # fetched from the chief host
    cluster.down()


MODEL_PARALLEL = ("{module: tests.workloads.model_parallel_digits, backend: jax, epochs: 2, "
                  "steps_per_epoch: 40, progress_every_steps: 1, deterministic: true, "
                  "learning_rate: 0.002, distribution: model_parallel, mesh: [1, 2], "
                  "per_replica_batch_size: %d}")


def test_model_parallel_splits_the_variables_over_both_processes_and_resumes_bit_identical(
        tmp_path: Path, orchestrate_home: Path, unbroken: RunResult) -> None:
    """Mesh [1, 2] over 2 processes of 1 device each: every Dense kernel is split between the
    processes, each process feeds the whole global batch (the batch axis is 1). It trains as
    data parallelism does at the same global batch and learning rate (the module's unbroken
    run: 2 replicas of 32, 0.001 x 2), and a process killed mid-run resumes from the chief's
    checkpoint (the split variables gathered to save) to the same weights."""
    whole = train(local_spec(tmp_path, "jax-mp", MODEL_PARALLEL, batch=64))
    assert whole.status == "succeeded" and len(whole.attempts) == 1
    events = events_of(whole.attempts[0].tasks[0].log)
    built = next(e for e in events if e.kind == "built")
    assert built.get("replicas") == 1 and built.get("global_batch_size") == 64
    assert built.get("learning_rate") == 0.002
    np.testing.assert_allclose(epoch_losses(whole.attempts[0]),
                               epoch_losses(unbroken.attempts[0]), rtol=1e-4)

    paced = MODEL_PARALLEL.replace("tests.workloads.model_parallel_digits",
                                   "tests.workloads.paced_model_parallel_digits")
    listener = at_step(25, lambda pid: os.kill(pid, signal.SIGKILL))
    result = train(local_spec(tmp_path, "jax-mp-kill", paced, batch=64), listener=listener)
    first, second = result.attempts
    assert (first.cause, first.failed_task) == ("crashed", "worker:1")
    # No snapshot of split variables: the chief holds only its part of each kernel.
    assert first.snapshot == (
        "worker:0 could not save one: the variables are split over the processes "
        "(job.distribution: model_parallel): a survivor holds only its part of them"), \
        first.snapshot
    assert second.resumed_from_step == 20
    assert set(result.digests.values()) == set(whole.digests.values())


DEFERRED = '''\
import numpy as np
import jax
import keras
from keras.src.backend.jax import core
from worker.runtimes.keras_jax import Processes, _placed_once

before = (core.Variable._initialize_with_initializer, core.Variable._direct_assign)
keras.utils.set_random_seed(7)
expected = keras.layers.Dense(3)
expected.build((None, 4))
keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()))
keras.utils.set_random_seed(7)
with _placed_once(jax, Processes("", 1, 0), restoring=True) as placed:
    layer = keras.layers.Dense(3, bias_initializer="ones")
    layer.build((None, 4))
    assert not np.asarray(layer.kernel.value).any()  # a zero until the restore sets it or not
    with placed.restoring():
        layer.bias.assign(np.full(3, 5.0, "float32"))
    placed.initialize_the_rest()
np.testing.assert_array_equal(np.asarray(layer.kernel.value), np.asarray(expected.kernel.value))
np.testing.assert_array_equal(np.asarray(layer.bias.value), np.full(3, 5.0, "float32"))
assert (core.Variable._initialize_with_initializer, core.Variable._direct_assign) == before
assert not placed.deferred
print("ok", placed.count)
'''


VERIFY_IN_A_BUCKET = """
import json, sys
import tensorflow as tf
from worker.checkpoints import index_names, verify

source, base = sys.argv[1], sys.argv[2]
for name in tf.io.gfile.listdir(source):
    data = open(f"{source}/{name}", "rb").read()
    if name == "ckpt-80.weights.h5":
        data = data[: len(data) // 2]  # a save cut short
    tf.io.gfile.makedirs(f"{base}/chief")
    with tf.io.gfile.GFile(f"{base}/chief/{name}", "wb") as f:
        f.write(data)
print(json.dumps({"result": verify(base), "index": index_names(f"{base}/chief"),
                  "files": sorted(tf.io.gfile.listdir(f"{base}/chief"))}))
"""


def test_checkpoints_in_a_bucket_are_verified_there_and_a_torn_one_dropped(
        tmp_path: Path, unbroken: RunResult) -> None:
    """The same check on a URL (a ``file://`` one standing in for gs://: the same tf.io.gfile
    calls; TensorFlow's ``ram://`` appends where a rewrite must replace): read there, the index
    rewritten there, the torn files deleted there."""
    events = events_of(unbroken.attempts[0].tasks[0].log)
    chief_dir = next(e for e in events if e.kind == "checkpoint").get("path")
    base = f"file://{tmp_path}/bucket/runs/r1"
    done = subprocess.run([sys.executable, "-c", VERIFY_IN_A_BUCKET, chief_dir, base],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.splitlines()[-1])
    chief = f"{base}/chief"
    assert said["result"]["ok"] and said["result"]["path"] == f"{chief}/ckpt-70"
    assert [r["path"] for r in said["result"]["rejected"]] == [f"{chief}/ckpt-80"]
    assert said["index"] == ["ckpt-60", "ckpt-70"]
    assert said["files"] == ["checkpoint", "ckpt-60.state.npz", "ckpt-60.weights.h5",
                             "ckpt-70.state.npz", "ckpt-70.weights.h5"]


def test_a_variable_the_restore_does_not_set_gets_what_its_initializer_makes(
        tmp_path: Path) -> None:
    """On a resume the initializers wait for the restore; one it does not set (here the
    kernel) is initialized afterwards to the values the build would have given it, and one it
    sets keeps the checkpoint's."""
    script = tmp_path / "deferred.py"
    script.write_text(DEFERRED)
    done = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True,
                          text=True, timeout=120,
                          env={**os.environ, "KERAS_BACKEND": "jax", "PYTHONPATH": str(REPO)})
    assert done.returncode == 0 and done.stdout.split()[0] == "ok", done.stderr[-3000:]


FITS = """
import json, types
from worker.tfimport import keras
keras = keras()
import numpy as np
from worker.runtimes.keras_jax import JaxTraining
taken = []
def batches():
    step = 0
    while True:
        taken.append(step)
        yield np.full((4, 3), step, "float32"), np.zeros((4, 1), "float32")
        step += 1
trained = []
class Seen(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        trained.append(len(taken))
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
model.compile("sgd", "mse")
stub = types.SimpleNamespace(model=model, _keeps_snapshots=False)
source, counts = batches(), []
for epochs, initial_epoch, steps in ((1, 0, 1), (3, 1, 2)):  # a resume's rest of 1, then 2 x 2
    JaxTraining._fit(stub, source, Seen(), epochs=epochs, initial_epoch=initial_epoch,
                     steps=steps)
    counts.append(len(taken))
print(json.dumps({"counts": counts, "trained": len(trained)}))
"""


def test_a_fit_of_one_step_takes_one_batch_so_a_resume_at_an_epochs_last_step_stays_exact(
        ) -> None:
    """Keras 3.15's fit of one epoch of one step takes two batches from a generator and trains
    on one: a JAX run resumed at the last step but one of an epoch (a worker killed at step 19
    of 20) trained every later step on the batch after its own, and ended with other weights
    than an unbroken run (the chaos soak found it). The runtime fits on exactly the batches it
    trains on."""
    out = subprocess.run([sys.executable, "-c", FITS], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "KERAS_BACKEND": "jax"}, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["counts"] == [1, 5] and result["trained"] == 5, result
