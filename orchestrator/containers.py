"""Tasks in a container image: the ``run`` command line, stop and removal by label, the image
pulled on every host, and what the doctor asks each host's container engine.

A task runs as ``docker run`` (or ``podman run``) in the foreground of the launch wrapper, so
its output, exit code and process group are the ones the ``process`` launcher already
watches; the container itself lives outside that group (under the engine's daemon or conmon),
so stopping a task stops and removes its container, found by the label that holds the task's
rc path (unique per host, run, attempt and task).

Every container gets the host's network (TF's gRPC server listens on the host's address,
and the peers dial it), the host's IPC namespace (NCCL's shared memory), the task's
directories mounted at the same paths, the user id of the SSH user (so checkpoints and logs
stay theirs), and the task's environment by name only: values travel in the client's
environment, never on a command line another user could read with ``ps``.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from orchestrator.errors import OrchestratorError
from orchestrator.hosts import Host, one_per_machine
from orchestrator.plan import TaskPlan
from orchestrator.problems import Problem
from orchestrator.remote.base import Runner
from orchestrator.remote.fanout import fan_out
from orchestrator.spec import Container, is_url

LABEL = "orchestrate"
RUNTIMES = ("docker", "podman")
# What each engine wants to pass every GPU in: docker's NVIDIA runtime hook, podman's CDI.
GPU_FLAGS = {"docker": "--gpus=all", "podman": "--device=nvidia.com/gpu=all"}
# A host has NVIDIA GPUs when the driver's control device exists.
GPU_TEST = "[ -e /dev/nvidiactl ]"


class ContainerError(OrchestratorError):
    """A host's container engine or image is not usable; says which host and the fix."""


def name_of(task: TaskPlan) -> str:
    """``orch-CLUSTER-RUN-aN-ROLE-I``: readable in ``docker ps``, unique per host and attempt."""
    env = task.env
    raw = (f"orch-{env['ORCHESTRATE_CLUSTER']}-{env['ORCHESTRATE_RUN_ID']}-"
           f"a{env['ORCHESTRATE_ATTEMPT']}-{task.role}-{task.index}")
    return re.sub(r"[^A-Za-z0-9_.-]", "-", raw)[:200]


def mounts(task: TaskPlan) -> list[str]:
    """The directories a task reads and writes, outermost only: its cwd (the code), the
    host's cluster root (runs, logs, the synced worker) and a checkpoint or TensorBoard
    directory outside both (``checkpoint.dir``, ``tensorboard.dir`` on shared storage)."""
    candidates = [task.cwd, task.host.root or "",
                  task.env.get("ORCHESTRATE_CHECKPOINT_DIR", ""),
                  task.env.get("ORCHESTRATE_MODEL_DIR", ""),
                  task.env.get("ORCHESTRATE_TENSORBOARD_DIR", "")]
    dirs = sorted({d.rstrip("/") or "/" for d in candidates
                   if d and d.startswith("/") and not is_url(d)})
    outer: list[str] = []
    for d in dirs:
        if not any(d == o or d.startswith(o.rstrip("/") + "/") for o in outer):
            outer.append(d)
    return outer


def run_argv(container: Container, task: TaskPlan) -> list[str]:
    """The task's argv wrapped in ``RUNTIME run``; the launch wrapper runs it in the foreground.

    A small ``sh -c`` adds what only the host knows: the SSH user's uid:gid, and the GPU flag
    where the host has GPUs (``gpus: auto``). Everything else is one quoted word each.
    """
    rt = container.runtime
    words = [
        "run", "--rm", "--name", name_of(task),
        "--label", f"{LABEL}.cluster={task.env['ORCHESTRATE_CLUSTER']}",
        "--label", f"{LABEL}.run={task.env['ORCHESTRATE_RUN_ID']}",
        "--label", f"{LABEL}.task={task.key}",
        "--label", f"{LABEL}.rc={task.rc_path}",
        "--network", "host", "--ipc", "host", "--init",
        "--workdir", task.cwd,
        "--env", "HOME=/tmp",
    ]
    dirs = mounts(task)
    for d in dirs:
        words += ["--volume", f"{d}:{d}"]
    for key in task.env:
        words += ["--env", key]
    words += [*container.options, container.image, *task.argv]
    gpu = {"auto": f"if {GPU_TEST}; then set -- \"$@\" {GPU_FLAGS[rt]}; fi; ",
           "all": f"set -- \"$@\" {GPU_FLAGS[rt]}; ", "none": ""}[container.gpus]
    # The bind mounts' sources must exist (podman refuses a missing one, docker makes it
    # root's): made here, as the SSH user.
    script = ("mkdir -p -- " + " ".join(shlex.quote(d) for d in dirs) + " && "
              'set -- --user "$(id -u):$(id -g)"; ' + gpu +
              'exec "$0" run "$@" ' + " ".join(shlex.quote(w) for w in words[1:]))
    return ["sh", "-c", script, rt]


