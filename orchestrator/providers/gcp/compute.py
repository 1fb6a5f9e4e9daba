"""Compute Engine calls: the google-cloud-compute clients, retries on 429/5xx, operation waits, fixes."""

from __future__ import annotations

import contextlib
import functools
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from tenacity import (
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential_jitter,
)

from orchestrator.errors import ProviderError

try:
    import google.auth
    import requests
    from google.api_core import exceptions as api_errors
    from google.auth import exceptions as auth_errors
    from google.auth.credentials import AnonymousCredentials, Credentials
    from google.cloud import compute_v1
except ImportError as exc:  # the CLI imports this module only for provider.kind: gcp
    raise ProviderError(
        f"the gcp provider needs google-cloud-compute, which cannot be imported ({exc})",
        fix="pip install google-cloud-compute google-auth",
    ) from None

ENDPOINT_ENV = "ORCHESTRATE_GCE_ENDPOINT"  # e.g. http://127.0.0.1:8089 for a local fake (tests)
CLOUD_SCOPE = "https://www.googleapis.com/auth/cloud-platform"
WAIT_CALL_S = 150.0  # one operations.wait call: the API answers within about two minutes
WAIT_PAUSE_FIRST_S = 0.5  # operations.wait may answer before DONE: pause before asking again
WAIT_PAUSE_MAX_S = 5.0
MAX_TRIES = 8
# The host key types the guest agent generates and paramiko verifies; another type published
# next to them (a security key, a certificate) is skipped rather than failing the connection.
HOST_KEY_TYPES = frozenset({"ssh-ed25519", "ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384",
                            "ecdsa-sha2-nistp521", "ssh-rsa"})
RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})
RATE_REASONS = frozenset({"rateLimitExceeded", "userRateLimitExceeded"})
QUOTA_REASONS = frozenset({"quotaExceeded", "QUOTA_EXCEEDED"})
CAPACITY_REASONS = frozenset({"insufficientCapacity"})  # a 503 that means: try another zone
DISABLED_REASONS = frozenset({"accessNotConfigured", "SERVICE_DISABLED"})
ADC_FIX = ("run 'gcloud auth application-default login' (or point GOOGLE_APPLICATION_CREDENTIALS "
           "at a valid service-account key file) and run the command again")
FIELD_HINTS = (  # (word in the API's message, spec field, how to list valid values)
    ("machineType", "provider.machine_type", "gcloud compute machine-types list --zones ZONE"),
    ("acceleratorType", "provider.accelerator.type",
     "gcloud compute accelerator-types list --filter=zone:ZONE"),
    ("diskType", "provider.disk_type", "gcloud compute disk-types list --zones ZONE"),
    ("sourceImage", "provider.image", "gcloud compute images list"),
    ("subnetwork", "provider.subnetwork", "gcloud compute networks subnets list"),
    ("network", "provider.network", "gcloud compute networks list"),
)
T = TypeVar("T")
ANONYMOUS: Callable[[], Credentials] = AnonymousCredentials

__all__ = ["Compute", "ComputeError", "OpError", "OpRef", "Vm", "compute_v1"]


@dataclass(frozen=True)
class Vm:
    """One instance as the API shows it."""

    name: str
    zone: str
    status: str  # PROVISIONING, STAGING, RUNNING, STOPPING, TERMINATED, ...
    id: str  # the instance ID: the same across stop and start, new when re-created
    internal_ip: str
    external_ip: str
    spot: bool
    ssh_keys: str
    metadata_fingerprint: str


@dataclass(frozen=True)
class OpError:
    """One entry of a finished operation's ``error.errors``."""

    code: str
    message: str


@dataclass(frozen=True)
class OpRef:
    """An operation to wait for: ``scope`` is ``zones/ZONE`` or ``global``."""

    scope: str
    name: str


class ComputeError(ProviderError):
    """A Compute Engine call failed; carries the HTTP status and the API's reasons."""

    def __init__(self, message: str, *, status: int | None, reasons: tuple[str, ...],
                 api_message: str, fix: str | None = None, timed_out: bool = False) -> None:
        super().__init__(message, fix=fix)
        self.status = status
        self.reasons = reasons
        self.api_message = api_message
        self.timed_out = timed_out  # no answer within the call's own timeout

    @property
    def quota(self) -> bool:
        return bool(QUOTA_REASONS & set(self.reasons))

    @property
    def capacity(self) -> bool:
        """Refused at the request for want of capacity in the zone (HTTP 503)."""
        return bool(CAPACITY_REASONS & set(self.reasons))


