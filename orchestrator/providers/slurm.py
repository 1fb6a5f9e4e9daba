"""The `slurm` provider: one allocation on a Slurm cluster, every task a job step in it.

``up`` submits a holder job (``sbatch --nodes=N --ntasks-per-node=1 --no-kill``, sleeping)
and waits for it to run, saying why it waits (the queue's reason), or adopts an allocation
the user holds (``up --attach JOBID``); the nodes it got are the cluster's hosts, reached by
their ``NodeAddr``. Slurm's commands run where it is driven: this machine, or a login node
over SSH (``provider.login``, as SkyPilot does). Nothing reaches a node over SSH: a command on
a node is a job step (``remote/slurm.py``), and files are on the file system every node
shares (the cluster's root, checked by ``up``), written once from the submit side.
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from orchestrator import paths
from orchestrator import spec as specs
from orchestrator.errors import OrchestratorError, ProviderError
from orchestrator.hosts import Host, SSHEndpoint
from orchestrator.problems import Problem
from orchestrator.providers.base import CloudCheck, DownReport, HostHealth
from orchestrator.providers.ssh_hosts import SSHHostsProvider
from orchestrator.remote.base import Runner, quote_argv
from orchestrator.remote.fanout import fan_out
from orchestrator.remote.local import LocalRunner
from orchestrator.remote.slurm import SRUN_BY_WRAPPER, StepRunner, srun_options
from orchestrator.remote.ssh import SSHRunner
from orchestrator.remote.sync import remote_stamps
from orchestrator.spec import ClusterSpec

JOB_LABEL, NODE_LABEL = "slurm_job", "slurm_node"
QUEUE_POLL_S = (0.2, 5.0)  # the wait for the allocation: first poll, then doubling to this
COMPLETING_WAIT_S = 60.0  # how long an allocation may show COMPLETING before it is judged
# slurmctld looks at time limits every 30 s and may send --signal up to 60 s early: an
# allocation this much past its warning is counted as ending.
SIGNAL_SLACK_S = 90
# After a task failed, a step on every node tells a dead one (srun gives up on a node whose
# slurmd does not answer within Slurm's MessageTimeout, 10 s by default) long before slurmctld
# marks it DOWN (SlurmdTimeout, 300 s by default).
PROBE_S = 60
NO_NODE = "Requested node configuration is not available"  # sbatch: no node could ever run it
ENDED = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
         "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY", "SPECIAL_EXIT", "REVOKED"}
# What a pending job's reason means, and what to do about it (squeue's %r, Slurm's
# job_reason strings); the ones that never clear by waiting end the wait at once.
REASONS = {
    "Priority": "jobs of higher priority are ahead of it in the queue",
    "Resources": "waiting for nodes to become free",
    "None": "not yet looked at by the scheduler",
    "BeginTime": "its start time has not come",
    "Dependency": "waiting for a job it depends on",
    "ReqNodeNotAvail": "a node it needs is down, drained or reserved",
    "QOSMaxGRESPerUser": "your QOS's GPU limit per user is in use by your other jobs",
    "QOSMaxNodePerUserLimit": "your QOS's node limit per user is in use by your other jobs",
    "QOSGrpGRES": "the QOS's GPUs are in use",
    "AssocGrpGRES": "your account's GPUs are in use",
    "AssocGrpNodeLimit": "your account's node limit is in use",
    "AssocMaxJobsLimit": "your account runs as many jobs as it may",
    "JobHeldUser": "held by you (scontrol release JOBID)",
    "Reservation": "waiting for its reservation to start",
    "Licenses": "waiting for licenses",
}
NEVER = {
    "PartitionNodeLimit": "asks for more nodes than the partition allows: lower workers, or "
                          "choose another provider.partition",
    "PartitionTimeLimit": "asks for more time than the partition allows: lower provider.time",
    "PartitionDown": "the partition is down: ask the admins, or choose another "
                     "provider.partition",
    "PartitionInactive": "the partition is inactive: choose another provider.partition",
    "JobHeldAdmin": "an administrator holds it: ask them to release it",
    "BadConstraints": "no node has the features asked for: fix provider.constraint",
    "QOSMaxWallDurationPerJobLimit": "asks for more time than the QOS allows: lower "
                                     "provider.time",
    "AccountNotAllowed": "the account may not use this partition: fix provider.account",
    "QOSNotAllowed": "the QOS may not use this partition: fix provider.qos",
    "InvalidAccount": "the account is not valid: fix provider.account",
    "InvalidQOS": "the QOS is not valid: fix provider.qos",
}


@dataclass(frozen=True)
class Job:
    """A job as ``squeue`` shows it."""

    id: str
    state: str  # PENDING, RUNNING, COMPLETING, ...
    reason: str
    nodes: str  # the compact node list (n[1-3])
    user: str = ""
    left: str = ""  # the time left before its limit, as squeue shows it (1:23, UNLIMITED)

    @property
    def left_s(self) -> int | None:
        """Seconds left before the time limit; None without one."""
        try:
            return specs.slurm_seconds(self.left)
        except ValueError:
            return None

    @property
    def ended(self) -> bool:
        return self.state in ENDED


def node_down(state: str) -> bool:
    """Whether scontrol's node State says the node cannot run steps: not responding (a
    trailing '*'), DOWN or FAIL (also as part of MIXED+..., ALLOCATED+...)."""
    return state.endswith("*") or "DOWN" in state or "FAIL" in state


def explain(reason: str) -> str:
    """A pending job's reason in words (the reason itself when it is not a known one)."""
    return REASONS.get(reason) or NEVER.get(reason) or reason