REMOVE_TRIES = 30  # how many times a stop removes a container that is still listed


def selector(runtime: str, label: str, value: str, *, every: bool) -> str:
    """A shell expression: the ids of containers with ``label=value`` (running, or ``every``)."""
    return (f"$({runtime} ps -q{'a' if every else ''} --filter "
            f"{shlex.quote(f'label={LABEL}.{label}={value}')} 2>/dev/null)")


def stop_script(runtime: str, rc_path: str, grace_s: float) -> str:
    """Stop the task's container (TERM, KILL after ``grace_s``; 0: KILL at once) and remove it.

    The removal is checked: a container run with ``--rm`` is also removed by the engine's own
    cleanup process when it exits, and an ``rm -f`` that races it can return (podman 4 says
    "no such container", or nothing) while the container is still listed, being removed. So
    ``rm -f`` is repeated until no container of the task is listed (``REMOVE_TRIES`` s at most).
    """
    grace = max(0, int(grace_s + 0.999))
    running, every = (selector(runtime, "rc", rc_path, every=e) for e in (False, True))
    return (f"ids={running}; if [ -n \"$ids\" ]; then {runtime} stop -t {grace} $ids "
            f">/dev/null 2>&1; fi; i=0; while ids={every}; [ -n \"$ids\" ] && "
            f"[ $i -lt {REMOVE_TRIES} ]; do [ $i -eq 0 ] || sleep 1; {runtime} rm -f $ids "
            f">/dev/null 2>&1; i=$((i+1)); done; true")


def states_script(runtime: str, rc_path: str) -> str:
    """The task container's state, one word (running, paused, exited...), empty if none."""
    ids = selector(runtime, "rc", rc_path, every=False)
    return (f"ids={ids}; [ -z \"$ids\" ] || {runtime} inspect --format '{{{{.State.Status}}}}' "
            f"$ids 2>/dev/null; true")


def state_letters(words: str) -> str:
    """Process-state letters (as ``probes.states`` prints them) of container states."""
    return "".join({"running": "R", "paused": "T"}.get(w, "") for w in words.split())


def remove_cluster(runner: Runner, runtime: str, cluster: str) -> list[str]:
    """Remove every container this cluster started on the runner's host; their names."""
    ids = selector(runtime, "cluster", cluster, every=True)
    script = (f"command -v {runtime} >/dev/null 2>&1 || exit 0; ids={ids}; [ -z \"$ids\" ] && "
              f"exit 0; {runtime} inspect --format '{{{{.Name}}}}' $ids 2>/dev/null; "
              f"{runtime} rm -f $ids >/dev/null 2>&1; true")
    out = runner.run(script, check=False, timeout_s=120).stdout
    return [line.strip().lstrip("/") for line in out.splitlines() if line.strip()]


# -- the image on every host ---------------------------------------------------------------
def pull(runner: Runner, host: Host, container: Container) -> str:
    """Make the image present on ``host`` (``container.pull``) and start one container of it
    as a task's would be started; the image's id.

    Raises:
        ContainerError: the engine is missing or unusable by the SSH user, the image cannot
            be pulled (does not exist, needs a login), or the engine cannot start a container
            of it (no init binary for --init); the message names the host and the fix.
    """
    rt, image = container.runtime, shlex.quote(container.image)
    have = f"{rt} image inspect --format '{{{{.Id}}}}' {image} 2>/dev/null"
    pull_cmd = f"{rt} pull -q {image} >&2"
    body = {"missing": f"{have} || {{ {pull_cmd} && {have}; }}",
            "always": f"{pull_cmd} && {have}",
            "never": have}[container.pull]
    result = runner.run(f"command -v {rt} >/dev/null 2>&1 || {{ echo 'command not found' >&2; "
                        f"exit 127; }}; {body}", check=False, timeout_s=3600)
    if result.ok and result.stdout.strip():
        failed = start_failure(runner, container)
        if failed is not None:
            raise ContainerError(f"{host.name}: {rt} cannot start a container of "
                                 f"{container.image}: {failed}",
                                 fix=engine_fix(container, host, failed))
        return result.stdout.strip().splitlines()[-1]
    raise ContainerError(f"{host.name}: {failure_text(container, result.stderr or result.stdout)}",
                         fix=fix_for(container, result.stderr + result.stdout,
                                     host=host, pulling=container.pull != "never"))


