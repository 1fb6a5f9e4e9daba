"""The holder of a kept cluster's SSH connections (orchestrator/holder.py): ``up`` and ``train``
leave one, the next ``train`` starts its tasks through it, ``down`` stops it; it answers only
its own user, runs commands only over the connections it holds, and ends by itself. Real sshd
hosts in network namespaces, logged in as an unprivileged user; real TensorFlow where a run
trains."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path

import pytest
from helpers import REPO, first_attempt_pgids, private_examples, write_spec
from hostlab import HostLab

from orchestrator import early_claim, holder
from orchestrator.api import Cluster
from orchestrator.hosts import SSHEndpoint
from orchestrator.remote.netns import start_time

pytestmark = [pytest.mark.ssh, pytest.mark.netns]

TRAIN = "name: held\njob: {module: examples.digits, epochs: 1, steps_per_epoch: 4}\n"


@pytest.fixture(autouse=True)
def nothing_left() -> Iterator[None]:
    yield
    early_claim.reset(wait_s=20)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``orchestrate ARGS``, the program, with this test's ORCHESTRATE_HOME."""
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], cwd=REPO, text=True,
                          capture_output=True, timeout=300, stdin=subprocess.DEVNULL)


def wait_for(check: object, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


def serving(record: Path) -> bool:
    """Whether the holder of ``record`` runs and takes requests."""
    pid = holder.running(record)
    if pid is None:
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(holder.address(record))
        except OSError:
            return False
    return True


@pytest.mark.tf  # it trains: in a TF lane (tests/conftest.py)
def test_up_leaves_a_holder_the_next_train_starts_its_tasks_through_and_down_stops_it(
        hostlab: HostLab, tmp_path: Path) -> None:
    path = write_spec(tmp_path, hostlab, hostlab.hosts(2), TRAIN, user=hostlab.plain_user())
    private_examples(path, tmp_path)
    up = cli("up", str(path))
    assert up.returncode == 0, up.stdout + up.stderr
    record = early_claim._record(path)
    assert wait_for(lambda: serving(record)), "no holder after up"
    pid = holder.running(record)
    # its pid file is private, in a private folder
    assert all(p.stat().st_mode & 0o077 == 0 for p in (record.parent, holder.pid_file(record)))
    # A first run keeps its warm tasks' launches; the holder is still the one up left
    assert Cluster.from_spec(path).train().wait().status == "succeeded"
    assert holder.running(record) == pid

    # The next train's early claim goes through the holder: its tasks are the run's
    assert early_claim.start(["train", "--plain", str(path)]) == 2
    assert early_claim.held(path)
    second = Cluster.from_spec(path).train()
    assert second.wait().status == "succeeded"
    tasks = early_claim.early_tasks()
    assert len(tasks) == 2 and all([s for _, s in found] == ["taken"] for _, found in tasks)
    assert first_attempt_pgids(second.id) == sorted(g for _, f in tasks for g, _ in f)
    early_claim.reset(wait_s=20)

    down = cli("down", str(path))
    assert down.returncode == 0, down.stdout + down.stderr
    assert wait_for(lambda: start_time(pid) is None, 10)  # type: ignore[arg-type]
    assert not holder.pid_file(record).exists()
    assert early_claim.start(["train", str(path)]) == 0  # nothing kept, nothing held


def test_a_holder_answers_its_user_over_its_own_connections_and_ends_by_itself(
        hostlab: HostLab, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_spec(tmp_path, hostlab, hostlab.hosts(1),
                      "name: held-alone\njob: {module: examples.digits}\n",
                      user=hostlab.plain_user())
    assert cli("up", str(path)).returncode == 0
    record = early_claim._record(path)
    assert wait_for(lambda: serving(record))
    ((name, endpoint, _),) = early_claim._read(path)

    def ask(ep: SSHEndpoint, jobs: list[dict[str, str]]) -> list[dict[str, object]]:
        sock = holder.ask(record, [{"name": name, "ssh": asdict(ep), "jobs": jobs}])
        assert sock is not None
        return sorted(holder.answers(sock), key=lambda a: int(a["job"]))  # type: ignore[arg-type]

    # A script, and one on stdin (a launch's way), each answered with its output and code
    got = ask(endpoint, [{"script": "id -un; exit 3"}, {"stdin": "read -r x || true; echo $x"}])
    assert [(a["out"], a["code"]) for a in got] == [(f"{hostlab.plain_user()}\n", 3), ("\n", 0)]
    # An endpoint it does not hold (another port, another user): no answer, nothing run
    for other in (replace(endpoint, port=endpoint.port + 1), replace(endpoint, user="root")):
        assert ask(other, [{"script": "touch ran-anyway"}]) == []
    assert [a["out"] for a in ask(endpoint, [{"script": "test -e ran-anyway; echo $?"}])] == ["1\n"]

    # Another user of this machine reaches the socket: the holder drops it unanswered
    probe = ("import socket, sys\ns = socket.socket(socket.AF_UNIX)\n"
             "s.connect(b'\\0' + sys.argv[1].encode())\ntry:\n"
             "    s.sendall(b'{\"hosts\": []}\\n')\n    got = s.recv(100)\n"
             "except (BrokenPipeError, ConnectionResetError):\n    got = b''\n"
             "print('dropped' if got == b'' else repr(got))\n")
    other = subprocess.run(
        ["runuser", "-u", hostlab.plain_user(), "--", sys.executable, "-S", "-c", probe,
         holder.address(record)[1:].decode()],
        capture_output=True, text=True, timeout=30)
    assert other.stdout.strip() == "dropped", other.stdout + other.stderr

    # and a socket of another user's under the holder's name gets no request: its secrets
    # stay here (the pid file names a process of ours that is not the listener)
    holder.stop(record)
    assert wait_for(lambda: not serving(record), 10)
    squat = subprocess.Popen(
        ["runuser", "-u", hostlab.plain_user(), "--", sys.executable, "-S", "-c",
         "import socket, sys; s = socket.socket(socket.AF_UNIX); "
         "s.bind(b'\\0' + sys.argv[1].encode()); s.listen(1); print('up', flush=True); "
         "c, _ = s.accept(); "
         "c.settimeout(2); print(repr(c.recv(100)), flush=True)",
         holder.address(record)[1:].decode()],
        stdout=subprocess.PIPE, text=True)
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        assert squat.stdout is not None and squat.stdout.readline().strip() == "up"
        holder.pid_file(record).write_text(f"{sleeper.pid} {start_time(sleeper.pid)}\n")
        assert holder.ask(record, [{"name": name, "ssh": asdict(endpoint),
                                    "jobs": [{"stdin": "export SECRET=1"}]}]) is None
        said, _ = squat.communicate(timeout=10)
        assert "SECRET" not in said
    finally:
        for proc in (squat, sleeper):
            proc.kill()
            proc.wait()
        holder.pid_file(record).unlink(missing_ok=True)

    # It ends by itself: after ORCHESTRATE_HOLD_S with no request, once its record is gone,
    # or once it keeps other hosts
    monkeypatch.setenv("ORCHESTRATE_HOLD_S", "1")
    holder.start(record)
    pid = holder.running(record)
    assert pid is not None and wait_for(lambda: serving(record))
    assert wait_for(lambda: start_time(pid) is None, 10)
    monkeypatch.setenv("ORCHESTRATE_HOLD_S", "600")
    for change in ("remove", "rehost"):
        text = record.read_text()
        holder.start(record)
        pid = holder.running(record)
        assert pid is not None and wait_for(lambda: serving(record))
        if change == "remove":
            record.unlink()
        else:
            record.write_text(text.replace(f'"port": {endpoint.port}',
                                           f'"port": {endpoint.port + 1}'))
        assert wait_for(lambda: start_time(pid) is None, 10), change  # noqa: B023
        record.write_text(text)
    # With holding off, none starts
    monkeypatch.setenv("ORCHESTRATE_HOLD_S", "0")
    holder.start(record)
    assert holder.running(record) is None


def test_how_long_a_holder_waits_is_read_from_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for value, expected in (("30", 30.0), ("0", 0.0), ("-5", 0.0), ("soon", holder.HOLD_S)):
        monkeypatch.setenv("ORCHESTRATE_HOLD_S", value)
        assert holder.hold_s() == expected
    monkeypatch.delenv("ORCHESTRATE_HOLD_S")
    assert holder.hold_s() == holder.HOLD_S
