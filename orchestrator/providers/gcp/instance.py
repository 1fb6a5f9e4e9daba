"""A cluster's VMs: found by label, bulk-created with zone fall-through, restarted, awaited, deleted."""

from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from orchestrator.errors import ProviderError
from orchestrator.files import write_atomic
from orchestrator.providers.gcp import config as gce
from orchestrator.providers.gcp import names
from orchestrator.providers.gcp.compute import (
    Compute,
    ComputeError,
    OpError,
    OpRef,
    Vm,
    compute_v1,
    errors_of,
)
from orchestrator.remote.fanout import fan_out
from orchestrator.spec import GcpProvider, PortRange

STOCKOUT_CODES = frozenset({
    "ZONE_RESOURCE_POOL_EXHAUSTED", "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS",
    "REGION_RESOURCE_POOL_EXHAUSTED", "RESOURCE_POOL_EXHAUSTED", "GPU_STOCKOUT",
    "insufficientCapacity",  # HTTP 503 at the request
    "UNSUPPORTED_OPERATION",  # seen when a spot VM is preempted while being created
})
QUOTA_CODES = frozenset({"QUOTA_EXCEEDED", "quotaExceeded"})
# A bulkInsert that could not make min_count VMs says so first; the reason follows, or is only
# in the per-VM insert operations of its operation group.
SUMMARY_CODES = frozenset({"VM_MIN_COUNT_NOT_REACHED"})
RESTARTABLE = frozenset({"TERMINATED", "STOPPED"})  # started with instances.start
SUSPENDED = "SUSPENDED"  # started with instances.resume
QUOTA_NAME = re.compile(r"Quota '([^']+)' exceeded.*? in region ([a-z0-9-]+)")
GLOBAL_QUOTA = re.compile(r"Quota '([^']+)' exceeded.*? globally")
POLL_FIRST_S = 0.25
POLL_MAX_S = 5.0


@dataclass(frozen=True)
class ZoneFailure:
    """Why one zone could not take the VMs."""

    zone: str
    code: str
    message: str

    @property
    def is_quota(self) -> bool:
        return self.code in QUOTA_CODES

    @property
    def is_global(self) -> bool:
        """A project-wide quota (GPUS_ALL_REGIONS): no other zone or region can help."""
        return self.is_quota and GLOBAL_QUOTA.search(self.message) is not None


class CapacityError(ProviderError):
    """No zone of the spec could create the VMs; ``failures`` says why, zone by zone."""

    def __init__(self, message: str, failures: tuple[ZoneFailure, ...], *, fix: str) -> None:
        super().__init__(message, fix=fix)
        self.failures = failures


