"""Managed-mode example: a small classifier of scikit-learn's 8x8 handwritten digits.

The orchestrator imports this module on every task and calls ``build_model()``
inside the strategy's scope and ``make_dataset(global_batch_size, seed)``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf
import tf_keras as keras
from sklearn.datasets import load_digits


def build_model() -> Any:
    """An uncompiled tf_keras model; the runtime compiles it with the spec's optimizer and loss."""
    return keras.Sequential(
        [
            keras.Input(shape=(64,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )


def make_dataset(global_batch_size: int, seed: int | None = None) -> tf.data.Dataset:
    """1797 digits scaled to [0, 1], shuffled, repeated, in global batches.

    MultiWorkerMirroredStrategy shards it across the tasks (by data) and splits
    each global batch among the replicas.
    """
    features, labels = load_digits(return_X_y=True)
    features = (features / 16.0).astype(np.float32)
    labels = labels.astype(np.int64)
    dataset = tf.data.Dataset.from_tensor_slices((features, labels))
    dataset = dataset.shuffle(len(features), seed=seed, reshuffle_each_iteration=True)
    return dataset.repeat().batch(global_batch_size, drop_remainder=True)
