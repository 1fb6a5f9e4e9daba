"""The worker's job runtimes, one module each, by the mode the controller names in its argv
(``python -m worker MODE ...``); the controller's side of each is in ``orchestrator/runtimes/``.
``managed`` trains with one of two Keras: ``tf_keras`` (fit) or ``keras3`` (a custom loop)."""

from __future__ import annotations

from worker.runtimes import command, managed
from worker.runtimes.common import WorkerRuntime

RUNTIMES: dict[str, WorkerRuntime] = {r.mode: r for r in (managed.RUNTIME, command.RUNTIME)}
