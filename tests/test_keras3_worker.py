"""Real TensorFlow, workers launched by hand as the controller launches them (``python -m worker
managed --job JSON`` with TF_CONFIG and the ORCHESTRATE_* variables): Keras 3 in the runtime's
distributed loop, the save that every task makes on a SIGTERM (both Keras), exact resume, and
the build errors that name the fix."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from orchestrator.events import Event, parse_line
from worker.runtimes.common import STOPPED_EXIT
from worker.runtimes.keras3 import metric_function
from worker.runtimes.managed import BuildError

pytestmark = pytest.mark.tf
REPO = Path(__file__).resolve().parent.parent
KERAS3_DIGITS = "examples.keras3_digits"
PACED_KERAS3 = "tests.workloads.paced_keras3_digits"
PACED_TF_KERAS = "tests.workloads.paced_digits"
WAIT_S = 240.0  # for events; generous, for a loaded 2-core machine


def managed_job(module: str, **overrides: Any) -> dict[str, Any]:
    """A job as the controller sends it (the spec's ManagedJob, plus two fields)."""
    return {
        "module": module, "model_fn": "build_model", "dataset_fn": "make_dataset",
        "keras": "auto", "epochs": 2, "steps_per_epoch": 40, "per_replica_batch_size": 32,
        "optimizer": "adam", "learning_rate": 0.001, "scale_learning_rate": True,
        "loss": "sparse_categorical_crossentropy", "metrics": ["accuracy"], "seed": 1234,
        "deterministic": False, "progress_every_steps": 1, "checkpoint_every_steps": 10,
        "collective_timeout_s": None, **overrides,
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def events_of(log: Path) -> list[Event]:
    text = log.read_text() if log.exists() else ""
    return [e for e in map(parse_line, text.splitlines()) if e is not None]


@dataclass
class Group:
    """Tasks of one attempt, each a ``python -m worker managed`` process with its own log."""

    run_dir: Path
    procs: list[subprocess.Popen[bytes]]
    logs: list[Path]

    def events(self, index: int, kind: str | None = None) -> list[Event]:
        return [e for e in events_of(self.logs[index]) if kind is None or e.kind == kind]

    def wait_for(self, index: int, test: Callable[[Event], bool]) -> Event:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            found = [e for e in self.events(index) if test(e)]
            if found:
                return found[0]
            if self.procs[index].poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"no such event from task {index}:\n{self.logs[index].read_text()}")

    def wait(self) -> list[int]:
        return [p.wait(timeout=WAIT_S) for p in self.procs]

    def output(self) -> str:
        return "\n".join(f"--- task {i}\n{log.read_text()}" for i, log in enumerate(self.logs))


@dataclass
class Launcher:
    """Starts groups of tasks on loopback ports and kills, by PID, whatever is left at the end."""

    started: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self, run_dir: Path, job: dict[str, Any], *, workers: int = 2, attempt: int = 1,
              legacy_keras: str = "1", env: dict[str, str] | None = None) -> Group:
        ports = [free_port() for _ in range(workers)]
        cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
        logs_dir = run_dir / f"attempt-{attempt}"
        logs_dir.mkdir(parents=True, exist_ok=True)
        procs, logs = [], []
        for index in range(workers):
            log = logs_dir / f"worker-{index}.log"
            task_env = {
                **os.environ, **(env or {}),
                "TF_CONFIG": json.dumps({"cluster": cluster,
                                         "task": {"type": "worker", "index": index}}),
                "TF_USE_LEGACY_KERAS": legacy_keras,
                "ORCHESTRATE_CHECKPOINT_DIR": str(run_dir / "checkpoints"),
                "ORCHESTRATE_MODEL_DIR": str(run_dir / "model"),
                "ORCHESTRATE_TASK": f"worker:{index}", "ORCHESTRATE_ATTEMPT": str(attempt),
            }
            with log.open("wb") as out:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "worker", "managed", "--job", json.dumps(job)],
                    cwd=REPO, env=task_env, stdout=out, stderr=subprocess.STDOUT))
            logs.append(log)
        self.started += procs
        return Group(run_dir, procs, logs)

    def kill_all(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture
def launcher() -> Iterator[Launcher]:
    launcher = Launcher()
    yield launcher
    launcher.kill_all()


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Group]:
    """examples.keras3_digits trained to the end by 2 workers in deterministic mode (Keras 3)."""
    launcher = Launcher()
    run_dir = tmp_path_factory.mktemp("unbroken")
    group = launcher.start(run_dir, managed_job(KERAS3_DIGITS, keras="3", deterministic=True,
                                                checkpoint_every_steps=20),
                           legacy_keras="0")
    try:
        assert group.wait() == [0, 0], group.output()
        yield group
    finally:
        launcher.kill_all()


