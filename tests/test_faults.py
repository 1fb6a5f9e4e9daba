"""The fault matrix on the namespace test cluster: each way a multi-worker run fails is detected,
classified, recovered and measured, with real TensorFlow across real hosts."""

from __future__ import annotations

import shlex
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers import namespace_commands, release_run, write_spec
from hostlab import HostLab, LabHost

from orchestrator import paths
from orchestrator.api import Cluster
from orchestrator.errors import RunFailed
from orchestrator.events import Event
from orchestrator.state import AttemptRecord, Store
from orchestrator.view import RunResult, RunView

pytestmark = [pytest.mark.ssh, pytest.mark.tf]
EVERY = 10  # checkpoint interval, in steps
BODY = """\
name: {name}
job: {{module: {module}, epochs: 2, steps_per_epoch: 40, progress_every_steps: 1}}
checkpoint: {{every_steps: 10}}
retry: {{max_restarts: 3, backoff_initial_s: 0.2, backoff_max_s: 1}}
timeouts: {{stop_grace_s: 1, poll_s: 4, hang_s: 10, startup_s: {startup_s}, repair_s: 90}}
"""


@dataclass
class Fault:
    """What a fault injector knows: the hosts and each task's pid, per attempt."""

    hosts: list[LabHost]
    pids: dict[tuple[int, str], int] = field(default_factory=dict)
    last_checkpoint: int | None = None
    fired: list[str] = field(default_factory=list)
    timers: list[threading.Timer] = field(default_factory=list)

    def host_of(self, task: str) -> LabHost:
        return self.hosts[int(task.split(":")[1])]

    def later(self, seconds: float, action: Callable[[], None]) -> None:
        timer = threading.Timer(seconds, action)
        timer.start()
        self.timers.append(timer)


Trigger = Callable[[Fault, RunView, Event | None], bool]
Action = Callable[[Fault, RunView, Event | None], None]


def progress_of(task: str, step: int = 15) -> Trigger:
    def trigger(fault: Fault, view: RunView, event: Event | None) -> bool:
        return (event is not None and event.attempt == 1 and event.kind == "progress" and event.task == task
                and int(event.get("step")) >= step)
    return trigger


def train_with_fault(hostlab: HostLab, tmp_path: Path, name: str, trigger: Trigger,
                     action: Action, *, startup_s: int = 120,
                     module: str = "tests.workloads.paced_digits", extra: str = "",
                     cluster_hook: Callable[[Cluster, Fault], None] | None = None,
                     doctor: bool = True, hosts_n: int = 2) -> tuple[RunResult, Fault]:
    """Train on ``hosts_n`` lab hosts (2 where a third adds nothing to the fault: each host
    is a task, and a task is seconds of CPU at its start) and inject ``action`` once
    ``trigger`` holds. The default workload
    is paced (0.2 s a batch) until the fault is injected, so a trigger on a step event acts
    while training still runs however late the event is read; then every host's run is
    released to full speed. With the doctor, the first attempt's tasks start warm while it
    checks (their ``started`` comes at the go); without, cold, once the plan is made."""
    hosts = hostlab.hosts(hosts_n)
    path = write_spec(tmp_path, hostlab, hosts, BODY.format(name=name, startup_s=startup_s,
                                                                module=module) + extra)
    cluster = Cluster.from_spec(path)
    fault = Fault(hosts)
    if cluster_hook is not None:
        cluster_hook(cluster, fault)

    def listener(view: RunView, event: Event | None) -> None:
        if event is not None and event.kind == "started":
            fault.pids[(event.attempt, event.task)] = int(event.get("pid"))
        if event is not None and event.kind == "checkpoint" and event.attempt == 1:
            fault.last_checkpoint = int(event.get("step"))
        if not fault.fired and trigger(fault, view, event):
            fault.fired.append(f"{event.kind} {event.task} step {event.get('step')}" if event
                               else f"mirrored step {view.mirrored_step}")
            action(fault, view, event)
            release(hosts, name, view.run_id)
        elif fault.fired and event is not None and event.kind == "started" and event.attempt > 1:
            release(hosts, name, view.run_id)  # a host whose disk was wiped has a new run dir

    try:
        result = cluster.train(listener=listener, doctor=doctor).wait()
    finally:
        for timer in fault.timers:
            timer.join()
        for h in hosts:
            h.heal()
        cluster.down()
    assert fault.fired, "the fault was never injected"
    return result, fault


