"""The Python API: `Cluster` and `Run`. The CLI is a thin layer over these; notebooks use them directly."""

from __future__ import annotations

import contextlib
import os
import shlex
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from orchestrator import boards, charts, containers, cost, elastic, kept_pass, secrets
from orchestrator import plan as planning
from orchestrator import spec as specs
from orchestrator.errors import OrchestratorError, RunFailed, StateError
from orchestrator.events import Event, LineBuffer, read_line
from orchestrator.hosts import Host, one_per_machine
from orchestrator.launchers import launcher_named
from orchestrator.plan import ClusterPlan, TaskPlan
from orchestrator.problems import Problem
from orchestrator.providers import DownReport, Provider, for_spec
from orchestrator.remote.base import Runner, TaskState
from orchestrator.remote.fanout import fan_out
from orchestrator.runtimes import GpuDescription, resolve_gpus, runtime_for
from orchestrator.runtimes.base import JAX_ADDRESSES_ENV, JAX_PROCESS_ID_ENV, JAX_PROCESSES_ENV
from orchestrator.spec import ClusterSpec, Container
from orchestrator.state import AttemptRecord, ClusterRecord, Point, RunRecord, Store, TaskRecord
from orchestrator.supervisor import HEARTBEAT_S, Supervisor
from orchestrator.view import Listener, RunResult, RunView, safe

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from orchestrator.console import NotebookProgress
    from orchestrator.doctor import DoctorReport, TensorFlowImport

HEARTBEAT_STALE_S = 10.0
RESUMABLE = ("stopped", "cancelled", "failed")  # runs `train --resume` may continue


@dataclass(frozen=True)
class ClusterStatus:
    """A cluster as the state store knows it, with its newest runs first."""

    name: str
    record: ClusterRecord | None
    runs: list[RunRecord]
    histories: dict[str, list[Point]] = field(default_factory=dict)  # by run id

    def to_dict(self) -> dict[str, Any]:
        """The shape of ``orchestrate status --json`` (one entry of its "clusters")."""
        record = self.record
        return {
            "name": self.name,
            "provider": record.provider if record else None,
            "status": record.status if record else "unknown",
            "spec_path": record.spec_path if record else None,
            "updated_at": record.updated_at if record else None,
            "hosts": list(record.hosts) if record else [],
            "runs": [_run_dict(r, self.histories.get(r.id, [])) for r in self.runs],
        }


def statuses(name: str | None = None, store: Store | None = None, *,
             run_id: str | None = None) -> list[ClusterStatus]:
    """Every cluster in the store (or the one named), each with its runs and their histories;
    with ``run_id``, only that run and its cluster.

    Raises:
        StateError: ``name`` is not a cluster the store knows, or ``run_id`` not one of its runs.
    """
    store = store or Store()
    found = [_cluster_status(store, c.name, c, run_id) for c in store.clusters()
             if name in (None, c.name)]
    if name and not found:
        known = ", ".join(c.name for c in store.clusters())
        raise StateError(f"no cluster named {name!r}",
                         fix=f"known clusters: {known}" if known else "no cluster has been "
                         "used yet: start with 'orchestrate train SPEC'")
    if run_id is not None:
        found = [c for c in found if c.runs]
        if not found:
            raise StateError(f"no run {run_id!r}" + (f" of cluster {name!r}" if name else ""),
                             fix="list the runs with 'orchestrate status"
                             + (f" {name}'" if name else "'"))
    return found


def _cluster_status(store: Store, name: str, record: ClusterRecord | None,
                    run_id: str | None = None) -> ClusterStatus:
    """Cluster ``name`` with its newest runs and their histories; with ``run_id``, with that
    run alone (none when it is another cluster's, or no run's)."""
    if run_id is None:
        runs = store.runs(name)
    else:
        run = _run_or_none(store, run_id)
        runs = [run] if run is not None and run.cluster == name else []
    return ClusterStatus(name, record, runs, {r.id: store.points(r.id) for r in runs})


def _run_or_none(store: Store, run_id: str) -> RunRecord | None:
    try:
        return store.get_run(run_id)
    except StateError:
        return None


def plot_run(name: str | None, run_id: str | None, path: Path,
             store: Store | None = None) -> Path:
    """Draw a run (the newest of cluster ``name``, or ``run_id``) to ``path`` (.png or .svg).

    Raises:
        StateError: no such cluster or run, or no cluster named while several have runs.
        OrchestratorError: matplotlib missing, a run with no progress yet, a path not writable.
    """
    found = [c for c in statuses(name, store, run_id=run_id) if c.runs]
    if not found:
        raise StateError("no run to draw: no cluster has runs yet",
                         fix="start one with 'orchestrate train SPEC'")
    if len(found) > 1:
        raise StateError(f"several clusters have runs ({', '.join(c.name for c in found)}): "
                         "which one's to draw?", fix=f"name it: 'orchestrate status "
                         f"{found[0].name} --plot {path}'")
    cluster = found[0]
    run = cluster.to_dict()["runs"][0]
    if not charts.has_history(run):
        raise OrchestratorError(f"run {run['id']} has no progress recorded to draw",
                                fix="wait for its first steps (the chief reports every "
                                "job.progress_every_steps), then run this again")
    charts.save_plot(run, path, f"{cluster.name}: run {run['id']}")
    return path


