"""TensorFlow and Keras 3, imported without loading JAX or matplotlib where no task uses them.

``import tensorflow`` imports JAX when it is installed (``tensorflow.lite.python.util`` takes
``jax.jit`` for TFLite's conversion of JAX functions, and nothing else in TensorFlow does):
about half a second of CPU at every task's start on a host that also has JAX (the worker
image's JAX variant, a venv with ``orchestrate[worker]`` and ``jax``), for an API no task
uses. So the first import of TensorFlow in a worker process goes through ``tensorflow()``,
which hides JAX while TensorFlow loads (as ``orchestrator/remote/ssh.py`` hides invoke from
paramiko). An ``import jax`` afterwards works as ever; where JAX is already imported (the JAX
runtime), TensorFlow gets it as it would have.

JAX is hidden only where Keras is sure not to need it: where ``tf.keras`` is tf_keras
(``TF_USE_LEGACY_KERAS=1``, as the runtime sets it for a tf_keras job), or where Keras 3's
backend is said to be TensorFlow (``KERAS_BACKEND=tensorflow``, as the controller sets it for
a Keras 3 job on TensorFlow). Otherwise ``import tensorflow`` also imports Keras 3
(``keras.src.optimizers``, in a ``try`` that swallows an ImportError), and a Keras 3 whose
backend is JAX (``KERAS_BACKEND``, or ``~/.keras/keras.json``) would be left half-imported
without it: its layers then fail with "module 'keras.src.backend' has no attribute
'name_scope'".

Keras 3 itself imports matplotlib's pyplot when it is installed (``keras.visualization``'s two
plotting functions take it at import), which no training task draws with: measured (keras
3.15, matplotlib 3.11, this project's CI machine, medians of 4) 0.4 s of a JAX task's 2.8 s
import of JAX and Keras, and with JAX hidden too, 1.1 s of 5.5 s for TensorFlow with Keras 3.
So Keras 3 is imported with matplotlib hidden (``tensorflow()`` where it imports Keras 3, and
``keras()``), and those functions get matplotlib afterwards, imported when one is first called.

It imports scikit-learn too, for ``keras.wrappers``' three estimators, whose classes derive from
scikit-learn's: measured (keras 3.15, scikit-learn 1.8, this machine, 3 alternating runs) 0.8 s
of wall and CPU of a JAX task's import, 2.8-3.2 s against 2.0-2.5 s. So it is hidden as well,
and the wrappers, made on Keras' stand-in base classes while it was, are dropped where
scikit-learn is installed: ``keras.wrappers`` is made again, on scikit-learn's own classes, when
it is first asked for.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

# Keras 3's modules that take a matplotlib module at import (None without it): the attribute
# and the module it stands for.
KERAS_MATPLOTLIB = (
    ("keras.src.visualization.plot_image_gallery", "plt", "matplotlib.pyplot"),
    ("keras.src.visualization.plot_bounding_box_gallery", "patches", "matplotlib.patches"),
)


# The packages that export Keras 3's scikit-learn wrappers (``_lend_keras_wrappers``), and the
# modules that make them.
KERAS_WRAPPERS = ("keras", "keras._tf_keras.keras")
KERAS_WRAPPER_MODULES = "keras.src.wrappers"


def tensorflow() -> ModuleType:
    """The ``tensorflow`` module, imported now if it was not."""
    loaded = sys.modules.get("tensorflow")
    if loaded is not None:
        return loaded
    legacy = os.environ.get("TF_USE_LEGACY_KERAS") == "1"
    hidden = [*(("jax",) if legacy or os.environ.get("KERAS_BACKEND") == "tensorflow" else ()),
              *(() if legacy else ("matplotlib", "sklearn"))]  # Keras 3 comes with TensorFlow
    with _hidden(hidden):
        import tensorflow  # noqa: F401
    if not legacy:
        _lend_keras_matplotlib()
        _lend_keras_wrappers()
    return sys.modules["tensorflow"]


def keras() -> ModuleType:
    """The ``keras`` module (Keras 3), imported now if it was not, without matplotlib and
    scikit-learn."""
    loaded = sys.modules.get("keras")
    if loaded is not None:
        return loaded
    with _hidden(["matplotlib", "sklearn"]):
        import keras  # noqa: F401
    _lend_keras_matplotlib()
    _lend_keras_wrappers()
    return sys.modules["keras"]


@contextlib.contextmanager
def _hidden(names: list[str]) -> Iterator[None]:
    """``import NAME`` fails for each of ``names`` not imported yet, until the block ends."""
    hidden = [name for name in names if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]  # makes ``import NAME`` fail
    try:
        yield
    finally:
        for name in hidden:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


class _Later:
    """A module imported when one of its attributes is first read."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attribute: str) -> Any:
        return getattr(importlib.import_module(self._name), attribute)


def _lend_keras_matplotlib() -> None:
    """Keras 3's modules that found no matplotlib while it was hidden get it, imported when
    first used, where it is installed (where not, they say so as Keras says it)."""
    if "matplotlib" in sys.modules or importlib.util.find_spec("matplotlib") is None:
        return
    for module_name, attribute, target in KERAS_MATPLOTLIB:
        module = sys.modules.get(module_name)
        if module is not None and getattr(module, attribute, False) is None:
            setattr(module, attribute, _Later(target))


def _lend_keras_wrappers() -> None:
    """Keras 3's scikit-learn wrappers, made while scikit-learn was hidden, on Keras' stand-in
    base classes: where it is installed, they are dropped, and ``keras.wrappers`` is imported
    again, with scikit-learn, when first read (a ``__getattr__`` of the package, PEP 562). Where
    it is not, they stay as Keras made them (they say it is missing, as Keras says it)."""
    if "sklearn" in sys.modules or importlib.util.find_spec("sklearn") is None:
        return
    made = [name for name in sys.modules if name == KERAS_WRAPPER_MODULES
            or name.startswith(KERAS_WRAPPER_MODULES + ".")
            or any(name == f"{package}.wrappers" for package in KERAS_WRAPPERS)]
    for name in made:
        del sys.modules[name]
    for package in KERAS_WRAPPERS:
        module = sys.modules.get(package)
        if module is not None and "wrappers" in vars(module):
            delattr(module, "wrappers")
            module.__getattr__ = _wrappers_of(package)  # type: ignore[method-assign]


def _wrappers_of(package: str) -> Any:
    """A package's ``__getattr__`` that imports its ``wrappers`` when first read."""

    def __getattr__(name: str) -> Any:
        if name == "wrappers":
            return importlib.import_module(f"{package}.wrappers")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
