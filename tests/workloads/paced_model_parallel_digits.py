"""``tests.workloads.model_parallel_digits``, paced as ``tests.workloads.paced_jax_digits``."""

from __future__ import annotations

from tests.workloads.model_parallel_digits import build_model, layout_map
from tests.workloads.paced_jax_digits import make_dataset

__all__ = ["build_model", "layout_map", "make_dataset"]
