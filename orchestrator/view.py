"""The view model of a run: what every display (terminal, notebook, plain lines) and the API's
callers see of it, updated by the supervisor as events arrive. Displays import only this."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from orchestrator.events import BadEventNotes, Event
from orchestrator.state import AttemptRecord


@dataclass
class TaskView:
    """What the operator sees of one task; updated as events arrive."""

    key: str
    host: str
    endpoint: str
    state: str = "starting"
    step: int = 0
    loss: float | None = None
    steps_per_s: float | None = None
    last_event: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    replicas: int | None = None  # this task's own (one per GPU it uses), once it connected
    waiting: str = ""  # why it has not started, as its scheduler says ("" when nothing says)


@dataclass
class RunView:
    run_id: str
    cluster: str
    attempt: int = 0
    total_steps: int | None = None
    tasks: dict[str, TaskView] = field(default_factory=dict)
    messages: list[str] = field(default_factory=list)
    mirrored_step: int | None = None  # newest chief checkpoint copied to this machine
    mirroring_step: int | None = None  # the chief checkpoint being copied now, if any
    # Checkpoint bytes moved so far: "through_controller" (this machine's copy, pulled and
    # pushed back) and "host_to_host" (the chief's checkpoint given to the other hosts).
    checkpoint_bytes: dict[str, int] = field(
        default_factory=lambda: {"through_controller": 0, "host_to_host": 0})
    # As the tasks report them once connected (None until then, and for command jobs): the
    # replicas in sync, the collectives, and the global batch and learning rate they train with.
    replicas: int | None = None
    collectives: str | None = None
    global_batch_size: int | None = None
    learning_rate: float | None = None
    # The tasks' bad event lines noted so far (in ``messages``: once per kind, a few in all).
    bad_events: BadEventNotes = field(default_factory=BadEventNotes, repr=False, compare=False)


Listener = Callable[[RunView, Event | None], None]


class SafeListener:
    """A listener whose errors never end a run (a display, or a user's callback).

    Its first error is reported once, in plain text on stderr, with the listener's name; it
    is still called after (a display may fail on one event and not on the next). A Ctrl-C
    (KeyboardInterrupt) or an exit in it is not an error of the listener: it goes on up.
    """

    def __init__(self, listener: Listener) -> None:
        self.listener = listener
        self.failed = False

    def __call__(self, view: RunView, event: Event | None) -> None:
        try:
            self.listener(view, event)
        except Exception as exc:
            if self.failed:
                return
            self.failed = True
            sys.stderr.write(f"orchestrate: the listener {listener_name(self.listener)} raised "
                             f"{type(exc).__name__}: {str(exc)[:500]}; the run goes on (its "
                             "later errors are not reported)\n")
            sys.stderr.flush()


def safe(listener: Listener) -> SafeListener:
    """``listener``, guarded (once: a guarded listener is returned as it is)."""
    return listener if isinstance(listener, SafeListener) else SafeListener(listener)


def listener_name(listener: Callable[..., object]) -> str:
    """How a report names a listener: a function's qualified name, else its class's."""
    name = getattr(listener, "__qualname__", None) or type(listener).__qualname__
    module = getattr(listener, "__module__", None) or type(listener).__module__
    return f"{module}.{name}" if module and module != "builtins" else str(name)


@dataclass(frozen=True)
class RunResult:
    run_id: str
    status: str
    metrics: dict[str, float]
    model_path: str
    digests: dict[str, str]
    attempts: list[AttemptRecord]
    seconds: float
    checkpoint_bytes: dict[str, int] = field(default_factory=dict)  # as in RunView


def human_bytes(count: float) -> str:
    """A size for people: 1.5 GiB."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    power = 0
    while count >= 1024 and power < len(units) - 1:
        count, power = count / 1024, power + 1
    return f"{count:.0f} B" if power == 0 else f"{count:.1f} {units[power]}"


def describe_phases(phases: dict[str, float]) -> str:
    """A recovery's phases for people: "detect 0.5s, stop 0.1s, ..."."""
    return ", ".join(f"{name.replace('_', ' ')} {seconds:.1f}s" for name, seconds in
                     phases.items())
