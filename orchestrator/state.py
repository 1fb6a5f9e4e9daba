"""SQLite store (stdlib sqlite3) of clusters, runs and attempts, under ORCHESTRATE_HOME."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sqlite3
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Any

from orchestrator.errors import StateError
from orchestrator.files import PRIVATE_DIR, private, private_dir, sync_dir_entry
from orchestrator.paths import CLUSTERS, state_db

SCHEMA_VERSION = 1  # PRAGMA user_version; a store of a higher one is a newer orchestrate's
BUSY_TIMEOUT_S = 10.0  # how long a command waits for a store another process has locked
UNREADABLE = "unreadable"  # the status of a record whose JSON columns do not decode
_WRITABLE_FIX = ("make {0} a directory you can write (chmod u+rwx), or set ORCHESTRATE_HOME to "
                 "one")

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
    warm_json TEXT NOT NULL DEFAULT '[]',
    price_json TEXT NOT NULL DEFAULT '{}'
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
    snapshot_step INTEGER,
    snapshot TEXT NOT NULL DEFAULT '',
    resized TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (run_id, number)
);
CREATE TABLE IF NOT EXISTS points (
    run_id TEXT NOT NULL REFERENCES runs (id),
    attempt INTEGER NOT NULL,
    step INTEGER NOT NULL,
    at REAL NOT NULL,
    loss REAL,
    steps_per_s REAL,
    examples_per_s REAL,
    metrics_json TEXT NOT NULL DEFAULT '{}',
    PRIMARY KEY (run_id, attempt, step)
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
    ("attempts", "snapshot_step", "INTEGER"),
    ("attempts", "snapshot", "TEXT NOT NULL DEFAULT ''"),
    ("runs", "price_json", "TEXT NOT NULL DEFAULT '{}'"),
    ("attempts", "resized", "TEXT NOT NULL DEFAULT ''"),
)


def _statements(script: str) -> list[str]:
    return [s.strip() for s in script.split(";") if s.strip()]


def _base_columns() -> dict[str, tuple[str, ...]]:
    """Each table's columns of the first release: a table of that name without them is not ours."""
    db = sqlite3.connect(":memory:")
    try:
        db.executescript(SCHEMA)
        added = {(t, c) for t, c, _ in MIGRATIONS}
        return {t: tuple(r[1] for r in db.execute(f"PRAGMA table_info({t})") if (t, r[1]) not in added)
                for t in ("clusters", "runs", "attempts", "points")}
    finally:
        db.close()


BASE_COLUMNS = _base_columns()


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
    # After a crash: the step of the survivor's snapshot the next attempt resumes from (None:
    # none was saved), and who saved it or why none was (retry.snapshot_on_crash).
    snapshot_step: int | None = None
    snapshot: str = ""
    # An elastic group on fewer workers than the spec's: how many, and why ("" at full size).
    resized: str = ""

    @property
    def detect_s(self) -> float | None:
        """Seconds from the failure to its detection."""
        if self.failed_at is None or self.detected_at is None:
            return None
        return max(0.0, self.detected_at - self.failed_at)


@dataclass(frozen=True)
class Point:
    """The chief's progress at one step of one attempt: one point of the run's history. ``at``
    is when the chief reported it, on the attempts' time axis (``history.History`` says
    whose clock)."""

    attempt: int
    step: int
    at: float
    loss: float | None = None
    steps_per_s: float | None = None
    examples_per_s: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def key(self) -> tuple[int, int]:
        return self.attempt, self.step


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
    # The cluster's price an hour as the run began (``cost.Price.to_json``; {} when unknown).
    price: dict[str, Any] = field(default_factory=dict)


