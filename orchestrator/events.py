"""Parse the worker's one-line JSON events out of a task's log stream.

A task prints what it likes, so an event line is checked as it is read: a line with the
prefix that is not a well-formed event (not JSON, too long or too deep, a known event's field
of the wrong type, a number out of range) is a ``BadEvent`` with a short reason, never an
exception. An ``Event``'s fields have the types ``worker/events.py`` documents (numbers as
int or float, text as str), so the code that reads them converts nothing.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

PREFIX = "@orchestrate "  # the worker's worker.events.PREFIX; a test keeps the two equal
MAX_EVENT_CHARS = 256 * 1024  # a longer event line is refused unread (a traceback is 4 KB)
MAX_LINE_BYTES = 1 << 20  # output without a newline for this long is cut into a line
MAX_DEPTH = 16  # lists and objects nested deeper than this are refused
MAX_TEXT = 16 * 1024  # characters kept of any text field
MAX_STEP = 2**53  # steps, sizes and counts are at most this (the store keeps 64-bit ints)
SNIPPET = 80  # characters of a bad line quoted in its note
KIND = re.compile(r"[A-Za-z][A-Za-z0-9_.:-]{0,63}")


@dataclass(frozen=True)
class Event:
    kind: str
    task: str
    attempt: int
    time: float
    fields: dict[str, Any] = field(default_factory=dict)

    def get(self, name: str, default: Any = None) -> Any:
        return self.fields.get(name, default)


@dataclass(frozen=True)
class BadEvent:
    """A line with the event prefix that is not a well-formed event, and why.

    ``kind`` is the event's name where it could be read ("" otherwise); ``topic`` what was
    wrong with it ("json", a field's name, ...): a note is shown once per (kind, topic)."""

    kind: str
    topic: str
    reason: str
    snippet: str

    def note(self, task: str) -> str:
        what = f"{self.kind!r} event" if self.kind else "event line"
        return (f"{task} printed a bad {what}, ignored: {self.reason} (line: {self.snippet}); "
                "later lines wrong the same way are not reported")


class _Refused(ValueError):
    def __init__(self, topic: str, reason: str) -> None:
        super().__init__(reason)
        self.topic = topic
        self.reason = reason


# -- field types: each takes the decoded JSON value and returns it typed, or raises ---------------
Check = Callable[[str, Any], Any]


def _received(value: Any) -> str:
    try:
        text = repr(value) if isinstance(value, float) else json.dumps(value)
    except (ValueError, RecursionError):
        text = type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def _integer(low: int, high: int) -> Check:
    def check(name: str, value: Any) -> int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise _Refused(name, f"{name!r} must be an integer, received {_received(value)}")
        if not low <= value <= high:
            raise _Refused(name, f"{name!r} must be in [{low}, {high}], received "
                                 f"{_received(value)}")
        return value

    return check


def _number(*, finite: bool = True, low: float | None = None) -> Check:
    def check(name: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _Refused(name, f"{name!r} must be a number, received {_received(value)}")
        try:
            number = float(value)
        except OverflowError:  # an integer of hundreds of digits
            number = math.inf if value > 0 else -math.inf
        if finite and not math.isfinite(number):
            raise _Refused(name, f"{name!r} must be a finite number, received {_received(value)}")
        if low is not None and number < low:
            raise _Refused(name, f"{name!r} must be at least {low:g}, received {_received(value)}")
        return number

    return check


def _text(name: str, value: Any) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        raise _Refused(name, f"{name!r} must be text, received {_received(value)}")
    return _clean_text(value)


def _texts(name: str, value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _Refused(name, f"{name!r} must be a list of text, received {_received(value)}")
    return [_clean_text(v) for v in value[:1000]]


def _numbers(name: str, value: Any) -> dict[str, float]:
    """Metrics: names to numbers (NaN and infinity are a diverged training's, kept)."""
    if not isinstance(value, dict):
        raise _Refused(name, f"{name!r} must be an object of numbers, received "
                             f"{_received(value)}")
    number = _number(finite=False)
    metrics = {_clean_text(k)[:200]: v for k, v in list(value.items())[:200]}
    return {k: number(f"{name}.{k}"[:60], v) for k, v in metrics.items()}


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _Refused(name, f"{name!r} must be true or false, received {_received(value)}")
    return value


STEP = _integer(0, MAX_STEP)
SIZE = _integer(0, MAX_STEP)
REPLICAS = _integer(1, 2**20)
PID = _integer(0, 2**31)
SECONDS = _number(low=0.0)
RATE = _number(low=0.0)
# The fields of every event the controller knows (worker/events.py documents them), by type;
# a field left out, or null, is absent, except a required one. Other fields pass unchecked.
FIELDS: dict[str, dict[str, Check]] = {
    "started": {"pid": PID, "mode": _text, "python": _text, "argv": _texts},
    "connected": {"replicas": REPLICAS, "local_replicas": REPLICAS, "gpus": SIZE,
                  "collectives": _text, "tf_version": _text},
    "built": {"global_batch_size": SIZE, "learning_rate": _number(), "replicas": REPLICAS,
              "parameters": SIZE},
    "training": {"step": STEP, "total_steps": STEP},
    "resumed": {"step": STEP, "total_steps": STEP},
    "progress": {"step": STEP, "total_steps": STEP, "loss": _number(finite=False),
                 "metrics": _numbers, "steps_per_s": RATE, "examples_per_s": RATE},
    "epoch": {"epoch": SIZE, "logs": _numbers},
    "checkpoint": {"step": STEP, "epoch": SIZE, "path": _text, "reason": _text,
                   "counted": _text},
    "finished": {"metrics": _numbers, "model_path": _text, "weights_sha256": _text,
                 "step": SIZE, "seconds": SECONDS},
    "error": {"phase": _text, "type": _text, "message": _text, "traceback": _text,
              "fix": _text, "exit_code": _integer(-(2**31), 2**31)},
    "stopped": {"step": STEP, "signal": _text},
    "board": {"message": _text},
    "snapshot_started": {},
    "snapshot_failed": {"reason": _text},
    "warming": {"pid": PID},
    "warm_unusable": {"reason": _text},
    "ready": {"since": SECONDS, "imported_s": SECONDS, "rss_mib": SECONDS},
    "go": {"since": SECONDS, "ready_at": SECONDS, "waited_s": SECONDS, "cold": _flag},
    "warm_expired": {"reason": _text},
}
# Fields without which an event means nothing: these events are about a step.
REQUIRED = {"training": "step", "resumed": "step", "progress": "step", "checkpoint": "step",
            "stopped": "step"}
ATTEMPT = _integer(0, 10**6)
TIME = _number(low=0.0)


def _clean_text(value: str) -> str:
    """At most ``MAX_TEXT`` characters, and none that UTF-8 cannot write (a lone surrogate from
    a ``\\ud800`` escape stops a terminal, a file and SQLite alike)."""
    value = value[:MAX_TEXT]
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        value = value.encode("utf-8", errors="replace").decode("utf-8")
    return value


def _plain(name: str, value: Any, depth: int = 0) -> Any:
    """A field nothing here reads: any JSON, its text cleaned, its nesting bounded."""
    if depth > MAX_DEPTH:
        raise _Refused("depth", f"{name!r} is nested more than {MAX_DEPTH} levels deep")
    if isinstance(value, str):
        return _clean_text(value)
    if isinstance(value, list):
        return [_plain(name, v, depth + 1) for v in value]
    if isinstance(value, dict):
        return {_clean_text(k): _plain(name, v, depth + 1) for k, v in value.items()}
    return value


def _snippet(text: str) -> str:
    text = _clean_text(text[:SNIPPET * 2]).replace("\r", " ").replace("\n", " ")
    return repr(text[:SNIPPET] + ("..." if len(text) > SNIPPET else ""))


def read_line(line: str) -> Event | BadEvent | None:
    """The event on ``line``; a ``BadEvent`` for a line with the prefix that is not a
    well-formed event; None for ordinary output."""
    start = line.find(PREFIX)
    if start < 0:
        return None
    body = line[start + len(PREFIX) :]
    kind = ""
    try:
        if len(body) > MAX_EVENT_CHARS:
            raise _Refused("length", f"the line is {len(body)} characters long, more than "
                                     f"{MAX_EVENT_CHARS} (an event is one short JSON object)")
        try:
            record = json.loads(body)
        except (ValueError, RecursionError) as exc:
            reason = "nested too deep" if isinstance(exc, RecursionError) else \
                str(exc).splitlines()[0][:120]
            raise _Refused("json", f"not JSON ({reason})") from None
        if not isinstance(record, dict):
            raise _Refused("json", f"not a JSON object, received {_received(record)}")
        name = record.pop("event", None)
        if not isinstance(name, str) or not KIND.fullmatch(name):
            raise _Refused("event", "'event' must be a name (letters, digits, '_', '.', ':', "
                                    f"'-'), received {_received(name)}")
        kind = name
        return _event(kind, record)
    except _Refused as refused:
        return BadEvent(kind, refused.topic, refused.reason, _snippet(body))


def _event(kind: str, record: dict[str, Any]) -> Event:
    task = record.pop("task", None)
    attempt = record.pop("attempt", None)
    when = record.pop("time", None)
    known = FIELDS.get(kind, {})
    fields: dict[str, Any] = {}
    for name, value in record.items():
        if value is None and name in known:
            continue  # null: left out
        check = known.get(name)
        fields[name] = check(name, value) if check else _plain(name, value)
    required = REQUIRED.get(kind)
    if required is not None and required not in fields:
        raise _Refused(required, f"{required!r} is missing or null")
    return Event(kind, _text("task", task)[:200] if task is not None else "",
                 ATTEMPT("attempt", attempt) if attempt is not None else 0,
                 TIME("time", when) if when is not None else 0.0, fields)


def parse_line(line: str) -> Event | None:
    """The event on ``line``, or None for ordinary output and for a line that is not a
    well-formed event (``read_line`` says why)."""
    found = read_line(line)
    return found if isinstance(found, Event) else None


class BadEventNotes:
    """The notes a run shows of its tasks' bad event lines: one per event kind and what was
    wrong, ``limit`` in all, then one saying that the rest are not shown."""

    def __init__(self, limit: int = 10) -> None:
        self.limit = limit
        self._seen: set[tuple[str, str]] = set()

    def note(self, task: str, bad: BadEvent) -> str | None:
        key = (bad.kind, bad.topic)
        if key in self._seen or len(self._seen) > self.limit:
            return None
        self._seen.add(key)
        if len(self._seen) > self.limit:
            return f"more bad event lines ({self.limit} kinds shown): further ones are not reported"
        return bad.note(task)


class LineBuffer:
    """Turns chunks of bytes into whole lines, keeping a partial last line for later; output
    with no newline for ``MAX_LINE_BYTES`` is cut into a line of its own, so that memory stays
    bounded whatever a task prints."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, data: bytes) -> list[str]:
        data = self._pending + data
        *lines, self._pending = data.split(b"\n")
        while len(self._pending) > MAX_LINE_BYTES:
            lines.append(self._pending[:MAX_LINE_BYTES])
            self._pending = self._pending[MAX_LINE_BYTES:]
        return [line.decode("utf-8", errors="replace") for line in lines]
