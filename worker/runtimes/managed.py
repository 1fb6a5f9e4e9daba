"""The managed runtime (``python -m worker managed --job JSON``): MultiWorkerMirroredStrategy
first, then the user's module, its model built under the strategy's scope and trained by the
Keras it is: a tf_keras model with ``fit`` (``tf_keras.py``), a Keras 3 model in a distributed
custom loop (``keras3.py``, since Keras 3's ``fit`` fails under MWMS). Then the chief-only save.
With ``backend: jax``, Keras 3 on JAX instead, without TensorFlow (``keras_jax.py``).

Both report the same events (listed in ``worker.events``). An error in phase ``build`` is the
user's code, and its message says the fix. On SIGTERM to any task, every task saves at one
step, emits ``stopped`` and exits with STOPPED_EXIT (see ``common.Preemption``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from worker.events import emit
from worker.runtimes.common import (
    DeviceError,
    Phase,
    WorkerRuntime,
    abort_when_asked,
    asked_for_snapshot,
    connected_fields,
    create_strategy,
    emit_error,
    exit_now,
    is_chief,
    peer_lost,
    prepare_devices,
    save_model,
    save_snapshot,
    weights_digest,
)
from worker.storage import check_checkpoint_storage
from worker.tfimport import tensorflow

STORAGE_ERROR = 2


class BuildError(Exception):
    """The user's module gave the runtime something it cannot train; the message says the fix."""


@dataclass(frozen=True)
class Job:
    """The job as the controller sends it: the spec's ManagedJob (``mode`` aside, ``collectives``
    resolved where the controller knew every task's GPUs), plus the checkpoint interval and the
    collective timeout."""

    module: str
    model_fn: str
    dataset_fn: str
    keras: str  # "auto", "3" or "2"
    epochs: int
    steps_per_epoch: int
    per_replica_batch_size: int
    optimizer: str
    learning_rate: float
    scale_learning_rate: bool
    loss: str
    metrics: tuple[str, ...]
    seed: int | None
    deterministic: bool
    progress_every_steps: int
    checkpoint_every_steps: int
    collective_timeout_s: float | None
    collectives: str = "ring"  # "ring", "nccl", or "auto" (the controller had no GPU count)
    gpu_memory_growth: bool = True
    backend: str = "tensorflow"  # or "jax": Keras 3 on JAX (``keras_jax.py``), no TensorFlow
    distribution: str = "data_parallel"  # or "model_parallel" (JAX only)
    mesh: tuple[int, int] | None = None  # model_parallel's [batch, model]
    layout_map_fn: str = "layout_map"  # model_parallel: the module's LayoutMap of a DeviceMesh
    # The chief saves its state at the last completed step when a peer's loss breaks a step
    # (on JAX, with data parallelism: keras_jax.JaxTraining.snapshot).
    snapshot_on_crash: bool = False
    snapshot_s: float = 0.0  # timeouts.snapshot_s: on JAX, how long the service spares a survivor

    @classmethod
    def from_json(cls, text: str) -> Job:
        payload = json.loads(text)
        unknown = set(payload) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown job field(s): {', '.join(sorted(unknown))}")
        mesh = payload.get("mesh")
        return cls(**{**payload, "keras": str(payload["keras"]),
                      "metrics": tuple(payload["metrics"]),
                      "mesh": None if mesh is None else tuple(mesh)})

    @property
    def total_steps(self) -> int:
        return self.epochs * self.steps_per_epoch

    def scaled(self, replicas: int) -> tuple[int, float]:
        """The global batch and the learning rate for ``replicas`` in sync."""
        return (self.per_replica_batch_size * replicas,
                self.learning_rate * (replicas if self.scale_learning_rate else 1))


class Training(Protocol):
    """A model compiled and ready to train on this task (after the ``built`` event)."""

    checkpoint_path: str  # the chief's checkpoint directory

    def fit(self) -> tuple[dict[str, float], int]:
        """Train to the last step; the last epoch's metrics and the step reached."""
        ...

    def snapshot(self, failure: BaseException) -> tuple[int, int]:
        """After ``fit`` failed on a peer's loss (``failure``): save a checkpoint at the last
        step this task completed (as a periodic one), without a collective; (step, epoch).
        Raises SnapshotRefused where the state is not at a completed step."""
        ...


def run_managed(job: Job) -> int:
    """Train the job's model on this task; return the process exit code."""
    phase: Phase = "connect"
    emit("started", pid=os.getpid(), mode="managed", python=sys.version.split()[0])
    if not check_checkpoint_storage(os.environ["ORCHESTRATE_CHECKPOINT_DIR"]):
        return STORAGE_ERROR
    if job.backend == "jax":
        from worker.runtimes import keras_jax

        return keras_jax.run(job)
    try:
        tf = tensorflow()
        devices = prepare_devices(tf, job.collectives, job.gpu_memory_growth)
        strategy = create_strategy(tf, devices, job.collective_timeout_s)
        if job.snapshot_on_crash:
            abort_when_asked(tf)
        phase = "build"
        emit("connected", **connected_fields(strategy, devices), tf_version=tf.__version__)
        model, training = _build(tf, strategy, job)
        phase = "train"
        try:
            metrics, step = training.fit()
        except Exception as exc:
            # The chief saves the group's state; another task only when the controller asks
            # it to (the chief is the peer that died).
            if job.snapshot_on_crash and peer_lost(tf, exc) and (
                    is_chief(strategy) or asked_for_snapshot()):
                save_snapshot(functools.partial(training.snapshot, exc), training.checkpoint_path)
            raise
        phase = "save"
        model_path = save_model(is_chief(strategy), model.save)
        emit("finished", metrics=metrics, model_path=model_path,
             weights_sha256=weights_digest(model.get_weights()), step=step)
        exit_now(0)
    except DeviceError as exc:  # the job's GPU settings: the spec's to fix, as a build error
        emit_error(exc, "build")
        return 1
    except Exception as exc:  # reported to the controller, then the task fails
        emit_error(exc, phase)
        exit_now(1)