def _run_dict(run: RunRecord, history: list[Point]) -> dict[str, Any]:
    return {
        "id": run.id, "status": run.status, "started_at": run.started_at,
        "ended_at": run.ended_at,
        "seconds": round((run.ended_at or time.time()) - run.started_at, 3),
        "controller_pid": run.controller_pid, "controller_alive": _controller_alive(run),
        "metrics": run.metrics, "model_path": run.model_path, "message": run.message,
        "restarts": max(0, len(run.attempts) - 1),
        "attempts": [_attempt_dict(a) for a in run.attempts],
        "history": [asdict(p) for p in history],
        **_cost_entries(run),
    }


def _cost_entries(run: RunRecord) -> dict[str, Any]:
    """The run's ``price`` an hour (as it began) and its ``cost`` so far, each with a
    ``summary`` line; null when unknown (a local run, an older or damaged record)."""
    try:
        price = cost.Price.from_json(run.price)
    except ValueError:
        return {"price": None, "cost": None}
    spent = cost.cost_of(price, run, time.time())
    return {"price": {**price.to_json(), "summary": cost.describe_price(price)},
            "cost": {**asdict(spent), "summary": cost.describe_cost(spent, price)}}


def _attempt_dict(a: AttemptRecord) -> dict[str, Any]:
    fields = asdict(a)
    fields.pop("run_id")
    fields["detect_s"] = a.detect_s
    fields["tasks"] = [{"task": t.task, "host": t.host, "endpoint": t.endpoint,
                        "exit_code": t.exit_code, "log": t.log} for t in a.tasks]
    return fields


SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


def spec_schema() -> dict[str, Any]:
    """The JSON Schema of spec files, for editors to validate and complete them."""
    return {"$schema": SCHEMA_DIALECT, **ClusterSpec.model_json_schema()}


@dataclass(frozen=True)
class Scaling:
    """The global batch size and learning rate for a number of replicas in sync.

    ``replicas_known`` is False when the number is assumed: one replica per task, as on
    CPU hosts (a task with N GPUs runs N replicas; ``Cluster.doctor()`` counts them).
    """

    replicas: int
    replicas_known: bool
    per_replica_batch_size: int | None
    global_batch_size: int | None
    learning_rate: float | None
    scaled_learning_rate: float | None
    scale_learning_rate: bool

    @classmethod
    def of(cls, plan: ClusterPlan, replicas: int | None = None) -> Scaling:
        rule = plan.scaling  # the job runtime's: how batch and learning rate follow replicas
        n = rule.replicas or replicas or len(plan.tasks)
        return cls(
            replicas=n, replicas_known=bool(rule.replicas) or replicas is not None,
            per_replica_batch_size=rule.per_replica_batch_size,
            global_batch_size=rule.global_batch_size(n), learning_rate=rule.learning_rate,
            scaled_learning_rate=rule.scaled_learning_rate(n),
            scale_learning_rate=rule.scale_learning_rate,
        )


