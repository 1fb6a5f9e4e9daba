"""The provider interface: where a cluster's hosts come from, and how to reach them."""

from __future__ import annotations

import contextlib
import enum
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.errors import OrchestratorError, ProviderError
from orchestrator.hosts import Host
from orchestrator.problems import Problem
from orchestrator.remote.base import Runner, TaskHandle
from orchestrator.spec import ClusterSpec

if TYPE_CHECKING:
    from orchestrator.plan import ClusterPlan


class HostHealth(enum.Enum):
    RUNNING = "running"  # reachable and doing its job
    UNREACHABLE = "unreachable"  # exists (as far as we know) but does not answer
    PREEMPTED = "preempted"  # the cloud took a spot/preemptible VM back
    GONE = "gone"  # deleted, or stopped for another reason


@dataclass(frozen=True)
class DownReport:
    """What ``down`` removed or stopped, for the user to read."""

    removed: tuple[str, ...] = ()
    stopped: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())


@dataclass(frozen=True)
class CloudCheck:
    """What a provider finds before any host is asked (``Provider.cloud_check``).

    ``problems``: what the cloud says of the spec (an image, machine type or GPU it does not
    have), and the hosts that do not exist yet. ``unprovisioned``: the names of those hosts:
    the doctor reports them there and does not try to reach them.
    """

    problems: tuple[Problem, ...] = ()
    unprovisioned: tuple[str, ...] = ()


