"""A passing doctor report is kept for the next ``train`` of the same spec and hosts
(orchestrator/kept_pass.py): that train starts without the doctor and says so; a changed spec
or host, ``--recheck``, a failed run and ``down`` check again. Real TensorFlow, local tasks."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from orchestrator import kept_pass, paths
from orchestrator.api import Cluster
from orchestrator.doctor import DoctorReport
from orchestrator.errors import RunFailed
from orchestrator.hosts import Host
from orchestrator.remote.base import Runner

REPO = Path(__file__).resolve().parent.parent

LOCAL = """\
name: kept
workdir: {repo}
provider: {{kind: local}}
workers: 2
job: {{module: tests.workloads.breakable_digits, epochs: {epochs}, steps_per_epoch: 5}}
retry: {{max_restarts: 0}}
timeouts: {{startup_s: 180}}
"""

STATIC = """\
name: kept-static
workdir: {repo}
workers: 2
provider:
  kind: static
  python: /usr/bin/python3
  known_hosts: {known_hosts}
  connect_timeout_s: 1
  wait_for_host_s: 1
  hosts:
    - {{address: {first}, user: trainer, key_file: {key}}}
    - {{address: 10.0.0.2, user: trainer, key_file: {key}}}
job: {{module: examples.digits}}
"""


def spec_file(tmp_path: Path, text: str, name: str = "cluster.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


@pytest.mark.tf  # it trains: in a TF lane, not beside them (tests/conftest.py)
def test_a_passing_doctor_is_kept_for_the_next_train_until_something_may_have_changed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = spec_file(tmp_path, LOCAL.format(repo=REPO, epochs=1))
    cluster = Cluster.from_spec(path)
    reports: list[DoctorReport] = []
    assert cluster.kept_pass() is None
    cluster.train(on_doctor=reports.append)
    assert len(reports) == 1 and not reports[0].problems
    kept = cluster.kept_pass()
    assert kept is not None and kept.gpus_per_task == [0, 0]
    record = paths.cluster_home("kept") / kept_pass.FILE
    assert stat.S_IMODE(record.stat().st_mode) == 0o600
    assert set(json.loads(record.read_text())) == {"key", "at", "seconds", "gpus_per_task", "warnings"}

    # The next train, from the CLI: no doctor, and it says why.
    cli = subprocess.run([sys.executable, "-m", "orchestrator.cli", "train", str(path), "--plain"],
                         capture_output=True, text=True, timeout=600)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert "doctor: passed" in cli.stdout and "not run again" in cli.stdout
    assert "train --recheck" in cli.stdout and "machine(s) ok" not in cli.stdout

    cluster.train(on_doctor=reports.append, recheck=True)  # --recheck: the doctor runs
    assert len(reports) == 2

    # Another spec under the same name (one field changed) has no pass.
    changed = spec_file(tmp_path, LOCAL.format(repo=REPO, epochs=2), "changed.yaml")
    assert Cluster.from_spec(changed).kept_pass() is None
    assert cluster.kept_pass() is not None

    # A run that fails (the pass was used) drops it: the train after it checks again.
    monkeypatch.setenv("DIGITS_BROKEN", "1")
    with pytest.raises(RunFailed):
        cluster.train(on_doctor=reports.append)
    assert len(reports) == 2 and cluster.kept_pass() is None
    monkeypatch.delenv("DIGITS_BROKEN")
    cluster.train(on_doctor=reports.append)
    assert len(reports) == 3 and cluster.kept_pass() is not None

    cluster.down()
    assert cluster.kept_pass() is None


def test_a_kept_pass_holds_for_its_hosts_and_its_time_only(tmp_path: Path) -> None:
    key = tmp_path / "id_ed25519"
    key.write_text("not read: nothing connects\n")
    known = tmp_path / "known_hosts"
    known.write_text("")

    def cluster(first: str) -> Cluster:
        return Cluster.from_spec(spec_file(tmp_path, STATIC.format(
            repo=REPO, known_hosts=known, key=key, first=first)))

    one = cluster("10.0.0.1")
    stamps = {"kept-static-0": "a", "kept-static-1": "b"}
    key_one = kept_pass.key_of(one.spec, one.plan(), one.provider.python, stamps)
    kept_pass.keep("kept-static", key_one, 1.5, [0, 0])
    kept = kept_pass.load("kept-static", key_one)
    assert kept is not None and kept.seconds == 1.5
    assert "for this spec and these hosts" in kept.line(now=kept.at + 30)
    assert "passed 30s ago" in kept.line(now=kept.at + 30)

    other = cluster("10.0.0.3")  # another host: check again
    assert kept_pass.key_of(other.spec, other.plan(), other.provider.python, stamps) != key_one
    # the same hosts, something installed on one of them: check again
    assert kept_pass.key_of(one.spec, one.plan(), one.provider.python,
                            {**stamps, "kept-static-1": "c"}) != key_one
    assert one.kept_pass() is None  # no host answers for its stamp: no pass
    assert kept_pass.load("kept-static", key_one, now=kept.at + kept_pass.KEEP_S - 1) is not None
    assert kept_pass.load("kept-static", key_one, now=kept.at + kept_pass.KEEP_S + 1) is None
    assert kept_pass.load("kept-static", key_one, now=kept.at - 60) is None  # clock went back

    record = paths.cluster_home("kept-static") / kept_pass.FILE
    record.write_text("{not json")
    assert kept_pass.load("kept-static", key_one) is None  # a damaged record is no pass
    kept_pass.drop("kept-static")
    kept_pass.drop("kept-static")  # none kept: nothing to do
    assert not record.exists()


def test_a_hosts_stamp_changes_with_what_is_installed_for_its_python(tmp_path: Path) -> None:
    """The host's side of the key: a distribution installed, upgraded or removed on the
    Python's path changes it; anything else in those directories does not."""
    def stamp() -> str:
        source = f"import hashlib, os, sys; sys.path[:] = [{str(tmp_path)!r}]\n" + kept_pass.STAMP
        argv = kept_pass.stamp_argv(sys.executable)
        return subprocess.run([*argv[:-1], source], capture_output=True, text=True,
                              check=True, timeout=60).stdout.strip()

    empty = stamp()
    assert len(empty) == 64 and stamp() == empty
    (tmp_path / "notes.txt").write_text("not a distribution")
    assert stamp() == empty
    (tmp_path / "tensorflow-2.21.0.dist-info").mkdir()
    installed = stamp()
    assert installed != empty
    (tmp_path / "tensorflow-2.21.0.dist-info").rename(tmp_path / "tensorflow-2.20.0.dist-info")
    assert stamp() not in (empty, installed)