class Cluster:
    """A cluster spec bound to its provider and the state store.

    Example::

        with Cluster.from_spec("cluster_specs/local.yaml") as cluster:
            run = cluster.train()
            print(run.metrics())
    """

    def __init__(
        self, spec: ClusterSpec, *, spec_path: str | Path | None = None, store: Store | None = None
    ) -> None:
        self.spec = spec
        self.spec_path = Path(spec_path).resolve() if spec_path else Path.cwd() / "<in-memory>"
        self.store = store or Store()
        self._provider: Provider | None = None

    @classmethod
    def from_spec(cls, source: str | Path | ClusterSpec, *, store: Store | None = None) -> Cluster:
        """From a spec file path (validated, errors as SpecError) or a ClusterSpec built in code."""
        if isinstance(source, ClusterSpec):
            return cls(source, store=store)
        return cls(specs.load(source), spec_path=source, store=store)

    @classmethod
    def named(cls, name: str, *, store: Store | None = None) -> Cluster:
        """The cluster the store knows by ``name``, from the spec file it was last used with.

        Raises:
            StateError: no cluster of that name has been used on this machine.
        """
        store = store or Store()
        record = store.get_cluster(name)
        if record is None:
            raise StateError(f"no cluster named {name!r}", fix="see 'orchestrate status'")
        return cls.from_spec(record.spec_path, store=store)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def workdir(self) -> Path:
        return specs.workdir_of(self.spec, self.spec_path)

    @property
    def provider(self) -> Provider:
        if self._provider is None:
            self._provider = for_spec(self.spec, self.spec_path)
        return self._provider

    # -- lifecycle -----------------------------------------------------------------------
    def up(self, *, attach: str | None = None,
           progress: Callable[[str], None] | None = None) -> list[Host]:
        """Create or attach to the hosts and prepare them; idempotent.

        ``attach``: an allocation the user holds (a Slurm job id) to use instead of
        submitting one; ``down`` leaves it. ``progress`` hears what ``up`` waits for (the
        queue's reason) as it changes.

        The cluster's record says "provisioning" meanwhile; an error or a Ctrl-C leaves it
        "failed" or "interrupted" with the hosts it knew before ('down' removes what was
        made), never "provisioning" with no one at work.
        """
        before = self.store.get_cluster(self.name)
        known = before.hosts if before is not None else []
        self._record("provisioning", known)
        if progress is not None:
            self.provider.progress = progress
        try:
            if attach is not None:
                self.provider.adopt(attach)
            hosts = self.provider.up()
            if self.spec.engine_container is not None:
                containers.pull_all(hosts, self.provider.runner, self.spec.engine_container)
        except BaseException as exc:
            self._record("failed" if isinstance(exc, Exception) else "interrupted", known)
            raise
        self._record("up", [{"name": h.name, "address": h.address} for h in hosts])
        return hosts

    def plan(self) -> ClusterPlan:
        """What ``train`` would launch, without touching any host or cloud API."""
        hosts = self.provider.planned_hosts()
        return planning.build(
            self.spec,
            hosts,
            run_id="<next-run>",
            python=self.provider.python(hosts[0]),
            local_workdir=str(self.workdir),
        )

    def doctor(self, *, tensorflow: TensorFlowImport = "auto",
               pass_key: str | None = None) -> DoctorReport:
        """Check every host in parallel: SSH, Python, TensorFlow, GPUs, disk, ports, and every
        host's TCP connection to every other host's task port. What it finds is in the report
        (``report.blocking``, ``report.raise_if_blocking()``); it raises for none of it.

        First the provider's own checks (``Provider.cloud_check``: for gcp, the image, machine
        type and GPUs against the cloud's catalog); machines it says do not exist yet are
        reported, not reached for.

        Args:
            tensorflow: "auto" imports TensorFlow only on hosts with GPUs (to see the GPUs it
                sees); "always" everywhere (seconds per host); "never". For a job with
                ``job.backend: jax`` the same for JAX, in a child process (the devices it
                sees), and TensorFlow is not imported.
            pass_key: the key of the pass kept if nothing is found (``kept_pass``), as
                ``train`` found it before; by default, asked for after a clean report.
        """
        from orchestrator import doctor as doctoring  # not imported by a train on a kept pass

        started = time.monotonic()
        plan = self.plan()
        cloud = self.provider.cloud_check()
        machines = doctoring.machines_of(plan, self.provider.python)
        machines = doctoring.existing(plan, machines, cloud.unprovisioned)
        found = [*cloud.problems, *(self.provider.image_problems()
                                    if tensorflow == "always" else [])]
        # A static group's spares are asked meanwhile (a cloud's are made only as it grows)
        spares = self.provider.spare_hosts() \
            if isinstance(self.spec.provider, specs.StaticProvider) else []
        with self.provider.check_runners([*(m.host for m in machines), *spares]) as runner, \
                ThreadPoolExecutor(max_workers=1) as pool:
            asked = pool.submit(_spare_problems, self.spec, spares, runner)
            report = doctoring.examine(self.spec, self.provider.kind, plan, machines, runner,
                                       tensorflow=tensorflow, found=found)
            report = replace(report, problems=(*report.problems, *asked.result()))
        report = replace(report, seconds=time.monotonic() - started)
        self._keep_pass(report, tensorflow != "never" and not cloud.unprovisioned, pass_key)
        return report

    def kept_pass(self) -> kept_pass.Kept | None:
        """The doctor's passing report ``train`` would start on without checking again, if one
        is kept for this spec and these hosts (``orchestrator/kept_pass.py``; asks each host
        for its ``STAMP``)."""
        key = self._pass_key()
        return None if key is None else kept_pass.load(self.name, key)

    def _pass_key(self) -> str | None:
        """The key of a pass for this spec and its hosts as they are now; None where no pass
        is kept (a scheduler's hosts) or a host did not answer."""
        if self.spec.provider.kind not in kept_pass.PROVIDERS:
            return None
        plan = self.plan()
        python = self.provider.python
        hosts = kept_pass.hosts_of(plan)
        # This machine's tasks (no SSH, no node) that run one Python share its stamp: asked
        # once, a Python's start (about 50 ms of CPU) fewer per task beside the warm tasks'.
        def stamped_by(h: Host) -> tuple[str, str]:
            return ("" if h.is_local else h.name), python(h)

        asked = {stamped_by(h): h for h in reversed(hosts)}  # the first host of each
        found = fan_out(list(asked.values()),
                        lambda h: self.provider.run_repeatable(
                            h, kept_pass.stamp_argv(python(h)), timeout_s=30).strip(),
                        name_of=lambda h: h.name)
        if found.failed:
            return None
        stamped = {r.name: str(r.value) for r in found.succeeded}
        stamps = {h.name: stamped[asked[stamped_by(h)].name] for h in hosts}
        return kept_pass.key_of(self.spec, plan, python, stamps)

    def _keep_pass(self, report: DoctorReport, complete: bool, key: str | None) -> None:
        """Keep ``report`` for the next train, with its warnings, if it passed on every host
        (``complete``: it looked everywhere it could), else drop any pass kept before. ``key``:
        the pass's, if known; else asked for only now (every host just answered)."""
        passed = complete and report.ok and report.gpus_per_task is not None
        key = (key or self._pass_key()) if passed else None
        if key is None:
            kept_pass.drop(self.name)
        else:
            kept_pass.keep(self.name, key, report.seconds, report.gpus_per_task,
                           report.warnings)

    def scaling(self, replicas: int | None = None) -> Scaling:
        """Global batch size and learning rate, for ``replicas`` (default: one per task)."""
        return Scaling.of(self.plan(), replicas)

    def plan_document(self) -> dict[str, Any]:
        """What ``train`` would launch, as ``orchestrate plan --json`` shows it; touches nothing
        (the workdir's files are listed, not read, for what ``up`` would upload)."""
        from orchestrator.remote.sync import upload_of

        plan = self.plan()
        job = runtime_for(self.spec.job).describe(self.spec.job)
        return {
            "cluster": plan.cluster,
            "provider": self.spec.provider.kind,
            "spec": str(self.spec_path),
            "hosts": [_host_entry(t.host) for t in plan.tasks],
            "creates": self.provider.describe(),
            "price": cost.plan_entry(self.spec),
            "runtime": job.runtime,
            "job": dict(job.settings),
            "job_summary": job.summary,
            "total_steps": job.total_steps,
            "scaling": asdict(Scaling.of(plan)),
            "chief": plan.chief_key,
            "cluster_def": {role: list(eps) for role, eps in plan.cluster_def.items()},
            "tasks": [_task_entry(plan, t) for t in plan.tasks],
            "checkpoints": _checkpoints_entry(plan),
            **({"tensorboard": _tensorboard_entry(plan)}
               if "ORCHESTRATE_TENSORBOARD_DIR" in plan.chief.env else {}),
            "stop": _stop_entry(self.spec),
            **({"elastic": _elastic_entry(self.spec, self.provider.spare_hosts())}
               if self.spec.elastic is not None else {}),
            "gpus": asdict(GpuDescription.of(self.spec.job)),
            **({"container": _container_entry(self.spec.engine_container)}
               if self.spec.engine_container is not None else {}),
            **({"upload": upload_of(self.workdir, self.spec.provider).to_dict()}
               if isinstance(self.spec.provider, specs.SSHHosts) else {}),
            **({"secrets": [{"name": name, "set": name in os.environ}
                            for name in self.spec.secrets]} if self.spec.secrets else {}),
        }

    def train(self, *, listener: Listener | None = None, wait: bool = True,
              attach: bool = False, resume: str | None = None, doctor: bool = True,
              progress: bool | None = None,
              on_doctor: Callable[[DoctorReport], None] | None = None,
              recheck: bool = False) -> Run:
        """Run the job, restarting the whole group on failure; with ``wait=False``, in a thread.

        Args:
            listener: called with the run view and each event (drives a display).
            attach: take over the cluster's running run whose controller died (its tasks
                kept training) and supervise it to the end.
            resume: continue an ended run (a run id, or "last": the newest that was
                stopped, cancelled or failed) from its newest checkpoint, as its next attempt.
                A run that 'down' or Ctrl-C stopped saved at its last step: none is redone.
            doctor: check every host once it is up (``doctor()``: after setup, which may
                install TensorFlow) and refuse to start on a blocking problem.
            progress: show the live view in a Jupyter notebook; default: when running in one
                and no ``listener`` is given.
            on_doctor: called with the doctor's report before anything starts.
            recheck: run the doctor even where a passing report is kept for this spec and
                these hosts (``kept_pass()``; without ``recheck``, ``train`` starts on it and
                says so).

        Raises:
            DoctorFailed: the doctor found a blocking problem (the report lists them).
            StateError: a run is already in progress (attach to it or stop it), or
                ``attach`` found nothing to attach to.
        """
        active = self._active_runs(attach)
        resumed = self._resumable(resume) if resume is not None else None
        secret_values = secrets.resolve(self.spec, str(self.spec_path))  # before anything
        if not attach:
            self.up()  # idempotent: re-syncs only what changed since the last up
        display = _notebook_display(listener, progress)
        supervisor = Supervisor(self.spec, self.provider, self.store, workdir=self.workdir,
                                listener=_both(display, listener), secret_values=secret_values)
        run_id = active[0].id if attach else resumed
        if doctor and not attach:
            # A new run's first attempt starts warm at once (Supervisor.prestart): its tasks
            # import TensorFlow while the doctor checks (or the hosts' stamps are compared with
            # a kept pass's), and go (or are stopped) after it.
            early = None if resumed is not None else supervisor.prestart()
            try:
                with _beating(self.store, early):
                    gpus = self._checked(supervisor, recheck, on_doctor)
            except BaseException:
                if early is not None:
                    supervisor.discard(early)
                raise
            # collectives: auto, decided once from the GPUs found, so every task of every
            # attempt agrees (without the doctor, each task decides by the GPUs it sees)
            supervisor.use_spec(resolve_gpus(self.spec, gpus))
            if early is not None:
                self.store.note_run(early, "")
            run_id = run_id or early
        for note in self.provider.notes():
            supervisor.note(note)
        if resumed is not None:
            self.store.reopen_run(resumed)
        run_id = run_id or self.store.new_run(self.name)
        run = Run(self, supervisor, run_id, attach=attach, resume=resumed is not None,
                  display=display)
        if wait:
            run._run()
        else:
            run._start_thread()
        return run

    def _checked(self, supervisor: Supervisor, recheck: bool,
                 on_doctor: Callable[[DoctorReport], None] | None) -> list[int] | None:
        """``train``'s doctor, or the pass kept for this spec and these hosts (said to the
        run's view) unless ``recheck``; the GPUs of every task it found.

        Raises:
            DoctorFailed: the doctor found a blocking problem.
        """
        key = self._pass_key()
        kept = None if key is None or recheck else kept_pass.load(self.name, key)
        if kept is not None:
            supervisor.note(kept.line())
            for warning in kept.warnings:
                supervisor.note(f"! warning {warning.check}: {warning.message}\n"
                                f"    fix: {warning.fix}")
            return kept.gpus_per_task
        report = self.doctor(pass_key=key)
        if on_doctor is not None:
            on_doctor(report)
        report.raise_if_blocking()
        return report.gpus_per_task

    def _resumable(self, which: str) -> str:
        """The run ``train --resume`` continues: ``which`` is its id, or "last"."""
        if which == "last":
            ended = [r for r in self.store.runs(self.name, limit=50)
                     if r.status in RESUMABLE]
            if not ended:
                raise StateError(f"cluster {self.name!r} has no stopped, cancelled or failed run "
                                 "to resume",
                                 fix=f"start one with 'orchestrate train {self.spec_path.name}'")
            return ended[0].id
        run = self.store.get_run(which)
        if run.cluster != self.name or run.status not in RESUMABLE:
            raise StateError(
                f"run {which} is {run.status} in cluster {run.cluster!r}: only a stopped, "
                f"cancelled or failed run of {self.name!r} can be resumed",
                fix=f"list runs with 'orchestrate status {self.name}'")
        return run.id

    def _active_runs(self, attach: bool) -> list[RunRecord]:
        """Runs still marked running; refuses to start beside a live one."""
        active = [r for r in self.store.runs(self.name, limit=20) if r.status == "running"]
        live = [r for r in active if _controller_alive(r)]
        if live:
            raise StateError(
                f"run {live[0].id} of cluster {self.name!r} is being supervised by a live "
                f"controller (pid {live[0].controller_pid})",
                fix=f"follow it with 'orchestrate logs {self.name} -f', or stop it with "
                f"'orchestrate down {self.spec_path.name}'",
            )
        if attach and not active:
            raise StateError(f"cluster {self.name!r} has no running run to attach to",
                             fix=f"start one with 'orchestrate train {self.spec_path.name}'")
        if active and not attach:
            raise StateError(
                f"run {active[0].id} of cluster {self.name!r} has no live controller; "
                "its tasks may still be training",
                fix=f"take it over with 'orchestrate train {self.spec_path.name} --attach', "
                f"or stop it with 'orchestrate down {self.spec_path.name}'",
            )
        return active

    def down(self) -> DownReport:
        """Stop every task this cluster started, then remove what ``up`` made."""
        stopped = self.stop_tasks()
        stopped += self._remove_containers()
        report = self.provider.down()
        self._record("down")
        kept_pass.drop(self.name)
        self.provider.close()
        return DownReport(report.removed, (*stopped, *report.stopped), report.notes)

    def stop_tasks(self) -> list[str]:
        """Stop the tasks of every run the store still marks running, wherever its controller is.

        The run is marked stopped first, so its supervisor (in this process or
        another) does not take the stopped tasks for a failure and restart them. Every task
        gets SIGTERM at once, so all of them save a checkpoint at the same step (``train
        --resume`` continues there), and SIGKILL after ``timeouts.stop_grace_s``.

        So are the tasks of an attempt still recorded running in a run that ended (a second
        Ctrl-C cut its controller's stop short); an attempt whose controller is gone is then
        recorded stopped.
        """
        hosts = {h.name: h for h in self.provider.all_hosts()}
        running: list[tuple[str, TaskRecord]] = []
        left: list[tuple[str, int]] = []  # attempts running with no controller to end them
        for run in self.store.runs(self.name, limit=50):
            unended = [a for a in run.attempts if a.status == "running"]
            if run.status == "running":
                self.store.finish_run(run.id, status="stopped", message="stopped by down")
                running += [(run.id, task) for attempt in run.attempts for task in attempt.tasks
                            if task.host in hosts]
                running += [(run.id, task) for task in run.warm if task.host in hosts]
            elif unended:  # its controller ended before it could record the attempt's end
                running += [(run.id, task) for attempt in unended for task in attempt.tasks
                            if task.host in hosts]
            if not _controller_alive(run):
                left += [(run.id, a.number) for a in unended]

        def stop(item: tuple[str, TaskRecord]) -> str | None:
            run_id, task = item
            runner = self.provider.runner(hosts[task.host])
            launcher = launcher_named(task.launcher)
            handle = launcher.find(task)
            if launcher.poll(runner, handle).state is not TaskState.RUNNING:
                return None
            launcher.stop(runner, handle, self.spec.timeouts.stop_grace_s)
            return f"{run_id} {task.task}"

        stopped: list[str] = []
        if running:
            with ThreadPoolExecutor(max_workers=min(32, len(running))) as pool:
                stopped = [line for line in pool.map(stop, running) if line is not None]
        for run_id, number in left:
            self.store.update_attempt(run_id, number, status="stopped", ended_at=time.time())
        return stopped

    def _remove_containers(self) -> list[str]:
        """Every container this cluster started on its hosts, found by label: those of tasks
        no run record knows any more (a store that was lost, a launch cut short) included."""
        runtimes = {task.launcher for run in self.store.runs(self.name, limit=50)
                    for attempt in run.attempts for task in attempt.tasks
                    if task.launcher in containers.RUNTIMES}
        if self.spec.engine_container is not None:
            runtimes.add(self.spec.engine_container.runtime)
        if not runtimes:
            return []
        machines = one_per_machine(self.provider.all_hosts())

        def remove(host: Host) -> list[str]:
            try:
                runner = self.provider.runner(host)
                return [f"{host.name} container {name}" for rt in sorted(runtimes)
                        for name in containers.remove_cluster(runner, rt, self.name)]
            except OrchestratorError as exc:
                return [f"{host.name}: containers not removed ({exc.message})"]

        with ThreadPoolExecutor(max_workers=min(32, len(machines))) as pool:
            return [line for lines in pool.map(remove, machines) for line in lines]

    # -- inspection ----------------------------------------------------------------------
    def status(self) -> ClusterStatus:
        return _cluster_status(self.store, self.name, self.store.get_cluster(self.name))

    def history(self, run_id: str | None = None) -> list[Point]:
        """A run's recorded progress (the newest run by default): the chief's loss, metrics
        and speed at its steps, per attempt, at most ``history.MAX_POINTS`` spread evenly."""
        return self.store.points(self.run(run_id).id)

    def plot(self, path: str | Path | None = None, run_id: str | None = None) -> Figure:
        """A run as a matplotlib figure (a notebook shows it): loss and steps/s over time, one
        colour per attempt, the restarts marked; written to ``path`` (.png or .svg) if given.

        Raises:
            OrchestratorError: matplotlib is not installed, or the path cannot be written.
        """
        run = self.run(run_id)
        document = _run_dict(run, self.store.points(run.id))
        title = f"{self.name}: run {run.id}"
        if path is not None:
            return charts.save_plot(document, Path(path), title)
        return charts.figure(document, title)

    def run(self, run_id: str | None = None) -> RunRecord:
        """A recorded run: the newest when ``run_id`` is None."""
        if run_id is not None:
            return self.store.get_run(run_id)
        runs = self.store.runs(self.name, limit=1)
        if not runs:
            raise StateError(f"cluster {self.name!r} has no runs yet",
                             fix=f"start one with 'orchestrate train {self.spec_path.name}'")
        return runs[0]

    def tensorboard(self, run_id: str | None = None) -> boards.Logs:
        """A run's TensorBoard logs on this machine (the newest run by default): ``.directory``
        for ``tensorboard --logdir`` or a notebook's ``%tensorboard``. Where the chief wrote
        them on another machine, every attempt's files are copied here first, the new and
        grown ones only; ``.notes`` says which hosts could not be read (``orchestrator.boards``)."""
        return boards.local_logs(self.spec, self.run(run_id),
                                 lambda: {h.name: h for h in self.provider.all_hosts()},
                                 self.provider.runner)

    def serve_tensorboard(self, run_id: str | None, say: Callable[[str], None], *,
                          port: int = 0) -> None:
        """TensorBoard on this machine over a run's logs until Ctrl-C (``boards.serve``)."""
        boards.serve(lambda: self.tensorboard(run_id), say, port=port)

    def logs(
        self, run_id: str | None = None, task: str | None = None, attempt: int | None = None,
        *, follow: bool = False, poll_s: float = 0.5,
    ) -> Iterator[tuple[str, str]]:
        """(task, line) pairs of a run's output, event lines left out.

        Without ``follow``: one attempt (the last by default). With ``follow``: every
        attempt from ``attempt`` (default: the last) on, as it is written, until the run ends.
        """
        record = self.run(run_id)
        if attempt is not None and not 1 <= attempt <= max(len(record.attempts), 1):
            raise StateError(f"run {record.id} has no attempt {attempt} (it has "
                             f"{len(record.attempts)})", fix="name one from 'orchestrate status'")
        if not record.attempts and not follow:
            raise StateError(f"run {record.id} ({record.status}) has no attempt: none of its "
                             "tasks was started", fix=f"follow it as it starts with 'orchestrate "
                             f"logs {self.name} --run {record.id} -f'")
        known = sorted({t.task for a in record.attempts for t in a.tasks})
        if task is not None and known and task not in known:
            raise StateError(f"run {record.id} has no task {task!r} (its tasks: "
                             f"{', '.join(known)})", fix=f"name one of them, e.g. --task {known[-1]}")
        hosts = {h.name: h for h in self.provider.all_hosts()}
        readers: dict[tuple[int, str], tuple[int, LineBuffer]] = {}
        first = attempt or max(len(record.attempts), 1)
        while True:
            record = self.store.get_run(record.id)
            chosen = record.attempts[first - 1 :] if follow else record.attempts[first - 1 : first]
            for a in chosen:
                for entry in a.tasks:
                    if task is None or entry.task == task:
                        yield from self._new_lines(hosts, a.number, entry, readers)
            if not follow or record.status != "running":
                return
            time.sleep(poll_s)

    def _new_lines(
        self, hosts: dict[str, Host], number: int, entry: TaskRecord,
        readers: dict[tuple[int, str], tuple[int, LineBuffer]],
    ) -> Iterator[tuple[str, str]]:
        host = hosts.get(entry.host)
        if host is None:
            return
        key = (number, entry.task)
        offset, buffer = readers.get(key, (0, LineBuffer()))
        handle = launcher_named(entry.launcher).find(entry)
        data, offset = self.provider.runner(host).read_log(handle, offset)
        readers[key] = (offset, buffer)
        for line in buffer.feed(data):
            if not isinstance(read_line(line), Event):  # output, and lines that are no event
                yield key[1], line

    def _record(self, status: str, hosts: list[dict[str, Any]] | None = None) -> None:
        self.store.put_cluster(self.name, provider=self.provider.kind,
                               spec_path=str(self.spec_path), status=status, hosts=hosts or [])

    def __enter__(self) -> Cluster:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.down()


