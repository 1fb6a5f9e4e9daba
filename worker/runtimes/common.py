"""What every runtime of the worker shares: its entry in the CLI, MultiWorkerMirroredStrategy over
gRPC RING, which task is the chief, the final save and the error event."""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from worker.events import emit

Phase = str  # "connect", "build", "train", "save": where an error happened


@dataclass(frozen=True)
class WorkerRuntime:
    """One kind of job on the worker: ``python -m worker MODE ...`` runs ``run``.

    ``run`` gets the parsed arguments and the top parser (for usage errors). It decides the
    environment its TensorFlow needs (``TF_USE_LEGACY_KERAS``) before TensorFlow is imported.
    """

    mode: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, argparse.ArgumentParser], int]


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
