"""Preflight of a cluster: every host checked in parallel, and each problem explained with its fix."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import secrets
import shlex
import socket
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import worker as worker_package
from orchestrator import containers
from orchestrator.errors import CommandError, OrchestratorError
from orchestrator.hosts import Host, is_loopback
from orchestrator.plan import ClusterPlan, TaskPlan
from orchestrator.problems import Problem
from orchestrator.remote.base import ExecResult, Runner
from orchestrator.remote.fanout import FanOutResult, fan_out
from orchestrator.runtimes import MatchingPackage, resolve_collectives, runtime_for
from orchestrator.spec import ClusterSpec, Container, is_url
from orchestrator.view import human_bytes
from worker.preflight import OUTSIDER, Probe
from worker.storage import GFILE_FIX

PREFLIGHT = Path(worker_package.__file__).parent / "preflight.py"
MIN_FREE_BYTES = 1 << 30  # below this, the first checkpoint may not fit: blocking
LOW_FREE_BYTES = 10 << 30  # below this, a long run may fill the disk: a warning
WINDOW_S = 3.0  # how long each host keeps trying to reach every other host's task port
LINGER_S = 1.0  # how long each host's ports keep listening after that, for a late peer
OUTSIDE_SLACK_S = 3.0  # this machine's probes also wait out the hosts' SSH command start
STORAGE_CHECK_ENV = "ORCHESTRATE_STORAGE_CHECK_S"  # seconds a host's checkpoint write may take
STORAGE_CHECK_S = 20.0
MARKER_PREFIX = ".orchestrate-doctor-"
GCS_FIX = ("give the VM's service account write access to the bucket (roles/storage.objectUser) "
           "and the storage scope (provider.scopes: "
           "https://www.googleapis.com/auth/devstorage.read_write), or use an absolute path on a "
           "shared file system")
# What the fix of a host without JAX installs: the range of pyproject.toml's jax extra.
JAX_REQUIREMENT = "jax>=0.10,<0.11"
KERAS_REQUIREMENT = "keras>=3.15,<4"
DUPLICATE_GPU = "refuses two ranks on one GPU ('Duplicate GPU detected')"
TensorFlowImport = Literal["auto", "always", "never"]


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_mib: int | None
    driver: str | None


@dataclass(frozen=True)
class HostCheck:
    """What one machine answered (or why it did not); ``facts`` is the worker's preflight JSON."""

    name: str
    address: str
    tasks: tuple[str, ...]
    python: str
    reachable: bool
    error: str = ""
    fix: str = ""
    facts: Mapping[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def fact(self, *path: str) -> Any:
        """The preflight's answer at ``path`` (None where it said nothing)."""
        value: Any = self.facts
        for key in path:
            value = value.get(key) if isinstance(value, Mapping) else None
        return value

    def text(self, *path: str) -> str | None:
        value = self.fact(*path)
        return None if value is None else str(value)

    @property
    def checked(self) -> bool:
        return bool(self.facts)

    @property
    def python_version(self) -> str | None:
        return self.text("python", "version")

    @property
    def tf_version(self) -> str | None:
        return self.text("tensorflow", "version")

    @property
    def tf_error(self) -> str | None:
        return self.text("tensorflow", "error")

    @property
    def tf_cuda(self) -> str | None:
        return self.text("tensorflow", "cuda") if self.fact("tensorflow", "cuda_build") else None

    @property
    def tf_gpus(self) -> list[str] | None:
        """GPU names TensorFlow sees; None where it was not imported."""
        gpus = self.fact("tensorflow", "gpus")
        return None if gpus is None else [str(g.get("name")) for g in gpus]

    @property
    def tf_keras_version(self) -> str | None:
        return self.text("tf_keras", "version")

    @property
    def jax_version(self) -> str | None:
        return self.text("jax", "version")

    @property
    def jaxlib_version(self) -> str | None:
        return self.text("jax", "jaxlib_version")

    @property
    def keras_version(self) -> str | None:
        return self.text("keras", "version")

    @property
    def jax_gpus(self) -> int | None:
        """GPUs JAX sees; None where it did not list its devices."""
        backend = self.fact("jax", "devices", "backend")
        if backend is None:
            return None
        return int(self.fact("jax", "devices", "count") or 0) if backend == "gpu" else 0

    @property
    def jax_collectives(self) -> str | None:
        """What JAX all-reduces with here: NCCL between the GPUs it sees, else gloo on the CPU;
        None where a host with GPUs did not list JAX's devices."""
        if self.jax_version is None or (self.jax_gpus is None and self.gpus):
            return None
        return "NCCL" if self.jax_gpus else "gloo"

    @property
    def blind(self) -> bool:
        """nvidia-smi lists GPUs here, and the framework that listed its devices sees none."""
        return bool(self.gpus) and (self.tf_gpus == [] or self.jax_gpus == 0)

    @property
    def gpus(self) -> list[Gpu]:
        return [Gpu(str(g["name"]), g.get("memory_mib"), g.get("driver"))
                for g in self.fact("nvidia", "gpus") or []]

    @property
    def driver(self) -> str | None:
        return self.text("nvidia", "driver")

    @property
    def driver_cuda(self) -> str | None:
        """The newest CUDA the NVIDIA driver supports (nvidia-smi's 'CUDA Version')."""
        return self.text("nvidia", "cuda")

    @property
    def free_bytes(self) -> int | None:
        free = self.fact("disk", "free_bytes")
        return None if free is None else int(free)

    @property
    def ports(self) -> list[dict[str, Any]]:
        return list(self.fact("ports") or [])

    @property
    def gpu_count(self) -> int:
        """GPUs each task here would use: those JAX sees where it listed its devices (a job
        on JAX), those TensorFlow sees where it was imported, else those nvidia-smi lists
        (every task of a machine sees all of them)."""
        if self.jax_gpus is not None:
            return self.jax_gpus
        seen = self.tf_gpus
        return len(seen) if seen is not None else len(self.gpus)

    @property
    def replicas(self) -> int:
        """Replicas each task here would run: one per GPU it uses, else one (CPU)."""
        return max(1, self.gpu_count)


@dataclass(frozen=True)
class Link:
    """One host's TCP connection to another host's task port; ``ok`` None: not checked."""

    source: str
    target: str
    endpoint: str
    ok: bool | None
    error: str = ""


@dataclass(frozen=True)
class DoctorReport:
    cluster: str
    provider: str
    hosts: tuple[HostCheck, ...]
    links: tuple[Link, ...]
    problems: tuple[Problem, ...]
    seconds: float
    backend: str = "tensorflow"  # the job's: which software each host's line shows

    @property
    def blocking(self) -> list[Problem]:
        return [p for p in self.problems if p.blocking]

    @property
    def warnings(self) -> list[Problem]:
        return [p for p in self.problems if not p.blocking]

    @property
    def ok(self) -> bool:
        return not self.blocking

    @property
    def replicas(self) -> int | None:
        """Replicas in sync across the cluster, from the GPUs found; None if a host was not checked."""
        if not self.hosts or not all(h.checked for h in self.hosts):
            return None
        return sum(h.replicas * len(h.tasks) for h in self.hosts)

    @property
    def gpus_per_task(self) -> list[int] | None:
        """The GPUs of every task, by host; None if a host was not checked."""
        if not self.hosts or not all(h.checked for h in self.hosts):
            return None
        return [h.gpu_count for h in self.hosts for _ in h.tasks]

    def raise_if_blocking(self) -> None:
        if self.blocking:
            raise DoctorFailed(self)

    def to_dict(self) -> dict[str, Any]:
        return {
            "cluster": self.cluster, "provider": self.provider, "backend": self.backend,
            "ok": self.ok,
            "seconds": round(self.seconds, 3), "replicas": self.replicas,
            "hosts": [{"name": h.name, "address": h.address, "tasks": list(h.tasks),
                       "python": h.python, "reachable": h.reachable, "error": h.error,
                       "facts": dict(h.facts)} for h in self.hosts],
            "links": [vars(link) for link in self.links],
            "problems": [{**vars(p), "hosts": list(p.hosts)} for p in self.problems],
        }


class DoctorFailed(OrchestratorError):
    """The doctor found problems that would make training fail; carries the report."""

    def __init__(self, report: DoctorReport) -> None:
        lines = [f"doctor found {len(report.blocking)} blocking problem(s) in cluster "
                 f"{report.cluster!r}:"]
        for p in report.blocking:
            lines += [f"  - {p.check}: {p.message}", f"    fix: {p.fix}"]
        super().__init__("\n".join(lines), fix="fix the problems above and train again, or "
                         "skip the checks with 'train --no-doctor' (Cluster.train(doctor=False))")
        self.report = report


@dataclass(frozen=True)
class Machine:
    """The tasks that share one physical machine: checked once, through its first host."""

    host: Host
    tasks: tuple[TaskPlan, ...]
    python: str

    @property
    def name(self) -> str:
        return self.host.name


def machines_of(plan: ClusterPlan, python: Callable[[Host], str]) -> list[Machine]:
    groups: dict[str, list[TaskPlan]] = {}
    for task in plan.tasks:
        groups.setdefault(task.host.machine, []).append(task)
    return [Machine(ts[0].host, tuple(ts), python(ts[0].host)) for ts in groups.values()]


def existing(plan: ClusterPlan, machines: Sequence[Machine], unprovisioned: Collection[str]
             ) -> list[Machine]:
    """The machines of ``machines`` that exist, to be checked; none when the chief's does not
    (the others' checkpoint directory and marker are checked against the chief's)."""
    if not unprovisioned:
        return list(machines)
    if plan.chief.host.name in unprovisioned:
        return []
    return [m for m in machines if not any(t.host.name in unprovisioned for t in m.tasks)]


def examine(
    spec: ClusterSpec, provider: str, plan: ClusterPlan, machines: Sequence[Machine],
    runner: Callable[[Host], Runner], *, tensorflow: TensorFlowImport = "auto",
    found: Sequence[Problem] = (),
) -> DoctorReport:
    """Check every machine in parallel: SSH first, then one preflight each, all at once.

    Args:
        runner: the runner for a machine's host (connecting may fail: that host is unreachable).
        tensorflow: import TensorFlow on each host ("auto": only where nvidia-smi lists GPUs);
            for a job with ``job.backend: jax``, JAX instead, in a child process, to list the
            devices it sees (TensorFlow is then never imported).
        found: problems found before any host was asked (the provider's ``cloud_check``):
            the report lists them first, among the blocking ones or the warnings.
    """
    started = time.monotonic()
    reached = fan_out(machines, lambda m: runner(m.host).run(["true"], timeout_s=30),
                      name_of=lambda m: m.name)
    errors = {r.name: r.error for r in reached.failed}
    live = [m for m in machines if m.name not in errors]
    storage = StorageCheck.of(spec, plan, machines)
    if spec.container is not None:  # TensorFlow and JAX are the image's, not the host's
        tensorflow = "never"
    imports = Imports("never", tensorflow) if spec.job.backend == "jax" else Imports(tensorflow)
    outside = Outside.of(live)
    answers = fan_out(live, lambda m: _preflight(m, live, runner(m.host), imports, storage,
                                                 outside.probing),
                      name_of=lambda m: m.name)
    exposed = outside.problems(spec)
    engines, engine_problems = (({}, []) if spec.engine_container is None else
                                _engines(spec.engine_container, live, runner))
    checks = [_host_check(m, errors.get(m.name), answers) for m in machines]
    checks = [replace(c, facts={**c.facts, "container": engines[c.name]})
              if c.name in engines else c for c in checks]
    if storage is not None and storage.marker is not None:
        checks = _look_for_marker(storage, machines, checks, runner)
    links = _links(machines, checks)
    problems = sorted([*found, *diagnose(spec, plan, checks, links), *engine_problems, *exposed],
                      key=lambda p: not p.blocking)
    return DoctorReport(spec.name, provider, tuple(checks), tuple(links), tuple(problems),
                        time.monotonic() - started, spec.job.backend)


def _engines(container: Container, live: Sequence[Machine], runner: Callable[[Host], Runner]
             ) -> tuple[dict[str, dict[str, Any]], list[Problem]]:
    """The container engine on every machine (installed, usable, image, GPUs inside): its
    facts by machine name, and their problems."""
    asked = fan_out(live, lambda m: containers.examine(runner(m.host), container),
                    name_of=lambda m: m.name)
    facts = {r.name: r.value for r in asked.succeeded if r.value is not None}
    found = containers.problems(container, facts, {m.name: m.host for m in live})
    found += [Problem("container", f"{r.name}: {container.runtime} could not be asked: {r.error}",
                      f"check {container.runtime} on {r.name}", hosts=(r.name,))
              for r in asked.failed]
    return {name: asdict(f) for name, f in facts.items()}, found


@dataclass(frozen=True)
class Imports:
    """What each host's preflight imports to see the devices: TensorFlow for a job on it, JAX
    (in a child process) for a job on JAX."""

    tensorflow: TensorFlowImport
    jax: TensorFlowImport = "never"


def _preflight(machine: Machine, live: Sequence[Machine], runner: Runner, imports: Imports,
               storage: StorageCheck | None, outsider: bool = False) -> dict[str, Any]:
    peers = [t.endpoint for m in live if m is not machine for t in m.tasks]
    argv = [machine.python, "-c", PREFLIGHT.read_text(), "--name", machine.name,
            "--dir", machine.host.root or "~", "--expect", str(len(live) - 1),
            "--window", str(WINDOW_S), "--linger", str(LINGER_S),
            "--import-tensorflow", imports.tensorflow, "--import-jax", imports.jax]
    for task in machine.tasks:
        argv += ["--port", str(task.port)]
    for endpoint in peers:
        argv += ["--peer", endpoint]
    if outsider:
        argv.append("--outsider")
    if storage is not None:
        argv += [f"--write-check={storage.dirs[machine.name]}",  # one word, even as "-x"
                 "--storage-timeout", f"{storage.timeout_s:g}"]
        if storage.marker is not None and machine.name == storage.chief:
            argv += ["--marker", storage.marker, "--marker-content", storage.content]
    return _facts(runner.run(argv, timeout_s=180 + (storage.timeout_s if storage else 0)))


class Outside:
    """This machine's own probes of every task port, at every address it knows for the host,
    while the hosts' preflights listen there: TensorFlow's gRPC server binds every interface
    and has no authentication, so a task port this machine reaches while it is none of the
    cluster's hosts is open beyond the cluster. When this machine is one of the hosts (the
    local provider, or a static cluster that includes it), its reach is the cluster's own and
    nothing is probed."""

    def __init__(self, probes: Sequence[tuple[Machine, Probe]]) -> None:
        self.probes = list(probes)
        self._threads = [threading.Thread(target=p.run, daemon=True) for _, p in self.probes]
        for thread in self._threads:
            thread.start()

    @classmethod
    def of(cls, live: Sequence[Machine]) -> Outside:
        if not live or any(is_this_machine(m.host) for m in live):
            return cls([])
        deadline = time.monotonic() + WINDOW_S + LINGER_S + OUTSIDE_SLACK_S
        return cls([(m, Probe(_endpoint(address, task.port), OUTSIDER, deadline))
                    for m in live for task in m.tasks for address in _addresses(m.host)])

    @property
    def probing(self) -> bool:
        return bool(self.probes)

    def problems(self, spec: ClusterSpec) -> list[Problem]:
        for thread in self._threads:
            thread.join()
        reached: dict[str, list[str]] = {}
        for machine, probe in self.probes:
            if probe.ok:
                reached.setdefault(machine.name, []).append(probe.endpoint)
        if not reached:
            return []
        ports = sorted({t.port for m, _ in self.probes for t in m.tasks})
        span = f"{ports[0]}:{ports[-1]}" if len(ports) > 1 else str(ports[0])
        cluster = sorted({m.host.address for m, _ in self.probes})
        where = "; ".join(f"{name} at {', '.join(ends)}" for name, ends in reached.items())
        return [Problem(
            "exposure", f"task ports are reachable from this machine, which is not one of the "
            f"cluster's hosts: {where}. TensorFlow's gRPC server listens on every interface "
            "with no authentication: whoever reaches these ports can read or disturb the "
            "training",
            f"allow TCP ports {span} only from the cluster's hosts, e.g. on each host: "
            + "; ".join([*(f"sudo iptables -A INPUT -p tcp --dport {span} -s {a} -j ACCEPT"
                           for a in cluster),
                         f"sudo iptables -A INPUT -p tcp --dport {span} -j DROP"])
            + " (or a security group or cloud firewall rule that does the same)",
            blocking=False, hosts=tuple(reached))]


def is_this_machine(host: Host) -> bool:
    """Whether ``host`` is this machine: local, a loopback address, or an address this machine
    would send from to reach it (a UDP socket's route lookup; no packet is sent)."""
    if host.is_local:
        return True
    try:
        infos = socket.getaddrinfo(host.address, 9, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return False
    for family, _, _, _, sockaddr in infos:
        address = str(sockaddr[0])
        if ipaddress.ip_address(address.split("%")[0]).is_loopback:
            return True
        with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect(sockaddr)
            if sock.getsockname()[0] == address:
                return True
    return False


def _addresses(host: Host) -> list[str]:
    """Every address this machine knows for ``host``: the tasks' and the SSH one (not for a
    scheduler's node, whose ``ssh`` reaches the login node)."""
    ssh = [host.ssh.address] if host.ssh and host.node is None else []
    return list(dict.fromkeys([host.address, *ssh]))


def _endpoint(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def _facts(result: ExecResult) -> dict[str, Any]:
    """The JSON object on the last line a preflight printed."""
    last = result.stdout.strip().splitlines()[-1:] or ["{}"]
    facts: dict[str, Any] = json.loads(last[0])
    return facts


# -- checkpoint storage ------------------------------------------------------------------------
@dataclass(frozen=True)
class StorageCheck:
    """Where each machine's tasks write checkpoints, as the doctor checks it.

    ``dirs``: by machine name, the directory each machine must be able to create and write
    (``checkpoint.dir`` itself, not its per-run subdirectory). ``marker``: the file the chief's
    machine leaves there for the others to look for, when every task must see one directory.
    """

    named_by: str
    dirs: Mapping[str, str]
    chief: str
    timeout_s: float
    marker: str | None = None
    content: str = ""

    @classmethod
    def of(cls, spec: ClusterSpec, plan: ClusterPlan, machines: Sequence[Machine]
           ) -> StorageCheck | None:
        """What to check for ``plan``; None where checkpoints go to each host's own run dir, or
        no machine is checked."""
        layout = plan.checkpoints
        if not machines:
            return None
        if layout.named_by == "checkpoint.dir" and spec.checkpoint.dir is not None:
            dirs = {m.name: spec.checkpoint.dir for m in machines}
        elif layout.named_by:
            dirs = {m.name: layout.of(m.host) for m in machines}
        else:
            return None
        chief = next(m.name for m in machines if plan.chief_key in {t.key for t in m.tasks})
        same = layout.shared and len(machines) > 1 and not is_url(dirs[chief])
        return cls(layout.named_by, dirs, chief, _storage_timeout(),
                   marker=f"{MARKER_PREFIX}{secrets.token_hex(8)}" if same else None,
                   content=secrets.token_hex(16) if same else "")


def _storage_timeout() -> float:
    try:
        return float(os.environ.get(STORAGE_CHECK_ENV, STORAGE_CHECK_S))
    except ValueError:
        return STORAGE_CHECK_S


def _look_for_marker(storage: StorageCheck, machines: Sequence[Machine],
                     checks: Sequence[HostCheck], runner: Callable[[Host], Runner]
                     ) -> list[HostCheck]:
    """The second round: every other machine reads the file the chief's machine left in the
    shared directory; each one's answer joins its facts (``storage.sees_chief_marker``)."""
    by_name = {c.name: c for c in checks}
    chief = next(m for m in machines if m.name == storage.chief)
    written = by_name[chief.name].fact("storage", "marker", "written")
    path = f"{storage.dirs[chief.name].rstrip('/')}/{storage.marker}"
    readers = [m for m in machines if m is not chief and by_name[m.name].fact("storage", "ok")]
    try:
        answers = fan_out(readers if written else [], lambda m: _facts(runner(m.host).run(
            [m.python, "-c", PREFLIGHT.read_text(), f"--read-marker={path}"], timeout_s=60)),
            name_of=lambda m: m.name)
    finally:
        if by_name[chief.name].reachable:
            _remove_marker(chief, runner, path)
    seen: dict[str, dict[str, Any]] = {}
    for r in answers.results:
        marker = dict(r.value["marker"]) if r.ok and r.value else {
            "content": None, "error": _message(r.name, r.error)}
        ok = marker["content"] == storage.content
        seen[r.name] = {"path": path, "chief": chief.name, "ok": ok,
                        "error": None if ok else marker["error"] or "other content"}
    return [_with_storage(c, {"sees_chief_marker": seen[c.name]}) if c.name in seen else c
            for c in checks]


def _remove_marker(chief: Machine, runner: Callable[[Host], Runner], path: str) -> None:
    with contextlib.suppress(Exception):  # unanswered: the marker stays, a hidden file
        runner(chief.host).run([chief.python, "-c", PREFLIGHT.read_text(),
                                f"--remove-marker={path}"], timeout_s=30, check=False)


def _with_storage(check: HostCheck, extra: Mapping[str, Any]) -> HostCheck:
    facts = {**check.facts, "storage": {**(check.fact("storage") or {}), **extra}}
    return replace(check, facts=facts)


def _host_check(machine: Machine, unreachable: Exception | None,
                answers: FanOutResult[dict[str, Any]]) -> HostCheck:
    def check(**fields: Any) -> HostCheck:
        return HostCheck(machine.name, machine.host.address,
                         tuple(t.key for t in machine.tasks), machine.python, **fields)

    if unreachable is not None:
        return check(reachable=False, error=_message(machine.name, unreachable),
                     fix=_fix(unreachable))
    result = next(r for r in answers.results if r.name == machine.name)
    if not result.ok or result.value is None:
        return check(reachable=True, error=_message(machine.name, result.error),
                     fix=_fix(result.error))
    return check(reachable=True, facts=result.value,
                 seconds=float(result.value.get("seconds", 0.0)))


def _message(name: str, error: Exception | None) -> str:
    if isinstance(error, CommandError):
        tail = error.output.strip().splitlines()[-1:] or [f"exit {error.exit_code}"]
        return f"the preflight exited {error.exit_code}: {tail[0]}"
    if isinstance(error, OrchestratorError):
        return error.message.removeprefix(f"{name}: ")
    if isinstance(error, json.JSONDecodeError):
        return "preflight printed no report (a wrapper or shell profile printing to stdout?)"
    return f"{type(error).__name__}: {error}"


def _fix(error: Exception | None) -> str:
    if isinstance(error, CommandError) and error.exit_code == 127:
        return "set provider.python to an interpreter that exists on every host"
    if isinstance(error, OrchestratorError) and error.fix:
        return error.fix
    return "run the command by hand on the host to see why"


def _links(machines: Sequence[Machine], checks: Sequence[HostCheck]) -> list[Link]:
    by_name = {c.name: c for c in checks}
    taken = {(c.name, p["port"]) for c in checks for p in c.ports if not p["free"]}
    links = []
    for source in machines:
        results = {p["endpoint"]: p for p in by_name[source.name].facts.get("peers", [])}
        for target in machines:
            if target is source:
                continue
            for task in target.tasks:
                links.append(_link(source, target, task, results.get(task.endpoint), by_name,
                                   (target.name, task.port) in taken))
    return links


def _link(source: Machine, target: Machine, task: TaskPlan, result: dict[str, Any] | None,
          checks: Mapping[str, HostCheck], port_taken: bool) -> Link:
    ok: bool | None = None
    unchecked = [end.name for end in (source, target) if not checks[end.name].checked]
    if unchecked:
        error = f"not checked: {unchecked[0]} did not answer"
    elif port_taken:
        error = f"not checked: port {task.port} is in use on {target.name}"
    elif result is None:
        error = "not checked"
    else:
        ok, error = bool(result["ok"]), str(result.get("error") or "")
    return Link(source.name, task.key, task.endpoint, ok, error)


# -- diagnosis -------------------------------------------------------------------------------
def diagnose(spec: ClusterSpec, plan: ClusterPlan, checks: Sequence[HostCheck],
             links: Sequence[Link]) -> list[Problem]:
    """Every problem the answers show, blocking ones first."""
    ok = [c for c in checks if c.checked]
    hosted = spec.container is None  # else Python, TensorFlow and JAX are the image's
    on_jax = spec.job.backend == "jax"
    found = [
        *_unreachable(checks),
        *((_jax(ok) if on_jax else _tensorflow(spec, ok)) if hosted else []),
        *_gpus(spec, ok),
        *(_python(ok) if hosted else []),
        *_disk(ok),
        *_storage(plan, ok),
        *_ports(plan, ok),
        *_network(spec, plan, checks, links),
        *(_host_names(ok) if on_jax and len(checks) > 1 else []),
        *(_gfile_for_jax(plan, ok) if on_jax and hosted else []),
    ]
    return sorted(found, key=lambda p: not p.blocking)


def _gfile_for_jax(plan: ClusterPlan, checks: Sequence[HostCheck]) -> list[Problem]:
    """A JAX job whose checkpoints go to a bucket reaches it through TensorFlow's file systems
    (as Keras does for remote paths): hosts where the write check found no TensorFlow to try
    it with cannot save."""
    missing: dict[tuple[str, str], list[str]] = {}
    for c in checks:
        path, skipped = c.fact("storage", "path"), c.fact("storage", "skipped")
        if isinstance(path, str) and is_url(path) and isinstance(skipped, str) \
                and skipped.startswith("TensorFlow"):
            # the preflight's reason, less its own ": gs:// cannot be checked"
            missing.setdefault((path, skipped.split(": gs://")[0]), []).append(c.name)
    return [Problem(
        "checkpoint", f"{', '.join(hosts)}: {why}, and this JAX job's checkpoints go to {path} "
        f"({plan.checkpoints.named_by or 'checkpoint.dir'}): Keras on JAX reaches a gs:// URL "
        "only through TensorFlow's file systems (tf.io.gfile)", GFILE_FIX, hosts=tuple(hosts))
        for (path, why), hosts in missing.items()]


def _unreachable(checks: Iterable[HostCheck]) -> list[Problem]:
    problems = []
    for c in checks:
        if c.checked:
            continue
        what = "cannot be reached over SSH" if not c.reachable else "could not be checked"
        problems.append(Problem("ssh" if not c.reachable else "preflight",
                                f"{c.name} ({c.address}) {what}: {c.error}", c.fix,
                                hosts=(c.name,)))
    return problems


def _spread(checks: Iterable[HostCheck], value: Callable[[HostCheck], str | None]
            ) -> dict[str, list[str]]:
    """Value -> the hosts that have it (hosts without a value left out)."""
    seen: dict[str, list[str]] = {}
    for c in checks:
        v = value(c)
        if v:
            seen.setdefault(v, []).append(c.name)
    return seen


def _spread_text(seen: Mapping[str, list[str]]) -> str:
    return "; ".join(f"{v} on {', '.join(hosts)}" for v, hosts in
                     sorted(seen.items(), key=lambda kv: -len(kv[1])))


def _majority(seen: Mapping[str, list[str]]) -> str:
    return max(seen.items(), key=lambda kv: len(kv[1]))[0]


def _tensorflow(spec: ClusterSpec, checks: Sequence[HostCheck]) -> list[Problem]:
    rules = runtime_for(spec.job).rules(spec.job)
    extras = "".join(f" {name}" for name in rules.install_with)
    problems = []
    versions = _spread(checks, lambda c: c.tf_version)
    want = _majority(versions) if versions else "2.21.*"
    for c in checks:
        if c.tf_version is None:
            problems.append(Problem(
                "tensorflow", f"TensorFlow is not installed for {c.python} on {c.name} "
                f"({c.tf_error or 'no version found'})",
                f"install it there: {c.python} -m pip install 'tensorflow=={want}'{extras}",
                blocking=rules.needs_tensorflow, hosts=(c.name,)))
        elif c.tf_error and not c.fact("tensorflow", "imported"):
            problems.append(Problem(
                "tensorflow", f"TensorFlow {c.tf_version} does not import on {c.name}: "
                f"{c.tf_error}", f"reinstall it: {c.python} -m pip install --force-reinstall "
                f"'tensorflow=={c.tf_version}'", hosts=(c.name,)))
    odd = [c for c in checks if c.tf_version and c.tf_version != want]
    if odd:
        problems.append(Problem(
            "tensorflow", f"TensorFlow versions differ: {_spread_text(versions)}. Tasks with "
            "different versions fail to form the collective group or to restore each other's "
            "checkpoints", f"install TensorFlow {want} on {', '.join(c.name for c in odd)} "
            f"({odd[0].python} -m pip install 'tensorflow=={want}'), or build the hosts from "
            "one image", hosts=tuple(c.name for c in odd)))
    for package in rules.matching:  # where TensorFlow is the odd one, the right one fixes both
        problems += _matching(package, [c for c in checks if c not in odd])
    return problems


def _matching(package: MatchingPackage, checks: Sequence[HostCheck]) -> list[Problem]:
    """The job's runtime needs ``package`` in TensorFlow's minor version on every host."""
    problems = []
    name = package.module
    for c in checks:
        tf, version = c.tf_version, c.text(name, "version")
        if tf is None:
            continue
        fix = f"{c.python} -m pip install '{package.pip}~={_minor(tf)}.0'"
        if version is None:
            problems.append(Problem(name, f"{name} is not installed on {c.name}: {package.why}",
                                    fix, hosts=(c.name,)))
        elif _minor(version) != _minor(tf):
            problems.append(Problem(
                name, f"{name} {version} does not match TensorFlow {tf} on {c.name}", fix,
                hosts=(c.name,)))
    return problems


def _jax(checks: Sequence[HostCheck]) -> list[Problem]:
    """For a job on JAX: JAX, a jaxlib it imports with, and Keras 3 on every host, and one
    version of JAX and jaxlib everywhere. A host whose preflight said nothing of JAX (another
    version's) is left out: nothing is guessed."""
    told = [c for c in checks if c.fact("jax") is not None]
    sound = [c for c in told if c.jax_version and _jaxlib_fault(c) is None]
    pairs = _spread(sound, _jax_pair)
    want = next((c for c in sound if _jax_pair(c) == _majority(pairs)), None) if pairs else None
    problems = [p for c in told for p in _jax_install(c, want)]
    odd = [c for c in sound if want and _jax_pair(c) != _jax_pair(want)]
    if want and odd:
        problems.append(Problem(
            "jax", f"JAX versions differ: {_spread_text(pairs)}. Processes of different versions "
            "can fail to join JAX's distributed service or compile collectives that do not match",
            f"install jax {want.jax_version} and jaxlib {want.jaxlib_version} on "
            f"{', '.join(c.name for c in odd)} ({odd[0].python} -m pip install "
            f"{_jax_pins(odd[0], want)}), or build the hosts from one image",
            hosts=tuple(c.name for c in odd)))
    return problems


def _jax_pair(c: HostCheck) -> str:
    return f"jax {c.jax_version} with jaxlib {c.jaxlib_version}"


def _jax_pins(c: HostCheck, want: HostCheck | None) -> str:
    """pip's arguments for the jax and jaxlib of ``want`` (else jaxlib in ``c``'s JAX version)
    on ``c``, and ``c``'s CUDA plugin in that jaxlib's version (JAX loads no other)."""
    jax = want.jax_version if want else c.jax_version
    jaxlib = want.jaxlib_version if want else c.jax_version
    plugin = c.text("jax", "cuda_plugin", "name")
    return " ".join(f"'{name}=={version}'" for name, version in
                    (("jax", jax), ("jaxlib", jaxlib), (plugin, jaxlib)) if name and version)


def _jaxlib_fault(c: HostCheck) -> str | None:
    """Why JAX does not import with this host's jaxlib, as JAX's own check on import says;
    None where it does."""
    jax, jaxlib, minimum = c.jax_version, c.jaxlib_version, c.text("jax", "minimum_jaxlib")
    if jaxlib is None:
        return f"jaxlib is not installed on {c.name}: JAX {jax} does not import without it"
    if minimum and _version(jaxlib) < _version(minimum):
        return (f"jaxlib {jaxlib} on {c.name} is older than JAX {jax} imports with (>= "
                f"{minimum}): JAX does not import")
    if _version(jaxlib) > _version(jax or ""):
        return (f"jaxlib {jaxlib} on {c.name} is newer than JAX {jax}: JAX does not import "
                "('newer than and incompatible with jax version')")
    return None


def _jax_install(c: HostCheck, want: HostCheck | None) -> list[Problem]:
    """JAX, a jaxlib that JAX imports with, and Keras 3 on host ``c``; ``want``, the host
    whose JAX and jaxlib the others should have (None: no host has a sound pair)."""
    keras = c.keras_version
    keras_3 = keras is not None and _version(keras)[:1] == (3,)
    if c.jax_version is None:
        pin = f"jax=={want.jax_version}" if want else JAX_REQUIREMENT
        return [Problem(
            "jax", f"JAX is not installed for {c.python} on {c.name}"
            + ("" if keras_3 else ", nor Keras 3") + ": the job's tasks run on JAX "
            "(job.backend: jax)",
            f"install it there: {c.python} -m pip install '{pin}'"
            + ("" if keras_3 else f" '{KERAS_REQUIREMENT}'")
            + " (or, from this project's checkout on the host: pip install -e '.[jax]')",
            hosts=(c.name,))]
    problems = []
    fault, error = _jaxlib_fault(c), c.text("jax", "error")
    if fault:
        problems.append(Problem("jax", fault, "install a JAX and jaxlib that match there: "
                                f"{c.python} -m pip install {_jax_pins(c, want)}",
                                hosts=(c.name,)))
    elif error:
        problems.append(Problem(
            "jax", f"JAX did not list its devices on {c.name}: {error}",
            f"run {c.python} -c 'from jax import devices; print(devices())' on {c.name} to see "
            "why", blocking=False, hosts=(c.name,)))
    if not keras_3:
        what = "not installed" if keras is None else f"{keras}, not Keras 3"
        problems.append(Problem(
            "keras", f"Keras on {c.name} is {what}: on JAX the tasks train with Keras 3",
            f"install it there: {c.python} -m pip install '{KERAS_REQUIREMENT}'",
            hosts=(c.name,)))
    return problems


def _gpus(spec: ClusterSpec, checks: Sequence[HostCheck]) -> list[Problem]:
    problems = [*_gpu_counts(checks), *_collectives(spec, checks)]
    gpu_hosts = [c for c in checks if c.gpus]
    models = _spread(gpu_hosts, lambda c: " + ".join(sorted({g.name for g in c.gpus})))
    if len(models) > 1:
        problems.append(Problem(
            "gpu", f"GPU models differ: {_spread_text(models)}. Every step waits for the "
            "slowest GPU, so the faster ones idle (stragglers)",
            "use one machine type for every host (or accept the slowest GPU's pace)",
            blocking=False, hosts=tuple(c.name for c in gpu_hosts)))
    if gpu_hosts and len(gpu_hosts) < len(checks):
        cpu = [c.name for c in checks if not c.gpus]
        problems.append(Problem(
            "gpu", f"{', '.join(cpu)} {'has' if len(cpu) == 1 else 'have'} no GPU while "
            f"{', '.join(c.name for c in gpu_hosts)} do: every step runs at CPU speed",
            "give every host a GPU, or train on the GPU hosts only", blocking=False,
            hosts=tuple(cpu)))
    drivers = _spread(gpu_hosts, lambda c: c.driver)
    if len(drivers) > 1:
        problems.append(Problem(
            "gpu", f"NVIDIA driver versions differ: {_spread_text(drivers)} (a known cause of "
            "NCCL errors and uneven speed)", "install one driver version on every host "
            "(GPU VMs from one image)", blocking=False, hosts=tuple(c.name for c in gpu_hosts)))
    for c in gpu_hosts:
        if spec.job.backend != "jax":
            problems += _gpu_stack(c)
        elif spec.container is None:
            problems += _jax_gpus(c)
    return problems


def _gpu_counts(checks: Sequence[HostCheck]) -> list[Problem]:
    """Every task must run as many replicas as every other: MultiWorkerMirroredStrategy sizes
    its collective group as a task's own replicas times the tasks."""
    counted = [c for c in checks if not c.blind]  # said already, host by host
    if len({c.replicas for c in counted}) < 2:
        return []
    seen = _spread(counted, lambda c: f"{c.gpu_count} GPU(s)" if c.gpu_count else "no GPU")
    fewest = min(c.gpu_count for c in counted)
    same = (f", or make every task use {fewest}: env: {{CUDA_VISIBLE_DEVICES: "
            f"'{','.join(map(str, range(fewest)))}'}} in the spec" if fewest else "")
    return [Problem(
        "gpu", f"the hosts have different numbers of GPUs: {_spread_text(seen)}. Each task runs "
        "a replica per GPU it sees, and MultiWorkerMirroredStrategy needs the same number on "
        "every task (it sizes the collective group as its own replicas x the tasks)",
        f"give every host the same GPUs (one machine type){same}",
        hosts=tuple(c.name for c in counted))]


def _collectives(spec: ClusterSpec, checks: Sequence[HostCheck]) -> list[Problem]:
    """The job's collectives against the GPUs found: NCCL needs a GPU in every task and one
    task per GPU; RING where every host has GPUs leaves NCCL's speed unused."""
    if not checks:
        return []
    if spec.job.backend == "jax":  # JAX picks its own: NCCL between GPUs, else gloo
        return _shared_gpus(checks, "with job.backend: jax the GPUs all-reduce with NCCL, "
                            f"which {DUPLICATE_GPU}", "")
    asked = spec.job.collectives
    choice = resolve_collectives(asked, [c.gpu_count for c in checks for _ in c.tasks])
    named = f"job.collectives: {asked}" + (" (NCCL here)" if asked != choice else "")
    problems = []
    cpu = [c.name for c in checks if not c.gpu_count]
    if asked == "ring" and not cpu:
        problems.append(Problem(
            "collectives", "every host has GPUs but job.collectives is ring: gradients are "
            "all-reduced over gRPC through the hosts' CPUs, slower than NCCL from GPU to GPU",
            "set job.collectives: nccl (or auto: NCCL when every task has a GPU)",
            blocking=False, hosts=tuple(c.name for c in checks)))
    if choice == "nccl" and cpu:
        problems.append(Problem(
            "collectives", f"{named}, but {', '.join(cpu)} {'has' if len(cpu) == 1 else 'have'} "
            "no GPU that TensorFlow can use: NCCL all-reduces only between GPUs, so the tasks "
            "there would stop at start",
            "give every host a GPU (and TensorFlow with CUDA), or set job.collectives: auto "
            "(RING when a task has no GPU) or ring", hosts=tuple(cpu)))
    nccl = choice == "nccl"
    return problems + _shared_gpus(checks, f"with {named}, NCCL {DUPLICATE_GPU}" if nccl else "",
                                   ", or set job.collectives: ring" if nccl else "")


def _shared_gpus(checks: Sequence[HostCheck], nccl: str, fix: str) -> list[Problem]:
    """Machines whose tasks would each use all of their GPUs: blocking where ``nccl`` says
    that NCCL all-reduces there (it refuses two ranks on one GPU); ``fix``, another way out."""
    problems = []
    for c in checks:
        if len(c.tasks) > 1 and c.gpu_count:
            problems.append(Problem(
                "gpu", f"{c.name} runs {len(c.tasks)} tasks and each uses all {c.gpu_count} of "
                "its GPUs: " + (nccl or "they compete for GPU memory and time"),
                f"run one task per machine (a task uses every GPU of its host){fix}",
                blocking=bool(nccl), hosts=(c.name,)))
    return problems


def _gpu_stack(c: HostCheck) -> list[Problem]:
    problems = []
    driver, built = _version(c.driver_cuda or ""), _version(_minor(c.tf_cuda or ""))
    if driver and built and driver < built:
        older_major = driver[0] < built[0]  # within a major version, CUDA is minor-compatible
        problems.append(Problem(
            "cuda", f"the NVIDIA driver {c.driver} on {c.name} supports CUDA up to "
            f"{c.driver_cuda}, but TensorFlow {c.tf_version} is built for CUDA {c.tf_cuda}"
            + ("" if older_major else ": it runs by CUDA's minor-version compatibility, but "
               "kernels compiled at run time (PTX) may fail"),
            f"upgrade the driver on {c.name} to one for CUDA {_minor(c.tf_cuda or '')} or newer",
            blocking=older_major, hosts=(c.name,)))
    if c.tf_gpus is not None and not c.tf_gpus:
        problems.append(Problem(
            "gpu", f"TensorFlow on {c.name} sees none of its {len(c.gpus)} GPU(s) "
            f"({c.gpus[0].name}): its tasks would train on the CPU",
            f"install TensorFlow with CUDA there: {c.python} -m pip install "
            f"'tensorflow[and-cuda]=={c.tf_version}'", hosts=(c.name,)))
    return problems


def _jax_gpus(c: HostCheck) -> list[Problem]:
    """On a host with GPUs, a job on JAX: whether JAX sees them (where it listed its devices),
    or why it would not (its CPU wheel, a CUDA plugin of another version than jaxlib's)."""
    jax = c.jax_version
    if jax is None:
        return []  # blocking already
    plugin, version = c.text("jax", "cuda_plugin", "name"), c.text("jax", "cuda_plugin", "version")
    if plugin is None:
        why = ": JAX is installed without CUDA (the CPU wheel, no jax-cuda12-plugin)"
    elif c.jaxlib_version and _version(version or "") != _version(c.jaxlib_version):
        why = (f": its {plugin} {version} is not jaxlib's version ({c.jaxlib_version}), so JAX "
               "does not load it")
    else:
        why = ""
    listed = c.jax_gpus is not None
    if (listed and c.jax_gpus) or not (listed or why):  # it sees them, or nothing says it won't
        return []
    extra = (plugin or "jax-cuda12-plugin").split("-")[1]
    fix = f"install JAX with CUDA there: {c.python} -m pip install 'jax[{extra}]=={jax}'"
    if c.driver_cuda and _version(c.driver_cuda)[:1] < (12,):
        fix = (f"upgrade the NVIDIA driver on {c.name} (it supports CUDA up to {c.driver_cuda}; "
               f"JAX's CUDA wheels need 12 or newer), then {fix}")
    elif not why:
        fix = (f"run {c.python} -c 'from jax import devices; print(devices())' on {c.name} to see why "
               "(the CUDA libraries, the driver)")
    seen = "sees none" if listed else "would see none"
    return [Problem(
        "gpu", f"JAX on {c.name} {seen} of its {len(c.gpus)} GPU(s) ({c.gpus[0].name}){why}: "
        "its tasks would train on the CPU, with gloo's collectives", fix, blocking=False,
        hosts=(c.name,))]


def _python(checks: Sequence[HostCheck]) -> list[Problem]:
    versions = _spread(checks, lambda c: _minor(c.python_version or ""))
    if len(versions) <= 1:
        return []
    return [Problem("python", f"Python versions differ: {_spread_text(versions)}; pickled "
                    "data and some saved objects do not cross versions",
                    "use one Python version on every host", blocking=False,
                    hosts=tuple(c.name for c in checks))]


def _disk(checks: Sequence[HostCheck]) -> list[Problem]:
    problems = []
    for c in checks:
        free, where = c.free_bytes, c.fact("disk", "path")
        if free is None or free >= LOW_FREE_BYTES:
            continue
        blocking = free < MIN_FREE_BYTES
        problems.append(Problem(
            "disk", f"only {human_bytes(free)} free on {c.name} for {where} "
            f"({'checkpoints will not fit' if blocking else 'a long run may fill it'})",
            f"free space on {c.name}, or set provider.root to a larger disk",
            blocking=blocking, hosts=(c.name,)))
    return problems


def _storage(plan: ClusterPlan, checks: Sequence[HostCheck]) -> list[Problem]:
    """Hosts that cannot write where checkpoints go (facts of the preflight's --write-check),
    then hosts that see another directory there than the chief's machine writes."""
    named_by = plan.checkpoints.named_by or "checkpoint.dir"
    failed: dict[tuple[str, str, str, bool], list[str]] = {}
    for c in checks:
        if c.fact("storage", "ok") is False:
            url = bool(c.fact("storage", "url"))  # a bucket's access is not the login user's
            key = (str(c.fact("storage", "path")), str(c.fact("storage", "error")),
                   "" if url else str(c.fact("storage", "user")), url)
            failed.setdefault(key, []).append(c.name)
    problems = []
    for (path, error, user, url), hosts in failed.items():
        names = ", ".join(hosts)
        message = f"{names} cannot write checkpoints to {path} ({named_by}): {error}"
        if url:
            problems.append(Problem("checkpoint", message, GCS_FIX, hosts=tuple(hosts)))
            continue
        quoted = shlex.quote(path)
        other = ("mount the shared file system there" if plan.checkpoints.shared else
                 f"set {named_by} to a directory {user} can write")
        problems.append(Problem(
            "checkpoint", message, f"create {path} on {names} writable by user {user} (sudo "
            f"mkdir -p {quoted} && sudo chown {shlex.quote(user)} {quoted}), or {other}",
            hosts=tuple(hosts)))
    return problems + _not_shared(checks)


def _not_shared(checks: Sequence[HostCheck]) -> list[Problem]:
    """Hosts where the file the chief's machine left in the shared directory is not there."""
    unseen: dict[tuple[str, str, str], list[str]] = {}
    for c in checks:
        seen = c.fact("storage", "sees_chief_marker")
        if isinstance(seen, Mapping) and seen.get("ok") is False:
            key = (str(c.fact("storage", "path")), str(seen.get("chief")), str(seen.get("error")))
            unseen.setdefault(key, []).append(c.name)
    problems = []
    for (path, chief, error), hosts in unseen.items():
        names = ", ".join(hosts)
        how = {"No such file or directory": "is missing", "other content": "holds other content"
               }.get(error, f"cannot be read ({error})")
        problems.append(Problem(
            "checkpoint", f"{path} on {names} is not the directory that {chief} writes: a file "
            f"{chief} wrote there {how} on {names}, so the tasks there would not see the chief's "
            "checkpoints",
            f"mount the same shared file system at {path} on every host, or remove "
            "checkpoint.dir so the chief's checkpoint is copied to every host before a relaunch",
            hosts=tuple(hosts)))
    return problems


def _ports(plan: ClusterPlan, checks: Sequence[HostCheck]) -> list[Problem]:
    problems = []
    for c in checks:
        for p in c.ports:
            if p["free"]:
                continue
            fixed = any(plan.task(key).host.task_port == p["port"] for key in c.tasks)
            problems.append(Problem(
                "port", f"port {p['port']} on {c.name} is in use ({p['error']})"
                + ("" if fixed else "; train will take the next free port of the range"),
                f"stop what listens there (ss -ltnp 'sport = :{p['port']}' shows it)"
                + (" or give the host another task_port" if fixed else ""),
                blocking=fixed, hosts=(c.name,)))
    return problems


def _network(spec: ClusterSpec, plan: ClusterPlan, checks: Sequence[HostCheck],
             links: Sequence[Link]) -> list[Problem]:
    address = {c.name: c.address for c in checks}
    problems = []
    for link in links:
        if link.ok is not False:
            continue
        target = plan.task(link.target)
        problems.append(Problem(
            "network", f"{link.source} cannot open a TCP connection to {link.target} at "
            f"{link.endpoint}: {link.error}. TensorFlow's gRPC needs every host to reach every "
            "other host's task port",
            f"allow TCP from {address[link.source]} to {target.host.address} on ports "
            f"{spec.ports.start}-{spec.ports.end} (firewall rules, security groups); for "
            "GCP the cluster's rule orchestrate-NAME-grpc does this",
            hosts=(link.source, target.host.name)))
    return problems


def _host_names(checks: Sequence[HostCheck]) -> list[Problem]:
    """On JAX, every host's name must resolve to an address its peers reach: JAX's CPU
    collectives (gloo) listen on the first address of the host's name that the host can bind
    and tell the other processes to connect there (the preflight's ``hostname_lookup``). On
    GPUs the collectives are NCCL's, which do not look the name up: there only a warning."""
    return [p for p in map(_host_name, checks) if p is not None]


def _host_name(c: HostCheck) -> Problem | None:
    name, lookup = c.text("hostname"), c.fact("hostname_lookup")
    if name is None or not isinstance(lookup, Mapping):
        return None  # not read (a preflight of another version): nothing is guessed
    if _is_ip(c.address) and ipaddress.ip_address(c.address).is_loopback:
        return None  # its peers reach it over loopback: they are on this machine
    bound, error = lookup.get("bindable"), lookup.get("error")
    addresses = [str(a) for a in lookup.get("addresses") or []]
    if error or not addresses:
        what, action = f"does not resolve ({error or 'no address'})", "add the line"
    elif bound is None:
        what = (f"resolves to {', '.join(addresses)}, none of them an address of {c.name} "
                "(gloo: 'Unable to find address for')")
        action = f"replace the line '{addresses[0]} ... {name}' with"
    elif is_loopback(str(bound).split("%")[0]):
        what = (f"resolves to {bound}, a loopback address: the other hosts would connect to "
                f"themselves ('Gloo context initialization failed ... remote=[{bound}]')")
        action = f"replace the line '{bound} ... {name}' with"
    else:
        return None
    gpus = (f" ({c.name} has GPUs, whose collectives (NCCL) do not use the name: only "
            "collectives of CPU arrays would fail)" if c.gpu_count else "")
    address = c.address if _is_ip(c.address) else "ADDRESS"
    return Problem(
        "hostname", f"{c.name}'s host name {name!r} {what}. With job.backend: jax the CPU "
        "collectives (gloo) listen on the address of the host's name and tell every other "
        f"process to connect there{gpus}",
        f"in /etc/hosts on {c.name}, map {name} to the address the other hosts reach it at "
        f"({c.address}): {action} '{address} {name}'", blocking=not c.gpu_count,
        hosts=(c.name,))


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


# -- small helpers -----------------------------------------------------------------------------
def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".") if p.isdigit())
