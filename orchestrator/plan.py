"""PURE: spec + hosts -> ClusterPlan, the TF_CONFIG, port, env and command line of every task."""

from __future__ import annotations

import json
import posixpath
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from orchestrator.errors import PlanError
from orchestrator.hosts import Host, host_port, is_loopback
from orchestrator.paths import RunPaths, code_dir, lib_dir
from orchestrator.runtimes import BatchScaling, runtime_for
from orchestrator.runtimes.base import process_env
from orchestrator.spec import AUTO_MIRROR_MAX_BYTES, ClusterSpec, CommandJob, ManagedJob, is_url

Role = Literal["chief", "worker"]


@dataclass(frozen=True)
class TaskPlan:
    """Everything needed to start one task on its host."""

    role: Role
    index: int
    host: Host
    port: int
    tf_config: Mapping[str, Any]
    env: Mapping[str, str]
    argv: tuple[str, ...]
    cwd: str
    log_path: str
    rc_path: str

    @property
    def key(self) -> str:
        return f"{self.role}:{self.index}"

    @property
    def endpoint(self) -> str:
        return host_port(self.host.address, self.port)


@dataclass(frozen=True)
class CheckpointLayout:
    """Where the tasks of a run checkpoint, as each host sees it.

    ``shared``: every task sees the same directory (a gs:// URL, or a path under
    ``checkpoint.dir``), so nothing is copied. Otherwise each machine has its own and the
    chief's is copied to the others before a relaunch. ``named_by`` is the spec field that
    names the directory ("" for the run's own directory on each host).
    """

    dirs: Mapping[str, str] = field(default_factory=dict)  # by host name
    shared: bool = False
    named_by: str = ""
    mirror: Literal["auto", "always", "never"] = "auto"  # "never" when shared
    machines: int = 1  # how many machines the tasks run on

    def of(self, host: Host) -> str:
        return self.dirs[host.name]

    def describe(self) -> str:
        """One line for people: where checkpoints go and what is copied."""
        where = next(iter(self.dirs.values()), "")
        if self.shared:
            return f"{where} (shared by every task: nothing is copied)"
        if self.machines < 2:
            return f"{where} (every task runs on this one machine: nothing is copied)"
        limit = f"{AUTO_MIRROR_MAX_BYTES / (1 << 30):g} GiB"
        mirror = {"auto": f"this machine keeps a copy up to {limit}", "always": "this machine "
                  "keeps a copy", "never": "this machine keeps no copy"}[self.mirror]
        return (f"{where} on each host (the chief's is copied host to host before a relaunch; "
                f"{mirror})")


@dataclass(frozen=True)
class ClusterPlan:
    cluster: str
    run_id: str
    attempt: int
    tasks: tuple[TaskPlan, ...]  # the chief first
    cluster_def: Mapping[str, tuple[str, ...]]
    chief_key: str
    scaling: BatchScaling = field(default_factory=BatchScaling)  # the job runtime's batch, LR
    paths: Mapping[str, RunPaths] = field(default_factory=dict)  # by host name
    checkpoints: CheckpointLayout = field(default_factory=CheckpointLayout)

    @property
    def machines(self) -> int:
        """How many different machines the tasks run on."""
        return len({t.host.machine for t in self.tasks})

    @property
    def chief(self) -> TaskPlan:
        return self.tasks[0]

    def task(self, key: str) -> TaskPlan:
        for task in self.tasks:
            if task.key == key:
                return task
        raise KeyError(key)


@dataclass(frozen=True)
class _Attempt:
    """What every task of one attempt shares."""

    spec: ClusterSpec
    run_id: str
    attempt: int
    cluster_def: Mapping[str, Sequence[str]]
    argv: tuple[str, ...]
    job_env: Mapping[str, str]
    local_workdir: str
    checkpoints: CheckpointLayout