def _host_entry(host: Host) -> dict[str, Any]:
    ssh = host.ssh
    return {"name": host.name, "address": host.address, "root": host.root,
            "ssh": None if ssh is None else {"user": ssh.user, "address": ssh.address,
                                             "port": ssh.port},
            "labels": dict(host.labels)}


def _spare_problems(spec: specs.ClusterSpec, spares: list[Host],
                    runner: Callable[[Host], Runner]) -> list[Problem]:
    """The doctor's look at an elastic group's spares (``elastic.max_workers``): each that
    does not answer now, and why. Not blocking: the group starts without its spares, and
    grows onto each once it answers."""
    if not spares or spec.elastic is None:
        return []
    asked = fan_out(spares, lambda h: runner(h).run(["true"], timeout_s=30),
                    name_of=lambda h: h.name)
    every = spec.elastic.grow_check_s
    when = (f"the grow check asks it every {every:g}s" if every > 0 else
            "elastic.grow_check_s is 0, so it is never asked for")
    return [Problem("spare", f"spare {r.name} does not answer now "
                    f"({str(r.error).splitlines()[0][:300]}): the group starts with "
                    f"{spec.workers} worker(s) and grows onto it once it does ({when})",
                    "bring it up, or mend its entry in provider.hosts (address, user, "
                    "key_file, host key); the run does not wait for it",
                    blocking=False, hosts=(r.name,))
            for r in asked.failed]


