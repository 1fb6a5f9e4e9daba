"""The `gcp` provider: Compute Engine VMs reached with a per-cluster key, repaired after preemption."""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator import spec as specs
from orchestrator.errors import AuthError, HostUnreachableError, ProviderError
from orchestrator.hosts import Host, SSHEndpoint
from orchestrator.providers.base import DownReport, HostHealth
from orchestrator.providers.gcp import names
from orchestrator.providers.gcp.keys import PRIVATE_NAME, KeyPair, ensure_key_pair, remove_key_pair
from orchestrator.providers.hostprep import SSHHostsProvider
from orchestrator.remote.fanout import fan_out
from orchestrator.remote.ssh import SSHRunner
from orchestrator.spec import ClusterSpec
from orchestrator.state import home

if TYPE_CHECKING:  # google-cloud-compute loads in seconds: only commands that call the API pay
    from orchestrator.providers.gcp.compute import Compute, Vm
    from orchestrator.providers.gcp.instance import Fleet, ZoneFailure

STATE_FILE = "gcp.json"  # the VMs as `up` last saw them, so later commands need no API call
JOURNAL_FILE = "gcp-operations.json"
SSH_DIR = "ssh"
LOST = ("STOPPING", "TERMINATED", "STOPPED", "SUSPENDING", "SUSPENDED")
POLL_FIRST_S = 0.25
POLL_MAX_S = 5.0


