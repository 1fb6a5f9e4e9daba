"""A run's history: the chief's progress kept in the store, bounded and evenly thinned, and
drawn by `status` in the terminal and by `status --plot` as a PNG or SVG. (A real run's
history, with a killed chief, is drawn in tests/test_keras3_e2e.py.)"""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from helpers import REPO, png_size
from rich.console import Console

from orchestrator import charts
from orchestrator.api import Cluster, ClusterStatus, statuses
from orchestrator.errors import OrchestratorError, StateError
from orchestrator.events import Event
from orchestrator.history import History
from orchestrator.state import Point, Store


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def progress(step: int, loss: float = 1.0, rate: float = 10.0, at: float = 0.0) -> Event:
    return Event("progress", "worker:0", 1, at, {"step": step, "loss": loss,
                                                   "steps_per_s": rate, "examples_per_s": rate * 64,
                                                   "metrics": {"accuracy": 0.5}})


def recorded_run(store: Store, cluster: str = "demo") -> str:
    """A run of two attempts: attempt 1 reached step 30 and was lost at 16 s; attempt 2
    resumed from step 20 and trained from 25 s to step 60. Loss falls, speed is ~10 steps/s."""
    store.put_cluster(cluster, provider="local", spec_path=f"/specs/{cluster}.yaml", status="up")
    run = store.new_run(cluster)
    t0 = store.get_run(run).started_at
    store.start_attempt(run, 1, [])
    store.change_points(run, [Point(1, s, t0 + 1 + s / 2, 2 * math.exp(-s / 20), 10.0 + s % 3)
                              for s in range(1, 31)])
    store.update_attempt(run, 1, status="failed", cause="crashed", failed_task="worker:1",
                         ended_at=t0 + 17, failed_at=t0 + 16, last_step=30,
                         resumed_from_step=0, recovery_s=9.0, steps_lost=10)
    store.start_attempt(run, 2, [])
    store.change_points(run, [Point(2, s, t0 + 15 + s / 2, 2 * math.exp(-s / 20), 9.0 + s % 2)
                              for s in range(21, 61)])
    store.update_attempt(run, 2, status="succeeded", first_step_at=t0 + 25.5,
                         resumed_from_step=20, last_step=60)
    with store._tx() as db:  # when it began, as a real run's would be (no API sets it)
        db.execute("UPDATE attempts SET started_at = ? WHERE run_id = ? AND number = 2",
                   (t0 + 19, run))
    store.finish_run(run, status="succeeded")
    return run


def run_document(store: Store, run: str) -> dict:
    return next(r for c in statuses(store=store) for r in c.to_dict()["runs"] if r["id"] == run)


# -- the store -------------------------------------------------------------------------------
def test_points_round_trip_with_a_diverged_loss_kept_as_none() -> None:
    store = Store()
    run = store.new_run("c")
    store.change_points(run, [Point(1, 1, 5.0, float("nan"), 3.0, 96.0, {"acc": 0.25}),
                              Point(1, 2, 6.0, 0.5)])
    store.change_points(run, [Point(1, 2, 7.0, 9.9)])  # a step it has: kept as it was
    assert store.points(run) == [Point(1, 1, 5.0, None, 3.0, 96.0, {"acc": 0.25}),
                                 Point(1, 2, 6.0, 0.5)]
    store.change_points(run, [], drop=[(1, 1)])
    assert [p.key for p in store.points(run)] == [(1, 2)]
    store.delete_run(run)
    assert store.points(run) == []


def test_the_history_keeps_a_long_run_bounded_and_spread_evenly() -> None:
    store, clock = Store(), Clock()
    run = store.new_run("c")
    history = History(store, run, limit=100, clock=clock)
    for step in range(1, 1001):
        clock.now += 1.0
        history.add(1, progress(step))
    history.flush()
    steps = [p.step for p in store.points(run)]
    assert steps == [p.step for p in history.points]
    assert 50 <= len(steps) <= 100 and steps[0] == 1 and steps[-1] == 1000
    gaps = {b - a for a, b in itertools.pairwise(steps[:-1])}
    assert gaps == {history.stride}  # evenly: every stride-th step (and the newest)