def pull_all(hosts: Sequence[Host], runner_for: Callable[[Host], Runner],
             container: Container) -> None:
    """``pull`` on every machine in parallel (once per machine).

    Raises:
        ContainerError: for the first host that failed, naming every host that did.
    """
    result = fan_out(one_per_machine(hosts), lambda h: pull(runner_for(h), h, container),
                     name_of=lambda h: h.name)
    if result.failed:
        first = result.failed[0].error
        others = [r.name for r in result.failed[1:]]
        more = f" (also failed on {', '.join(others)})" if others else ""
        if isinstance(first, OrchestratorError):
            raise ContainerError(f"{first.message}{more}", fix=first.fix) from first
        raise ContainerError(f"{result.failed[0].name}: {first}{more}",
                             fix=f"check {container.runtime} on that host") from first


def failure_text(container: Container, output: str) -> str:
    """The engine's own words, as plain text: its last ``Error:`` line, else its last line."""
    return f"{container.runtime} could not provide the image {container.image}: " + \
        (engine_line(output) or _last_line(output))


def engine_line(output: str) -> str:
    """The engine's own error line in ``output`` (podman's ``Error: ...``, docker's ``docker:
    ...`` or ``Error response from daemon: ...``), the last one; empty when there is none."""
    lines = [line.strip() for line in output.strip().splitlines()
             if line.strip() and not line.lstrip().startswith("time=")]
    errors = [line for line in lines if line.lower().startswith(ENGINE_PREFIXES)]
    return errors[-1][-600:] if errors else ""


def _last_line(output: str) -> str:
    lines = [line.strip() for line in output.strip().splitlines() if line.strip()]
    return lines[-1][-600:] if lines else "no output"


REGISTRY_WORDS = ("manifest unknown", "not found: manifest", "name unknown", "initializing source",
                  "pinging container registry", "no such host", "repository does not exist",
                  "pull access denied", "short-name", "does not exist")
AUTH_WORDS = ("unauthorized", "authentication required", "denied: ", "permission \"artifactregistry")
DAEMON_WORDS = ("cannot connect to the docker daemon", "is the docker daemon running",
                "unable to connect to podman", "connection refused")


def fix_for(container: Container, output: str, *, host: Host, pulling: bool) -> str:
    """The fix for an engine's failure, from its words."""
    rt, low = container.runtime, output.lower()
    user = host.ssh.user if host.ssh is not None else "the user"
    if "command not found" in low or "not found in $path" in low:
        return (f"install {rt} on {host.name} (docker: the Deep Learning VM images have it; "
                f"else `apt-get install docker.io`; podman: `apt-get install podman`), or set "
                f"container.runtime to the engine it has")
    if "permission denied" in low and ("sock" in low or "connect" in low):
        return (f"let {user} use docker on {host.name}: `sudo usermod -aG docker {user}`, then "
                "log in again" if rt == "docker" else
                f"give {user} access to the podman socket on {host.name} (its group), or "
                "use rootless podman")
    if any(w in low for w in AUTH_WORDS):
        return (f"log {user} in to the registry on {host.name}: for Artifact Registry, "
                f"`gcloud auth configure-docker REGION-docker.pkg.dev` (the VM's service account "
                "needs roles/artifactregistry.reader)")
    if any(w in low for w in REGISTRY_WORDS) or not pulling:
        return (f"check that {container.image} exists and {host.name} can reach its registry "
                f"(`{rt} pull {container.image}` there says more), or load it there and set "
                "container.pull: never" if pulling else
                f"load the image on {host.name} (`{rt} pull {container.image}`), or set "
                "container.pull: missing")
    if any(w in low for w in DAEMON_WORDS):
        return f"start the {rt} service on {host.name} (`sudo systemctl start {rt}`)"
    return f"`{rt} pull {container.image}` on {host.name} says more"


# -- the engine's own failures ----------------------------------------------------------------
# How `docker run` and `podman run` exit when the task never started: 125, the engine failed
# (its daemon, an option, a missing helper); 126, the command could not be invoked; 127, it
# was not found. Docker's CLI picks 126 and 127 from the words of any error (its run.go,
# toStatusError), so a missing docker-init is 127 there, and podman's missing catatonit 125.
ENGINE_EXITS = (125, 126, 127)
ENGINE_PREFIXES = ("error", "docker:")
INIT_MISSING = ("container-init binary not found", '"docker-init": executable file not found')
NOT_IN_IMAGE = ("executable file not found in $path", "invoke a command that was not found",
                "no such file or directory")
