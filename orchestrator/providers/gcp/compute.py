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
MAX_TRIES = 8
RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})
RATE_REASONS = frozenset({"rateLimitExceeded", "userRateLimitExceeded"})
QUOTA_REASONS = frozenset({"quotaExceeded", "QUOTA_EXCEEDED"})
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
                 api_message: str, fix: str | None = None) -> None:
        super().__init__(message, fix=fix)
        self.status = status
        self.reasons = reasons
        self.api_message = api_message

    @property
    def quota(self) -> bool:
        return bool(QUOTA_REASONS & set(self.reasons))


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
    def call(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()``, retried on 429, 5xx and lost connections with exponential backoff.

        Raises:
            ComputeError: a non-retryable answer, or retries spent; says what to do.
        """
        retrying = Retrying(
            retry=retry_if_exception(_transient),
            wait=wait_exponential_jitter(initial=1.0, max=30.0),
            stop=stop_after_delay(self.deadline_s) | stop_after_attempt(MAX_TRIES),
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
            ) from None

    def list_vms(self, label: str, value: str) -> list[Vm]:
        """Every VM in the project labelled ``label=value``, in any zone, by name."""
        request = compute_v1.AggregatedListInstancesRequest(
            project=self.project, filter=f"labels.{label} = {value}")
        pairs = self.call(f"list the VMs labelled {label}={value}",
                          lambda: list(self.instances.aggregated_list(request=request, retry=None)))
        return sorted((_vm(i) for _, scoped in pairs for i in scoped.instances), key=lambda v: v.name)

    def get_vm(self, zone: str, name: str) -> Vm | None:
        try:
            found = self.call(f"look up VM {name}", lambda: self.instances.get(
                project=self.project, zone=zone, instance=name, retry=None))
        except ComputeError as exc:
            if exc.status == 404:
                return None
            raise
        return _vm(found)

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
        try:
            found = self.call(f"read the host keys of VM {name}", lambda: self.instances.get_guest_attributes(
                request=request, retry=None))
        except ComputeError as exc:
            if exc.status == 404:
                return ()
            raise
        return tuple(_key_line(e.key, e.value) for e in found.query_value.items
                     if e.namespace == "hostkeys" and e.value)

    def get_firewall(self, name: str) -> compute_v1.Firewall | None:
        try:
            return self.call(f"look up firewall rule {name}", lambda: self.firewalls.get(
                project=self.project, firewall=name, retry=None))
        except ComputeError as exc:
            if exc.status == 404:
                return None
            raise

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

    # -- operations ----------------------------------------------------------------------
    def wait(self, ref: OpRef, what: str) -> tuple[OpError, ...]:
        """Wait until the operation is DONE; its errors (none: it succeeded; gone: none).

        Raises:
            ProviderError: it is not done within the deadline.
        """
        deadline = time.monotonic() + self.deadline_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ProviderError(
                    f"{what}: operation {ref.name} is not done after {self.deadline_s:.0f}s",
                    fix="look at it in the console (Compute Engine > Operations) and run the "
                    "command again; raise provider.api_timeout_s if the API is slow")
            try:
                op = self.call(f"wait for: {what}",
                               functools.partial(self._wait_once, ref, min(left, WAIT_CALL_S)))
            except ComputeError as exc:
                if exc.status == 404:
                    return ()
                raise
            if op.status == compute_v1.Operation.Status.DONE:
                return tuple(OpError(e.code, e.message) for e in op.error.errors)

    def _wait_once(self, ref: OpRef, timeout: float) -> compute_v1.Operation:
        if ref.scope == "global":
            return self.global_operations.wait(project=self.project, operation=ref.name,
                                               timeout=timeout, retry=None)
        return self.zone_operations.wait(project=self.project, zone=ref.scope.split("/", 1)[1],
                                         operation=ref.name, timeout=timeout, retry=None)

    def _started(self, what: str, fn: Callable[[], compute_v1.Operation]) -> OpRef:
        op = self.call(what, fn)
        return OpRef(f"zones/{_last(op.zone)}" if op.zone else "global", op.name)


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
    return exc.code in RETRYABLE_STATUS or bool(RATE_REASONS & set(_reasons(exc)))


def _reasons(exc: api_errors.GoogleAPICallError) -> tuple[str, ...]:
    return tuple(str(e.get("reason", "")) for e in exc.errors if isinstance(e, dict))


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
        internal_ip=nic.network_i_p if nic else "",
        external_ip=external,
        spot=scheduling.provisioning_model == "SPOT" or bool(scheduling.preemptible),
        ssh_keys=metadata.get("ssh-keys", ""),
        metadata_fingerprint=instance.metadata.fingerprint,
    )


def _key_line(kind: str, value: str) -> str:
    """Guests publish ``hostkeys/ssh-ed25519`` = the key's base64 (some: the whole line)."""
    value = value.strip()
    return value if value.startswith(kind + " ") else f"{kind} {value}"


def _last(link: str) -> str:
    return link.rstrip("/").rsplit("/", 1)[-1]
