"""``examples.digits``, paced (see ``tests.workloads.pace``): every batch takes at least
``DIGITS_PACE_S`` seconds (default 0.2) until the run's ``release`` file exists, so that a
test acting at a step is sure to act while training still runs, however loaded the machine."""

from __future__ import annotations

import os

import tensorflow as tf

from examples.digits import build_model
from examples.digits import make_dataset as unpaced
from tests.workloads.pace import Pace, resume_step

__all__ = ["build_model", "make_dataset"]


def make_dataset(global_batch_size: int, seed: int | None = None) -> tf.data.Dataset:
    pace = Pace(resume_step(), float(os.environ.get("DIGITS_PACE_S", "0.2")))
    return pace.over(unpaced(global_batch_size, seed))