def release(hosts: list[LabHost], cluster: str, run_id: str) -> None:
    """Let a ``tests.workloads.paced_digits`` run go at full speed on every host whose run
    directory is there (a host whose disk was wiped has none until its task is relaunched)."""
    for h in hosts:
        release_run(paths.host_root(h.home, cluster), run_id)


def assert_recovered(result: RunResult, cause: str, task: str,
                     max_lost: int = EVERY) -> AttemptRecord:
    assert result.status == "succeeded"
    assert len(set(result.digests.values())) == 1  # every worker ends with the same weights
    first = result.attempts[0]
    assert (first.cause, first.failed_task) == (cause, task), first
    assert first.detect_s is not None and first.recovery_s is not None and first.recovery_s > 0
    assert first.steps_lost is not None and 0 <= first.steps_lost <= max_lost
    assert result.attempts[-1].status == "succeeded"
    assert result.attempts[1].resumed_from_step == (first.last_step or 0) - first.steps_lost
    assert Store().get_run(result.run_id).attempts[0].cause == cause
    return first


def kill_task(signal: str) -> Action:
    def action(fault: Fault, view: RunView, event: Event | None) -> None:
        assert event is not None
        host = fault.host_of(event.task)
        host.run(["kill", f"-{signal}", str(fault.pids[(1, event.task)])])
    return action


def test_chief_process_killed_a_worker_saves_in_its_place(hostlab: HostLab,
                                                           tmp_path: Path) -> None:
    # 3 hosts: two survivors, and the controller asks the first of them
    result, _ = train_with_fault(hostlab, tmp_path, "f-crash", progress_of("worker:0"),
                                 kill_task("KILL"), hosts_n=3)
    first = assert_recovered(result, "crashed", "worker:0", max_lost=1)
    assert first.exit_code == 137 and "signal 9" in first.detail
    assert (first.resumed_from_step or 0) == 0 and (result.attempts[1].resumed_from_step or 0) > 0
    # The controller asked worker:1 to save the group's state in the dead chief's place, on
    # its own host's disk; the relaunch copied it from there to the chief's host and the
    # others, so the chief resumed at that step, not at the last checkpoint (a multiple of 10).
    assert first.snapshot == (f"worker:1 saved its state at step {first.snapshot_step} after "
                              "worker:0 failed"), first.snapshot
    assert result.attempts[1].resumed_from_step == first.snapshot_step


def test_chief_host_lost_with_its_disk_resumes_from_the_controllers_copy(
        hostlab: HostLab, tmp_path: Path) -> None:
    mirrored_at_fire: list[int] = []

    def mirrored_one(fault: Fault, view: RunView, event: Event | None) -> bool:
        """A checkpoint of the chief's at step 20 or later has reached this machine."""
        if view.attempt == 1 and (view.mirrored_step or 0) >= 20:
            mirrored_at_fire.append(view.mirrored_step or 0)
            return True
        return False

    def lose_chief_host(fault: Fault, view: RunView, event: Event | None) -> None:
        chief = fault.hosts[0]
        chief.kill()  # every process on it, sshd included
        chief.run(["rm", "-rf", f"{chief.home}/.orchestrate/clusters/f-chief/runs"])
        fault.later(4.0, chief.heal)  # the machine comes back, its disk empty

    # Paced at 0.5 s a step (a checkpoint every 5 s) until the fault: the controller's copy,
    # which pulls at most 5% of the time, has a step >= 20 well before the paced run could end
    # even on a loaded machine. (Waiting for it to hold the newest checkpoint never happened
    # on a loaded CI machine: the copy trailed the chief by one pull to the end.)
    result, _ = train_with_fault(hostlab, tmp_path, "f-chief", mirrored_one, lose_chief_host,
                                 extra='env: {DIGITS_PACE_S: "0.5"}\n')
    # The chief's disk is gone, so the resume comes from this machine's copy (or a newer one
    # that reached another host): never from before the step this machine held at the fault.
    first = assert_recovered(result, "host_lost", "worker:0", max_lost=80)
    assert mirrored_at_fire and mirrored_at_fire[0] >= 20
    assert (result.attempts[1].resumed_from_step or 0) >= mirrored_at_fire[0], \
        (mirrored_at_fire, first.last_step, first.steps_lost)


