"""The tf_keras side of managed jobs: the model compiled under the strategy's scope, ``fit`` with a
BackupAndRestore that keeps 3 checkpoints, reports its saves and saves on SIGTERM, progress
events, and an exact resume in deterministic mode."""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterator
from typing import Any

from worker.events import emit
from worker.runtimes.common import Preemption, SnapshotRefused, is_chief, refuse_early_updates
from worker.runtimes.managed import Job
from worker.tensorboard import Board, Profile, learning_rate

# tf_keras' WorkerTrainingState keeps one checkpoint; keep a few so that a corrupt newest
# one can fall back to the one before.
KEEP = 3
EPOCH_KEY = "ckpt_saved_epoch/.ATTRIBUTES/VARIABLE_VALUE"
BATCH_KEY = "ckpt_saved_batch/.ATTRIBUTES/VARIABLE_VALUE"


class FitTraining:
    """A compiled tf_keras model and its dataset, trained by ``fit``."""

    def __init__(self, model: Any, dataset: Any, job: Job, global_batch: int) -> None:
        self.model, self.dataset, self.job, self.global_batch = model, dataset, job, global_batch
        self.checkpoint_path = os.path.join(os.environ["ORCHESTRATE_CHECKPOINT_DIR"], "chief")
        self.callbacks: list[Any] = []  # fit's, once it has begun
        self.iterators: list[Any] = []  # fit's input iterators, kept until the process ends

    def fit(self) -> tuple[dict[str, float], int]:
        import tf_keras

        keep_more_checkpoints()
        self.callbacks = callbacks = make_callbacks(
            tf_keras,
            checkpoint_dir=os.environ["ORCHESTRATE_CHECKPOINT_DIR"],
            every_steps=self.job.checkpoint_every_steps,
            progress_every=self.job.progress_every_steps,
            global_batch=self.global_batch,
            steps_per_epoch=self.job.steps_per_epoch,
            total_steps=self.job.total_steps,
        )
        with keeping_input_iterators(self.iterators):
            history = self.model.fit(self.dataset, epochs=self.job.epochs,
                                     steps_per_epoch=self.job.steps_per_epoch,
                                     callbacks=callbacks, verbose=0)
        metrics = {k: float(v[-1]) for k, v in history.history.items()}
        return metrics, int(self.model.optimizer.iterations.numpy())

    def snapshot(self, failure: BaseException) -> tuple[int, int]:
        """The state after the last step whose update is whole, in BackupAndRestore's
        checkpoint; ``failure`` is the error that broke the step under way.

        A step has two collectives: the gradients' all-reduce (one pack), which every weight
        and optimizer slot update waits for, and, after the update, the metrics' (tf_keras
        reads their SyncOnRead totals across the group for the step's logs). A peer lost in
        the first leaves the state at the last completed step; lost in the second, the step's
        update has run (and fit's callbacks never heard of the step). The legacy optimizer
        (tf_keras' under a strategy) increments ``iterations`` only once every update is
        applied: one ahead of the last completed step means the failed step is whole, and the
        snapshot is of it. Otherwise the failed collective must be the gradients', else the
        update may be half applied and no snapshot is exact. A failure before the next step's
        train function was called (fit reduces across the group eagerly at an epoch's edge, and
        waits there on a lost peer too) leaves the state whole. The counters that do not wait for
        the update (fit's train counter; a newer optimizer's iterations) are set as the step
        saved left them.
        """
        backup = self.callbacks[0] if self.callbacks else None
        state = getattr(self.model, "_training_state", None)
        if backup is None or state is None or backup.completed is None:
            raise SnapshotRefused("no step had completed")
        step, iterations, counter = backup.completed
        optimizer = self.model.optimizer
        refuse_early_updates(optimizer)
        import tensorflow as tf
        from tf_keras.src.optimizers.legacy.optimizer_v2 import OptimizerV2

        on_read = [v.name for v in self.model.variables
                   if getattr(v, "synchronization", None) == tf.VariableSynchronization.ON_READ]
        if on_read:
            raise SnapshotRefused(
                f"the model has variables synchronized on read ({on_read[0]}; tf_keras' "
                "BatchNormalization statistics are): each task holds its own, and saving them "
                "averages them across every task, which the lost one cannot join")
        ahead = int(optimizer.iterations.numpy()) - iterations
        if isinstance(optimizer, OptimizerV2) and ahead == 1:
            step, iterations, counter = step + 1, iterations + 1, counter + 1
        elif backup.launched == step and ahead == 0:
            pass  # failed between steps (an eager collective of fit's at an epoch's edge)
        else:
            node = failed_node(failure)
            if node is None or not in_scope(node, optimizer._name):
                raise SnapshotRefused(
                    f"the step after {step} failed in {node or 'an operation not named'}, not "
                    "in the gradients' all-reduce: its update may be partly applied "
                    f"({error_summary(failure)})")
        epoch, batch = divmod(step - 1, self.job.steps_per_epoch)
        # Another task saving in the chief's place writes even a step the chief had saved:
        # the chief's directory on this task's host may not have it.
        if step != backup.saved_step or \
                not self.model.distribute_strategy.extended.should_checkpoint:
            optimizer.iterations.assign(iterations)
            self.model._train_counter.assign(counter)
            # The epoch and batch of the step just done: saved_step() reads this very step.
            state._ckpt_saved_epoch.assign(epoch)
            state._ckpt_saved_batch.assign(batch)
            # The chief's directory whoever saves (the chief's own writes go there too).
            state.read_checkpoint_manager.save()
        return step, epoch