class Journal:
    """Operations in flight, on disk: a ``down`` after an interrupted ``up`` waits for them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()

    def pending(self) -> list[OpRef]:
        try:
            return [OpRef(**entry) for entry in json.loads(self.path.read_text())]
        except (FileNotFoundError, ValueError, TypeError):
            return []

    def add(self, ref: OpRef) -> None:
        with self._lock:
            self._write([*self.pending(), ref])

    def done(self, ref: OpRef) -> None:
        with self._lock:
            self._write([r for r in self.pending() if r != ref])

    def _write(self, refs: list[OpRef]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self.path, json.dumps([asdict(r) for r in refs]))


class Fleet:
    """The VMs of one cluster.

    Args:
        compute: the API.
        config: the spec's provider section.
        cluster: the cluster's name (the label value and the VM name prefix).
        journal: where operations in flight are recorded.
        pause: the wait between polls of VMs that are still booting (real time).
    """

    def __init__(self, compute: Compute, config: GcpProvider, cluster: str, journal: Journal, *,
                 pause: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.compute = compute
        self.config = config
        self.cluster = cluster
        self.journal = journal
        self.pause = pause
        self.clock = clock
        self.failures: tuple[ZoneFailure, ...] = ()  # zones that refused the last create

    def find(self) -> dict[str, Vm]:
        """The cluster's VM of each name (label, any zone). Names are unique per zone only: of
        copies in several zones (a create that landed after an interrupted ``up`` moved on),
        the one kept is a running one in the zone that holds most of the cluster."""
        return self._listed()[0]

    def _listed(self) -> tuple[dict[str, Vm], list[Vm]]:
        """(the VM kept of each name, the other copies), from one listing."""
        vms = self.compute.list_vms(names.CLUSTER_LABEL, self.cluster)
        zones = Counter(vm.zone for vm in vms)
        ranked = sorted(vms, key=lambda vm: (vm.status != "RUNNING", -zones[vm.zone], vm.zone))
        kept: dict[str, Vm] = {}
        extra: list[Vm] = []
        for vm in ranked:
            if vm.name in kept:
                extra.append(vm)
            else:
                kept[vm.name] = vm
        return dict(sorted(kept.items())), extra

    def converge(self, wanted: Sequence[str], ssh_keys: str, deadline: float) -> list[Vm]:
        """Make every VM of ``wanted`` RUNNING: create the missing ones, start the stopped ones.

        Raises:
            CapacityError: no zone could create the missing VMs.
            ProviderError: they do not all run by ``deadline`` (of ``clock``), or the API refused.
        """
        wait = POLL_FIRST_S
        while True:
            found, copies = self._listed()
            if copies:  # a second VM of a name: ours (labelled), and in the way of the first
                self.delete(copies)
                continue
            missing = [n for n in wanted if n not in found]
            stopped = [found[n] for n in wanted
                       if n in found and found[n].status in (*RESTARTABLE, SUSPENDED)]
            if missing:
                self.create(missing, ssh_keys, prefer=[vm.zone for vm in found.values()])
            if stopped:
                self.start(stopped)
            if not missing and not stopped:
                if all(found[n].status == "RUNNING" for n in wanted):
                    return [found[n] for n in wanted]
                self._check_deadline(deadline, [found[n] for n in wanted])
                self.pause(wait)
                wait = min(2 * wait, POLL_MAX_S)

    def create(self, vm_names: list[str], ssh_keys: str, prefer: Iterable[str] = ()) -> str:
        """Create ``vm_names`` in one bulkInsert, in the first zone (``prefer`` first) that can.

        Returns:
            The zone that took them; ``self.failures`` holds why the zones before it did not.
        """
        zones = self.config.zones
        order = list(dict.fromkeys([z for z in prefer if z in zones] + list(zones)))
        failures: list[ZoneFailure] = []
        for zone in order:
            failure = self._create_in(zone, vm_names, ssh_keys)
            if failure is None:
                self.failures = tuple(failures)
                return zone
            failures.append(failure)
            if failure.is_global:
                break
        self.failures = tuple(failures)
        raise _capacity_error(self.config, len(vm_names), tuple(failures))

    def _create_in(self, zone: str, vm_names: list[str], ssh_keys: str) -> ZoneFailure | None:
        properties = gce.instance_properties(self.config, self.cluster, zone, ssh_keys)
        try:
            ref = self.compute.bulk_insert(zone, gce.bulk_request(properties, vm_names))
        except ComputeError as exc:
            if exc.quota:
                return ZoneFailure(zone, "QUOTA_EXCEEDED", exc.api_message)
            if exc.capacity:
                return ZoneFailure(zone, "insufficientCapacity", exc.api_message)
            raise
        op = self.wait_operation(ref, f"create {len(vm_names)} VM(s) in {zone}")
        errors = errors_of(op) if op is not None else ()
        if not errors:
            return None
        reasons = [e for e in errors if e.code not in SUMMARY_CODES]
        if not reasons:  # only the summary: the reason is in the per-VM insert operations
            assert op is not None
            reasons = list(self.compute.failed_inserts(zone, op.operation_group_id))
        codes = {e.code for e in (*errors, *reasons)}
        if codes & (STOCKOUT_CODES | QUOTA_CODES) or codes <= SUMMARY_CODES:
            shown = next((e for e in reasons if e.code in QUOTA_CODES), None) or next(
                (e for e in reasons if e.code in STOCKOUT_CODES), None) or (reasons or errors)[0]
            return ZoneFailure(zone, shown.code, shown.message)
        raise ProviderError(
            f"creating VM(s) {', '.join(vm_names)} in {zone} failed: {_describe(tuple(reasons))}",
            fix="fix the provider setting the message names and run 'orchestrate up' again",
        )

    def start(self, vms: Sequence[Vm]) -> None:
        """Start stopped (e.g. preempted) VMs, resume suspended ones; one whose zone has no
        capacity now is deleted, so that the next round re-creates it under the same name
        wherever there is room."""
        refs = [(vm, self.compute.resume(vm.zone, vm.name) if vm.status == SUSPENDED
                 else self.compute.start(vm.zone, vm.name)) for vm in vms]
        for vm, ref in refs:
            errors = self.wait(ref, f"start VM {vm.name}")
            if {e.code for e in errors} & STOCKOUT_CODES:
                self.delete([vm])
            elif {e.code for e in errors} & QUOTA_CODES:  # another zone's VM needs it too
                named = QUOTA_NAME.search(next(e for e in errors if e.code in QUOTA_CODES).message)
                quota = f"{named[1]} quota in region {named[2]}" if named else "quota"
                raise ProviderError(
                    f"starting VM {vm.name} failed: {_describe(errors)}",
                    fix=f"request more {quota} (console: IAM & Admin > Quotas), or stop other "
                    "VMs of the region")
            elif errors:
                raise ProviderError(f"starting VM {vm.name} failed: {_describe(errors)}",
                                    fix="look at the VM in the console, or delete it and run "
                                    "'orchestrate up' to re-create it")

    def delete(self, vms: Sequence[Vm]) -> None:
        """Delete ``vms``: every request first, then the waits. A VM already gone is fine."""
        started = fan_out(vms, self._request_delete, name_of=lambda vm: vm.name)
        started.raise_if_failed("delete VMs")
        for result in started.succeeded:
            errors = self.wait(result.value, f"delete VM {result.name}") if result.value else ()
            if errors:
                raise ProviderError(f"deleting VM {result.name} failed: {_describe(errors)}",
                                    fix="run 'orchestrate down' again, or delete it in the console")

    def _request_delete(self, vm: Vm) -> OpRef | None:
        try:
            return self.compute.delete(vm.zone, vm.name)
        except ComputeError as exc:
            if exc.status == 404:
                return None
            raise

    def teardown(self) -> list[Vm]:
        """Wait for operations an interrupted ``up`` left, then delete every labelled VM."""
        self.settle()
        removed: list[Vm] = []
        for _ in range(3):  # a create that was in flight may land after the first listing
            found = self.compute.list_vms(names.CLUSTER_LABEL, self.cluster)  # copies too
            if not found:
                break
            self.delete(found)
            removed += found
        return removed

    def refresh_keys(self, vms: Sequence[Vm], public_line: str, ssh_keys: str) -> None:
        """VMs made with another key (the local key pair was lost) get the current one."""
        for vm in vms:
            if public_line not in vm.ssh_keys:
                items = gce.metadata_items(self.config, ssh_keys)
                self.wait_ok(self.compute.set_metadata(vm, items), f"set the SSH key of {vm.name}")

    def ensure_firewall(self, ports: PortRange) -> None:
        """One rule for the gRPC port range, from and to the cluster's network tag only."""
        rule = gce.firewall_rule(self.config, self.cluster, ports)
        found = self.compute.get_firewall(rule.name)
        if found is not None and found.description != rule.description:
            raise ProviderError(
                f"firewall rule {rule.name} exists in project {self.config.project} and is not "
                f"this cluster's (its description: {found.description!r})",
                fix="delete or rename that rule, or give the cluster another name")
        if found is not None and list(found.allowed) == list(rule.allowed):
            return
        if found is not None:  # the spec's port range changed since the rule was made
            self.wait_ok(self.compute.delete_firewall(rule.name), f"replace {rule.name}")
        self.wait_ok(self.compute.insert_firewall(rule), f"create firewall rule {rule.name}")

    def delete_firewall(self) -> Literal["deleted", "absent", "foreign"]:
        """Delete the cluster's rule; a rule of that name that is not ours is left alone."""
        name = names.firewall_name(self.cluster)
        rule = self.compute.get_firewall(name)
        if rule is None:
            return "absent"
        if rule.description != names.firewall_description(self.cluster):
            return "foreign"
        self.wait_ok(self.compute.delete_firewall(name), f"delete firewall rule {name}")
        return "deleted"

    def settle(self) -> None:
        for ref in self.journal.pending():
            self.wait(ref, f"operation {ref.name} of an earlier command")

    def wait(self, ref: OpRef, what: str) -> tuple[OpError, ...]:
        """Wait for an operation, recorded in the journal while it runs; its errors."""
        op = self.wait_operation(ref, what)
        return errors_of(op) if op is not None else ()

    def wait_operation(self, ref: OpRef, what: str) -> compute_v1.Operation | None:
        """The operation once DONE (None: gone), recorded in the journal while it runs."""
        self.journal.add(ref)
        op = self.compute.wait_operation(ref, what)
        self.journal.done(ref)
        return op

    def wait_ok(self, ref: OpRef, what: str) -> None:
        errors = self.wait(ref, what)
        if errors:
            raise ProviderError(f"{what} failed: {_describe(errors)}",
                                fix="fix what the message names and run the command again")

    def _check_deadline(self, deadline: float, vms: list[Vm]) -> None:
        if self.clock() < deadline:
            return
        states = ", ".join(f"{vm.name}: {vm.status}" for vm in vms if vm.status != "RUNNING")
        raise ProviderError(
            f"VMs of {self.cluster} are not running in time ({states})",
            fix="look at them in the console (serial port output); raise provider.boot_timeout_s "
            "(for up) or timeouts.repair_s (for recovery during train)",
        )


