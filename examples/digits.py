"""Managed-mode example: a small classifier of scikit-learn's 8x8 handwritten digits.

The orchestrator imports this module on every task and calls ``build_model()``
inside the strategy's scope and ``make_dataset(global_batch_size, seed)``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf
import tf_keras as keras


def load_digits() -> tuple[Any, Any]:
    """scikit-learn's digits (1797 rows of 64 pixels 0..16, and their labels), read from the
    file scikit-learn ships without importing scikit-learn, which would cost every task about
    a second of CPU at its start; the same arrays as ``load_digits(return_X_y=True)``. (This
    file stands alone, so that it can be copied as a template.)"""
    spec = importlib.util.find_spec("sklearn")  # where it is, without importing it
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" if (
        spec is not None and spec.origin) else None
    if path is None or not path.is_file():
        from sklearn.datasets import load_digits as load

        return load(return_X_y=True)
    data = np.loadtxt(path, delimiter=",")
    return data[:, :-1], data[:, -1].astype(int, copy=False)


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
    features, labels = load_digits()
    features = (features / 16.0).astype(np.float32)
    labels = labels.astype(np.int64)
    dataset = tf.data.Dataset.from_tensor_slices((features, labels))
    dataset = dataset.shuffle(len(features), seed=seed, reshuffle_each_iteration=True)
    return dataset.repeat().batch(global_batch_size, drop_remainder=True)
