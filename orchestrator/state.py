"""SQLite store (stdlib sqlite3) of clusters, runs and attempts, under ORCHESTRATE_HOME."""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Any

from orchestrator.errors import StateError
from orchestrator.paths import state_db

SCHEMA = """
CREATE TABLE IF NOT EXISTS clusters (
    name TEXT PRIMARY KEY,
    provider TEXT NOT NULL,
    spec_path TEXT NOT NULL,
    status TEXT NOT NULL,
    hosts_json TEXT NOT NULL DEFAULT '[]',
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS runs (
    id TEXT PRIMARY KEY,
    cluster TEXT NOT NULL,
    status TEXT NOT NULL,
    started_at REAL NOT NULL,
    ended_at REAL,
    metrics_json TEXT NOT NULL DEFAULT '{}',
    model_path TEXT NOT NULL DEFAULT '',
    message TEXT NOT NULL DEFAULT '',
    controller_pid INTEGER,
    heartbeat_at REAL,
    warm_json TEXT NOT NULL DEFAULT '[]'
);
CREATE INDEX IF NOT EXISTS runs_by_cluster ON runs (cluster, started_at);
CREATE TABLE IF NOT EXISTS attempts (
    run_id TEXT NOT NULL REFERENCES runs (id),
    number INTEGER NOT NULL,
    status TEXT NOT NULL,
    started_at REAL NOT NULL,
    ended_at REAL,
    cause TEXT NOT NULL DEFAULT '',
    detail TEXT NOT NULL DEFAULT '',
    failed_task TEXT NOT NULL DEFAULT '',
    exit_code INTEGER,
    resumed_from_step INTEGER,
    last_step INTEGER,
    first_step_at REAL,
    tasks_json TEXT NOT NULL DEFAULT '[]',
    evidence TEXT NOT NULL DEFAULT '',
    failed_at REAL,
    detected_at REAL,
    recovery_s REAL,
    steps_lost INTEGER,
    phases_json TEXT NOT NULL DEFAULT '{}',
    PRIMARY KEY (run_id, number)
);
"""

# Columns added after the first release: (table, column, declaration). Older stores get them.
MIGRATIONS = (
    ("runs", "heartbeat_at", "REAL"),
    ("runs", "warm_json", "TEXT NOT NULL DEFAULT '[]'"),
    ("attempts", "evidence", "TEXT NOT NULL DEFAULT ''"),
    ("attempts", "failed_at", "REAL"),
    ("attempts", "detected_at", "REAL"),
    ("attempts", "recovery_s", "REAL"),
    ("attempts", "steps_lost", "INTEGER"),
    ("attempts", "phases_json", "TEXT NOT NULL DEFAULT '{}'"),
)


@dataclass(frozen=True)
class ClusterRecord:
    name: str
    provider: str
    spec_path: str
    status: str
    hosts: list[dict[str, Any]]
    created_at: float
    updated_at: float