NOT_RUNNABLE = ("permission denied", "is a directory")


@dataclass(frozen=True)
class EngineFailure:
    """The engine could not start a container: its own error line, and the fix on the host."""

    line: str
    fix: str


def engine_failure(container: Container, host: Host, exit_code: int | None,
                   output: str) -> EngineFailure | None:
    """What a ``run`` that exited ``exit_code`` with ``output`` says of the engine, when it is
    the engine's failure (an exit of ``ENGINE_EXITS`` and the engine's own error line), else
    None: the task ran, and its exit is its own."""
    line = engine_line(output)
    if exit_code not in ENGINE_EXITS or not line:
        return None
    return EngineFailure(line, engine_fix(container, host, line))


def engine_fix(container: Container, host: Host, line: str) -> str:
    """The fix on ``host`` for the engine's error ``line`` about starting a container."""
    rt, low = container.runtime, line.lower()
    if any(w.lower() in low for w in INIT_MISSING):
        return (f"install podman's init on {host.name}: `sudo apt-get install catatonit` (podman "
                "runs /usr/libexec/podman/catatonit for --init; Debian only recommends it), or "
                "point podman at an init it has (init_path in containers.conf, or "
                "--init-path=PATH in container.options)" if rt == "podman" else
                f"install docker's init on {host.name}: docker-init comes with Docker Engine "
                "(docker-ce); Debian's docker.io needs `sudo apt-get install tini`; or set "
                "init-path in /etc/docker/daemon.json to an init it has")
    if any(w in low for w in DAEMON_WORDS) or ("permission denied" in low and "sock" in low):
        return fix_for(container, line, host=host, pulling=True)
    if any(w in low for w in NOT_IN_IMAGE):
        return (f"the image {container.image} has no {container.python} on its PATH: set "
                "container.python to the image's interpreter, or build the image from "
                "docker/Dockerfile")
    if any(w in low for w in NOT_RUNNABLE):
        return (f"{container.python} in {container.image} cannot be run by the SSH user's uid "
                "(tasks run as that user): make it executable by every user in the image")
    return fix_for(container, line, host=host, pulling=container.pull != "never")


def start_failure(runner: Runner, container: Container) -> str | None:
    """Start one container of the image as a task's is started (``--init``, the SSH user's uid,
    ``container.options``), running ``python -c ''``: None when it ran, else the engine's error
    line (a host without podman's catatonit, an image without its Python).

    Raises:
        RemoteError: the host could not be asked.
    """
    words = ["--rm", "--init", "--network", "none", "--entrypoint", container.python,
             *container.options, container.image, "-c", ""]
    result = runner.run(["sh", "-c", 'exec "$0" run --user "$(id -u):$(id -g)" "$@"',
                         container.runtime, *words], check=False, timeout_s=300)
    if result.ok:
        return None
    output = result.stdout + "\n" + result.stderr
    return engine_line(output) or f"exit {result.exit_code}: {_last_line(output)}"


# -- the doctor's look -----------------------------------------------------------------------
@dataclass(frozen=True)
class EngineFacts:
    """What a host's container engine said: installed, usable, the image, GPUs inside."""

    installed: bool
    usable: bool
    error: str = ""
    image_id: str | None = None
    host_gpus: bool = False
    gpus_inside: bool | None = None  # None: not asked (no GPU on the host, or no image)
    gpu_error: str = ""
    start_error: str = ""  # why a task's container cannot start (empty: it started, or no image)