def digest_of_saved_model(path: str) -> str:
    """The weights digest of a saved model, loaded by Keras 3 in a fresh process."""
    code = ("import hashlib, sys, keras; m = keras.saving.load_model(sys.argv[1]); "
            "d = hashlib.sha256(); [d.update(w.tobytes()) for w in m.get_weights()]; "
            "print(type(m).__name__, d.hexdigest())")
    proc = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "TF_USE_LEGACY_KERAS": "0"})
    assert proc.returncode == 0, proc.stderr
    kind, digest = proc.stdout.split()[-2:]
    assert kind == "Functional"
    return digest


def test_two_workers_train_a_keras3_model_to_identical_weights(unbroken: Group) -> None:
    connected = [unbroken.events(i, "connected")[0] for i in (0, 1)]
    assert [e.get("replicas") for e in connected] == [2, 2]
    built = unbroken.events(0, "built")[0]
    assert (built.get("global_batch_size"), built.get("replicas")) == (64, 2)
    losses = [e.get("loss") for e in unbroken.events(0, "progress")]
    assert len(losses) == 80 and losses[-1] < losses[0] * 0.5  # it learned
    assert unbroken.events(0, "progress") [-1].get("metrics")["accuracy"] > 0.8
    finished = [unbroken.events(i, "finished")[0] for i in (0, 1)]
    assert [f.get("step") for f in finished] == [80, 80]
    digests = {f.get("weights_sha256") for f in finished}
    assert len(digests) == 1  # every task holds the same weights: gradients were all-reduced
    assert finished[0].get("metrics") == unbroken.events(0, "epoch")[-1].get("logs")

    model_path = finished[0].get("model_path")
    assert model_path == str(unbroken.run_dir / "model" / "model.keras")
    assert finished[1].get("model_path") == ""  # only the chief keeps the model
    assert digest_of_saved_model(model_path) in digests


def test_a_keras3_checkpoint_is_in_backup_and_restores_layout_and_verifies(
        unbroken: Group) -> None:
    checkpoints = unbroken.run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["chief"]  # no workertemp_1 left
    reported = [e.get("step") for e in unbroken.events(0, "checkpoint")]
    assert reported == [20, 40, 60, 80] and not unbroken.events(1, "checkpoint")
    # `python -m worker verify-checkpoint`, saying at exit which of Keras 3 and JAX it loaded:
    # neither (tf.train reads the checkpoint; Keras 3's and JAX's imports are a third of the CPU
    # it takes, on the recovery's path)
    said = ("import atexit, runpy, sys; atexit.register(lambda: print('LOADED', "
            "[m for m in ('keras', 'jax') if sys.modules.get(m)], file=sys.stderr)); "
            "sys.argv[0] = 'worker'; runpy.run_module('worker', run_name='__main__')")
    environment = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
    proc = subprocess.run([sys.executable, "-c", said, "verify-checkpoint", "--dir",
                           str(checkpoints)], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=environment)
    assert proc.returncode == 0, proc.stderr
    assert "LOADED []" in proc.stderr.splitlines(), proc.stderr[-2000:]
    verified = json.loads(proc.stdout.splitlines()[-1])
    assert verified["ok"] and verified["rejected"] == []
    assert verified["path"] == str(checkpoints / "chief" / "ckpt-80")


def test_a_deterministic_keras3_run_killed_and_resumed_ends_bit_identical(
        unbroken: Group, launcher: Launcher, tmp_path: Path) -> None:
    # The same job on the same data, paced so that the kill lands mid-run.
    job = managed_job(PACED_KERAS3, keras="3", deterministic=True, checkpoint_every_steps=20)
    first = launcher.start(tmp_path, job, legacy_keras="0", env={"DIGITS_PACE_S": "0.05"})
    first.wait_for(0, lambda e: e.kind == "progress" and e.get("step") >= 25)
    for proc in reversed(first.procs):  # as the controller stops a failed group
        os.kill(proc.pid, signal.SIGKILL)
    assert first.wait() == [-9, -9]
    saved = [e.get("step") for e in first.events(0, "checkpoint")][-1]
    assert saved >= 20

    (tmp_path / "release").touch()
    second = launcher.start(tmp_path, job, attempt=2, legacy_keras="0")
    assert second.wait() == [0, 0], second.output()
    assert [second.events(i, "resumed")[0].get("step") for i in (0, 1)] == [saved, saved]
    expected = unbroken.events(0, "finished")[0].get("weights_sha256")
    assert [second.events(i, "finished")[0].get("weights_sha256") for i in (0, 1)] == [
        expected, expected]


