"""The Slurm test cluster of tests/slurmlab.py is real: nodes on their own addresses, jobs and
steps of an unprivileged user submitted over SSH from the login node, TCP between the steps of
two nodes, and a killed node that Slurm sees go down and come back."""

from __future__ import annotations

import os
import pwd
import shlex
import sys
import threading
import time

import paramiko
import pytest
from slurmlab import SlurmLab

pytestmark = [pytest.mark.slurm]


def ssh(lab: SlurmLab, command: str, timeout: float = 60) -> tuple[int, str, str]:
    """Run ``command`` on the login node as the lab's plain user, over SSH (no environment)."""
    client = paramiko.SSHClient()
    client.load_host_keys(lab.known_hosts)
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    client.connect(lab.login.address, port=22, username=lab.user, key_filename=lab.key_file,
                   timeout=10, allow_agent=False, look_for_keys=False)
    try:
        _, stdout, stderr = client.exec_command(command, timeout=timeout)
        out, err = stdout.read().decode(), stderr.read().decode()
        return stdout.channel.recv_exit_status(), out, err
    finally:
        client.close()


def ok(lab: SlurmLab, command: str, timeout: float = 60) -> str:
    rc, out, err = ssh(lab, command, timeout)
    assert rc == 0, f"{command!r} exited {rc}: {err or out}"
    return out


def submit(lab: SlurmLab, args: str) -> str:
    """sbatch over SSH on the login node as the plain user; the job id once it runs."""
    job = ok(lab, f"sbatch --parsable {args}").strip().split(";")[0]
    assert job.isdigit(), job
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        states = {j["id"]: j["state"] for j in lab.squeue()}
        if states.get(job) == "RUNNING":
            return job
        time.sleep(0.05)
    raise AssertionError(f"job {job} not running after 20 s: {lab.squeue()}")


def test_nodes_are_idle_on_their_own_addresses(slurm: SlurmLab) -> None:
    assert [n.name for n in slurm.nodes] == ["n1", "n2", "n3"]
    assert slurm.node_states() == {"n1": "idle", "n2": "idle", "n3": "idle"}  # no FUTURE ones
    for node in slurm.nodes:
        shown = slurm.run("scontrol", "show", "node", node.name).stdout
        assert f"NodeAddr={node.address} " in shown
        assert "State=IDLE " in shown
        assert node.address == node.host.address
    assert len({slurm.login.address, *(n.address for n in slurm.nodes)}) == 4
    assert slurm.login_host_key().startswith("ssh-ed25519 ")
    # the plain user on the login node, over SSH, with nothing set: the lab's cluster
    out = ok(slurm, "env | grep -c '^SLURM' || true; sinfo -h -N -o '%N %T' -p main")
    assert out.split("\n", 1)[1].split() == ["n1", "idle", "n2", "idle", "n3", "idle"]
    assert out.split("\n", 1)[0] == "0"


def test_batch_job_and_overlapping_steps_of_the_plain_user(slurm: SlurmLab) -> None:
    uid = pwd.getpwnam(slurm.user).pw_uid
    assert uid != 0
    job = submit(slurm, "-N3 --ntasks-per-node=1 --job-name=lab-sleep --wrap 'sleep 300'")
    assert slurm.squeue(user=slurm.user) == [
        {"id": job, "name": "lab-sleep", "state": "RUNNING", "user": slurm.user, "nodes": "n[1-3]"}]
    nodelist = ok(slurm, f"squeue -h -j {job} -o %N").strip()
    assert ok(slurm, f"scontrol show hostnames {nodelist}").split() == ["n1", "n2", "n3"]

    n2 = slurm.node("n2")
    probe = ("import os,socket;s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM);"
             f"s.connect(({slurm.bridge_address!r},9));"
             "print(os.getuid(),socket.gethostname(),s.getsockname()[0],os.environ['SLURM_STEP_ID'])")
    step = f"srun --jobid {job} -w n2 -N1 -n1 --overlap"
    # a long step on n2 and, while it runs, two more steps on the same node
    results: list[str] = []
    long = threading.Thread(target=lambda: results.append(
        ok(slurm, f"{step} sh -c 'sleep 3; id -u'")))
    long.start()
    time.sleep(1)
    first = ok(slurm, f"{step} {sys.executable} -c {shlex.quote(probe)}").split()
    second = ok(slurm, f"{step} {sys.executable} -c {shlex.quote(probe)}").split()
    long.join(30)
    assert results == [f"{uid}\n"]
    assert first[:3] == second[:3] == [str(uid), "n2", n2.address]
    assert first[3] != second[3]
    # Slurm's commands in a step on a node, with no SLURM_CONF: /etc/slurm is the lab's there
    shown = ok(slurm, f"{step} env -u SLURM_CONF scontrol show job {job}")
    assert f"JobId={job} " in shown and "JobState=RUNNING" in shown
    slurm.run("scancel", job)
    deadline = time.monotonic() + 30
    while slurm.squeue() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert slurm.squeue() == []


