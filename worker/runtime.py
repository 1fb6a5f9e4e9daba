"""The task runtime: MultiWorkerMirroredStrategy over gRPC RING, tf_keras fit, chief-only saves."""

from __future__ import annotations

import hashlib
import importlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

from worker.events import emit

Phase = str  # "connect", "build", "train", "save": where an error happened


def run_managed(job: dict[str, Any]) -> int:
    """Train the job's model on this task; return the process exit code."""
    phase: Phase = "connect"
    emit("started", pid=os.getpid(), mode="managed", python=sys.version.split()[0])
    try:
        import tensorflow as tf

        _seed(tf, job)
        strategy = create_strategy(tf, job.get("collective_timeout_s"))
        phase = "build"
        emit("connected", replicas=strategy.num_replicas_in_sync, tf_version=tf.__version__)
        model, dataset, global_batch = _build(tf, strategy, job)
        phase = "train"
        history = _fit(tf, model, dataset, job, global_batch)
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


def create_strategy(tf: Any, collective_timeout_s: float | None = None) -> Any:
    """MWMS with gRPC RING collectives; must run before any other TF op.

    With ``collective_timeout_s``, a collective that waits longer (a stuck peer) fails
    the task instead of hanging it forever.
    """
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING,
        timeout_seconds=collective_timeout_s,
    )
    return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)


def is_chief(strategy: Any) -> bool:
    resolver = strategy.cluster_resolver
    task_type, task_id = resolver.task_type, resolver.task_id
    has_chief = "chief" in resolver.cluster_spec().as_dict()
    return bool(task_type == "chief" or (not has_chief and task_type == "worker" and task_id == 0))


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
    from worker.checkpoints import saved_step

    latest = tf.train.latest_checkpoint(os.path.join(os.environ["ORCHESTRATE_CHECKPOINT_DIR"],
                                                     "chief"))
    return saved_step(tf, latest, steps_per_epoch) if latest else 0


def _fit(tf: Any, model: Any, dataset: Any, job: dict[str, Any], global_batch: int) -> Any:
    import tf_keras

    from worker.callbacks import make_callbacks
    from worker.checkpoints import keep_more_checkpoints

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


def save_model(strategy: Any, model: Any) -> str:
    """Every task must save (saving reads synced variables collectively); only the chief keeps it."""
    model_dir = os.environ["ORCHESTRATE_MODEL_DIR"]
    if is_chief(strategy):
        os.makedirs(model_dir, exist_ok=True)
        path = os.path.join(model_dir, "model.keras")
        model.save(path)
        return path
    scratch = tempfile.mkdtemp(prefix="orchestrate-model-")
    try:
        model.save(os.path.join(scratch, "model.keras"))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return ""


def weights_digest(model: Any) -> str:
    digest = hashlib.sha256()
    for weight in model.get_weights():
        digest.update(weight.tobytes())
    return digest.hexdigest()


def emit_error(exc: BaseException, phase: Phase) -> None:
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
    emit(
        "error",
        phase=phase,
        type=f"{type(exc).__module__}.{type(exc).__qualname__}",
        message=str(exc)[:2000],
        traceback="".join(tb)[-4000:],
    )
    traceback.print_exception(type(exc), exc, exc.__traceback__)


def run_command(argv: list[str]) -> int:
    """Run an unmodified script with TF_CONFIG set; report its start and end as events."""
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    started = time.monotonic()
    try:
        proc = subprocess.Popen(argv)
    except OSError as exc:
        emit_error(exc, "connect")
        return 127
    emit("started", pid=proc.pid, mode="command", argv=argv)
    signal.signal(signal.SIGTERM, lambda *_: proc.terminate())
    code = proc.wait()
    elapsed = round(time.monotonic() - started, 3)
    if code == 0:
        emit("finished", metrics={}, model_path="", seconds=elapsed)
    else:
        emit("error", phase="train", type="CommandFailed",
             message=f"{argv[0]} exited with {code}", exit_code=code)
    return code if code >= 0 else 128 - code
