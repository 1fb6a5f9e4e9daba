"""A run's figures in Prometheus' text format, served by the controller while 'train' runs
(``metrics.prometheus_port``) and written to a file for node_exporter's textfile collector
(``metrics.textfile``), so a team's dashboards and alerts can watch runs.

The figures come from the run's record (its attempts) and the chief's newest progress (the
history's newest point); they are rendered when asked, never kept apart from those. Every
series is labelled with the cluster and the run.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from orchestrator.files import write_atomic
from orchestrator.spec import Metrics
from orchestrator.state import AttemptRecord, Point

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TEXTFILE_EVERY_S = 5.0
PUBLIC_FILE = 0o644  # node_exporter, another user, reads it; it holds no secret


@dataclass(frozen=True)
class RunFigures:
    """What the exposition is made of, read at one moment."""

    cluster: str
    run_id: str
    running: bool
    attempt: int  # the attempt under way, or the last one
    total_steps: int | None
    newest: Point | None  # the chief's newest progress
    attempts: Sequence[AttemptRecord]


def exposition(figures: RunFigures) -> str:
    """The run's metrics in Prometheus' text exposition format (0.0.4)."""
    labels = {"cluster": figures.cluster, "run": figures.run_id}
    out: list[str] = []

    def family(name: str, kind: str, text: str,
               samples: Sequence[tuple[dict[str, str], float]]) -> None:
        out.append(f"# HELP {name} {text}")
        out.append(f"# TYPE {name} {kind}")
        out.extend(f"{name}{_labels({**labels, **extra})} {_value(value)}"
                   for extra, value in samples)

    newest = figures.newest
    family("orchestrate_run_running", "gauge", "1 while the run is being trained, else 0.",
           [({}, 1.0 if figures.running else 0.0)])
    family("orchestrate_attempt", "gauge", "The attempt under way (1 for the first).",
           [({}, float(figures.attempt))])
    if newest is not None:
        family("orchestrate_step", "gauge", "The chief's newest reported step.",
               [({}, float(newest.step))])
    if figures.total_steps is not None:
        family("orchestrate_total_steps", "gauge", "The steps the run trains in all.",
               [({}, float(figures.total_steps))])
    if newest is not None and newest.loss is not None:
        family("orchestrate_loss", "gauge", "The chief's newest loss (over the epoch so far).",
               [({}, newest.loss)])
    if newest is not None and newest.metrics:
        family("orchestrate_metric", "gauge", "The chief's newest value of each metric.",
               [({"name": name}, value) for name, value in sorted(newest.metrics.items())])
    if newest is not None and newest.steps_per_s is not None:
        family("orchestrate_steps_per_second", "gauge", "The chief's training speed.",
               [({}, newest.steps_per_s)])
    if newest is not None and newest.examples_per_s is not None:
        family("orchestrate_examples_per_second", "gauge", "Examples a second, all replicas.",
               [({}, newest.examples_per_s)])
    causes: dict[str, int] = {}
    for ended, _ in itertools.pairwise(figures.attempts):  # failed, and another began after
        if ended.cause:
            causes[ended.cause] = causes.get(ended.cause, 0) + 1
    family("orchestrate_restarts_total", "counter",
           "Restarts of the group, by the cause of the attempt that ended.",
           [({"cause": cause}, float(n)) for cause, n in sorted(causes.items())])
    recovered = [a for a in figures.attempts if a.recovery_s is not None]
    family("orchestrate_recoveries_total", "counter",
           "Recoveries: failures after which training was back.", [({}, float(len(recovered)))])
    family("orchestrate_recovery_seconds_total", "counter",
           "Seconds from each failure to the next attempt's first step, summed.",
           [({}, sum(a.recovery_s or 0.0 for a in recovered))])
    phases: dict[str, float] = {}
    for a in recovered:
        for phase, seconds in a.phases.items():
            phases[phase] = phases.get(phase, 0.0) + seconds
    family("orchestrate_recovery_phase_seconds_total", "counter",
           "The recoveries' seconds by phase (detect, stop, backoff, repair, checkpoint, "
           "launch, connect, first_step): they add up to the recovery seconds.",
           [({"phase": phase}, seconds) for phase, seconds in phases.items()])
    family("orchestrate_steps_redone_total", "counter",
           "Steps trained again after failures (those past the checkpoint resumed from).",
           [({}, float(sum(a.steps_lost or 0 for a in figures.attempts)))])
    return "\n".join(out) + "\n"


def _labels(labels: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{_escaped(v)}"' for k, v in labels.items()) + "}"


def _escaped(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _value(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


class Exporter:
    """Serves ``render()`` at /metrics on ``settings.bind:settings.prometheus_port`` and writes
    it to ``settings.textfile``, as the spec asks; neither ever stops a run: a port in use or a
    file that cannot be written is said once (``say``) and that output is left off."""

    def __init__(self, settings: Metrics, render: Callable[[], str],
                 say: Callable[[str], None], *, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.settings = settings
        self.render = render
        self.say = say
        self.clock = clock
        self._server: ThreadingHTTPServer | None = None
        self._written_at: float | None = None
        self._textfile_failed = False

    @property
    def url(self) -> str | None:
        """Where the endpoint serves, once started (None without one)."""
        if self._server is None:
            return None
        return f"http://{self.settings.bind}:{self._server.server_address[1]}/metrics"

    def start(self) -> None:
        port = self.settings.prometheus_port
        if port is not None:
            handler = type("Handler", (_Handler,), {"render": staticmethod(self.render)})
            try:
                self._server = ThreadingHTTPServer((self.settings.bind, port), handler)
            except OSError as exc:
                self.say(f"no Prometheus endpoint for this run: {self.settings.bind}:{port} "
                         f"cannot be bound ({exc.strerror or exc}); set metrics.prometheus_port "
                         "to a free port")
            else:
                self._server.daemon_threads = True
                threading.Thread(target=self._server.serve_forever, name="orchestrate-metrics",
                                 daemon=True).start()
        self.tick(force=True)

    def tick(self, *, force: bool = False) -> None:
        """Write the textfile if ``TEXTFILE_EVERY_S`` has passed (or ``force``)."""
        path = self.settings.textfile
        if path is None or self._textfile_failed:
            return
        now = self.clock()
        if not force and self._written_at is not None and \
                now - self._written_at < TEXTFILE_EVERY_S:
            return
        self._written_at = now
        try:
            write_atomic(Path(path), self.render(), mode=PUBLIC_FILE)
        except Exception as exc:  # a full disk, or the run's record unreadable: not the run's end
            self._textfile_failed = True
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            self.say(f"the metrics file {path} cannot be written ({why[:300]}): it is left off "
                     "for this run; make its directory writable")

    def close(self) -> None:
        """The last textfile (the run has ended), and the endpoint stopped."""
        self.tick(force=True)
        if self._server is not None:
            with contextlib.suppress(OSError):
                self._server.shutdown()
                self._server.server_close()
            self._server = None


class _Handler(BaseHTTPRequestHandler):
    render: Callable[[], str]

    def do_GET(self) -> None:
        if self.path.split("?", 1)[0] != "/metrics":
            self.send_error(404, "only /metrics is served here")
            return
        try:
            body = self.render().encode()
        except Exception as exc:  # the run's record unreadable now: this scrape fails, not the run
            self.send_error(500, f"{type(exc).__name__}: {str(exc)[:200]}")
            return
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        """Scrapes are not the run's news."""
