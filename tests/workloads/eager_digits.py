"""``tests.workloads.paced_digits`` with a tensor made at import: the module runs a TensorFlow op
when it is imported, which starts TensorFlow's runtime, so no warm task can import it ahead of
the strategy (``worker/warm.py``); a cold task imports it after the strategy, where it works."""

from __future__ import annotations

import tensorflow as tf

from tests.workloads.paced_digits import build_model, make_dataset

__all__ = ["build_model", "make_dataset"]

ONE = tf.constant(1.0)  # an op at import time