def build(
    spec: ClusterSpec,
    hosts: Sequence[Host],
    *,
    run_id: str,
    attempt: int = 1,
    python: str,
    local_workdir: str,
    busy_ports: Collection[tuple[str, int]] = (),
) -> ClusterPlan:
    """Lay out one attempt of a run: a task per host, the chief on ``hosts[0]``.

    Args:
        python: the interpreter that runs the worker on every host.
        local_workdir: the user's project directory, used as cwd on this machine's hosts;
            SSH hosts use ``<root>/code``, where ``up`` syncs it.
        busy_ports: (address, port) pairs known to be taken; the plan skips them.

    Raises:
        PlanError: zero tasks, a host count that does not match the spec, loopback
            addresses across machines, duplicate address:port, or an exhausted port range.
    """
    roles = _roles(spec)
    if not roles:
        raise PlanError("the cluster has zero tasks", fix="set workers: 1 or more")
    if len(hosts) != len(roles):
        raise PlanError(
            f"the spec asks for {len(roles)} tasks but {len(hosts)} hosts were given "
            f"({', '.join(h.name for h in hosts) or 'none'})",
            fix="give one host per task (workers, plus one if separate_chief is true)",
        )
    _check_addresses(hosts)
    if spec.container is not None:  # the worker runs in the image, with the image's Python
        python = spec.container.python
    ports = _assign_ports(spec, hosts, busy_ports)
    endpoints = [host_port(h.address, p) for h, p in zip(hosts, ports, strict=True)]
    cluster_def = _cluster_def(roles, endpoints)
    paths = {h.name: RunPaths.of(h.root, run_id) for h in hosts}
    runtime = runtime_for(spec.job)
    layout = checkpoint_layout(spec, hosts, run_id, local_workdir)
    shared = _Attempt(spec, run_id, attempt, cluster_def, runtime.argv(spec, python),
                      runtime.env(spec), local_workdir, layout)
    tasks = tuple(
        _task(shared, role, index, host, port, paths[host.name])
        for (role, index), host, port in zip(roles, hosts, ports, strict=True)
    )
    return ClusterPlan(
        cluster=spec.name,
        run_id=run_id,
        attempt=attempt,
        tasks=tasks,
        cluster_def=cluster_def,
        chief_key=tasks[0].key,
        scaling=runtime.scaling(spec.job),
        paths=paths,
        checkpoints=layout,
    )


def tensorboard_env(spec: ClusterSpec, paths: RunPaths, run_id: str) -> dict[str, str]:
    """Where TensorBoard logs go (``tensorboard.dir``/CLUSTER/RUN_ID, or the run's directory on
    the task's host) and, for a managed job, every how many steps the chief writes."""
    board = spec.tensorboard
    if not board.enabled:
        return {}
    where = posixpath.join(board.dir, spec.name, run_id) if board.dir else paths.tensorboard_dir
    env = {"ORCHESTRATE_TENSORBOARD_DIR": where}
    if isinstance(spec.job, ManagedJob):
        env["ORCHESTRATE_TENSORBOARD_EVERY"] = str(board.every_steps or
                                                    spec.job.progress_every_steps)
        if board.profile_steps is not None:
            env["ORCHESTRATE_TENSORBOARD_PROFILE"] = "{}-{}".format(*board.profile_steps)
    return env


def model_dir(host: Host, paths: RunPaths, checkpoints: CheckpointLayout) -> str:
    """Where the chief saves the final model: its run directory, unless that is gone with the
    task (an ephemeral host, its checkpoints in a bucket): then next to the checkpoints."""
    where = checkpoints.of(host)
    if host.ephemeral and is_url(where):
        return f"{where.rstrip('/')}/model"
    return paths.model_dir


def task_cwd(host: Host, local_workdir: str) -> str:
    """Where a task runs: the user's workdir on this machine, the synced code dir on a host."""
    return local_workdir if host.is_local else code_dir(host.root)


def checkpoint_layout(spec: ClusterSpec, hosts: Sequence[Host], run_id: str,
                      local_workdir: str) -> CheckpointLayout:
    """Where each host's tasks checkpoint (see :class:`CheckpointLayout`)."""
    shared_root = spec.checkpoint.dir
    named = spec.job.checkpoint_dir if isinstance(spec.job, CommandJob) else None
    if named is not None:
        dirs = {h.name: named if is_url(named) or named.startswith("/") else
                posixpath.normpath(posixpath.join(task_cwd(h, local_workdir), named))
                for h in hosts}
        shared = is_url(named) or (shared_root is not None and _under(named, shared_root))
        by = "job.checkpoint_dir"
    elif shared_root is not None:
        dirs = {h.name: f"{shared_root}/{spec.name}/{run_id}" for h in hosts}
        shared, by = True, "checkpoint.dir"
    else:
        dirs = {h.name: RunPaths.of(h.root, run_id).checkpoint_dir for h in hosts}
        # A root every host mounts (a Slurm cluster's shared home): one directory for all.
        shared = bool(hosts) and all(h.shared_fs for h in hosts) and len(set(dirs.values())) == 1
        by = "provider.root" if shared else ""
    return CheckpointLayout(dirs=dirs, shared=shared, named_by=by,
                            mirror="never" if shared else spec.checkpoint.mirror,
                            machines=len({h.machine for h in hosts}))


def _under(path: str, root: str) -> bool:
    path, root = posixpath.normpath(path), posixpath.normpath(root)
    return path == root or path.startswith(root.rstrip("/") + "/")