def test_the_history_keeps_each_attempts_first_and_last_point_through_thinning() -> None:
    store, clock = Store(), Clock()
    run = store.new_run("c")
    history = History(store, run, limit=40, clock=clock)
    for attempt, steps in ((1, range(1, 38)), (2, range(30, 120))):
        for step in steps:
            clock.now += 1.0
            history.add(attempt, progress(step))
    history.flush()
    kept = store.points(run)
    ones = [p.step for p in kept if p.attempt == 1]
    twos = [p.step for p in kept if p.attempt == 2]
    assert ones[0] == 1 and ones[-1] == 37 and twos[0] == 30 and twos[-1] == 119
    assert len(kept) <= 40


def test_the_history_writes_every_few_seconds_and_ignores_a_step_read_again() -> None:
    store, clock = Store(), Clock()
    run = store.new_run("c")
    history = History(store, run, clock=clock)
    history.add(1, progress(1))
    assert store.points(run) == []  # not yet: one transaction every FLUSH_S
    clock.now += 6.0
    history.add(1, progress(2))
    assert [p.step for p in store.points(run)] == [1, 2]
    history.add(1, progress(2, loss=0.1))  # a log read again after a take-over
    clock.now += 6.0
    history.add(1, progress(3))
    assert [(p.step, p.loss) for p in store.points(run)] == [(1, 1.0), (2, 1.0), (3, 1.0)]
    again = History(store, run, clock=clock)  # a controller that takes over goes on from it
    assert [p.step for p in again.points] == [1, 2, 3]


def test_a_point_is_placed_when_the_chief_reported_it_unless_its_clock_is_off() -> None:
    store, clock = Store(), Clock()
    history = History(store, store.new_run("c"), clock=clock)
    clock.now = 1010.0  # this machine reads the chief's log in batches: two lines at once
    history.add(1, progress(1, at=1008.5))
    history.add(1, progress(2, at=1009.5))
    history.add(1, progress(3, at=5000.0))  # a host clock an hour off: when it was read
    history.add(1, progress(4, at=1009.9))  # before the previous point: read time too
    assert [p.at for p in history.points] == [1008.5, 1009.5, 1010.0, 1010.0]


# -- the terminal ----------------------------------------------------------------------------
def test_status_draws_the_newest_run_with_the_restart_marked() -> None:
    store = Store()
    run = recorded_run(store)
    console = Console(width=100, record=True, color_system=None)
    from orchestrator.console import render_status

    render_status(console, [c.to_dict() for c in statuses(store=store)])
    text = console.export_text()
    lines = text.splitlines()
    loss_rows = [i for i, line in enumerate(lines) if line.strip().startswith("loss")]
    assert len(loss_rows) == 1 and "2" in lines[loss_rows[0]]  # the highest loss, 1.9
    chart = lines[loss_rows[0]:]
    assert any(any(0x2800 < ord(ch) <= 0x28FF for ch in line) for line in chart)
    assert sum("┊" in line for line in chart) >= 6  # the restart's rule, down both charts
    assert any("attempt 2 at 19s, after crashed in worker:1, back in 9.0s, 10 step(s) "
               "redone" in line for line in chart)
    axis = next(i for i, line in enumerate(lines) if "└" in line)
    assert lines[axis + 1].split() == ["0s", "22s", "45s"]
    assert all(len(line) <= 100 for line in lines if "┤" in line or "└" in line)
    console = Console(width=100, record=True, color_system=None)
    render_status(console, [c.to_dict() for c in statuses(store=store)], charts=False)
    text = console.export_text()
    assert "┤" not in text and f"run {run} succeeded" in text


def test_a_run_without_progress_draws_nothing() -> None:
    store = Store()
    store.put_cluster("cmd", provider="local", spec_path="/s.yaml", status="up")
    run = store.new_run("cmd")
    document = run_document(store, run)
    assert document["history"] == [] and not charts.has_history(document)


def test_status_json_carries_the_history() -> None:
    store = Store()
    run = recorded_run(store)
    document = json.loads(json.dumps(run_document(store, run)))
    assert len(document["history"]) == 70
    assert document["history"][0] == {"attempt": 1, "step": 1, "at": pytest.approx(
        document["started_at"] + 1.5), "loss": pytest.approx(2 * math.exp(-1 / 20)),
        "steps_per_s": 11.0, "examples_per_s": None, "metrics": {}}


