"""The tf_keras fit runtime (``managed`` jobs): MultiWorkerMirroredStrategy first, the user's
model built and compiled under its scope, ``fit`` with a BackupAndRestore that keeps 3
checkpoints and reports its saves, progress events, and the chief-only save."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from worker.events import emit
from worker.runtimes.common import (
    Phase,
    WorkerRuntime,
    create_strategy,
    emit_error,
    save_model,
    weights_digest,
)
from worker.storage import check_checkpoint_storage

# tf_keras' WorkerTrainingState keeps one checkpoint; keep a few so that a corrupt newest
# one can fall back to the one before.
KEEP = 3
STORAGE_ERROR = 2
EPOCH_KEY = "ckpt_saved_epoch/.ATTRIBUTES/VARIABLE_VALUE"
BATCH_KEY = "ckpt_saved_batch/.ATTRIBUTES/VARIABLE_VALUE"


def run_managed(job: dict[str, Any]) -> int:
    """Train the job's model on this task; return the process exit code."""
    phase: Phase = "connect"
    emit("started", pid=os.getpid(), mode="managed", python=sys.version.split()[0])
    if not check_checkpoint_storage(os.environ["ORCHESTRATE_CHECKPOINT_DIR"]):
        return STORAGE_ERROR
    try:
        import tensorflow as tf

        _seed(tf, job)
        strategy = create_strategy(tf, job.get("collective_timeout_s"))
        phase = "build"
        emit("connected", replicas=strategy.num_replicas_in_sync, tf_version=tf.__version__)
        model, dataset, global_batch = _build(tf, strategy, job)
        phase = "train"
        history = _fit(model, dataset, job, global_batch)
        phase = "save"
        model_path = save_model(strategy, model)
        emit(
            "finished",
            metrics={k: float(v[-1]) for k, v in history.history.items()},
            model_path=model_path,
            weights_sha256=weights_digest(model),
            step=int(model.optimizer.iterations.numpy()),
        )
        return 0
    except Exception as exc:  # reported to the controller, then the task fails
        emit_error(exc, phase)
        return 1


def _seed(tf: Any, job: dict[str, Any]) -> None:
    if job.get("seed") is not None:
        tf.keras.utils.set_random_seed(int(job["seed"]))
    if job.get("deterministic"):
        tf.config.experimental.enable_op_determinism()


def _build(tf: Any, strategy: Any, job: dict[str, Any]) -> tuple[Any, Any, int]:
    import tf_keras

    module = importlib.import_module(job["module"])
    model_fn: Callable[[], Any] = getattr(module, job["model_fn"])
    dataset_fn: Callable[..., Any] = getattr(module, job["dataset_fn"])
    replicas = strategy.num_replicas_in_sync
    global_batch = int(job["per_replica_batch_size"]) * replicas
    lr = float(job["learning_rate"]) * (replicas if job.get("scale_learning_rate") else 1)
    with strategy.scope():
        model = model_fn()
        optimizer = tf_keras.optimizers.get(
            {"class_name": job["optimizer"], "config": {"learning_rate": lr}}
        )
        model.compile(optimizer=optimizer, loss=job["loss"], metrics=list(job["metrics"]))
    # Each replica's metric result is already the global value; tf_keras' "auto" reduction
    # would sum it over replicas, so per-batch logs would read replicas x the true loss.
    model.distribute_reduction_method = "first"
    dataset = dataset_fn(global_batch_size=global_batch, seed=job.get("seed"))
    done = steps_already_trained(tf, int(job["steps_per_epoch"]))
    if done and job.get("deterministic"):
        # fit() restores its step counters but starts the input afresh: skip the batches the
        # restored weights have already seen, so the data lines up with an unbroken run.
        dataset = dataset.skip(done)
    emit("built", global_batch_size=global_batch, learning_rate=lr, replicas=replicas,
         parameters=int(model.count_params()))
    return model, dataset, global_batch


def steps_already_trained(tf: Any, steps_per_epoch: int) -> int:
    """The step the chief's latest checkpoint resumes at (0 without one)."""
    latest = tf.train.latest_checkpoint(os.path.join(os.environ["ORCHESTRATE_CHECKPOINT_DIR"],
                                                     "chief"))
    return saved_step(tf, latest, steps_per_epoch) if latest else 0


