"""The live view of `train`: a real pseudo-terminal, and a notebook's display updated in place."""

from __future__ import annotations

import fcntl
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.api import Cluster

REPO = Path(__file__).resolve().parent.parent
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\r")
ROW = re.compile(r"│ (worker:\d) +│ local-\d +│ (\w+) +│ +(\d+)/(\d+) │")


def read_until_exit(proc: subprocess.Popen[bytes], master: int, timeout_s: float) -> str:
    """Everything the child writes to its terminal until it exits and the terminal drains."""
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.5)
        if not ready:
            if proc.poll() is not None:
                break
            continue
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed its side
            break
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks).decode(errors="replace")


@pytest.fixture
def terminal() -> Iterator[tuple[int, int]]:
    """A pseudo-terminal of 40 rows x 120 columns: (master, slave) descriptors."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    try:
        yield master, slave
    finally:
        os.close(master)
        os.close(slave)


@pytest.mark.tf
def test_train_on_a_terminal_shows_every_workers_step_advancing(
        terminal: tuple[int, int], tmp_path: Path, orchestrate_home: Path) -> None:
    master, slave = terminal
    spec = tmp_path / "c.yaml"
    spec.write_text(f"name: live\nworkers: 2\nworkdir: {REPO}\nports: {{start: 24150, end: 24160}}\n"
                    "job: {module: examples.digits, epochs: 3, steps_per_epoch: 80, "
                    "progress_every_steps: 2}\ncheckpoint: {every_steps: 100}\n")
    env = {**os.environ, "ORCHESTRATE_HOME": str(orchestrate_home), "TERM": "xterm-256color",
           "COLUMNS": "120", "LINES": "40"}
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "train", str(spec)],
                            cwd=REPO, stdin=slave, stdout=slave, stderr=slave, env=env,
                            start_new_session=True)
    try:
        screen = ANSI.sub("", read_until_exit(proc, master, timeout_s=400))
        assert proc.wait(timeout=60) == 0, screen[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    steps: dict[str, list[int]] = {"worker:0": [], "worker:1": []}
    for task, _state, step, total in ROW.findall(screen):
        assert total == "240"
        if not steps[task] or steps[task][-1] != int(step):
            steps[task].append(int(step))
    for task, seen in steps.items():
        assert seen == sorted(seen), f"{task} went backwards: {seen}"
        assert len(set(seen) - {0, 240}) >= 2 and seen[-1] == 240, f"{task}: {seen}"
    assert "doctor: 1 machine(s) ok" in screen and "ETA" in screen
    assert "run " in screen and " succeeded in " in screen and "final accuracy:" in screen


def test_train_in_a_notebook_updates_one_output_in_place(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    shells = pytest.importorskip("IPython.core.interactiveshell",
                                 reason="IPython is not installed (pip install ipython)")
    from IPython.core.displaypub import CapturingDisplayPublisher

    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    (tmp_path / "tick.py").write_text("import time\nfor i in range(3):\n"
                                      "    print('tick', i, flush=True)\n    time.sleep(0.5)\n")
    spec = tmp_path / "c.yaml"
    spec.write_text("name: notebook\nworkers: 2\nports: {start: 24170, end: 24180}\n"
                    "job: {command: python tick.py}\n")
    shell = shells.InteractiveShell.instance()
    shell.display_pub = CapturingDisplayPublisher()
    try:
        result = Cluster.from_spec(spec).train(progress=True, doctor=False).wait()
    finally:
        shells.InteractiveShell.clear_instance()
    outputs = shell.display_pub.outputs
    assert len(outputs) >= 2 and not outputs[0]["update"]
    assert all(o["update"] for o in outputs[1:])  # the same output, redrawn in place
    assert len({o["transient"]["display_id"] for o in outputs}) == 1
    final = outputs[-1]["data"]
    rows = [line for line in final["text/plain"].splitlines() if "worker:" in line]
    assert [row.split("│")[1].strip() for row in rows] == ["worker:0", "worker:1"]
    assert all("finished" in row for row in rows)
    assert f"run {result.run_id} succeeded" in final["text/plain"]
    assert final["text/html"].startswith("<pre style=") and "worker:1" in final["text/html"]