def test_a_machine_back_within_a_poll_is_still_a_lost_host(hostlab: HostLab, tmp_path: Path) -> None:
    """Every process of worker:1's machine dies (sshd too) and it is back 1 s later, well within
    poll_s and the SSH connect retries: the next poll reconnects and finds the task gone, and
    the host answers as if nothing happened. The dropped connection tells a machine that went
    away from a task killed on a machine that stayed."""
    def restart_machine(fault: Fault, view: RunView, event: Event | None) -> None:
        host = fault.hosts[1]
        host.kill()
        fault.later(1.0, host.heal)

    # 2 hosts: the chief's collectives with the dead machine fail at once, and the chief's exit
    # is mostly read before the poll that reconnects to worker:1's machine. The connection that
    # dropped since worker:1 was last seen running names the lost host all the same.
    result, _ = train_with_fault(hostlab, tmp_path, "f-blink", progress_of("worker:1"),
                                 restart_machine)
    first = assert_recovered(result, "host_lost", "worker:1")
    assert "vanished" in first.detail or "answer" in first.detail, first.detail


@pytest.mark.parametrize(("lost", "saver", "name"), [("worker:1", "worker:0", "f-cut"),
                                                      ("worker:0", "worker:1", "f-cutchief")],
                         ids=["worker", "chief"])
def test_host_cut_off_from_the_network(hostlab: HostLab, tmp_path: Path, lost: str, saver: str,
                                       name: str) -> None:
    """A host cut off for 8 s: the survivor's step hangs on it; the controller's request makes
    the saving task abort the step's collectives and save the step it completed. When the
    chief's host is the one cut, worker:1 (its own host still reachable) saves into the
    chief's checkpoint directory on its own host, and the relaunch sends that snapshot to
    every host, the chief's, back by then, included."""
    index = int(lost.split(":")[1])

    def cut(fault: Fault, view: RunView, event: Event | None) -> None:
        fault.hosts[index].cut()
        fault.later(8.0, fault.hosts[index].restore)

    result, fault = train_with_fault(hostlab, tmp_path, name, progress_of(lost), cut)
    first = assert_recovered(result, "host_lost", lost, max_lost=1)
    assert fault.hosts[index].address in first.detail
    assert first.snapshot == (f"{saver} saved its state at step {first.snapshot_step} after "
                              f"{lost} failed"), first.snapshot
    assert result.attempts[1].resumed_from_step == first.snapshot_step
    # the task that was cut off with its host was stopped once the host came back
    assert namespace_commands(fault.hosts[index]) <= {"sshd", "sshd-session"}


def test_hung_worker_is_caught_by_the_progress_watchdog(hostlab: HostLab, tmp_path: Path) -> None:
    result, _ = train_with_fault(hostlab, tmp_path, "f-hang", progress_of("worker:1"),
                                 kill_task("STOP"))
    first = assert_recovered(result, "hung", "worker:1", max_lost=1)
    assert "worker:1 is stopped" in first.detail
    # killed first, the stopped task failed the chief's step on a lost peer: the chief saved
    # the step it had completed
    assert first.snapshot == (f"worker:0 saved its state at step {first.snapshot_step} after "
                              "worker:1 failed"), first.snapshot
    assert result.attempts[1].resumed_from_step == first.snapshot_step


