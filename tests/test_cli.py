"""The CLI as a user runs it: subprocesses, plain output, exit codes, no tracebacks."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def cli(*args: str, home: Path, cwd: Path = REPO) -> subprocess.Popen[str]:
    """``orchestrate ARGS``: the program the installed script runs (orchestrator/__main__.py)."""
    return subprocess.Popen([sys.executable, "-m", "orchestrator", *args], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "ORCHESTRATE_HOME": str(home)})


def test_logs_follow_prints_every_task_line_until_the_run_ends(tmp_path: Path,
                                                               orchestrate_home: Path) -> None:
    (tmp_path / "ticker.py").write_text(
        "import os, time\n"
        "for i in range(6):\n"
        "    print('tick', i, os.environ['ORCHESTRATE_TASK'], flush=True)\n"
        "    time.sleep(0.5)\n")
    spec = tmp_path / "c.yaml"
    spec.write_text("name: ticker\nworkers: 2\njob: {command: python ticker.py}\n")
    train = cli("train", str(spec), home=orchestrate_home)
    deadline = time.monotonic() + 60
    while not (orchestrate_home / "state.db").exists() or subprocess.run(
            [sys.executable, "-m", "orchestrator.cli", "status", "ticker"], capture_output=True,
            text=True, env={**os.environ, "ORCHESTRATE_HOME": str(orchestrate_home)},
            cwd=REPO).stdout.count("attempt 1") == 0:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    follow = cli("logs", "ticker", "-f", home=orchestrate_home)
    out, err = follow.communicate(timeout=120)
    assert train.wait(timeout=120) == 0
    assert follow.returncode == 0, err
    for task in ("worker:0", "worker:1"):
        assert [line for line in out.splitlines() if line.startswith(f"[{task}] tick")] == [
            f"[{task}] tick {i} {task}" for i in range(6)]


def test_status_of_an_unknown_cluster_is_one_clear_error(orchestrate_home: Path) -> None:
    proc = cli("status", "nope", home=orchestrate_home)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "Traceback" not in err
    assert err.splitlines()[0] == "error: no cluster named 'nope'"


def test_the_program_reaches_the_hosts_before_the_cli_loads(orchestrate_home: Path) -> None:
    """The installed ``orchestrate`` is ``orchestrator.__main__:main``, whose first step is the
    early claim (``early_claim.begin``, with the command's arguments), taken before typer and
    rich load: a kept cluster's tasks start while they do."""
    import tomllib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["orchestrate"] == "orchestrator.__main__:main"
    probe = ("import sys\n"
             "import orchestrator.early_claim as early\n"
             "begin = early.begin\n"
             "def seen(argv):\n"
             "    print('begin', list(argv), 'typer' in sys.modules, 'rich' in sys.modules)\n"
             "    begin(argv)\n"
             "early.begin = seen\n"
             "sys.argv = ['orchestrate', 'status', 'nope']\n"
             "from orchestrator.__main__ import main\n"
             "main()\n")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True,
                          text=True, timeout=60,
                          env={**os.environ, "ORCHESTRATE_HOME": str(orchestrate_home)})
    assert proc.stdout.splitlines()[0] == "begin ['status', 'nope'] False False"
    assert proc.returncode == 2 and proc.stderr.splitlines()[0] == "error: no cluster named 'nope'"