@dataclass(frozen=True)
class TaskRecord:
    """One task of an attempt as the store keeps it: enough to find, read and stop it later,
    and the last event it printed (the chief's last checkpoint, the step a killed task reached)."""

    task: str
    host: str
    endpoint: str
    pgid: int
    log: str
    rc: str
    launcher: str = "process"
    exit_code: int | None = None
    last_event: str = ""  # the kind of the last event it printed
    last_event_at: float | None = None
    step: int | None = None  # the last step it reported
    checkpoint_step: int | None = None  # the step of the last checkpoint it reported

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TaskRecord:
        """From its stored form; keys this version does not know are ignored."""
        known = {f.name for f in dataclass_fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class AttemptRecord:
    run_id: str
    number: int
    status: str
    started_at: float
    ended_at: float | None
    cause: str
    detail: str
    failed_task: str
    exit_code: int | None
    resumed_from_step: int | None
    last_step: int | None
    first_step_at: float | None
    tasks: list[TaskRecord]
    evidence: str = ""
    failed_at: float | None = None
    detected_at: float | None = None
    recovery_s: float | None = None
    steps_lost: int | None = None
    # Where the recovery from this attempt's failure went, in seconds per phase (see
    # ``supervisor.RECOVERY_PHASES``); they add up to ``recovery_s``.
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def detect_s(self) -> float | None:
        """Seconds from the failure to its detection."""
        if self.failed_at is None or self.detected_at is None:
            return None
        return max(0.0, self.detected_at - self.failed_at)


@dataclass(frozen=True)
class RunRecord:
    id: str
    cluster: str
    status: str
    started_at: float
    ended_at: float | None
    metrics: dict[str, float]
    model_path: str
    message: str
    controller_pid: int | None
    attempts: list[AttemptRecord] = field(default_factory=list)
    heartbeat_at: float | None = None
    # The next attempt's warm tasks (started, waiting for a go), for 'down' and '--attach'.
    warm: list[TaskRecord] = field(default_factory=list)


class Store:
    """One SQLite file; every write is one transaction, so a crash never leaves half a record."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or state_db()
        self._lock = threading.RLock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = sqlite3.connect(self.path, timeout=30, isolation_level=None,
                                       check_same_thread=False)
            self._db.row_factory = sqlite3.Row
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(SCHEMA)
            self._migrate()
        except sqlite3.DatabaseError as exc:
            raise StateError(
                f"cannot open the state store {self.path}: {exc}",
                fix="move the file aside (it is re-created empty) or set ORCHESTRATE_HOME",
            ) from None

    def close(self) -> None:
        self._db.close()

    def _migrate(self) -> None:
        for table, column, decl in MIGRATIONS:
            have = {row["name"] for row in self._db.execute(f"PRAGMA table_info({table})")}
            if column not in have:
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        # One connection serves the supervisor's threads (the watch loop, the warm tasks'
        # starter): one transaction at a time.
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    # -- clusters ----------------------------------------------------------------
    def put_cluster(
        self, name: str, *, provider: str, spec_path: str, status: str,
        hosts: list[dict[str, Any]] | None = None,
    ) -> None:
        now = time.time()
        with self._tx() as db:
            db.execute(
                "INSERT INTO clusters (name, provider, spec_path, status, hosts_json, created_at,"
                " updated_at) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (name) DO UPDATE SET"
                " provider=excluded.provider, spec_path=excluded.spec_path,"
                " status=excluded.status, hosts_json=excluded.hosts_json,"
                " updated_at=excluded.updated_at",
                (name, provider, spec_path, status, json.dumps(hosts or []), now, now),
            )

    def get_cluster(self, name: str) -> ClusterRecord | None:
        row = self._one("SELECT * FROM clusters WHERE name = ?", (name,))
        return _cluster(row) if row else None

    def clusters(self) -> list[ClusterRecord]:
        rows = self._all("SELECT * FROM clusters ORDER BY name", ())
        return [_cluster(r) for r in rows]

    def delete_cluster(self, name: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM clusters WHERE name = ?", (name,))

    # -- runs --------------------------------------------------------------------
    def new_run(self, cluster: str) -> str:
        run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]
        with self._tx() as db:
            db.execute(
                "INSERT INTO runs (id, cluster, status, started_at, controller_pid)"
                " VALUES (?, ?, 'running', ?, ?)",
                (run_id, cluster, time.time(), os.getpid()),
            )
        return run_id

    def reopen_run(self, run_id: str) -> None:
        """Mark an ended run running again, supervised by this process (``train --resume``)."""
        with self._tx() as db:
            db.execute(
                "UPDATE runs SET status='running', ended_at=NULL, message='', controller_pid=?"
                " WHERE id=?", (os.getpid(), run_id))

    def finish_run(
        self, run_id: str, *, status: str, message: str = "",
        metrics: dict[str, float] | None = None, model_path: str = "",
    ) -> None:
        with self._tx() as db:
            db.execute(
                "UPDATE runs SET status=?, ended_at=?, message=?, metrics_json=?, model_path=?"
                " WHERE id=?",
                (status, time.time(), message, json.dumps(metrics or {}), model_path, run_id),
            )

    def heartbeat(self, run_id: str) -> None:
        """The supervising controller is alive; ``train --attach`` refuses while this is fresh."""
        with self._tx() as db:
            db.execute("UPDATE runs SET heartbeat_at = ?, controller_pid = ? WHERE id = ?",
                       (time.time(), os.getpid(), run_id))

    def set_warm(self, run_id: str, tasks: list[TaskRecord]) -> None:
        """The run's warm tasks now (none once they were told to go or stopped)."""
        with self._tx() as db:
            db.execute("UPDATE runs SET warm_json = ? WHERE id = ?", (_tasks_json(tasks), run_id))

    def run_status(self, run_id: str) -> str:
        row = self._one("SELECT status FROM runs WHERE id = ?", (run_id,))
        return str(row["status"]) if row else "unknown"

    def get_run(self, run_id: str) -> RunRecord:
        row = self._one("SELECT * FROM runs WHERE id = ?", (run_id,))
        if row is None:
            raise StateError(f"no run {run_id!r} in {self.path}",
                             fix="list runs with 'orchestrate status'")
        return _run(row, self.attempts(run_id))

    def runs(self, cluster: str | None = None, limit: int = 20) -> list[RunRecord]:
        sql = "SELECT * FROM runs" + (" WHERE cluster = ?" if cluster else "")
        sql += " ORDER BY started_at DESC LIMIT ?"
        args: tuple[Any, ...] = (cluster, limit) if cluster else (limit,)
        return [_run(r, self.attempts(r["id"])) for r in self._all(sql, args)]

    # -- attempts ----------------------------------------------------------------
    def start_attempt(self, run_id: str, number: int, tasks: list[TaskRecord]) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT INTO attempts (run_id, number, status, started_at, tasks_json)"
                " VALUES (?, ?, 'running', ?, ?)",
                (run_id, number, time.time(), _tasks_json(tasks)),
            )

    def update_attempt(self, run_id: str, number: int, **fields: Any) -> None:
        allowed = {"status", "ended_at", "cause", "detail", "failed_task", "exit_code",
                   "resumed_from_step", "last_step", "first_step_at", "tasks", "evidence",
                   "failed_at", "detected_at", "recovery_s", "steps_lost", "phases"}
        unknown = set(fields) - allowed
        if unknown:
            raise ValueError(f"unknown attempt fields {sorted(unknown)}")
        if "tasks" in fields:
            fields["tasks_json"] = _tasks_json(fields.pop("tasks"))
        if "phases" in fields:
            fields["phases_json"] = json.dumps(fields.pop("phases"))
        cols = ", ".join(f"{k} = ?" for k in fields)
        with self._tx() as db:
            db.execute(
                f"UPDATE attempts SET {cols} WHERE run_id = ? AND number = ?",
                (*fields.values(), run_id, number),
            )

    def attempts(self, run_id: str) -> list[AttemptRecord]:
        rows = self._all("SELECT * FROM attempts WHERE run_id = ? ORDER BY number", (run_id,))
        return [_attempt(r) for r in rows]

    def _one(self, sql: str, args: tuple[Any, ...]) -> sqlite3.Row | None:
        with self._lock:
            row: sqlite3.Row | None = self._db.execute(sql, args).fetchone()
            return row

    def _all(self, sql: str, args: tuple[Any, ...]) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()