def failed_node(failure: BaseException) -> str | None:
    """The graph node a TensorFlow error names ("Detected at node NAME"), if any."""
    found = re.search(r"Detected at node '?([^\s']+)", str(failure))
    return found.group(1) if found else None


def error_summary(failure: BaseException) -> str:
    """The error's type and the start of its message (TensorFlow's "Graph execution error:"
    heading left out), on one line, at most 300 characters."""
    text = " ".join(str(failure).replace("Graph execution error:", "", 1).split())
    return f"{type(failure).__name__}: {text}"[:300]


def in_scope(node: str, scope: str) -> bool:
    """Whether ``node`` is in name scope ``scope`` (or a copy of it: ``Adam_1``)."""
    return re.fullmatch(rf"{re.escape(scope)}(_\d+)?", node.split("/", 1)[0]) is not None


@contextlib.contextmanager
def keeping_input_iterators(kept: list[Any]) -> Iterator[None]:
    """Within: every input iterator ``fit`` makes is appended to ``kept``, so that it is not
    destroyed when ``fit`` returns.

    Destroying a distributed input iterator waits for its tf.data threads, and now and then
    one of them takes seconds to end (9 to 25 s seen here; with the watchdog's few seconds in
    the chaos soak, a false 'hung'). The main thread waits inside the tensor's deallocation
    (``IteratorResource::~IteratorResource``, ``UnboundedThreadPool``'s logical thread), so
    this task reaches the final save late while every peer waits for it in the save's
    all-reduce. Kept, the iterator is never destroyed: the task ends with ``os._exit`` once it
    has said ``finished`` or its error (``exit_now``), as after a saved stop.
    """
    from tf_keras.src.engine import data_adapter

    handler = data_adapter.DataHandler
    original = handler.enumerate_epochs

    def enumerate_epochs(self: Any) -> Iterator[tuple[int, Any]]:
        for epoch, iterator in original(self):
            kept.append(iterator)
            yield epoch, iterator

    handler.enumerate_epochs = enumerate_epochs
    try:
        yield
    finally:
        handler.enumerate_epochs = original


def prepare(tf: Any, strategy: Any, job: Job, model: Any, dataset: Any, global_batch: int,
            lr: float) -> FitTraining:
    """Compile the model under the strategy's scope with the job's optimizer, loss and metrics."""
    import tf_keras

    with strategy.scope():
        optimizer = tf_keras.optimizers.get(
            {"class_name": job.optimizer, "config": {"learning_rate": lr}})
        model.compile(optimizer=optimizer, loss=job.loss, metrics=list(job.metrics))
    # Each replica's metric result is already the global value; tf_keras' "auto" reduction
    # would sum it over replicas, so per-batch logs would read replicas x the true loss.
    model.distribute_reduction_method = "first"
    done = steps_already_trained(tf, job.steps_per_epoch)
    if done and job.deterministic:
        # fit() restores its step counters but starts the input afresh: skip the batches the
        # restored weights have already seen, so the data lines up with an unbroken run.
        dataset = dataset.skip(done)
    return FitTraining(model, dataset, job, global_batch)


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


