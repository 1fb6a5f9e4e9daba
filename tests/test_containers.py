"""The container launcher's pieces without an engine: the `run` command line a task gets (what
is mounted, passed and quoted), the spec's refusals, and the fix for each engine failure.
Real containers are in tests/test_container_e2e.py."""

from __future__ import annotations

import shlex
import subprocess
import textwrap
from pathlib import Path

import pytest

from orchestrator import containers
from orchestrator import plan as planning
from orchestrator.errors import SpecError
from orchestrator.hosts import Host, SSHEndpoint
from orchestrator.spec import Container, load


def spec_file(tmp_path: Path, container: str) -> Path:
    (tmp_path / "train.py").write_text("print('hi')\n")
    path = tmp_path / "c.yaml"
    path.write_text(textwrap.dedent(f"""\
        name: ct
        workers: 2
        job: {{command: [python, train.py]}}
        checkpoint: {{dir: {tmp_path}/shared/ckpt}}
        tensorboard: {{dir: {tmp_path}/shared/tb}}
        env: {{SECRET_TOKEN: "s3cr3t value; $(rm -rf /)"}}
        container: {container}
        """))
    return path


def built_plan(tmp_path: Path, container: str = '{image: "reg.example/p/worker:2.21"}'
               ) -> planning.ClusterPlan:
    spec = load(spec_file(tmp_path, container))
    hosts = [Host(name=f"h{i}", address=f"10.0.0.{i + 2}", root=f"{tmp_path}/home/u/.orchestrate/ct",
                  ssh=SSHEndpoint(address=f"10.0.0.{i + 2}", user="u")) for i in range(2)]
    return planning.build(spec, hosts, run_id="r1", python="/usr/bin/python3.11",
                          local_workdir=str(tmp_path))


def test_the_task_runs_the_images_python_with_its_directories_mounted(tmp_path: Path) -> None:
    plan = built_plan(tmp_path)
    task = plan.tasks[1]
    assert task.argv[:3] == ("python3", "-m", "worker")  # the image's interpreter
    assert "python3" in task.argv  # the command's `python` too
    assert task.env["PYTHONPATH"].endswith(f"{tmp_path}/home/u/.orchestrate/ct/lib")
    assert containers.mounts(task) == [f"{tmp_path}/home/u/.orchestrate/ct",
                                       f"{tmp_path}/shared/ckpt/ct/r1",
                                       f"{tmp_path}/shared/tb/ct/r1"]
    assert containers.name_of(task) == "orch-ct-r1-a1-worker-1"


def test_the_run_command_line_passes_env_by_name_and_quotes_every_word(tmp_path: Path) -> None:
    plan = built_plan(tmp_path, '{image: "reg.example/p/worker:2.21", runtime: podman, '
                      'options: ["--shm-size=8g"], gpus: all}')
    task = plan.tasks[0]
    argv = containers.run_argv(Container(image="reg.example/p/worker:2.21", runtime="podman",
                                         options=("--shm-size=8g",), gpus="all"), task)
    script = argv[2]
    assert argv[:2] == ["sh", "-c"] and argv[3] == "podman"
    assert "s3cr3t" not in " ".join(argv)  # values stay in the environment, never in argv
    words = shlex.split(script.split("exec \"$0\" run \"$@\" ", 1)[1])
    assert words[words.index("SECRET_TOKEN") - 1:
                                              words.index("SECRET_TOKEN") + 1] == ["--env", "SECRET_TOKEN"]
    assert words[words.index("--network") + 1] == "host"
    assert words[words.index("--ipc") + 1] == "host"
    assert "--init" in words and "--rm" in words
    assert f"orchestrate.rc={task.rc_path}" in words
    image_at = words.index("reg.example/p/worker:2.21")
    assert words[image_at - 1] == "--shm-size=8g" and words[image_at + 1:] == list(task.argv)
    assert "--device=nvidia.com/gpu=all" in script


