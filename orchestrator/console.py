"""How a run looks to the operator: a live rich table on a terminal, plain lines otherwise."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from orchestrator.events import Event
from orchestrator.supervisor import RunResult, RunView


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


class PlainProgress:
    """One line per notable event; progress at most every ``every_s`` seconds per run."""

    def __init__(self, console: Console, every_s: float = 2.0) -> None:
        self.console = console
        self.every_s = every_s
        self._last = 0.0
        self._said = 0

    def __call__(self, view: RunView, event: Event | None) -> None:
        for message in view.messages[self._said :]:
            self.console.print(f"[{view.cluster}] {message}", markup=False, highlight=False)
        self._said = len(view.messages)
        if event is None:
            return
        if event.kind == "progress" and event.task == _chief(view):
            now = time.monotonic()
            if now - self._last >= self.every_s or event.get("step") == view.total_steps:
                self._last = now
                self.console.print(_progress_line(view, event), markup=False, highlight=False)
        elif event.kind in ("checkpoint", "resumed", "error"):
            self.console.print(f"[{event.task}] {event.kind}: {_event_text(event)}",
                               markup=False, highlight=False)


class LiveProgress:
    """A table with one row per task and an overall bar with ETA, redrawn in place."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.bar = Progress(
            TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(), TimeRemainingColumn(), console=console,
        )
        self._bar_id = self.bar.add_task("steps", total=None)
        self.live = Live(console=console, refresh_per_second=4, transient=False)
        self._view: RunView | None = None

    def __enter__(self) -> LiveProgress:
        self.live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.live.__exit__(*exc)

    def __call__(self, view: RunView, event: Event | None) -> None:
        self._view = view
        steps = max((t.step for t in view.tasks.values()), default=0)
        self.bar.update(self._bar_id, completed=steps, total=view.total_steps,
                        description=f"attempt {view.attempt}")
        self.live.update(Group(self._table(view), self.bar, *view.messages[-4:]))

    def _table(self, view: RunView) -> Table:
        table = Table(title=f"{view.cluster}  run {view.run_id}", expand=False)
        for column in ("task", "address", "state", "step", "loss", "steps/s", "last event"):
            table.add_column(column, justify="right" if column in ("step", "loss", "steps/s")
                             else "left")
        for t in view.tasks.values():
            table.add_row(t.key, t.endpoint, t.state, str(t.step), _fmt(t.loss, ".4f"),
                          _fmt(t.steps_per_s, ".1f"), t.last_event)
        return table


def summary(console: Console, result: RunResult) -> None:
    restarts = len(result.attempts) - 1
    console.print(f"[bold green]run {result.run_id} succeeded[/] in {result.seconds:.1f}s, "
                  f"{len(result.attempts)} attempt(s), {restarts} restart(s)")
    for a in result.attempts:
        if a.cause:
            console.print(f"  attempt {a.number}: {a.cause} in {a.failed_task}: {a.detail}",
                          markup=False, highlight=False)
        else:
            console.print(f"  attempt {a.number}: {a.status}, started at step "
                          f"{a.resumed_from_step or 0}", highlight=False)
    for name, value in result.metrics.items():
        console.print(f"  final {name}: {value:.4f}")
    if result.model_path:
        console.print(f"  model saved by the chief: {result.model_path}",
                      markup=False, highlight=False, soft_wrap=True)


def _chief(view: RunView) -> str:
    return next(iter(view.tasks), "")


def _progress_line(view: RunView, event: Event) -> str:
    metrics = " ".join(f"{k}={v:.4f}" for k, v in (event.get("metrics") or {}).items())
    return (f"[{event.task}] step {event.get('step')}/{view.total_steps} "
            f"loss={event.get('loss', 0.0):.4f} {metrics} "
            f"{event.get('steps_per_s', 0.0):.1f} steps/s "
            f"{event.get('examples_per_s', 0.0):.0f} examples/s").replace("  ", " ")


def _event_text(event: Event) -> str:
    if event.kind == "error":
        return f"{event.get('type', '')}: {event.get('message', '')}"
    return f"step {event.get('step')}"
