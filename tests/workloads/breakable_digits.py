"""``examples.digits``, whose model is not built while ``DIGITS_BROKEN`` is set in the task's
environment: a run that fails (the user's code) under the same spec as one that succeeded."""

from __future__ import annotations

import os
from typing import Any

from examples.digits import build_model as built
from examples.digits import make_dataset

__all__ = ["build_model", "make_dataset"]


def build_model() -> Any:
    if os.environ.get("DIGITS_BROKEN"):
        raise RuntimeError("DIGITS_BROKEN is set: the model is not built")
    return built()
