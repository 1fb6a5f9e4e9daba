"""Shared by the benchmarks: --quick/--repeats, median and spread, the machine, a JSON line and a table."""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for _path in (str(REPO / "tests"), str(REPO)):  # the lab and the fake Compute API live in tests/
    if _path not in sys.path:
        sys.path.insert(0, _path)

# Python as it runs by default caches compiled modules (``__pycache__``), so a command's second
# start reads bytecode instead of compiling its source again. Some machines turn that off for
# every process (PYTHONDONTWRITEBYTECODE=1 in the environment, seen on the development machines
# of this project): there each `orchestrate` command compiled the controller's source anew, some
# 0.15 s of the launch row. Every process a benchmark starts (controllers, hand-launched tasks,
# lab hosts' commands) runs with the default here, as a user's Python would; the machine's
# setting is reported with the figures (``describe_machine``).
BYTECODE_OFF_HERE = os.environ.pop("PYTHONDONTWRITEBYTECODE", "")
sys.dont_write_bytecode = False


def parser(doc: str | None, *, full_repeats: int = 3) -> argparse.ArgumentParser:
    """The flags every benchmark takes: ``--quick`` (a CI smoke run) and ``--repeats N``."""
    text = doc or ""
    parser = argparse.ArgumentParser(description=text.splitlines()[0] if text else None,
                                     epilog="\n".join(text.splitlines()[1:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run for CI: smallest sizes, one repeat; figures mean little")
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"measurements per figure (default: 1 with --quick, else {full_repeats})")
    parser.set_defaults(full_repeats=full_repeats)
    return parser


def repeats(args: argparse.Namespace) -> int:
    if args.repeats is not None:
        return max(1, int(args.repeats))
    return 1 if args.quick else int(args.full_repeats)


def spread(values: Sequence[float | None], digits: int = 3) -> dict[str, Any]:
    """Median, min, max and count of the values measured (None values are left out)."""
    present = [float(v) for v in values if v is not None]
    if not present:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": round(statistics.median(present), digits), "min": round(min(present), digits),
            "max": round(max(present), digits), "n": len(present)}


def median_of(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def ratio(numerator: float | None, denominator: float | None, digits: int = 3) -> float | None:
    if numerator is None or not denominator:
        return None
    return round(numerator / denominator, digits)


def show(figure: dict[str, Any] | float | None, unit: str = "") -> str:
    """``median [min-max] unit`` for a spread, or the plain value."""
    if figure is None:
        return "-"
    if not isinstance(figure, dict):
        return f"{figure:g}{unit}"
    if figure.get("median") is None:
        return "-"
    if figure["n"] == 1 or figure["min"] == figure["max"]:
        return f"{figure['median']:g}{unit}"
    return f"{figure['median']:g}{unit} [{figure['min']:g}-{figure['max']:g}]"


def describe_machine() -> dict[str, Any]:
    """This machine, as the figures should be read: cores, memory, versions, load now."""
    return {
        "cpus": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "python": platform.python_version(),
        "tensorflow": _version("tensorflow"),
        "tf_keras": _version("tf-keras"),
        "platform": platform.platform(terse=True),
        "load_before": [round(x, 2) for x in os.getloadavg()],
        "bytecode_cache": "on (the machine sets PYTHONDONTWRITEBYTECODE; unset for the benchmark)"
        if BYTECODE_OFF_HERE else "on",
    }


def _memory_gib() -> float | None:
    try:
        words = Path("/proc/meminfo").read_text().split()
        return round(int(words[words.index("MemTotal:") + 1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        return None


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def note(message: str) -> None:
    """A progress line on stderr; stdout carries only the JSON line."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def publish(benchmark: str, args: argparse.Namespace, host: dict[str, Any], started: float,
            figures: dict[str, Any], header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Print the one JSON line (stdout) and the short table (stderr)."""
    record = {"benchmark": benchmark, "mode": "quick" if args.quick else "full",
              "repeats": repeats(args), **figures,
              "machine": {**host, "load_after": [round(x, 2) for x in os.getloadavg()]},
              "wall_s": round(time.monotonic() - started, 1)}
    print(json.dumps(record), flush=True)
    print(table(header, rows), file=sys.stderr, flush=True)


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(c) for c in header], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
             for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


@contextlib.contextmanager
def temp_home(prefix: str) -> Iterator[Path]:
    """A fresh ORCHESTRATE_HOME for this process (and the controllers it starts), removed after."""
    previous = os.environ.get("ORCHESTRATE_HOME")
    home = Path(tempfile.mkdtemp(prefix=f"orchestrate-bench-{prefix}-"))
    os.environ["ORCHESTRATE_HOME"] = str(home)
    try:
        yield home
    finally:
        if previous is None:
            os.environ.pop("ORCHESTRATE_HOME", None)
        else:
            os.environ["ORCHESTRATE_HOME"] = previous
        shutil.rmtree(home, ignore_errors=True)