def _elastic_entry(spec: specs.ClusterSpec, spares: list[Host]) -> dict[str, Any]:
    """The sizes an elastic group may train at, and its batch and learning rate at each; and
    the spares it may grow onto past ``workers``."""
    assert spec.elastic is not None
    sizes = list(range(spec.max_workers, spec.elastic.min_workers - 1, -1))
    grows = (f"from {spec.workers} up to {spec.max_workers} onto "
             f"{', '.join(h.name for h in spares)} as the grow check finds them; " if spares
             else "")
    return {"min_workers": spec.elastic.min_workers, "max_workers": spec.max_workers,
            "batch": spec.elastic.batch, "spares": [_host_entry(h) for h in spares],
            "sizes": {n: elastic.describe(spec, n) for n in sizes},
            "summary": f"{grows}down to {spec.elastic.min_workers} worker(s) when a machine is "
                       f"lost for good ({spec.elastic.batch}): "
                       + "; ".join(elastic.describe(spec, n) for n in sizes)}


def _tensorboard_entry(plan: ClusterPlan) -> dict[str, Any]:
    """Where the chief writes TensorBoard logs, and how often (managed jobs)."""
    env = plan.chief.env
    where, every = env["ORCHESTRATE_TENSORBOARD_DIR"], env.get("ORCHESTRATE_TENSORBOARD_EVERY")
    writes = (f"the chief writes every {every} step(s)" if every else
              "ORCHESTRATE_TENSORBOARD_DIR is set for the script")
    profiled = env.get("ORCHESTRATE_TENSORBOARD_PROFILE")
    if profiled:
        first, _, last = profiled.partition("-")
        writes += f", traces step{f's {first}-{last}' if last != first else f' {first}'}"
    host = "" if plan.chief.host.is_local or "://" in where else f" on {plan.chief.host.name}"
    return {"dir": where, "every_steps": None if every is None else int(every),
            "profile_steps": [int(n) for n in profiled.split("-")] if profiled else None,
            "summary": f"{where}{host} ({writes}; 'orchestrate tensorboard' shows it)"}