class Slurm:
    """Slurm's commands, run through one runner (this machine, or a login node)."""

    def __init__(self, runner: Runner, where: str) -> None:
        self.runner = runner
        self.where = where

    def run(self, argv: Sequence[str], *, timeout_s: float = 60, what: str = "") -> str:
        """Run a Slurm command; its output.

        Raises:
            ProviderError: it failed, with Slurm's own words.
        """
        result = self.runner.run(list(argv), check=False, timeout_s=timeout_s)
        if result.exit_code == 127:
            raise ProviderError(f"{argv[0]} is not installed {self.where}",
                                fix="install Slurm's client commands there, or set "
                                "provider.login to a login node that has them")
        if not result.ok:
            said = (result.stderr or result.stdout).strip()[-500:]
            raise ProviderError(f"{what or argv[0]} failed {self.where} "
                                f"(exit {result.exit_code}): {said}")
        return result.stdout

    def submit(self, options: Sequence[str]) -> str:
        """``sbatch --parsable OPTIONS``: the job id."""
        out = self.run(["sbatch", "--parsable", *options], what="sbatch")
        job_id = out.strip().split(";")[0]
        if not job_id.isdigit():
            raise ProviderError(f"sbatch printed no job id {self.where}: {out.strip()[:200]!r}")
        return job_id

    def job(self, job_id: str) -> Job | None:
        """The job, None once Slurm no longer knows it."""
        result = self.runner.run(["squeue", "--noheader", f"--jobs={job_id}",
                                  "--format=%i|%T|%r|%N|%u|%L"], check=False, timeout_s=60)
        if not result.ok:
            if "Invalid job id" in result.stderr:
                return None
            raise ProviderError(f"squeue failed {self.where}: {result.stderr.strip()[-300:]}")
        for line in result.stdout.splitlines():
            words = line.strip().split("|")
            if len(words) == 6 and words[0] == job_id:
                return Job(*words)
        return None

    def hostnames(self, nodelist: str) -> list[str]:
        return self.run(["scontrol", "show", "hostnames", nodelist]).split()

    def nodes(self, names: Sequence[str]) -> dict[str, dict[str, str]]:
        """``scontrol show node -o``'s fields of each node, by name."""
        out = self.run(["scontrol", "--oneliner", "show", "node", ",".join(names)])
        found: dict[str, dict[str, str]] = {}
        for line in out.splitlines():
            fields = dict(re.findall(r"(\w+)=(\S*)", line))
            if "NodeName" in fields:
                found[fields["NodeName"]] = fields
        return found

    def cancel(self, job_id: str) -> None:
        """``scancel JOB``; a job that is already ending or gone is left as it is."""
        result = self.runner.run(["scancel", job_id], check=False, timeout_s=60)
        said = (result.stderr or result.stdout).strip()
        if not result.ok and "already completing or completed" not in said \
                and "Invalid job id" not in said:
            raise ProviderError(f"scancel {job_id} failed {self.where} (exit "
                                f"{result.exit_code}): {said[-500:]}")


