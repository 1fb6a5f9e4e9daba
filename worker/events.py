"""One-line JSON events on stdout: the only thing the worker tells the controller."""

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