def examine(runner: Runner, container: Container) -> EngineFacts:
    """Ask the host's engine: installed, usable by this user, the image present, whether a
    task's container of it starts (``start_failure``), and on a GPU host whether a container
    of the image sees the GPUs (``nvidia-smi -L`` inside)."""
    rt, image = container.runtime, shlex.quote(container.image)
    first = runner.run(
        f"command -v {rt} >/dev/null 2>&1 || {{ echo missing; exit 0; }}; "
        f"if {GPU_TEST}; then echo gpus; fi; "
        f"out=$({rt} version 2>&1 >/dev/null) || {{ echo unusable; printf '%s\\n' \"$out\"; exit 0; }}; "
        f"echo usable; {rt} image inspect --format 'image {{{{.Id}}}}' {image} 2>/dev/null; true",
        check=False, timeout_s=60)
    lines = first.stdout.splitlines()
    if "missing" in lines[:1]:
        return EngineFacts(installed=False, usable=False, error="command not found")
    gpus = "gpus" in lines
    if "unusable" in lines:
        at = lines.index("unusable")
        return EngineFacts(True, False, "\n".join(lines[at + 1:])[-600:], host_gpus=gpus)
    image_id = next((line.split(" ", 1)[1] for line in lines if line.startswith("image ")), None)
    inside: bool | None = None
    gpu_error = ""
    if gpus and image_id is not None and container.gpus != "none":
        probe = runner.run(f"{rt} run --rm {GPU_FLAGS[rt]} --network none --entrypoint "
                           f"nvidia-smi {image} -L 2>&1", check=False, timeout_s=120)
        inside = probe.ok and "GPU " in probe.stdout
        gpu_error = "" if inside else probe.stdout.strip()[-400:]
    start_error = (start_failure(runner, container) or "") if image_id is not None else ""
    return EngineFacts(True, True, image_id=image_id, host_gpus=gpus, gpus_inside=inside,
                       gpu_error=gpu_error, start_error=start_error)


def problems(container: Container, facts: dict[str, EngineFacts],
             hosts: dict[str, Host]) -> list[Problem]:
    """The doctor's problems from every host's engine facts (by host name)."""
    found: list[Problem] = []
    rt = container.runtime
    for name, f in facts.items():
        host = hosts[name]
        if not f.installed:
            found.append(Problem("container", f"{rt} is not installed on {name}",
                                 fix_for(container, "command not found", host=host,
                                         pulling=True), hosts=(name,)))
        elif not f.usable:
            found.append(Problem(
                "container", f"{rt} on {name} cannot be used by its SSH user: "
                f"{' / '.join(f.error.splitlines()[-2:]) or 'no output'}",
                fix_for(container, f.error, host=host, pulling=True), hosts=(name,)))
        elif f.image_id is None:
            never = container.pull == "never"
            found.append(Problem(
                "container", f"the image {container.image} is not on {name}"
                + ("" if never else " yet: `up` pulls it"),
                fix_for(container, "", host=host, pulling=False) if never else
                "run `orchestrate up` (it pulls the image on every host in parallel)",
                blocking=never, hosts=(name,)))
        elif f.start_error:
            found.append(Problem(
                "container", f"{rt} on {name} cannot start a task's container of "
                f"{container.image}: {f.start_error}",
                engine_fix(container, host, f.start_error), hosts=(name,)))
        elif f.gpus_inside is False:
            found.append(Problem(
                "container", f"a container of {container.image} on {name} does not see the "
                f"host's GPUs ({' / '.join(f.gpu_error.splitlines()[-2:]) or 'no output'})",
                "install the NVIDIA Container Toolkit there and configure the engine: "
                + ("`sudo nvidia-ctk runtime configure --runtime=docker && sudo systemctl "
                   "restart docker`" if rt == "docker" else
                   "`sudo nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml`")
                + " (Deep Learning VM images have it)", hosts=(name,)))
    ids: dict[str, list[str]] = {}
    for name, f in facts.items():
        if f.image_id:
            ids.setdefault(f.image_id[:19], []).append(name)
    if len(ids) > 1:
        spread = "; ".join(f"{i} on {', '.join(n)}" for i, n in ids.items())
        found.append(Problem(
            "container", f"the hosts have different images under the name {container.image} "
            f"({spread}): tasks with different TensorFlow or CUDA builds fail to form the group "
            "or to restore each other's checkpoints",
            "pin the image by digest (IMAGE@sha256:...) or set container.pull: always, then "
            "`orchestrate up`", hosts=tuple(n for names in ids.values() for n in names)))
    return found


def worker_argv(container: Container, directories: Sequence[str], module: str,
                *args: str, pythonpath: str) -> list[str]:
    """A one-off ``python -m MODULE ARGS`` in the image, for checks that need TensorFlow (such
    as verify-checkpoint): no network, ``directories`` mounted at the same paths, the synced
    worker first on ``PYTHONPATH``."""
    words = ["--rm", "--network", "none", "--env", "HOME=/tmp", "--env", f"PYTHONPATH={pythonpath}"]
    for d in sorted({d for d in (*directories, pythonpath) if d.startswith("/")}):
        words += ["--volume", f"{d}:{d}"]
    return ["sh", "-c", 'exec "$0" run --user "$(id -u):$(id -g)" "$@"', container.runtime,
            *words, *container.options, container.image, container.python, "-m", module, *args]