class SlurmProvider(SSHHostsProvider):
    kind = "slurm"
    host_noun = "node"
    # Not yet: a warm task shares its attempt's log and exit-code files, and on Slurm it would
    # wait in an allocation that 'renew' may replace before it is told to go.
    warm_tasks = False
    # An elastic group's check finds its replacement still queued, or running: a look, not a
    # wait (the job keeps its place in the queue between checks).
    return_probe_s = 5.0
    config: specs.SlurmProvider

    def __init__(self, spec: ClusterSpec, spec_path: Path) -> None:
        super().__init__(spec, spec_path)
        assert isinstance(spec.provider, specs.SlurmProvider)
        self.config = spec.provider
        self._submit: Runner | None = None
        self._steps: dict[str, StepRunner] = {}
        self._job: dict[str, Any] = {}  # the allocation: job_id, submitted (by 'up')

    # -- where Slurm is driven ----------------------------------------------------------
    @property
    def where(self) -> str:
        login = self.config.login
        return f"on login node {login.address}" if login else "on this machine"

    def login_endpoint(self) -> SSHEndpoint | None:
        login = self.config.login
        if login is None:
            return None
        base = self.spec_path.parent
        known = login.known_hosts or "~/.ssh/known_hosts"
        return SSHEndpoint(
            address=login.address, user=login.user, port=login.port,
            key_file=str((base / Path(login.key_file).expanduser()).resolve()),
            host_keys=(login.host_key,) if login.host_key else (),
            known_hosts=str((base / Path(known).expanduser()).resolve()),
            connect_timeout_s=self.config.connect_timeout_s)

    @property
    def submit_runner(self) -> Runner:
        """The runner Slurm's commands go through, shared by every node's runner."""
        with self._lock:
            if self._submit is None:
                endpoint = self.login_endpoint()
                self._submit = (LocalRunner("this machine") if endpoint is None else
                                SSHRunner(f"login {endpoint.address}", endpoint,
                                          connect_deadline_s=self.connect_deadline_s))
            return self._submit

    @property
    def slurm(self) -> Slurm:
        return Slurm(self.submit_runner, self.where)

    def submit_host(self) -> Host:
        """The machine Slurm is driven from, as a host: the cluster's root is made, synced and
        removed there, once for every node."""
        host = Host(name=f"{self.spec.name}-login", address=self.config.login.address
                    if self.config.login else "localhost", root="", ssh=self.login_endpoint(),
                    shared_fs=True)
        return replace(host, root=self.resolve_root(host))

    # -- runners: the submit side for files and tasks' wrappers, steps for a node --------
    def runner(self, host: Host) -> Runner:  # type: ignore[override]
        node = host.node or host.label(NODE_LABEL)
        job = host.label(JOB_LABEL)
        if node is None or job is None:
            return self.submit_runner
        with self._lock:
            step = self._steps.get(host.name)
            if step is None or step.job_id != job or step.node != node:
                step = StepRunner(host.name, self.submit_runner, job, node,
                                  gpus=self.config.gpus_per_node)
                self._steps[host.name] = step
            return step

    def runner_to(self, host: Host) -> Runner:  # type: ignore[override]
        return self.runner(host)

    @contextlib.contextmanager
    def check_runners(self, hosts: Sequence[Host]) -> Iterator[Callable[[Host], Runner]]:
        yield self.runner

    def close(self) -> None:
        with self._lock:
            submit, self._submit = self._submit, None
            self._steps.clear()
        if submit is not None:
            submit.close()

    # -- the allocation ------------------------------------------------------------------
    def _load(self) -> dict[str, Any]:
        if not self._job:
            self.load_hosts()
            with contextlib.suppress(FileNotFoundError, ValueError, KeyError, TypeError):
                document = json.loads(self.hosts_file.read_text())
                self._job = {"job_id": str(document["job_id"]),
                             "submitted": bool(document["submitted"]),
                             "replacements": [str(j) for j in document.get("replacements", [])],
                             "lost": [str(n) for n in document.get("lost", [])],
                             "waiting": {str(name): {"job": str(w["job"]),
                                                     "exclude": [str(n) for n in w["exclude"]]}
                                         for name, w in document.get("waiting", {}).items()}}
        return self._job

    def _save(self, hosts: Sequence[Host]) -> None:
        for host in hosts:
            self.remember(host)
        self.save_hosts([h.name for h in hosts], extra=self._job)

    def _record(self, **changes: Any) -> None:
        """Change the allocation's record and write it (with the hosts as they are)."""
        self._job = {**self._job, **changes}
        self.save_hosts(list(self.remembered()), extra=self._job)

    def adopt(self, job_id: str) -> None:
        """Make the allocation ``job_id`` (one the user holds, e.g. from ``salloc``) the
        cluster's: ``up`` uses it, ``down`` leaves it running.

        Raises:
            ProviderError: no such job of the user's, or it has ended.
        """
        if not job_id.isdigit():
            raise ProviderError(f"--attach {job_id!r} is not a Slurm job id",
                                fix="give the number squeue shows in its JOBID column")
        job = self.slurm.job(job_id)
        if job is None or job.ended:
            raise ProviderError(f"job {job_id} is not in Slurm's queue {self.where} "
                                f"({job.state.lower() if job else 'unknown or ended'})",
                                fix="give the id of an allocation you hold (squeue --me)")
        current = self._load()
        if current.get("job_id") not in (None, job_id) and current.get("submitted"):
            raise ProviderError(
                f"the cluster already holds allocation {current['job_id']}, which 'up' "
                f"submitted", fix=f"run 'orchestrate down {self.spec_path.name}' first")
        self._job = {"job_id": job_id, "submitted": False}

    def sbatch_options(self, root: str, *, nodes: int | None = None,
                       exclude: Sequence[str] = ()) -> list[str]:
        """What ``up`` asks sbatch for (``plan`` shows it): the allocation of every task, or
        ``nodes`` others (a lost node's replacement), on none of the nodes ``exclude`` names."""
        config = self.config
        options = [f"--job-name=orchestrate-{self.spec.name}",
                   f"--nodes={nodes or self.spec.num_tasks}",
                   "--ntasks-per-node=1", "--no-kill", f"--output={root}/slurm-%j.out"]
        extra = [o for o in config.sbatch if not o.startswith("--exclude=")]
        excluded = self._excluded(exclude)
        if excluded:
            options.append(f"--exclude={excluded}")
        for flag, value in (("--partition", config.partition), ("--account", config.account),
                            ("--qos", config.qos), ("--time", config.time),
                            ("--constraint", config.constraint)):
            if value is not None:
                options.append(f"{flag}={value}")
        if config.gpus_per_node:
            options.append(f"--gpus-per-node={config.gpus_per_node}")
        # TERM to every step (not the holder) this long before the time limit: each task
        # saves at one step, and the run goes on in a new allocation ('renew').
        options.append(f"--signal=TERM@{self.warning_s}")
        return [*options, *extra, "--wrap=exec sleep infinity"]

    def _excluded(self, exclude: Sequence[str]) -> str:
        """The user's own --exclude and the group's nodes, as one option's value."""
        return ",".join([*(o.split("=", 1)[1] for o in self.config.sbatch
                           if o.startswith("--exclude=")), *exclude])

    @property
    def warning_s(self) -> int:
        """Seconds before the time limit that the steps get TERM (the stop's grace and a
        margin, at most half the allocation's time): an allocation with less left is not
        given another attempt."""
        lead = int(self.spec.timeouts.stop_grace_s) + 30
        if self.config.time is not None:
            lead = min(lead, specs.slurm_seconds(self.config.time) // 2)
        return max(10, min(lead, 65535))

    def renew(self) -> str | None:
        """Before an attempt: an allocation that ended, was requeued or is near its time
        limit (``warning_s`` and Slurm's slack) is replaced (``up``: a new one submitted, or
        the requeued one waited for); what happened, for the run's messages, or None when it
        can go on.

        Raises:
            ProviderError: the allocation was one the user attached, and it has ended.
        """
        record = self._load()
        job_id = record.get("job_id")
        if not job_id:
            return None
        job = self._settled(job_id)
        left = job.left_s if job is not None else None
        ending = left is not None and left <= self.warning_s + SIGNAL_SLACK_S
        if job is not None and job.state == "RUNNING" and not ending:
            return self._renew_replacements(job_id)
        if job is None or job.ended or job.state == "COMPLETING":
            why = f"allocation {job_id} ended ({job.state.lower() if job else 'gone'})"
        elif job.state == "RUNNING":
            why = f"allocation {job_id} is {left}s from its time limit"
        else:
            why = f"allocation {job_id} is {job.state.lower()} again ({job.reason}: requeued)"
        if record.get("submitted") and (job is None or job.state in ("RUNNING", "COMPLETING")
                                        or job.ended):
            if job is not None and not job.ended:
                self.slurm.cancel(job_id)  # what is left of it cannot hold an attempt
            self._cancel_replacements()  # the new allocation has a node for every task
            self._job = {"job_id": "", "submitted": True}  # 'up' submits a new one
        self.progress(why)
        self._job = {**self._job, "lost": []}  # what runs again runs on nodes Slurm found fit
        hosts = self.up()
        nodes = ",".join(h.node or h.name for h in hosts)
        return f"{why}: going on in allocation {self._job['job_id']} ({nodes})"

    def _settled(self, job_id: str) -> Job | None:
        """The job once it is not COMPLETING, which both an ended job and a requeued one show
        while their steps end (squeue shows the flag, not the base state): a requeued one
        turns PENDING, an ended one leaves the queue. Still COMPLETING after
        ``COMPLETING_WAIT_S`` (a node that does not answer): as it is."""
        deadline = time.monotonic() + COMPLETING_WAIT_S
        job = self.slurm.job(job_id)
        while job is not None and job.state == "COMPLETING" and time.monotonic() < deadline:
            time.sleep(0.5)
            job = self.slurm.job(job_id)
        return job

    def _renew_replacements(self, job_id: str) -> str | None:
        """Hosts on a replacement allocation that ended (its own time limit, a scancel) move
        to a node of the allocation, or a new replacement; what happened, or None."""
        ended = [h for h in self.hosts() if h.label(JOB_LABEL) not in (None, job_id)
                 and not self._runs(h.label(JOB_LABEL) or "")]
        spares = [h.name for h in self.spare_hosts() if self.placed(h)
                  and not self._runs(h.label(JOB_LABEL) or "")]
        for name in spares:  # the supervisor leaves it out again, and asks for it anew
            self.forget(name)
        if spares:
            self._record()
        if not ended:
            return f"the allocation of spare(s) {', '.join(spares)} ended" if spares else None
        hosts = {h.name: h for h in self.up()}
        moved = ", ".join(f"{h.name} on node {hosts[h.name].node}" for h in ended)
        return f"the replacement allocation of {', '.join(h.name for h in ended)} ended: {moved}"

    def _runs(self, job_id: str) -> bool:
        job = self.slurm.job(job_id)
        return job is not None and job.state == "RUNNING"

    def _cancel_replacements(self) -> None:
        for job_id in self._job.get("replacements", []):
            self.slurm.cancel(job_id)
        for name in self._spare_names():  # grown onto a replacement: gone with it
            self.forget(name)
        self._job = {**self._job, "replacements": [], "lost": [], "waiting": {}}

    def _allocation(self, root: str) -> Job:
        """The cluster's running allocation: the recorded one, else a new one, waited for."""
        record = self._load()
        job_id = record.get("job_id")
        job = self.slurm.job(job_id) if job_id else None
        if job is not None and job.ended:
            job = None
        if job is None and job_id and not record.get("submitted"):
            raise ProviderError(
                f"allocation {job_id}, which 'up --attach' adopted, is no longer running",
                fix=f"attach another ('orchestrate up {self.spec_path.name} --attach JOBID'), "
                f"or run 'orchestrate down {self.spec_path.name}' and 'up' to submit one")
        if job is None:
            job_id = self.slurm.submit(self.sbatch_options(root))
            self._job = {"job_id": job_id, "submitted": True}
            self.save_hosts([], extra=self._job)  # recorded before the wait: 'down' finds it
            self.progress(f"submitted allocation {job_id} ({self.spec.num_tasks} node(s)) "
                          f"{self.where}")
        assert job_id is not None
        return self._wait_running(job_id, self.config.queue_timeout_s, "provider.queue_timeout_s")

    def _wait_running(self, job_id: str, timeout_s: float, timeout_field: str, *,
                      keep: bool = False, since: float | None = None) -> Job:
        """Wait for the job to run, saying why it waits; a job that cannot run (a reason
        that never clears, or still pending ``timeout_s`` after ``since``, default now) is
        cancelled, except that ``keep`` leaves one that is only still pending in the queue."""
        deadline = (time.monotonic() if since is None else since) + timeout_s
        wait, said = QUEUE_POLL_S[0], ""
        while True:
            job = self.slurm.job(job_id)
            if job is None or job.ended:
                raise ProviderError(
                    f"allocation {job_id} ended before it ran "
                    f"({job.state.lower() + ': ' + job.reason if job else 'no longer queued'})",
                    fix=f"see {self.spec.name}'s slurm-{job_id}.out in the cluster's root and "
                    "'sacct -j " + job_id + "'")
            if job.state == "RUNNING":
                return job
            if job.reason in NEVER:
                self._cancel_ours(job_id)
                raise ProviderError(f"allocation {job_id} cannot start: {job.reason} "
                                    f"({NEVER[job.reason]})", fix=NEVER[job.reason])
            now = f"{job.state.lower()}: {job.reason}"
            if now != said:
                self.progress(f"allocation {job_id} {now} ({explain(job.reason)})")
                said = now
            if time.monotonic() > deadline and keep:
                raise ProviderError(
                    f"allocation {job_id} did not start within {timeout_s:.0f}s "
                    f"({job.reason}: {explain(job.reason)}); it stays queued, and the group "
                    "grows back when it runs",
                    fix=f"wait, or raise {timeout_field}; 'sinfo' shows what is free")
            if time.monotonic() > deadline:
                self._cancel_ours(job_id)
                raise ProviderError(
                    f"allocation {job_id} did not start within {timeout_s:.0f}s "
                    f"({job.reason}: {explain(job.reason)}); it was cancelled",
                    fix=f"raise {timeout_field}, ask for fewer nodes or less time, or "
                    "try another provider.partition ('sinfo' shows what is free)")
            time.sleep(wait)
            # a job that starts at once is seen within a second; a long wait costs few calls
            cap = 1.0 if time.monotonic() < deadline - timeout_s + 30 else QUEUE_POLL_S[1]
            wait = min(2 * wait, cap)

    def _cancel_ours(self, job_id: str) -> None:
        replacements = self._job.get("replacements", [])
        if job_id in replacements:
            self.slurm.cancel(job_id)
            self._record(replacements=[j for j in replacements if j != job_id],
                         waiting={name: w for name, w in self._job.get("waiting", {}).items()
                                  if w["job"] != job_id})
        elif self._job.get("job_id") == job_id and self._job.get("submitted"):
            self.slurm.cancel(job_id)
            self._job = {}
            self.forget_hosts()

    def _node_host(self, name: str, job_id: str, node: str, root: str) -> Host:
        address = self.slurm.nodes([node]).get(node, {}).get("NodeAddr") or node
        return Host(name=name, address=address, root=root, ssh=self.login_endpoint(),
                    labels=((JOB_LABEL, job_id), (NODE_LABEL, node)), node=node,
                    shared_fs=True)

    def _assign(self, job: Job, root: str, replace_within_s: float) -> list[Host]:
        """A node per task, the chief's first. A task keeps its node while the node is in its
        allocation (or replacement) and not lost; the others take the allocation's free nodes
        in order, then a replacement each (a one-node allocation, waited for up to
        ``replace_within_s``).

        Raises:
            ProviderError: a new allocation with too few nodes, or no replacement in time.
        """
        names = self._names()
        nodes = self.slurm.hostnames(job.nodes)
        record = self._load()
        lost = set(record.get("lost", []))
        had = self.remembered()
        kept: dict[str, Host] = {}
        for name in names:
            host = had.get(name)
            owner = host.label(JOB_LABEL) if host is not None else None
            if host is None or owner is None or host.node in lost:
                continue
            if (owner == job.id and host.node in nodes) or (
                    owner in record.get("replacements", []) and self._runs(owner)):
                kept[name] = replace(host, root=root)
        used = {h.node for h in kept.values()}
        free = [n for n in nodes if n not in lost and n not in used]
        if not kept and len(free) < len(names):
            raise ProviderError(
                f"allocation {job.id} has {len(nodes)} node(s) ({job.nodes}) for "
                f"{self.spec.num_tasks} task(s), one per node",
                fix="attach an allocation with at least as many nodes, or lower workers")
        hosts: list[Host] = []
        for name in names:
            if name in kept:
                hosts.append(kept[name])
            elif free:
                hosts.append(self._node_host(name, job.id, free.pop(0), root))
            else:
                # Not a lost node while it is in the allocation and Slurm still takes it for
                # fit (a replacement could start on a dead node); one Slurm marks down is
                # scheduled on again only once it is back in service (ReturnToService), and
                # may then be the replacement.
                others = {n for n in (*nodes, *(h.node for h in kept.values()),
                                      *(h.node for h in hosts)) if n}
                suspects = (others & lost) - self._down(lost)
                hosts.append(self._replacement(name, root, sorted(others - (lost - suspects)),
                                               replace_within_s, suspects))
        return hosts

    def _down(self, nodes: set[str]) -> set[str]:
        """Those of ``nodes`` that Slurm marks down or not responding."""
        if not nodes:
            return set()
        states = self.slurm.nodes(sorted(nodes))
        return {n for n in nodes if node_down(states.get(n, {}).get("State", ""))}

    def _replacement(self, name: str, root: str, exclude: Sequence[str],
                     within_s: float, suspects: set[str]) -> Host:
        """A one-node allocation for ``name``'s task, on none of ``exclude`` (of which
        ``suspects`` are lost nodes Slurm does not mark down yet: ``_submit_replacement``).

        An elastic group (which goes on without the task meanwhile) keeps one that is still
        pending after ``within_s`` queued, for the next call to find: it keeps its place in
        the queue, and its --exclude follows the group's nodes as they change (``scontrol
        update``): a lost node that Slurm took out of the allocation may be the one it gets.
        """
        started = time.monotonic()
        standing = self._job.get("waiting", {}).get(name)
        job = self.slurm.job(standing["job"]) if standing else None
        if standing is not None and job is not None and not job.ended:
            job_id = standing["job"]
            if sorted(standing["exclude"]) != sorted(exclude):
                self.slurm.run(["scontrol", "update", f"JobId={job_id}",
                                f"ExcNodeList={self._excluded(exclude)}"],
                               what="scontrol update")
                self._record(waiting={**self._job.get("waiting", {}),
                                      name: {"job": job_id, "exclude": list(exclude)}})
        else:
            job_id, exclude = self._submit_replacement(root, exclude, suspects, within_s)
            self._record(replacements=[*self._job.get("replacements", []), job_id],
                         waiting={**self._job.get("waiting", {}),
                                  name: {"job": job_id, "exclude": list(exclude)}})
            self.progress(f"{name}: submitted replacement allocation {job_id} (1 node, not "
                          f"{','.join(exclude)}) {self.where}")
        job = self._wait_running(job_id, within_s, "timeouts.repair_s",
                                 keep=self.spec.elastic is not None, since=started)
        node = self.slurm.hostnames(job.nodes)[0]
        self._record(lost=[n for n in self._job.get("lost", []) if n != node],
                     waiting={n: w for n, w in self._job.get("waiting", {}).items()
                              if n != name})
        self.progress(f"{name}: replacement allocation {job_id} runs on node {node}")
        return self._node_host(name, job_id, node, root)

    def _submit_replacement(self, root: str, exclude: Sequence[str], suspects: set[str],
                            within_s: float) -> tuple[str, list[str]]:
        """sbatch a one-node allocation on none of ``exclude``; its id, and what it excludes.

        Where that is every node of the partition, sbatch refuses it. Some of them may be
        ``suspects``: lost nodes that Slurm does not mark down yet (it does within its
        SlurmdTimeout), excluded only so that nothing starts on a dead node meanwhile; they are
        waited for, within ``within_s``, and asked again without those Slurm then marks down.

        Raises:
            ProviderError: sbatch refused it, and no suspect was marked down in time.
        """
        deadline = time.monotonic() + within_s
        exclude, waiting = list(exclude), set(suspects)
        while True:
            try:
                return self.slurm.submit(self.sbatch_options(root, nodes=1, exclude=exclude)), \
                    exclude
            except ProviderError as exc:
                if NO_NODE not in exc.message or not waiting:
                    raise
                if time.monotonic() > deadline:
                    raise ProviderError(
                        f"no node outside the group can run its task: every node of the "
                        f"partition is the group's, and Slurm does not mark lost node(s) "
                        f"{', '.join(sorted(waiting))} down yet (it does after its "
                        f"SlurmdTimeout); {exc.message}",
                        fix="raise timeouts.repair_s above Slurm's SlurmdTimeout ('scontrol "
                        "show config'), or use a partition with a node to spare") from None
            time.sleep(1.0)
            down = self._down(waiting)
            if down:
                self.progress(f"Slurm marks node(s) {', '.join(sorted(down))} down")
            exclude, waiting = [n for n in exclude if n not in down], waiting - down

    def give_up(self, host: Host) -> None:
        """The replacement still queued for ``host``'s task is cancelled."""
        standing = self._load().get("waiting", {}).get(host.name)
        if standing is not None:
            self._cancel_ours(standing["job"])

    # -- up / hosts / down -----------------------------------------------------------------
    def up(self) -> list[Host]:
        """Check the upload, make the root on the shared file system, get the allocation
        (submitted and waited for, or the one recorded), check that every node sees the root,
        sync the code and the worker package once, run setup on the first node."""
        self.upload()
        submit = self.submit_host()
        self.claim_root(submit)
        hosts = self._place(submit.root, self.config.queue_timeout_s)
        self._prepare(submit, hosts)
        return hosts

    def _place(self, root: str, replace_within_s: float) -> list[Host]:
        """The allocation, a node per task, recorded; a node new to a task is checked to see
        the root."""
        had = self.remembered()
        hosts = self._assign(self._allocation(root), root, replace_within_s)
        self._save([*hosts, *(h for h in self.spare_hosts() if self.placed(h))])
        moved = [h for h in hosts if had.get(h.name) is None or had[h.name].labels != h.labels]
        self._check_shared(moved or hosts, root)
        return hosts

    def lost_hosts(self, hosts: Sequence[Host]) -> dict[str, str]:
        """After a task failed: the nodes of ``hosts`` lost under their tasks. Slurm's view
        (DOWN, not responding, taken out of the allocation) and a step on every node of a
        running allocation (one whose slurmd is gone fails within Slurm's MessageTimeout, long
        before slurmctld marks it DOWN); a node is not blamed for its allocation's end."""
        nodes = [h for h in hosts if h.node and h.label(JOB_LABEL)]
        try:
            jobs = {j: self.slurm.job(j) for j in {h.label(JOB_LABEL) or "" for h in nodes}}
            members = {j: set(self.slurm.hostnames(job.nodes)) for j, job in jobs.items()
                       if job is not None and job.state == "RUNNING"}
            states = self.slurm.nodes([h.node or "" for h in nodes])
        except OrchestratorError:
            return {}  # Slurm does not answer: nothing to tell about one node
        live = [h for h in nodes if h.label(JOB_LABEL) in members]

        def probe(host: Host) -> str | None:
            state = states.get(host.node or "", {}).get("State", "")
            if host.node not in members[host.label(JOB_LABEL) or ""]:
                return f"Slurm took node {host.node} out of allocation {host.label(JOB_LABEL)}"
            if node_down(state):
                return f"Slurm has node {host.node} {state}"
            try:
                result = self.runner(host).run("true", check=False, timeout_s=PROBE_S)
            except OrchestratorError:
                return None  # the submit side did not answer: not the node's doing
            said = (result.stderr or result.stdout).strip().splitlines()
            return None if result.ok else \
                f"a step on node {host.node} failed: {said[0] if said else result.exit_code}"

        found = fan_out(live, probe, name_of=lambda h: h.name).values()
        lost = {name: why for name, why in found.items() if why}
        if lost:
            by_name = {h.name: h for h in hosts}
            self._record(lost=sorted({*self._load().get("lost", []),
                                      *(by_name[n].node or "" for n in lost)}))
        return lost

    def repair(self, host: Host, deadline_s: float) -> Host:
        """A lost node's task goes to a replacement: a free node of the allocation, else a
        one-node allocation waited for up to ``deadline_s`` (the queue's reason said meanwhile).
        A node that is not lost (it answers a step) stays. A spare (``elastic.max_workers``)
        is a one-node allocation of its own (``_place_spare``).

        Raises:
            ProviderError: no replacement ran within ``deadline_s`` (it is cancelled).
        """
        if host.name in self._spare_names():
            return self._place_spare(host, deadline_s)
        lost = self._load().get("lost", [])
        if host.node not in lost and self.host_health(host) is HostHealth.RUNNING:
            return host
        self._record(lost=sorted({*lost, host.node or ""} - {""}))
        self.progress(f"{host.name}: node {host.node} is lost; its task goes to another node")
        try:
            hosts = self._place(self.submit_host().root, deadline_s)
        except ProviderError as exc:
            raise ProviderError(f"{host.name}'s node {host.node} was lost and no node took its "
                                f"place: {exc.message}", fix=exc.fix) from None
        return next(h for h in hosts if h.name == host.name)

    def _place_spare(self, host: Host, deadline_s: float) -> Host:
        """A node for a spare: a one-node allocation on none of the group's nodes, submitted
        once and kept queued while it waits (its --exclude following the group, as a lost
        node's replacement); the host once it runs, its node checked to see the root.

        Raises:
            ProviderError: it has not started within ``deadline_s`` (it stays queued).
        """
        lost = set(self._load().get("lost", []))
        if self.placed(host) and host.node not in lost and \
                self.host_health(host) is HostHealth.RUNNING:
            return host
        self.forget(host.name)
        root = self.submit_host().root
        group = {h.node for h in self.all_hosts() if h.node and h.name != host.name}
        suspects = lost - self._down(lost)
        placed = self._replacement(host.name, root, sorted((group - lost) | suspects),
                                   deadline_s, suspects)
        self._check_shared([placed], root)
        self.remember(placed)
        self._record()
        return placed

    def placed(self, host: Host) -> bool:
        """A spare is a node once its allocation ran (``_place_spare``)."""
        return host.node is not None

    def _names(self) -> list[str]:
        """The tasks' hosts, the chief's first."""
        return [f"{self.spec.name}-{i}" for i in range(self.spec.num_tasks)]

    def _spare_names(self) -> list[str]:
        """The spares' (``elastic.max_workers``), after the tasks'."""
        return [f"{self.spec.name}-{i}" for i in self.spec.spare_indices]

    def spare_hosts(self) -> list[Host]:
        """Each spare as its allocation placed it, else a placeholder with no node (not
        ``placed``) until the grow check gets it one."""
        self._load()
        had = self.remembered()
        root = next((h.root for h in had.values()), "") or self.planned_root("~")
        return [had.get(name) or Host(name=name, address=name, root=root,
                                      ssh=self.login_endpoint(), shared_fs=True)
                for name in self._spare_names()]

    def _check_shared(self, hosts: Sequence[Host], root: str) -> None:
        """Every node sees the root's marker, which was written on the submit side."""
        marker = shlex.quote(f"{root}/{paths.ROOT_MARKER}")

        def sees(host: Host) -> str:
            return self.runner(host).run(f"cat {marker} 2>/dev/null || true",
                                         timeout_s=120).stdout.strip()

        result = fan_out(hosts, sees, name_of=lambda h: h.name)
        result.raise_if_failed("run a step on every node")
        blind = [f"{h.name} ({h.node})" for h in hosts
                 if result.values().get(h.name) != self.spec.name]
        if blind:
            raise ProviderError(
                f"{', '.join(blind)} cannot see {root}, written {self.where}: the cluster's "
                "files must be on a file system every node mounts",
                fix="set provider.root to a directory on the cluster's shared file system "
                "(your home on most clusters; NFS, Lustre, GPFS)")

    def _prepare(self, submit: Host, hosts: Sequence[Host]) -> None:
        """Sync once from the submit side; setup runs as a step on the first node (the nodes'
        environment, modules and CUDA, not the login node's)."""
        code, lib, setup = remote_stamps(self.submit_runner, self.trees(submit.root),
                                         [self.setup_stamp_path(submit.root)])
        code_changed, _ = self.sync_code(self.submit_runner, submit.root, stamps=(code, lib))
        self.run_setup(self.submit_runner, self.runner(hosts[0]), submit.root, code_changed,
                       setup)

    def hosts(self) -> list[Host]:
        """The tasks' nodes in the recorded allocation (none before 'up')."""
        self._load()
        had = self.remembered()
        return [had[name] for name in self._names() if name in had]

    def planned_hosts(self) -> list[Host]:
        """The recorded nodes, else placeholders (the scheduler picks the nodes)."""
        known = self.hosts()
        if known:
            return known
        root = self.planned_root("~")
        return [Host(name=f"{self.spec.name}-{i}", address=f"node-{i}", root=root,
                     ssh=self.login_endpoint(), node=f"node-{i}", shared_fs=True)
                for i in range(self.spec.num_tasks)]

    def describe(self) -> dict[str, Any]:
        root = self.planned_hosts()[0].root
        task = quote_argv(["sh", "-c", SRUN_BY_WRAPPER, "orchestrate-TASK",
                           *srun_options("JOBID", "NODE", gpus=self.config.gpus_per_node),
                           "python", "-m", "worker", "…"])
        return {"slurm": {"where": self.where,
                          "sbatch": quote_argv(["sbatch", "--parsable",
                                                *self.sbatch_options(root)]),
                          "srun": task}}

    def notes(self) -> list[str]:
        notes = super().notes()
        job = self._load().get("job_id")
        if job:
            how = "submitted by 'up'" if self._job.get("submitted") else "attached"
            notes.append(f"allocation {job} ({how}) {self.where}")
        return notes

    def cloud_check(self) -> CloudCheck:
        """The doctor's look at the partition before any node is asked (it exists and is up,
        has the nodes, the time and the GPUs asked for); before 'up' there are no nodes to
        ask."""
        try:
            problems = partition_problems(self.spec, self.config, self.slurm)
        except OrchestratorError as exc:
            problems = [Problem("slurm", f"Slurm could not be asked {self.where}: "
                                f"{exc.message}", exc.fix or "check provider.login and that "
                                "Slurm's commands work there")]
        hosts = self.hosts()
        if hosts:
            try:
                problems += self.node_problems(hosts)
            except OrchestratorError as exc:
                problems.append(Problem("slurm", f"the allocation's nodes could not be asked "
                                        f"{self.where}: {exc.message}", exc.fix or
                                        "check that Slurm's commands work there"))
            return CloudCheck(tuple(problems))
        problems.append(Problem(
            "slurm", "no allocation yet: the nodes are checked once 'up' has one",
            f"run 'orchestrate up {self.spec_path.name}' (or 'train'), then the doctor again",
            blocking=False))
        return CloudCheck(tuple(problems), tuple(h.name for h in self.planned_hosts()))

    def node_problems(self, hosts: Sequence[Host]) -> list[Problem]:
        """The allocation's nodes as Slurm sees them: still in their allocation, not down,
        with the GPUs (GRES) ``gpus_per_node`` asks for; an allocation 'up --attach' adopted
        may have been made without them."""
        problems: list[Problem] = []
        jobs = {j: self.slurm.job(j) for j in {h.label(JOB_LABEL) or "" for h in hosts} if j}
        gone = sorted(j for j, job in jobs.items() if job is None or job.ended)
        if gone:
            problems.append(Problem(
                "slurm", f"allocation {', '.join(gone)} has ended",
                f"run 'orchestrate up {self.spec_path.name}' (train does it by itself)"))
        nodes = self.slurm.nodes([h.node or "" for h in hosts])
        for host in hosts:
            fields = nodes.get(host.node or "", {})
            state = fields.get("State", "unknown")
            if node_down(state):
                problems.append(Problem(
                    "slurm", f"{host.name}'s node {host.node} is {state}",
                    "train gives its task another node; or ask the admins about the node",
                    hosts=(host.name,), blocking=False))
            have = gpu_count(fields.get("Gres", ""))
            if self.config.gpus_per_node and have < self.config.gpus_per_node:
                problems.append(Problem(
                    "slurm", f"{host.name}'s node {host.node} has {have} GPU(s) (GRES "
                    f"{fields.get('Gres') or '(null)'}), not the {self.config.gpus_per_node} of "
                    "provider.gpus_per_node", "attach an allocation on GPU nodes (salloc "
                    "--gpus-per-node=N), or lower provider.gpus_per_node", hosts=(host.name,)))
        return problems

    def host_health(self, host: Host) -> HostHealth:
        """The node as Slurm sees it: gone with the allocation, unreachable when DOWN or not
        responding, else running."""
        job_id = host.label(JOB_LABEL)
        try:
            job = self.slurm.job(job_id) if job_id else None
            if job is None or job.ended or host.node not in self.slurm.hostnames(job.nodes):
                return HostHealth.GONE  # with its allocation, or taken out of it (--no-kill)
            node = self.slurm.nodes([host.node or ""]).get(host.node or "", {})
        except OrchestratorError:
            return HostHealth.UNREACHABLE
        state = node.get("State", "")
        if node_down(state):
            return HostHealth.UNREACHABLE
        return HostHealth.RUNNING

    def down(self) -> DownReport:
        """Cancel the allocation 'up' submitted (an attached one is left running), then remove
        the root where 'up' made it."""
        record = self._load()
        removed: list[str] = []
        notes: list[str] = []
        job_id = record.get("job_id")
        if job_id and record.get("submitted"):
            job = self.slurm.job(job_id)
            if job is not None and not job.ended:
                self.slurm.cancel(job_id)
                removed.append(f"allocation {job_id} (scancel {self.where})")
        elif job_id:
            notes.append(f"allocation {job_id} is yours ('up --attach'): left running")
        for replacement in record.get("replacements", []):
            job = self.slurm.job(replacement)
            if job is not None and not job.ended:
                self.slurm.cancel(replacement)
                removed.append(f"replacement allocation {replacement} (scancel {self.where})")
        try:
            done, text = self.remove_root(self.submit_host())
        except OrchestratorError as exc:
            done, text = False, f"root not removed: {exc.message}"
        (removed if done else notes).append(text)
        self._job = {}
        self.forget_hosts()
        return DownReport(removed=tuple(removed), notes=tuple(notes))


def partition_problems(spec: ClusterSpec, config: specs.SlurmProvider, slurm: Slurm
                       ) -> list[Problem]:
    """What ``sinfo`` says of the partition against the spec: it exists and is up, has a
    node per task, allows the time and has the GPUs per node."""
    out = slurm.run(["sinfo", "--noheader", "--format=%P|%a|%l|%D|%G"], what="sinfo")
    rows = [line.split("|") for line in out.splitlines() if line.count("|") == 4]
    default = next((r[0].rstrip("*") for r in rows if r[0].endswith("*")), None)
    name = config.partition or default
    known = sorted({r[0].rstrip("*") for r in rows})
    if name is None:
        return [Problem("slurm", "the cluster has no default partition",
                        f"set provider.partition to one of: {', '.join(known) or '(none)'}")]
    mine = [r for r in rows if r[0].rstrip("*") == name]
    if not mine:
        return [Problem("slurm", f"partition {name!r} does not exist",
                        f"set provider.partition to one of: {', '.join(known) or '(none)'}")]
    problems: list[Problem] = []
    state = mine[0][1]
    if state != "up":
        problems.append(Problem("slurm", f"partition {name} is {state}, not up",
                                "ask the admins, or choose another provider.partition"))
    nodes = sum(int(r[3]) for r in mine if r[3].isdigit())
    if nodes < spec.num_tasks:
        problems.append(Problem("slurm", f"partition {name} has {nodes} node(s) for "
                                f"{spec.num_tasks} task(s), one per node",
                                "lower workers, or choose a larger provider.partition"))
    elif state == "up":
        problems += _spare_problems(spec, name, slurm)
    limit = mine[0][2]
    if config.time is not None and limit not in ("infinite", "UNLIMITED", "n/a"):
        with contextlib.suppress(ValueError):
            if specs.slurm_seconds(config.time) > specs.slurm_seconds(limit):
                problems.append(Problem(
                    "slurm", f"provider.time {config.time} is over partition {name}'s limit "
                    f"of {limit}", f"set provider.time to {limit} or less: a longer run goes "
                    "on in a new allocation by itself"))
    if config.gpus_per_node:
        counts = [gpu_count(r[4]) for r in mine]
        if max(counts, default=0) < config.gpus_per_node:
            problems.append(Problem(
                "slurm", f"partition {name}'s nodes have {max(counts, default=0)} GPU(s) "
                f"(GRES {mine[0][4]}), not the {config.gpus_per_node} of "
                "provider.gpus_per_node", "lower provider.gpus_per_node, or choose a GPU "
                "partition ('sinfo -o \"%P %G\"' shows them)"))
    return problems


def _spare_problems(spec: ClusterSpec, partition: str, slurm: Slurm) -> list[Problem]:
    """Whether the partition has a node up beyond the group's, for a lost node's task to go
    to: without one, an elastic group goes on smaller until the node is back, and any other
    fails after timeouts.repair_s (not blocking: it is how the run will fare, not a fault)."""
    out = slurm.run(["sinfo", "--noheader", f"--partition={partition}", "--format=%D|%t"],
                    what="sinfo")
    up = sum(int(count) for count, _, state in (line.partition("|") for line in out.split())
             if count.isdigit() and not node_down(state.upper()) and not any(
                 word in state for word in ("drain", "drng", "maint", "inval", "unk", "futr")))
    if up > spec.num_tasks:
        return []
    what = (f"partition {partition} has {up} node(s) up for the group's {spec.num_tasks}: "
            "none to spare, so a lost node's task has no node to go to")
    policy = spec.elastic
    if policy is not None:
        return [Problem("slurm", f"{what}; the group goes on with fewer meanwhile (elastic, "
                        f"down to {policy.min_workers}) and grows back once a node is",
                        "choose a provider.partition with a node to spare, to keep the "
                        "group's size when a node is lost", blocking=False)]
    return [Problem("slurm", f"{what}, and the run fails after timeouts.repair_s "
                    f"({spec.timeouts.repair_s:.0f}s)",
                    f"add 'elastic: {{min_workers: {max(1, spec.workers - 1)}}}' to go on "
                    "with the nodes left, or choose a provider.partition with a node to spare",
                    blocking=False)]


def gpu_count(gres: str) -> int:
    """GPUs per node in sinfo's GRES column: ``gpu:8``, ``gpu:a100:4(S:0-1)``, ``(null)``."""
    total = 0
    for item in gres.split(","):
        parts = item.split("(")[0].split(":")
        if parts[0] == "gpu" and parts[-1].isdigit():
            total += int(parts[-1])
    return total
