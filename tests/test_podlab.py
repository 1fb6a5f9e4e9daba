"""The pod lab itself: real pods, their namespaces, logs, status, stops, node loss, teardown."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hostlab import FORCE_LOOPBACK_ENV
from podlab import (
    HostPath,
    PodLab,
    PodLabError,
    PodLabUnavailable,
    PodProcess,
    PodRun,
    Running,
    Waiting,
    pod_dns_names,
)

pytestmark = pytest.mark.pods

PY = sys.executable
CRI_RECORD = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{9}Z) (stdout|stderr) ([FP]) (.*)$")

# Listens on port 5000, answers one connection with its host name; meanwhile asks the peer
# named in argv[1] the same, prints the answer, and exits once it has answered too.
PEER = """
import socket, sys, threading, time
server = socket.create_server(("0.0.0.0", 5000))
def answer():
    conn, _ = server.accept()
    conn.sendall(socket.gethostname().encode()); conn.close()
thread = threading.Thread(target=answer); thread.start()
for _ in range(300):
    try:
        with socket.create_connection((sys.argv[1], 5000), timeout=1) as c:
            print("peer says", c.recv(100).decode(), flush=True); break
    except OSError:
        time.sleep(0.05)
thread.join()
"""


# A TF server as worker argv[1] of two ("w-0.workers:2222", "w-1.workers:2222"); worker 0
# runs an addition on worker 1 and prints the result, worker 1 serves until SIGTERM.
TF_WORKER = """
import signal, sys, time
import tensorflow as tf
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
tf.compat.v1.disable_eager_execution()
cluster = tf.train.ClusterSpec({"worker": ["w-0.workers:2222", "w-1.workers:2222"]})
server = tf.distribute.Server(cluster, job_name="worker", task_index=int(sys.argv[1]))
if sys.argv[1] == "0":
    with tf.device("/job:worker/task:1/cpu:0"):
        total = tf.constant(20) + tf.constant(22)
    with tf.compat.v1.Session(server.target) as session:
        print(session.run(total), "computed by worker 1", flush=True)
else:
    while True:  # not server.join(): a Python handler never runs while that blocks
        time.sleep(1)
"""

# Starts a lab with a running pod, prints what a later lab must remove, and dies of SIGKILL.
STALE_LAB = """
import os, time
from podlab import PodLab, PodRun
lab = PodLab.start()
pod = lab.run_pod(PodRun("s", "default", "node-1", command=("sleep", "1000")))
while not pod.status_path.exists():
    time.sleep(0.02)
print(lab.dir, pod.netns, pod.shim.pid, flush=True)
os.kill(os.getpid(), 9)
"""


def records(pod: PodProcess) -> list[tuple[str, str, str, str]]:
    """The pod's CRI log as (timestamp, stream, tag, content); every line must match."""
    lines = pod.log_path.read_text().splitlines()
    parsed = [CRI_RECORD.match(line) for line in lines]
    assert all(parsed), lines
    return [m.groups() for m in parsed if m]  # type: ignore[misc]