# -- an image --------------------------------------------------------------------------------
def test_the_plot_is_a_png_of_the_expected_size_and_an_svg(tmp_path: Path) -> None:
    store = Store()
    run = recorded_run(store)
    document = run_document(store, run)
    out = tmp_path / "plots"
    out.mkdir()
    png, svg = out / "run.png", out / "run.svg"
    charts.save_plot(document, png)
    assert png_size(png) == (1000, 600)
    charts.save_plot(document, svg)
    root = ET.parse(svg).getroot()
    assert root.tag.endswith("svg") and root.get("width") == "720pt"
    assert "attempt 2" in svg.read_text()
    assert sorted(p.name for p in out.iterdir()) == ["run.png", "run.svg"]  # nothing partial


def test_a_plot_to_another_suffix_or_without_matplotlib_says_what_to_do(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = Store()
    document = run_document(store, recorded_run(store))
    out = tmp_path / "plots"
    out.mkdir()
    with pytest.raises(OrchestratorError, match=r"\.png, \.svg") as caught:
        charts.save_plot(document, out / "run.jpg")
    assert caught.value.fix == "name it run.png or run.svg"
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # as if not installed
    with pytest.raises(OrchestratorError, match="needs matplotlib") as caught:
        charts.save_plot(document, out / "run.png")
    assert ".[plot]" in (caught.value.fix or "")
    assert not list(out.iterdir())


def test_the_api_draws_a_run_as_a_figure(tmp_path: Path) -> None:
    store = Store()
    run = recorded_run(store, "nb")
    spec = tmp_path / "nb.yaml"
    spec.write_text(f"name: nb\nworkdir: {REPO}\nworkers: 2\n"
                    "job: {module: tests.workloads.paced_digits}\n")
    cluster = Cluster.from_spec(spec, store=store)
    assert [p.key for p in cluster.history()][:2] == [(1, 1), (1, 2)]
    fig = cluster.plot(tmp_path / "nb.png")
    assert [ax.get_ylabel() for ax in fig.axes] == ["loss", "steps/s"]
    assert [[line.get_label() for line in ax.get_lines() if line.get_label()[0] != "_"]
            for ax in fig.axes] == [["attempt 1", "attempt 2"]] * 2  # one line an attempt
    assert png_size(tmp_path / "nb.png") == (1000, 600) and cluster.run().id == run


def cli(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", "status", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "ORCHESTRATE_HOME": str(home), "COLUMNS": "100"})


def test_status_plot_from_the_command_line(tmp_path: Path, orchestrate_home: Path) -> None:
    store = Store()
    run = recorded_run(store, "one")
    answer = cli(orchestrate_home, "--plot", str(tmp_path / "one.png"))
    assert answer.returncode == 0, answer.stderr
    assert answer.stdout.strip() == f"wrote {tmp_path / 'one.png'}"
    assert png_size(tmp_path / "one.png") == (1000, 600)
    recorded_run(store, "two")
    answer = cli(orchestrate_home, "--plot", str(tmp_path / "x.png"))
    assert answer.returncode != 0 and "several clusters have runs (one, two)" in answer.stderr
    assert "Traceback" not in answer.stderr
    answer = cli(orchestrate_home, "one", "--run", run, "--plot", str(tmp_path / "o.svg"))
    assert answer.returncode == 0 and (tmp_path / "o.svg").stat().st_size > 1000
    answer = cli(orchestrate_home, "one", "--run", "nope", "--plot", str(tmp_path / "n.png"))
    assert answer.returncode != 0 and "no run 'nope' of cluster 'one'" in answer.stderr
    answer = cli(orchestrate_home, "one", "--run", run)
    assert answer.returncode == 0 and answer.stdout.count("  run ") == 1 and "┤" in answer.stdout


def test_a_cluster_status_without_a_store_record_still_renders() -> None:
    document = ClusterStatus("gone", None, []).to_dict()
    assert document["runs"] == [] and document["status"] == "unknown"
    with pytest.raises(StateError, match="no cluster named 'nope'"):
        statuses("nope", store=Store())
