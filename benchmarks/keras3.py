"""Benchmark: the Keras 3 distributed loop against tf_keras `fit`, same model, same data, same run.

One module builds the model with ``tf.keras`` (Dense 64, LayerNormalization, Dense 32, Dense
10 over the 8x8 digits), so the job's ``keras`` switch alone decides which Keras trains it:
``keras: 2`` makes tf.keras tf_keras and the runtime fits it; ``keras: 3`` makes it Keras 3 and
the runtime trains it in its own loop under MultiWorkerMirroredStrategy. Both run under
`orchestrate train` on 2 local workers, taking turns; the rate is the chief's, from its own
event timestamps, leaving out the first 20% of the steps. Goal: Keras 3 / tf_keras >= 0.95.

    python benchmarks/keras3.py             # 3 x 200 steps, 5 repeats of each
    python benchmarks/keras3.py --quick     # 2 x 40 steps, once each
"""

from __future__ import annotations

import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

from common import describe_machine, median_of, note, parser, publish, ratio, repeats, show, spread, temp_home
from jobs import PORTS, Run, final_loss, orchestrated, write_spec

GOAL_RATIO = 0.95
WORKERS = 2

MODULE = '''
"""The same model in either Keras: tf.keras is whatever the job's `keras` makes it."""

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits


def build_model():
    inputs = tf.keras.Input(shape=(64,))
    x = tf.keras.layers.Dense(64, activation="relu")(inputs)
    x = tf.keras.layers.LayerNormalization()(x)
    x = tf.keras.layers.Dense(32, activation="relu")(x)
    outputs = tf.keras.layers.Dense(10, activation="softmax")(x)
    return tf.keras.Model(inputs, outputs)


def make_dataset(global_batch_size, seed=None):
    features, labels = load_digits(return_X_y=True)
    features = (features / 16.0).astype(np.float32)
    dataset = tf.data.Dataset.from_tensor_slices((features, labels.astype(np.int64)))
    dataset = dataset.shuffle(len(features), seed=seed, reshuffle_each_iteration=True)
    return dataset.repeat().batch(global_batch_size, drop_remainder=True)
'''


def job_spec(directory: Path, keras: str, epochs: int, steps: int) -> Path:
    project = directory / "project"
    project.mkdir(exist_ok=True)
    (project / "same_model.py").write_text(textwrap.dedent(MODULE))
    return write_spec(directory, {
        "name": f"keras{keras}-bench", "workers": WORKERS, "workdir": str(project),
        "job": {"module": "same_model", "keras": keras, "epochs": epochs,
                "steps_per_epoch": steps, "progress_every_steps": 1},
        "checkpoint": {"every_steps": 50}, "ports": PORTS,
        "timeouts": {"stop_grace_s": 10, "startup_s": 180},
    })


def main() -> None:
    args = parser(__doc__, full_repeats=5).parse_args()
    host, started = describe_machine(), time.monotonic()
    runs = repeats(args)
    epochs, steps = (2, 40) if args.quick else (3, 200)
    found: dict[str, list[Run]] = {"2": [], "3": []}
    with temp_home("keras3"), tempfile.TemporaryDirectory(prefix="orchestrate-bench-") as scratch:
        paths = {k: job_spec(Path(scratch), k, epochs, steps) for k in found}
        for i in range(runs):
            for keras in (["2", "3"] if i % 2 == 0 else ["3", "2"]):
                run = orchestrated(paths[keras], "--no-doctor")
                found[keras].append(run)
                note(f"keras {keras}: {run.steps_per_s() or 0:.1f} steps/s")
    rates = {k: [r.steps_per_s() for r in v] for k, v in found.items()}
    paired = [k3 / k2 for k2, k3 in zip(rates["2"], rates["3"], strict=True) if k2 and k3]
    value = ratio(median_of(rates["3"]), median_of(rates["2"]))
    results: dict[str, Any] = {
        "workers": WORKERS, "steps": epochs * steps,
        "tf_keras_fit_steps_per_s": spread(rates["2"], 2),
        "keras3_loop_steps_per_s": spread(rates["3"], 2),
        "ratio": value, "paired_ratio": spread(paired),
        "final_loss": {k: final_loss(v) for k, v in found.items()},
        "goal_met": value is not None and value >= GOAL_RATIO,
    }
    publish("keras3", args, host, started,
            {"goal": f"Keras 3 loop / tf_keras fit steps per second >= {GOAL_RATIO}",
             "job": f"Dense-LayerNorm-Dense-Dense on digits, {epochs} x {steps} steps, 2 local "
                    "workers, checkpoint every 50, progress every step",
             "results": results},
            ["workers", "steps", "tf_keras fit steps/s", "Keras 3 loop steps/s", "ratio", "goal"],
            [[WORKERS, epochs * steps, show(results["tf_keras_fit_steps_per_s"]),
              show(results["keras3_loop_steps_per_s"]), value,
              "yes" if results["goal_met"] else "no"]])


if __name__ == "__main__":
    main()
