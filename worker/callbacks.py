"""tf_keras callbacks that report progress and checkpoints as events."""

from __future__ import annotations

import os
import time
from typing import Any

from worker.events import emit


def make_callbacks(
    keras: Any,
    *,
    checkpoint_dir: str,
    every_steps: int,
    progress_every: int,
    global_batch: int,
    total_steps: int,
) -> list[Any]:
    """BackupAndRestore that reports its saves, then a progress reporter.

    tf_keras' BackupAndRestore is multi-worker aware: the chief writes
    ``checkpoint_dir/chief``, the others write temp dirs it removes, and every
    task restores from ``checkpoint_dir/chief``.
    """

    class ReportingBackup(keras.callbacks.BackupAndRestore):  # type: ignore[misc]
        def on_train_begin(self, logs: Any = None) -> None:
            super().on_train_begin(logs)
            step = int(self.model.optimizer.iterations.numpy())
            emit("resumed" if step else "training", step=step, total_steps=total_steps)

        def _backup(self, epoch: int, batch: int = 0) -> None:
            super()._backup(epoch=epoch, batch=batch)
            if self.model.distribute_strategy.extended.should_checkpoint:
                emit(
                    "checkpoint",
                    step=int(self.model.optimizer.iterations.numpy()),
                    epoch=epoch,
                    path=os.path.join(self.backup_dir, "chief"),
                )

    class Progress(keras.callbacks.Callback):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self._last = time.monotonic()
            self._last_step = 0

        def on_train_begin(self, logs: Any = None) -> None:
            self._last = time.monotonic()
            self._last_step = int(self.model.optimizer.iterations.numpy())

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            step = int(self.model.optimizer.iterations.numpy())
            if step % progress_every and step != total_steps:
                return
            now = time.monotonic()
            steps = step - self._last_step
            rate = steps / (now - self._last) if now > self._last and steps > 0 else 0.0
            self._last, self._last_step = now, step
            emit(
                "progress",
                step=step,
                total_steps=total_steps,
                loss=float((logs or {}).get("loss", float("nan"))),
                metrics={k: float(v) for k, v in (logs or {}).items() if k != "loss"},
                steps_per_s=round(rate, 3),
                examples_per_s=round(rate * global_batch, 1),
            )

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            emit("epoch", epoch=epoch, logs={k: float(v) for k, v in (logs or {}).items()})

    return [ReportingBackup(checkpoint_dir, save_freq=every_steps), Progress()]
