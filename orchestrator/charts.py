"""A run as a picture: its loss and steps/s over time, each attempt in its own colour and the
restarts marked, drawn in the terminal (braille dots, for ``status``) or as a PNG or SVG
(matplotlib, an optional extra, for ``status --plot`` and ``Cluster.plot``).

Both read a run as ``status --json`` gives it (``api.ClusterStatus.to_dict``): its
``started_at``, ``attempts`` and ``history``; time is this machine's, from the run's start.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Group
from rich.text import Text

from orchestrator.errors import OrchestratorError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

ATTEMPT_COLOURS = ("cyan", "magenta", "yellow", "green", "blue", "red")
PLOT_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")
SERIES = (("loss", "loss"), ("steps_per_s", "steps/s"))
PLOT_SIZE = (10.0, 6.0)  # inches, at PLOT_DPI: a 1000 x 600 PNG
PLOT_DPI = 100
PLOT_FORMATS = (".png", ".svg")
# One braille cell is 2 dots wide and 4 high; bit of each dot (x, y) in the cell's code point.
DOT_BITS = ((0x01, 0x02, 0x04, 0x40), (0x08, 0x10, 0x20, 0x80))
LABEL = 16  # characters left of the chart: the series' name and its value at that row


@dataclass(frozen=True)
class Line:
    """One attempt's values of one series: (seconds from the run's start, value)."""

    attempt: int
    points: tuple[tuple[float, float], ...]


@dataclass(frozen=True)
class Restart:
    """Attempt ``attempt`` began at ``at`` (seconds from the run's start) after ``why``;
    ``gap`` is the time without training before it (from the failure to its first step)."""

    attempt: int
    at: float
    why: str
    gap: tuple[float, float] | None


def lines(run: dict[str, Any], series: str) -> list[Line]:
    """The run's values of ``series`` (a field of the history's points), one line per attempt;
    points without a finite value are left out."""
    by_attempt: dict[int, list[tuple[float, float]]] = {}
    for point in run.get("history") or ():
        value = point.get(series)
        if isinstance(value, int | float) and math.isfinite(value):
            by_attempt.setdefault(point["attempt"], []).append(
                (point["at"] - run["started_at"], float(value)))
    return [Line(a, tuple(p)) for a, p in sorted(by_attempt.items())]


def restarts(run: dict[str, Any]) -> list[Restart]:
    """Where each attempt after the first began, and why (the previous one's end)."""
    found: list[Restart] = []
    attempts = run.get("attempts") or []
    for previous, attempt in itertools.pairwise(attempts):
        why = previous["cause"] or previous["status"]
        if previous.get("failed_task") and previous["failed_task"] != "-":
            why += f" in {previous['failed_task']}"
        if previous.get("recovery_s") is not None:
            why += f", back in {previous['recovery_s']:.1f}s"
        if previous.get("steps_lost"):
            why += f", {previous['steps_lost']} step(s) redone"
        lost_at = previous.get("failed_at") or previous.get("ended_at")
        first = attempt.get("first_step_at")
        gap = (lost_at - run["started_at"], first - run["started_at"]) \
            if lost_at is not None and first is not None and first > lost_at else None
        found.append(Restart(attempt["number"], attempt["started_at"] - run["started_at"], why,
                             gap))
    return found


def has_history(run: dict[str, Any]) -> bool:
    """Whether there is a curve to draw: two points of loss or speed at least."""
    return any(sum(len(line.points) for line in lines(run, name)) >= 2 for name, _ in SERIES)


# -- the terminal ---------------------------------------------------------------------------
class Canvas:
    """Braille dots, each cell coloured by the last line drawn through it."""

    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.bits = [[0] * width for _ in range(height)]
        self.style: list[list[str | None]] = [[None] * width for _ in range(height)]

    def dot(self, x: int, y: int, style: str) -> None:
        """Dot ``(x, y)``: x from the left, y from the top, in dots (2 by 4 per cell)."""
        if 0 <= x < self.width * 2 and 0 <= y < self.height * 4:
            row, column = y // 4, x // 2
            self.bits[row][column] |= DOT_BITS[x % 2][y % 4]
            self.style[row][column] = style

    def line(self, start: tuple[int, int], end: tuple[int, int], style: str) -> None:
        (x0, y0), (x1, y1) = start, end
        steps = max(abs(x1 - x0), abs(y1 - y0), 1)
        for i in range(steps + 1):
            self.dot(round(x0 + (x1 - x0) * i / steps), round(y0 + (y1 - y0) * i / steps), style)

    def row(self, index: int, marks: dict[int, str]) -> Text:
        """Row ``index``; an empty cell of a column in ``marks`` shows a restart's rule."""
        text = Text()
        for column, bits in enumerate(self.bits[index]):
            if bits:
                text.append(chr(0x2800 + bits), style=self.style[index][column] or "")
            elif column in marks:
                text.append("┊", style=marks[column])
            else:
                text.append(" ")
        return text


def terminal_chart(run: dict[str, Any], width: int = 100, height: int = 6) -> Group:
    """Loss and steps/s over the run's time, ``width`` characters wide, ``height`` rows each,
    with a line under them for each restart."""
    columns = max(20, width - LABEL - 1)
    end = _end_of(run)
    x_of = _scale(0.0, end, 0, columns * 2 - 1)
    begun = restarts(run)
    marks = {x_of(r.at) // 2: f"bold {_colour(r.attempt)}" for r in begun}
    rendered: list[Text] = []
    for series, title in SERIES:
        found = lines(run, series)
        values = [v for line in found for _, v in line.points]
        if len(values) < 2:
            continue
        low, high = min(values), max(values)
        y_of = _scale(high, low if high > low else high - 1.0, 0, height * 4 - 1)
        canvas = Canvas(columns, height)
        for line in found:
            dots = [(x_of(t), y_of(v)) for t, v in line.points]
            for start, stop in itertools.pairwise(dots if len(dots) > 1 else dots * 2):
                canvas.line(start, stop, _colour(line.attempt))
        for index in range(height):
            label = title if index == 0 else ""
            value = _number(high) if index == 0 else _number(low) if index == height - 1 else ""
            axis = "┤" if value else "│"
            rendered.append(Text(f"{label:<7}{value:>8} {axis}", style="dim")
                            + canvas.row(index, marks))
    if not rendered:
        return Group(Text("no progress recorded yet", style="dim"))
    rendered.append(Text(" " * LABEL + "└" + "─" * columns, style="dim"))
    rendered.append(_time_axis(end, columns))
    for r in begun:
        rendered.append(Text(" " * LABEL + " ") + Text("┊", style=f"bold {_colour(r.attempt)}")
                        + Text(f" attempt {r.attempt} at {_duration(r.at)}, after {r.why}",
                               overflow="fold"))
    return Group(*rendered)


def _time_axis(end: float, columns: int) -> Text:
    left, middle, right = _duration(0.0), _duration(end / 2), _duration(end)
    gap = max(1, columns // 2 - len(left) - len(middle) // 2)
    text = left + " " * gap + middle
    text += " " * max(1, columns - len(text) - len(right)) + right
    return Text(" " * (LABEL + 1) + text, style="dim")


def _scale(low: float, high: float, first: int, last: int) -> Any:
    span = (high - low) or 1.0

    def to(value: float) -> int:
        return min(last, max(first, round(first + (value - low) / span * (last - first))))
    return to


def _end_of(run: dict[str, Any]) -> float:
    times: list[float] = [p["at"] - run["started_at"] for p in run.get("history") or ()]
    if run.get("ended_at"):
        times.append(run["ended_at"] - run["started_at"])
    return max([*times, 1.0])


def _colour(attempt: int) -> str:
    return ATTEMPT_COLOURS[(attempt - 1) % len(ATTEMPT_COLOURS)]


def _number(value: float) -> str:
    return f"{value:.4g}"


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


# -- an image --------------------------------------------------------------------------------
def figure(run: dict[str, Any], title: str = "") -> Figure:
    """The run as a matplotlib figure (``PLOT_SIZE`` at ``PLOT_DPI``): loss above, steps/s
    below, one colour per attempt, a dashed rule where each attempt began and the time without
    training before it shaded.

    Raises:
        OrchestratorError: matplotlib is not installed.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise OrchestratorError("drawing a run as an image needs matplotlib, which is not "
                                "installed", fix='pip install -e ".[plot]" (or pip install '
                                "matplotlib)") from None
    end = _end_of(run)
    minutes = end > 180
    unit = 60.0 if minutes else 1.0
    begun = restarts(run)
    fig = Figure(figsize=PLOT_SIZE, dpi=PLOT_DPI, layout="constrained")
    axes = fig.subplots(len(SERIES), 1, sharex=True)
    for ax, (series, name) in zip(axes, SERIES, strict=True):
        for line in lines(run, series):
            ax.plot([t / unit for t, _ in line.points], [v for _, v in line.points],
                    color=_plot_colour(line.attempt), linewidth=1.4,
                    label=f"attempt {line.attempt}")
        for r in begun:
            ax.axvline(r.at / unit, color=_plot_colour(r.attempt), linestyle="--", linewidth=1)
            if r.gap is not None:
                ax.axvspan(r.gap[0] / unit, r.gap[1] / unit, color="#d62728", alpha=0.12)
        ax.set_ylabel(name)
        ax.grid(True, alpha=0.3)
    for r in begun:
        axes[0].annotate(f"attempt {r.attempt}\nafter {r.why}", (r.at / unit, 1.0),
                         xycoords=("data", "axes fraction"), xytext=(4, -4),
                         textcoords="offset points", va="top", fontsize=8)
    if len(run.get("attempts") or ()) > 1:
        axes[0].legend(loc="best", fontsize=8)
    axes[-1].set_xlabel("minutes since the run began" if minutes else
                        "seconds since the run began")
    axes[-1].set_xlim(0, end / unit)
    fig.suptitle(title or f"run {run['id']}")
    return fig


def save_plot(run: dict[str, Any], path: Path, title: str = "") -> Figure:
    """Write the run's figure to ``path`` (.png or .svg), through a temporary file so a failed
    write leaves no half image; the figure.

    Raises:
        OrchestratorError: another suffix, or matplotlib missing, or the file not writable.
    """
    if path.suffix.lower() not in PLOT_FORMATS:
        raise OrchestratorError(f"cannot write a plot to {path}: its suffix is not one of "
                                f"{', '.join(PLOT_FORMATS)}", fix=f"name it {path.stem}.png "
                                f"or {path.stem}.svg")
    fig = figure(run, title)
    partial = path.with_name(f".{path.name}.partial")
    try:
        fig.savefig(partial, format=path.suffix.lower()[1:])
        partial.replace(path)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise OrchestratorError(f"cannot write the plot {path}: {exc.strerror or exc}",
                                fix="choose a path in a directory you can write") from None
    return fig


def _plot_colour(attempt: int) -> str:
    return PLOT_COLOURS[(attempt - 1) % len(PLOT_COLOURS)]