def make_callbacks(
    keras: Any,
    *,
    checkpoint_dir: str,
    every_steps: int,
    progress_every: int,
    global_batch: int,
    steps_per_epoch: int,
    total_steps: int,
) -> list[Any]:
    """BackupAndRestore that reports its saves and saves on SIGTERM, then a progress reporter.

    tf_keras' BackupAndRestore is multi-worker aware: the chief writes
    ``checkpoint_dir/chief``, the others write temp dirs it removes, and every
    task restores from ``checkpoint_dir/chief``. Its own ``save_before_preemption`` is not
    used: off GCP it does nothing, and its handler restores the other tasks from their temp
    dirs instead of the chief's and leaves those dirs behind.
    """
    import tensorflow as tf

    class ReportingBackup(keras.callbacks.BackupAndRestore):  # type: ignore[misc]
        def on_train_begin(self, logs: Any = None) -> None:
            super().on_train_begin(logs)
            self._step = self._saved_step = int(self.model.optimizer.iterations.numpy())
            # (step, the optimizer's iterations, fit's train counter) as the last step whose
            # function returned left them: what a snapshot puts back (FitTraining.snapshot).
            self.completed: tuple[int, int, int] | None = None
            self._preemption = Preemption(tf, self.model.distribute_strategy,
                                          os.path.join(self.backup_dir, "chief"),
                                          save=self._save_at_stop)
            emit("resumed" if self._step else "training", step=self._step,
                 total_steps=total_steps)
            self.launched = self._step  # the last step whose train function was called

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            super().on_train_batch_begin(batch, logs)
            self.launched = self._current_epoch * steps_per_epoch + batch + 1

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            super().on_train_batch_end(batch, logs)
            self._step = self._current_epoch * steps_per_epoch + batch + 1
            self.completed = (self._step, int(self.model.optimizer.iterations.numpy()),
                              int(self.model._train_counter.numpy()))
            if self._step < total_steps:  # at the last step, finishing loses nothing
                self._preemption.check(self._step)

        @property
        def saved_step(self) -> int:
            return self._saved_step

        def on_train_end(self, logs: Any = None) -> None:
            # The last step's checkpoint stays (delete_checkpoint=False): a task that dies
            # while the model is saved makes the group go on from the end, not from 0.
            if self._step == total_steps and self._saved_step != self._step:
                self._backup(epoch=self._current_epoch)  # the epoch and batch of the last step
            super().on_train_end(logs)

        def _backup(self, epoch: int, batch: int = 0) -> None:
            super()._backup(epoch=epoch, batch=batch)
            self._saved_step = int(self.model.optimizer.iterations.numpy())
            if self.model.distribute_strategy.extended.should_checkpoint:
                emit("checkpoint", step=self._saved_step, epoch=epoch,
                     path=os.path.join(self.backup_dir, "chief"))

        def _save_at_stop(self) -> tuple[int, int]:
            # The saved epoch and batch are those of the step just done: saved_step() reads
            # this very step back, and fit() resumes after it.
            if self._saved_step != self._step:
                self._training_state.back_up(epoch=self._current_epoch)
            return self._step, self._current_epoch

    class Progress(keras.callbacks.Callback):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self._last = time.monotonic()
            self._last_step = self._step = 0
            self._board: Board | None = None
            self._profile: Profile | None = None

        def on_train_begin(self, logs: Any = None) -> None:
            self._last = time.monotonic()
            self._last_step = self._step = int(self.model.optimizer.iterations.numpy())
            chief = is_chief(self.model.distribute_strategy)
            self._board = Board.from_env(chief)
            self._profile = Profile.from_env(chief, "tensorflow")
            if self._board is not None:
                self._board.begin(self._last_step)

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            if self._profile is not None:
                self._profile.before(self._step)

        def on_train_end(self, logs: Any = None) -> None:
            if self._profile is not None:
                self._profile.close()

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            step = self._step = int(self.model.optimizer.iterations.numpy())
            if self._profile is not None:
                self._profile.after(step)
            if self._board is not None and self._board.due(step, total_steps):
                self._board.scalars(step, {k: float(v) for k, v in (logs or {}).items()},
                                    global_batch, learning_rate(self.model.optimizer))
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

    return [ReportingBackup(checkpoint_dir, save_freq=every_steps, delete_checkpoint=False),
            Progress()]