class Store:
    """One SQLite file; every write is one transaction, so a crash never leaves half a record.

    A file that is not this store (another program's database, a newer orchestrate's, a
    damaged one) is refused before anything is written to it; a store another process keeps
    locked is waited for ``busy_timeout_s`` at most. Every failure is a StateError naming the
    file and the fix.
    """

    def __init__(self, path: Path | None = None, *,
                 busy_timeout_s: float = BUSY_TIMEOUT_S) -> None:
        self.path = path or state_db()
        self.busy_timeout_s = busy_timeout_s
        self._lock = threading.RLock()
        self._home()
        with self._translated():
            self._check_file()
            self._create_if_missing()
            self._db = sqlite3.connect(self.path, timeout=busy_timeout_s, isolation_level=None,
                                       check_same_thread=False)
            self._db.row_factory = sqlite3.Row
            try:
                self._upgrade(self._check_schema())
            except BaseException:
                self._db.close()
                raise
        for suffix in ("", "-wal", "-shm", "-journal"):
            private(Path(f"{self.path}{suffix}"))

    def close(self) -> None:
        self._db.close()

    # -- opening the file ---------------------------------------------------------
    def _home(self) -> None:
        """The store's directory, 0700 (and ``clusters/`` beside it, where it exists: the
        providers make it, 0700 too)."""
        directory = self.path.parent
        try:
            private_dir(directory)
            private(directory / CLUSTERS, PRIVATE_DIR)
        except OSError as exc:
            blocker = next((p for p in (directory, *directory.parents)
                            if p.exists() and not p.is_dir()), None)
            if blocker is not None:
                what = (f"the orchestrate home {directory}" if blocker == directory else
                        f"cannot make the orchestrate home {directory}: {blocker}")
                raise StateError(f"{what} is a file, not a directory",
                                 fix=f"move {blocker} aside, or set ORCHESTRATE_HOME to a "
                                 "directory (it is made if missing)") from None
            raise StateError(f"cannot make or enter the orchestrate home {directory}: "
                             f"{exc.strerror or exc}",
                             fix=_WRITABLE_FIX.format(directory)) from None

    def _check_file(self) -> None:
        """Refuse what SQLite would take for a new database and write to (a directory, a
        device, an empty file), by its metadata alone. The file itself is never opened here:
        closing any descriptor of a file drops every POSIX lock this process holds on it, the
        locks of the SQLite connections this process has open to it too (the store of a
        running 'train' in a notebook, say), which SQLite then reports as a disk I/O error. A
        file that is not SQLite is refused by SQLite's own first read ('not a database')."""
        if not self.path.exists():
            return
        if not self.path.is_file():
            raise self._foreign("it is not a regular file")
        if self.path.stat().st_size == 0:
            raise self._foreign("it is an empty file")

    def _create_if_missing(self) -> None:
        """A new store is made whole under a temporary name (0600, schema in place) and then
        linked into place, so no other process ever sees a half-made one."""
        if self.path.exists():
            return
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        os.close(fd)
        try:
            db = sqlite3.connect(tmp, isolation_level=None)
            try:
                db.execute("PRAGMA journal_mode=WAL")
                db.execute("BEGIN IMMEDIATE")
                for statement in _statements(SCHEMA):
                    db.execute(statement)
                db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                db.execute("COMMIT")
            finally:
                db.close()
            try:
                os.link(tmp, self.path)  # fails if another process made one meanwhile: kept
            except FileExistsError:
                pass
            except OSError:  # a file system without hard links
                if not self.path.exists():
                    os.replace(tmp, self.path)
            sync_dir_entry(self.path.parent)
        finally:
            for suffix in ("", "-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp + suffix)

    def _check_schema(self) -> set[str]:
        """Read (never write) what the file holds; return the tables of ours it has.

        Raises:
            StateError: a newer store version, another program's tables, or a table of ours
                without the columns every version had.
        """
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise StateError(
                f"the state store {self.path} was written by a newer orchestrate (store version "
                f"{version}; this one reads up to {SCHEMA_VERSION}); it was left as it is",
                fix="use that newer orchestrate, or set ORCHESTRATE_HOME to another directory "
                "for this one")
        tables = {row[0] for row in self._db.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table'")}
        ours = tables & set(BASE_COLUMNS)
        if tables and not ours:
            raise self._foreign(f"it is another program's database (tables: "
                                f"{', '.join(sorted(tables)[:8])})")
        for table in sorted(ours):
            have = self._columns(table)
            missing = [c for c in BASE_COLUMNS[table] if c not in have]
            if missing:
                raise self._foreign(f"its table {table} lacks the columns {', '.join(missing)}")
        return ours

    def _upgrade(self, ours: set[str]) -> None:
        """Add what an older store lacks (tables, then columns), in one transaction; nothing
        when it is current."""
        missing = [(t, c, d) for t, c, d in MIGRATIONS if t in ours and c not in self._columns(t)]
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if ours == set(BASE_COLUMNS) and not missing and version == SCHEMA_VERSION:
            return
        with self._tx() as db:
            for statement in _statements(SCHEMA):
                db.execute(statement)
            for table, column, decl in missing:
                db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        if self._db.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
            self._db.execute("PRAGMA journal_mode=WAL")

    def _columns(self, table: str) -> set[str]:
        return {row["name"] for row in self._db.execute(f"PRAGMA table_info({table})")}

    def _foreign(self, why: str) -> StateError:
        return StateError(
            f"{self.path} is not an orchestrate state store: {why}; it was left as it is",
            fix=f"move the file aside (mv {self.path} {self.path}.bad): the next command starts "
            "a new, empty store; or set ORCHESTRATE_HOME to another directory")

    @contextmanager
    def _translated(self) -> Iterator[None]:
        """SQLite's and the file system's errors as a StateError naming the file and the fix."""
        try:
            yield
        except (sqlite3.IntegrityError, sqlite3.ProgrammingError, sqlite3.InterfaceError):
            raise  # a mistake of this program's, not of the file
        except sqlite3.Error as exc:
            raise self._sqlite_error(exc) from None
        except OSError as exc:
            raise StateError(f"cannot use the state store {self.path}: {exc.strerror or exc}",
                             fix=_WRITABLE_FIX.format(self.path.parent)) from None

    def _sqlite_error(self, exc: sqlite3.Error) -> StateError:
        text = str(exc)
        name = getattr(exc, "sqlite_errorname", "")  # the extended code (Python 3.11+)
        if name and "disk I/O" in text:
            text += f" ({name})"  # which I/O failed: SQLITE_IOERR_SHMMAP, _SHORT_READ, ...
        if "locked" in text or "busy" in text:
            return StateError(
                f"another orchestrate is using {self.path}: it stayed locked for "
                f"{self.busy_timeout_s:g}s ({text})",
                fix="wait for that command to finish, then run this one again; if none is "
                f"running, a stuck process holds the file: find it with 'fuser {self.path}'")
        if "disk I/O" in text:
            return StateError(
                f"cannot read or write the state store {self.path}: {text}",
                fix="run the command again; if it comes back, check the disk, and that nothing "
                "but orchestrate opens the files of " + f"{self.path.parent} (a program that "
                "reads state.db while a run writes it drops the run's SQLite locks)")
        if any(word in text for word in ("readonly", "read-only", "unable to open")):
            return StateError(f"cannot write the state store {self.path}: {text}",
                              fix=_WRITABLE_FIX.format(self.path.parent))
        if "not a database" in text:
            return self._foreign("it is not an SQLite database")
        return self._foreign(text)

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        # One connection serves the supervisor's threads (the watch loop, the warm tasks'
        # starter): one transaction at a time.
        with self._lock, self._translated():
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
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
    def new_run(self, cluster: str, run_id: str | None = None) -> str:
        """Record a new run of ``cluster``, named ``run_id`` (one its tasks were started under
        early) or a new id; the id."""
        run_id = run_id or time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]
        with self._tx() as db:
            db.execute(
                "INSERT INTO runs (id, cluster, status, started_at, controller_pid)"
                " VALUES (?, ?, 'running', ?, ?)",
                (run_id, cluster, time.time(), os.getpid()),
            )
        return run_id

    def delete_run(self, run_id: str) -> None:
        """Forget a run that never got to its first attempt (``Supervisor.discard``)."""
        with self._tx() as db:
            db.execute("DELETE FROM points WHERE run_id = ?", (run_id,))
            db.execute("DELETE FROM attempts WHERE run_id = ?", (run_id,))
            db.execute("DELETE FROM runs WHERE id = ?", (run_id,))

    def reopen_run(self, run_id: str) -> None:
        """Mark an ended run running again, supervised by this process (``train --resume``)."""
        with self._tx() as db:
            db.execute(
                "UPDATE runs SET status='running', ended_at=NULL, message='', controller_pid=?"
                " WHERE id=?", (os.getpid(), run_id))

    def note_run(self, run_id: str, message: str) -> None:
        """What a running run waits for now ("" when nothing), for 'status'; the run's end
        replaces it with its final message."""
        with self._tx() as db:
            db.execute("UPDATE runs SET message=? WHERE id=? AND status='running'",
                       (message[:2000], run_id))

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

    def set_price(self, run_id: str, price: dict[str, Any]) -> None:
        """The cluster's price an hour for this run (``cost.Price.to_json``)."""
        with self._tx() as db:
            db.execute("UPDATE runs SET price_json = ? WHERE id = ?", (json.dumps(price), run_id))

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
                   "failed_at", "detected_at", "recovery_s", "steps_lost", "phases",
                   "snapshot_step", "snapshot", "resized"}
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

    # -- the history of a run --------------------------------------------------------
    def change_points(self, run_id: str, add: Sequence[Point],
                      drop: Sequence[tuple[int, int]] = ()) -> None:
        """Add points to a run's history and drop others (by attempt and step), at once. A
        point of a step the history has already is kept as it was (a log read again)."""
        with self._tx() as db:
            db.executemany("DELETE FROM points WHERE run_id = ? AND attempt = ? AND step = ?",
                           [(run_id, attempt, step) for attempt, step in drop])
            db.executemany(
                "INSERT OR IGNORE INTO points (run_id, attempt, step, at, loss, steps_per_s,"
                " examples_per_s, metrics_json) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [(run_id, p.attempt, p.step, p.at, _finite(p.loss), p.steps_per_s,
                  p.examples_per_s, json.dumps(p.metrics)) for p in add])

    def points(self, run_id: str) -> list[Point]:
        """The run's history, in the order it was made (by attempt, then step); a point whose
        metrics do not decode keeps its other figures."""
        rows = self._all("SELECT * FROM points WHERE run_id = ? ORDER BY attempt, step",
                         (run_id,))
        return [Point(r["attempt"], r["step"], r["at"], r["loss"], r["steps_per_s"],
                      r["examples_per_s"], _decoded(r, "metrics_json", _numbers, {}, []))
                for r in rows]

    def _one(self, sql: str, args: tuple[Any, ...]) -> sqlite3.Row | None:
        with self._lock, self._translated():
            row: sqlite3.Row | None = self._db.execute(sql, args).fetchone()
            return row

    def _all(self, sql: str, args: tuple[Any, ...]) -> list[sqlite3.Row]:
        with self._lock, self._translated():
            return self._db.execute(sql, args).fetchall()


