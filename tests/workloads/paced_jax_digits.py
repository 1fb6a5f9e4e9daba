"""``examples.keras3_digits`` for ``backend: jax``, paced as ``tests.workloads.pace`` paces the
TensorFlow workloads, without TensorFlow: the features are an array whose rows, once the
runtime takes a process's part of a batch from them, take at least ``DIGITS_PACE_S`` seconds
(default 0.2) until the run's ``release`` file exists. The values are the example's own, so a
paced run computes exactly what an unpaced one does."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from examples.keras3_digits import build_model
from examples.keras3_digits import make_dataset as arrays

__all__ = ["build_model", "make_dataset"]


class PacedArray(np.ndarray):
    """The features; taking rows (a batch) waits the pace first, until the release."""

    release: Path
    seconds: float

    def __getitem__(self, key: Any) -> Any:
        if not self.release.exists():
            time.sleep(self.seconds)
        return np.asarray(self).__getitem__(key)


def make_dataset(global_batch_size: int, seed: int | None = None) -> tuple[Any, Any]:
    features, labels = arrays(global_batch_size, seed)
    paced = features.view(PacedArray)
    paced.release = Path(os.environ["ORCHESTRATE_CHECKPOINT_DIR"]).parent / "release"
    paced.seconds = float(os.environ.get("DIGITS_PACE_S", "0.2"))
    return paced, labels