def _build(tf: Any, strategy: Any, job: Job) -> tuple[Any, Training]:
    module = importlib.import_module(job.module)
    model_fn: Callable[[], Any] = getattr(module, job.model_fn)
    dataset_fn: Callable[..., Any] = getattr(module, job.dataset_fn)
    _seed(tf, job)
    with strategy.scope():
        model = model_fn()
    keras = keras_of(model, job.keras)
    replicas = strategy.num_replicas_in_sync
    global_batch, lr = job.scaled(replicas)
    dataset = input_dataset(tf, dataset_fn(global_batch_size=global_batch, seed=job.seed),
                            global_batch, job)
    if keras == "3":
        from worker.runtimes import keras3

        training: Training = keras3.prepare(tf, strategy, job, model, dataset, global_batch, lr)
    else:
        from worker.runtimes import tf_keras

        training = tf_keras.prepare(tf, strategy, job, model, dataset, global_batch, lr)
    emit("built", global_batch_size=global_batch, learning_rate=lr, replicas=replicas,
         parameters=int(model.count_params()))
    return model, training


def _seed(tf: Any, job: Job) -> None:
    """Seeds before build_model(): Python, NumPy and TensorFlow through tf.keras, and Keras 3's
    own seed generator when the module uses Keras 3."""
    if job.seed is not None:
        tf.keras.utils.set_random_seed(job.seed)
        if "keras" in sys.modules:
            sys.modules["keras"].utils.set_random_seed(job.seed)
    if job.deterministic:
        tf.config.experimental.enable_op_determinism()


def keras_of(model: Any, wanted: str) -> str:
    """"2" for a tf_keras model, "3" for a Keras 3 one; a BuildError for anything else, for a
    model of the other Keras than ``wanted`` (job.keras), and for a compiled model."""
    kind = _keras_kind(model)
    received = f"{type(model).__module__}.{type(model).__qualname__}"
    if kind is None:
        raise BuildError(
            f"build_model() returned {received}, not a Keras model: return a keras.Model "
            "(Keras 3) or a tf_keras.Model (Keras 2), uncompiled")
    if wanted != "auto" and wanted != kind:
        raise BuildError(
            "job.keras is 2 (tf_keras) but build_model() returned a Keras 3 model "
            f"({received}): the module imports keras; set job.keras: 3 or auto"
            if kind == "3" else
            "job.keras is 3 but build_model() returned a tf_keras model "
            f"({received}): the module imports tf_keras (or tf.keras, which is tf_keras unless "
            "job.keras is 3); set job.keras: 2 or auto, or build the model with keras")
    if getattr(model, "compiled" if kind == "3" else "_is_compiled", False):
        raise BuildError(
            f"build_model() returned a compiled model ({received}): the runtime compiles it "
            "with job.optimizer, job.loss and job.metrics; return it uncompiled (remove the "
            "model.compile call)")
    return kind


def _keras_kind(model: Any) -> str | None:
    tf_keras, keras = sys.modules.get("tf_keras"), sys.modules.get("keras")
    if tf_keras is not None and isinstance(model, tf_keras.Model):
        return "2"
    if keras is not None and isinstance(model, keras.Model):
        return "3"
    return None


def input_dataset(tf: Any, made: Any, global_batch: int, job: Job) -> Any:
    """What ``make_dataset`` returned, as a dataset of global batches: a tf.data.Dataset as it
    is; a tuple (features, labels) of arrays shuffled (reshuffled every pass), repeated and
    batched here, so that a Keras 3 module needs only keras and NumPy."""
    if isinstance(made, tf.data.Dataset):
        return made
    if isinstance(made, tuple) and len(made) == 2:
        dataset = tf.data.Dataset.from_tensor_slices(made)
        dataset = dataset.shuffle(int(dataset.cardinality()), seed=job.seed,
                                  reshuffle_each_iteration=True)
        return dataset.repeat().batch(global_batch, drop_remainder=True)
    raise BuildError(
        f"{job.dataset_fn}() returned {type(made).__module__}.{type(made).__qualname__}: return "
        "a tf.data.Dataset of (features, labels) batches of global_batch_size, repeated, or a "
        "tuple (features, labels) of NumPy arrays")


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--job", required=True, help="the job as JSON (from the cluster plan)")


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    # Before TensorFlow is imported: unless the controller says Keras 3, tf.keras is tf_keras
    # (Keras 2), the Keras whose fit() works under MultiWorkerMirroredStrategy.
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    try:
        job = Job.from_json(args.job)
    except (ValueError, TypeError, KeyError) as exc:
        parser.error(f"--job: {exc}")
    return run_managed(job)


RUNTIME = WorkerRuntime("managed", "build, compile and train a model from a user module",
                        _add_arguments, _run)
