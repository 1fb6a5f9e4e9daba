"""Checkpoint checks run on a host (``python -m worker verify-checkpoint --dir D``): find the
newest checkpoint in a directory that really restores.

Two formats share one layout (an index file ``checkpoint`` in tf.train's text format naming
the newest checkpoint and the ones kept, in ``DIR/chief`` or ``DIR``): TensorFlow's
(``NAME.index`` and ``NAME.data-*``, read with TensorFlow) and the JAX runtime's Keras format
(``NAME.weights.h5``, Keras's own weights file with the optimizer's, and ``NAME.state.npz``,
the step and the variables the weights file leaves out; read with h5py and NumPy, no
TensorFlow).

The Keras format's directory may be a ``gs://`` URL: it is then read and written through
TensorFlow's file systems (``tf.io.gfile``), as Keras itself reaches remote paths, so a JAX host
writing to a bucket needs TensorFlow beside JAX (the worker image's JAX variant has it).
"""

from __future__ import annotations

import json
import os
import posixpath
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from worker.storage import is_url
from worker.tfimport import tensorflow

INDEX = "checkpoint"
WEIGHTS = ".weights.h5"
STATE = ".state.npz"
STEP_KEY = "orchestrate/step"


def restores(tf: Any, path: str) -> str | None:
    """None if every tensor of the checkpoint at ``path`` reads back; else why not."""
    try:
        reader = tf.train.load_checkpoint(path)
        for key in reader.get_variable_to_shape_map():
            reader.get_tensor(key)
    except Exception as exc:  # any read failure makes the checkpoint unusable
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    return None


# -- files: a path, or a URL through TensorFlow's file systems ---------------------------------
def _gfile() -> Any:
    return tensorflow().io.gfile


def join(directory: str, name: str) -> str:
    return posixpath.join(directory, name) if is_url(directory) else os.path.join(directory, name)


def exists(path: str) -> bool:
    return bool(_gfile().exists(path)) if is_url(path) else os.path.exists(path)


def read_bytes(path: str, limit: int = -1) -> bytes:
    """The file's bytes (at most ``limit``); OSError if it cannot be read (a URL's errors too)."""
    if not is_url(path):
        with open(path, "rb") as f:
            return f.read(limit)
    try:
        with _gfile().GFile(path, "rb") as f:
            data: bytes = f.read(limit)
            return data
    except ImportError:
        raise
    except Exception as exc:  # TensorFlow's NotFoundError and the like: an OSError here
        raise OSError(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                      ) from exc


def write_bytes(path: str, data: bytes) -> None:
    """The whole file, or none of it: a temporary file renamed over it; an object of a bucket
    appears when its upload ends."""
    if is_url(path):
        with _gfile().GFile(path, "wb") as f:
            f.write(data)
        return
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)


def makedirs(directory: str) -> None:
    if is_url(directory):
        _gfile().makedirs(directory)
    else:
        os.makedirs(directory, exist_ok=True)


def _listdir(directory: str) -> list[str]:
    if is_url(directory):
        return [name.rstrip("/") for name in _gfile().listdir(directory)]
    return os.listdir(directory)


def _remove(path: str) -> None:
    if is_url(path):
        _gfile().remove(path)
    else:
        os.remove(path)


def keras_restores(path: str) -> str | None:
    """None if every array of the Keras-format checkpoint at ``path`` reads back; else why not.
    A checkpoint in a bucket is read from a local copy."""
    if not is_url(path):
        return _keras_restores(path)
    scratch = tempfile.mkdtemp(prefix="orchestrate-verify-")
    local = os.path.join(scratch, posixpath.basename(path))
    try:
        for suffix in (WEIGHTS, STATE):
            try:
                data = read_bytes(path + suffix)
            except OSError as exc:
                return str(exc)[:300]
            with open(local + suffix, "wb") as f:
                f.write(data)
        return _keras_restores(local)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _keras_restores(path: str) -> str | None:
    try:
        import h5py
        import numpy as np

        with h5py.File(path + WEIGHTS, "r") as weights:
            weights.visititems(lambda _, item: item[()] if isinstance(item, h5py.Dataset)
                               else None)
        with np.load(path + STATE) as state:
            for key in state.files:
                state[key]  # reading it is the check
            if STEP_KEY not in state.files:
                return f"{os.path.basename(path)}{STATE} has no step"
    except Exception as exc:  # any read failure makes the checkpoint unusable
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    return None


