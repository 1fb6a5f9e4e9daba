"""A run's Prometheus metrics: the exposition as Prometheus' own parser reads it, the endpoint
and the textfile, and what a bad `metrics:` section gets. (A real run's metrics, scraped while
it trains and read from the textfile after a crash and a recovery: tests/test_no_step_lost.py.)"""

from __future__ import annotations

import math
import socket
import stat
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from helpers import free_port, prometheus_samples

from orchestrator import spec
from orchestrator.errors import SpecError
from orchestrator.metrics import Exporter, RunFigures, exposition
from orchestrator.spec import Metrics
from orchestrator.state import AttemptRecord, Point

GOOD = "name: m\nworkers: 2\njob: {command: python train.py}\n"


def attempt(number: int, **fields: object) -> AttemptRecord:
    base: dict[str, object] = dict(run_id="r", number=number, status="failed", started_at=0.0,
                                   ended_at=None, cause="", detail="", failed_task="",
                                   exit_code=None, resumed_from_step=None, last_step=None,
                                   first_step_at=None, tasks=[])
    return AttemptRecord(**{**base, **fields})


FIGURES = RunFigures(
    cluster="digits", run_id="20261129-030000-abcdef", running=True, attempt=3, total_steps=160,
    newest=Point(3, 120, 5.0, 0.25, 41.5, 2656.0, {"accuracy": 0.93, 'odd"name\n': 1.0}),
    attempts=[
        attempt(1, cause="crashed", recovery_s=10.0, steps_lost=4,
                phases={"detect": 0.5, "stop": 0.5, "connect": 9.0}),
        attempt(2, cause="preempted", recovery_s=20.0, steps_lost=0,
                phases={"detect": 2.0, "stop": 18.0}),
        attempt(3, status="running"),
    ])


def test_the_exposition_carries_progress_restarts_and_recovery_by_phase() -> None:
    got = prometheus_samples(exposition(FIGURES))
    assert got["orchestrate_run_running"] == 1.0
    assert got["orchestrate_attempt"] == 3.0
    assert got["orchestrate_step"] == 120.0 and got["orchestrate_total_steps"] == 160
    assert got["orchestrate_loss"] == 0.25
    assert got['orchestrate_metric{name="accuracy"}'] == 0.93
    assert got['orchestrate_metric{name="odd"name\n"}'] == 1.0  # escaped, read back
    assert got["orchestrate_steps_per_second"] == 41.5
    assert got["orchestrate_examples_per_second"] == 2656.0
    assert got['orchestrate_restarts_total{cause="crashed"}'] == 1.0
    assert got['orchestrate_restarts_total{cause="preempted"}'] == 1.0
    assert got["orchestrate_recoveries_total"] == 2.0
    assert got["orchestrate_recovery_seconds_total"] == 30.0
    assert {name: v for name, v in got.items()
            if name.startswith("orchestrate_recovery_phase_seconds_total")} == {
        f'orchestrate_recovery_phase_seconds_total{{phase="{phase}"}}': seconds
        for phase, seconds in (("detect", 2.5), ("stop", 18.5), ("connect", 9.0))}
    assert got["orchestrate_steps_redone_total"] == 4.0


def test_an_attempt_that_ended_the_run_is_no_restart() -> None:
    figures = RunFigures("digits", "20261129-030000-abcdef", False, 2, 160, None,
                         [attempt(1, cause="crashed"), attempt(2, cause="crashed")])
    got = prometheus_samples(exposition(figures))
    assert got['orchestrate_restarts_total{cause="crashed"}'] == 1.0
    assert got["orchestrate_run_running"] == 0.0


def test_before_the_first_step_only_the_runs_state_is_said() -> None:
    text = exposition(RunFigures("digits", "20261129-030000-abcdef", True, 1, None, None, []))
    names = set(prometheus_samples(text))
    assert names == {"orchestrate_run_running", "orchestrate_attempt",
                     "orchestrate_recoveries_total", "orchestrate_recovery_seconds_total",
                     "orchestrate_steps_redone_total"}
    diverged = Point(1, 3, 1.0, None, float("nan"), None, {})
    text = exposition(RunFigures("digits", "20261129-030000-abcdef", True, 1, 10, diverged, []))
    assert math.isnan(prometheus_samples(text)["orchestrate_steps_per_second"])
    assert "orchestrate_loss" not in prometheus_samples(text)


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_endpoint_serves_and_the_textfile_is_written_whole_and_readable(
        tmp_path: Path) -> None:
    textfile = tmp_path / "run.prom"
    figures = {"running": True}
    notes: list[str] = []
    clock = Clock()

    def render() -> str:
        return exposition(RunFigures("digits", "20261129-030000-abcdef", figures["running"], 1,
                                     None, None, []))

    exporter = Exporter(Metrics(prometheus_port=free_port(), textfile=str(textfile)), render,
                        notes.append, clock=clock)
    exporter.start()
    try:
        assert exporter.url is not None
        with urllib.request.urlopen(exporter.url, timeout=10) as answer:
            assert answer.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            assert prometheus_samples(answer.read().decode())["orchestrate_run_running"] == 1.0
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(exporter.url.replace("/metrics", "/"), timeout=10)
        assert missing.value.code == 404
        assert prometheus_samples(textfile.read_text())["orchestrate_run_running"] == 1.0
        assert stat.S_IMODE(textfile.stat().st_mode) == 0o644  # node_exporter reads it
        figures["running"] = False
        exporter.tick()  # within TEXTFILE_EVERY_S: not yet
        assert prometheus_samples(textfile.read_text())["orchestrate_run_running"] == 1.0
        clock.now += 6.0
        exporter.tick()
        assert prometheus_samples(textfile.read_text())["orchestrate_run_running"] == 0.0
    finally:
        exporter.close()
    assert exporter.url is None and notes == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.prom"]  # no temporary left


def test_a_port_in_use_or_an_unwritable_textfile_is_said_and_the_run_goes_on(
        tmp_path: Path) -> None:
    notes: list[str] = []
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        settings = Metrics(prometheus_port=port, textfile=str(tmp_path / "none" / "run.prom"))
        exporter = Exporter(settings, lambda: "", notes.append)
        exporter.start()
        exporter.tick(force=True)
        exporter.close()
    assert exporter.url is None and len(notes) == 2
    assert notes[0].startswith(f"no Prometheus endpoint for this run: 127.0.0.1:{port} cannot "
                               "be bound (Address already in use)")
    assert notes[1].startswith(f"the metrics file {tmp_path}/none/run.prom cannot be written "
                               "(No such file or directory)")


@pytest.mark.parametrize(("section", "says", "fix"), [
    ("{prometheus_port: 0}", "greater than or equal to 1", None),
    ("{bind: localhost}", "'localhost' is not an IP address", "127.0.0.1"),
    ("{textfile: /var/lib/node_exporter/run.txt}", "does not end in .prom", "NAME.prom"),
    ("{textfile: gs://bucket/run.prom}", "is a URL", "a path on this machine"),
    ("{textfile: run.prom}", "is relative", None),
    ("{port: 9100}", "port", None),
])
def test_a_bad_metrics_section_names_the_field_and_the_fix(section: str, says: str,
                                                           fix: str | None) -> None:
    with pytest.raises(SpecError) as info:
        spec.parse(GOOD + f"metrics: {section}\n", file="cluster.yaml")
    assert info.value.field.startswith("metrics") and says in str(info.value), str(info.value)
    assert info.value.line == 4
    if fix is not None:
        assert fix in (info.value.fix or "")
