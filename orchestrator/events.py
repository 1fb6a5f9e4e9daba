"""Parse the worker's one-line JSON events out of a task's log stream."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

PREFIX = "@orchestrate "  # the worker's worker.events.PREFIX; a test keeps the two equal


@dataclass(frozen=True)
class Event:
    kind: str
    task: str
    attempt: int
    time: float
    fields: dict[str, Any] = field(default_factory=dict)

    def get(self, name: str, default: Any = None) -> Any:
        return self.fields.get(name, default)


def parse_line(line: str) -> Event | None:
    """The event on ``line``, or None for ordinary output (or a line cut mid-write)."""
    start = line.find(PREFIX)
    if start < 0:
        return None
    try:
        record = json.loads(line[start + len(PREFIX) :])
    except json.JSONDecodeError:
        return None
    if not isinstance(record, dict) or "event" not in record:
        return None
    kind = str(record.pop("event"))
    task = str(record.pop("task", ""))
    attempt = int(record.pop("attempt", 0))
    when = float(record.pop("time", 0.0))
    return Event(kind, task, attempt, when, record)


class LineBuffer:
    """Turns chunks of bytes into whole lines, keeping a partial last line for later."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, data: bytes) -> list[str]:
        data = self._pending + data
        *lines, self._pending = data.split(b"\n")
        return [line.decode("utf-8", errors="replace") for line in lines]
