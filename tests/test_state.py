"""The state store keeps clusters, runs and attempts across processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.errors import StateError
from orchestrator.paths import home
from orchestrator.state import Point, Store, TaskRecord


def test_home_follows_orchestrate_home(orchestrate_home: Path) -> None:
    assert home() == orchestrate_home


def test_runs_and_attempts_round_trip_through_a_second_connection() -> None:
    store = Store()
    store.put_cluster("c", provider="local", spec_path="/s.yaml", status="up",
                      hosts=[{"name": "local-0", "address": "127.0.0.1"}])
    run = store.new_run("c")
    task = TaskRecord(task="worker:0", host="local-0", endpoint="127.0.0.1:23456", pgid=42,
                      log="/l/worker-0.log", rc="/l/worker-0.rc", exit_code=137,
                      last_event="checkpoint", last_event_at=1.5, step=41, checkpoint_step=40)
    store.start_attempt(run, 1, [task])
    store.update_attempt(run, 1, status="failed", cause="crashed", failed_task="worker:1",
                         exit_code=137, last_step=45)
    store.start_attempt(run, 2, [])
    store.update_attempt(run, 2, status="succeeded", resumed_from_step=40)
    store.finish_run(run, status="succeeded", metrics={"loss": 0.1}, model_path="/m")

    again = Store()
    record = again.get_run(run)
    assert record.status == "succeeded" and record.metrics == {"loss": 0.1}
    assert [(a.number, a.cause, a.exit_code) for a in record.attempts] == [
        (1, "crashed", 137), (2, "", None)]
    assert record.attempts[0].tasks == [task]
    assert record.attempts[1].resumed_from_step == 40
    assert again.get_cluster("c") is not None and again.runs("c")[0].id == run


def test_unknown_run_is_a_state_error() -> None:
    with pytest.raises(StateError, match="no run 'nope'"):
        Store().get_run("nope")


def test_unknown_attempt_field_is_refused() -> None:
    store = Store()
    run = store.new_run("c")
    store.start_attempt(run, 1, [])
    with pytest.raises(ValueError, match="unknown attempt fields"):
        store.update_attempt(run, 1, colour="red")


def test_corrupt_store_gives_a_fix(orchestrate_home: Path) -> None:
    orchestrate_home.mkdir(parents=True)
    (orchestrate_home / "state.db").write_bytes(b"not a database" * 100)
    with pytest.raises(StateError, match="move the file aside"):
        Store()


def test_a_store_from_before_the_recovery_columns_is_migrated(orchestrate_home: Path) -> None:
    import sqlite3

    orchestrate_home.mkdir(parents=True)
    old = sqlite3.connect(orchestrate_home / "state.db")
    old.executescript(
        "CREATE TABLE runs (id TEXT PRIMARY KEY, cluster TEXT NOT NULL, status TEXT NOT NULL,"
        " started_at REAL NOT NULL, ended_at REAL, metrics_json TEXT NOT NULL DEFAULT '{}',"
        " model_path TEXT NOT NULL DEFAULT '', message TEXT NOT NULL DEFAULT '',"
        " controller_pid INTEGER);"
        "CREATE TABLE attempts (run_id TEXT NOT NULL, number INTEGER NOT NULL,"
        " status TEXT NOT NULL, started_at REAL NOT NULL, ended_at REAL,"
        " cause TEXT NOT NULL DEFAULT '', detail TEXT NOT NULL DEFAULT '',"
        " failed_task TEXT NOT NULL DEFAULT '', exit_code INTEGER, resumed_from_step INTEGER,"
        " last_step INTEGER, first_step_at REAL, tasks_json TEXT NOT NULL DEFAULT '[]',"
        " PRIMARY KEY (run_id, number));"
        "INSERT INTO runs (id, cluster, status, started_at) VALUES ('r0', 'c', 'succeeded', 1.0);"
        "INSERT INTO attempts (run_id, number, status, started_at) VALUES ('r0', 1, 'ok', 1.0);"
    )
    old.close()
    store = Store()
    record = store.get_run("r0")
    assert record.heartbeat_at is None and record.attempts[0].recovery_s is None
    store.update_attempt("r0", 1, recovery_s=2.5, steps_lost=3)
    assert store.attempts("r0")[0].recovery_s == 2.5
    store.change_points("r0", [Point(1, 10, 2.0, loss=0.5)])  # the history's table is added
    assert store.points("r0") == [Point(1, 10, 2.0, loss=0.5)]


def test_a_task_record_ignores_keys_it_does_not_know() -> None:
    stored = {"task": "worker:1", "host": "h", "endpoint": "h:1", "pgid": 7, "log": "l", "rc": "r",
              "exit_code": None, "from_a_newer_version": True}
    assert TaskRecord.from_json(stored) == TaskRecord("worker:1", "h", "h:1", 7, "l", "r")


def test_opening_the_store_again_keeps_this_processs_other_connections_working(
        orchestrate_home: Path) -> None:
    """A notebook's running 'train' has the store open when something in the same process opens
    it again, and then another process ('orchestrate down') opens and closes it. Opening must
    not read the file itself: closing that descriptor would drop every POSIX lock the process
    holds on the file, SQLite's too, and the other process, seeing no one else, would delete
    the WAL under the first connection (a 'disk I/O error' on its next write)."""
    first = Store()
    run_id = first.new_run("c")
    second = Store()
    other = subprocess.run([sys.executable, "-c", "from orchestrator.state import Store; "
                            "Store().runs('c'); print('ok')"], capture_output=True, text=True,
                           timeout=60, env={**os.environ, "ORCHESTRATE_HOME": str(orchestrate_home)})
    assert other.stdout.strip() == "ok", other.stderr
    first.heartbeat(run_id)  # a write through the first connection
    first.finish_run(run_id, status="stopped", message="by down")
    assert second.get_run(run_id).status == "stopped"
    assert Store().get_run(run_id).message == "by down"
