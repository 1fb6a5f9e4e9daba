"""The `gcp` provider: Compute Engine VMs reached with a per-cluster key, repaired after preemption.

What every SSH-reached provider does (runners, waiting for SSH, roots, the host cache, the key
pair, preparing hosts) is ``SSHHostsProvider``'s; this module provisions, reads host keys from
guest attributes, asks the API about health, repairs and deletes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator import paths
from orchestrator import spec as specs
from orchestrator.errors import ProviderError
from orchestrator.hosts import Host, SSHEndpoint
from orchestrator.problems import Problem
from orchestrator.providers.base import CloudCheck, DownReport, HostHealth
from orchestrator.providers.gcp import names
from orchestrator.providers.keys import KeyPair
from orchestrator.providers.ssh_hosts import POLL_FIRST_S, POLL_MAX_S, SSHHostsProvider
from orchestrator.remote.fanout import fan_out
from orchestrator.spec import ClusterSpec

if TYPE_CHECKING:  # google-cloud-compute loads in seconds: only commands that call the API pay
    from orchestrator.providers.gcp.compute import Compute, Vm
    from orchestrator.providers.gcp.instance import Fleet, ZoneFailure

LOST = ("STOPPING", "TERMINATED", "STOPPED", "SUSPENDING", "SUSPENDED")


class GcpProvider(SSHHostsProvider):
    """See the module docstring.

    Args:
        spec: a spec whose provider is ``gcp``.
        spec_path: where it was read from (``workdir`` is relative to it).
        compute: the API (default: Application Default Credentials, or $ORCHESTRATE_GCE_ENDPOINT).
        sleep: the backoff sleep between API retries.
    """

    kind = "gcp"
    reclaims_hosts = True  # spot VMs
    config: specs.GcpProvider
    host_noun = "VM"
    ssh_fix = ("check that a firewall rule lets this machine reach port 22 of the VMs "
               "(or use provider.ssh_via: external), then run 'orchestrate up' again")
    auth_fix = ("the VM answers SSH but ignores the cluster's key in its ssh-keys metadata: OS "
                "Login is on and forced, most likely by the organization policy "
                "constraints/compute.requireOsLogin, which overrides the VMs' enable-oslogin=FALSE. "
                "Ask an organization admin to exempt this project from that policy (or use a "
                "project without it), then run 'orchestrate up' again; 'gcloud compute "
                "project-info describe' shows the project's own enable-oslogin")
    auth_patience_s = 60.0  # the guest agent installs ssh-keys seconds after sshd starts

    def __init__(self, spec: ClusterSpec, spec_path: Path, *, compute: Compute | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        super().__init__(spec, spec_path)
        assert isinstance(spec.provider, specs.GcpProvider)
        self.config = spec.provider
        self._compute = compute
        self._sleep = sleep
        self._fleet: Fleet | None = None

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
            journal = Journal(paths.operations_journal(self.spec.name, self.kind))
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

    @property
    def spare_names(self) -> list[str]:
        """The VMs an elastic group may grow onto (``elastic.max_workers``): created by the
        grow check once a zone has room, never by ``up``."""
        return [names.instance_name(self.spec.name, i) for i in self.spec.spare_indices]

    def describe(self) -> dict[str, Any]:
        """The VMs ``up`` creates (or finds), their shape, and the cluster's firewall rule."""
        config = self.config
        spares = {"spare_vms": self.spare_names} if self.spare_names else {}
        return {"vms": self.vm_names, **spares, "machine_type": config.machine_type,
                "accelerator": config.accelerator.model_dump() if config.accelerator else None,
                "zones": list(config.zones), "spot": config.spot, "image": config.image,
                "disk_size_gb": config.disk_size_gb,
                "firewall_rule": names.firewall_name(self.spec.name)}

    # -- up --------------------------------------------------------------------------------
    def up(self) -> list[Host]:
        """Check what will be uploaded, provision the VMs, reach each over SSH, sync the code
        and run setup; idempotent. A workdir that cannot be uploaded is refused before any VM
        is made."""
        self.upload()
        vms = self.provision()
        hosts = self._attach(vms, time.monotonic() + self.config.boot_timeout_s)
        self.prepare_all(hosts)
        self.remember_claims(hosts)
        return hosts

    def provision(self) -> list[Vm]:
        """The cloud half of ``up``: key pair, firewall rule, and every VM RUNNING (no SSH)."""
        keys = self.key_pair()
        self.fleet.settle()  # creates an interrupted command left in flight land first
        self.fleet.ensure_firewall(self.spec.ports)
        deadline = time.monotonic() + self.config.boot_timeout_s
        vms = self.fleet.converge(self.vm_names, self._ssh_keys(keys), deadline)
        self.fleet.refresh_keys(vms, keys.public_line, self._ssh_keys(keys))
        return vms

    def _ssh_keys(self, keys: KeyPair) -> str:
        return names.ssh_keys_value(self.config.ssh_user, keys.public_line, self.spec.name)

    # -- reaching the VMs ------------------------------------------------------------------
    def _attach(self, vms: Sequence[Vm], deadline: float) -> list[Host]:
        found = fan_out(vms, lambda vm: self._reach(vm, deadline), name_of=lambda vm: vm.name)
        found.raise_if_failed("reach the VMs")
        hosts = [r.value for r in found.succeeded if r.value is not None]
        self._save_hosts()
        return hosts

    def _reach(self, vm: Vm, deadline: float) -> Host:
        """The VM as a Host: its host keys, SSH answering, root resolved.

        The keys of a VM reached before under the same instance ID (a second ``up``, a stopped
        and restarted VM) are the ones recorded then: the guest agent publishes host keys only
        when the instance ID changes, so a restarted VM may publish nothing. A new instance
        (created or re-created) is waited for until it publishes its own."""
        known = self.remembered().get(vm.name)
        recorded = known.ssh.host_keys if known is not None and known.ssh is not None else ()
        same = known is not None and vm.id and dict(known.labels).get("instance_id") == vm.id
        keys = recorded if same and recorded else self._wait_for_host_keys(vm, deadline)
        host = self._host(vm, keys, root="")
        self.wait_for_ssh(host, deadline)
        host = replace(host, root=self.resolve_root(host))
        self.remember(host)
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
            labels=(("zone", vm.zone), ("instance_id", vm.id)),
        )

    def _endpoint(self, address: str, host_keys: tuple[str, ...]) -> SSHEndpoint:
        return SSHEndpoint(
            address=address,
            user=self.config.ssh_user,
            key_file=self.key_file,
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

    # -- the Provider interface ------------------------------------------------------------
    def hosts(self) -> list[Host]:
        """The VMs as the last ``up`` (here or in another process) saw them; before any ``up``,
        the planned ones (named, not yet reachable), so that ``plan`` needs no cloud access."""
        known = self.remembered()
        return [known.get(name) or self._planned(name) for name in self.vm_names]

    def spare_hosts(self) -> list[Host]:
        """The spare VMs as their repair last reached them, else as planned (not created)."""
        known = self.remembered()
        return [known.get(name) or self._planned(name) for name in self.spare_names]

    def _planned(self, name: str) -> Host:
        zone = self.config.zones[0]
        dns = f"{name}.{zone}.c.{self.config.project}.internal"
        return Host(name=name, address=dns, root=self.planned_root(f"/home/{self.config.ssh_user}"),
                    ssh=self._endpoint(dns, ()), labels=(("zone", zone),))

    def restored(self, host: Host) -> Host:
        """A cached VM keeps its address and host keys; user, key and timeout follow the spec."""
        assert host.ssh is not None
        return replace(host, ssh=self._endpoint(host.ssh.address, host.ssh.host_keys))

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

    @property
    def return_probe_s(self) -> float:  # type: ignore[override]
        """A VM re-created where a zone has room again boots before it answers."""
        return self.config.boot_timeout_s + 30.0

    def repair(self, host: Host, deadline_s: float) -> Host:
        """Start the stopped VM (or re-create it under the same name, in any zone of the spec),
        wait for it to run and answer SSH with the host key it publishes, and prepare it again.

        Raises:
            ProviderError: it is not back within ``deadline_s``, or no zone has room for it.
        """
        deadline = time.monotonic() + deadline_s
        self.drop_runner(host.name)  # its connection died with the VM
        keys = self.key_pair()
        vm = self.fleet.converge([host.name], self._ssh_keys(keys), deadline)[0]
        self.fleet.refresh_keys([vm], keys.public_line, self._ssh_keys(keys))
        repaired = self._reach(vm, deadline)
        self._save_hosts()
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
        self.forget_hosts()
        paths.operations_journal(self.spec.name, self.kind).unlink(missing_ok=True)
        self.remove_key_pair()
        return DownReport(removed=tuple(removed), notes=tuple(notes))

    def close(self) -> None:
        super().close()
        if self._compute is not None:
            self._compute.close()
            self._compute = None
            self._fleet = None

    def _save_hosts(self) -> None:
        failures = [{"zone": f.zone, "code": f.code, "message": f.message} for f in self.zone_failures]
        self.save_hosts([*self.vm_names, *self.spare_names], {"zone_failures": failures})

    def cloud_check(self) -> CloudCheck:
        """The doctor's first look, through the API only: the image, the machine type and the
        GPUs in each zone against Compute Engine's catalog, and the VMs no ``up`` has reached
        (their names are only planned: SSH to them could only fail); and the firewall rules
        that open the task ports wider than the cluster's own rule."""
        from orchestrator.providers.gcp import catalog, exposure

        check = catalog.check(self.config, lambda: self.compute, cluster=self.spec.name,
                              vm_names=self.vm_names, reached=list(self.remembered()),
                              spec_path=self.spec_path)
        if any(p.check == catalog.CHECK and p.message.startswith("cannot check")
               for p in check.problems):
            return check  # the API does not answer: that is the one problem to show
        try:
            found = exposure.problems(self.config, self.compute, self.spec.name, self.spec.ports)
        except ProviderError as exc:
            found = [Problem(exposure.CHECK, f"cannot list the firewall rules: {exc.message}",
                             exc.fix or "grant compute.firewalls.list to check them",
                             blocking=False)]
        return replace(check, problems=(*check.problems, *found))
