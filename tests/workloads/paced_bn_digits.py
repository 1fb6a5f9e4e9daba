"""``tests.workloads.paced_digits`` with a BatchNormalization layer: tf_keras keeps its moving
statistics in variables synchronized on read, which a snapshot after a crash cannot save."""

from __future__ import annotations

from typing import Any

import tf_keras as keras

from tests.workloads.paced_digits import make_dataset

__all__ = ["build_model", "make_dataset"]


def build_model() -> Any:
    return keras.Sequential([
        keras.layers.Input(shape=(64,)),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.BatchNormalization(),
        keras.layers.Dense(10, activation="softmax"),
    ])