@pytest.mark.parametrize(("module", "keras", "signalled"), [
    (PACED_KERAS3, "auto", 1),  # Keras 3 (chosen by the model), a non-chief task gets TERM
    (PACED_TF_KERAS, "2", 0),  # tf_keras' fit, the chief gets TERM
])
def test_sigterm_to_one_task_makes_every_task_save_at_one_step_and_resume_there(
        module: str, keras: str, signalled: int, launcher: Launcher, tmp_path: Path) -> None:
    job = managed_job(module, keras=keras, epochs=3)
    first = launcher.start(tmp_path, job, env={"DIGITS_PACE_S": "0.05"})
    first.wait_for(0, lambda e: e.kind == "progress" and e.get("step") >= 15)
    first.procs[signalled].send_signal(signal.SIGTERM)
    assert first.wait() == [STOPPED_EXIT, STOPPED_EXIT], first.output()

    stopped = [first.events(i, "stopped") for i in (0, 1)]
    assert [len(s) for s in stopped] == [1, 1]
    step = stopped[0][0].get("step")
    assert 15 < step < 120 and stopped[1][0].get("step") == step
    assert stopped[signalled][0].get("signal") == "SIGTERM"
    assert stopped[1 - signalled][0].get("signal") == "peer"
    final = first.events(0, "checkpoint")[-1]
    assert (final.get("step"), final.get("reason")) == (step, "stop")
    assert final.get("path") == str(tmp_path / "checkpoints" / "chief")
    assert not first.events(1, "checkpoint")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["chief"]
    for i in (0, 1):
        assert all(e.get("step") <= step for e in first.events(i, "progress"))

    (tmp_path / "release").touch()
    second = launcher.start(tmp_path, job, attempt=2)
    assert second.wait() == [0, 0], second.output()
    assert [second.events(i, "resumed")[0].get("step") for i in (0, 1)] == [step, step]  # 0 redone
    assert [second.events(i, "finished")[0].get("step") for i in (0, 1)] == [120, 120]


BROKEN = {
    "returns_a_layer": ("import keras\n"
                        "def build_model():\n    return keras.layers.Dense(3)\n",
                        "auto", "keras.src.layers.core.dense.Dense, not a Keras model: return a "
                        "keras.Model (Keras 3) or a tf_keras.Model (Keras 2)"),
    "compiles_its_model": ("import tf_keras\n"
                           "def build_model():\n"
                           "    m = tf_keras.Sequential([tf_keras.Input((4,)), "
                           "tf_keras.layers.Dense(2)])\n"
                           "    m.compile(optimizer='sgd', loss='mse')\n    return m\n",
                           "auto", "returned a compiled model (tf_keras.src.engine.sequential."
                           "Sequential): the runtime compiles it with job.optimizer, job.loss "
                           "and job.metrics; return it uncompiled"),
    "keras_mismatch": ("from examples.keras3_digits import build_model\n", "2",
                       "job.keras is 2 (tf_keras) but build_model() returned a Keras 3 model "
                       "(keras.src.models.functional.Functional): the module imports keras; "
                       "set job.keras: 3 or auto"),
}


def test_build_errors_name_what_build_model_returned_and_the_fix(
        launcher: Launcher, tmp_path: Path) -> None:
    groups = {}
    for name, (source, keras, _) in BROKEN.items():
        (tmp_path / f"{name}.py").write_text(
            source + "def make_dataset(global_batch_size, seed=None):\n    return None\n")
        groups[name] = launcher.start(tmp_path / name, managed_job(name, keras=keras), workers=1,
                                      env={"PYTHONPATH": str(tmp_path)})
    for name, group in groups.items():
        assert group.wait() == [1], group.output()
        errors = group.events(0, "error")
        assert [e.get("phase") for e in errors] == ["build"], group.output()
        assert errors[0].get("type") == "worker.runtimes.managed.BuildError"
        assert BROKEN[name][2] in errors[0].get("message")
        assert not group.events(0, "built")


