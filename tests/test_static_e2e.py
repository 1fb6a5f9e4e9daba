"""The static provider end to end: real sshd hosts in network namespaces, real TensorFlow
training over gRPC between them, driven the way a user drives it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from helpers import REPO, events_in, namespace_commands, write_spec
from hostlab import HostLab

from orchestrator import cost, paths
from orchestrator.api import Cluster
from orchestrator.errors import AuthError, HostKeyError, RemoteError, RunFailed
from orchestrator.events import Event
from orchestrator.paths import ROOT_MARKER
from orchestrator.remote.ssh import SSHRunner
from orchestrator.state import Store
from orchestrator.view import RunView

pytestmark = pytest.mark.ssh


def cli(*args: str, home: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "ORCHESTRATE_HOME": str(home)})


@pytest.mark.tf
def test_up_train_down_on_three_ssh_hosts(hostlab: HostLab, tmp_path: Path,
                                          orchestrate_home: Path) -> None:
    hosts = hostlab.hosts(3)
    path = write_spec(tmp_path, hostlab, hosts, """\
        name: static-e2e
        job: {module: examples.digits, epochs: 2, steps_per_epoch: 30, progress_every_steps: 5}
        checkpoint: {every_steps: 10}
        cost: {gpu_hour_price: 3.0}
        """)
    up = cli("up", str(path), home=orchestrate_home)
    assert up.returncode == 0, up.stdout + up.stderr
    root = ".orchestrate/clusters/static-e2e"
    for h in hosts:  # code and worker package synced into each host's own home
        assert h.run(["test", "-f", f"{h.home}/{root}/code/examples/digits.py"]).returncode == 0
        assert h.run(["test", "-f", f"{h.home}/{root}/lib/worker/__main__.py"]).returncode == 0
        assert h.run(["test", "-d", f"{h.home}/{root}/code/.git"]).returncode != 0

    train = cli("train", str(path), home=orchestrate_home)
    assert train.returncode == 0, train.stdout + train.stderr
    run = Store(orchestrate_home / "state.db").runs("static-e2e")[0]
    assert run.status == "succeeded"
    assert Path(run.model_path).is_file()  # fetched from the chief host to this machine
    assert str(orchestrate_home) in run.model_path

    tasks = run.attempts[0].tasks
    assert [t.endpoint for t in tasks] == [f"{h.address}:23456" for h in hosts]
    logs = [events_in(h, t.log) for h, t in zip(hosts, tasks, strict=True)]
    losses = [e.get("loss") for e in logs[0] if e.kind == "progress"]
    assert losses[-1] < losses[0]
    digests = {next(e.get("weights_sha256") for e in log if e.kind == "finished") for log in logs}
    assert len(digests) == 1
    assert all(next(e for e in log if e.kind == "connected").get("replicas") == 3 for log in logs)
    # The spec says no GPUs for static hosts: the price counts those the tasks reported (none
    # on these hosts), each machine's once, at the user's price.
    assert (run.price["gpus"], run.price["machines"], run.price["per_hour"]) == (0, 3, 0.0)
    assert run.price["note"] == "" and run.price["source"] == cost.USER_PRICE, run.price

    logs_out = cli("logs", "static-e2e", home=orchestrate_home)
    assert logs_out.returncode == 0 and "[worker:2]" in logs_out.stdout
    status = cli("status", "static-e2e", home=orchestrate_home)
    assert "static-e2e (static) up" in status.stdout and "succeeded" in status.stdout

    down = cli("down", str(path), home=orchestrate_home)
    assert down.returncode == 0, down.stdout + down.stderr
    for h in hosts:
        assert h.run(["test", "-e", f"{h.home}/{root}"]).returncode != 0
        assert h.run(["test", "-d", h.home]).returncode == 0  # only our directory went


@pytest.mark.tf
def test_killed_worker_recovers_from_the_chief_checkpoint_copied_to_other_hosts(
        hostlab: HostLab, tmp_path: Path) -> None:
    hosts = hostlab.hosts(3)
    path = write_spec(tmp_path, hostlab, hosts, """\
        name: static-kill
        job: {module: examples.digits, epochs: 2, steps_per_epoch: 40, progress_every_steps: 1}
        checkpoint: {every_steps: 10}
        retry: {max_restarts: 2, backoff_initial_s: 0.5, backoff_max_s: 2}
        timeouts: {stop_grace_s: 2}
        """)
    cluster = Cluster.from_spec(path)
    cluster.up()
    pids: dict[str, int] = {}
    killed: list[int] = []
    before_copy: dict[str, str] = {}

    def listener(view: RunView, event: Event | None) -> None:
        if event is None:
            # the first view with the message: a later one (with no message since) may come
            # once the copy is done
            if view.messages and view.messages[-1].startswith(
                    "copying the chief's checkpoint") and not before_copy:
                for h in hosts[1:]:
                    ckpt = f"{h.home}/.orchestrate/clusters/static-kill/runs/{view.run_id}/checkpoints"
                    before_copy[h.name] = h.run(f"ls -A {ckpt}/chief 2>/dev/null; true").stdout
            return
        if event.kind == "started" and event.attempt == 1:
            pids[event.task] = int(event.get("pid"))
        if (event.kind == "progress" and event.task == "worker:2" and event.attempt == 1
                and event.get("step") >= 25 and not killed):
            killed.append(event.get("step"))
            hosts[2].run(["kill", "-9", str(pids["worker:2"])])

    result = cluster.train(listener=listener).wait()
    assert killed and result.status == "succeeded"
    first, second = result.attempts
    assert (first.cause, first.failed_task) == ("crashed", "worker:2")
    assert before_copy == {h.name: "" for h in hosts[1:]}  # nothing to resume from without it
    assert second.resumed_from_step and second.resumed_from_step > 0
    for h, task in zip(hosts, second.tasks, strict=True):
        resumed = [e for e in events_in(h, task.log) if e.kind == "resumed"]
        assert resumed and resumed[0].get("step") == second.resumed_from_step
    assert len(set(result.digests.values())) == 1
    cluster.down()


def test_unknown_host_key_is_refused_with_a_fix(hostlab: HostLab, tmp_path: Path,
                                                orchestrate_home: Path) -> None:
    hosts = hostlab.hosts(1)
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    path = write_spec(tmp_path, hostlab, hosts, "name: hk\njob: {module: examples.digits}\n",
                      known_hosts=str(empty))
    up = cli("up", str(path), home=orchestrate_home, timeout=60)
    assert up.returncode == 2 and "Traceback" not in up.stderr
    assert "hk-0" in up.stderr and "SHA256:" in up.stderr and "fix:" in up.stderr
    with pytest.raises(RemoteError) as info:
        Cluster.from_spec(path).up()
    assert "host key" in str(info.value).lower()


def test_changed_host_key_and_wrong_user_key_are_refused(hostlab: HostLab,
                                                         tmp_path: Path) -> None:
    host = hostlab.hosts(1)[0]
    other = hostlab.hosts(2)[1]
    wrong = tmp_path / "known_hosts"
    wrong.write_text(f"{host.address} {other.host_key_line}\n")
    path = write_spec(tmp_path, hostlab, [host], "name: hk2\njob: {module: examples.digits}\n",
                      known_hosts=str(wrong))
    with pytest.raises(RemoteError) as changed:
        Cluster.from_spec(path).up()
    assert isinstance(changed.value.__cause__, HostKeyError)
    assert "CHANGED" in str(changed.value) and "man-in-the-middle" in str(changed.value)

    key = tmp_path / "not-authorised"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    text = write_spec(tmp_path, hostlab, [host], "name: auth\njob: {module: examples.digits}\n")
    text.write_text(text.read_text().replace(hostlab.client_key_path, str(key)))
    with pytest.raises(RemoteError) as info:
        Cluster.from_spec(text).up()
    assert isinstance(info.value.__cause__, AuthError)
    assert host.user in str(info.value) and str(key) in str(info.value)


@pytest.mark.netns
def test_unreachable_host_fails_up_naming_the_host(hostlab: HostLab, tmp_path: Path,
                                                   orchestrate_home: Path) -> None:
    hosts = hostlab.hosts(2)
    hosts[1].cut()
    try:
        path = write_spec(tmp_path, hostlab, hosts,
                          "name: gone\njob: {module: examples.digits}\n")
        up = cli("up", str(path), home=orchestrate_home, timeout=120)
    finally:
        hosts[1].restore()
    assert up.returncode == 2
    assert "gone-1" in up.stderr and hosts[1].address in up.stderr


HOSTILE = [
    "two words",
    "semi;colon",
    "$(touch {marker})",
    "`touch {marker}`",
    "quote'single",
    'quote"double',
    "new\nline",
    "*",
    "--flag=$HOME",
]


def test_hostile_strings_in_spec_fields_reach_the_task_literally(hostlab: HostLab,
                                                                 tmp_path: Path) -> None:
    host = hostlab.hosts(1)[0]
    marker = f"/tmp/orchestrate-pwned-{uuid.uuid4().hex}"
    values = [v.format(marker=marker) for v in HOSTILE]
    (tmp_path / "echo_args.py").write_text(
        "import json, os, sys\n"
        "json.dump({'argv': sys.argv[1:], 'env': os.environ['HOSTILE_ENV']}, "
        "open('seen.json', 'w'))\n")
    path = tmp_path / "cluster.yaml"
    path.write_text(
        "name: hostile\nworkers: 1\n"
        f"provider:\n  kind: static\n  python: {sys.executable}\n"
        f"  known_hosts: {hostlab.known_hosts_path}\n"
        f"  hosts:\n    - {{address: {host.address}, ssh_port: {host.port}, user: {host.user}, "
        f"key_file: {hostlab.client_key_path}}}\n"
        "job:\n  mode: command\n  command: " + json.dumps(["python", "echo_args.py", *values])
        + "\nenv:\n  HOSTILE_ENV: " + json.dumps(" ".join(values)) + "\n"
    )
    cluster = Cluster.from_spec(path)
    cluster.up()
    result = cluster.train().wait()
    assert result.status == "succeeded"
    seen = json.loads(host.run(
        ["cat", f"{host.home}/.orchestrate/clusters/hostile/code/seen.json"]).stdout)
    assert seen == {"argv": values, "env": " ".join(values)}
    assert not Path(marker).exists()
    assert host.run(["test", "-e", marker]).returncode != 0
    cluster.down()


def test_down_from_another_process_stops_a_running_job_for_good(
        hostlab: HostLab, tmp_path: Path, orchestrate_home: Path) -> None:
    hosts = hostlab.hosts(2)
    (tmp_path / "sleeper.py").write_text("import time\nprint('working', flush=True)\n"
                                         "time.sleep(600)\n")
    path = write_spec(tmp_path, hostlab, hosts, """\
        name: stop-me
        workdir: .
        job: {command: python sleeper.py}
        retry: {max_restarts: 3, backoff_initial_s: 0.2}
        timeouts: {stop_grace_s: 1}
        """)
    path.write_text(path.read_text().replace(f"workdir: {REPO}\n", ""))
    cluster = Cluster.from_spec(path)
    run = cluster.train(wait=False)
    deadline = time.monotonic() + 60
    while not all(t.state == "running" for t in run.supervisor.view.tasks.values()) or \
            len(run.supervisor.view.tasks) < 2:
        assert time.monotonic() < deadline, run.supervisor.view
        time.sleep(0.2)

    down = cli("down", str(path), home=orchestrate_home, timeout=120)
    assert down.returncode == 0, down.stdout + down.stderr
    # down marks the run stopped first, then stops each task still running; the supervisor,
    # seeing the mark, stops them too, and on a busy machine may be first for both: which of
    # the two stopped a task is not the point, that it stays stopped is (below)
    assert "Traceback" not in down.stdout + down.stderr
    with pytest.raises(RunFailed, match="stopped by 'orchestrate down'"):
        run.wait(timeout=60)
    record = Store().get_run(run.id)
    assert record.status == "stopped" and len(record.attempts) == 1  # not restarted
    for h in hosts:
        assert h.run(["test", "-e", f"{h.home}/.orchestrate/clusters/stop-me"]).returncode != 0
        if h.namespace:  # the watch's poll shell, told to exit at its end, exits meanwhile
            deadline = time.monotonic() + 15
            while not namespace_commands(h) <= {"sshd", "sshd-session"}:
                assert time.monotonic() < deadline, namespace_commands(h)
                time.sleep(0.05)


def test_up_reads_what_a_host_holds_in_one_command_and_runs_setup_only_when_it_or_the_code_changed(
        hostlab: HostLab, tmp_path: Path, orchestrate_home: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    (host,) = hostlab.hosts(1)
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("print('v1')\n")

    def spec(setup: str) -> Path:
        path = write_spec(tmp_path, hostlab, [host], f"""\
            name: setup-once
            workdir: {project}
            job: {{command: python train.py}}
            """, provider_extra=f"  setup: ['echo {setup} >> \"$HOME/setup-ran\"']\n")
        path.write_text(path.read_text().replace(f"workdir: {REPO}\n", ""))
        return path

    commands: list[str] = []
    original = SSHRunner._exec

    def counted(self: SSHRunner, script: str, *args: object, **kwargs: object) -> object:
        commands.append(script)
        return original(self, script, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(SSHRunner, "_exec", counted)

    def up(setup: str) -> list[str]:
        commands.clear()
        Cluster.from_spec(spec(setup)).up()
        return list(commands)

    def ran() -> list[str]:
        return host.run(["cat", f"{host.home}/setup-ran"]).stdout.split()

    try:
        first = up("a")
        assert ran() == ["a"]
        again = up("a")  # nothing changed: setup does not run, nothing is uploaded
        assert ran() == ["a"]
        assert len(again) < len(first)
        # One command: the recorded $HOME checked, the root's claim, both trees' stamps and
        # setup's
        assert len(again) == 1, again
        assert "$HOME" in again[0] and ROOT_MARKER in again[0]
        assert "orchestrate-setup" in again[0] and again[0].count(".orchestrate-sync") == 2

        # A home that is not the one recorded (the account moved) is asked for, and the
        # root claimed where it is now: the check, $HOME, then the claim as before
        record = paths.hosts_cache("setup-once", "static")
        document = json.loads(record.read_text())
        (name,) = document["roots"]
        assert document["roots"][name]["home"] == host.home
        document["roots"][name]["home"] = "/nowhere/else"
        record.write_text(json.dumps(document))
        moved = up("a")
        assert len(moved) == 3, moved
        assert ran() == ["a"]
        assert json.loads(record.read_text())["roots"][name]["home"] == host.home

        (project / "train.py").write_text("print('v2')\n")  # the code changed: setup again
        up("a")
        assert ran() == ["a", "a"]
        up("b")  # the setup changed
        assert ran() == ["a", "a", "b"]
        up("b")
        assert ran() == ["a", "a", "b"]
        assert host.run(["cat", f"{host.home}/.orchestrate/clusters/setup-once/code/train.py"]
                        ).stdout == "print('v2')\n"
    finally:
        Cluster.from_spec(spec("b")).down()
        host.run(["rm", "-f", f"{host.home}/setup-ran"])