class Compute:
    """The clients of one project, with retries at this I/O boundary only.

    Args:
        project: the project ID.
        credentials: google-auth credentials (ADC in production).
        endpoint: the API's base URL; default: compute.googleapis.com.
        deadline_s: how long one call may retry, and one operation may run.
        sleep: the backoff sleep (tests pass a recorder).
    """

    def __init__(self, project: str, credentials: Credentials, *, endpoint: str | None = None,
                 deadline_s: float = 600.0, sleep: Callable[[float], None] = time.sleep) -> None:
        self.project = project
        self.deadline_s = deadline_s
        self.sleep = sleep
        options = {"api_endpoint": endpoint} if endpoint else None
        kwargs: dict[str, Any] = {"credentials": credentials, "client_options": options}
        self._clients = contextlib.ExitStack()
        self.instances = self._clients.enter_context(compute_v1.InstancesClient(**kwargs))
        self.zone_operations = self._clients.enter_context(compute_v1.ZoneOperationsClient(**kwargs))
        self.global_operations = self._clients.enter_context(
            compute_v1.GlobalOperationsClient(**kwargs))
        self.firewalls = self._clients.enter_context(compute_v1.FirewallsClient(**kwargs))
        self.images = self._clients.enter_context(compute_v1.ImagesClient(**kwargs))
        self.machine_types = self._clients.enter_context(compute_v1.MachineTypesClient(**kwargs))
        self.accelerator_types = self._clients.enter_context(
            compute_v1.AcceleratorTypesClient(**kwargs))

    @classmethod
    def connect(cls, project: str, *, deadline_s: float,
                sleep: Callable[[float], None] = time.sleep) -> Compute:
        """Clients with Application Default Credentials, or for $ORCHESTRATE_GCE_ENDPOINT."""
        endpoint = os.environ.get(ENDPOINT_ENV) or None
        return cls(project, _credentials(endpoint), endpoint=endpoint, deadline_s=deadline_s,
                   sleep=sleep)

    def close(self) -> None:
        """Close the clients' HTTP sessions."""
        self._clients.close()

    # -- calls ---------------------------------------------------------------------------
    def call(self, what: str, fn: Callable[[], T], *, deadline: float | None = None) -> T:
        """``fn()``, retried on 429, 5xx and lost connections with exponential backoff, for at
        most ``deadline_s`` and never past ``deadline`` (a ``time.monotonic()`` value).

        Raises:
            ComputeError: a non-retryable answer, or retries spent; says what to do.
        """
        budget = self.deadline_s if deadline is None else max(0.0, deadline - time.monotonic())
        retrying = Retrying(
            retry=retry_if_exception(_transient),
            wait=wait_exponential_jitter(initial=1.0, max=30.0),
            stop=stop_after_delay(min(self.deadline_s, budget)) | stop_after_attempt(MAX_TRIES),
            sleep=self.sleep,
            reraise=True,
        )
        try:
            return retrying(fn)
        except api_errors.GoogleAPICallError as exc:
            raise _explain(what, exc, self.project) from None
        except requests.RequestException as exc:
            raise ComputeError(
                f"{what}: cannot reach Compute Engine: {exc}", status=None, reasons=(),
                api_message=str(exc), fix="check this machine's network and try again",
                timed_out=isinstance(exc, requests.Timeout),
            ) from None
        except auth_errors.GoogleAuthError as exc:  # RefreshError, TransportError, ...
            raise ComputeError(
                f"{what}: the Google Cloud credentials do not work: {exc}", status=None,
                reasons=(), api_message=str(exc), fix=ADC_FIX) from None

    def list_vms(self, label: str, value: str) -> list[Vm]:
        """Every VM in the project labelled ``label=value``, in any zone, by name."""
        request = compute_v1.AggregatedListInstancesRequest(
            project=self.project, filter=f"labels.{label} = {value}")
        pairs = self.call(f"list the VMs labelled {label}={value}",
                          lambda: list(self.instances.aggregated_list(request=request, retry=None)))
        return sorted((_vm(i) for _, scoped in pairs for i in scoped.instances), key=lambda v: v.name)

    def get_vm(self, zone: str, name: str) -> Vm | None:
        found = self._found(f"look up VM {name}", lambda: self.instances.get(
            project=self.project, zone=zone, instance=name, retry=None))
        return None if found is None else _vm(found)

    def bulk_insert(self, zone: str, resource: compute_v1.BulkInsertInstanceResource) -> OpRef:
        request = compute_v1.BulkInsertInstanceRequest(
            project=self.project, zone=zone, bulk_insert_instance_resource_resource=resource,
            request_id=str(uuid.uuid4()))  # a retried request is not executed twice
        return self._started(f"create VMs in {zone}",
                             lambda: self.instances.bulk_insert_unary(request=request, retry=None))

    def start(self, zone: str, name: str) -> OpRef:
        request = compute_v1.StartInstanceRequest(project=self.project, zone=zone, instance=name,
                                                  request_id=str(uuid.uuid4()))
        return self._started(f"start VM {name}",
                             lambda: self.instances.start_unary(request=request, retry=None))

    def resume(self, zone: str, name: str) -> OpRef:
        """Resume a SUSPENDED VM (``start`` refuses one)."""
        request = compute_v1.ResumeInstanceRequest(project=self.project, zone=zone, instance=name,
                                                   request_id=str(uuid.uuid4()))
        return self._started(f"resume VM {name}",
                             lambda: self.instances.resume_unary(request=request, retry=None))

    def failed_inserts(self, zone: str, group: str) -> tuple[OpError, ...]:
        """The errors of the per-VM ``insert`` operations of a bulkInsert (its operation group):
        where the reason is when the bulkInsert's own error is only VM_MIN_COUNT_NOT_REACHED."""
        if not group:
            return ()
        request = compute_v1.ListZoneOperationsRequest(project=self.project, zone=zone,
                                                       filter='operationType = "insert"')
        ops = self.call(f"list the VM creations in {zone}", lambda: list(
            self.zone_operations.list(request=request, retry=None)))
        return tuple(OpError(e.code, e.message) for op in ops
                     if op.operation_group_id == group for e in op.error.errors)

    def delete(self, zone: str, name: str) -> OpRef:
        request = compute_v1.DeleteInstanceRequest(project=self.project, zone=zone, instance=name,
                                                   request_id=str(uuid.uuid4()))
        return self._started(f"delete VM {name}",
                             lambda: self.instances.delete_unary(request=request, retry=None))

    def set_metadata(self, vm: Vm, items: Sequence[compute_v1.Items]) -> OpRef:
        request = compute_v1.SetMetadataInstanceRequest(
            project=self.project, zone=vm.zone, instance=vm.name, request_id=str(uuid.uuid4()),
            metadata_resource=compute_v1.Metadata(fingerprint=vm.metadata_fingerprint,
                                                  items=list(items)))
        return self._started(f"set the metadata of VM {vm.name}",
                             lambda: self.instances.set_metadata_unary(request=request, retry=None))

    def host_keys(self, zone: str, name: str) -> tuple[str, ...]:
        """The VM's SSH host keys its guest published (``hostkeys/`` guest attributes); () if none yet."""
        request = compute_v1.GetGuestAttributesInstanceRequest(
            project=self.project, zone=zone, instance=name, query_path="hostkeys/")
        found = self._found(f"read the host keys of VM {name}",
                            lambda: self.instances.get_guest_attributes(request=request, retry=None))
        if found is None:
            return ()
        lines = (_key_line(e.key, e.value) for e in found.query_value.items
                 if e.namespace == "hostkeys" and e.key in HOST_KEY_TYPES)
        return tuple(line for line in lines if line)

    def get_firewall(self, name: str) -> compute_v1.Firewall | None:
        return self._found(f"look up firewall rule {name}", lambda: self.firewalls.get(
            project=self.project, firewall=name, retry=None))

    def list_firewalls(self) -> list[compute_v1.Firewall]:
        """Every firewall rule of the project, all pages."""
        request = compute_v1.ListFirewallsRequest(project=self.project)
        return self.call("list the firewall rules", lambda: list(
            self.firewalls.list(request=request, retry=None)))

    def insert_firewall(self, rule: compute_v1.Firewall) -> OpRef:
        request = compute_v1.InsertFirewallRequest(project=self.project, firewall_resource=rule,
                                                   request_id=str(uuid.uuid4()))
        return self._started(f"create firewall rule {rule.name}",
                             lambda: self.firewalls.insert_unary(request=request, retry=None))

    def delete_firewall(self, name: str) -> OpRef:
        request = compute_v1.DeleteFirewallRequest(project=self.project, firewall=name,
                                                   request_id=str(uuid.uuid4()))
        return self._started(f"delete firewall rule {name}",
                             lambda: self.firewalls.delete_unary(request=request, retry=None))

    # -- the catalog: what exists to build VMs from ---------------------------------------
    def image(self, project: str, name: str) -> compute_v1.Image | None:
        """The image ``projects/PROJECT/global/images/NAME``; None if there is none."""
        return self._found(f"look up image {name} of project {project}", lambda: self.images.get(
            project=project, image=name, retry=None))

    def image_from_family(self, project: str, family: str) -> compute_v1.Image | None:
        """The image a VM of ``projects/PROJECT/global/images/family/FAMILY`` boots from (the
        family's newest that is not deprecated); None if the family has none."""
        return self._found(f"look up image family {family} of project {project}",
                           lambda: self.images.get_from_family(project=project, family=family,
                                                               retry=None))

    def machine_type(self, zone: str, name: str) -> compute_v1.MachineType | None:
        """Machine type ``name`` in ``zone``; None if the zone has no such type."""
        return self._found(f"look up machine type {name} in {zone}", lambda: self.machine_types.get(
            project=self.project, zone=zone, machine_type=name, retry=None))

    def accelerator_type(self, zone: str, name: str) -> compute_v1.AcceleratorType | None:
        """Accelerator (GPU) type ``name`` in ``zone``; None if the zone has no such type."""
        return self._found(f"look up accelerator type {name} in {zone}",
                           lambda: self.accelerator_types.get(
                               project=self.project, zone=zone, accelerator_type=name, retry=None))

    def _found(self, what: str, fn: Callable[[], T]) -> T | None:
        """``call(what, fn)``, None where the API answers 404 (there is no such thing)."""
        try:
            return self.call(what, fn)
        except ComputeError as exc:
            if exc.status == 404:
                return None
            raise

    # -- operations ----------------------------------------------------------------------
    def wait(self, ref: OpRef, what: str) -> tuple[OpError, ...]:
        """Wait until the operation is DONE; its errors (none: it succeeded; gone: none).

        Raises:
            ProviderError: it is not done within the deadline.
        """
        op = self.wait_operation(ref, what)
        return () if op is None else errors_of(op)

    def wait_operation(self, ref: OpRef, what: str) -> compute_v1.Operation | None:
        """The operation once DONE; None if it is gone. ``operations.wait`` may answer before
        DONE (it is best effort): the next call comes after a pause that grows, and no call or
        retry runs past the deadline.

        Raises:
            ProviderError: it is not done within the deadline.
        """
        deadline = time.monotonic() + self.deadline_s
        pause = WAIT_PAUSE_FIRST_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ProviderError(
                    f"{what}: operation {ref.name} is not done after {self.deadline_s:.0f}s",
                    fix="look at it in the console (Compute Engine > Operations) and run the "
                    "command again; raise provider.api_timeout_s if the API is slow")
            try:
                op = self.call(f"wait for: {what}",
                               functools.partial(self._wait_once, ref, min(left, WAIT_CALL_S)),
                               deadline=deadline)
            except ComputeError as exc:
                if exc.status == 404:
                    return None
                if exc.timed_out and time.monotonic() >= deadline - 1.0:
                    continue  # the long poll used the time left: not done by the deadline
                raise
            if op.status == compute_v1.Operation.Status.DONE:
                return op
            self.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(2 * pause, WAIT_PAUSE_MAX_S)

    def _wait_once(self, ref: OpRef, timeout: float) -> compute_v1.Operation:
        if ref.scope == "global":
            return self.global_operations.wait(project=self.project, operation=ref.name,
                                               timeout=timeout, retry=None)
        return self.zone_operations.wait(project=self.project, zone=ref.scope.split("/", 1)[1],
                                         operation=ref.name, timeout=timeout, retry=None)

    def _started(self, what: str, fn: Callable[[], compute_v1.Operation]) -> OpRef:
        op = self.call(what, fn)
        return OpRef(f"zones/{_last(op.zone)}" if op.zone else "global", op.name)


