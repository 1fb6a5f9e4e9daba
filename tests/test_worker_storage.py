"""The worker's view of checkpoint storage: the chief's index watch that reports a command job's
checkpoints, which task is the chief, and a gs:// location that cannot be written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, write_spec
from hostlab import HostLab

from orchestrator.api import Cluster
from orchestrator.errors import RunFailed
from orchestrator.events import parse_line
from worker.storage import checkpoint_number, is_chief_task

WATCH = """
import os, sys, time
from worker.storage import IndexWatch
watch = IndexWatch(sys.argv[1], interval_s=0.05).start()
time.sleep(float(sys.argv[2]))
watch.stop()
"""


def index(directory: Path, name: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / "checkpoint.tmp"
    tmp.write_text(f'model_checkpoint_path: "{name}"\nall_model_checkpoint_paths: "{name}"\n')
    os.replace(tmp, directory / "checkpoint")  # as TensorFlow writes it: a rename


def test_checkpoint_number_reads_the_index() -> None:
    assert checkpoint_number('model_checkpoint_path: "ckpt-7"\n') == 7
    assert checkpoint_number('model_checkpoint_path: "/x/y/ckpt-12"\n') == 12
    assert checkpoint_number('model_checkpoint_path: "weights"\n') is None
    assert checkpoint_number("") is None


@pytest.mark.parametrize(("config", "chief"), [
    ({"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 0}}, True),
    ({"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 1}}, False),
    ({"cluster": {"chief": ["c:1"], "worker": ["a:1"]}, "task": {"type": "worker", "index": 0}},
     False),
    ({"cluster": {"chief": ["c:1"], "worker": ["a:1"]}, "task": {"type": "chief", "index": 0}},
     True),
])
def test_the_chief_is_the_chief_or_worker_0_without_one(
        config: dict[str, object], chief: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    assert is_chief_task() is chief


def test_index_watch_reports_each_new_checkpoint_once(tmp_path: Path) -> None:
    """BackupAndRestore's layout (base/chief) and a CheckpointManager's (base itself); an index
    present before the watch starts is not news."""
    index(tmp_path / "chief", "ckpt-1")
    proc = subprocess.Popen([sys.executable, "-c", WATCH, str(tmp_path), "3"], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(1.0)
        index(tmp_path / "chief", "ckpt-2")
        time.sleep(0.5)
        index(tmp_path, "ckpt-5")
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    events = [e for e in map(parse_line, out.splitlines()) if e is not None]
    assert [(e.kind, e.get("step"), e.get("path")) for e in events] == [
        ("checkpoint", 2, str(tmp_path / "chief")), ("checkpoint", 5, str(tmp_path))]


@pytest.mark.ssh
@pytest.mark.tf
@pytest.mark.netns
def test_a_gs_location_without_credentials_fails_the_first_task_clearly(
        hostlab: HostLab, tmp_path: Path) -> None:
    """The lab's hosts have no route to Cloud Storage and no credentials: the first attempt's
    tasks say so and the run stops (a user error, not retried), without the doctor's help."""
    hosts = hostlab.hosts(2)
    body = """\
        name: gs-nocreds
        job: {command: python -c "print('never runs')"}
        checkpoint: {dir: "gs://orchestrate-no-such-bucket/ckpt"}
        retry: {max_restarts: 3, backoff_initial_s: 0.2, backoff_max_s: 1}
        timeouts: {stop_grace_s: 1, startup_s: 120}
        """
    cluster = Cluster.from_spec(write_spec(tmp_path, hostlab, hosts, body,
                                           user=hostlab.plain_user()))
    try:
        with pytest.raises(RunFailed) as info:
            cluster.train(doctor=False).wait()
    finally:
        cluster.down()
    text = str(info.value)
    assert "failed after 1 attempt(s)" in text and "user_error" in text, text
    assert "cannot write the checkpoint location gs://orchestrate-no-such-bucket/ckpt/gs-nocreds/"\
        in text
    assert "roles/storage.objectUser" in text  # the fix
    assert "startup_timeout" not in text  # the tasks answered; nothing waited for a deadline


NO_TENSORFLOW = """
import sys
sys.modules["tensorflow"] = None  # a JAX host: no TensorFlow to import
from worker.storage import check_checkpoint_storage
sys.exit(0 if check_checkpoint_storage(sys.argv[1]) else 3)
"""


def test_a_bucket_on_a_host_without_tensorflow_says_so_with_the_fix() -> None:
    """A JAX job's gs:// checkpoints go through TensorFlow's file systems, as Keras's own remote
    paths do: a host without TensorFlow is told that, and what to install, not a generic storage
    error."""
    done = subprocess.run([sys.executable, "-c", NO_TENSORFLOW, "gs://ckpt/runs/c/r1"],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 3, done.stderr
    (event,) = [e for e in map(parse_line, done.stdout.splitlines()) if e is not None]
    assert (event.kind, event.get("phase")) == ("error", "storage")
    assert event.get("message").startswith(
        "cannot write the checkpoint location gs://ckpt/runs/c/r1: TensorFlow is not installed")
    assert "tensorflow>=2.21,<2.22" in event.get("fix") and "JAX variant" in event.get("fix")