def wait_for_log(pod: PodProcess, text: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while text not in pod.log_tail(100_000):
        assert time.monotonic() < deadline, f"{pod!r} never logged {text!r}: {pod.state()}"
        time.sleep(0.02)


def python_pod(name: str, script: str, *args: str, node: str = "node-1", **fields: object) -> PodRun:
    return PodRun(name=name, namespace="default", node=node, command=(PY, "-c"),
                  args=(script, *args), **fields)  # type: ignore[arg-type]


def wait_for(condition: Callable[[], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.02)


def dead(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except FileNotFoundError:
        return True


def died(pid: int, within_s: float = 30.0) -> bool:
    """Whether ``pid``, sent SIGKILL, is dead within ``within_s``. A killed process leaves its
    network namespace (no longer among ``ip netns pids``) while the kernel is still tearing it
    down, and only then turns zombie: CI once read it between the two."""
    deadline = time.monotonic() + within_s
    while not dead(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return dead(pid)


def test_stdout_and_stderr_reach_the_cri_log_in_order_with_timestamps_and_tags(pods: PodLab) -> None:
    script = ("import sys, time\n"
              "for i in range(3):\n"
              "    print(f'out {i}', flush=True); time.sleep(0.02)\n"
              "    print(f'err {i}', file=sys.stderr, flush=True); time.sleep(0.02)\n"
              "print('x' * 40000, flush=True)\n"
              "sys.stdout.write('last, no newline')\n")
    pod = pods.run_pod(python_pod("logger", script))
    assert pod.wait(30).exit_code == 0
    log = records(pod)
    assert [(s, t, c) for _, s, t, c in log if s == "stdout" and not c.startswith("x")] == [
        ("stdout", "F", "out 0"), ("stdout", "F", "out 1"), ("stdout", "F", "out 2"),
        ("stdout", "F", "last, no newline")]
    assert [(t, c) for _, s, t, c in log if s == "stderr"] == [("F", "err 0"), ("F", "err 1"),
                                                               ("F", "err 2")]
    long = [(t, len(c)) for _, _, t, c in log if c.startswith("x")]
    assert long == [("P", 16384), ("P", 16384), ("F", 40000 - 2 * 16384)]
    stamps = [stamp for stamp, *_ in log]
    assert stamps == sorted(stamps)


def test_a_pod_has_its_host_name_and_resolves_its_own_and_a_peers_fqdn(pods: PodLab) -> None:
    peer = "w-1.workers.default.svc.cluster.local"
    script = ("import socket\n"
              "print(socket.gethostname(), open('/etc/hostname').read().strip())\n"
              f"print(socket.gethostbyname('w-0.workers.default.svc.cluster.local'))\n"
              "print(socket.gethostbyname('w-0.workers'))\n"
              f"print(socket.gethostbyname('{peer}'))\n"
              "try:\n    socket.gethostbyname('nowhere.example')\n"
              "except OSError:\n    print('unknown name fails')\n")
    pod = pods.run_pod(python_pod("w-0", script, hostname="w-0", subdomain="workers",
                                  hosts_entries={peer: "198.51.100.7"}))
    assert pod.wait(30).exit_code == 0, pod.log_tail()
    assert [c for *_, c in records(pod)] == ["w-0 w-0", pod.ip, pod.ip, "198.51.100.7",
                                             "unknown name fails"]


def test_hosts_entries_set_while_a_pod_runs_resolve_at_once(pods: PodLab) -> None:
    script = ("import socket, time\n"
              "print('waiting', flush=True)\n"
              "while True:\n"
              "    try:\n        print(socket.gethostbyname('late.peer')); break\n"
              "    except OSError:\n        time.sleep(0.02)\n")
    pod = pods.run_pod(python_pod("resolver", script))
    wait_for_log(pod, "waiting")
    pod.set_hosts_entries({"late.peer": "198.51.100.9"})
    assert pod.wait(30).exit_code == 0
    assert [c for *_, c in records(pod)] == ["waiting", "198.51.100.9"]


def test_two_pods_on_one_node_listen_on_one_port_and_reach_each_other_by_name(
        pods: PodLab) -> None:
    runs = [python_pod(f"w-{i}", PEER, f"w-{1 - i}.workers", hostname=f"w-{i}",
                       subdomain="workers") for i in (0, 1)]
    a, b = (pods.create_pod(run) for run in runs)
    assert a.ip != b.ip
    dns = {name: pod.ip for pod in (a, b)
           for name in pod_dns_names(pod.run.host_name, "workers", "default")}
    for pod in (a, b):  # published once both addresses are known, as a cluster DNS would
        pod.set_hosts_entries(dns)
        pod.start()
    for pod, peer in ((a, "w-1"), (b, "w-0")):
        assert pod.wait(60).exit_code == 0, pod.log_tail()
        assert [c for *_, c in records(pod)] == [f"peer says {peer}"]


@pytest.mark.tf
def test_tensorflow_in_two_pods_runs_an_op_on_the_other_over_grpc_by_dns_name(
        pods: PodLab) -> None:
    user = pods.plain_user()
    runs = [python_pod(f"w-{i}", TF_WORKER, str(i), node=f"node-{i + 1}", hostname=f"w-{i}",
                       subdomain="workers", run_as_user=user.uid, run_as_group=user.gid,
                       env={"TF_CPP_MIN_LOG_LEVEL": "3"}) for i in (0, 1)]
    workers = [pods.create_pod(run) for run in runs]
    dns = {name: pod.ip for pod in workers
           for name in pod_dns_names(pod.run.host_name, "workers", "default")}
    for pod in workers:
        pod.set_hosts_entries(dns)
        pod.start()
    chief, other = workers
    assert chief.wait(120).exit_code == 0, chief.log_tail()
    assert "42 computed by worker 1" in [c for _, s, _, c in records(chief) if s == "stdout"]
    other.terminate(grace_s=30)  # it handles SIGTERM: exits 0 at once
    assert other.wait(0).exit_code == 0, other.log_tail()


def test_volumes_appear_at_their_paths_and_a_read_only_one_refuses_writes(
        pods: PodLab, tmp_path: Path) -> None:
    code, data = tmp_path / "code", tmp_path / "data"
    code.mkdir()
    data.mkdir()
    (code / "train.py").write_text("print('training')\n")
    script = ("import os, runpy\n"
              "runpy.run_path('/orchestrate/code/train.py')\n"
              "open('/data/out.txt', 'w').write('from the pod')\n"
              "open('/made-in-the-pod', 'w').write('private')\n"
              "try:\n    open('/orchestrate/code/x', 'w')\n"
              "except OSError as e:\n    print('read-only:', e.strerror)\n")
    pod = pods.run_pod(python_pod("vol", script, mounts={
        "/orchestrate/code": HostPath(str(code), read_only=True),
        "/data": HostPath(str(data))}))
    assert pod.wait(30).exit_code == 0, pod.log_tail()
    assert [c for *_, c in records(pod)] == ["training", "read-only: Read-only file system"]
    assert (data / "out.txt").read_text() == "from the pod"
    assert not Path("/orchestrate").exists() and not Path("/made-in-the-pod").exists()
    assert sorted(os.listdir(code)) == ["train.py"]


def test_a_pod_runs_as_the_plain_user_with_exactly_its_env_in_its_working_dir(
        pods: PodLab) -> None:
    user = pods.plain_user()
    script = ("import os, json\n"
              "env = open('/proc/self/environ').read().split(chr(0))[:-1]\n"
              "print(json.dumps([os.getuid(), os.getgid(), os.getgroups(), os.getcwd(), env]))\n")
    pod = pods.run_pod(python_pod("plain", script, env={"TF_CONFIG": "{}", "A": "1"},
                                  working_dir="/work-dir", run_as_user=user.uid,
                                  run_as_group=user.gid))
    assert pod.wait(30).exit_code == 0, pod.log_tail()
    uid, gid, groups, cwd, env = json.loads(records(pod)[0][3])
    assert (uid, gid, groups, cwd) == (user.uid, user.gid, [], "/work-dir")
    assert user.uid != 0
    assert env == ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                   "HOSTNAME=plain", "TF_CONFIG={}", "A=1", "HOME=/"]


def test_terminate_lets_a_python_that_handles_sigterm_exit_with_its_own_code(
        pods: PodLab) -> None:
    script = ("import os, signal, sys, time\n"
              # os.write, not print: a handler that prints while the main thread is inside
              # print (flushing "ready") fails with "reentrant call inside BufferedWriter"
              "signal.signal(signal.SIGTERM, lambda *_: (os.write(1, b'saving\\n'), "
              "sys.exit(7)))\n"
              "print('ready', os.getpid(), flush=True)\n"
              "while True:\n    time.sleep(1)\n")
    pod = pods.run_pod(python_pod("graceful", script))
    wait_for_log(pod, "ready")
    assert isinstance(pod.state(), Running)
    pod.terminate_in_background(grace_s=60).join()
    state = pod.wait(0)
    assert (state.exit_code, state.reason, state.signal) == (7, "Error", None)
    assert [c for *_, c in records(pod)] == ["ready 1", "saving"]  # PID 1 of its namespace


def test_a_shell_pid_1_ignores_sigterm_and_is_killed_with_its_children_after_the_grace(
        pods: PodLab) -> None:
    pod = pods.run_pod(PodRun("sleeper", "default", "node-2", command=("sh", "-c"),
                              args=("echo ready; sleep 1000",)))
    wait_for_log(pod, "ready")
    pod.terminate(grace_s=0.5)
    state = pod.wait(0)
    assert (state.exit_code, state.reason, state.signal) == (137, "Error", 9)
    assert pod.processes() == []  # the sleep went with its PID namespace


@pytest.mark.parametrize(("command", "code", "reason", "message"), [
    (("sh", "-c", "exit 3"), 3, "Error", None),
    (("true",), 0, "Completed", None),
    ((), 128, "StartError", "no command"),
    (("/no/such/program",), 128, "StartError", "No such file"),
])
def test_a_pods_exit_gives_its_code_and_reason(pods: PodLab, command: tuple[str, ...], code: int,
                                              reason: str, message: str | None) -> None:
    pod = pods.run_pod(PodRun("exits", "default", "node-3", command=command))
    state = pod.wait(30)
    assert (state.exit_code, state.reason, state.signal) == (code, reason, None)
    if message is None:
        assert state.message is None
    else:
        assert state.message is not None and message in state.message


def test_kill_node_kills_every_pod_on_it_and_writes_no_status(pods: PodLab) -> None:
    script = "import time\nprint('ready', flush=True)\ntime.sleep(1000)\n"
    lost = [pods.run_pod(python_pod(f"lost-{i}", script, node="node-2")) for i in (0, 1)]
    kept = pods.run_pod(python_pod("kept", script, node="node-3"))
    for pod in [*lost, kept]:
        wait_for_log(pod, "ready")
    pids = [int((pod.dir / "container.pid").read_text()) for pod in lost]
    pods.kill_node("node-2")
    for pod, pid in zip(lost, pids, strict=True):
        assert pod.shim is not None and pod.shim.poll() == -9
        assert pod.processes() == [] and died(pid)
        assert isinstance(pod.state(), Running)  # what it last said: a lost node says nothing
        assert json.loads(pod.status_path.read_text())["state"] == "running"
    assert isinstance(kept.state(), Running) and kept.processes()
    with pytest.raises(PodLabError, match="node-2"):
        pods.run_pod(python_pod("late", script, node="node-2"))


def test_a_removed_pods_address_is_handed_out_again_only_after_every_free_one(
        pods: PodLab) -> None:
    first = pods.create_pod(PodRun("a", "default", "node-1", command=("true",)))
    assert isinstance(first.state(), Waiting)
    pods.remove_pod(first)
    assert first.netns not in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                             text=True).stdout.split()
    second = pods.create_pod(PodRun("a", "default", "node-1", command=("true",)))
    assert second.ip != first.ip


def test_close_leaves_no_namespace_veth_process_or_directory(podlab: PodLab) -> None:
    lab = PodLab.start()
    try:
        user = lab.plain_user()
        running = lab.run_pod(PodRun("r", "default", "node-1", command=("sleep",), args=("1000",),
                                     run_as_user=user.uid))
        ended = lab.run_pod(PodRun("e", "default", "node-2", command=("true",)))
        ended.wait(30)
        wait_for(lambda: isinstance(running.state(), Running))
        assert running.shim is not None
        pids = [running.shim.pid, int((running.dir / "container.pid").read_text())]
        namespaces = [running.netns, ended.netns]
        links = [running.veth, ended.veth, lab.bridge]
        dirs = [lab.dir, lab.hostlab.dir]
    finally:
        lab.close()
    assert not set(namespaces) & set(subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                    text=True).stdout.split())
    link_names = re.findall(r"^\d+: ([^:@\s]+)", subprocess.run(
        ["ip", "-o", "link", "show"], capture_output=True, text=True).stdout, re.M)
    assert not set(links) & set(link_names)
    assert all(died(pid) for pid in pids)
    assert not any(d.exists() for d in dirs)
    assert user.name not in Path("/etc/passwd").read_text()


def test_a_pod_lab_of_a_killed_process_is_removed_by_the_next_start(podlab: PodLab) -> None:
    tests = Path(__file__).parent
    out = subprocess.run([PY, "-c", STALE_LAB], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": f"{tests}:{tests.parent}"})
    lab_dir, netns, shim = out.stdout.split()
    assert Path(lab_dir).exists() and not dead(int(shim)), out.stderr
    PodLab.start().close()
    assert not Path(lab_dir).exists() and dead(int(shim))
    assert netns not in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                       text=True).stdout.split()


def test_pod_dns_names_are_the_fqdn_then_what_the_search_path_completes() -> None:
    assert pod_dns_names("w-0", "workers", "ml") == [
        "w-0.workers.ml.svc.cluster.local", "w-0.workers.ml.svc", "w-0.workers.ml",
        "w-0.workers"]
    assert pod_dns_names("solo", "", "ml") == []


def test_without_network_namespaces_the_lab_is_unavailable_and_says_why(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FORCE_LOOPBACK_ENV, "1")
    with pytest.raises(PodLabUnavailable, match=f"{FORCE_LOOPBACK_ENV}=1: no network namespaces"):
        PodLab.start()
