"""The Keras 3 side of managed jobs: Keras 3's ``fit`` fails under MultiWorkerMirroredStrategy
(keras-team/keras#20585), so the model trains in the runtime's own distributed loop.

Each step is one ``tf.function`` that runs the replica step on every replica
(``strategy.run``): the loss of each example averaged over the global batch, plus the model's
regularization losses, and the Keras 3 optimizer's ``apply_gradients``, which all-reduces the
gradients across every replica of every task. Loss and metrics add up, per replica, in one
sync-on-read vector (example count, loss sum, one sum per metric) that is summed over all
replicas only when a progress or epoch event reads it: no host sync and no extra collective at
the other steps. Checkpoints are a ``tf.train.Checkpoint`` in BackupAndRestore's layout (see
``common.checkpoint_dirs``), which ``python -m worker verify-checkpoint`` and the controller's
copies handle as they handle tf_keras'.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from worker.events import emit
from worker.runtimes.common import (
    Preemption,
    SnapshotRefused,
    checkpoint_dirs,
    emit_progress,
    is_chief,
    refuse_early_updates,
    remove_dir,
)
from worker.runtimes.managed import BuildError, Job
from worker.tensorboard import Board, Profile, boards_every, learning_rate, writes_at

KEEP = 3  # checkpoints kept in the chief's directory, as for tf_keras

# Metrics that are a mean of per-example values: the only kind that the loop's sums over all
# replicas give exactly. "accuracy" and "acc" are resolved as Keras' compile resolves them.
PER_EXAMPLE_METRICS = (
    "binary_accuracy", "categorical_accuracy", "sparse_categorical_accuracy",
    "top_k_categorical_accuracy", "sparse_top_k_categorical_accuracy",
    "mean_squared_error", "mean_absolute_error", "mean_absolute_percentage_error",
    "mean_squared_logarithmic_error", "binary_crossentropy", "categorical_crossentropy",
    "sparse_categorical_crossentropy", "binary_focal_crossentropy",
    "categorical_focal_crossentropy", "kl_divergence", "poisson", "hinge", "squared_hinge",
    "categorical_hinge", "huber", "log_cosh",
)
METRIC_ALIASES = {"mse": "mean_squared_error", "mae": "mean_absolute_error",
                  "mape": "mean_absolute_percentage_error",
                  "msle": "mean_squared_logarithmic_error", "kld": "kl_divergence"}

Fn = Callable[[Any, Any], Any]


def per_example_loss(keras: Any, name: str) -> Fn:
    """The job's loss (a Keras loss name) as a function giving one value per example."""
    loss = keras.losses.get(name)
    if isinstance(loss, keras.losses.Loss):
        return type(loss).from_config({**loss.get_config(), "reduction": None})  # type: ignore[no-any-return]
    return loss  # type: ignore[no-any-return]


def metric_function(keras: Any, name: str) -> Fn:
    """The per-example function of a metric the job names; a BuildError for any other."""
    if name.lower() in ("accuracy", "acc"):
        return _accuracy(keras)
    key = METRIC_ALIASES.get(name, name)
    if key not in PER_EXAMPLE_METRICS:
        raise BuildError(
            f"job.metrics names {name!r}, which is not a mean of per-example values: the Keras "
            "3 loop reports only those exactly across replicas. Use accuracy, acc, "
            f"{', '.join(METRIC_ALIASES)} or {', '.join(PER_EXAMPLE_METRICS)}")
    return getattr(keras.metrics, key)  # type: ignore[no-any-return]


def _accuracy(keras: Any) -> Fn:
    """Binary, sparse categorical or categorical accuracy, chosen by the shapes of the labels and
    the predictions as Keras' compile chooses for "accuracy"."""

    def accuracy(y_true: Any, y_pred: Any) -> Any:
        binary = y_pred.shape[-1] == 1
        sparse = len(y_true.shape) < len(y_pred.shape) or (
            y_true.shape[-1] == 1 and y_pred.shape[-1] > 1)
        fn = (keras.metrics.binary_accuracy if binary else
              keras.metrics.sparse_categorical_accuracy if sparse else
              keras.metrics.categorical_accuracy)
        return fn(y_true, y_pred)

    return accuracy


