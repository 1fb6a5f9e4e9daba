"""TensorBoard event files written by the chief of a managed job, in plain Python.

Every runtime writes through this one writer, so a JAX task (no TensorFlow) writes the same
logs as a TensorFlow one: an event file is a TFRecord file (each record: its length, a masked
CRC-32C of the length, the bytes, a masked CRC-32C of the bytes) of ``tensorflow.Event``
protocol buffers, encoded here by hand (the few fields used; their numbers are those of
``tensorflow/core/util/event.proto`` and ``tensorflow/core/framework/summary.proto``).

What is written (``Board``):

- at each attempt's start, a ``SessionLog`` START at the step after the one it resumes from
  (TensorBoard then drops what an earlier attempt wrote from that step on: steps redone after
  a crash are not drawn twice), the scalar ``run/attempt`` and a text ``run/attempts`` saying
  where the attempt began and why the one before ended;
- every ``every_steps`` steps and at the last: ``train/loss``, ``train/<metric>``,
  ``train/learning_rate`` (where the optimizer can say it), ``speed/steps_per_s`` and
  ``speed/examples_per_s``.

Each attempt writes a file of its own, flushed at every write, so TensorBoard and the
controller's mirror see the curve as it grows. A ``gs://`` directory is written through
TensorFlow's file systems (``tf.io.gfile``; a JAX task needs TensorFlow beside it, as for a
``gs://`` checkpoint), which upload the whole file at every flush: there the file is flushed at
most every ``URL_FLUSH_S`` (Cloud Storage takes about one write a second to an object) and at
the end. A write that fails (the disk full, the bucket refused) turns the board off with one
``board`` event the controller shows: training never stops for its plots.

``Profile`` traces the steps ``tensorboard.profile_steps`` names with the framework's own
profiler (``tf.profiler.experimental``, ``jax.profiler``), on the chief, into the same
directory's ``plugins/profile/<time>/``, where TensorBoard's Profile tab
(tensorboard-plugin-profile) shows it.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import struct
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

from worker.events import emit

DIR_ENV = "ORCHESTRATE_TENSORBOARD_DIR"
EVERY_ENV = "ORCHESTRATE_TENSORBOARD_EVERY"  # steps between scalar writes (managed jobs)
AFTER_ENV = "ORCHESTRATE_RESTARTED_AFTER"  # why the attempt before this one ended
PROFILE_ENV = "ORCHESTRATE_TENSORBOARD_PROFILE"  # "FIRST-LAST": the steps the chief traces
URL_FLUSH_S = 10.0  # the most often a board in a bucket is uploaded again

_CRC_TABLE: list[int] = []


def _crc32c_table() -> list[int]:
    if not _CRC_TABLE:
        for i in range(256):
            crc = i
            for _ in range(8):
                crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
            _CRC_TABLE.append(crc)
    return _CRC_TABLE


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), as TFRecord uses it; small records only (a few hundred bytes)."""
    table, crc = _crc32c_table(), 0xFFFFFFFF
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
    """``data`` framed as one TFRecord."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc(length)) + data + struct.pack("<I", masked_crc(data))


# -- protocol buffer wire format: the few field kinds an Event needs --------------------------
def _varint(value: int) -> bytes:
    out = bytearray()
    value &= (1 << 64) - 1  # negative int64s as protobuf writes them
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _key(field: int, wire: int) -> bytes:
    return _varint(field << 3 | wire)


def _bytes(field: int, value: bytes) -> bytes:
    return _key(field, 2) + _varint(len(value)) + value


def _int(field: int, value: int) -> bytes:
    return _key(field, 0) + _varint(value)


def _double(field: int, value: float) -> bytes:
    return _key(field, 1) + struct.pack("<d", value)


def _float(field: int, value: float) -> bytes:
    return _key(field, 5) + struct.pack("<f", value)


def event(step: int, *, summary: bytes = b"", file_version: str = "",
          session_start: bool = False, wall_time: float | None = None) -> bytes:
    """An encoded ``Event``: wall_time (1), step (2), file_version (3), summary (5),
    session_log (7; its status (1) START = 1)."""
    out = _double(1, time.time() if wall_time is None else wall_time) + _int(2, step)
    if file_version:
        out += _bytes(3, file_version.encode())
    if summary:
        out += _bytes(5, summary)
    if session_start:
        out += _bytes(7, _int(1, 1))
    return out


def scalar_value(tag: str, value: float) -> bytes:
    """A ``Summary.Value``: tag (1), simple_value (2)."""
    return _bytes(1, _bytes(1, tag.encode()) + _float(2, value))


def text_value(tag: str, text: str) -> bytes:
    """A ``Summary.Value`` the text plugin shows: tag (1), metadata (9: plugin_data (1):
    plugin_name (1) "text"), tensor (8: dtype (1) DT_STRING = 7, tensor_shape (2) scalar,
    string_val (8))."""
    metadata = _bytes(1, _bytes(1, b"text"))
    tensor = _int(1, 7) + _bytes(2, b"") + _bytes(8, text.encode())
    return _bytes(1, _bytes(1, tag.encode()) + _bytes(9, metadata) + _bytes(8, tensor))


def writes_at(step: int, total_steps: int, every: int | None) -> bool:
    """Whether the chief writes at ``step``, writing every ``every`` steps (None: never) and
    at the last."""
    return every is not None and (step % every == 0 or step == total_steps)


def boards_every() -> int | None:
    """Every how many steps the chief writes (None: it writes none), as every task reads it
    from the same environment: a runtime whose metrics are read collectively reads them on
    every task at those steps."""
    if not os.environ.get(DIR_ENV):
        return None
    return max(1, int(os.environ.get(EVERY_ENV) or 1))


class Board:
    """The chief's TensorBoard log for one attempt: a new event file in ``directory``."""

    def __init__(self, directory: str, every_steps: int, attempt: int) -> None:
        self.every_steps, self.attempt = max(1, every_steps), attempt
        self._url = "://" in directory
        self._file: Any = None  # a file, or a tf.io.gfile.GFile for a URL
        self._since: tuple[float, int] | None = None
        self._flushed = 0.0
        name = (f"events.out.tfevents.{time.time():.6f}.{socket.gethostname()}."
                f"{os.getpid()}.a{attempt}")
        try:
            if self._url:
                gfile = _gfile(directory)
                gfile.makedirs(directory)
                self._file = gfile.GFile(f"{directory.rstrip('/')}/{name}", "wb")
            else:
                os.makedirs(directory, exist_ok=True)
                self._file = open(os.path.join(directory, name), "ab")  # noqa: SIM115
            self._write(event(0, file_version="brain.Event:2"))
        except Exception as exc:  # OSError; for a URL, whatever TensorFlow raises
            self._off(exc)

    @classmethod
    def from_env(cls, chief: bool) -> Board | None:
        """The board the controller asked for (``ORCHESTRATE_TENSORBOARD_DIR``), on the chief
        only; None elsewhere, or when no directory is set."""
        every = boards_every()
        if not chief or every is None:
            return None
        return cls(os.environ[DIR_ENV], every, int(os.environ.get("ORCHESTRATE_ATTEMPT") or 1))

    @property
    def on(self) -> bool:
        return self._file is not None

    def begin(self, step: int) -> None:
        """Mark this attempt's start at ``step`` (the step it resumes from, 0 for a new run)."""
        self._since = (time.monotonic(), step)
        after = " ".join(os.environ.get(AFTER_ENV, "").split())
        text = f"attempt {self.attempt} began at step {step}"
        if after:  # the text plugin renders Markdown: what hosts said goes in a code block
            text += ", after:\n\n    " + after
        summary = scalar_value("run/attempt", float(self.attempt)) + \
            text_value("run/attempts", text)
        if step > 0 or self.attempt > 1:  # TensorBoard keeps what came before this step
            self._write(event(step + 1, session_start=True))
        self._write(event(step, summary=summary))

    def due(self, step: int, total_steps: int) -> bool:
        return self.on and writes_at(step, total_steps, self.every_steps)

    def scalars(self, step: int, values: Mapping[str, float], global_batch: int,
                learning_rate: float | None = None) -> None:
        """``train/`` scalars (``values``: the loss and metrics at ``step``), the learning rate
        and the speed since the last write."""
        now = time.monotonic()
        summary = b"".join(scalar_value(f"train/{name}", float(v)) for name, v in values.items()
                           if isinstance(v, (int, float)) and math.isfinite(v))
        if learning_rate is not None and math.isfinite(learning_rate):
            summary += scalar_value("train/learning_rate", learning_rate)
        if self._since is not None and step > self._since[1] and now > self._since[0]:
            rate = (step - self._since[1]) / (now - self._since[0])
            summary += scalar_value("speed/steps_per_s", rate)
            summary += scalar_value("speed/examples_per_s", rate * global_batch)
        self._since = (now, step)
        self._write(event(step, summary=summary))

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()  # (a URL's file is uploaded as it closes)
            except Exception as exc:
                self._file = None
                self._off(exc)
            self._file = None

    def _write(self, data: bytes) -> None:
        if self._file is None or not data:
            return
        try:
            self._file.write(record(data))
            now = time.monotonic()
            if not self._url or now - self._flushed >= URL_FLUSH_S:
                self._file.flush()
                self._flushed = now
        except Exception as exc:  # OSError; for a URL, whatever TensorFlow raises
            self._off(exc)

    def _off(self, exc: BaseException) -> None:
        said = " ".join(str(exc).split())[:400]
        emit("board", message=f"TensorBoard log turned off: {type(exc).__name__}: {said}")
        print(f"orchestrate: TensorBoard log turned off: {said}", file=sys.stderr, flush=True)
        if self._file is not None:
            with contextlib.suppress(Exception):
                self._file.close()
            self._file = None