def is_keras_format(path: str) -> bool:
    return exists(path + WEIGHTS) or exists(path + STATE)


def check(path: str) -> str | None:
    """None if the checkpoint at ``path`` (either format) restores; else why not."""
    if is_keras_format(path):
        return keras_restores(path)
    return restores(tensorflow(), path)


def index_names(directory: str) -> list[str]:
    """The checkpoints the index in ``directory`` names, oldest first, the newest last."""
    try:
        text = read_bytes(join(directory, INDEX), 1 << 20).decode("utf-8", errors="replace")
    except OSError:
        return []
    newest, kept = "", []
    for line in text.splitlines():
        key, _, value = line.partition(":")
        name = os.path.basename(value.strip().strip('"'))
        if key.strip() == "model_checkpoint_path":
            newest = name
        elif key.strip() == "all_model_checkpoint_paths" and name:
            kept.append(name)
    if not newest:
        return []
    return [n for n in kept if n != newest] + [newest]


def write_index(directory: str, names: list[str]) -> None:
    """Name ``names`` in the index (the last is the newest), atomically; remove the Keras-format
    files of every other checkpoint in ``directory``."""
    text = f'model_checkpoint_path: "{names[-1]}"\n' + "".join(
        f'all_model_checkpoint_paths: "{n}"\n' for n in names)
    write_bytes(join(directory, INDEX), text.encode())
    for file in _listdir(directory):
        if file.endswith((WEIGHTS, STATE)) and \
                file.removesuffix(WEIGHTS).removesuffix(STATE) not in names:
            _remove(join(directory, file))


def _keras_dir(base: str) -> str | None:
    """Where the tasks restore from, if the checkpoints there are in the Keras format."""
    for directory in (join(base, "chief"), base):
        names = index_names(directory)
        if names:
            return directory if is_keras_format(join(directory, names[-1])) else None
    return None


def newest_good(directory: str, names: list[str], problem: Callable[[str], str | None],
                keep: Callable[[list[str], list[dict[str, str]]], None]) -> dict[str, Any]:
    """The newest of ``names`` (oldest first) in ``directory`` that restores (``problem`` of
    its path is None); where newer ones do not, ``keep(the names up to it, the rejected)``
    leaves only those in the index."""
    rejected: list[dict[str, str]] = []
    for i in range(len(names) - 1, -1, -1):
        path = join(directory, names[i])
        why = problem(path)
        if why is None:
            if rejected:
                keep(names[: i + 1], rejected)
            return {"ok": True, "dir": directory, "path": path, "rejected": rejected}
        rejected.append({"path": path, "problem": why})
    return {"ok": False, "dir": directory, "path": None, "rejected": rejected}


def restore_dir(tf: Any, directory: str) -> str:
    """Where the tasks restore from: ``DIR/chief`` in BackupAndRestore's layout (the chief writes
    there), else ``DIR`` itself (a CheckpointManager's directory)."""
    chief = os.path.join(directory, "chief")
    return chief if tf.io.gfile.exists(os.path.join(chief, "checkpoint")) else directory


def verify(base: str) -> dict[str, Any]:
    """Check the checkpoints the tasks restore from ``base`` (see ``restore_dir``), newest first;
    point the index at the newest good one.

    Corrupt or partial ones newer than it leave the index and their files are deleted, so
    every task restores from the same good checkpoint. Names in the index stay relative:
    the directory is copied between hosts whose home directories differ.
    """
    keras_dir = _keras_dir(base)
    if keras_dir is not None:
        return newest_good(keras_dir, index_names(keras_dir), keras_restores,
                           lambda kept, _: write_index(keras_dir, kept))
    tf = tensorflow()
    directory = restore_dir(tf, base)
    state = tf.train.get_checkpoint_state(directory)
    if state is None:
        return {"ok": True, "dir": directory, "path": None, "rejected": []}
    names = [os.path.basename(p) for p in
             (state.all_model_checkpoint_paths or [state.model_checkpoint_path])]

    def keep(kept: list[str], rejected: list[dict[str, str]]) -> None:
        tf.compat.v1.train.update_checkpoint_state(directory, kept[-1],
                                                   all_model_checkpoint_paths=kept)
        for bad in rejected:
            for leftover in tf.io.gfile.glob(bad["path"] + ".*"):
                tf.io.gfile.remove(leftover)

    return newest_good(directory, names, lambda path: restores(tf, path), keep)


def main(directory: str) -> int:
    result = verify(directory)
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 3
