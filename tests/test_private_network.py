"""The local provider's tasks in a network of their own: each task listens on its task port on
every interface (as TensorFlow's gRPC server does) and reaches the other over 127.0.0.1, while
this test, in the controller's network, reaches neither, on loopback or on any address of this
machine. Real `orchestrate train` and `down` subprocesses, command-mode tasks (no TensorFlow;
tests/test_train_local.py trains TensorFlow over gRPC in the same namespace), as root and as an
unprivileged user."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from hostlab import HostLab

from orchestrator.remote import netns

REPO = Path(__file__).resolve().parent.parent
JOB = """\
import json, os, pathlib, socket, time
tf = json.loads(os.environ["TF_CONFIG"])
me = tf["task"]["index"]
ends = tf["cluster"]["worker"]
out = pathlib.Path(os.environ["OUT"])
(out / f"pid-{me}").write_text(str(os.getpid()))
server = socket.create_server(("", int(ends[me].rsplit(":", 1)[1])))  # every interface
(out / f"listening-{me}").touch()
host, port = ends[1 - me].rsplit(":", 1)
for _ in range(400):
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
        (out / f"reached-{me}").touch()
        break
    except OSError:
        time.sleep(0.05)
while not (out / "done").exists():
    time.sleep(0.05)
"""


def this_machines_addresses() -> list[str]:
    """Every IPv4 address of this machine's interfaces (loopback too), as `ip` lists them."""
    lines = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True,
                           check=True).stdout.splitlines()
    return [line.split()[3].split("/")[0] for line in lines]


def reachable(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=1).close()
        return True
    except OSError:
        return False


def setup(directory: Path, name: str, network: str, port: int) -> tuple[Path, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "job.py").write_text(JOB)
    out = directory / "out"
    out.mkdir()
    spec = directory / "c.yaml"
    spec.write_text(f"name: {name}\nworkers: 2\njob: {{command: python job.py}}\n"
                    f"provider: {{kind: local, python: {sys.executable}, "
                    f"private_network: {network}}}\n"
                    f"ports: {{start: {port}, end: {port + 10}}}\nretry: {{max_restarts: 0}}\n"
                    f"env: {{OUT: '{out}'}}\n")
    return spec, out


def orchestrate(*args: str, home: Path, env: dict[str, str] | None = None,
                user: str | None = None) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "orchestrator.cli", *args]
    if user is not None:
        argv = ["runuser", "-u", user, "--", *argv]
    return subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "ORCHESTRATE_HOME": str(home),
                                            **(env or {})})


def wait_for(out: Path, names: list[str], train: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 60
    while not all((out / n).exists() for n in names):
        assert train.poll() is None, train.communicate()
        assert time.monotonic() < deadline, sorted(p.name for p in out.iterdir())
        time.sleep(0.05)


def train_and_probe(spec: Path, out: Path, home: Path, port: int, *,
                    env: dict[str, str] | None = None, user: str | None = None,
                    ) -> tuple[bool, bool, str]:
    """Train; once both tasks listen and reached each other, whether this test reaches a task
    port anywhere on this machine, and whether the tasks share this process's network
    namespace. Returns those and what train printed."""
    train = orchestrate("train", str(spec), "--no-doctor", home=home, env=env, user=user)
    try:
        wait_for(out, ["listening-0", "listening-1", "reached-0", "reached-1"], train)
        ports = [port, port + 1]  # the first two of the range: nothing else takes them here
        seen = any(reachable(a, p) for a in this_machines_addresses() for p in ports)
        mine = os.readlink("/proc/self/ns/net")
        shared = all(os.readlink(f"/proc/{(out / f'pid-{i}').read_text()}/ns/net") == mine
                     for i in (0, 1))
        (out / "done").touch()
        stdout, stderr = train.communicate(timeout=120)
    finally:
        train.kill()
    assert train.returncode == 0, stdout + stderr
    assert "Traceback" not in stdout + stderr
    return seen, shared, stdout + stderr


def test_local_tasks_reach_each_other_and_nothing_else_reaches_them(
        tmp_path: Path, orchestrate_home: Path) -> None:
    spec, out = setup(tmp_path / "private", "net-private", "auto", 24810)
    seen, shared, _ = train_and_probe(spec, out, orchestrate_home, 24810)
    assert not seen and not shared
    holder = orchestrate_home / "clusters" / "net-private" / "netns.pid"
    pid = int(holder.read_text().split()[0])
    assert Path(f"/proc/{pid}").exists()  # kept for the next run, until down
    down = orchestrate("down", str(spec), home=orchestrate_home)
    stdout, stderr = down.communicate(timeout=60)
    assert down.returncode == 0, stdout + stderr
    assert "the tasks' network namespace" in stdout
    assert not holder.exists()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}/stat").exists() and \
            Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] not in "ZX":
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_with_private_network_false_the_ports_are_this_machines(
        tmp_path: Path, orchestrate_home: Path) -> None:
    """The control: the same probe does see the tasks on this machine's network."""
    spec, out = setup(tmp_path / "host", "net-host", "false", 24830)
    seen, shared, _ = train_and_probe(spec, out, orchestrate_home, 24830)
    assert seen and shared
    assert not (orchestrate_home / "clusters" / "net-host" / "netns.pid").exists()


