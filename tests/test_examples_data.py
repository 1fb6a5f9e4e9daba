"""The digits example reads scikit-learn's data file without importing scikit-learn (a second
of CPU at every task's start), and gets the very arrays ``load_digits`` returns. (Keras 3
imports scikit-learn itself, for its wrappers, so the Keras 3 example does not try.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

PROBE = """
import json, sys
import {module} as example
features, labels = example.load_digits()
loaded_sklearn = "sklearn" in sys.modules
from sklearn.datasets import load_digits
want_x, want_y = load_digits(return_X_y=True)
print(json.dumps({{"sklearn_at_import": loaded_sklearn,
                  "same": bool((features == want_x).all() and (labels == want_y).all()),
                  "dtypes": [str(features.dtype), str(want_x.dtype), str(labels.dtype), str(want_y.dtype)],
                  "shape": list(features.shape)}}))
"""


def test_the_example_reads_the_digits_without_importing_scikit_learn() -> None:
    # as the worker imports a tf_keras module: TensorFlow's tf.keras is tf_keras
    env = {**os.environ, "TF_USE_LEGACY_KERAS": "1"}
    out = subprocess.run([sys.executable, "-c", PROBE.format(module="examples.digits")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
                         check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["sklearn_at_import"] is False
    assert result["same"] is True and result["shape"] == [1797, 64]
    dtypes = result["dtypes"]
    assert dtypes[0] == dtypes[1] and dtypes[2] == dtypes[3], dtypes