def test_this_machines_tasks_are_stamped_once_for_their_one_python(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Local tasks share this machine and its Python: one stamp for all of them (a Python's
    start each fewer beside the warm tasks' imports), and the key holds it for every host."""
    cluster = Cluster.from_spec(spec_file(tmp_path, LOCAL.format(repo=REPO, epochs=1)
                                          .replace("workers: 2", "workers: 3")))
    runner_for, stamped = cluster.provider.runner, []

    def counting(host: Host) -> Runner:
        runner = runner_for(host)
        run = runner.run

        def counted(argv: Any, **options: Any) -> Any:
            if list(argv)[:3] == kept_pass.stamp_argv(cluster.provider.python(host))[:3]:
                stamped.append(host.name)
            return run(argv, **options)

        monkeypatch.setattr(runner, "run", counted)
        return runner

    monkeypatch.setattr(cluster.provider, "runner", counting)
    key = cluster._pass_key()
    assert len(stamped) == 1, stamped
    hosts = kept_pass.hosts_of(cluster.plan())
    assert len(hosts) == 3
    stamp = subprocess.run(kept_pass.stamp_argv(cluster.provider.python(hosts[0])),
                           capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    assert key == kept_pass.key_of(cluster.spec, cluster.plan(), cluster.provider.python,
                                   {h.name: stamp for h in hosts})
