"""Managed-mode job whose checkpoint is large while its training stays cheap.

A non-trainable weight of ``BIG_STATE_MIB`` MiB (default 256) of random, incompressible
values takes part trivially in the forward pass: every checkpoint and the saved model carry
it, but it has no gradient, no optimizer slots and nothing to all-reduce.

Pacing, for tests that need training to go on while something slow happens (see
``tests.workloads.pace``): from batch ``BIG_STATE_PACE_FROM`` on (unset: never), each batch
takes at least ``BIG_STATE_PACE_S`` seconds (default 0.2) until the run's ``release`` file
appears.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import tensorflow as tf
import tf_keras as keras

from tests.workloads.pace import Pace


class BigState(keras.layers.Layer):
    """Passes its input through unchanged, reading one value of a large non-trainable weight."""

    def __init__(self, mib: int = 256, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.mib = mib

    def build(self, input_shape: Any) -> None:
        self.state = self.add_weight(
            name="state",
            shape=(self.mib << 18,),  # float32: 2**18 values per MiB
            initializer=keras.initializers.RandomUniform(-1.0, 1.0, seed=7),
            trainable=False,
        )
        super().build(input_shape)

    def call(self, inputs: Any) -> Any:
        return inputs + 0.0 * self.state[0]

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "mib": self.mib}


def build_model() -> Any:
    """An uncompiled tf_keras model: the big state, then a small softmax classifier."""
    return keras.Sequential([
        keras.Input(shape=(8,)),
        BigState(int(os.environ.get("BIG_STATE_MIB", "256"))),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dense(4, activation="softmax"),
    ])


def make_dataset(global_batch_size: int, seed: int | None = None) -> tf.data.Dataset:
    """512 random points labelled by the quadrant of their first two coordinates, repeated."""
    rng = np.random.default_rng(seed)
    features = rng.uniform(-1.0, 1.0, size=(512, 8)).astype(np.float32)
    labels = ((features[:, 0] > 0).astype(np.int64) * 2 + (features[:, 1] > 0)).astype(np.int64)
    dataset = tf.data.Dataset.from_tensor_slices((features, labels)).repeat()
    dataset = dataset.batch(global_batch_size, drop_remainder=True)
    pace_from = os.environ.get("BIG_STATE_PACE_FROM")
    if pace_from is None:
        return dataset
    pace = Pace(int(pace_from), float(os.environ.get("BIG_STATE_PACE_S", "0.2")))
    return pace.over(dataset)