class Provider(ABC):
    """Creates or attaches to hosts, hands out runners, and cleans up.

    ``hosts()`` returns one host per task, the chief's first.
    """

    kind: str
    # Whether the provider takes machines back on its own (spot VMs): only then can a lost
    # host be preempted, and is its health worth asking while the group waits to restart.
    reclaims_hosts: bool = False
    # Whether the next attempt's tasks may wait warm beside the running ones (retry.warm_tasks).
    warm_tasks: bool = True
    # Whether the hosts are slots the scheduler places, named by their index in the group (a
    # JobSet's pods): an elastic group of fewer workers then runs on the first N of them,
    # whichever one could not be placed, and grows back onto them in order.
    interchangeable_hosts: bool = False
    # An elastic group's check for a host it lost: how long each ``repair`` may take (off the
    # training's path). A listed machine answers its SSH port within moments once it is back.
    return_probe_s: float = 10.0

    def __init__(self, spec: ClusterSpec, spec_path: Path) -> None:
        self.spec = spec
        self.spec_path = spec_path
        # What ``up`` is waiting for, as it changes (a scheduler's queue): the CLI prints it.
        self.progress: Callable[[str], None] = lambda line: None

    @abstractmethod
    def up(self) -> list[Host]:
        """Create or attach to every host and prepare it to run tasks; idempotent."""

    def adopt(self, allocation: str) -> None:
        """Make ``allocation`` (one the user already holds, e.g. from ``salloc``) the
        cluster's, for ``up`` to use and ``down`` to leave.

        Raises:
            ProviderError: the provider has no allocations, or not this one.
        """
        raise ProviderError(f"provider {self.kind!r} has no allocations to attach to",
                            fix="leave out --attach (it is for provider.kind: slurm)")

    def renew(self) -> str | None:
        """Before an attempt: make sure the hosts can hold it (a scheduler's allocation that
        ended, was requeued or is about to reach its time limit is replaced or waited for);
        what was done, for the run's messages, or None: nothing was needed (the default)."""
        return None

    @abstractmethod
    def hosts(self) -> list[Host]:
        """The cluster's hosts as they are now, without creating anything."""

    def spare_hosts(self) -> list[Host]:
        """The machines an elastic group may grow onto past its tasks (``elastic.max_workers``),
        as they are now, none created or reached: each is brought in by ``repair`` once the
        grow check finds it; default: none."""
        return []

    def placed(self, host: Host) -> bool:
        """Whether a spare of ``spare_hosts()`` is a machine the group can run on now (a
        scheduler's spare is one only once its allocation runs); default: yes, once its
        repair brought it in."""
        return True

    def all_hosts(self) -> list[Host]:
        """``hosts()`` and then ``spare_hosts()``: every machine a task of the cluster may run
        on (for ``down`` and ``logs`` to find them)."""
        return [*self.hosts(), *self.spare_hosts()]

    def notes(self) -> list[str]:
        """What the user should know about the last ``up`` (e.g. zones that refused VMs)."""
        return []

    def planned_hosts(self) -> list[Host]:
        """The hosts as a dry run shows them, without contacting any; default: ``hosts()``."""
        return self.hosts()

    def describe(self) -> dict[str, Any] | None:
        """What ``up`` creates, as ``orchestrate plan`` shows it; None: it creates no machines."""
        return None

    def cloud_check(self) -> CloudCheck:
        """The doctor's checks that need no host, run before it asks the hosts: for a cloud,
        its catalog against the spec and which machines no ``up`` has made yet; default:
        nothing (the hosts are the ones the spec names)."""
        return CloudCheck()

    @abstractmethod
    def runner(self, host: Host) -> Runner:
        """A runner for ``host``; the provider owns and reuses it."""

    def early_run_id(self) -> str | None:
        """The id a new run is to take because its first attempt's tasks were started under it
        early (an SSH host's: ``orchestrator/early_claim.py``), once; default: None."""
        return None

    def remember_launches(self, run_id: str, scripts: dict[str, list[tuple[str, list[str]]]],
                          run_dirs: dict[str, str]) -> None:
        """The launch scripts of run ``run_id``'s first-attempt warm tasks, by host name, and
        each host's run directory, for the next ``train`` to start early where it can;
        default: nothing is kept."""

    def run_repeatable(self, host: Host, argv: Sequence[str], timeout_s: float) -> str:
        """What ``argv``, a command that only reads, prints on ``host`` (an SSH host's may
        have run early: ``orchestrator/early_claim.py``)."""
        return self.runner(host).run(argv, timeout_s=timeout_s).stdout

    def image_problems(self) -> list[Problem]:
        """What the doctor's ``--import-tf`` finds by starting the tasks' image where no host
        exists before 'train' (a scheduler's pod); default: nothing to probe (the hosts are
        asked instead)."""
        return []

    @contextlib.contextmanager
    def check_runners(self, hosts: Sequence[Host]) -> Iterator[Callable[[Host], Runner]]:
        """Runners for a quick check of ``hosts`` (the doctor's), released on exit: a host that
        does not answer fails fast instead of being waited for; default: ``runner``."""
        yield self.runner

    @abstractmethod
    def python(self, host: Host) -> str:
        """The interpreter that runs the worker on ``host``."""

    @abstractmethod
    def down(self) -> DownReport:
        """Remove what ``up`` made (processes, files, machines); leave everything else."""

    def host_health(self, host: Host) -> HostHealth:
        """How ``host`` is doing: by default, whether it answers a trivial command."""
        try:
            self.runner(host).run(["true"], timeout_s=15)
        except OrchestratorError:
            return HostHealth.UNREACHABLE
        return HostHealth.RUNNING

    def lost_hosts(self, hosts: Sequence[Host]) -> dict[str, str]:
        """After a task failed: which of ``hosts`` the provider finds lost under their tasks
        (a scheduler's node that stopped answering), by name, with why; default: none known
        (a lost SSH host shows as its dropped connection)."""
        return {}

    def repair(self, host: Host, deadline_s: float) -> Host:
        """Bring a lost host back under the same index (wait for it, restart or re-create it)
        and prepare it again; returns the host as it is now (its address may change).

        Raises:
            ProviderError: the host is not back within ``deadline_s``.
        """
        waited = 0.0
        while self.host_health(host) is not HostHealth.RUNNING:
            if waited >= deadline_s:
                raise ProviderError(
                    f"host {host.name} ({host.address}) did not come back within {deadline_s:.0f}s",
                    fix="bring the machine back (or replace it in the spec) and train again",
                )
            time.sleep(min(5.0, deadline_s))
            waited += min(5.0, deadline_s)
        self.up()
        return next(h for h in self.all_hosts() if h.name == host.name)

    def give_up(self, host: Host) -> None:
        """An elastic run ended without ``host``: withdraw what still asks for it (a
        scheduler's queued replacement), so that nothing starts later to stand unused;
        default: nothing is left asking (a repair is a call that returns)."""

    def start_group(self, plan: ClusterPlan) -> list[TaskHandle] | None:
        """Start every task of ``plan`` at once, where the scheduler starts a group as one
        object (a Kubernetes JobSet), and return their handles in the plan's order; None
        (the default): each task is started on its own host by the launcher.

        Raises:
            ProviderError: the group could not be submitted; nothing of it is left running.
        """
        return None

    def busy_ports(self, hosts: Sequence[Host]) -> set[tuple[str, int]]:
        """(address, port) pairs of the spec's range already taken; default: none known."""
        return set()

    def close(self) -> None:
        """Release connections."""