class GcpProvider(SSHHostsProvider):
    """See the module docstring.

    Args:
        spec: a spec whose provider is ``gcp``.
        spec_path: where it was read from (``workdir`` is relative to it).
        compute: the API (default: Application Default Credentials, or $ORCHESTRATE_GCE_ENDPOINT).
        sleep: the backoff sleep between API retries.
    """

    kind = "gcp"
    config: specs.GcpProvider

    def __init__(self, spec: ClusterSpec, spec_path: Path, *, compute: Compute | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        super().__init__(spec, spec_path)
        assert isinstance(spec.provider, specs.GcpProvider)
        self.config = spec.provider
        self.state_dir = home() / "clusters" / spec.name
        self._compute = compute
        self._sleep = sleep
        self._fleet: Fleet | None = None
        self._hosts: dict[str, Host] = {}
        self._runners: dict[str, SSHRunner] = {}
        self._lock = threading.RLock()

    @property
    def compute(self) -> Compute:
        from orchestrator.providers.gcp.compute import Compute

        if self._compute is None:
            self._compute = Compute.connect(self.config.project, deadline_s=self.config.api_timeout_s,
                                            sleep=self._sleep)
        return self._compute

    @property
    def fleet(self) -> Fleet:
        from orchestrator.providers.gcp.instance import Fleet, Journal

        if self._fleet is None:
            journal = Journal(self.state_dir / JOURNAL_FILE)
            self._fleet = Fleet(self.compute, self.config, self.spec.name, journal)
        return self._fleet

    @property
    def zone_failures(self) -> tuple[ZoneFailure, ...]:
        """Why zones before the one that took the VMs refused them (in the last ``up``)."""
        return self._fleet.failures if self._fleet else ()

    def notes(self) -> list[str]:
        return [f"zone {f.zone} refused the VMs ({f.code}): {f.message}"
                for f in self.zone_failures]

    @property
    def vm_names(self) -> list[str]:
        """One VM per task, the chief's first."""
        return [names.instance_name(self.spec.name, i) for i in range(self.spec.num_tasks)]

    # -- up --------------------------------------------------------------------------------
    def up(self) -> list[Host]:
        """Provision the VMs, reach each over SSH, sync the code and run setup; idempotent."""
        vms = self.provision()
        hosts = self._attach(vms, time.monotonic() + self.config.boot_timeout_s)
        fan_out(hosts, self.prepare, name_of=lambda h: h.name).raise_if_failed("prepare hosts")
        return hosts

    def provision(self) -> list[Vm]:
        """The cloud half of ``up``: key pair, firewall rule, and every VM RUNNING (no SSH)."""
        keys = self._keys()
        self.fleet.settle()  # creates an interrupted command left in flight land first
        self.fleet.ensure_firewall(self.spec.ports)
        deadline = time.monotonic() + self.config.boot_timeout_s
        vms = self.fleet.converge(self.vm_names, self._ssh_keys(keys), deadline)
        self.fleet.refresh_keys(vms, keys.public_line, self._ssh_keys(keys))
        return vms

    def _keys(self) -> KeyPair:
        return ensure_key_pair(self.state_dir / SSH_DIR)

    def _ssh_keys(self, keys: KeyPair) -> str:
        return names.ssh_keys_value(self.config.ssh_user, keys.public_line, self.spec.name)

    # -- reaching the VMs ------------------------------------------------------------------
    def _attach(self, vms: Sequence[Vm], deadline: float) -> list[Host]:
        found = fan_out(vms, lambda vm: self._reach(vm, deadline), name_of=lambda vm: vm.name)
        found.raise_if_failed("reach the VMs")
        hosts = [r.value for r in found.succeeded if r.value is not None]
        self._save_state()
        return hosts

    def _reach(self, vm: Vm, deadline: float) -> Host:
        """The VM as a Host: host keys from guest attributes, SSH answering, root resolved."""
        host = self._host(vm, self._wait_for_host_keys(vm, deadline), root="")
        assert host.ssh is not None
        runner = self._runner_for(host.name, host.ssh)
        self._wait_for_ssh(runner, host, deadline)
        host = replace(host, root=self.config.root or self._home_root(runner))
        with self._lock:
            self._hosts[host.name] = host
        return host

    def _host(self, vm: Vm, host_keys: tuple[str, ...], root: str) -> Host:
        ssh_address = vm.external_ip if self.config.ssh_via == "external" else vm.internal_ip
        if not ssh_address:
            raise ProviderError(f"VM {vm.name} has no {self.config.ssh_via} IP address",
                                fix="set provider.external_ip: true for ssh_via: external")
        return Host(
            name=vm.name,
            address=vm.internal_ip,
            root=root,
            ssh=self._endpoint(ssh_address, host_keys),
            labels=(("zone", vm.zone),),
        )

    def _endpoint(self, address: str, host_keys: tuple[str, ...]) -> SSHEndpoint:
        return SSHEndpoint(
            address=address,
            user=self.config.ssh_user,
            key_file=str(self.state_dir / SSH_DIR / PRIVATE_NAME),
            host_keys=host_keys,
            connect_timeout_s=self.config.connect_timeout_s,
        )

    def _wait_for_host_keys(self, vm: Vm, deadline: float) -> tuple[str, ...]:
        wait = POLL_FIRST_S
        while not (keys := self.compute.host_keys(vm.zone, vm.name)):
            if time.monotonic() > deadline:
                raise ProviderError(
                    f"VM {vm.name} published no SSH host keys (guest attributes hostkeys/) in time",
                    fix="use an image with Google's guest environment (Deep Learning VM, Debian, "
                    "Ubuntu): it publishes them when metadata enable-guest-attributes is TRUE")
            time.sleep(wait)
            wait = min(2 * wait, POLL_MAX_S)
        return keys

    def _wait_for_ssh(self, runner: SSHRunner, host: Host, deadline: float) -> None:
        """A booting VM refuses connections, then our key, until its guest agent adds the key."""
        wait = POLL_FIRST_S
        while True:
            try:
                runner.run(["true"], timeout_s=30)
                return
            except (HostUnreachableError, AuthError) as exc:
                if time.monotonic() > deadline:
                    raise ProviderError(
                        f"VM {host.name} does not accept SSH in time: {exc.message}",
                        fix="check that a firewall rule lets this machine reach port 22 of the VMs "
                        "(or use provider.ssh_via: external), then run 'orchestrate up' again") from exc
            time.sleep(wait)
            wait = min(2 * wait, POLL_MAX_S)

    def _home_root(self, runner: SSHRunner) -> str:
        home_dir = runner.run('printf %s "$HOME"').stdout.strip()
        if not home_dir.startswith("/"):
            raise ProviderError(f"{runner.host_name}: the SSH user's home is {home_dir!r}",
                                fix="set provider.root to an absolute directory")
        return f"{home_dir}/.orchestrate/clusters/{self.spec.name}"

    # -- the Provider interface ------------------------------------------------------------
    def hosts(self) -> list[Host]:
        """The VMs as the last ``up`` (here or in another process) saw them; before any ``up``,
        the planned ones (named, not yet reachable), so that ``plan`` needs no cloud access."""
        with self._lock:
            if not self._hosts:
                self._load_state()
            return [self._hosts.get(name) or self._planned(name) for name in self.vm_names]

    def _planned(self, name: str) -> Host:
        zone = self.config.zones[0]
        dns = f"{name}.{zone}.c.{self.config.project}.internal"
        root = self.config.root or f"/home/{self.config.ssh_user}/.orchestrate/clusters/{self.spec.name}"
        return Host(name=name, address=dns, root=root, ssh=self._endpoint(dns, ()),
                    labels=(("zone", zone),))

    def runner(self, host: Host) -> SSHRunner:
        """One runner per VM, always to the VM as it is now (a repaired VM may have moved)."""
        with self._lock:
            current = self._hosts.get(host.name, host)
            assert current.ssh is not None
            return self._runner_for(host.name, current.ssh)

    def _runner_for(self, name: str, endpoint: SSHEndpoint) -> SSHRunner:
        """The runner of VM ``name``, replaced when the VM's address or host key changed."""
        with self._lock:
            runner = self._runners.get(name)
            if runner is None or runner.endpoint != endpoint:
                if runner is not None:
                    runner.close()
                runner = SSHRunner(name, endpoint, connect_deadline_s=3 * self.config.connect_timeout_s)
                self._runners[name] = runner
            return runner

    def _drop_runner(self, name: str) -> None:
        with self._lock:
            runner = self._runners.pop(name, None)
        if runner is not None:
            runner.close()

    def host_health(self, host: Host) -> HostHealth:
        """From the API: gone, preempted (a stopped spot VM), booting; if running, over SSH."""
        try:
            vm = self._look_up(host)
        except ProviderError:
            return HostHealth.UNREACHABLE
        if vm is None:
            return HostHealth.GONE
        if vm.status in LOST:
            return HostHealth.PREEMPTED if vm.spot else HostHealth.GONE
        if vm.status != "RUNNING":
            return HostHealth.UNREACHABLE
        return super().host_health(host)

    def _look_up(self, host: Host) -> Vm | None:
        zone = dict(host.labels).get("zone")
        vm = self.compute.get_vm(zone, host.name) if zone else None
        return vm or self.fleet.find().get(host.name)

    def repair(self, host: Host, deadline_s: float) -> Host:
        """Start the stopped VM (or re-create it under the same name, in any zone of the spec),
        wait for it to run and answer SSH with the host key it publishes, and prepare it again.

        Raises:
            ProviderError: it is not back within ``deadline_s``, or no zone has room for it.
        """
        deadline = time.monotonic() + deadline_s
        self._drop_runner(host.name)  # its connection died with the VM
        keys = self._keys()
        vm = self.fleet.converge([host.name], self._ssh_keys(keys), deadline)[0]
        self.fleet.refresh_keys([vm], keys.public_line, self._ssh_keys(keys))
        repaired = self._reach(vm, deadline)
        self._save_state()
        self.prepare(repaired)
        return repaired

    def down(self) -> DownReport:
        """Delete every VM labelled for the cluster (found in the live API, whatever the local
        state says) and the firewall rule; then forget the cluster's key pair and state."""
        vms = self.fleet.teardown()
        removed = [f"VM {vm.zone}/{vm.name}" for vm in vms]
        notes = []
        rule = names.firewall_name(self.spec.name)
        firewall = self.fleet.delete_firewall()
        if firewall == "deleted":
            removed.append(f"firewall rule {rule}")
        elif firewall == "foreign":
            notes.append(f"firewall rule {rule} is not this cluster's: left alone")
        self.close()
        self._forget()
        return DownReport(removed=tuple(removed), notes=tuple(notes))

    def close(self) -> None:
        with self._lock:
            for runner in self._runners.values():
                runner.close()
            self._runners.clear()
        if self._compute is not None:
            self._compute.close()
            self._compute = None
            self._fleet = None

    # -- local state -----------------------------------------------------------------------
    def _save_state(self) -> None:
        with self._lock:
            hosts = [self._hosts[n] for n in self.vm_names if n in self._hosts]
        records = [{"name": h.name, "address": h.address, "root": h.root,
                    "zone": dict(h.labels).get("zone", ""),
                    "ssh_address": h.ssh.address if h.ssh else "",
                    "host_keys": list(h.ssh.host_keys) if h.ssh else []} for h in hosts]
        failures = [{"zone": f.zone, "code": f.code, "message": f.message} for f in self.zone_failures]
        _write_json(self.state_dir / STATE_FILE, {"hosts": records, "zone_failures": failures})

    def _load_state(self) -> None:
        try:
            data = json.loads((self.state_dir / STATE_FILE).read_text())
        except (FileNotFoundError, ValueError):
            return
        for r in data.get("hosts", []):
            self._hosts[r["name"]] = Host(
                name=r["name"], address=r["address"], root=r["root"],
                ssh=self._endpoint(r["ssh_address"], tuple(r["host_keys"])),
                labels=(("zone", r["zone"]),))

    def _forget(self) -> None:
        with self._lock:
            self._hosts.clear()
        for name in (STATE_FILE, JOURNAL_FILE):
            (self.state_dir / name).unlink(missing_ok=True)
        remove_key_pair(self.state_dir / SSH_DIR)


def _write_json(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)