def test_peer_that_never_connects_hits_the_startup_timeout(hostlab: HostLab,
                                                           tmp_path: Path) -> None:
    def never_connects(fault: Fault, view: RunView, event: Event | None) -> bool:
        return (event is not None and event.attempt == 1 and event.kind == "started"
                and event.task == "worker:1")

    # A cold start (no doctor, no warm first attempt): ``started`` is said as the process
    # starts, seconds before it could connect (a warm task says it at its go, and connects
    # at once: it would be stopped having trained).
    result, _ = train_with_fault(hostlab, tmp_path, "f-start", never_connects, kill_task("STOP"),
                                 startup_s=25, doctor=False)
    assert result.status == "succeeded"
    first = result.attempts[0]
    assert (first.cause, first.failed_task) == ("startup_timeout", "worker:1")
    assert "did not reach the first step" in first.detail and "worker:1 is stopped" in first.detail
    assert (result.attempts[1].resumed_from_step or 0) == 0


def test_taken_port_is_avoided_on_the_next_attempt(hostlab: HostLab, tmp_path: Path) -> None:
    squatters: list[subprocess.Popen[bytes]] = []

    def squat_after_the_probe(cluster: Cluster, fault: Fault) -> None:
        start_group = cluster.provider.start_group

        def squat(plan: object) -> object:
            # After the attempt's plan probed the ports, before its tasks start (or, warm
            # since the doctor ran, go and bind): another program grabs the port meanwhile.
            if not squatters:
                host = fault.hosts[1]
                # SO_REUSEADDR: an earlier test's connections may leave 23456 in TIME_WAIT;
                # a listening squatter blocks gRPC's bind either way.
                code = ("import socket, time; s = socket.socket(); "
                        "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
                        "s.bind(('', 23456)); s.listen(); print('bound', flush=True); "
                        "time.sleep(600)")
                argv = ["ip", "netns", "exec", str(host.namespace), sys.executable, "-c", code]
                squatters.append(subprocess.Popen(argv, stdout=subprocess.PIPE))
                assert squatters[0].stdout is not None and squatters[0].stdout.readline()
            return start_group(plan)  # type: ignore[arg-type]

        cluster.provider.start_group = squat  # type: ignore[method-assign,assignment]

    def never(fault: Fault, view: RunView, event: Event | None) -> bool:
        fault.fired.append("squatter")  # the fault is the squatter itself
        return False

    try:
        result, _ = train_with_fault(hostlab, tmp_path, "f-port", never, kill_task("KILL"),
                                     cluster_hook=squat_after_the_probe)
    finally:
        for proc in squatters:
            proc.kill()
            proc.wait()
    assert result.status == "succeeded"
    first, second = result.attempts[:2]
    assert (first.cause, first.failed_task) == ("port_conflict", "worker:1")
    assert first.tasks[1].endpoint.endswith(":23456")
    assert not second.tasks[1].endpoint.endswith(":23456")


def test_broken_user_code_fails_fast_with_its_traceback(hostlab: HostLab, tmp_path: Path) -> None:
    code = tmp_path / "code"
    code.mkdir()
    (code / "broken.py").write_text(
        "def build_model():\n    return undefined_layer_factory()\n"
        "def make_dataset(global_batch_size, seed=None):\n    return None\n")
    hosts = hostlab.hosts(2)
    path = write_spec(tmp_path, hostlab, hosts, "name: f-user\njob: {module: broken}\n"
                      "retry: {max_restarts: 3}\n")
    path.write_text(path.read_text().replace(f"workdir: {Path(__file__).parent.parent}",
                                             f"workdir: {shlex.quote(str(code))}"))
    cluster = Cluster.from_spec(path)
    with pytest.raises(RunFailed) as info:
        cluster.train()
    cluster.down()
    report = str(info.value)
    assert "user_error" in report and "NameError" in report
    assert "undefined_layer_factory" in report  # the traceback tail is in the report
    assert len(Store().get_run(info.value.run_id).attempts) == 1  # not retried