class DistributedStep:
    """One optimizer step on a global batch spread over the strategy's replicas, and the running
    sums of the loss and the metrics over every replica since the last ``reset``."""

    def __init__(self, tf: Any, strategy: Any, model: Any, optimizer: Any, loss: Fn,
                 metrics: dict[str, Fn], global_batch: int) -> None:
        self.tf, self.strategy, self.model, self.optimizer = tf, strategy, model, optimizer
        self.loss, self.metrics, self.global_batch = loss, metrics, global_batch
        with strategy.scope():
            self.totals = tf.Variable(
                tf.zeros([2 + len(metrics)]), trainable=False,
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=tf.VariableAggregation.SUM)
            # The model's non-trainable state (dropout's seeds, normalization statistics) as
            # the last step that completed left it: a step that fails on a lost peer has moved
            # it in its forward pass, and its all-reduce never came (see ``rewind``). Each
            # replica keeps its own copy (sync on read), read back without a collective.
            self.state = list(model.non_trainable_variables)
            self.kept = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False,
                                     synchronization=tf.VariableSynchronization.ON_READ,
                                     aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
                         for v in self.state]
        self.train = tf.function(self._train)
        self._read = tf.function(lambda: tf.identity(self.totals))

    def _train(self, iterator: Any) -> None:
        self.strategy.run(self._replica_step, args=(next(iterator),))

    def _replica_step(self, batch: Any) -> None:
        tf = self.tf
        features, labels = batch
        with tf.GradientTape() as tape:
            predictions = self.model(features, training=True)
            per_example = self._per_example(self.loss(labels, predictions))
            regularization = tf.add_n([tf.constant(0.0)] + [
                tf.cast(loss, tf.float32) for loss in self.model.losses])
            objective = (tf.nn.compute_average_loss(per_example,
                                                    global_batch_size=self.global_batch)
                         + tf.nn.scale_regularization_loss(regularization))
        variables = self.model.trainable_variables
        self.optimizer.apply_gradients(zip(tape.gradient(objective, variables), variables, strict=True))
        count = tf.cast(tf.shape(per_example)[0], tf.float32)
        sums = [count, tf.reduce_sum(per_example) + regularization * count]
        sums += [tf.reduce_sum(self._per_example(fn(labels, predictions)))
                 for fn in self.metrics.values()]
        self.totals.assign_add(tf.stack(sums))
        # Only once the update came: ops that do not wait for the all-reduce run even in a
        # step that fails on it. Reading an updated weight waits for its update (ops on one
        # variable run in program order), which waits for the all-reduce.
        with tf.control_dependencies([tf.identity(v.value) for v in variables[:1]]):
            for variable, kept in zip(self.state, self.kept, strict=True):
                kept.assign(variable.value)  # after the forward pass's update (same variable)

    def _per_example(self, values: Any) -> Any:
        """One float32 per example: the mean over every axis but the batch axis."""
        tf = self.tf
        values = tf.cast(values, tf.float32)
        return tf.reduce_mean(tf.reshape(values, [tf.shape(values)[0], -1]), axis=1)

    def means(self) -> dict[str, float]:
        """The loss and the metrics, each a mean over the examples since the last reset
        (``{}`` before the first step). Every task must call it at the same step: it sums the
        replicas' values across the tasks."""
        count, loss, *sums = (float(x) for x in self._read().numpy())
        if not count:
            return {}
        return {"loss": loss / count, **{name: s / count for name, s in zip(self.metrics, sums, strict=True)}}

    def reset(self) -> None:
        self.totals.assign(self.tf.zeros_like(self.totals))

    def rewind(self, steps: int) -> None:
        """Put the state as the step that completed ``steps`` left it, after the next step failed
        on a lost peer. Its gradients' all-reduce (one collective: a step's gradients go as one
        pack) never completed, so no weight or optimizer slot moved; but the ops that do not wait
        for it may have run: the optimizer's step count and the forward pass's non-trainable
        state. Raises SnapshotRefused where an update that does not wait for the gradients
        (weight decay, an EMA of the weights) may have changed the weights themselves."""
        optimizer = self.optimizer
        refuse_early_updates(optimizer)
        applied = int(optimizer.iterations.numpy())
        if applied not in (steps, steps + 1):
            raise SnapshotRefused(f"the state is not at a completed step (the optimizer has "
                                  f"applied {applied} step(s), the loop counted {steps})")
        optimizer.iterations.assign(steps)
        for variable, kept in zip(self.state, self.kept, strict=True):
            variable.assign(self.strategy.experimental_local_results(kept)[0])


