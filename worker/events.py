"""One-line JSON events on stdout: the only thing the worker tells the controller.

Every event has ``event``, ``task``, ``attempt`` and ``time``. A managed task emits, in order:
``started`` {pid, mode, python}; ``connected`` {replicas (in sync, every task's),
local_replicas (this task's: one per GPU it uses, else one), gpus (TensorFlow sees here),
collectives ("ring" or "nccl"), tf_version} (every task reached; a controller reads only the
fields it knows, and an older worker's event has just replicas and tf_version);
``built`` {global_batch_size, learning_rate, replicas, parameters}; ``training`` or
``resumed`` {step, total_steps}; while it trains ``progress`` {step, total_steps, loss,
metrics, steps_per_s, examples_per_s} (loss and metrics: means over the epoch so far),
``epoch`` {epoch, logs} and, from the chief only, ``checkpoint`` {step, epoch, path};
then ``finished`` {metrics, model_path (the chief's; "" elsewhere), weights_sha256, step}.
Instead of finishing it may emit ``error`` {phase, type, message, traceback} (phase
``build``: the user's module, or GPU settings that do not fit the task such as NCCL without a
GPU; the message says the fix) and exit 1, or, when any task got
SIGTERM, save with every peer at one step: the chief emits ``checkpoint`` {..., reason:
"stop"}, every task ``stopped`` {step, signal: "SIGTERM" where it was received, else "peer"},
and exits with ``worker.runtimes.common.STOPPED_EXIT`` (75). When a step fails because a peer
was lost (TensorFlow's ``UnavailableError``), the chief of a job with ``snapshot_on_crash``
emits ``snapshot_started``, saves its state at the last completed step and emits
``checkpoint`` {..., reason: "snapshot"}, or ``snapshot_failed`` {reason} where it cannot, then
its ``error``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

PREFIX = "@orchestrate "


def emit(event: str, **fields: Any) -> None:
    """Print one event line, e.g. ``@orchestrate {"event": "progress", "step": 10, ...}``."""
    record = {
        "event": event,
        "task": os.environ.get("ORCHESTRATE_TASK", "worker:0"),
        "attempt": int(os.environ.get("ORCHESTRATE_ATTEMPT", "1")),
        "time": round(time.time(), 3),
        **fields,
    }
    sys.stdout.write(PREFIX + json.dumps(record, default=_plain) + "\n")
    sys.stdout.flush()


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)