@pytest.fixture
def no_unshare(tmp_path: Path) -> dict[str, str]:
    """A PATH without util-linux's unshare: a machine that cannot make the namespace."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("sh", "python3", "cat", "sleep", "mkdir", "rm", "mv", "setsid", "ip",
                 "nsenter"):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    return {"PATH": str(bin_dir)}


def test_where_the_namespace_cannot_be_made_auto_says_so_and_true_refuses(
        tmp_path: Path, orchestrate_home: Path, no_unshare: dict[str, str]) -> None:
    spec, out = setup(tmp_path / "auto", "net-auto", "auto", 24850)
    seen, shared, said = train_and_probe(spec, out, orchestrate_home, 24850, env=no_unshare)
    assert seen and shared
    assert "the tasks use this machine's network (unshare (util-linux) is not installed)" in said
    spec, out = setup(tmp_path / "true", "net-true", "true", 24870)
    train = orchestrate("train", str(spec), "--no-doctor", home=orchestrate_home, env=no_unshare)
    stdout, stderr = train.communicate(timeout=60)
    assert train.returncode == 2 and "Traceback" not in stdout + stderr, stdout + stderr
    assert "the tasks cannot get a network of their own here: unshare (util-linux) is not " \
           "installed" in stderr
    assert "fix: enable unprivileged user namespaces" in stderr
    assert not list(out.iterdir())  # nothing started


def test_an_unprivileged_user_gets_the_private_network_too(hostlab: HostLab) -> None:
    """The controller runs as the lab's plain user (no capability at all): the namespace is
    made with an unprivileged user namespace."""
    user = hostlab.plain_user()
    work = Path(tempfile.mkdtemp(prefix="orch-net-"))  # pytest's own tmp is root's alone
    try:
        work.chmod(0o755)
        spec, out = setup(work / "job", "net-plain", "auto", 24890)
        home = work / "home"
        subprocess.run(["chown", "-R", user, str(work)], check=True)
        seen, shared, said = train_and_probe(spec, out, home, 24890, user=user)
        assert not seen and not shared, said
        down = orchestrate("down", str(spec), home=home, user=user)
        stdout, stderr = down.communicate(timeout=60)
        assert down.returncode == 0 and "the tasks' network namespace" in stdout, \
            stdout + stderr
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_a_holder_ends_by_itself_once_its_pid_file_is_gone(tmp_path: Path) -> None:
    """Removing the cluster's directory (or 'down' removing the file) ends the holder: no
    process is left behind by a cluster nobody can name any more."""
    pid_file = tmp_path / "netns.pid"
    holder = netns.ensure(pid_file)
    assert netns.ensure(pid_file) == holder  # found again, not a second one
    pid_file.unlink()
    assert netns.wait_gone(holder, 10)


def test_the_ports_probe_looks_in_the_tasks_namespace_not_this_machines(
        tmp_path: Path, orchestrate_home: Path) -> None:
    """The next attempt's ports are those free where the tasks listen: a port a process left
    in the tasks' namespace holds is taken (a dead JAX chief's coordination service, serving
    there, once took the next chief's connection for 70 s), one this machine's other processes
    hold is no task's."""
    from orchestrator.api import Cluster
    from orchestrator.remote.base import LaunchSpec

    spec, _ = setup(tmp_path / "probe", "net-probe", "auto", 24850)
    cluster = Cluster.from_spec(spec)
    provider = cluster.provider
    hosts = provider.up()
    runner = provider.runner(hosts[0])
    outside = socket.create_server(("", 24851))  # this machine's network, not the tasks'
    hold = ("import socket, time; s = socket.create_server(('', 24850)); "
            "open('held', 'w').close(); time.sleep(300)")
    handle = runner.start(LaunchSpec((sys.executable, "-c", hold), str(tmp_path),
                                     str(tmp_path / "hold.log"), str(tmp_path / "hold.rc")))
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "held").exists():
            assert time.monotonic() < deadline, (tmp_path / "hold.log").read_text()
            time.sleep(0.05)
        assert provider.busy_ports(hosts) == {("127.0.0.1", 24850)}
    finally:
        outside.close()
        runner.stop(handle, grace_s=0.0)
        cluster.down()
