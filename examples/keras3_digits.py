"""Managed-mode example in Keras 3: the digits classifier of ``examples.digits``, as a functional
model with layer normalization and dropout, written with ``keras`` and NumPy only.

With ``job.keras: 3`` (or ``auto``) the orchestrator trains it in its distributed custom loop
(Keras 3's ``fit`` fails under MultiWorkerMirroredStrategy). ``make_dataset`` returns the arrays;
the runtime shuffles, repeats and batches them.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
from sklearn.datasets import load_digits


def build_model() -> Any:
    """An uncompiled Keras 3 functional model; the runtime compiles it with the spec's optimizer
    and loss."""
    inputs = keras.Input(shape=(64,), name="pixels")
    x = keras.layers.Dense(64, activation="relu")(inputs)
    x = keras.layers.LayerNormalization()(x)
    x = keras.layers.Dropout(0.1)(x)
    x = keras.layers.Dense(32, activation="relu")(x)
    outputs = keras.layers.Dense(10, activation="softmax")(x)
    return keras.Model(inputs, outputs, name="digits")


def make_dataset(global_batch_size: int, seed: int | None = None) -> tuple[Any, Any]:
    """1797 digits scaled to [0, 1] and their labels, as NumPy arrays."""
    features, labels = load_digits(return_X_y=True)
    return (features / 16.0).astype(np.float32), labels.astype(np.int64)