def test_tcp_between_steps_on_two_nodes(slurm: SlurmLab) -> None:
    job = submit(slurm, "-N3 --ntasks-per-node=1 --wrap 'sleep 300'")
    n2, n3 = slurm.node("n2"), slurm.node("n3")
    where = (n3.address, 23456)  # a port in n3's namespace, where only slurmd listens
    server = (f"import socket;s=socket.create_server({where!r});c,_=s.accept();"
              "c.sendall(b'hello from '+socket.gethostname().encode());c.close()")
    client = ("import socket,time\nfor _ in range(200):\n  try:\n"
              f"    c=socket.create_connection({where!r},timeout=2);break\n"
              "  except OSError: time.sleep(0.05)\nprint(c.recv(100).decode(),socket.gethostname())")
    py = sys.executable
    out = ok(slurm, f"srun --jobid {job} -w n3 -N1 -n1 --overlap {py} -c {shlex.quote(server)} & "
                    f"srun --jobid {job} -w n2 -N1 -n1 --overlap {py} -c {shlex.quote(client)}; wait")
    assert out.split() == ["hello", "from", "n3", "n2"]
    assert n2.address != n3.address


def test_scontrol_squeue_sbatch_srun_on_this_machine(slurm: SlurmLab) -> None:
    out = slurm.run("srun", "-N3", "--ntasks-per-node=1", "hostname", user=slurm.user).stdout
    assert sorted(out.split()) == ["n1", "n2", "n3"]
    # srun's job is listed (COMPLETING) until slurmctld hears every node's end of it: seconds
    # on a loaded machine
    deadline = time.monotonic() + 60
    while slurm.squeue() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert slurm.squeue() == []
    job = slurm.run("sbatch", "--parsable", "-p", "short", "-N1", "--wrap", "sleep 300",
                    user=slurm.user).stdout.strip()
    jobs = slurm.squeue()
    assert [(j["id"], j["user"]) for j in jobs] == [(job, slurm.user)]
    assert "TimeLimit=00:03:00" in slurm.run("scontrol", "show", "job", job).stdout
    slurm.cancel_all()
    assert slurm.squeue() == []


def test_a_killed_node_goes_down_and_comes_back(slurm: SlurmLab) -> None:
    job = submit(slurm, "-N3 --ntasks-per-node=1 --wrap 'sleep 300'")
    # a task of the user on n3 that the loss of the node must take with it
    marker = f"slurmlab-task-{job}"
    step = ssh_background(slurm, f"srun --jobid {job} -w n3 -N1 -n1 --overlap "
                                 f"{sys.executable} -c 'import time; time.sleep(300)' {marker}")
    deadline = time.monotonic() + 20
    while not _pids_of(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _pids_of(marker)
    started = time.monotonic()
    slurm.kill_node("n3")
    assert not _pids_of(marker)
    state, seen = "", dict[str, float]()
    while time.monotonic() - started < 60:
        state = slurm.node_states()["n3"]
        seen.setdefault(state, round(time.monotonic() - started, 1))
        if state.startswith("down"):
            break
        time.sleep(0.2)
    assert state == "down*", f"n3 is {state!r} 60 s after its slurmd was killed: {seen}"
    assert "mixed*" in seen  # not responding before down
    print(f"n3 after the kill: {seen}")
    # slurmctld told the step's srun on the login node (it found it by its host name): it ends
    step.join(15)
    assert not step.is_alive()
    # the batch job lost a node: requeued (JobRequeue=1), it waits for three nodes again
    assert [j["state"] for j in slurm.squeue() if j["id"] == job] in (["PENDING"], ["COMPLETING"])
    slurm.cancel_all()
    slurm.start_node("n3")
    started = time.monotonic()
    slurm.wait_idle(timeout=30)
    print(f"n3 idle again {time.monotonic() - started:.1f} s after its slurmd started")
    out = slurm.run("srun", "-w", "n3", "-N1", "hostname", user=slurm.user).stdout
    assert out.split() == ["n3"]


def ssh_background(lab: SlurmLab, command: str) -> threading.Thread:
    thread = threading.Thread(target=ssh, args=(lab, command, 120), daemon=True)
    thread.start()
    return thread


def _pids_of(marker: str) -> list[int]:
    """This Python's processes whose last argument is ``marker`` (the task, not its srun)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    argv = f.read().rstrip(b"\0").split(b"\0")
            except OSError:
                continue
            if argv[0] == sys.executable.encode() and argv[-1] == marker.encode():
                found.append(int(entry.name))
    return found
