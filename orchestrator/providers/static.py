"""The `static` provider: attach to hosts listed in the spec over SSH; create and delete nothing."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

from orchestrator import spec as specs
from orchestrator.errors import ProviderError
from orchestrator.hosts import Host, SSHEndpoint
from orchestrator.providers.base import DownReport
from orchestrator.providers.hostprep import SSHHostsProvider
from orchestrator.remote.fanout import fan_out
from orchestrator.remote.ssh import SSHRunner
from orchestrator.spec import ClusterSpec


class StaticProvider(SSHHostsProvider):
    kind = "static"
    config: specs.StaticProvider

    def __init__(self, spec: ClusterSpec, spec_path: Path) -> None:
        super().__init__(spec, spec_path)
        assert isinstance(spec.provider, specs.StaticProvider)
        self.config = spec.provider
        self._runners: dict[str, SSHRunner] = {}
        self._roots: dict[str, str] = {}
        self._lock = threading.Lock()

    def hosts(self) -> list[Host]:
        """The listed hosts; the first call asks each (in parallel) for its home directory."""
        hosts = self._unrooted()
        missing = [h for h in hosts if h.name not in self._roots]
        if missing and self.config.root is None:
            found = fan_out(missing, self._home_root, name_of=lambda h: h.name)
            found.raise_if_failed("reach hosts")
            self._roots.update({r.name: str(r.value) for r in found.succeeded})
        return [replace(h, root=self.config.root or self._roots[h.name]) for h in hosts]

    def planned_hosts(self) -> list[Host]:
        """The listed hosts without SSH: roots read '~/...' of each SSH user until ``up``."""
        root = self.config.root or f"~/.orchestrate/clusters/{self.spec.name}"
        return [replace(h, root=root) for h in self._unrooted()]

    def _home_root(self, host: Host) -> str:
        home = self.runner(host).run('printf %s "$HOME"').stdout.strip()
        if not home.startswith("/"):
            raise ProviderError(f"{host.name}: the SSH user's home is {home!r}, not absolute",
                                fix="set provider.root to an absolute directory")
        return f"{home}/.orchestrate/clusters/{self.spec.name}"

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

    def runner(self, host: Host) -> SSHRunner:
        assert host.ssh is not None
        with self._lock:
            runner = self._runners.get(host.name)
            if runner is None:
                runner = SSHRunner(host.name, host.ssh,
                                   connect_deadline_s=max(self.config.wait_for_host_s,
                                                          self.config.connect_timeout_s))
                self._runners[host.name] = runner
            return runner

    def up(self) -> list[Host]:
        """Reach every host in parallel, sync the code and the worker package, run setup."""
        hosts = self.hosts()
        fan_out(hosts, self.prepare, name_of=lambda h: h.name).raise_if_failed("prepare hosts")
        return hosts

    def down(self) -> DownReport:
        """Remove this cluster's directory on every host; nothing else is touched."""
        hosts = self.hosts()

        def clean(host: Host) -> str:
            self.runner(host).run(["rm", "-rf", "--", host.root])
            return f"{host.name}:{host.root}"

        result = fan_out(hosts, clean, name_of=lambda h: h.name)
        notes = tuple(f"{r.name}: not cleaned: {r.error}" for r in result.failed)
        return DownReport(removed=tuple(str(r.value) for r in result.succeeded), notes=notes)

    def close(self) -> None:
        with self._lock:
            for runner in self._runners.values():
                runner.close()
            self._runners.clear()