def _cluster(row: sqlite3.Row) -> ClusterRecord:
    problems: list[str] = []
    hosts = _decoded(row, "hosts_json", _host_list, [], problems)
    return ClusterRecord(
        name=row["name"], provider=row["provider"], spec_path=row["spec_path"],
        status=UNREADABLE if problems else row["status"], hosts=hosts,
        created_at=row["created_at"], updated_at=row["updated_at"],
    )


def _run(row: sqlite3.Row, attempts: list[AttemptRecord]) -> RunRecord:
    problems: list[str] = []
    metrics = _decoded(row, "metrics_json", _numbers, {}, problems)
    warm = _decoded(row, "warm_json", _task_list, [], problems)
    price = _decoded(row, "price_json", _mapping, {}, [])  # a damaged one: no cost shown
    return RunRecord(
        id=row["id"], cluster=row["cluster"],
        status=UNREADABLE if problems else row["status"],
        started_at=row["started_at"], ended_at=row["ended_at"],
        metrics=metrics, model_path=row["model_path"],
        message=_unreadable(problems) if problems else row["message"],
        controller_pid=row["controller_pid"], attempts=attempts,
        heartbeat_at=row["heartbeat_at"], warm=warm, price=price,
    )


def _attempt(row: sqlite3.Row) -> AttemptRecord:
    problems: list[str] = []
    tasks = _decoded(row, "tasks_json", _task_list, [], problems)
    phases = _decoded(row, "phases_json", _numbers, {}, problems)
    return AttemptRecord(
        run_id=row["run_id"], number=row["number"],
        status=UNREADABLE if problems else row["status"],
        started_at=row["started_at"], ended_at=row["ended_at"], cause=row["cause"],
        detail=_unreadable(problems) if problems else row["detail"],
        failed_task=row["failed_task"], exit_code=row["exit_code"],
        resumed_from_step=row["resumed_from_step"], last_step=row["last_step"],
        first_step_at=row["first_step_at"], tasks=tasks,
        evidence=row["evidence"], failed_at=row["failed_at"], detected_at=row["detected_at"],
        recovery_s=row["recovery_s"], steps_lost=row["steps_lost"], phases=phases,
        snapshot_step=row["snapshot_step"], snapshot=row["snapshot"], resized=row["resized"],
    )


