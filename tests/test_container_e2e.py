"""Tasks in containers, driven the way a user drives them: the worker image built from
docker/Dockerfile (tests/containers.py, its JAX variant), real podman containers with the host's
network, TensorFlow's gRPC RING collectives (and, for a JAX job, JAX's distributed service and
gloo) between containers, on 2 local tasks and on sshd hosts in network namespaces logged into
as an unprivileged user (a podman service per host, its socket given to that user as docker's
is to the docker group)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from containers import IMAGE_TIMEOUT_S, PODMAN, podman_usable
from helpers import REPO, events_in, write_spec
from hostlab import INIT_DIR, HostLab, LabHost

from orchestrator.api import Cluster
from orchestrator.errors import RunFailed
from orchestrator.events import Event
from orchestrator.view import RunView

pytestmark = [pytest.mark.tf, pytest.mark.container,
              pytest.mark.timeout(IMAGE_TIMEOUT_S + 600)]

PACED = ("{module: tests.workloads.paced_digits, epochs: 2, steps_per_epoch: 30, "
         "progress_every_steps: 1}")
JAX_JOB = ("{module: examples.keras3_digits, backend: jax, epochs: 1, steps_per_epoch: 20, "
           "deterministic: true}")




def containers_of(cluster: str, *, every: bool = True, host: LabHost | None = None,
                  run: str | None = None) -> list[str]:
    """Names of the cluster's containers (``every``: stopped ones too), on this machine's
    podman or, with ``host``, on that host's podman service; with ``run``, that run's only
    (another session's test killed before its cleanup leaves containers of the same name)."""
    words = ["ps", *(["-a"] if every else []), "--format", "{{.Names}}",
             "--filter", f"label=orchestrate.cluster={cluster}",
             *(["--filter", f"label=orchestrate.run={run}"] if run else [])]
    out = podman_on(host, *words).stdout
    return sorted(out.split())


def podman_on(host: LabHost | None, *argv: str,
              check: bool = True) -> subprocess.CompletedProcess[str]:
    """``podman ARGV`` on this machine, or as a client of ``host``'s podman service."""
    if host is None:
        return subprocess.run([*PODMAN, *argv], capture_output=True, text=True, check=check)
    env = {**os.environ, "CONTAINER_HOST": f"unix://{host.dir / 'podman.sock'}"}
    return subprocess.run(["podman", *argv], capture_output=True, text=True, check=check, env=env)


# The local container tests use this machine's own network (`--network host`), which tests
# on other xdist workers share: each cluster its own port range, which no other test uses.
LOCAL_PORTS = {"ct-local": 25600, "ct-attach": 25640, "ct-term": 25680, "ct-jax": 25720}


def local_spec(tmp_path: Path, name: str, image: str, *, pace: str = "0.05",
               job: str = PACED) -> Path:
    path = tmp_path / f"{name}.yaml"
    start = LOCAL_PORTS[name]
    path.write_text(textwrap.dedent(f"""\
        name: {name}
        workdir: {REPO}
        workers: 2
        ports: {{start: {start}, end: {start + 39}}}
        job: {job}
        container: {{image: "{image}", runtime: podman, pull: never}}
        checkpoint: {{every_steps: 10}}
        retry: {{max_restarts: 2, backoff_initial_s: 0.2, backoff_max_s: 1}}
        timeouts: {{startup_s: 240, stop_grace_s: 20}}
        env: {{DIGITS_PACE_S: "{pace}"}}
        """))
    return path


def kill_container_at(step: int, kill: Callable[[str], object], task: str = "worker:1"
                      ) -> Callable[[RunView, Event | None], None]:
    """A listener that kills ``task``'s container of attempt 1 once it reports ``step``."""
    done: list[int] = []

    def listener(view: RunView, event: Event | None) -> None:
        if (event is not None and event.attempt == 1 and event.kind == "progress"
                and event.task == task and event.get("step") >= step and not done):
            done.append(event.get("step"))
            kill(f"orch-{view.cluster}-{view.run_id}-a1-{task.replace(':', '-')}")

    return listener


def test_two_local_tasks_train_in_containers_and_a_killed_container_resumes(
        image: str, tmp_path: Path, orchestrate_home: Path) -> None:
    cluster = Cluster.from_spec(local_spec(tmp_path, "ct-local", image))
    cluster.up()
    kill = kill_container_at(15, lambda name: subprocess.run(
        [*PODMAN, "kill", name], check=True, capture_output=True))
    result = cluster.train(listener=kill).wait()
    first, second = result.attempts
    assert (first.cause, first.failed_task) == ("crashed", "worker:1")
    assert "137" in first.detail or "signal 9" in first.detail  # podman kill: SIGKILL
    # from the chief's snapshot at the step its peer's loss broke, not the last checkpoint
    assert first.snapshot_step is not None and first.snapshot.startswith("worker:0 saved its")
    assert second.resumed_from_step == first.snapshot_step
    for task in second.tasks:
        assert task.launcher == "podman"  # `--attach`, `down` and `logs` find it that way
        events = [json.loads(line.split(" ", 1)[1]) for line in Path(task.log).read_text()
                  .splitlines() if line.startswith("@orchestrate ")]
        assert any(e["event"] == "resumed" and e["step"] == second.resumed_from_step
                   for e in events)
    assert len(set(result.digests.values())) == 1  # both replicas hold one model
    assert containers_of("ct-local", run=result.run_id) == []  # --rm, and the killed one was removed
    cluster.down()


def test_a_keras3_module_trains_on_jax_in_two_local_containers_to_one_model(
        image: str, tmp_path: Path, orchestrate_home: Path) -> None:
    """``job.backend: jax`` in the image's JAX variant: the managed runtime's processes find
    each other through JAX's distributed service on the host's network, and end as one model."""
    cluster = Cluster.from_spec(local_spec(tmp_path, "ct-jax", image, job=JAX_JOB))
    cluster.up()
    result = cluster.train().wait()
    assert result.status == "succeeded" and len(result.attempts) == 1, result.attempts
    assert len(result.digests) == 2 and len(set(result.digests.values())) == 1
    for task in result.attempts[0].tasks:
        assert task.launcher == "podman"
        events = [json.loads(line.split(" ", 1)[1]) for line in Path(task.log).read_text()
                  .splitlines() if line.startswith("@orchestrate ")]
        connected = next(e for e in events if e["event"] == "connected")
        assert (connected["replicas"], connected["collectives"]) == (2, "gloo"), connected
        assert connected["jax_version"].startswith("0.10."), connected
        assert [e["step"] for e in events if e["event"] == "finished"] == [20]
    assert containers_of("ct-jax", run=result.run_id) == []
    cluster.down()


def cli(*args: str, **kwargs: object) -> subprocess.Popen[str]:
    process: subprocess.Popen[str] = subprocess.Popen(  # type: ignore[call-overload]
        [sys.executable, "-m", "orchestrator.cli", *args], text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kwargs)
    return process


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def test_attach_after_a_controller_kill_finds_the_containers_and_down_leaves_none(
        image: str, tmp_path: Path, orchestrate_home: Path) -> None:
    spec = local_spec(tmp_path, "ct-attach", image, pace="0.3")
    train = cli("train", str(spec), "--no-doctor")
    cluster = Cluster.from_spec(spec)
    try:
        def training() -> bool:
            logs = list(orchestrate_home.glob("clusters/ct-attach/runs/*/logs/attempt-1/worker-0.log"))
            return bool(logs) and '"event": "progress"' in logs[0].read_text()
        wait_for(lambda: bool(cluster.status().runs), 120, "the run recorded")
        run_id = cluster.status().runs[0].id
        wait_for(lambda: len(containers_of("ct-attach", every=False, run=run_id)) == 2, 240,
                 "2 containers")
        wait_for(training, 240, "a step recorded")
        train.kill()  # the controller dies; its tasks go on in their containers
        train.wait(30)
        running = containers_of("ct-attach", every=False, run=run_id)
        assert len(running) == 2 and all(n.startswith(f"orch-ct-attach-{run_id}-")
                                         for n in running), running
        attach = cli("train", str(spec), "--attach")
        try:
            wait_for(lambda: cluster.status().runs[0].controller_pid == attach.pid, 120,
                     "the attach to take the run over")
        finally:
            down = subprocess.run([sys.executable, "-m", "orchestrator.cli", "down", str(spec)],
                                  capture_output=True, text=True, timeout=300)
            out, _ = attach.communicate(timeout=120)
        assert down.returncode == 0, down.stdout + down.stderr
        assert "stopped" in down.stdout
        assert attach.returncode != 0, out  # the attached run was stopped by down
        assert "down" in out
        assert containers_of("ct-attach") == []
        run = cluster.status().runs[0]
        assert run.status == "stopped"
    finally:
        if train.poll() is None:
            train.kill()
        subprocess.run([*PODMAN, "rm", "-f", *containers_of("ct-attach")], capture_output=True)


def podman_hosts(hostlab: HostLab) -> tuple[list[LabHost], str]:
    """2 namespace hosts, each with a podman service whose socket the plain user may use; the
    hosts and that user."""
    hostlab.require_partition()
    hosts = hostlab.hosts(2)
    user = hostlab.plain_user()
    for h in hosts:
        h.serve_podman(user=user)
    return hosts, user


def test_on_ssh_hosts_as_a_plain_user_a_killed_container_resumes_and_down_leaves_none(
        image: str, hostlab: HostLab, tmp_path: Path, orchestrate_home: Path) -> None:
    """Through the CLI, as a user would: up, doctor, train (a container killed mid-run), down."""
    hosts, user = podman_hosts(hostlab)
    path = write_spec(tmp_path, hostlab, hosts, f"""\
        name: ct-ssh
        job: {PACED}
        container: {{image: "{image}", runtime: podman}}
        env: {{DIGITS_PACE_S: "0.1"}}
        checkpoint: {{every_steps: 10}}
        retry: {{max_restarts: 2, backoff_initial_s: 0.5, backoff_max_s: 2}}
        timeouts: {{startup_s: 240, stop_grace_s: 20}}
        """, user=user)
    train: subprocess.Popen[str] | None = None
    try:
        up = orchestrate("up", str(path))
        assert up.returncode == 0, up.stdout + up.stderr
        doctor = orchestrate("doctor", str(path))
        assert doctor.returncode == 0, doctor.stdout + doctor.stderr
        assert doctor.stdout.count("container: image ") == 2  # both hosts have the image

        train = cli("train", str(path))
        chief_logs = f"{hosts[0].plain_home}/.orchestrate/clusters/ct-ssh/runs/*/logs/attempt-1/worker-0.log"

        def checkpointed() -> bool:
            logs = list(Path("/").glob(chief_logs.lstrip("/")))
            return bool(logs) and '"event": "checkpoint"' in logs[0].read_text()

        wait_for(checkpointed, 300, "the chief's first checkpoint")
        # (the lab's hosts share this machine's podman storage: each service lists them all)
        names = [n for n in containers_of("ct-ssh", every=False, host=hosts[1])
                 if n.endswith("-a1-worker-1")]
        assert len(names) == 1
        podman_on(hosts[1], "kill", names[0])
        out, _ = train.communicate(timeout=600)
        assert train.returncode == 0, out
        assert "attempt 1 failed: crashed in worker:1" in out
        run = Cluster.from_spec(path).run()
        first, second = run.attempts
        assert (first.cause, first.failed_task) == ("crashed", "worker:1")
        assert second.resumed_from_step == first.snapshot_step is not None, first.snapshot
        assert f"resumed from a survivor's snapshot at step {first.snapshot_step}" in out
        for h, task in zip(hosts, second.tasks, strict=True):
            assert task.log.startswith(h.plain_home)  # the unprivileged user's own home
            assert any(e.kind == "resumed" for e in events_in(h, task.log))
        # what TensorFlow wrote in the container belongs to the SSH user, not to root
        owners = hosts[0].run(f"find {hosts[0].plain_home}/.orchestrate -path '*checkpoints*' "
                              "-type f -exec stat -c %U {} +").stdout.split()
        assert owners and set(owners) == {user}
        for h in hosts:
            assert containers_of("ct-ssh", host=h) == []
    finally:
        if train is not None and train.poll() is None:
            train.kill()
            train.wait()
        down = orchestrate("down", str(path))
        assert down.returncode == 0, down.stdout + down.stderr
        for h in hosts:
            assert containers_of("ct-ssh", host=h) == []


def test_a_keras3_module_on_jax_in_containers_on_ssh_hosts_resumes_a_killed_one_to_one_model(
        image: str, hostlab: HostLab, tmp_path: Path, orchestrate_home: Path) -> None:
    """``job.backend: jax`` in containers on 2 SSH hosts, logged into as the plain user: gloo
    in each container looks the host's name up in the /etc/hosts podman copied from the host
    (the host's own address, as the doctor asks), a killed container restarts the group from
    the chief's snapshot of the step the kill broke, and both tasks end with one model."""
    hosts, user = podman_hosts(hostlab)
    path = write_spec(tmp_path, hostlab, hosts, f"""\
        name: ct-jax-ssh
        job: {{module: tests.workloads.paced_jax_digits, backend: jax, epochs: 1,
               steps_per_epoch: 40, deterministic: true, progress_every_steps: 1}}
        container: {{image: "{image}", runtime: podman}}
        checkpoint: {{every_steps: 5}}
        retry: {{max_restarts: 2, backoff_initial_s: 0.5, backoff_max_s: 2}}
        timeouts: {{startup_s: 240, stop_grace_s: 20}}
        """, user=user)
    # Paced (0.2 s a step): unpaced, a step takes milliseconds, and on a loaded machine the
    # kill seen at step 12 landed after the chief's step 40, in the model's save (a collective
    # too), where there is nothing to snapshot: the chief had checkpointed step 40.
    cluster = Cluster.from_spec(path)
    try:
        cluster.up()
        kill = kill_container_at(12, lambda name: podman_on(hosts[1], "kill", name))
        result = cluster.train(listener=kill).wait()
        first, second = result.attempts
        assert (first.cause, first.failed_task) == ("crashed", "worker:1"), first
        # The chief, in its container, saved the state of the step the kill broke.
        assert first.snapshot == \
            f"worker:0 saved its state at step {first.snapshot_step} after worker:1 failed", \
            first.snapshot
        assert second.resumed_from_step == first.snapshot_step >= 12
        assert result.status == "succeeded"
        for h, task in zip(hosts, second.tasks, strict=True):
            assert task.launcher == "podman" and task.log.startswith(h.plain_home)
            events = events_in(h, task.log)
            connected = next(e for e in events if e.kind == "connected")
            assert (connected.get("replicas"), connected.get("collectives")) == (2, "gloo")
            assert any(e.kind == "resumed" and e.get("step") == second.resumed_from_step
                       for e in events)
            assert [e.get("step") for e in events if e.kind == "finished"] == [40]
        assert len(result.digests) == 2 and len(set(result.digests.values())) == 1
        for h in hosts:
            assert containers_of("ct-jax-ssh", host=h) == []
    finally:
        cluster.down()
    for h in hosts:
        assert containers_of("ct-jax-ssh", host=h) == []


def orchestrate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args],
                          capture_output=True, text=True, timeout=600)


