"""What every runtime of the worker shares: its entry in the CLI, the task's GPUs (memory growth,
the collectives they use) and MultiWorkerMirroredStrategy over them, which task is the chief and
where it checkpoints, the save on SIGTERM, the final save and the error event."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import hashlib
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn

from worker.events import emit
from worker.storage import is_url

Phase = str  # "connect", "build", "train", "save": where an error happened

STOPPED_EXIT = 75
"""The exit code of a task that saved a checkpoint on SIGTERM (its own or a peer's) and stopped.
Every task of the group saved at the same step, so relaunching the group loses no step
(75 is EX_TEMPFAIL: try again)."""


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


class DeviceError(Exception):
    """The job's GPU settings do not fit this task (NCCL without a GPU); the message says the fix."""


@dataclass(frozen=True)
class Devices:
    """What this task trains on: the GPUs TensorFlow sees, and the collectives that every task
    of the group uses ("ring": gRPC on any device; "nccl": GPU to GPU)."""

    gpus: int
    collectives: str


def prepare_devices(tf: Any, collectives: str, memory_growth: bool) -> Devices:
    """Memory growth on every GPU TensorFlow sees (before anything initialises them), and the
    job's collectives for them: "auto" (the controller had no GPU count) is NCCL where this
    task sees a GPU, else RING.

    Raises:
        DeviceError: NCCL was asked for and this task sees no GPU. TensorFlow itself would
            only log a warning and all-reduce on the CPU; a task that was meant to train on
            GPUs and sees none has a broken CUDA set-up, which should not pass unnoticed.
    """
    gpus = tf.config.list_physical_devices("GPU")
    if memory_growth:
        for gpu in gpus:
            tf.config.experimental.set_memory_growth(gpu, True)
    if collectives == "auto":
        collectives = "nccl" if gpus else "ring"
    if collectives == "nccl" and not gpus:
        raise DeviceError(
            "job.collectives is nccl but TensorFlow sees no GPU in this task: NCCL all-reduces "
            "only between GPUs. Set job.collectives: auto (RING where a task has no GPU) or "
            "ring, or make the GPUs visible (TensorFlow with CUDA: pip install "
            "'tensorflow[and-cuda]'; CUDA_VISIBLE_DEVICES not empty)")
    return Devices(len(gpus), collectives)


COORDINATOR_WAIT_S = 60.0  # how long a task waits for the coordination service's port
COORDINATOR_POLL_S = 0.02


def await_port(address: str, *, limit_s: float = COORDINATOR_WAIT_S) -> None:
    """Until ``address`` (host:port, [v6]:port) takes a connection (at most ``limit_s``; then
    the framework's own wait goes on). A task that asks for the coordination service before
    its leader has started it is refused, and gRPC tries again only after its first backoff,
    1 s: tasks started at once (a launch, a relaunch) paid that second whenever another than
    the leader got there first."""
    import socket

    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                return
        except OSError:
            time.sleep(COORDINATOR_POLL_S)


def coordination_leader(config: str | None) -> tuple[str, bool] | None:
    """The task that runs TensorFlow's coordination service for ``config`` (a TF_CONFIG), as
    ``multi_worker_util.coordination_leader`` picks it (chief 0 where there is a chief, else
    worker 0): its address, and whether it is this task. None without a cluster."""
    import json

    try:
        parsed = json.loads(config or "{}")
        cluster, task = parsed.get("cluster") or {}, parsed.get("task") or {}
        job = "chief" if cluster.get("chief") else "worker"
        address = str(cluster[job][0])
        return address, (task.get("type"), int(task.get("index", 0))) == (job, 0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None


def create_strategy(tf: Any, devices: Devices, collective_timeout_s: float | None = None) -> Any:
    """MWMS with the collectives of ``devices``; must run before any other TF op (after
    ``prepare_devices``). A task other than the coordination service's leader first waits for
    the leader's port (``await_port``).

    With ``collective_timeout_s``, a collective that waits longer (a stuck peer) fails
    the task instead of hanging it forever.
    """
    leader = coordination_leader(os.environ.get("TF_CONFIG"))
    if leader is not None and not leader[1]:
        await_port(leader[0])
    implementation = tf.distribute.experimental.CommunicationImplementation
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=implementation.NCCL if devices.collectives == "nccl" else implementation.RING,
        timeout_seconds=collective_timeout_s,
    )
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    # Connecting installed TF's C++ SIGTERM notifier, which swallows the signal. Until the
    # runtime's Preemption takes SIGTERM over, a SIGTERM ends the task, as it did before.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return strategy


def connected_fields(strategy: Any, devices: Devices) -> dict[str, Any]:
    """What the ``connected`` event says of the group: the replicas in sync (every task's),
    this task's own replicas (one per GPU it uses, else one), its GPUs and the collectives."""
    return {"replicas": int(strategy.num_replicas_in_sync),
            "local_replicas": len(strategy.extended.worker_devices),
            "gpus": devices.gpus, "collectives": devices.collectives}


def is_chief(strategy: Any) -> bool:
    resolver = strategy.cluster_resolver
    task_type, task_id = resolver.task_type, resolver.task_id
    has_chief = "chief" in resolver.cluster_spec().as_dict()
    return bool(task_type == "chief" or (not has_chief and task_type == "worker" and task_id == 0))


def checkpoint_dirs(strategy: Any, base: str) -> tuple[str, str]:
    """(where every task restores from, where this task writes), in tf_keras BackupAndRestore's
    layout: the chief writes ``base/chief``, another task ``base/workertemp_<task id>``, which
    it removes after each save. Every task must save (saving reads synced variables
    collectively); only the chief's copy is kept."""
    chief = os.path.join(base, "chief")
    if is_chief(strategy):
        return chief, chief
    return chief, os.path.join(base, f"workertemp_{strategy.cluster_resolver.task_id}")


def remove_dir(tf: Any, path: str) -> None:
    """Remove a directory (a path or a gs:// URL) if it exists."""
    if tf.io.gfile.exists(path):
        tf.io.gfile.rmtree(path)


class Preemption:
    """tf.distribute's PreemptionCheckpointHandler, made to stop the group on SIGTERM anywhere.

    When any task gets SIGTERM, its handler agrees a step with every peer through TF's
    coordination service; each task trains up to that step, saves (``save``, which returns
    the step and epoch saved), reports it and exits with STOPPED_EXIT. The chief emits
    ``checkpoint`` (``reason: "stop"``); every task emits ``stopped`` {step, signal:
    "SIGTERM" where it was received, else "peer"}.

    The handler's constructor asks the GCE metadata server which platform it runs on (up to
    5 s; on a GCE CPU VM the handler then does nothing, on a GCE GPU VM it polls for
    maintenance events instead of SIGTERM). Detection is pinned to this machine's devices
    while it is built, so SIGTERM is the trigger everywhere. Grace period 0: stop at the next
    step. The handler's own restore reads an empty checkpoint (the runtime restores its
    state itself, from the chief's directory on every task), and its step counter is set to
    the real step at every call.
    """

    def __init__(self, tf: Any, strategy: Any, chief_dir: str,
                 save: Callable[[], tuple[int, int]]) -> None:
        self._save, self._saved = save, (0, 0)
        self._chief, self._chief_dir = is_chief(strategy), chief_dir
        self.signalled = False
        config = tf.distribute.experimental.TerminationConfig(
            exit_fn=self._exit, grace_period=0, save_fn=self._save_at_stop)
        nothing = tf.train.CheckpointManager(tf.train.Checkpoint(), chief_dir, max_to_keep=1)
        with _platform_of_this_machine(tf):
            self._handler = tf.distribute.experimental.PreemptionCheckpointHandler(
                strategy.cluster_resolver, nothing, termination_config=config)
        self._tell_peers = signal.getsignal(signal.SIGTERM)  # the handler's own
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def run(self, step: int, train_step: Callable[..., Any], *args: Any) -> Any:
        """``train_step(*args)`` (one step), first saving and exiting if the group agreed to
        stop at ``step`` (the steps done so far)."""
        self._handler._run_counter = step
        return self._handler.run(train_step, *args)

    def check(self, step: int) -> None:
        """Save and exit if the group agreed to stop at ``step``, the step just done."""
        self._handler._run_counter = step
        self._handler.save_checkpoint_if_preempted()

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.signalled = True
        if callable(self._tell_peers):
            self._tell_peers(signum, frame)

    def _save_at_stop(self) -> None:
        self._saved = self._save()

    def _exit(self) -> None:
        step, epoch = self._saved
        if self._chief:
            emit("checkpoint", step=step, epoch=epoch, path=self._chief_dir, reason="stop")
        exit_stopped(step, self.signalled)


class SnapshotRefused(Exception):
    """No consistent state to save after a peer's loss; the message says why."""


def peer_lost(tf: Any, exc: BaseException) -> bool:
    """Whether a step failed because a peer (or its host) went away: TensorFlow's errors for a
    collective whose peer is gone (UnavailableError within moments of a death), or aborted."""
    errors = tf.errors
    return isinstance(exc, (errors.UnavailableError, errors.CancelledError, errors.AbortedError,
                            errors.DeadlineExceededError))


def refuse_early_updates(optimizer: Any) -> None:
    """Raise SnapshotRefused where ``optimizer`` changes the weights before a step's gradients
    arrive (weight decay, an EMA of the weights): then a step that failed on a lost peer may
    have moved them, and no snapshot is exact."""
    if getattr(optimizer, "weight_decay", None) or getattr(optimizer, "use_ema", False):
        raise SnapshotRefused(
            f"{type(optimizer).__name__} changes the weights before the gradients arrive "
            "(weight decay or EMA): a failed step may have moved them")


# How long a task other than the chief waits, after a lost peer broke its step, for the
# controller to ask it for the snapshot (it does when the chief itself died). It is killed
# sooner when the chief saves instead; without a controller, it exits after this.
SNAPSHOT_ASK_WAIT_S = 10.0


def snapshot_request(wait_s: float | None, every_s: float = 0.02) -> str | None:
    """The key of the task the controller asks to save the group's state: what the file
    ``ORCHESTRATE_SNAPSHOT_REQUEST`` names holds (``Supervisor._ask_for_snapshot`` writes it
    atomically, on the saving task's host). Looked for every ``every_s``, for up to
    ``wait_s`` (None: until it appears); None when there is none (or no such file is set)."""
    path = os.environ.get("ORCHESTRATE_SNAPSHOT_REQUEST")
    if not path:
        return None
    deadline = None if wait_s is None else time.monotonic() + wait_s
    while True:
        try:
            with open(path, encoding="utf-8") as f:
                return f.read().strip()
        except FileNotFoundError:
            pass
        if deadline is not None and time.monotonic() >= deadline:
            return None
        time.sleep(every_s)


def asked_for_snapshot(wait_s: float = SNAPSHOT_ASK_WAIT_S) -> bool:
    """Whether the controller asks this task to save the group's state in the chief's place
    (its key in the request, ``snapshot_request``; another key there: another task saves).
    Waits up to ``wait_s`` for the request."""
    named = snapshot_request(wait_s)
    return named is not None and named == os.environ.get("ORCHESTRATE_TASK")


def when_asked(action: Callable[[], None]) -> None:
    """Watch, on a thread of its own, for the controller's snapshot request naming this task
    (``snapshot_request``), and then call ``action`` there. Nothing is watched where no request
    can come (no request file or task key set)."""
    task = os.environ.get("ORCHESTRATE_TASK")
    if not os.environ.get("ORCHESTRATE_SNAPSHOT_REQUEST") or not task:
        return

    def watch() -> None:
        if snapshot_request(None, every_s=0.05) == task:
            action()

    threading.Thread(target=watch, name="snapshot-request", daemon=True).start()


def abort_when_asked(tf: Any) -> None:
    """Once the controller asks this task for the snapshot (``when_asked``), abort this
    process's collective ops: a step that waits on a peer that will never answer (a machine cut
    off, a peer that died before it joined the step's collective) then fails at once as on a
    lost peer, and the task saves the step it completed, where it would otherwise wait for
    TensorFlow's own timeouts."""

    def abort() -> None:
        from tensorflow.python.eager import context

        context.context().abort_collective_ops(
            tf.errors.UNAVAILABLE, "a peer was lost: the controller asked this task "
            "to save the group's state")

    when_asked(abort)


def save_snapshot(snapshot: Callable[[], tuple[int, int]], path: str) -> None:
    """After a peer's loss broke the step under way, save this task's state at the last step it
    completed ("just-in-time" checkpointing): a data-parallel group's every task holds the same
    variables, and a step's all-reduce completes on a task only with every peer's gradients, so
    the state is that of an unbroken run at that step. ``snapshot()`` writes it as an ordinary
    checkpoint in ``path``, the chief's directory (on this task's host: a worker saves in the
    chief's place when the chief died), and returns (step, epoch). Reports ``checkpoint`` {reason:
    "snapshot"}, or ``snapshot_failed`` {reason}; the caller then fails as before. First
    ``snapshot_started``: the controller waits for a chief that says so (see
    ``Supervisor._await_snapshot``)."""
    emit("snapshot_started")
    try:
        step, epoch = snapshot()
    except SnapshotRefused as exc:
        emit("snapshot_failed", reason=str(exc))
        return
    except Exception as exc:  # the save itself: the last periodic checkpoint stays the latest
        emit("snapshot_failed", reason=f"the save failed: {type(exc).__name__}: {exc}"[:1000])
        return
    emit("checkpoint", step=step, epoch=epoch, path=path, reason="snapshot")


def exit_stopped(step: int, signalled: bool) -> NoReturn:
    """Say that this task saved ``step`` and stops (``signal``: "SIGTERM" where it was
    received, else "peer"), then exit with STOPPED_EXIT at once, not through the interpreter's
    shutdown: destroying a distributed input iterator whose prefetch is inside a py_function
    waits for the GIL forever."""
    emit("stopped", step=step, signal="SIGTERM" if signalled else "peer")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(STOPPED_EXIT)


def exit_now(code: int) -> NoReturn:
    """End a task that has said how it ended (``finished``: its model saved, every checkpoint
    written; or its ``error``): the ``atexit`` handlers run (the user's: a tracker's last
    upload; TensorFlow's: an async checkpoint joined), then the process ends with ``code``
    without the interpreter's teardown, which would destroy the input iterators the runtime
    keeps (``tf_keras.keeping_input_iterators``: that can block for seconds) and collect
    TensorFlow's objects for nothing."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def emit_progress(step: int, total_steps: int, means: dict[str, float], global_batch: int,
                  since: tuple[float, int]) -> tuple[float, int]:
    """A ``progress`` event at ``step``: the loss and metrics (``means``), and the rate since
    ``since`` (monotonic time, step); the new ``since``."""
    now, (last, last_step) = time.monotonic(), since
    steps = step - last_step
    rate = steps / (now - last) if now > last and steps > 0 else 0.0
    metrics = dict(means)
    emit("progress", step=step, total_steps=total_steps,
         loss=metrics.pop("loss", float("nan")), metrics=metrics,
         steps_per_s=round(rate, 3), examples_per_s=round(rate * global_batch, 1))
    return now, step


@contextlib.contextmanager
def _platform_of_this_machine(tf: Any) -> Iterator[None]:
    from tensorflow.python.distribute.failure_handling import failure_handling_util as util

    platform = (util.PlatformDevice.INTERNAL_GPU if tf.config.list_logical_devices("GPU")
                else util.PlatformDevice.INTERNAL_CPU)
    detect = util.detect_platform
    util.detect_platform = lambda: platform
    try:
        yield
    finally:
        util.detect_platform = detect


def save_model(chief: bool, save: Callable[[str], None]) -> str:
    """``save(path)`` the final model on every task (saving is a collective on TensorFlow and
    on JAX alike); only the chief's, in ORCHESTRATE_MODEL_DIR, is kept: its path, else ""."""
    model_dir = os.environ["ORCHESTRATE_MODEL_DIR"]
    if chief:
        if is_url(model_dir):  # a bucket (a pod without a volume): Keras writes it through gfile
            import tensorflow as tf

            tf.io.gfile.makedirs(model_dir)
        else:
            os.makedirs(model_dir, exist_ok=True)
        path = f"{model_dir.rstrip('/')}/model.keras"
        save(path)
        return path
    scratch = tempfile.mkdtemp(prefix="orchestrate-model-")
    try:
        save(os.path.join(scratch, "model.keras"))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return ""


def weights_digest(weights: Iterable[Any]) -> str:
    """The SHA-256 of the weights' bytes (NumPy arrays), in order."""
    digest = hashlib.sha256()
    for weight in weights:
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
