"""TensorFlow, imported without loading JAX.

``import tensorflow`` imports JAX when it is installed (``tensorflow.lite.python.util`` takes
``jax.jit`` for TFLite's conversion of JAX functions, and nothing else in TensorFlow does):
about half a second of CPU at every task's start on a host that also has JAX (the worker
image's JAX variant, a venv with ``orchestrate[worker]`` and ``jax``), for an API no task
uses. So the first import of TensorFlow in a worker process goes through ``tensorflow()``,
which hides JAX while TensorFlow loads (as ``orchestrator/remote/ssh.py`` hides invoke from
paramiko). An ``import jax`` afterwards works as ever; where JAX is already imported (the JAX
runtime), TensorFlow gets it as it would have.

Only where ``tf.keras`` is tf_keras (``TF_USE_LEGACY_KERAS=1``, as the runtime sets it for a
tf_keras job): otherwise ``import tensorflow`` also imports Keras 3 (``keras.src.optimizers``,
in a ``try`` that swallows an ImportError), and a Keras 3 whose backend is JAX
(``KERAS_BACKEND``, or ``~/.keras/keras.json``) would be left half-imported without it: its
layers then fail with "module 'keras.src.backend' has no attribute 'name_scope'".
"""

from __future__ import annotations

import os
import sys
from types import ModuleType


def tensorflow() -> ModuleType:
    """The ``tensorflow`` module, imported now if it was not."""
    loaded = sys.modules.get("tensorflow")
    if loaded is not None:
        return loaded
    hide = "jax" not in sys.modules and os.environ.get("TF_USE_LEGACY_KERAS") == "1"
    if hide:
        sys.modules["jax"] = None  # type: ignore[assignment]  # makes ``import jax`` fail
    try:
        import tensorflow  # noqa: F401
    finally:
        if hide and "jax" in sys.modules and sys.modules["jax"] is None:
            del sys.modules["jax"]
    return sys.modules["tensorflow"]