def _roles(spec: ClusterSpec) -> list[tuple[Role, int]]:
    chief: list[tuple[Role, int]] = [("chief", 0)] if spec.separate_chief else []
    return chief + [("worker", i) for i in range(spec.workers)]


def _check_addresses(hosts: Sequence[Host]) -> None:
    machines = {h.machine for h in hosts}
    if len(machines) > 1:
        for h in hosts:
            if is_loopback(h.address):
                raise PlanError(
                    f"host {h.name} has the loopback address {h.address}, but the tasks run on "
                    f"{len(machines)} different machines, which cannot reach each other's loopback",
                    fix="give every host an address the other hosts can reach (its internal IP)",
                )


def _assign_ports(
    spec: ClusterSpec, hosts: Sequence[Host], busy: Collection[tuple[str, int]]
) -> list[int]:
    """A port per task, unique per machine: TF's gRPC server binds the wildcard address."""
    machine_of = {h.address: h.machine for h in hosts}
    taken = {(machine_of[addr], port) for addr, port in busy if addr in machine_of}
    for h in hosts:
        if h.task_port is None:
            continue
        if (h.machine, h.task_port) in taken:
            raise PlanError(
                f"two tasks would listen on port {h.task_port} of the machine of {h.name} "
                f"({host_port(h.address, h.task_port)})",
                fix="give each task on the same machine its own port",
            )
        taken.add((h.machine, h.task_port))
    ports: list[int] = []
    for h in hosts:
        if h.task_port is not None:
            ports.append(h.task_port)
            continue
        free = (p for p in range(spec.ports.start, spec.ports.end + 1) if (h.machine, p) not in taken)
        port = next(free, None)
        if port is None:
            raise PlanError(
                f"no free port left for {h.name} ({h.address}) in the range "
                f"{spec.ports.start}-{spec.ports.end}",
                fix="widen ports.start/ports.end in the spec",
            )
        taken.add((h.machine, port))
        ports.append(port)
    return ports


def _cluster_def(roles: list[tuple[Role, int]], endpoints: list[str]) -> dict[str, tuple[str, ...]]:
    out: dict[str, tuple[str, ...]] = {}
    for (role, _), ep in zip(roles, endpoints, strict=True):
        out[role] = (*out.get(role, ()), ep)
    return out


def tf_config(cluster_def: Mapping[str, Sequence[str]], role: Role, index: int) -> dict[str, Any]:
    return {
        "cluster": {r: list(eps) for r, eps in cluster_def.items()},
        "task": {"type": role, "index": index},
    }


def _task(shared: _Attempt, role: Role, index: int, host: Host, port: int,
          paths: RunPaths) -> TaskPlan:
    spec = shared.spec
    config = tf_config(shared.cluster_def, role, index)
    cwd = task_cwd(host, shared.local_workdir)
    # The worker package synced by `up` (SSH hosts; local ones too when the tasks run in an
    # image): first on the path, so the controller's own worker runs whatever the image holds.
    lib = [] if host.is_local and spec.container is None else [lib_dir(host.root)]
    env = {
        **spec.env,
        "TF_CONFIG": json.dumps(config, separators=(",", ":")),
        **shared.job_env,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": ":".join([cwd, *lib]),
        "ORCHESTRATE_CLUSTER": spec.name,
        "ORCHESTRATE_RUN_ID": shared.run_id,
        "ORCHESTRATE_ATTEMPT": str(shared.attempt),
        "ORCHESTRATE_TASK": f"{role}:{index}",
        "ORCHESTRATE_CHECKPOINT_DIR": shared.checkpoints.of(host),
        "ORCHESTRATE_MODEL_DIR": model_dir(host, paths, shared.checkpoints),
        **process_env(spec.job, shared.cluster_def, role, index),
    }
    env.update(tensorboard_env(spec, paths, shared.run_id))
    stem = paths.task_stem(shared.attempt, role, index)
    if spec.retry.snapshot_on_crash and spec.job.mode == "managed":
        # Written by the controller on a survivor's host when the chief died, naming the task
        # that saves the group's state in its place (Supervisor._ask_for_snapshot). One path
        # for the attempt's tasks: a pod template (Kubernetes) is the same for every task.
        env["ORCHESTRATE_SNAPSHOT_REQUEST"] = posixpath.join(posixpath.dirname(stem),
                                                             "snapshot-request")
    return TaskPlan(
        role=role,
        index=index,
        host=host,
        port=port,
        tf_config=config,
        env=env,
        argv=shared.argv,
        cwd=cwd,
        log_path=f"{stem}.log",
        rc_path=f"{stem}.rc",
    )