def errors_of(op: compute_v1.Operation) -> tuple[OpError, ...]:
    return tuple(OpError(e.code, e.message) for e in op.error.errors)


def _credentials(endpoint: str | None) -> Credentials:
    """Anonymous for a plain-http endpoint (a local fake: never send tokens there); else ADC."""
    if endpoint and endpoint.startswith("http://"):
        return ANONYMOUS()
    try:
        credentials, _ = google.auth.default(scopes=[CLOUD_SCOPE])
    except auth_errors.DefaultCredentialsError as exc:
        raise ProviderError(
            f"no Google Cloud credentials found for the gcp provider ({exc})",
            fix="run 'gcloud auth application-default login', or set "
            "GOOGLE_APPLICATION_CREDENTIALS to a service-account key file",
        ) from None
    result: Credentials = credentials
    return result


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, (requests.ConnectionError, requests.Timeout)):
        return True
    if not isinstance(exc, api_errors.GoogleAPICallError):
        return False
    reasons = set(_reasons(exc))
    if CAPACITY_REASONS & reasons:
        return False  # the zone has no room: another zone may, the same one later may not
    return exc.code in RETRYABLE_STATUS or bool(RATE_REASONS & reasons)


def _reasons(exc: api_errors.GoogleAPICallError) -> tuple[str, ...]:
    """The ``errors[].reason`` of the answer, and the ErrorInfo reason of its details."""
    reasons = [str(e.get("reason", "")) for e in exc.errors if isinstance(e, dict)]
    if getattr(exc, "reason", None):
        reasons.append(str(exc.reason))
    for detail in getattr(exc, "details", None) or ():
        if isinstance(detail, dict) and detail.get("reason"):
            reasons.append(str(detail["reason"]))
    return tuple(r for r in reasons if r)


