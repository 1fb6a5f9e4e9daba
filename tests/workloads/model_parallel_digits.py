"""``examples.keras3_digits`` split over a device mesh (``job.distribution: model_parallel``):
every Dense kernel's output units over the mesh's ``model`` axis, the rest replicated."""

from __future__ import annotations

from typing import Any

import keras

from examples.keras3_digits import build_model, make_dataset

__all__ = ["build_model", "layout_map", "make_dataset"]


def layout_map(mesh: Any) -> Any:
    layouts = keras.distribution.LayoutMap(mesh)
    layouts["dense.*kernel"] = (None, "model")
    layouts["dense.*bias"] = ("model",)
    return layouts