def _describe(errors: tuple[OpError, ...]) -> str:
    return "; ".join(f"{e.code}: {e.message}" for e in errors)


def _capacity_error(config: GcpProvider, count: int, failures: tuple[ZoneFailure, ...]) -> CapacityError:
    what = config.machine_type + (f" with {config.accelerator.count} x {config.accelerator.type}"
                                  if config.accelerator else "")
    lines = "\n".join(f"  {f.zone}: {f.code}: {f.message}" for f in failures)
    quotas = [f for f in failures if f.is_quota]
    global_quota = next((f for f in failures if f.is_global), None)
    if global_quota is not None:
        named = GLOBAL_QUOTA.search(global_quota.message)
        metric = named[1] if named else "GPUS_ALL_REGIONS"
        fix = (f"request more of the global {metric} quota of project {config.project} (it "
               "counts GPUs in all regions together; new projects have 0, so no zone or region "
               "can help): console IAM & Admin > Quotas, filter 'GPUs (all regions)', edit, ask "
               f"for the GPUs the cluster needs; 'gcloud compute project-info describe --project "
               f"{config.project}' shows the limit")
    elif quotas:
        named = QUOTA_NAME.search(quotas[0].message)
        quota = f"{named[1]} quota in region {named[2]}" if named else "quota"
        fix = (f"request more {quota} (console: IAM & Admin > Quotas), or add zones of other "
               "regions to provider.zones")
    else:
        fix = ("add more zones to provider.zones, try again later, or choose another "
               "provider.machine_type")
    return CapacityError(f"no zone could create {count} VM(s) of {what}:\n{lines}", failures,
                         fix=fix)