def test_a_user_without_access_to_the_engine_gets_the_host_and_the_fix(
        image: str, hostlab: HostLab, tmp_path: Path, orchestrate_home: Path) -> None:
    hostlab.require_partition()
    hosts = hostlab.hosts(2)
    user = hostlab.plain_user()
    hosts[0].serve_podman(user=user)
    hosts[1].serve_podman(user=None)  # the socket is root's: like a user not in the docker group
    path = write_spec(tmp_path, hostlab, hosts, f"""\
        name: ct-denied
        job: {PACED}
        container: {{image: "{image}", runtime: podman}}
        """, user=user)
    try:
        doctor = subprocess.run([sys.executable, "-m", "orchestrator.cli", "doctor", str(path)],
                                capture_output=True, text=True, timeout=300)
        assert doctor.returncode != 0
        text = doctor.stdout + doctor.stderr
        assert "Traceback" not in text
        assert "podman on ct-denied-1 cannot be used by its SSH user" in text
        assert "permission denied" in text.lower()
        assert f"give {user} access to the podman socket on ct-denied-1" in text
        assert "ct-denied-0" not in text.split("problem")[-1]  # the other host is fine
        up = subprocess.run([sys.executable, "-m", "orchestrator.cli", "up", str(path)],
                            capture_output=True, text=True, timeout=300)
        assert up.returncode != 0 and "Traceback" not in up.stdout + up.stderr
        assert "ct-denied-1" in up.stdout + up.stderr
        assert containers_of("ct-denied", host=hosts[0]) == []
    finally:
        hosts[1].serve_podman(user=user)


