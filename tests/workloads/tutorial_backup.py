"""A training script written as TensorFlow's multi-worker Keras tutorial teaches it: TF_CONFIG
read by MultiWorkerMirroredStrategy, ``model.fit`` with ``tf.keras.callbacks.BackupAndRestore``
writing to a directory relative to the working directory. Nothing in it knows the orchestrator.

It prints ``EPOCH-BEGIN n`` as each epoch starts (so a test can see where a resumed run began)
and ``WEIGHTS <sha256>`` at the end. ``TUTORIAL_BACKUP_DIR`` (default: ``ORCHESTRATE_CHECKPOINT_DIR``) and
``TUTORIAL_EPOCHS`` (default 6) set the obvious; each batch sleeps ``TUTORIAL_PACE_S``
(default 0.05) so that a test can act between two epochs.
"""

import hashlib
import json
import os
import time

import numpy as np
import tensorflow as tf

tf_config = json.loads(os.environ["TF_CONFIG"])
num_workers = sum(len(tasks) for tasks in tf_config["cluster"].values())
strategy = tf.distribute.MultiWorkerMirroredStrategy()

STEPS = 20
per_worker_batch = 32
global_batch = per_worker_batch * num_workers
pace_s = float(os.environ.get("TUTORIAL_PACE_S", "0.05"))

rng = np.random.default_rng(3)
x = rng.normal(size=(STEPS * global_batch, 8)).astype("float32")
y = (x[:, 0] > 0).astype("int64")
dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(1024, seed=3).repeat().batch(
    global_batch)

with strategy.scope():
    tf.keras.utils.set_random_seed(5)
    model = tf.keras.Sequential([
        tf.keras.Input(shape=(8,)),
        tf.keras.layers.Dense(32, activation="relu"),
        tf.keras.layers.Dense(2),
    ])
    model.compile(
        optimizer=tf.keras.optimizers.Adam(1e-3),
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )

# The tutorial's own directory, or the one the orchestrator exports.
backup_dir = os.environ.get("TUTORIAL_BACKUP_DIR") or os.environ["ORCHESTRATE_CHECKPOINT_DIR"]
callbacks = [
    tf.keras.callbacks.BackupAndRestore(backup_dir=backup_dir),
    tf.keras.callbacks.LambdaCallback(
        on_epoch_begin=lambda epoch, logs: print(f"EPOCH-BEGIN {epoch}", flush=True),
        on_train_batch_end=lambda batch, logs: time.sleep(pace_s),
    ),
]
model.fit(dataset, epochs=int(os.environ.get("TUTORIAL_EPOCHS", "6")), steps_per_epoch=STEPS,
          callbacks=callbacks, verbose=2)

digest = hashlib.sha256()
for weight in model.get_weights():
    digest.update(weight.tobytes())
print(f"WEIGHTS {digest.hexdigest()}", flush=True)
