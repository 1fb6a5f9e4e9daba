"""`orchestrate status` and `orchestrate logs` after a real run with one failed attempt."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from snapshot import assert_matches, normalise

REPO = Path(__file__).resolve().parent.parent
VOLATILE = {"started_at", "ended_at", "updated_at", "seconds", "controller_pid", "first_step_at",
            "failed_at", "detected_at", "detect_s", "recovery_s", "endpoint", "evidence", "phases"}
FLAKY_SCRIPT = """\
import os, sys, time
task, attempt = os.environ["ORCHESTRATE_TASK"], os.environ["ORCHESTRATE_ATTEMPT"]
print("hello from", task, "attempt", attempt, flush=True)
if task == "worker:1" and attempt == "1":
    time.sleep(2)  # worker:0 has ended (exit 0) well before this failure
    sys.exit(3)
"""


def cli(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "ORCHESTRATE_HOME": str(home)})


@pytest.fixture
def flaky_run(tmp_path: Path, orchestrate_home: Path) -> Path:
    """A finished run of cluster 'flaky': worker:1 exits 3 in attempt 1, after worker:0
    exited 0; attempt 2 succeeds."""
    (tmp_path / "flaky.py").write_text(FLAKY_SCRIPT)
    spec = tmp_path / "c.yaml"
    spec.write_text("name: flaky\nworkers: 2\nports: {start: 24130, end: 24140}\n"
                    "job: {command: python flaky.py}\n"
                    "retry: {max_restarts: 2, backoff_initial_s: 0.1, backoff_max_s: 0.2}\n")
    train = cli("train", str(spec), "--no-doctor", home=orchestrate_home)
    assert train.returncode == 0, train.stdout + train.stderr
    assert "attempt 1: crashed in worker:1: exited 3: CommandFailed" in train.stdout
    return spec


def test_status_json_of_a_recovered_run_matches_its_snapshot(
        flaky_run: Path, orchestrate_home: Path, tmp_path: Path) -> None:
    proc = cli("status", "--json", home=orchestrate_home)
    assert proc.returncode == 0, proc.stderr
    document = json.loads(proc.stdout)
    assert_matches("status.json", normalise(
        document, {str(orchestrate_home): "<home>", str(tmp_path): "<tmp>",
                   sys.executable: "<python>"},
        volatile=VOLATILE.__contains__))
    (attempt_1, attempt_2) = document["clusters"][0]["runs"][0]["attempts"]
    assert attempt_1["detect_s"] >= 0 and attempt_2["detect_s"] is None


def test_status_text_shows_hosts_runs_attempts_and_causes(flaky_run: Path,
                                                          orchestrate_home: Path) -> None:
    proc = cli("status", "flaky", home=orchestrate_home)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"flaky (local) up, spec {flaky_run}"
    assert lines[1] == "  hosts: local-0 127.0.0.1, local-1 127.0.0.1"
    assert " succeeded " in lines[2] and lines[2].endswith("2 attempt(s), 1 restart(s)")
    assert lines[3].startswith("    attempt 1: failed from step 0 to 0; crashed in worker:1: "
                               "exited 3: CommandFailed")
    assert "; detected in " in lines[3]
    assert lines[4] == "    attempt 2: succeeded from step 0 to 0"


def test_logs_merge_every_task_with_a_prefix_or_show_one(flaky_run: Path,
                                                         orchestrate_home: Path) -> None:
    merged = cli("logs", "flaky", home=orchestrate_home)
    assert merged.returncode == 0, merged.stderr
    assert merged.stdout.splitlines() == [
        "[worker:0] hello from worker:0 attempt 2", "[worker:1] hello from worker:1 attempt 2"]
    first = cli("logs", "flaky", "--task", "worker:1", "--attempt", "1", home=orchestrate_home)
    assert first.stdout.splitlines() == ["[worker:1] hello from worker:1 attempt 1"]
    wrong = cli("logs", "flaky", "--task", "worker:7", home=orchestrate_home)
    assert wrong.returncode == 2 and "Traceback" not in wrong.stderr
    assert "has no task 'worker:7' (its tasks: worker:0, worker:1)" in wrong.stderr
    assert "fix: name one of them, e.g. --task worker:1" in wrong.stderr
