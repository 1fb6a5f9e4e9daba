"""A training script written the way TensorFlow's multi-worker Keras tutorial writes it.

It knows nothing about the orchestrator: it reads TF_CONFIG, builds a
MultiWorkerMirroredStrategy, fits with tf.keras (Keras 2 via
TF_USE_LEGACY_KERAS=1, which the orchestrator sets) and BackupAndRestore, and
saves the model from the chief while the other workers save to temporary paths
that they delete. Its backups go to ORCHESTRATE_CHECKPOINT_DIR when the
orchestrator runs it (so a restarted group resumes from the chief's backup on
every host), else to --backup-dir.

    python examples/command_mode/train.py --model-dir /tmp/digits-model
"""

import argparse
import json
import os
import shutil

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits


def digits_dataset(global_batch_size):
    features, labels = load_digits(return_X_y=True)
    features = (features / 16.0).astype(np.float32)
    dataset = tf.data.Dataset.from_tensor_slices((features, labels.astype(np.int64)))
    return dataset.shuffle(len(features), seed=7).repeat().batch(global_batch_size)


def build_and_compile_model():
    model = tf.keras.Sequential(
        [
            tf.keras.Input(shape=(64,)),
            tf.keras.layers.Dense(64, activation="relu"),
            tf.keras.layers.Dense(10),
        ]
    )
    model.compile(
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=tf.keras.optimizers.SGD(learning_rate=0.05),
        metrics=["accuracy"],
    )
    return model


def _is_chief(task_type, task_id):
    return task_type == "chief" or (task_type == "worker" and task_id == 0)


def write_filepath(filepath, task_type, task_id):
    dirpath, base = os.path.dirname(filepath), os.path.basename(filepath)
    if not _is_chief(task_type, task_id):
        dirpath = os.path.join(dirpath, f"workertemp_{task_id}")
        tf.io.gfile.makedirs(dirpath)
    return os.path.join(dirpath, base)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", default="/tmp/keras-model")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--backup-dir", default="/tmp/keras-backup")
    args = parser.parse_args()
    backup_dir = os.environ.get("ORCHESTRATE_CHECKPOINT_DIR", args.backup_dir)

    tf_config = json.loads(os.environ["TF_CONFIG"])
    num_workers = len(tf_config["cluster"]["worker"])
    strategy = tf.distribute.MultiWorkerMirroredStrategy()

    global_batch_size = 32 * num_workers
    with strategy.scope():
        model = build_and_compile_model()
    callbacks = [tf.keras.callbacks.BackupAndRestore(backup_dir=backup_dir)]
    history = model.fit(digits_dataset(global_batch_size), epochs=args.epochs, steps_per_epoch=30,
                        callbacks=callbacks)
    print("final loss", history.history["loss"][-1])

    task_type, task_id = strategy.cluster_resolver.task_type, strategy.cluster_resolver.task_id
    path = write_filepath(os.path.join(args.model_dir, "model.keras"), task_type, task_id)
    model.save(path)
    if not _is_chief(task_type, task_id):
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    else:
        print("saved model to", path)


if __name__ == "__main__":
    main()