def test_the_wrapper_adds_the_users_ids_and_the_gpu_flag_only_where_the_host_has_gpus(
        tmp_path: Path) -> None:
    task = built_plan(tmp_path).tasks[0]
    argv = containers.run_argv(Container(image="reg.example/p/w:1"), task)
    fake = tmp_path / "docker"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    fake.chmod(0o755)
    out = subprocess.run([*argv[:3], str(fake)], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin"}).stdout.splitlines()
    assert out[:3] == ["run", "--user", f"{_id('-u')}:{_id('-g')}"]
    has_gpus = Path("/dev/nvidiactl").exists()
    assert ("--gpus=all" in out) == has_gpus
    assert out[-len(task.argv):] == list(task.argv)


def _id(flag: str) -> str:
    return subprocess.run(["id", flag], capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.parametrize(("container", "says"), [
    ('{image: "Bad Image"}', "is not an image reference"),
    ('{image: "x", options: ["--network=bridge"]}', "is set by the orchestrator"),
    ('{image: "x", options: ["--name", "y"]}', "is set by the orchestrator"),
    ('{image: "x", runtime: containerd}', "docker"),
    ('{image: "x", python: "python3; rm -rf /"}', "container.python"),
])
def test_the_spec_refuses_what_would_break_the_task(tmp_path: Path, container: str,
                                                    says: str) -> None:
    with pytest.raises(SpecError) as err:
        load(spec_file(tmp_path, container))
    assert says in str(err.value)
    assert "c.yaml" in str(err.value)


HOST = Host(name="gpu-1", address="10.0.0.2", root="/r", ssh=SSHEndpoint(address="10.0.0.2", user="ml"))


@pytest.mark.parametrize(("runtime", "output", "fix"), [
    ("docker", "sh: 1: docker: command not found", "install docker on gpu-1"),
    ("docker", "permission denied while trying to connect to the Docker daemon socket at "
     "unix:///var/run/docker.sock", "sudo usermod -aG docker ml"),
    ("podman", "Error: unable to connect to Podman socket: dial unix /run/podman/podman.sock: "
     "connect: permission denied", "give ml access to the podman socket on gpu-1"),
    ("docker", "Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the "
     "docker daemon running?", "sudo systemctl start docker"),
    ("docker", "Error response from daemon: manifest for us-docker.pkg.dev/p/r/w:9 not found: "
     "manifest unknown", "check that"),
    ("docker", "Error response from daemon: Head \"https://us-docker.pkg.dev/v2/p/r/w/manifests/1\""
     ": denied: Permission \"artifactregistry.repositories.downloadArtifacts\" denied",
     "gcloud auth configure-docker"),
    ("docker", "Error response from daemon: unauthorized: authentication required",
     "gcloud auth configure-docker"),
])
def test_each_engine_failure_gets_its_fix(runtime: str, output: str, fix: str) -> None:
    container = Container(image="us-docker.pkg.dev/p/r/w:9", runtime=runtime)  # type: ignore[arg-type]
    assert fix in containers.fix_for(container, output, host=HOST, pulling=True)


# The engines' own words when `run` fails before the task starts, with their exit codes:
# podman 4.3's as this machine's podman prints them, docker's as its CLI words them (its
# run.go: "docker: " + the daemon's error, then a --help line; 127 for any "not found" or "no
# such", 126 for any "permission denied", else 125).
DOCKER_HELP = "\n\nRun 'docker run --help' for more information"
OCI = ("failed to create task for container: failed to create shim task: OCI runtime create "
       "failed: runc create failed: unable to start container process: ")
ENGINE_FAILURES = [
    ("podman", 125, "Error: container-init binary not found on the host: stat "
     "/usr/libexec/podman/catatonit: no such file or directory", "sudo apt-get install catatonit"),
    ("docker", 127, 'docker: Error response from daemon: exec: "docker-init": executable file '
     "not found in $PATH." + DOCKER_HELP, "sudo apt-get install tini"),
    ("podman", 127, 'Error: runc: runc create failed: unable to start container process: exec: '
     '"python3": executable file not found in $PATH: OCI runtime attempted to invoke a command '
     "that was not found", "has no python3 on its PATH"),
    ("docker", 127, f'docker: Error response from daemon: {OCI}exec: "python3": executable file '
     "not found in $PATH: unknown." + DOCKER_HELP, "has no python3 on its PATH"),
    ("podman", 126, 'Error: runc: runc create failed: unable to start container process: exec: '
     '"/usr/bin/python3": permission denied: OCI permission denied', "cannot be run by the SSH"),
    ("docker", 126, f'docker: Error response from daemon: {OCI}exec: "/usr/bin/python3": '
     "permission denied: unknown." + DOCKER_HELP, "cannot be run by the SSH"),
    ("podman", 125, 'Cannot connect to Podman. Please verify your connection to the Linux '
     "system using `podman system connection list`\nError: unable to connect to Podman socket: "
     'Get "http://d/v4.3.1/libpod/_ping": dial unix /run/podman/podman.sock: connect: no such '
     "file or directory", "sudo systemctl start podman"),
    ("docker", 125, "docker: Cannot connect to the Docker daemon at unix:///var/run/docker.sock."
     " Is the docker daemon running?." + DOCKER_HELP, "sudo systemctl start docker"),
    ("docker", 126, "docker: permission denied while trying to connect to the Docker daemon "
     'socket at unix:///var/run/docker.sock: Head "http://%2Fvar%2Frun%2Fdocker.sock/_ping": '
     "dial unix /var/run/docker.sock: connect: permission denied." + DOCKER_HELP,
     "sudo usermod -aG docker ml"),
]


@pytest.mark.parametrize(("runtime", "code", "output", "fix"), ENGINE_FAILURES)
def test_an_engines_failure_to_start_the_task_is_the_engines_with_the_fix_for_the_host(
        runtime: str, code: int, output: str, fix: str) -> None:
    container = Container(image="reg.example/w:1", runtime=runtime)  # type: ignore[arg-type]
    failure = containers.engine_failure(container, HOST, code, "Some earlier line\n" + output)
    assert failure is not None and fix in failure.fix
    assert failure.line.startswith(("Error", "docker:")) and failure.line in output
    assert "training code" not in failure.fix


@pytest.mark.parametrize(("code", "output"), [
    (125, "Traceback (most recent call last):\nSystemExit: 125"),  # the task's own exit 125
    (127, "sh: 1: helper: not found"),  # a command the task ran was not found
    (1, "Error: the engine's words, but the exit is the task's"),
    (137, "Error: killed"),
    (None, "Error: container-init binary not found on the host"),
])
def test_a_tasks_own_exit_is_not_the_engines(code: int | None, output: str) -> None:
    container = Container(image="reg.example/w:1", runtime="podman")
    assert containers.engine_failure(container, HOST, code, output) is None


def test_a_host_whose_engine_cannot_start_a_tasks_container_is_blocking() -> None:
    c = Container(image="reg.example/w:1", runtime="podman")
    facts = {"a": containers.EngineFacts(True, True, image_id="sha256:1", start_error=(
        "Error: container-init binary not found on the host: stat "
        "/usr/libexec/podman/catatonit: no such file or directory"))}
    problems = containers.problems(c, facts, {"a": Host(name="a", address="10.0.0.9", root="/r")})
    assert len(problems) == 1 and problems[0].blocking and problems[0].hosts == ("a",)
    assert "podman on a cannot start a task's container" in problems[0].message
    assert "catatonit" in problems[0].message and "apt-get install catatonit" in problems[0].fix


def test_hosts_with_different_images_under_one_name_are_flagged() -> None:
    c = Container(image="reg.example/w:latest")
    facts = {"a": containers.EngineFacts(True, True, image_id="sha256:" + "1" * 64),
             "b": containers.EngineFacts(True, True, image_id="sha256:" + "2" * 64)}
    hosts = {n: Host(name=n, address="10.0.0.9", root="/r") for n in facts}
    problems = containers.problems(c, facts, hosts)
    assert len(problems) == 1 and problems[0].blocking
    assert "different images" in problems[0].message and "@sha256" in problems[0].fix


def test_a_gpu_host_whose_containers_see_no_gpu_is_blocking() -> None:
    c = Container(image="reg.example/w:1", runtime="docker")
    facts = {"a": containers.EngineFacts(True, True, image_id="sha256:1", host_gpus=True,
                                         gpus_inside=False, gpu_error="could not select device "
                                         "driver \"\" with capabilities: [[gpu]]")}
    problems = containers.problems(c, facts, {"a": Host(name="a", address="10.0.0.9", root="/r")})
    assert len(problems) == 1 and problems[0].blocking
    assert "nvidia-ctk runtime configure --runtime=docker" in problems[0].fix
    assert "could not select device driver" in problems[0].message


def test_container_states_map_to_process_states() -> None:
    assert containers.state_letters("running\n") == "R"
    assert containers.state_letters("paused\n") == "T"  # a paused container hangs the group
    assert containers.state_letters("") == ""