def _api_message(exc: api_errors.GoogleAPICallError) -> str:
    for e in exc.errors:
        if isinstance(e, dict) and e.get("message"):
            return str(e["message"])
    return str(exc.message)


def _explain(what: str, exc: api_errors.GoogleAPICallError, project: str) -> ComputeError:
    """The API's message, and the fix for what the user can change."""
    status = int(exc.code) if exc.code is not None else None
    message = _api_message(exc)
    reasons = _reasons(exc)
    return ComputeError(f"{what}: {message} (HTTP {status})", status=status, reasons=reasons,
                        api_message=message, fix=_fix(status, message, reasons, project))


def _fix(status: int | None, message: str, reasons: tuple[str, ...], project: str) -> str:
    if DISABLED_REASONS & set(reasons):
        return (f"enable the Compute Engine API in project {project}: gcloud services enable "
                f"compute.googleapis.com --project {project} (console: APIs & Services), wait a "
                "minute, and run the command again; or fix provider.project")
    if QUOTA_REASONS & set(reasons):
        return ("request more quota (console: IAM & Admin > Quotas) or add zones of other "
                "regions to provider.zones")
    if status in (401, 403):
        return (f"give the account of your Application Default Credentials the role "
                f"roles/compute.instanceAdmin.v1 (and roles/iam.serviceAccountUser for the VMs' "
                f"service account) in project {project}, or fix provider.project")
    if status in RETRYABLE_STATUS:
        return "Compute Engine kept failing: try again later, or raise provider.api_timeout_s"
    for needle, field, listing in FIELD_HINTS:
        if needle in message:
            return f"change {field} to one that exists there ({listing}), or use other provider.zones"
    if status == 404:
        return f"check provider.project ({project}) and provider.zones"
    return "check the provider settings the message names"


def _vm(instance: compute_v1.Instance) -> Vm:
    nic = instance.network_interfaces[0] if instance.network_interfaces else None
    external = next((a.nat_i_p for a in nic.access_configs if a.nat_i_p), "") if nic else ""
    metadata = {item.key: item.value for item in instance.metadata.items}
    scheduling = instance.scheduling
    return Vm(
        name=instance.name,
        zone=_last(instance.zone),
        status=instance.status,
        id=str(instance.id),
        internal_ip=nic.network_i_p if nic else "",
        external_ip=external,
        spot=scheduling.provisioning_model == "SPOT" or bool(scheduling.preemptible),
        ssh_keys=metadata.get("ssh-keys", ""),
        metadata_fingerprint=instance.metadata.fingerprint,
    )


def _key_line(kind: str, value: str) -> str:
    """``kind base64`` from a ``hostkeys/KIND`` attribute: the guest agent writes the second
    field of the key's .pub file (with its newline when the file has no comment); other guests
    write the whole line. "" when there is no key in it."""
    fields = value.split()
    if fields and fields[0] == kind:
        fields = fields[1:]
    return f"{kind} {fields[0]}" if fields else ""


def _last(link: str) -> str:
    return link.rstrip("/").rsplit("/", 1)[-1]