def _checkpoints_entry(plan: ClusterPlan) -> dict[str, Any]:
    """Where the run checkpoints (the chief's directory), whether every task shares it, and
    what is copied."""
    layout = plan.checkpoints
    return {"dir": layout.of(plan.chief.host), "shared": layout.shared,
            "named_by": layout.named_by, "mirror": layout.mirror, "summary": layout.describe()}


def _stop_entry(spec: ClusterSpec) -> dict[str, Any]:
    """How a planned stop ends the tasks (``down``, Ctrl-C, a preemption) and a crash's."""
    grace = spec.timeouts.stop_grace_s
    saves = spec.job.mode == "managed"
    return {"grace_s": grace, "saves_on_sigterm": saves,
            "summary": (f"SIGTERM, {grace:g}s grace " + (
                "(every task saves a checkpoint at the same step), " if saves else
                "(the script's own SIGTERM handling), ") +
                "then SIGKILL; after a crash the rest are killed at once")}


def _container_entry(container: Container) -> dict[str, Any]:
    """How the tasks run in the image (``orchestrate plan``)."""
    pull = {"missing": "up pulls it on every host where it is missing",
            "always": "up pulls it on every host every time",
            "never": "it must be on every host already"}[container.pull]
    gpus = {"auto": "GPUs passed in where the host has them", "all": "every GPU passed in",
            "none": "no GPU passed in"}[container.gpus]
    return {**container.model_dump(mode="json"),
            "summary": f"{container.runtime} run {container.image} ({pull}; host network and "
                       f"IPC, the task's directories mounted, {gpus})"}


