"""The provider interface: where a cluster's hosts come from, and how to reach them."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.hosts import Host
from orchestrator.remote.base import Runner
from orchestrator.spec import ClusterSpec


@dataclass(frozen=True)
class DownReport:
    """What ``down`` removed or stopped, for the user to read."""

    removed: tuple[str, ...] = ()
    stopped: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())


class Provider(ABC):
    """Creates or attaches to hosts, hands out runners, and cleans up.

    ``hosts()`` returns one host per task, the chief's first.
    """

    kind: str

    def __init__(self, spec: ClusterSpec, spec_path: Path) -> None:
        self.spec = spec
        self.spec_path = spec_path

    @abstractmethod
    def up(self) -> list[Host]:
        """Create or attach to every host and prepare it to run tasks; idempotent."""

    @abstractmethod
    def hosts(self) -> list[Host]:
        """The cluster's hosts as they are now, without creating anything."""

    @abstractmethod
    def runner(self, host: Host) -> Runner:
        """A runner for ``host``; the provider owns and reuses it."""

    @abstractmethod
    def python(self, host: Host) -> str:
        """The interpreter that runs the worker on ``host``."""

    @abstractmethod
    def down(self) -> DownReport:
        """Remove what ``up`` made (processes, files, machines); leave everything else."""

    def busy_ports(self, hosts: Sequence[Host]) -> set[tuple[str, int]]:
        """(address, port) pairs of the spec's range already taken; default: none known."""
        return set()

    def close(self) -> None:
        """Release connections."""