class LoopTraining:
    """A Keras 3 model with its optimizer, checkpoint and input, trained step by step."""

    def __init__(self, tf: Any, strategy: Any, job: Job, model: Any, step: DistributedStep,
                 dataset: Any) -> None:
        self.tf, self.strategy, self.job, self.model, self.steps = tf, strategy, job, model, step
        base = os.environ["ORCHESTRATE_CHECKPOINT_DIR"]
        self.chief_dir, self.write_dir = checkpoint_dirs(strategy, base)
        self.checkpoint_path = self.chief_dir
        self.chief = is_chief(strategy)
        self.step_var = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
        # The model's own tracking leaves out its layers' random seed states (dropout's):
        # listed here, a resumed run draws the masks that an unbroken one draws.
        self.checkpoint = tf.train.Checkpoint(model=model, optimizer=step.optimizer,
                                              step=self.step_var,
                                              non_trainable=list(model.non_trainable_variables))
        self.manager = tf.train.CheckpointManager(self.checkpoint, self.write_dir,
                                                  max_to_keep=KEEP if self.chief else 1)
        self.step = self.saved_step = self._restore()
        if self.step and job.deterministic:
            # A fresh input starts at the first batch: skip those the restored weights have
            # seen, so the data lines up with an unbroken run.
            dataset = dataset.skip(self.step)
        self.iterator = iter(strategy.experimental_distribute_dataset(dataset))

    def _restore(self) -> int:
        """Every task restores the chief's latest checkpoint; the step it resumes at."""
        latest = self.tf.train.latest_checkpoint(self.chief_dir)
        if latest is None:
            return 0
        self.checkpoint.restore(latest).assert_existing_objects_matched()
        return int(self.step_var.numpy())

    def fit(self) -> tuple[dict[str, float], int]:
        job = self.job
        preemption = Preemption(self.tf, self.strategy, self.chief_dir, save=self._save_at_stop)
        emit("resumed" if self.step else "training", step=self.step, total_steps=job.total_steps)
        logs: dict[str, float] = {}
        self._mark = (time.monotonic(), self.step)
        board, board_every = Board.from_env(self.chief), boards_every()
        profile = Profile.from_env(self.chief, "tensorflow")
        if board is not None:
            board.begin(self.step)
        for epoch in range(self.step // job.steps_per_epoch, job.epochs):
            self.steps.reset()
            while self.step < (epoch + 1) * job.steps_per_epoch:
                if profile is not None:
                    profile.before(self.step)
                preemption.run(self.step, self.steps.train, self.iterator)
                self.step += 1
                if profile is not None:
                    profile.after(self.step)
                if self.step % job.checkpoint_every_steps == 0:
                    self._save()
                last = self.step == job.total_steps
                report = self.step % job.progress_every_steps == 0 or last
                # means() is a collective: every task calls it at the steps the chief writes
                plot = writes_at(self.step, job.total_steps, board_every)
                if report or plot:
                    means = self.steps.means()
                    if plot and board is not None:
                        board.scalars(self.step, means, self.steps.global_batch,
                                      learning_rate(self.steps.optimizer))
                    if report:
                        self._progress(means)
            logs = self.steps.means()
            emit("epoch", epoch=epoch, logs=logs)
        if profile is not None:
            profile.close()
        if self.saved_step != self.step:  # the end is a checkpoint: a failure after it costs
            self._save()                  # no step (the relaunch goes straight to the save)
        return logs, self.step

    def snapshot(self, failure: BaseException) -> tuple[int, int]:
        """The state at the loop's step count: the steps whose function returned (``failure``,
        the error that broke the step under way, is not needed: see FitTraining.snapshot)."""
        if not self.step:
            raise SnapshotRefused("no step had completed")
        if self.chief and self.saved_step == self.step:
            return self.step, self._epoch()  # saved already
        self.steps.rewind(self.step)
        if self.chief:
            self._save(report=False)  # save_snapshot reports it
        else:
            # In the chief's place (it died): into the chief's directory on this host, even a
            # step the chief had saved, which that directory here may not have.
            self.step_var.assign(self.step)
            self.tf.train.CheckpointManager(self.checkpoint, self.chief_dir, max_to_keep=KEEP) \
                .save(checkpoint_number=self.step)
            self.saved_step = self.step
        return self.step, self._epoch()

    def _save(self, report: bool = True) -> None:
        """A checkpoint of this step: the chief's kept (and reported), another task's removed
        (every task must save: saving reads synced variables collectively)."""
        self.step_var.assign(self.step)
        self.manager.save(checkpoint_number=self.step)
        self.saved_step = self.step
        if not self.chief:
            remove_dir(self.tf, self.write_dir)
        elif report:
            emit("checkpoint", step=self.step, epoch=self._epoch(), path=self.chief_dir)

    def _save_at_stop(self) -> tuple[int, int]:
        if self.saved_step != self.step:
            self._save(report=False)  # Preemption reports it
        return self.step, self._epoch()

    def _epoch(self) -> int:
        """The epoch of the step just done."""
        return max(self.step - 1, 0) // self.job.steps_per_epoch

    def _progress(self, means: dict[str, float]) -> None:
        self._mark = emit_progress(self.step, self.job.total_steps, means,
                                   self.steps.global_batch, self._mark)


def prepare(tf: Any, strategy: Any, job: Job, model: Any, dataset: Any, global_batch: int,
            lr: float) -> LoopTraining:
    """The job's optimizer, loss and metrics for a Keras 3 model; its state restored from the
    chief's latest checkpoint."""
    import keras

    metrics = {name: metric_function(keras, name) for name in job.metrics}
    _check_batches(dataset)
    with strategy.scope():
        if not model.built:
            model(tf.nest.map_structure(
                lambda spec: tf.zeros([1, *spec.shape[1:]], spec.dtype), dataset.element_spec[0]))
        optimizer = keras.optimizers.get(
            {"class_name": job.optimizer, "config": {"learning_rate": lr}})
        optimizer.build(model.trainable_variables)
    step = DistributedStep(tf, strategy, model, optimizer, per_example_loss(keras, job.loss),
                           metrics, global_batch)
    return LoopTraining(tf, strategy, job, model, step, dataset)


def _check_batches(dataset: Any) -> None:
    spec = dataset.element_spec
    if not (isinstance(spec, tuple) and len(spec) == 2):
        raise BuildError(
            f"the dataset's elements are {spec}: the Keras 3 loop trains on (features, labels) "
            "batches; make make_dataset() yield those (sample weights are not supported)")