def test_a_tf_keras_module_may_give_arrays_which_the_runtime_batches(
        launcher: Launcher, tmp_path: Path) -> None:
    # The module's atexit handler (a tracker's last upload, say) runs: a finished task ends
    # without the interpreter's teardown, but after its atexit handlers.
    (tmp_path / "arrays.py").write_text(textwrap.dedent("""\
        import atexit, os
        import numpy as np
        from sklearn.datasets import load_digits

        from examples.digits import build_model

        atexit.register(lambda: open(os.environ["AT_EXIT"], "w").close())

        def make_dataset(global_batch_size, seed=None):
            features, labels = load_digits(return_X_y=True)
            return (features / 16.0).astype(np.float32), labels
        """))
    group = launcher.start(tmp_path / "run", managed_job("arrays", epochs=1, steps_per_epoch=30),
                           workers=1, env={"PYTHONPATH": str(tmp_path),
                                           "AT_EXIT": str(tmp_path / "at-exit")})
    assert group.wait() == [0], group.output()
    losses = [e.get("loss") for e in group.events(0, "progress")]
    assert len(losses) == 30 and losses[-1] < losses[0]
    assert group.events(0, "finished")[0].get("step") == 30
    assert (tmp_path / "at-exit").exists()


def test_fits_input_iterators_outlive_fit_and_the_patch_is_undone() -> None:
    """Destroying fit's input iterator as fit returns blocked a task for seconds now and then
    while its peers waited in the final save (see ``keeping_input_iterators``); the runtime
    keeps them instead."""
    import tensorflow as tf
    import tf_keras
    from tf_keras.src.engine import data_adapter

    from worker.runtimes.tf_keras import keeping_input_iterators

    original = data_adapter.DataHandler.enumerate_epochs
    model = tf_keras.Sequential([tf_keras.Input((4,)), tf_keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    data = tf.data.Dataset.from_tensors((tf.zeros((2, 4)), tf.zeros((2, 1)))).repeat()
    kept: list[Any] = []
    with keeping_input_iterators(kept):
        model.fit(data, epochs=2, steps_per_epoch=3, verbose=0)
    assert kept and all(isinstance(i, tf.data.Iterator) for i in kept)
    assert data_adapter.DataHandler.enumerate_epochs is original
    assert next(kept[-1])[0].shape == (2, 4)  # alive: it still gives batches


def test_a_metric_that_is_not_a_mean_of_examples_is_refused_naming_those_that_are() -> None:
    with pytest.raises(BuildError, match=r"'auc', which is not a mean of per-example values"
                                         r".*accuracy, acc, mse.*sparse_categorical_accuracy"):
        metric_function(None, "auc")


REPLICA_SUMS = textwrap.dedent("""\
    import json
    import numpy as np
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras

    from examples.keras3_digits import make_dataset
    from worker.runtimes.keras3 import DistributedStep, metric_function, per_example_loss

    METRICS = ["accuracy", "sparse_top_k_categorical_accuracy", "sparse_categorical_crossentropy"]

    def build():
        keras.utils.set_random_seed(3)
        inputs = keras.Input((64,))
        x = keras.layers.Dense(32, activation="relu",
                               kernel_regularizer=keras.regularizers.L2(0.01))(inputs)
        x = keras.layers.LayerNormalization()(x)
        return keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(x))

    features, labels = make_dataset(64)
    x, y = features[:64], labels[:64]

    plain = build()  # one process, no strategy: what the whole global batch gives
    with tf.GradientTape() as tape:
        pred = plain(x, training=True)
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, pred))
        loss += tf.add_n(plain.losses)
    grads = tape.gradient(loss, plain.trainable_variables)
    expected = {"loss": float(loss),
                "accuracy": float(np.mean(keras.metrics.sparse_categorical_accuracy(y, pred))),
                "sparse_top_k_categorical_accuracy": float(np.mean(
                    keras.metrics.sparse_top_k_categorical_accuracy(y, pred))),
                "sparse_categorical_crossentropy": float(np.mean(
                    keras.losses.sparse_categorical_crossentropy(y, pred)))}
    keras.optimizers.SGD(0.5).apply_gradients(zip(grads, plain.trainable_variables))

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = build()
        optimizer = keras.optimizers.SGD(0.5)
        optimizer.build(model.trainable_variables)
    step = DistributedStep(tf, strategy, model, optimizer,
                           per_example_loss(keras, "sparse_categorical_crossentropy"),
                           {m: metric_function(keras, m) for m in METRICS}, 64)
    batches = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(64))
    step.train(iter(batches))
    got = step.means()
    step.reset()
    print(json.dumps({
        "replicas": strategy.num_replicas_in_sync, "expected": expected, "got": got,
        "after_reset": step.means(),
        "weights_gap": max(float(np.max(np.abs(a - b)))
                           for a, b in zip(plain.get_weights(), model.get_weights())),
    }))
    """)


def test_the_loops_loss_metrics_and_update_over_replicas_equal_one_process_on_the_batch() -> None:
    proc = subprocess.run([sys.executable, "-c", REPLICA_SUMS], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "TF_USE_LEGACY_KERAS": "0"})
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["replicas"] == 2
    assert result["got"] == pytest.approx(result["expected"], rel=1e-5)
    assert result["after_reset"] == {}
    assert result["weights_gap"] < 1e-6  # gradients summed over replicas = the global mean's


SNAPSHOT_CASES = """
import json, os, sys
import tensorflow as tf
import tf_keras

from worker.runtimes.common import SnapshotRefused
from worker.runtimes.managed import Job
from worker.runtimes.tf_keras import prepare, saved_step

strategy = tf.distribute.MultiWorkerMirroredStrategy()  # one task: the legacy optimizer
with strategy.scope():
    model = tf_keras.Sequential([tf_keras.Input((4,)), tf_keras.layers.Dense(2)])
job = Job.from_json(sys.argv[1])
data = tf.data.Dataset.from_tensors((tf.ones((8, 4)), tf.zeros((8,), tf.int64))).repeat()
training = prepare(tf, strategy, job, model, data, 8, 0.01)
gradients = "Graph execution error:\\n\\nDetected at node Adam/CollectiveReduceV2 defined at"
metrics = "Graph execution error:\\n\\nDetected at node div_no_nan/CollectiveReduceV2 defined at"
def case(failure, ahead, launched=7):  # 7: the step's train function was called
    model.optimizer.iterations.assign(6 + ahead)
    training.callbacks[0].launched = launched
    try:
        step, _ = training.snapshot(RuntimeError(failure))
    except SnapshotRefused as exc:
        return "refused: " + str(exc)
    latest = tf.train.latest_checkpoint(os.path.join(os.environ["ORCHESTRATE_CHECKPOINT_DIR"],
                                                     "chief"))
    return [step, saved_step(tf, latest, 6), int(model.optimizer.iterations.numpy()),
            int(model._train_counter.numpy())]
class Cases(tf_keras.callbacks.Callback):  # after the runtime's: step 6 is the last completed
    def on_train_batch_end(self, batch, logs=None):
        if batch == 5:
            print(json.dumps({"gradients": case(gradients, 0),
                              "metrics, update whole": case(metrics, 1),
                              "metrics, update not whole": case(metrics, 0),
                              "no node": case("lost", 0),
                              "between steps": case("lost", 0, launched=6)}))
            self.model.stop_training = True
fit = model.fit
model.fit = lambda *args, callbacks, **kwargs: fit(*args, callbacks=[*callbacks, Cases()],
                                                   **kwargs)
training.fit()
"""


def test_a_snapshot_is_of_the_last_step_whose_update_is_whole(tmp_path: Path) -> None:
    """A tf_keras step has two collectives: the gradients' all-reduce, then (after the update)
    the metrics'. A peer lost in the second left the step's update applied; the soak once
    resumed such a snapshot one step early, and its weights were not bit-identical. The
    legacy optimizer's iterations, one ahead, say the update is whole."""
    script = tmp_path / "cases.py"
    script.write_text(SNAPSHOT_CASES)
    job = managed_job("unused", epochs=2, steps_per_epoch=6, checkpoint_every_steps=100,
                      optimizer="adam")
    env = {**os.environ, "TF_USE_LEGACY_KERAS": "1", "PYTHONPATH": str(REPO),
           "ORCHESTRATE_CHECKPOINT_DIR": str(tmp_path / "checkpoints")}
    env.pop("TF_CONFIG", None)
    proc = subprocess.run([sys.executable, str(script), json.dumps(job)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=WAIT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    # the gradients' all-reduce failed: nothing moved
    assert cases["gradients"] == [6, 6, 6, 6], cases
    # the metrics' failed after a whole update: the snapshot is of step 7, counters and all
    assert cases["metrics, update whole"] == [7, 7, 7, 7]
    assert cases["metrics, update not whole"] == (
        "refused: the step after 6 failed in div_no_nan/CollectiveReduceV2, not in the "
        "gradients' all-reduce: its update may be partly applied (RuntimeError: Detected at "
        "node div_no_nan/CollectiveReduceV2 defined at)")
    assert cases["no node"].startswith("refused: the step after 6 failed in an operation not")
    assert cases["no node"].endswith("(RuntimeError: lost)")
    # Failed before step 7's train function was called (fit's eager all-reduce at an epoch's
    # edge, waiting on the lost peer): the state is step 6's, whole.
    assert cases["between steps"] == [6, 6, 6, 6]
