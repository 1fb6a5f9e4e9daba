"""Checkpoint storage as a task sees it: a gs:// location checked before training starts (a clear
error instead of a hang), and, for scripts that report nothing themselves, a watch on the chief's
checkpoint index that reports each new checkpoint as an event."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import threading
import uuid
from typing import Any

from worker.events import emit
from worker.preflight import describe_error
from worker.tfimport import tensorflow

CHECK_S = 60.0  # a gs:// check that takes longer than this counts as failed (a hang)
STORAGE_FIX = (
    "give the identity the tasks run as write access to the bucket (roles/storage.objectUser): "
    "on gcp the VMs' service account, with the storage scope (provider.scopes: "
    "https://www.googleapis.com/auth/devstorage.read_write); on kubernetes "
    "provider.service_account, through Workload Identity (the README's Kubernetes section); "
    "or set checkpoint.dir to an absolute path on a shared file system"
)
GFILE_FIX = (
    "install TensorFlow beside JAX on every host (the worker extra's: pip install "
    "'tensorflow>=2.21,<2.22'; only its file systems are used), or run the tasks in the worker "
    "image's JAX variant, which has it; or set checkpoint.dir to a path"
)
INDEX_RE = re.compile(r'^model_checkpoint_path:\s*"([^"]+)"', re.M)


def is_url(location: str) -> bool:
    return "://" in location


def write_problem(location: str, timeout_s: float | None = None) -> str | None:
    """None if a marker can be written to and removed from ``location`` (a URL, through
    TensorFlow's file systems) within ``timeout_s``; else what went wrong, one line."""
    timeout = timeout_s if timeout_s is not None else float(
        os.environ.get("ORCHESTRATE_STORAGE_CHECK_S", CHECK_S))
    outcome: list[str | None] = []

    def attempt() -> None:
        try:
            tf = tensorflow()
            tf.io.gfile.makedirs(location)
            marker = f"{location}/.orchestrate-check-{uuid.uuid4().hex}"
            with tf.io.gfile.GFile(marker, "w") as f:
                f.write("ok")
            tf.io.gfile.remove(marker)
            outcome.append(None)
        except Exception as exc:  # any failure of the file system is the answer
            outcome.append(f"{type(exc).__name__}: {describe_error(str(exc))[:600]}")

    thread = threading.Thread(target=attempt, daemon=True, name="orchestrate-storage-check")
    thread.start()
    thread.join(timeout)
    if not outcome:
        return f"no answer within {timeout:g}s"
    return outcome[0]


def check_checkpoint_storage(location: str) -> bool:
    """For a gs:// checkpoint location: emit a ``storage`` error and return False when this task
    cannot write there. Paths on disk are left to the job (and to ``orchestrate doctor``)."""
    if not is_url(location):
        return True
    if importlib.util.find_spec("tensorflow") is None:
        emit("error", phase="storage", type="CheckpointStorageError",
             message=f"cannot write the checkpoint location {location}: TensorFlow is not "
             f"installed on this host ({sys.executable}), and a gs:// URL is reached only "
             "through its file systems (tf.io.gfile), as Keras on JAX reaches remote paths",
             fix=GFILE_FIX)
        return False
    problem = write_problem(location)
    if problem is None:
        return True
    emit("error", phase="storage", type="CheckpointStorageError",
         message=f"cannot write the checkpoint location {location}: {problem}", fix=STORAGE_FIX)
    return False


def is_chief_task() -> bool:
    """From TF_CONFIG: the chief, or worker 0 of a cluster without one."""
    config: dict[str, Any] = json.loads(os.environ.get("TF_CONFIG") or "{}")
    task = config.get("task", {})
    has_chief = "chief" in config.get("cluster", {})
    return bool(task.get("type") == "chief" or
                (not has_chief and task.get("type") == "worker" and task.get("index") == 0))


def checkpoint_number(index_text: str) -> int | None:
    """The number of the checkpoint an index names (``ckpt-7`` -> 7)."""
    match = INDEX_RE.search(index_text)
    if not match:
        return None
    tail = re.search(r"-(\d+)$", os.path.basename(match.group(1)))
    return int(tail.group(1)) if tail else None


class IndexWatch:
    """Report every new checkpoint that the chief writes under ``base`` (``base/chief`` for
    BackupAndRestore, ``base`` for a CheckpointManager) as a ``checkpoint`` event.

    TensorFlow writes the index last, by a rename, so a changed index means a whole new
    checkpoint. The event's ``step`` is the checkpoint's number (the script reports no steps).
    """

    def __init__(self, base: str, interval_s: float = 1.0) -> None:
        self.indexes = [os.path.join(base, "chief", "checkpoint"), os.path.join(base, "checkpoint")]
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._seen: dict[str, tuple[int, int]] = {p: _stamp(p) for p in self.indexes}
        self._thread = threading.Thread(target=self._run, daemon=True, name="orchestrate-index")

    def start(self) -> IndexWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.poll()  # a checkpoint written just before the end still counts

    def poll(self) -> None:
        for index in self.indexes:
            stamp = _stamp(index)
            if stamp == self._seen.get(index) or stamp == (0, 0):
                continue
            self._seen[index] = stamp
            try:
                with open(index, encoding="utf-8") as f:
                    number = checkpoint_number(f.read())
            except OSError:
                continue
            if number is not None:
                emit("checkpoint", step=number, path=os.path.dirname(index), counted="saves")

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()


def _stamp(path: str) -> tuple[int, int]:
    try:
        stat = os.stat(path)
    except OSError:
        return (0, 0)
    return (stat.st_mtime_ns, stat.st_size)