def _decoded(row: sqlite3.Row, column: str, parse: Callable[[Any], Any], empty: Any,
             problems: list[str]) -> Any:
    """A JSON column as ``parse`` reads it; ``empty`` (and a note in ``problems``) when it is
    not JSON or not of the shape ``parse`` expects: one damaged record must not hide the rest."""
    text = row[column]
    try:
        value = json.loads(text) if text else None
    except ValueError as exc:
        problems.append(f"{column} is not JSON ({str(exc)[:120]})")
        return empty
    try:
        return empty if value is None else parse(value)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        problems.append(f"{column} does not hold what it should ({str(exc)[:120]})")
        return empty


def _unreadable(problems: list[str]) -> str:
    return "unreadable in the state store: " + "; ".join(problems)


def _task_list(value: Any) -> list[TaskRecord]:
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise TypeError("expected a list of task records")
    return [TaskRecord.from_json(t) for t in value]


def _numbers(value: Any) -> dict[str, float]:
    if not isinstance(value, dict) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in value.values()):
        raise TypeError("expected a map of names to numbers")
    return value


def _mapping(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError("expected a mapping")
    return value


def _host_list(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not all(
            isinstance(h, dict) and isinstance(h.get("name"), str)
            and isinstance(h.get("address"), str) for h in value):
        raise TypeError("expected a list of hosts, each with a name and an address")
    return value


def _finite(value: float | None) -> float | None:
    """A loss for the store: NaN (a diverged step, or none reported) and infinities as NULL,
    which SQLite would store as NULL or refuse anyway."""
    return value if value is not None and math.isfinite(value) else None


def _tasks_json(tasks: list[TaskRecord]) -> str:
    return json.dumps([t.to_json() for t in tasks])
