"""The digits job under Ray Train's TensorflowTrainer, for the peer benchmark (not a benchmark itself).

Same model, data, batch size, optimizer and number of workers as `examples.digits` under
the orchestrator; MultiWorkerMirroredStrategy with RING collectives on the TF_CONFIG that
Ray sets; a checkpoint (rank 0's weights) reported every ``--every`` steps;
``FailureConfig(max_failures=1)``. Every worker appends its events (started, progress) as
JSON lines to ``--events/<pid>.jsonl`` with its own clock, so the benchmark can time them.

    python benchmarks/ray_digits.py --events DIR --storage DIR --temp DIR [--workers 2] [--steps 80]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def emit(directory: str, event: str, **fields: Any) -> None:
    record = {"event": event, "time": round(time.time(), 3), "pid": os.getpid(), **fields}
    with open(os.path.join(directory, f"{os.getpid()}.jsonl"), "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def train_loop(config: dict[str, Any]) -> None:
    """Runs on every Ray Train worker."""
    import numpy as np
    import ray.train
    import tensorflow as tf
    import tf_keras

    from examples.digits import build_model, make_dataset

    events, rank = config["events"], ray.train.get_context().get_world_rank()
    emit(events, "started", rank=rank)
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    replicas = strategy.num_replicas_in_sync
    with strategy.scope():
        model = build_model()
        model.compile(optimizer=tf_keras.optimizers.Adam(learning_rate=0.002 * replicas),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.distribute_reduction_method = "first"
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            saved = np.load(os.path.join(directory, "weights.npz"))
            model.set_weights([saved[f"arr_{i}"] for i in range(len(saved.files))])
            start = int(json.loads(Path(directory, "step.json").read_text())["step"])
    emit(events, "resumed" if start else "training", rank=rank, step=start)

    class Report(tf_keras.callbacks.Callback):  # type: ignore[misc]
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            step = start + batch + 1
            emit(events, "progress", rank=rank, step=step, loss=float((logs or {}).get("loss", 0)))
            if step % config["every"] == 0 or step == config["steps"]:
                report(model, step, rank)

    dataset = make_dataset(global_batch_size=32 * replicas, seed=1234)
    model.fit(dataset, epochs=1, steps_per_epoch=config["steps"] - start, callbacks=[Report()],
              verbose=0)


def report(model: Any, step: int, rank: int) -> None:
    """Every rank reports; rank 0 attaches its weights as the checkpoint."""
    import numpy as np
    import ray.train

    if rank != 0:
        ray.train.report({"step": step}, checkpoint=None)
        return
    with tempfile.TemporaryDirectory(prefix="ray-digits-") as directory:
        np.savez(os.path.join(directory, "weights.npz"), *model.get_weights())
        Path(directory, "step.json").write_text(json.dumps({"step": step}))
        ray.train.report({"step": step}, checkpoint=ray.train.Checkpoint.from_directory(directory))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", required=True)
    parser.add_argument("--storage", required=True)
    parser.add_argument("--temp", required=True, help="Ray's session directory (short path)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--every", type=int, default=10)
    args = parser.parse_args()

    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer

    env = {"TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "1", "PYTHONPATH": str(REPO)}
    # Logical CPUs only schedule Ray's actors: the workers and Ray's controller share 2 cores.
    ray.init(num_cpus=args.workers + 2, include_dashboard=False, runtime_env={"env_vars": env},
             log_to_driver=False, _temp_dir=args.temp)
    try:
        trainer = TensorflowTrainer(
            train_loop,
            train_loop_config={"events": args.events, "steps": args.steps, "every": args.every},
            scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False,
                                         resources_per_worker={"CPU": 1}),
            run_config=RunConfig(name="digits", storage_path=args.storage,
                                 failure_config=FailureConfig(max_failures=1),
                                 checkpoint_config=CheckpointConfig(num_to_keep=2)),
        )
        result = trainer.fit()
        print(json.dumps({"error": None if result.error is None else repr(result.error)}))
    finally:
        ray.shutdown()
    sys.exit(0 if result.error is None else 1)


if __name__ == "__main__":
    main()
