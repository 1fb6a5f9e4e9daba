"""Snapshot comparison for JSON documents the CLI prints, with volatile values normalised.

Set ORCHESTRATE_UPDATE_SNAPSHOTS=1 to rewrite the files under tests/snapshots/ from the
current output (then review the diff).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

SNAPSHOTS = Path(__file__).resolve().parent / "snapshots"
RUN_ID = re.compile(r"\d{8}-\d{6}-[0-9a-f]{6}")


def normalise(value: Any, replacements: Mapping[str, str],
              volatile: Callable[[str], bool] = lambda key: False, key: str = "") -> Any:
    """``value`` with every key for which ``volatile(key)`` holds set to "<KEY>" (when not
    null), run ids set to <run>, and each ``replacements`` text replaced in strings."""
    if isinstance(value, dict):
        return {k: normalise(v, replacements, volatile, k) for k, v in value.items()}
    if isinstance(value, list):
        return [normalise(v, replacements, volatile, key) for v in value]
    if value is not None and volatile(key):
        return f"<{key}>"
    if isinstance(value, str):
        for old, new in sorted(replacements.items(), key=lambda kv: -len(kv[0])):
            value = value.replace(old, new)
        return RUN_ID.sub("<run>", value)
    return value


def assert_matches(name: str, document: Any) -> None:
    path = SNAPSHOTS / name
    if os.environ.get("ORCHESTRATE_UPDATE_SNAPSHOTS") == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
    expected = json.loads(path.read_text())
    assert document == expected, (
        f"{name} changed; if on purpose, rerun with ORCHESTRATE_UPDATE_SNAPSHOTS=1 and review "
        f"the diff of {path}")