def _task_entry(plan: ClusterPlan, t: TaskPlan) -> dict[str, Any]:
    return {"task": t.key, "role": t.role, "index": t.index, "is_chief": t.key == plan.chief_key,
            "host": t.host.name, "address": t.host.address, "port": t.port,
            "endpoint": t.endpoint, "tf_config": t.tf_config, "cwd": t.cwd, "argv": list(t.argv),
            "command": shlex.join(t.argv), "env": dict(t.env), "log": t.log_path,
            "checkpoint_dir": plan.checkpoints.of(t.host),
            "model_dir": t.env["ORCHESTRATE_MODEL_DIR"],
            **({"jax": {"process_id": int(t.env[JAX_PROCESS_ID_ENV]),
                        "processes": int(t.env[JAX_PROCESSES_ENV]),
                        "coordinator": t.env[JAX_ADDRESSES_ENV].split(",")[0]}}
               if JAX_PROCESS_ID_ENV in t.env else {})}


def _notebook_display(listener: Listener | None, progress: bool | None) -> NotebookProgress | None:
    from orchestrator.console import NotebookProgress, in_notebook

    wanted = progress if progress is not None else listener is None and in_notebook()
    return NotebookProgress() if wanted else None


def _both(first: Listener | None, second: Listener | None) -> Listener | None:
    """One listener calling both, each guarded: an error of one does not stop the other."""
    if first is None or second is None:
        single = first or second
        return safe(single) if single is not None else None
    one, other = safe(first), safe(second)

    def call(view: RunView, event: Event | None) -> None:
        one(view, event)
        other(view, event)

    return call