def saved_step(tf: Any, path: str, steps_per_epoch: int) -> int:
    """The global step a BackupAndRestore checkpoint resumes at."""
    reader = tf.train.load_checkpoint(path)
    epoch = int(reader.get_tensor(EPOCH_KEY))
    batch = int(reader.get_tensor(BATCH_KEY))
    if epoch < 0:
        return 0
    return epoch * steps_per_epoch + (batch + 1 if batch >= 0 else steps_per_epoch)


def keep_more_checkpoints() -> None:
    from tf_keras.src.distribute import worker_training_state

    worker_training_state.MAX_CHECKPOINT_TO_KEEP = KEEP


def _fit(model: Any, dataset: Any, job: dict[str, Any], global_batch: int) -> Any:
    import tf_keras

    keep_more_checkpoints()
    callbacks = make_callbacks(
        tf_keras,
        checkpoint_dir=os.environ["ORCHESTRATE_CHECKPOINT_DIR"],
        every_steps=int(job["checkpoint_every_steps"]),
        progress_every=int(job["progress_every_steps"]),
        global_batch=global_batch,
        total_steps=int(job["epochs"]) * int(job["steps_per_epoch"]),
    )
    return model.fit(
        dataset,
        epochs=int(job["epochs"]),
        steps_per_epoch=int(job["steps_per_epoch"]),
        callbacks=callbacks,
        verbose=0,
    )


def make_callbacks(
    keras: Any,
    *,
    checkpoint_dir: str,
    every_steps: int,
    progress_every: int,
    global_batch: int,
    total_steps: int,
) -> list[Any]:
    """BackupAndRestore that reports its saves, then a progress reporter.

    tf_keras' BackupAndRestore is multi-worker aware: the chief writes
    ``checkpoint_dir/chief``, the others write temp dirs it removes, and every
    task restores from ``checkpoint_dir/chief``.
    """

    class ReportingBackup(keras.callbacks.BackupAndRestore):  # type: ignore[misc]
        def on_train_begin(self, logs: Any = None) -> None:
            super().on_train_begin(logs)
            step = int(self.model.optimizer.iterations.numpy())
            emit("resumed" if step else "training", step=step, total_steps=total_steps)

        def _backup(self, epoch: int, batch: int = 0) -> None:
            super()._backup(epoch=epoch, batch=batch)
            if self.model.distribute_strategy.extended.should_checkpoint:
                emit(
                    "checkpoint",
                    step=int(self.model.optimizer.iterations.numpy()),
                    epoch=epoch,
                    path=os.path.join(self.backup_dir, "chief"),
                )

    class Progress(keras.callbacks.Callback):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self._last = time.monotonic()
            self._last_step = 0

        def on_train_begin(self, logs: Any = None) -> None:
            self._last = time.monotonic()
            self._last_step = int(self.model.optimizer.iterations.numpy())

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            step = int(self.model.optimizer.iterations.numpy())
            if step % progress_every and step != total_steps:
                return
            now = time.monotonic()
            steps = step - self._last_step
            rate = steps / (now - self._last) if now > self._last and steps > 0 else 0.0
            self._last, self._last_step = now, step
            emit(
                "progress",
                step=step,
                total_steps=total_steps,
                loss=float((logs or {}).get("loss", float("nan"))),
                metrics={k: float(v) for k, v in (logs or {}).items() if k != "loss"},
                steps_per_s=round(rate, 3),
                examples_per_s=round(rate * global_batch, 1),
            )

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            emit("epoch", epoch=epoch, logs={k: float(v) for k, v in (logs or {}).items()})

    return [ReportingBackup(checkpoint_dir, save_freq=every_steps), Progress()]


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--job", required=True, help="the job as JSON (from the cluster plan)")


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    # Before TensorFlow is imported: tf.keras is then tf_keras (Keras 2), the Keras whose
    # fit() works under MultiWorkerMirroredStrategy.
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    return run_managed(json.loads(args.job))


RUNTIME = WorkerRuntime("managed", "build, compile and fit a model from a user module",
                        _add_arguments, _run)
