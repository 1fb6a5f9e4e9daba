"""Keras 3 on JAX across processes, written as Keras's own distribution guide has it.

Run it on every task as a command job (``cluster_specs/keras_jax.yaml``)::

    job: {command: [python, keras_jax.py], backend: jax}

orchestrate gives every task ``KERAS_BACKEND=jax`` and the ``KERAS_DISTRIBUTION_*`` variables
that ``keras.distribution.initialize()`` reads (every task's address, the chief's first: JAX's
coordinator; how many processes; which one this is), and restarts the whole group when one
process dies (a JAX process cannot go on without its peers).

What multi-process JAX asks of a script, each done below: the same seed on every process (the
model's initial weights must agree), each process feeding its own shard of every global batch
(``auto_shard_dataset=False``: NumPy input cannot be sharded for you), and every process
calling ``save`` (a save is a collective; only process 0 keeps the file).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np

FEATURES = 8
EXAMPLES = 1024
GLOBAL_BATCH = 64
EPOCHS = int(os.environ.get("EPOCHS", "4"))
SEED = 7


def data() -> tuple[np.ndarray, np.ndarray]:
    """A linear target with noise: the same arrays on every process."""
    rng = np.random.default_rng(SEED)
    x = rng.normal(size=(EXAMPLES, FEATURES)).astype("float32")
    w = np.linspace(-1.0, 1.0, FEATURES, dtype="float32")[:, None]
    y = x @ w + 0.01 * rng.normal(size=(EXAMPLES, 1)).astype("float32")
    return x, y


def build_model() -> keras.Model:
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.05), loss="mse")
    return model


def main(callbacks: Sequence[keras.callbacks.Callback] = ()) -> dict[str, Any]:
    import jax

    keras.distribution.initialize()  # from KERAS_DISTRIBUTION_*: JAX's distributed service
    keras.utils.set_random_seed(SEED)  # the same initial weights on every process
    process, processes = jax.process_index(), jax.process_count()
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=jax.devices(), auto_shard_dataset=False))
    model = build_model()
    x, y = data()
    # Process p feeds rows p, p+n, ...: its part of every global batch.
    history = model.fit(x[process::processes], y[process::processes],
                        batch_size=GLOBAL_BATCH // processes, epochs=EPOCHS, shuffle=False,
                        verbose=2, callbacks=list(callbacks))
    model_dir = os.environ.get("ORCHESTRATE_MODEL_DIR") or tempfile.mkdtemp()
    if process == 0:
        os.makedirs(model_dir, exist_ok=True)
        model.save(os.path.join(model_dir, "model.keras"))
    else:
        with tempfile.TemporaryDirectory() as scratch:
            model.save(os.path.join(scratch, "model.keras"))
    digest = hashlib.sha256(b"".join(np.asarray(w).tobytes() for w in model.get_weights()))
    result = {"process": process, "processes": processes, "devices": jax.device_count(),
              "loss": float(history.history["loss"][-1]), "weights_sha256": digest.hexdigest()}
    print("result " + json.dumps(result, sort_keys=True), flush=True)
    return result


if __name__ == "__main__":
    main()