@contextlib.contextmanager
def _beating(store: Store, run_id: str | None) -> Iterator[None]:
    """Heartbeat run ``run_id`` (none: nothing) until the block ends, before its supervisor
    does: a doctor can take minutes, and a run silent for ``HEARTBEAT_STALE_S`` is one another
    'train' would offer to take over."""
    if run_id is None:
        yield
        return
    done = threading.Event()

    def beat() -> None:
        while True:
            with contextlib.suppress(Exception):  # the supervisor's own beats say it later
                store.heartbeat(run_id)
            if done.wait(HEARTBEAT_S):
                return

    thread = threading.Thread(target=beat, daemon=True, name="orchestrate-heartbeat")
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _controller_alive(run: RunRecord) -> bool:
    """A controller heartbeats every 2 s; one silent for 10 s, or whose pid is gone, is dead.

    The store is per user and per machine, so the recorded pid is one of this machine's.
    """
    if run.heartbeat_at is None or time.time() - run.heartbeat_at >= HEARTBEAT_STALE_S:
        return False
    if run.controller_pid is None or run.controller_pid == os.getpid():
        return run.controller_pid is not None
    try:
        os.kill(run.controller_pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Run:
    """One training run; ``wait()`` for its result, or inspect it while it runs."""

    def __init__(self, cluster: Cluster, supervisor: Supervisor, run_id: str,
                 attach: bool = False, resume: bool = False,
                 display: NotebookProgress | None = None) -> None:
        self.cluster = cluster
        self.supervisor = supervisor
        self.id = run_id
        self.attach = attach
        self.resume = resume
        self._display = display
        self._result: RunResult | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        try:
            self._result = self.supervisor.run(self.id, attach=self.attach, resume=self.resume)
        except BaseException as exc:
            self._error = exc
            if isinstance(exc, RunFailed):  # something may be wrong that a doctor would see
                kept_pass.drop(self.cluster.name)
            if self._thread is None:
                raise
        finally:
            if self._display is not None:
                safe(self._finish_display)(self.supervisor.view, None)

    def _finish_display(self, view: RunView, event: Event | None) -> None:
        """The notebook display's last frame (and summary): a listener's call, guarded."""
        if self._display is not None:
            self._display.finish(view, self._result)

    def _start_thread(self) -> None:
        self._thread = threading.Thread(target=self._run, name="orchestrate-run", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> RunResult:
        """Block until the run ends; raises RunFailed if it failed."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"run {self.id} still running after {timeout}s")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def status(self) -> RunRecord:
        return self.cluster.store.get_run(self.id)

    def metrics(self) -> dict[str, float]:
        return self.wait().metrics

    def logs(self, task: str | None = None) -> list[str]:
        return [f"[{t}] {line}" for t, line in self.cluster.logs(self.id, task=task)]
