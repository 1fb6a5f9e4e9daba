"""The `static` provider: attach to hosts listed in the spec over SSH; create and delete nothing."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from orchestrator import spec as specs
from orchestrator.hosts import Host, SSHEndpoint
from orchestrator.providers.base import DownReport
from orchestrator.providers.ssh_hosts import SSHHostsProvider
from orchestrator.remote.fanout import fan_out
from orchestrator.spec import ClusterSpec


class StaticProvider(SSHHostsProvider):
    kind = "static"
    config: specs.StaticProvider

    def __init__(self, spec: ClusterSpec, spec_path: Path) -> None:
        super().__init__(spec, spec_path)
        assert isinstance(spec.provider, specs.StaticProvider)
        self.config = spec.provider
        self._roots: dict[str, str] = {}

    @property
    def connect_deadline_s(self) -> float:
        """A listed host that does not answer is retried for ``wait_for_host_s``."""
        return max(self.config.wait_for_host_s, self.config.connect_timeout_s)

    def hosts(self) -> list[Host]:
        """The listed hosts; the first call asks each (in parallel) for its home directory."""
        hosts = self._unrooted()
        missing = [h for h in hosts if h.name not in self._roots]
        if missing:
            found = fan_out(missing, self.resolve_root, name_of=lambda h: h.name)
            found.raise_if_failed("reach hosts")
            self._roots.update({r.name: str(r.value) for r in found.succeeded})
        return [replace(h, root=self._roots[h.name]) for h in hosts]

    def planned_hosts(self) -> list[Host]:
        """The listed hosts without SSH: roots read '~/...' of each SSH user until ``up``."""
        root = self.planned_root("~")
        return [replace(h, root=root) for h in self._unrooted()]

    def _unrooted(self) -> list[Host]:
        base = self.spec_path.parent
        known = self.config.known_hosts or "~/.ssh/known_hosts"
        return [
            Host(
                name=h.name or f"{self.spec.name}-{i}",
                address=h.address,
                root="",
                ssh=SSHEndpoint(
                    address=h.ssh_address or h.address,
                    user=h.user,
                    port=h.ssh_port,
                    key_file=str((base / Path(h.key_file).expanduser()).resolve()),
                    host_keys=(h.host_key,) if h.host_key else (),
                    known_hosts=str((base / Path(known).expanduser()).resolve()),
                    trust_on_first_use=self.config.trust_on_first_use,
                    connect_timeout_s=self.config.connect_timeout_s,
                ),
                task_port=h.task_port,
            )
            for i, h in enumerate(self.config.hosts)
        ]

    def up(self) -> list[Host]:
        """Check what will be uploaded, reach every host in parallel, make and mark each root,
        sync the code and the worker package, run setup."""
        self.upload()
        hosts = self.hosts()
        self.prepare_all(hosts)
        return hosts

    def down(self) -> DownReport:
        """Remove this cluster's directory on every host, only where ``up`` made it (its marker
        names this cluster); anything else is left, and the report says why."""
        result = fan_out(self.hosts(), self.remove_root, name_of=lambda h: h.name)
        outcomes = [r.value for r in result.succeeded if r.value is not None]
        notes = [f"{r.name}: not cleaned: {r.error}" for r in result.failed]
        notes += [text for removed, text in outcomes if not removed]
        return DownReport(removed=tuple(text for removed, text in outcomes if removed),
                          notes=tuple(notes))
