"""The `local` provider: every task a process on this machine, on loopback ports."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import worker as worker_package
from orchestrator import paths
from orchestrator.files import private_dir
from orchestrator.hosts import Host
from orchestrator.providers.base import DownReport, Provider
from orchestrator.remote.local import LocalRunner
from orchestrator.remote.sync import sync_dir
from orchestrator.spec import ClusterSpec
from worker import probes

LOOPBACK = "127.0.0.1"


class LocalProvider(Provider):
    kind = "local"

    def __init__(self, spec: ClusterSpec, spec_path: Path) -> None:
        super().__init__(spec, spec_path)
        self._runner = LocalRunner("localhost")

    @property
    def root(self) -> str:
        return str(paths.cluster_home(self.spec.name))

    def up(self) -> list[Host]:
        """Only the root, private (0700); with ``container``, the tasks run in an image, so the
        controller's ``worker`` package is copied to ``<root>/lib`` (on their PYTHONPATH,
        mounted) as on an SSH host."""
        hosts = self.hosts()
        private_dir(Path(self.root))
        if self.spec.container is not None:
            sync_dir(self._runner, str(Path(worker_package.__file__).parent),
                     f"{paths.lib_dir(self.root)}/worker", ("__pycache__", "*.pyc"))
        return hosts

    def hosts(self) -> list[Host]:
        return [
            Host(name=f"local-{i}", address=LOOPBACK, root=self.root)
            for i in range(self.spec.num_tasks)
        ]

    def runner(self, host: Host) -> LocalRunner:
        return self._runner

    def python(self, host: Host) -> str:
        configured = getattr(self.spec.provider, "python", None)
        return configured or sys.executable

    def down(self) -> DownReport:
        return DownReport(notes=(f"run files are kept under {self.root}",))

    def busy_ports(self, hosts: Sequence[Host]) -> set[tuple[str, int]]:
        """Probe the range until every task has a free port; return the taken ones seen."""
        taken = probes.taken_ports(self.spec.ports.start, self.spec.ports.end, len(hosts))
        return {(LOOPBACK, port) for port in taken}
