"""The worker imports TensorFlow without JAX (worker/tfimport.py): half a second of every
task's start on a host that has both, for TFLite's conversion of JAX functions only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytest.importorskip("jax")

PROBE = """
import json, sys
{before}
from worker.tfimport import tensorflow
tf = tensorflow()
after_tf = "jax" in sys.modules
lite_util = sys.modules["tensorflow.lite.python.util"]
import jax
print(json.dumps({{"jax_with_tf": after_tf, "tf": tf.__version__, "same": tf is sys.modules["tensorflow"],
                  "lite_jit": lite_util._jit is not None, "jax_works": bool(jax.numpy.ones(2).sum() == 2),
                  "again": tensorflow() is tf}}))
"""


def probe(before: str = "") -> dict[str, object]:
    environment = {**os.environ, "TF_USE_LEGACY_KERAS": "1"}
    out = subprocess.run([sys.executable, "-c", PROBE.format(before=before)], cwd=REPO,
                         env=environment, capture_output=True, text=True, timeout=300,
                         check=True)
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_tensorflow_loads_without_jax_and_jax_imports_afterwards() -> None:
    result = probe()
    assert result["jax_with_tf"] is False and result["tf"] and result["same"] is True
    assert result["jax_works"] is True and result["again"] is True
    assert result["lite_jit"] is False  # the one thing TensorFlow would have taken from JAX


def test_where_jax_is_loaded_first_tensorflow_gets_it_as_ever() -> None:
    result = probe(before="import jax")
    assert result["jax_with_tf"] is True and result["lite_jit"] is True
    assert result["jax_works"] is True


def test_with_keras_3_on_jax_tensorflow_loads_jax_and_keras_works() -> None:
    """TensorFlow imports Keras 3 unless tf.keras is tf_keras, and Keras 3 on JAX needs JAX
    then: hidden, Keras was left half-imported (a Keras 3 job on JAX checking its gs://
    checkpoint directory through TensorFlow before the runtime imported JAX)."""
    code = ("from worker.tfimport import tensorflow; tensorflow(); import keras; "
            "layer = keras.layers.Dropout(0.1); print(keras.backend.backend(), type(layer).__name__)")
    env = {**os.environ, "TF_USE_LEGACY_KERAS": "0", "KERAS_BACKEND": "jax"}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "jax Dropout"


DRAWS = """
import json, sys
from worker.tfimport import {which}
{which}()
import keras
loaded = {{name: name in sys.modules for name in ("jax", "matplotlib", "sklearn", "tensorflow")}}
layer = keras.layers.Dense(2)
layer.build((None, 3))
images = keras.ops.convert_to_numpy(keras.random.uniform((2, 4, 4, 3), seed=1))
import matplotlib, os
matplotlib.use("Agg")
# keras's own check for pyplot, taken at import, comes first: "requires matplotlib" without it
keras.visualization.plot_image_gallery(images, rows=1, cols=2, path={path!r})
# the scikit-learn wrappers, made again on scikit-learn's own classes when first read
from sklearn import base
wrappers = [issubclass(keras.wrappers.SKLearnClassifier, (base.BaseEstimator, base.ClassifierMixin)),
            issubclass(keras.wrappers.SKLearnRegressor, base.RegressorMixin),
            base.is_classifier(keras.wrappers.SKLearnClassifier(model=lambda: None))]
print(json.dumps({{"loaded": loaded, "backend": keras.backend.backend(), "wrappers": wrappers,
                  "png": open({path!r}, "rb").read(8) == bytes([137, 80, 78, 71, 13, 10, 26, 10]),
                  "kernel": list(layer.kernel.shape)}}))
"""


def draws(which: str, env: dict[str, str], path: Path) -> dict[str, object]:
    code = DRAWS.format(which=which, path=str(path / "gallery.png"))
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO,
                         env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_keras_3_on_tensorflow_loads_neither_jax_nor_matplotlib_nor_sklearn_and_still_works(
        tmp_path: Path) -> None:
    """TensorFlow with Keras 3 as a Keras 3 job on TensorFlow has it (the controller says
    KERAS_BACKEND=tensorflow): JAX and matplotlib are left out of the import, and Keras's
    plotting, which took pyplot at import, gets it when it draws; scikit-learn is left out
    too, and keras.wrappers' estimators, read later, are scikit-learn's."""
    pytest.importorskip("matplotlib")
    result = draws("tensorflow", {"TF_USE_LEGACY_KERAS": "0", "KERAS_BACKEND": "tensorflow"},
                   tmp_path)
    assert result["loaded"] == {"jax": False, "matplotlib": False, "sklearn": False,
                                "tensorflow": True}
    assert result["backend"] == "tensorflow" and result["kernel"] == [3, 2]
    assert result["png"] is True and result["wrappers"] == [True, True, True]


def test_keras_3_on_jax_loads_without_matplotlib_and_sklearn_and_still_works(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    result = draws("keras", {"KERAS_BACKEND": "jax"}, tmp_path)
    assert result["loaded"] == {"jax": True, "matplotlib": False, "sklearn": False,
                                "tensorflow": False}
    assert result["backend"] == "jax" and result["kernel"] == [3, 2]
    assert result["png"] is True and result["wrappers"] == [True, True, True]


SAVES = """
import json, sys
from worker.tfimport import keras
keras = keras()
from keras.src.utils import module_utils
from worker.runtimes.keras_jax import _tensorflow_left_out
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
model.compile("adam", "mse")
with _tensorflow_left_out():
    model.save({path!r})
saved_without = "tensorflow" not in sys.modules
again = keras.saving.load_model({path!r})
print(json.dumps({{"saved_without_tensorflow": saved_without,
                  "asks_again": module_utils.tensorflow._available is None,
                  "same": [list(w.shape) for w in again.weights] == [[4, 2], [2]]}}))
"""


def test_a_jax_tasks_model_is_saved_without_importing_tensorflow(tmp_path: Path) -> None:
    """Keras' serializer asks whether TensorFlow is available before it checks a config's
    values for its types, which imports it where installed: 2.7 s at the end of every JAX
    task. The JAX runtime saves its model with TensorFlow said unavailable where it is not
    imported (no value can then be of its types), and the model loads back as it was."""
    code = SAVES.format(path=str(tmp_path / "model.keras"))
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "KERAS_BACKEND": "jax"}, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"saved_without_tensorflow": True, "asks_again": True, "same": True}
