"""Pacing for test workloads that must be caught mid-run: from batch ``start`` on, each batch
takes at least ``seconds`` until a file named ``release`` appears in the run's directory on the
host (the parent of ``ORCHESTRATE_CHECKPOINT_DIR``); then training runs at full speed.

The pace adds a Python-computed 0.0 to the features, which leaves every finite value as it is,
so a paced run computes exactly what an unpaced one does."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import tensorflow as tf


class Pace:
    """Slows batches down from a given one on, until the run's ``release`` file exists."""

    def __init__(self, start: int, seconds: float) -> None:
        self.start, self.seconds, self.batches = start, seconds, 0
        self.release = Path(os.environ["ORCHESTRATE_CHECKPOINT_DIR"]).parent / "release"

    def apply(self, features: tf.Tensor, labels: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        token = tf.py_function(self._wait, [], tf.float32)
        token.set_shape([])
        return features + token, labels

    def _wait(self) -> np.float32:
        self.batches += 1
        if self.batches > self.start and not self.release.exists():
            time.sleep(self.seconds)
        return np.float32(0.0)
