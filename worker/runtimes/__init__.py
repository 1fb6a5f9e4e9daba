"""The worker's job runtimes, one module each, by the mode the controller names in its argv
(``python -m worker MODE ...``); the controller's side of each is in ``orchestrator/runtimes/``."""

from __future__ import annotations

from worker.runtimes import command, tf_keras
from worker.runtimes.common import WorkerRuntime

RUNTIMES: dict[str, WorkerRuntime] = {r.mode: r for r in (tf_keras.RUNTIME, command.RUNTIME)}
