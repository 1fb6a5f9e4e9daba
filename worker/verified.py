"""Stdlib only: which checkpoint the tasks would restore now, and whether it was already verified.

A warm task on the chief's host checks each checkpoint as the chief writes it (``worker.warm``)
and records the result in a JSON file beside the run: the checkpoint's name and the signature
of its files (name, size and modification time of each), so a checkpoint rewritten since does
not pass for verified. Before a relaunch the controller runs this file on the chief's host
(``python -S -c SOURCE check DIR RESULT [--request FILE --wait S --pgid N]``): it compares the
newest checkpoint with the result, and with ``--request`` asks the warm task to check it now
and waits for the answer while that task lives.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import sys
import time
from typing import Any

INDEX = "checkpoint"


def restore_dir(base: str) -> str:
    """``DIR/chief`` in BackupAndRestore's layout (the chief writes there), else ``DIR``."""
    chief = os.path.join(base, "chief")
    return chief if os.path.isfile(os.path.join(chief, INDEX)) else base


def newest(base: str) -> tuple[str, str] | None:
    """(path, signature) of the checkpoint the index of ``base`` names; None without one."""
    directory = restore_dir(base)
    try:
        with open(os.path.join(directory, INDEX), encoding="utf-8", errors="replace") as f:
            text = f.read(1 << 20)
    except OSError:
        return None
    name = _named(text)
    if not name:
        return None
    path = os.path.join(directory, os.path.basename(name))
    return path, signature(path)


def _named(text: str) -> str | None:
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model_checkpoint_path":
            return value.strip().strip('"')
    return None


def signature(path: str) -> str:
    """The files of checkpoint ``path`` (``path.index``, ``path.data-*``): name, size, mtime."""
    entries = []
    for file in sorted(glob.glob(glob.escape(path) + ".*")):
        with contextlib.suppress(OSError):
            st = os.stat(file)
            entries.append([os.path.basename(file), st.st_size, st.st_mtime_ns])
    return json.dumps(entries, separators=(",", ":"))


def read_result(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            result: dict[str, Any] = json.load(f)
    except (OSError, ValueError):
        return None
    return result if isinstance(result, dict) else None


def write_result(path: str, result: dict[str, Any]) -> None:
    """Replace the result file at once (a reader sees the old one or the new one)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(result, f)
    os.replace(tmp, path)


def group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` has a process (one of another user's counts)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def check(base: str, result_path: str, request: str | None = None, wait_s: float = 0.0,
          pgid: int = 0) -> dict[str, Any]:
    """Whether the newest checkpoint of ``base`` is the one the result file says was verified.

    ``checkpoint`` is None when there is none; ``verified`` is True (it restores), False (it
    does not: ``problem`` says why) or None (not checked). With ``request``, a checkpoint not
    checked yet is asked for (the warm task checks it at once) and waited for up to ``wait_s``
    while process group ``pgid`` lives.
    """
    deadline = time.monotonic() + wait_s
    asked = False
    while True:
        current = newest(base)
        if current is None:
            return {"checkpoint": None, "verified": None}
        path, sig = current
        result = read_result(result_path)
        if result is not None and result.get("signature") == sig and result.get("path") == path:
            return {"checkpoint": path, "verified": bool(result.get("ok")),
                    "problem": result.get("problem"), "seconds": result.get("seconds")}
        if request is None or time.monotonic() >= deadline or not (pgid and group_alive(pgid)):
            return {"checkpoint": path, "verified": None}
        if not asked:
            with contextlib.suppress(OSError), open(request, "w", encoding="utf-8") as f:
                f.write(path)
            asked = True
        time.sleep(0.02)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="worker.verified")
    sub = parser.add_subparsers(dest="command", required=True)
    cmd = sub.add_parser("check")
    cmd.add_argument("dir")
    cmd.add_argument("result")
    cmd.add_argument("--request")
    cmd.add_argument("--wait", type=float, default=0.0)
    cmd.add_argument("--pgid", type=int, default=0)
    args = parser.parse_args(argv)
    print(json.dumps(check(args.dir, args.result, args.request, args.wait, args.pgid)),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