def test_a_host_whose_podman_has_no_init_is_named_with_the_fix_and_never_blamed_on_the_code(
        image: str, hostlab: HostLab, tmp_path: Path, orchestrate_home: Path) -> None:
    """podman without catatonit (Debian installs it only as a Recommends) cannot start a task's
    container (`--init`): doctor, up and train name the host and the fix before any task
    starts, and a host that loses its init during a run fails the relaunch as the engine's
    failure (with the engine's words and the fix), not the user's code's, and not retried."""
    hostlab.require_partition()
    hosts = hostlab.hosts(2)
    user = hostlab.plain_user()
    hosts[0].serve_podman(user=user)
    hosts[1].serve_podman(user=user, without_init=True)
    path = write_spec(tmp_path, hostlab, hosts, f"""\
        name: ct-noinit
        job: {PACED}
        container: {{image: "{image}", runtime: podman}}
        retry: {{max_restarts: 2, backoff_initial_s: 0.2, backoff_max_s: 1}}
        timeouts: {{startup_s: 240, stop_grace_s: 5}}
        """, user=user)
    engine_said = (f"Error: container-init binary not found on the host: stat {INIT_DIR}/"
                   "catatonit: no such file or directory")
    try:
        doctor = orchestrate("doctor", str(path))
        text = doctor.stdout + doctor.stderr
        assert doctor.returncode != 0 and "Traceback" not in text, text
        assert "podman on ct-noinit-1 cannot start a task's container" in text
        assert engine_said in text and "sudo apt-get install catatonit" in text
        assert "ct-noinit-0" not in text.split("problem")[-1]  # the other host is fine
        up = orchestrate("up", str(path))
        text = up.stdout + up.stderr
        assert up.returncode != 0 and "Traceback" not in text, text
        assert f"ct-noinit-1: podman cannot start a container of {image}: {engine_said}" in text
        assert "sudo apt-get install catatonit" in text

        # The host loses its init while a run trains (its podman service restarted without
        # it, the running container killed): the relaunch there fails in the engine.
        hosts[1].serve_podman(user=user)
        broken: list[str] = []

        def break_engine(view: RunView, event: Event | None) -> None:
            if (event is not None and event.attempt == 1 and event.kind == "progress"
                    and event.get("step") >= 3 and not broken):
                broken.append(f"orch-ct-noinit-{view.run_id}-a1-worker-1")
                hosts[1].serve_podman(user=user, without_init=True)
                podman_on(hosts[1], "kill", broken[0], check=False)

        cluster = Cluster.from_spec(path)
        with pytest.raises(RunFailed) as failed:
            cluster.train(listener=break_engine)
        assert broken
        *before, last = cluster.run().attempts
        assert (last.cause, last.failed_task, last.exit_code) == ("engine_error", "worker:1", 125)
        assert engine_said in last.detail and "ct-noinit-1" in last.detail
        assert [a.cause for a in before] == ["crashed"]  # the engine's failure is not retried
        assert failed.value.fix is not None and "sudo apt-get install catatonit" in failed.value.fix
        assert "user_error" not in str(failed.value) and "training code" not in str(failed.value)
        for h in hosts:
            assert containers_of("ct-noinit", host=h) == []
    finally:
        hosts[1].serve_podman(user=user)
        down = orchestrate("down", str(path))
        assert down.returncode == 0, down.stdout + down.stderr


