"""The digits job for the benchmarks: run under `orchestrate train`, or hand-launched with the same TF_CONFIG.

Both read the worker's own event timestamps (``time`` of each ``@orchestrate`` line) from the
task logs afterwards, so no polling delay of the benchmark enters a figure.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import REPO, note
from hostlab import HostLab, LabError, LabHost

from orchestrator import plan as planning
from orchestrator import spec as specs
from orchestrator.events import Event, parse_line
from orchestrator.hosts import Host
from orchestrator.paths import home
from orchestrator.providers import for_spec
from orchestrator.state import RunRecord, Store
from orchestrator.supervisor import Supervisor
from orchestrator.view import Listener, RunResult

TIMEOUT_S = 300.0
# Not the default range (23456-23655) that the test suite uses, maybe at the same time, and
# where another benchmark process starts its own search at a different port.
PORTS = {"start": 24000 + os.getpid() % 100 * 10, "end": 24000 + os.getpid() % 100 * 10 + 199}


@dataclass(frozen=True)
class Target:
    """Where the tasks run: this machine (``local`` provider) or lab hosts (``static`` over SSH)."""

    name: str
    lab: HostLab | None = None
    hosts: tuple[LabHost, ...] = ()

    def namespace_of(self, address: str) -> str | None:
        return next((h.namespace for h in self.hosts if h.address == address), None)


LOCAL = Target("local")
# examples.digits paced: each batch takes >= DIGITS_PACE_S (0.2 s) until a file named
# ``release`` exists in the run's directory on the task's host (tests/workloads/pace.py).
PACED = "tests.workloads.paced_digits"
# examples.keras3_digits for Keras 3 on JAX, paced the same way without TensorFlow
# (tests/workloads/paced_jax_digits.py)
PACED_JAX = "tests.workloads.paced_jax_digits"
PACED_FILES = {PACED: ("__init__.py", "pace.py", "paced_digits.py"),
               PACED_JAX: ("__init__.py", "paced_jax_digits.py")}


@contextlib.contextmanager
def namespace_lab(size: int) -> Iterator[tuple[HostLab | None, str]]:
    """A lab of ``size`` sshd hosts in network namespaces, or None and the reason there is none."""
    if os.geteuid() != 0:
        yield None, "needs root (network namespaces, sshd, test users)"
        return
    try:
        lab = HostLab.start()
    except (LabError, OSError, subprocess.SubprocessError) as exc:
        yield None, f"the namespace lab did not start: {exc}"
        return
    try:
        if not lab.can_partition:
            yield None, lab.reason
            return
        started = time.monotonic()
        lab.hosts(size)
        note(f"lab: {size} namespace host(s) with sshd up in {time.monotonic() - started:.1f}s")
        yield lab, ""
    finally:
        lab.close()


def digits_spec(name: str, workers: int, target: Target, *, epochs: int, steps_per_epoch: int,
                checkpoint_every: int, module: str = "examples.digits",
                **sections: Any) -> dict[str, Any]:
    """The examples.digits job (one progress event per step) as a spec for ``target``; or
    ``module`` ``PACED`` (the same job, paced until the run's ``release`` file exists)."""
    spec: dict[str, Any] = {
        "name": name, "workers": workers,
        "job": {"module": module, "epochs": epochs, "steps_per_epoch": steps_per_epoch,
                "progress_every_steps": 1},
        "checkpoint": {"every_steps": checkpoint_every}, "ports": PORTS,
        **sections,
    }
    if target.lab is not None:
        spec["provider"] = static_provider(target.lab, target.hosts[:workers])
    return spec


def static_provider(lab: HostLab, hosts: tuple[LabHost, ...] | list[LabHost]) -> dict[str, Any]:
    return {
        "kind": "static", "python": sys.executable, "known_hosts": lab.known_hosts_path,
        "connect_timeout_s": 5, "wait_for_host_s": 10,
        "hosts": [{"address": h.address, "ssh_port": h.port, "user": h.user,
                   "key_file": lab.client_key_path} for h in hosts],
    }


def write_spec(directory: Path, spec: dict[str, Any], stem: str | None = None) -> Path:
    """The spec as a file ``STEM.yaml`` (JSON is YAML; the spec's name by default), validated
    the way the CLI validates it.

    Without a ``workdir``, the job's project is a copy of ``examples/`` under ``directory``
    (and of the paced workload, for a ``PACED`` or ``PACED_JAX`` job): a small user project.
    (This repository's own tree, caches included, would make every ``up`` pack and hash tens
    of MB.)
    """
    project = directory / "project"
    if "workdir" not in spec:
        if not (project / "examples").exists():
            shutil.copytree(REPO / "examples", project / "examples",
                            ignore=shutil.ignore_patterns("__pycache__"))
        workloads = project / "tests" / "workloads"
        for file in PACED_FILES.get(spec.get("job", {}).get("module", ""), ()):
            workloads.mkdir(parents=True, exist_ok=True)
            if not (workloads / file).exists():
                shutil.copy2(REPO / "tests" / "workloads" / file, workloads / file)
    spec = {"workdir": str(project), **spec}
    path = directory / f"{stem or spec['name']}.yaml"
    path.write_text(json.dumps(spec, indent=1))
    specs.load(path)
    return path


@dataclass
class Run:
    """One run of the job: when it was started (this machine's clock) and every event of it."""

    started: float
    events: list[Event] = field(default_factory=list)
    returncode: int = 0
    output: str = ""
    wall_s: float = 0.0
    controller_cpu_s: float | None = None  # the `orchestrate train` process and its children

    @property
    def controller_cpu_share(self) -> float | None:
        """The controller's CPU time over the run's wall time (1.0 = one core all the time)."""
        if self.controller_cpu_s is None or not self.wall_s:
            return None
        return self.controller_cpu_s / self.wall_s

    def first_step_at(self, attempt: int = 1, task: str = "worker:0") -> float | None:
        times = [e.time for e in self.events
                 if e.kind == "progress" and e.attempt == attempt and e.task == task]
        return min(times) if times else None

    def all_started_s(self, attempt: int = 1) -> float | None:
        """Seconds from the start until every task's worker process was running Python (its
        ``started`` event; a warm task's ``warming``, before it imports TensorFlow)."""
        firsts: dict[str, float] = {}
        for e in self.events:
            if e.kind in ("started", "warming") and e.attempt == attempt:
                firsts[e.task] = min(firsts.get(e.task, e.time), e.time)
        return max(firsts.values()) - self.started if firsts else None

    def first_step_s(self, attempt: int = 1) -> float | None:
        """Seconds from the start to the chief's first completed step."""
        at = self.first_step_at(attempt)
        return None if at is None else at - self.started

    def steps_per_s(self, warmup: float = 0.2, task: str = "worker:0") -> float | None:
        """The chief's step rate over the run, leaving out the first ``warmup`` of its steps."""
        steps = sorted((int(e.get("step")), e.time) for e in self.events
                       if e.kind == "progress" and e.attempt == 1 and e.task == task)
        if len(steps) < 3:
            return None
        first = next(s for s in steps if s[0] >= steps[-1][0] * warmup)
        last = steps[-1]
        return (last[0] - first[0]) / (last[1] - first[1]) if last[1] > first[1] else None


def final_loss(runs: list[Run]) -> float | None:
    """The chief's last reported loss of the last of ``runs``."""
    losses = [e.get("loss") for e in runs[-1].events
              if e.kind == "progress" and e.task == "worker:0"] if runs else []
    return round(float(losses[-1]), 4) if losses else None


def cli(*args: str, timeout_s: float = TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """``orchestrate ARGS`` in a subprocess with this process's ORCHESTRATE_HOME (the program
    that the ``orchestrate`` script runs: ``orchestrator/__main__.py``)."""
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout_s,
                          stdin=subprocess.DEVNULL)


def orchestrated(path: Path, *flags: str, timeout_s: float = TIMEOUT_S) -> Run:
    """``orchestrate train PATH --plain FLAGS`` to the end; the clock starts with the subprocess."""
    name = specs.load(path).name
    before = {r.id for r in _runs(name)}
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # the tasks are detached: not children
    started = time.time()
    proc = cli("train", str(path), "--plain", *flags, timeout_s=timeout_s)
    wall = time.time() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"orchestrate train {path.name} exited {proc.returncode}:\n"
                           f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    record = next(r for r in _runs(name) if r.id not in before)
    logs = [t.log for a in record.attempts for t in a.tasks]
    cpu = (after.ru_utime + after.ru_stime) - (usage.ru_utime + usage.ru_stime)
    return Run(started, _events(logs), proc.returncode, proc.stdout, wall, cpu)


def supervise(path: Path, listener: Listener) -> RunResult:
    """One run under the real Supervisor in this process: what ``Cluster.train`` does after its
    preflight checks (``up``, a new run in the store, supervise to the end)."""
    spec = specs.load(path)
    provider = for_spec(spec, path)
    store = Store()
    try:
        provider.up()
        supervisor = Supervisor(spec, provider, store, workdir=specs.workdir_of(spec, path),
                                listener=listener)
        return supervisor.run(store.new_run(spec.name))
    finally:
        provider.close()
        store.close()


def by_hand(path: Path, target: Target, timeout_s: float = TIMEOUT_S) -> Run:
    """Start every task's worker process directly, as a person with the plan would.

    Same argv, TF_CONFIG, environment and working directory as the orchestrator's plan;
    started with ``subprocess.Popen`` (inside the host's network namespace for lab
    hosts), no controller, no SSH, no detaching shell. The clock starts at the first start;
    before it, lab hosts get the code the way ``up`` syncs it (skipped when unchanged).
    """
    spec = specs.load(path)
    provider = for_spec(spec, path)
    try:
        hosts = provider.up() if target.lab is not None else provider.hosts()  # code synced
        busy = provider.busy_ports(hosts)
    finally:
        provider.close()
    plan = planning.build(spec, hosts, run_id=f"by-hand-{uuid.uuid4().hex[:8]}",
                          python=sys.executable, local_workdir=str(specs.workdir_of(spec, path)),
                          busy_ports=busy)
    commands = [_hand_command(task, target) for task in plan.tasks]
    procs: list[subprocess.Popen[bytes]] = []
    started = time.time()
    try:
        for argv, env, task in commands:
            Path(task.log_path).parent.mkdir(parents=True, exist_ok=True)
            with open(task.log_path, "ab") as log:
                procs.append(subprocess.Popen(argv, cwd=task.cwd, env=env, stdout=log,
                                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              start_new_session=True))
        deadline = time.monotonic() + timeout_s
        codes = [p.wait(max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    logs = [t.log_path for t in plan.tasks]
    if any(codes):
        raise RuntimeError(f"hand-launched tasks exited {codes}:\n"
                           + Path(logs[codes.index(next(c for c in codes if c))]).read_text()[-3000:])
    return Run(started, _events(logs))


BY_HAND = "by hand"
TRAIN = "orchestrate train"
TRAIN_NO_DOCTOR = "orchestrate train --no-doctor"
TRAIN_RECHECK = "orchestrate train --recheck"


def train_variants() -> list[str]:
    """``orchestrate train``, and with ``--no-doctor`` too where this version has the preflight;
    where it keeps the doctor's pass for the next train, ``--recheck`` (the doctor runs) first,
    and ``train`` is the one that starts on the kept pass."""
    usage = cli("train", "--help", timeout_s=60).stdout
    if "--recheck" in usage:
        return [TRAIN_RECHECK, TRAIN, TRAIN_NO_DOCTOR]
    return [TRAIN, TRAIN_NO_DOCTOR] if "--no-doctor" in usage else [TRAIN]


def compare(path: Path, target: Target, runs: int, kinds: list[str], *,
            warm_up: bool) -> dict[str, list[Run]]:
    """``runs`` runs of ``path`` of each kind (``BY_HAND``, ``TRAIN``, ...), taking turns, the
    order rotating every repeat so that drift on a shared machine falls on all of them alike.

    On lab hosts, ``orchestrate up`` runs once first (a cluster is up before ``train`` is
    timed); with ``warm_up``, one untimed hand-launched run takes the first-run costs.
    """
    if target.lab is not None:
        up = cli("up", str(path))
        if up.returncode != 0:
            raise RuntimeError(f"orchestrate up failed: {up.stdout}{up.stderr}")
    if warm_up:
        by_hand(path, target)
    if TRAIN_RECHECK in kinds:  # so that every timed plain `train` starts on a kept pass
        doctor = cli("doctor", str(path))
        if doctor.returncode != 0:
            raise RuntimeError(f"orchestrate doctor failed: {doctor.stdout}{doctor.stderr}")
    found: dict[str, list[Run]] = {kind: [] for kind in kinds}
    for i in range(runs):
        for kind in kinds[i % len(kinds):] + kinds[:i % len(kinds)]:
            extra = kind.split()[2:]
            run = by_hand(path, target) if kind == BY_HAND else orchestrated(path, *extra)
            found[kind].append(run)
            note(f"{path.stem} on {target.name}, {kind}: first step at {run.first_step_s() or 0:.2f}s,"
                 f" {run.steps_per_s() or 0:.1f} steps/s")
    return found


def _runs(cluster: str) -> list[RunRecord]:
    store = Store()
    try:
        return store.runs(cluster, limit=1000)
    finally:
        store.close()


def _hand_command(task: planning.TaskPlan, target: Target
                  ) -> tuple[list[str], dict[str, str], planning.TaskPlan]:
    namespace = target.namespace_of(task.host.address)
    if namespace is None:
        return list(task.argv), {**os.environ, **task.env}, task
    login = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": _home_of(task.host),
             "LANG": "C.UTF-8"}
    return ["ip", "netns", "exec", namespace, *task.argv], {**login, **task.env}, task


def _home_of(host: Host) -> str:
    return host.root.split("/.orchestrate/", 1)[0] if "/.orchestrate/" in host.root else str(home())


def _events(logs: list[str]) -> list[Event]:
    found = []
    for log in logs:
        with contextlib.suppress(FileNotFoundError):
            for line in Path(log).read_text(errors="replace").splitlines():
                event = parse_line(line)
                if event is not None:
                    found.append(event)
    return found
