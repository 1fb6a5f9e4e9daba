"""A hostile state store, driven through the CLI: ORCHESTRATE_HOME that is a file or cannot be
written, a state file that is not this store (or a newer one), damaged JSON in one record, a
store another process keeps locked, and the modes of what the controller writes under umask 000.

Every failure is one clear error naming the path and the fix, never a traceback, and the file is
left exactly as it was."""

from __future__ import annotations

import contextlib
import json
import os
import random
import sqlite3
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import orchestrate

from orchestrator.state import Store

REPO = Path(__file__).resolve().parent.parent
COMMANDS = ("status", "logs", "train", "up", "down")


def spec_file(tmp_path: Path, name: str = "c") -> Path:
    """A local cluster whose one task prints hello and writes a file of its own."""
    (tmp_path / "hello.py").write_text("open('made-by-task.txt', 'w').close()\nprint('hello')\n")
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"name: {name}\nworkers: 1\njob: {{command: python hello.py}}\n")
    return path


def argv_of(command: str, spec: Path) -> tuple[str, ...]:
    return {"status": ("status",), "logs": ("logs", "c")}.get(command, (command, str(spec)))


def snapshot(home: Path) -> dict[str, bytes | None]:
    """Every path under (or at) ``home`` with the bytes of each file: what must not change."""
    if home.is_file():
        return {".": home.read_bytes()}
    return {str(p.relative_to(home)): p.read_bytes() if p.is_file() else None
            for p in sorted(home.rglob("*"))}


# -- a home or a state file that is not this store ---------------------------------------------
def home_is_a_file(home: Path) -> None:
    home.write_text("ORCHESTRATE_HOME=/somewhere\n")


def random_bytes(home: Path) -> None:
    home.mkdir()
    (home / "state.db").write_bytes(random.Random(7).randbytes(4096))


def empty_file(home: Path) -> None:
    home.mkdir()
    (home / "state.db").write_bytes(b"")


def text_file(home: Path) -> None:
    home.mkdir()
    (home / "state.db").write_text("clusters:\n  - name: c\n")


def sqlite_db(home: Path, script: str) -> None:
    home.mkdir()
    db = sqlite3.connect(home / "state.db")
    db.executescript(script)
    db.close()


def other_columns(home: Path) -> None:
    sqlite_db(home, "CREATE TABLE runs (x TEXT, y INTEGER); INSERT INTO runs VALUES ('a', 1);")


def other_program(home: Path) -> None:
    sqlite_db(home, "CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT);"
                    "INSERT INTO notes (body) VALUES ('mine');")


def newer_store(home: Path) -> None:
    store = Store(home / "state.db")
    store.put_cluster("c", provider="local", spec_path="/nowhere.yaml", status="up")
    store.close()
    sqlite_db_version(home / "state.db", 99)


def sqlite_db_version(path: Path, version: int) -> None:
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {version}")
    db.close()


def state_is_a_directory(home: Path) -> None:
    (home / "state.db").mkdir(parents=True)


@dataclass(frozen=True)
class Hostile:
    make: Callable[[Path], None]
    says: str  # what the error says, after the path it names
    fix: str