def _cluster(row: sqlite3.Row) -> ClusterRecord:
    return ClusterRecord(
        name=row["name"], provider=row["provider"], spec_path=row["spec_path"],
        status=row["status"], hosts=json.loads(row["hosts_json"]),
        created_at=row["created_at"], updated_at=row["updated_at"],
    )


def _run(row: sqlite3.Row, attempts: list[AttemptRecord]) -> RunRecord:
    return RunRecord(
        id=row["id"], cluster=row["cluster"], status=row["status"],
        started_at=row["started_at"], ended_at=row["ended_at"],
        metrics=json.loads(row["metrics_json"]), model_path=row["model_path"],
        message=row["message"], controller_pid=row["controller_pid"], attempts=attempts,
        heartbeat_at=row["heartbeat_at"],
        warm=[TaskRecord.from_json(t) for t in json.loads(row["warm_json"] or "[]")],
    )


def _attempt(row: sqlite3.Row) -> AttemptRecord:
    return AttemptRecord(
        run_id=row["run_id"], number=row["number"], status=row["status"],
        started_at=row["started_at"], ended_at=row["ended_at"], cause=row["cause"],
        detail=row["detail"], failed_task=row["failed_task"], exit_code=row["exit_code"],
        resumed_from_step=row["resumed_from_step"], last_step=row["last_step"],
        first_step_at=row["first_step_at"],
        tasks=[TaskRecord.from_json(t) for t in json.loads(row["tasks_json"])],
        evidence=row["evidence"], failed_at=row["failed_at"], detected_at=row["detected_at"],
        recovery_s=row["recovery_s"], steps_lost=row["steps_lost"],
        phases=json.loads(row["phases_json"] or "{}"),
    )


def _tasks_json(tasks: list[TaskRecord]) -> str:
    return json.dumps([t.to_json() for t in tasks])