def test_an_image_that_does_not_exist_and_an_engine_that_is_missing(
        tmp_path: Path, orchestrate_home: Path) -> None:
    reason = podman_usable()
    if reason is not None:
        pytest.skip(reason)
    spec = tmp_path / "missing.yaml"
    spec.write_text(textwrap.dedent(f"""\
        name: ct-missing
        workdir: {REPO}
        job: {PACED}
        container: {{image: "localhost/orchestrate-no-such-image:1", runtime: podman}}
        """))
    up = subprocess.run([sys.executable, "-m", "orchestrator.cli", "up", str(spec)],
                        capture_output=True, text=True, timeout=300)
    text = up.stdout + up.stderr
    assert up.returncode != 0 and "Traceback" not in text
    assert "local-0: podman could not provide the image localhost/orchestrate-no-such-image:1" in text
    assert "check that localhost/orchestrate-no-such-image:1 exists" in text
    assert containers_of("ct-missing") == []

    # A PATH without the engine: every tool of this machine but podman and docker.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for directory in ("/usr/local/bin", "/usr/bin", "/bin"):
        for entry in Path(directory).iterdir():
            if entry.name not in {"podman", "docker"} and not (bin_dir / entry.name).exists():
                (bin_dir / entry.name).symlink_to(entry)
    env = {**os.environ, "PATH": str(bin_dir)}
    doctor = subprocess.run([sys.executable, "-m", "orchestrator.cli", "doctor", str(spec)],
                            capture_output=True, text=True, timeout=300, env=env)
    text = doctor.stdout + doctor.stderr
    assert doctor.returncode != 0 and "Traceback" not in text
    assert "podman is not installed on local-0" in text
    assert "apt-get install podman" in text


def test_the_containers_stop_with_a_planned_stop_saving_at_one_step(
        image: str, tmp_path: Path, orchestrate_home: Path) -> None:
    """SIGTERM through the engine reaches the task (``--init`` forwards it): every task saves
    at one step and exits 75, as outside a container."""
    cluster = Cluster.from_spec(local_spec(tmp_path, "ct-term", image, pace="0.2"))
    cluster.up()
    stopped: list[str] = []

    def listener(view: RunView, event: Event | None) -> None:
        if (event is not None and event.kind == "progress" and event.task == "worker:0"
                and event.get("step") >= 8 and not stopped):
            stopped.append("x")
            subprocess.run([*PODMAN, "stop", "-t", "30",
                            f"orch-ct-term-{view.run_id}-a1-worker-1"], check=True,
                           capture_output=True)

    run = cluster.train(listener=listener, wait=False)
    result = run.wait()
    first = result.attempts[0]
    assert first.cause == "preempted"
    assert {t.exit_code for t in first.tasks} == {75}
    assert result.attempts[1].resumed_from_step == first.last_step
    assert containers_of("ct-term", run=result.run_id) == []
    cluster.down()
