"""PURE: spec + hosts -> ClusterPlan, the TF_CONFIG, port, env and command line of every task."""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from orchestrator.errors import PlanError
from orchestrator.hosts import Host, is_loopback
from orchestrator.spec import ClusterSpec, CommandJob, ManagedJob

Role = Literal["chief", "worker"]
PYTHON_NAMES = ("python", "python3")


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
class RunPaths:
    """Where one run keeps its files on a host (relative to ``Host.root``'s parent)."""

    run_dir: str
    checkpoint_dir: str
    model_dir: str
    logs_dir: str


@dataclass(frozen=True)
class ClusterPlan:
    cluster: str
    run_id: str
    attempt: int
    tasks: tuple[TaskPlan, ...]  # the chief first
    cluster_def: Mapping[str, tuple[str, ...]]
    chief_key: str
    per_replica_batch_size: int | None = None
    learning_rate: float | None = None
    scale_learning_rate: bool = False
    paths: Mapping[str, RunPaths] = field(default_factory=dict)  # by host name

    @property
    def chief(self) -> TaskPlan:
        return self.tasks[0]

    def task(self, key: str) -> TaskPlan:
        for task in self.tasks:
            if task.key == key:
                return task
        raise KeyError(key)


def host_port(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def run_paths(host: Host, run_id: str) -> RunPaths:
    run_dir = f"{host.root}/runs/{run_id}"
    return RunPaths(
        run_dir=run_dir,
        checkpoint_dir=f"{run_dir}/checkpoints",
        model_dir=f"{run_dir}/model",
        logs_dir=f"{run_dir}/logs",
    )


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
    ports = _assign_ports(spec, hosts, busy_ports)
    endpoints = [host_port(h.address, p) for h, p in zip(hosts, ports, strict=True)]
    cluster_def = _cluster_def(roles, endpoints)
    paths = {h.name: run_paths(h, run_id) for h in hosts}
    tasks = tuple(
        _task(spec, role, index, host, port, cluster_def, paths[host.name], run_id, attempt,
              python, local_workdir)
        for (role, index), host, port in zip(roles, hosts, ports, strict=True)
    )
    job = spec.job if isinstance(spec.job, ManagedJob) else None
    return ClusterPlan(
        cluster=spec.name,
        run_id=run_id,
        attempt=attempt,
        tasks=tasks,
        cluster_def=cluster_def,
        chief_key=tasks[0].key,
        per_replica_batch_size=job.per_replica_batch_size if job else None,
        learning_rate=job.learning_rate if job else None,
        scale_learning_rate=job.scale_learning_rate if job else False,
        paths=paths,
    )


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


def _task(
    spec: ClusterSpec,
    role: Role,
    index: int,
    host: Host,
    port: int,
    cluster_def: Mapping[str, Sequence[str]],
    paths: RunPaths,
    run_id: str,
    attempt: int,
    python: str,
    local_workdir: str,
) -> TaskPlan:
    config = tf_config(cluster_def, role, index)
    cwd = local_workdir if host.is_local else f"{host.root}/code"
    lib = [] if host.is_local else [f"{host.root}/lib"]
    env = {
        **spec.env,
        "TF_CONFIG": json.dumps(config, separators=(",", ":")),
        "TF_USE_LEGACY_KERAS": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": ":".join([cwd, *lib]),
        "ORCHESTRATE_CLUSTER": spec.name,
        "ORCHESTRATE_RUN_ID": run_id,
        "ORCHESTRATE_ATTEMPT": str(attempt),
        "ORCHESTRATE_TASK": f"{role}:{index}",
        "ORCHESTRATE_CHECKPOINT_DIR": paths.checkpoint_dir,
        "ORCHESTRATE_MODEL_DIR": paths.model_dir,
    }
    stem = f"{paths.logs_dir}/attempt-{attempt}/{role}-{index}"
    return TaskPlan(
        role=role,
        index=index,
        host=host,
        port=port,
        tf_config=config,
        env=env,
        argv=_argv(spec, python),
        cwd=cwd,
        log_path=f"{stem}.log",
        rc_path=f"{stem}.rc",
    )


def _argv(spec: ClusterSpec, python: str) -> tuple[str, ...]:
    job = spec.job
    if isinstance(job, CommandJob):
        command = list(job.command)
        if command[0] in PYTHON_NAMES:
            command[0] = python
        return (python, "-m", "worker", "command", "--", *command)
    payload = job.model_dump(exclude={"mode"})
    payload["checkpoint_every_steps"] = spec.checkpoint.every_steps
    payload["collective_timeout_s"] = spec.timeouts.collective_s
    return (python, "-m", "worker", "managed", "--job", json.dumps(payload, sort_keys=True))
