"""``examples.keras3_digits`` for ``backend: jax`` with its input as a TensorFlow user writes it:
a ``tf.data.Dataset`` of global batches (seeded shuffle, repeat, batch), as the module gives
MultiWorkerMirroredStrategy on TensorFlow."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from examples.keras3_digits import build_model
from examples.keras3_digits import make_dataset as arrays

__all__ = ["build_model", "make_dataset"]


def make_dataset(global_batch_size: int, seed: int | None = None) -> Any:
    features, labels = arrays(global_batch_size, seed)
    dataset = tf.data.Dataset.from_tensor_slices((features, labels))
    dataset = dataset.shuffle(len(features), seed=seed, reshuffle_each_iteration=True)
    return dataset.repeat().batch(global_batch_size, drop_remainder=True)
