"""The `local` provider: every task a process on this machine, on loopback ports."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import worker as worker_package
from orchestrator import paths
from orchestrator.errors import ProviderError
from orchestrator.files import private_dir
from orchestrator.hosts import Host
from orchestrator.providers.base import DownReport, Provider
from orchestrator.remote import netns
from orchestrator.remote.base import probe_argv
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
        self._notes: list[str] = []
        if self._private:  # the holder an earlier 'up' made (train --attach does no 'up')
            self._runner.netns = netns.found(self._netns_file)

    @property
    def _private(self) -> bool:
        return getattr(self.spec.provider, "private_network", False) is not False and \
            self.spec.container is None  # a container runs on the host's network

    @property
    def _netns_file(self) -> Path:
        return paths.cluster_home(self.spec.name) / "netns.pid"

    @property
    def root(self) -> str:
        return str(paths.cluster_home(self.spec.name))

    def up(self) -> list[Host]:
        """Only the root, private (0700); with ``container``, the tasks run in an image, so the
        controller's ``worker`` package is copied to ``<root>/lib`` (on their PYTHONPATH,
        mounted) as on an SSH host."""
        hosts = self.hosts()
        private_dir(Path(self.root))
        self._notes = []
        if self._private:
            self._private_network()
        if self.spec.container is not None:
            sync_dir(self._runner, str(Path(worker_package.__file__).parent),
                     f"{paths.lib_dir(self.root)}/worker", ("__pycache__", "*.pyc"))
        return hosts

    def _private_network(self) -> None:
        """The tasks' own network namespace (``remote/netns.py``), made once per cluster."""
        try:
            self._runner.netns = netns.ensure(self._netns_file)
        except netns.Unavailable as why:
            if self.spec.provider.private_network is True:  # type: ignore[union-attr]
                raise ProviderError(
                    f"the tasks cannot get a network of their own here: {why}",
                    fix="enable unprivileged user namespaces (sysctl "
                    "kernel.unprivileged_userns_clone=1, or the AppArmor profile that "
                    "restricts them), or set provider.private_network: auto") from None
            self._runner.netns = None
            self._notes.append(
                f"the tasks use this machine's network ({why}): TensorFlow's gRPC ports "
                f"{self.spec.ports.start}-{self.spec.ports.end} are reachable from other "
                "machines unless a firewall closes them")

    def notes(self) -> list[str]:
        return list(self._notes)

    def hosts(self) -> list[Host]:
        return [
            Host(name=f"local-{i}", address=LOOPBACK, root=self.root)
            for i in range(self.spec.num_tasks)
        ]

    def spare_hosts(self) -> list[Host]:
        """More processes on this machine, for a group that grows past workers: each is
        'back' at the first grow check (its repair: this machine answers)."""
        return [Host(name=f"local-{i}", address=LOOPBACK, root=self.root)
                for i in self.spec.spare_indices]

    def runner(self, host: Host) -> LocalRunner:
        return self._runner

    def python(self, host: Host) -> str:
        configured = getattr(self.spec.provider, "python", None)
        return configured or sys.executable

    def down(self) -> DownReport:
        stopped = netns.stop(self._netns_file)
        self._runner.netns = None
        return DownReport(removed=("the tasks' network namespace",) if stopped else (),
                          notes=(f"run files are kept under {self.root}",))

    def busy_ports(self, hosts: Sequence[Host]) -> set[tuple[str, int]]:
        """Probe the range until every task has a free port; return the taken ones seen: in
        the tasks' network namespace where they have one (a port this machine's other
        processes hold is no task's, and one a process left in there holds is; measured: a
        dead JAX chief's coordination service, still serving there, took the next chief's
        connection for 70 s), else here."""
        ports = self.spec.ports
        holder = self._runner.netns
        if holder is None:
            taken = probes.taken_ports(ports.start, ports.end, len(hosts))
        else:
            argv = [*holder.enter(), *probe_argv(sys.executable, "ports", str(ports.start),
                                                 str(ports.end), str(len(hosts)))]
            out = self._runner.run(argv, timeout_s=30).stdout
            taken = [int(p) for p in out.split()]
        return {(LOOPBACK, port) for port in taken}
