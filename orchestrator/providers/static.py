"""The `static` provider: attach to hosts listed in the spec over SSH; create and delete nothing."""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import replace
from pathlib import Path

from orchestrator import spec as specs
from orchestrator.errors import ProviderError
from orchestrator.hosts import Host, SSHEndpoint
from orchestrator.providers.base import DownReport
from orchestrator.providers.ssh_hosts import SSHHostsProvider, port_opens
from orchestrator.remote.fanout import fan_out
from orchestrator.spec import ClusterSpec


class StaticProvider(SSHHostsProvider):
    kind = "static"
    config: specs.StaticProvider
    homes_recorded = True  # with the roots (``_record_roots``)

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
        """The listed hosts of the tasks; the first call asks each (in parallel) for its home
        directory, except where ``up`` recorded the root of the same address and user: a later
        command (``train --attach``, ``down``) lists a host that is down as it was."""
        hosts = self._unrooted()[:self.spec.num_tasks]
        self._load_roots()
        missing = [h for h in hosts if h.name not in self._roots]
        if missing:
            found = fan_out(missing, self.resolve_root, name_of=lambda h: h.name)
            found.raise_if_failed("reach hosts")
            self._roots.update({r.name: str(r.value) for r in found.succeeded})
        return [replace(h, root=self._roots[h.name]) for h in hosts]

    def spare_hosts(self) -> list[Host]:
        """The hosts listed past the tasks (``elastic.max_workers``), none asked: the root of
        one the group grew onto is the one its repair found (recorded), else empty (a spare
        may well be down; its repair asks it once it answers)."""
        self._load_roots()
        return [replace(h, root=self._roots.get(h.name, ""))
                for h in self._unrooted()[self.spec.num_tasks:]]

    def _load_roots(self) -> None:
        if not self._roots:
            self._roots.update(self._recorded_roots(self._unrooted()))
            self.expect_homes(self._recorded_homes(self._unrooted()))

    def planned_hosts(self) -> list[Host]:
        """The listed hosts of the tasks without SSH: roots read '~/...' of each SSH user
        until ``up``."""
        root = self.planned_root("~")
        return [replace(h, root=root) for h in self._unrooted()[:self.spec.num_tasks]]

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

    def _recorded(self, hosts: list[Host]) -> dict[str, dict[str, object]]:
        """What ``up`` recorded of the hosts still listed at the same address for the same
        user (the root, and the SSH user's home where it was known)."""
        with contextlib.suppress(FileNotFoundError, ValueError, KeyError, TypeError,
                                 AttributeError):
            recorded = json.loads(self.hosts_file.read_text())["roots"]
            return {h.name: recorded[h.name] for h in hosts
                    if h.ssh is not None and isinstance(recorded.get(h.name), dict)
                    and recorded[h.name]["address"] == h.ssh.address
                    and recorded[h.name]["user"] == h.ssh.user}
        return {}

    def _recorded_roots(self, hosts: list[Host]) -> dict[str, str]:
        """The roots ``up`` recorded (``_recorded``); none where the spec sets
        ``provider.root`` (it is the root, asked of no host)."""
        if self.config.root:
            return {}
        return {n: str(r["root"]) for n, r in self._recorded(hosts).items() if "root" in r}

    def _recorded_homes(self, hosts: list[Host]) -> dict[str, str]:
        """The SSH users' homes ``up`` recorded (``_recorded``), each checked on its host as its
        root is claimed."""
        return {n: str(r["home"]) for n, r in self._recorded(hosts).items() if r.get("home")}

    def up(self) -> list[Host]:
        """Check what will be uploaded, reach every host in parallel, make and mark each root,
        sync the code and the worker package, run setup; the roots are recorded."""
        self.upload()
        hosts = self.hosts()
        self.prepare_all(hosts)
        self._record_roots(hosts)
        self.remember_claims(hosts)
        return hosts

    def _record_roots(self, hosts: list[Host]) -> None:
        """Record the roots of ``hosts``, and of the spares prepared before (kept: ``down``
        removes what was made on them)."""
        prepared = {h.name for h in hosts}
        kept = [h for h in self.spare_hosts() if h.root and h.name not in prepared]
        self.save_hosts([], extra={"roots": {
            h.name: {"address": h.ssh.address, "user": h.ssh.user, "root": h.root,
                     "home": self.known_home(h.name)}
            for h in [*hosts, *kept] if h.ssh is not None}})

    def repair(self, host: Host, deadline_s: float) -> Host:
        """A listed host cannot be restarted from here: wait up to ``deadline_s`` for it to
        answer again, and prepare it alone (the others were prepared when the run began).
        Its SSH port is probed with a fresh connection every 0.25 s (``port_opens``), so a
        host cut off and back is seen at once, not when a connect's SYN is next resent.

        Raises:
            ProviderError: it does not answer within ``deadline_s``.
        """
        deadline = time.monotonic() + deadline_s
        assert host.ssh is not None
        try:
            if not port_opens(host.ssh.address, host.ssh.port, deadline):
                raise ProviderError("no connection to its SSH port opened")
            self.wait_for_ssh(host, deadline)
        except ProviderError as exc:
            raise ProviderError(
                f"host {host.name} ({host.address}) did not come back within {deadline_s:.0f}s: "
                f"{exc.message}",
                fix="bring the machine back (or replace it in the spec) and train again",
            ) from None
        if not host.root:  # a spare, asked for the first time
            host = replace(host, root=self.resolve_root(host))
        self.prepare_all([host])
        if host.name not in self._roots:
            self._roots[host.name] = host.root
            self._record_roots(self.hosts())
        return next(h for h in self.all_hosts() if h.name == host.name)

    def down(self) -> DownReport:
        """Remove this cluster's directory on every host (and every spare the group grew
        onto), only where ``up`` made it (its marker names this cluster); anything else is
        left, and the report says why."""
        prepared = [h for h in self.spare_hosts() if h.root]  # the spares it grew onto
        result = fan_out([*self.hosts(), *prepared], self.remove_root, name_of=lambda h: h.name)
        outcomes = [r.value for r in result.succeeded if r.value is not None]
        notes = [f"{r.name}: not cleaned: {r.error}" for r in result.failed]
        notes += [text for removed, text in outcomes if not removed]
        if not result.failed:
            self.forget_hosts()
        return DownReport(removed=tuple(text for removed, text in outcomes if removed),
                          notes=tuple(notes))
