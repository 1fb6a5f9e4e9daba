"""Pacing for test workloads that must be caught mid-run: from batch ``start`` on, each batch
takes at least ``seconds`` until a file named ``release`` appears in the run's directory on the
host (the parent of ``ORCHESTRATE_CHECKPOINT_DIR``); then training runs at full speed.

The pace adds a Python-computed 0.0 to the features, which leaves every finite value as it is,
so a paced run computes exactly what an unpaced one does.

With ``PACE_UNTIL_BATCH`` set (``Pace.over``), the batches from that one on (counted from the
pipeline's start, which a resume's skip keeps: the index is the step) pass through no Python
at all. It was the fix for a hang: fit's end destroyed its input iterator, which waited for a
py_function in flight while holding the GIL the py_function needed. The tf_keras runtime now
keeps fit's iterators to the end of the process (see docs/ARCHITECTURE.md, test workloads);
the chaos soak still sets it, so its last steps run at full speed.

A resumed task skips the batches its checkpoint has seen through the whole pipeline, pace
included: ``resume_step()`` says how many, so that they go by unpaced (``Pace(resume_step(),
...)``) and a resume costs what an unpaced one does."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import tensorflow as tf

# The trained-step count in a checkpoint: the Keras 3 loop's own, or the optimizer's iterations
# (tf_keras' BackupAndRestore: its legacy optimizer's under a strategy, else the new one's).
STEP_KEYS = ("step/.ATTRIBUTES/VARIABLE_VALUE",
             "model/optimizer/iter/.ATTRIBUTES/VARIABLE_VALUE",
             "model/optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE")


def resume_step() -> int:
    """The step of the chief's newest checkpoint, which this task resumes at (0: none)."""
    latest = tf.train.latest_checkpoint(
        os.path.join(os.environ["ORCHESTRATE_CHECKPOINT_DIR"], "chief"))
    if latest is None:
        return 0
    names = {name for name, _ in tf.train.list_variables(latest)}
    key = next((k for k in STEP_KEYS if k in names), None)
    return 0 if key is None else int(tf.train.load_variable(latest, key))


class Pace:
    """Slows batches down from a given one on, until the run's ``release`` file exists."""

    def __init__(self, start: int, seconds: float) -> None:
        self.start, self.seconds, self.batches = start, seconds, 0
        self.release = Path(os.environ["ORCHESTRATE_CHECKPOINT_DIR"]).parent / "release"

    def over(self, dataset: tf.data.Dataset) -> tf.data.Dataset:
        """``dataset`` paced (``apply``); only before batch ``PACE_UNTIL_BATCH`` where it is
        set (the later batches take the branch of a ``tf.cond`` that calls no Python)."""
        until = os.environ.get("PACE_UNTIL_BATCH")
        if until is None:
            return dataset.map(self.apply)
        limit = tf.constant(int(until), tf.int64)

        def one(index: tf.Tensor, batch: tuple[tf.Tensor, tf.Tensor]) -> tuple[tf.Tensor, tf.Tensor]:
            features, labels = batch
            paced = tf.cond(index < limit, lambda: self.apply(features, labels)[0],
                            lambda: features)
            return paced, labels

        return dataset.enumerate().map(one)

    def apply(self, features: tf.Tensor, labels: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        token = tf.py_function(self._wait, [], tf.float32)
        token.set_shape([])
        return features + token, labels

    def _wait(self) -> np.float32:
        self.batches += 1
        if self.batches > self.start and not self.release.exists():
            time.sleep(self.seconds)
        return np.float32(0.0)
