"""``examples.keras3_digits``, paced (see ``tests.workloads.pace``): every batch takes at least
``DIGITS_PACE_S`` seconds (default 0.2) until the run's ``release`` file exists, so that a test
acting at a step is sure to act while training still runs. The arrays are batched as the
managed runtime batches them, then paced."""

from __future__ import annotations

import os

import tensorflow as tf

from examples.keras3_digits import build_model
from examples.keras3_digits import make_dataset as arrays
from tests.workloads.pace import Pace, resume_step

__all__ = ["build_model", "make_dataset"]


def make_dataset(global_batch_size: int, seed: int | None = None) -> tf.data.Dataset:
    features, labels = arrays(global_batch_size, seed)
    dataset = tf.data.Dataset.from_tensor_slices((features, labels))
    dataset = dataset.shuffle(len(features), seed=seed, reshuffle_each_iteration=True)
    dataset = dataset.repeat().batch(global_batch_size, drop_remainder=True)
    pace = Pace(resume_step(), float(os.environ.get("DIGITS_PACE_S", "0.2")))
    return pace.over(dataset)
