"""Checkpoint checks run on a host (``python -m worker verify-checkpoint --dir D``): find the
newest checkpoint in a directory that really restores."""

from __future__ import annotations

import json
import os
from typing import Any


def restores(tf: Any, path: str) -> str | None:
    """None if every tensor of the checkpoint at ``path`` reads back; else why not."""
    try:
        reader = tf.train.load_checkpoint(path)
        for key in reader.get_variable_to_shape_map():
            reader.get_tensor(key)
    except Exception as exc:  # any read failure makes the checkpoint unusable
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    return None


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
    import tensorflow as tf

    directory = restore_dir(tf, base)
    state = tf.train.get_checkpoint_state(directory)
    if state is None:
        return {"ok": True, "dir": directory, "path": None, "rejected": []}
    names = [os.path.basename(p) for p in
             (state.all_model_checkpoint_paths or [state.model_checkpoint_path])]
    rejected: list[dict[str, str]] = []
    for i in range(len(names) - 1, -1, -1):
        path = os.path.join(directory, names[i])
        problem = restores(tf, path)
        if problem is None:
            if rejected:
                tf.compat.v1.train.update_checkpoint_state(
                    directory, names[i], all_model_checkpoint_paths=names[: i + 1])
                for bad in rejected:
                    for leftover in tf.io.gfile.glob(bad["path"] + ".*"):
                        tf.io.gfile.remove(leftover)
            return {"ok": True, "dir": directory, "path": path, "rejected": rejected}
        rejected.append({"path": path, "problem": problem})
    return {"ok": False, "dir": directory, "path": None, "rejected": rejected}


def main(directory: str) -> int:
    result = verify(directory)
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 3