HOSTILE = {
    "home is a file": Hostile(home_is_a_file, "is a file, not a directory",
                              "set ORCHESTRATE_HOME to a directory"),
    "random bytes": Hostile(random_bytes, "is not an orchestrate state store: it is not an "
                            "SQLite database", "move the file aside (mv "),
    "an empty file": Hostile(empty_file, "is not an orchestrate state store: it is an empty file",
                             "move the file aside (mv "),
    "a text file": Hostile(text_file, "is not an orchestrate state store: it is not an SQLite "
                           "database", "or set ORCHESTRATE_HOME to another directory"),
    "a table with other columns": Hostile(
        other_columns, "is not an orchestrate state store: its table runs lacks the columns id, "
        "cluster, status", "move the file aside (mv "),
    "another program's database": Hostile(
        other_program, "is not an orchestrate state store: it is another program's database "
        "(tables: notes)", "move the file aside (mv "),
    "a newer store version": Hostile(
        newer_store, "was written by a newer orchestrate (store version 99; this one reads up "
        "to 1)", "use that newer orchestrate, or set ORCHESTRATE_HOME"),
    "state.db is a directory": Hostile(
        state_is_a_directory, "is not an orchestrate state store: it is not a regular file",
        "move the file aside (mv "),
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_home_or_store_that_is_not_ours_is_one_clear_error_and_left_as_it_is(
        case: str, command: str, orchestrate_home: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    hostile = HOSTILE[case]
    hostile.make(orchestrate_home)
    before = snapshot(orchestrate_home)
    named = orchestrate_home if case == "home is a file" else orchestrate_home / "state.db"

    code, out, err = orchestrate(capsys, *argv_of(command, spec_file(tmp_path)))

    assert code == 2, out + err
    assert "Traceback" not in out + err
    first, fix = err.splitlines()[0], err.splitlines()[1]
    assert first.startswith("error: ") and f"{named} {hostile.says}" in first, err
    assert fix.startswith("  fix: ") and hostile.fix in fix, err
    assert snapshot(orchestrate_home) == before  # not migrated, rewritten or added to


@pytest.mark.parametrize("case", list(HOSTILE))
def test_validate_needs_no_store(case: str, orchestrate_home: Path, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    HOSTILE[case].make(orchestrate_home)
    spec = spec_file(tmp_path)
    code, out, err = orchestrate(capsys, "validate", str(spec))
    assert code == 0, err
    assert out.startswith(f"{spec}: ok: cluster 'c'")


@contextlib.contextmanager
def unwritable(directory: Path) -> Iterator[None]:
    """``directory`` that this process cannot write: immutable for root (who ignores modes),
    read-only otherwise."""
    if os.geteuid() == 0:
        made = subprocess.run(["chattr", "+i", str(directory)], capture_output=True, text=True,
                              timeout=30)
        if made.returncode != 0:
            pytest.skip(f"root ignores modes and chattr +i fails here: {made.stderr.strip()}")
        try:
            yield
        finally:
            subprocess.run(["chattr", "-i", str(directory)], timeout=30, check=True)
    else:
        directory.chmod(0o500)
        try:
            yield
        finally:
            directory.chmod(0o700)


@pytest.mark.parametrize("with_store", [False, True], ids=["empty home", "home with a store"])
@pytest.mark.parametrize("command", COMMANDS)
def test_a_home_that_cannot_be_written_is_one_clear_error(
        command: str, with_store: bool, orchestrate_home: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    orchestrate_home.mkdir(mode=0o700)
    if with_store:
        Store().close()
    before = snapshot(orchestrate_home)
    with unwritable(orchestrate_home):
        code, out, err = orchestrate(capsys, *argv_of(command, spec_file(tmp_path)))
    assert code == 2 and "Traceback" not in out + err, out + err
    first, fix = err.splitlines()[:2]
    assert f"the state store {orchestrate_home / 'state.db'}: " in first, err
    assert first.startswith(("error: cannot use", "error: cannot write")), err
    assert fix == f"  fix: make {orchestrate_home} a directory you can write (chmod u+rwx), or " \
                  "set ORCHESTRATE_HOME to one"
    assert snapshot(orchestrate_home) == before


# -- one damaged record ------------------------------------------------------------------------
def two_runs(home: Path) -> tuple[str, str]:
    """Cluster c with two finished runs, each with one attempt of one task."""
    store = Store()
    store.put_cluster("c", provider="local", spec_path=str(home / "c.yaml"), status="up",
                      hosts=[{"name": "local-0", "address": "127.0.0.1"}])
    ids = []
    for _ in range(2):
        run = store.new_run("c")
        store.start_attempt(run, 1, [])
        store.update_attempt(run, 1, status="succeeded", phases={"detect": 0.5})
        store.finish_run(run, status="succeeded", metrics={"loss": 0.25})
        ids.append(run)
        time.sleep(0.01)  # distinct start times: the newest is listed first
    store.close()
    return ids[0], ids[1]


DAMAGE = [  # (table, column, stored text)
    ("runs", "metrics_json", "{not json"),
    ("runs", "metrics_json", '{"loss": "low"}'),
    ("runs", "warm_json", "[{]"),
    ("runs", "warm_json", '{"task": 1}'),
    ("attempts", "tasks_json", "["),
    ("attempts", "tasks_json", "[1, 2]"),
    ("attempts", "tasks_json", '[{"task": "worker:0"}]'),
    ("attempts", "phases_json", "nan nan"),
]


@pytest.mark.parametrize(("table", "column", "text"), DAMAGE)
def test_a_damaged_record_shows_as_unreadable_and_the_others_as_they_are(
        table: str, column: str, text: str, orchestrate_home: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    good, bad = two_runs(orchestrate_home)
    key = "id" if table == "runs" else "run_id"
    db = sqlite3.connect(orchestrate_home / "state.db")
    db.execute(f"UPDATE {table} SET {column} = ? WHERE {key} = ?", (text, bad))
    db.commit()
    db.close()

    code, out, err = orchestrate(capsys, "status")
    assert code == 0 and "Traceback" not in out + err, out + err
    assert f"run {good} succeeded" in out and "loss 0.2500" in out
    if table == "runs":
        assert f"run {bad} unreadable" in out
    else:
        assert f"run {bad} succeeded" in out and "attempt 1: unreadable" in out

    code, out, err = orchestrate(capsys, "status", "--json")
    assert code == 0, err
    runs = {r["id"]: r for r in json.loads(out)["clusters"][0]["runs"]}
    assert runs[good]["status"] == "succeeded" and runs[good]["metrics"] == {"loss": 0.25}
    damaged = runs[bad] if table == "runs" else runs[bad]["attempts"][0]
    said = damaged["message" if table == "runs" else "detail"]
    assert damaged["status"] == "unreadable"
    assert said.startswith(f"unreadable in the state store: {column} ")


def test_a_damaged_host_list_shows_the_cluster_as_unreadable_with_its_runs(
        orchestrate_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good, other = two_runs(orchestrate_home)
    db = sqlite3.connect(orchestrate_home / "state.db")
    db.execute("UPDATE clusters SET hosts_json = '[{\"name\": 3}]'")
    db.commit()
    db.close()
    code, out, err = orchestrate(capsys, "status")
    assert code == 0 and "Traceback" not in out + err, out + err
    assert out.startswith("c (local) unreadable, spec ")
    assert f"run {good} succeeded" in out and f"run {other} succeeded" in out


# -- a store another process keeps locked ------------------------------------------------------
@dataclass(frozen=True)
class Finished:
    code: int
    out: str
    err: str
    seconds: float


@dataclass(frozen=True)
class Locked:
    stores: dict[str, Path]  # journal mode -> the locked state file
    finished: dict[tuple[str, str], Finished]  # (journal mode, command) -> how it ended


def with_a_run(home: Path, spec: Path, journal: str) -> None:
    store = Store(home / "state.db")
    store.put_cluster("c", provider="local", spec_path=str(spec), status="up")
    run = store.new_run("c")
    store.start_attempt(run, 1, [])
    store.finish_run(run, status="succeeded")
    store.close()
    db = sqlite3.connect(home / "state.db")
    db.execute(f"PRAGMA journal_mode={journal}")
    db.close()


LOCKER = ("import sqlite3, sys, time\n"
          "db = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
          "db.execute('BEGIN EXCLUSIVE')\n"
          "print('locked', flush=True)\n"
          "sys.stdin.read()\n")


@pytest.fixture(scope="module")
def locked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Locked]:
    """Every command, run at once against a store of each journal mode that another process
    holds in an exclusive transaction throughout: how each ended, and how soon."""
    started: dict[tuple[str, str], tuple[subprocess.Popen[str], float]] = {}
    lockers: list[subprocess.Popen[str]] = []
    stores: dict[str, Path] = {}
    try:
        for journal in ("wal", "delete"):
            base = tmp_path_factory.mktemp(f"locked-{journal}")
            home = base / "home"
            stores[journal] = home / "state.db"
            spec = spec_file(base)
            with_a_run(home, spec, journal)
            locker = subprocess.Popen([sys.executable, "-c", LOCKER, str(home / "state.db")],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            lockers.append(locker)
            assert locker.stdout is not None and locker.stdout.readline() == "locked\n"
            env = {**os.environ, "ORCHESTRATE_HOME": str(home)}
            for command in COMMANDS:
                argv = [sys.executable, "-m", "orchestrator.cli", *argv_of(command, spec)]
                started[journal, command] = (subprocess.Popen(
                    argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    text=True), time.monotonic())
        before = {j: path.read_bytes() for j, path in stores.items()}
        finished = {}
        for key, (proc, began) in started.items():
            out, err = proc.communicate(timeout=120)
            finished[key] = Finished(proc.returncode, out, err, time.monotonic() - began)
        assert {j: path.read_bytes() for j, path in stores.items()} == before
        yield Locked(stores, finished)
    finally:
        for proc in [*lockers, *(p for p, _ in started.values())]:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.communicate(timeout=30)


LOCK_CASES = [  # (journal mode, command, waits for the lock)
    *(("wal", command, command in ("train", "up", "down")) for command in COMMANDS),
    *(("delete", command, True) for command in COMMANDS),
]


@pytest.mark.parametrize(("journal", "command", "blocked"), LOCK_CASES)
def test_a_store_locked_by_another_process_is_waited_for_then_named(
        locked: Locked, journal: str, command: str, blocked: bool) -> None:
    """In WAL mode readers go on beside a writer; a write (or any read of a rollback-journal
    store) waits the busy timeout, then says who holds the file."""
    got, db = locked.finished[journal, command], locked.stores[journal]
    assert "Traceback" not in got.out + got.err
    assert got.seconds < 60
    if not blocked:
        assert got.code == 0, got.err
        return
    assert got.code == 2, got.out + got.err
    first, fix = got.err.splitlines()[:2]
    assert first.startswith(f"error: another orchestrate is using {db}: it stayed locked for 10s")
    assert fix.startswith("  fix: wait for that command to finish, then run this one again")


# -- modes, whatever the umask -----------------------------------------------------------------
@pytest.fixture(scope="module")
def trained_under_umask_000(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ORCHESTRATE_HOME after 'orchestrate train' of a local command job under umask 000."""
    base = tmp_path_factory.mktemp("umask")
    home = base / "made" / "home"
    spec = spec_file(base)
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", "train", str(spec),
                           "--plain", "--no-doctor"], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "ORCHESTRATE_HOME": str(home)},
                          preexec_fn=lambda: os.umask(0))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return home


MODES = [  # (a path or glob under ORCHESTRATE_HOME, the mode of what it names)
    (".", 0o700),
    ("..", 0o700),  # a parent the store made for it
    ("clusters", 0o700),
    ("clusters/c", 0o700),
    ("clusters/c/runs", 0o700),
    ("clusters/c/runs/*", 0o700),
    ("clusters/c/runs/*/logs", 0o700),
    ("clusters/c/runs/*/logs/attempt-1", 0o700),
    ("clusters/c/runs/*/logs/attempt-1/worker-0.log", 0o600),
    ("clusters/c/runs/*/logs/attempt-1/worker-0.rc", 0o600),
    ("clusters/c/runs/*/logs/attempt-1/worker-0.pid", 0o600),
    ("state.db*", 0o600),  # and its -wal and -shm, where left
]


@pytest.mark.parametrize(("pattern", "mode"), MODES)
def test_what_the_controller_writes_is_private_whatever_the_umask(
        trained_under_umask_000: Path, pattern: str, mode: int) -> None:
    home = trained_under_umask_000
    found = [home / pattern] if pattern in (".", "..") else list(home.glob(pattern))
    assert found, pattern
    for path in found:
        assert stat.S_IMODE(path.stat().st_mode) == mode, (path, oct(path.stat().st_mode))


def test_a_task_keeps_the_umask_of_the_controller_for_its_own_files(
        trained_under_umask_000: Path) -> None:
    log = next(trained_under_umask_000.glob("clusters/c/runs/*/logs/attempt-1/worker-0.log"))
    assert "hello" in log.read_text().splitlines()
    made = trained_under_umask_000.parent.parent / "made-by-task.txt"  # in its workdir
    assert stat.S_IMODE(made.stat().st_mode) == 0o666


TIGHTENED = [  # (path under ORCHESTRATE_HOME, a mode an older version left, the mode after)
    (".", 0o755, 0o700),
    ("clusters", 0o775, 0o700),
    ("state.db", 0o644, 0o600),
    ("state.db", 0o666, 0o600),
]


@pytest.mark.parametrize(("name", "loose", "tight"), TIGHTENED)
def test_a_home_left_open_by_an_older_version_is_closed(
        name: str, loose: int, tight: int, orchestrate_home: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    (orchestrate_home / "clusters").mkdir(parents=True)
    Store().close()
    (orchestrate_home / name).chmod(loose)
    code, _, err = orchestrate(capsys, "status")
    assert code == 0, err
    assert stat.S_IMODE((orchestrate_home / name).stat().st_mode) == tight