def _gfile(location: str) -> Any:
    """TensorFlow's file systems, for a ``gs://`` location; an error that says so without it."""
    try:
        from worker.tfimport import tensorflow

        return tensorflow().io.gfile
    except ImportError as exc:
        raise OSError(f"{location} is reached through TensorFlow's file systems, and "
                      f"TensorFlow is not installed on this host ({sys.executable})") from exc


class Profile:
    """A trace of the steps ``first``..``last`` (counted from 1, both included) by the
    framework's profiler, on the chief, into ``directory``/plugins/profile/. An attempt resumed
    inside the window traces the rest of it; one resumed after it, none. A profiler that
    refuses (another trace under way, a missing library) is said once: training goes on."""

    def __init__(self, directory: str, first: int, last: int,
                 start: Callable[[str], None], stop: Callable[[], None]) -> None:
        self.directory, self.first, self.last = directory, first, last
        self._start, self._stop = start, stop
        self._state = "waiting"  # then "tracing", then "done"
        self._began = self._done = 0

    @classmethod
    def from_env(cls, chief: bool, backend: str) -> Profile | None:
        """The trace the controller asked for (``ORCHESTRATE_TENSORBOARD_PROFILE``, "FIRST-LAST"),
        on the chief only, by ``backend``'s profiler ("tensorflow" or "jax")."""
        steps, directory = os.environ.get(PROFILE_ENV), os.environ.get(DIR_ENV)
        if not chief or not steps or not directory:
            return None
        first, _, last = steps.partition("-")
        start, stop = _profiler(backend)
        if "://" in directory:
            start, stop = _through_a_local_directory(directory, start, stop)
        return cls(directory, int(first), int(last or first), start, stop)

    @property
    def tracing(self) -> bool:
        return self._state == "tracing"

    def before(self, done: int) -> None:
        """Before a step, ``done`` steps done: the trace begins where that step is its first."""
        if self._state == "waiting" and self.first <= done + 1 <= self.last:
            try:
                self._start(self.directory)
            except Exception as exc:
                self._state = "done"
                emit("board", message=f"steps {self.first}-{self.last} not profiled: "
                     f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
                return
            self._state, self._began, self._done = "tracing", done + 1, done

    def after(self, done: int) -> None:
        """After a step, ``done`` steps done: the trace ends with the window's last step."""
        if self._state == "tracing":
            self._done = done
            if done >= self.last:
                self.close()

    def close(self) -> None:
        """End a trace under way (the window's end, or training's) and write it."""
        if self._state != "tracing":
            return
        self._state = "done"
        where = f"{self.directory.rstrip('/')}/plugins/profile"
        try:
            self._stop()
        except Exception as exc:
            emit("board", message=f"the profile of steps {self._began}-{self._done} was not "
                 f"written: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
            return
        emit("board", message=f"steps {self._began}-{self._done} profiled into {where} "
             "(TensorBoard's Profile tab)")


def _through_a_local_directory(
        url: str, start: Callable[[str], None],
        stop: Callable[[], None]) -> tuple[Callable[[str], None], Callable[[], None]]:
    """A profiler that traces into a temporary directory on this host, then copies the trace
    to ``url`` through TensorFlow's file systems (which a profiler may not have: jaxlib's)."""
    import shutil
    import tempfile

    local: list[str] = []

    def start_here(_: str) -> None:
        _gfile(url)  # (before the trace: without a file system to copy it with, none)
        local.append(tempfile.mkdtemp(prefix="orchestrate-profile-"))
        start(local[-1])

    def stop_and_copy() -> None:
        try:
            stop()
            gfile = _gfile(url)
            for root, _, files in os.walk(local[-1]):
                relative = os.path.relpath(root, local[-1])
                target = url.rstrip("/") if relative == "." else f"{url.rstrip('/')}/{relative}"
                gfile.makedirs(target)
                for name in files:
                    gfile.copy(os.path.join(root, name), f"{target}/{name}", overwrite=True)
        finally:
            shutil.rmtree(local[-1], ignore_errors=True)
    return start_here, stop_and_copy


def _profiler(backend: str) -> tuple[Callable[[str], None], Callable[[], None]]:
    """``backend``'s profiler: start (into a directory) and stop, imported when called."""
    if backend == "jax":
        def start(directory: str) -> None:
            import jax

            jax.profiler.start_trace(directory)

        def stop() -> None:
            import jax

            jax.profiler.stop_trace()
        return start, stop

    def tf_start(directory: str) -> None:
        from worker.tfimport import tensorflow

        tensorflow().profiler.experimental.start(directory)

    def tf_stop() -> None:
        from worker.tfimport import tensorflow

        tensorflow().profiler.experimental.stop()
    return tf_start, tf_stop


def learning_rate(optimizer: Any) -> float | None:
    """The optimizer's learning rate now (a schedule's, at its step), where it can say."""
    rate: Any = getattr(optimizer, "learning_rate", None)
    try:
        if callable(rate):  # a schedule
            rate = rate(optimizer.iterations)
        if hasattr(rate, "numpy"):  # a variable (under a strategy, a MirroredVariable: no
            rate = rate.numpy()     # float() of its own)
        return float(rate)
    except Exception:  # whatever it raises: a plot is not worth a failed step
        return None
