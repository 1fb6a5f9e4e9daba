"""An HTTP fake of the Compute Engine REST API subset the gcp provider uses, with failure switches.

It speaks the real JSON shapes (``selfLink``, ``targetLink``, ``networkInterfaces[].networkIP``,
``accessConfigs[].natIP``, ``labels``, ``status``, ``scheduling``, errors as
``{"error": {"code", "message", "errors": [{"reason", ...}]}}``) and the real long-running
operations: every mutation returns an Operation that goes PENDING -> RUNNING -> DONE, failing
with ``error.errors[].code`` (``ZONE_RESOURCE_POOL_EXHAUSTED``, ``QUOTA_EXCEEDED``, ...), and
``operations/NAME/wait`` long-polls. Drive it with the real google-cloud-compute client::

    with FakeCompute(latency_s=0.2) as fake:
        client = compute_v1.InstancesClient(credentials=AnonymousCredentials(),
                                            client_options={"api_endpoint": fake.url})

Switches a test flips: ``fail_next(n, status)`` (429/503 bursts), ``lose_next(method)`` (the
request runs, its answer is lost: a retry with the same ``requestId`` gets the same operation),
``exhaust(zone)`` (a stockout reported as Compute Engine does: the summary code
``VM_MIN_COUNT_NOT_REACHED`` first, the reason after it or only in the per-VM ``insert``
operations of the bulkInsert's ``operationGroupId``), ``refuse_capacity(zone)`` (HTTP 503
``insufficientCapacity`` at the request), ``set_quota(region, metric, limit)`` (inside the
operation, or at the request as HTTP 403 ``quotaExceeded``), ``set_global_quota(metric, limit)``
(``GPUS_ALL_REGIONS``, "Limit: 0.0 globally"), ``os_login(enabled, enforced)`` (the guest then
ignores ``ssh-keys`` unless the instance's ``enable-oslogin`` is FALSE and no org policy forces
it), ``disable_api()`` (403 ``accessNotConfigured``), ``deny(permission)``,
``withhold(zone, machine_type)``, ``preempt(name, after_s=None)`` (STOPPING and the guest told to
shut down at once, TERMINATED once it is down or ``stop_s``, 30 s, later at the latest),
``suspend(name)`` (SUSPENDED: ``start`` refuses it, ``resume`` brings it back),
``early_waits`` (``operations.wait`` answers at once, before DONE, as the real one may),
``retire_image(image, state)`` and ``withhold_accelerator(zone, type)`` (the catalog that
``images.getFromFamily``/``images.get``, ``machineTypes.get`` and ``acceleratorTypes.get``
read; everything exists by default), and
``latency_s`` (per operation), ``boot_s`` (STAGING -> RUNNING) and ``host_key_delay_s`` (from
RUNNING to the guest publishing its host keys).

Faithful where the real API is unkind: names are unique per zone (not per project); guest
attributes are published on the first boot of an instance ID only (the guest agent publishes
host keys when the instance ID changes) and are gone while it is stopped, so a restarted VM
publishes nothing; the published value carries the key's comment and a newline, next to an
attribute of a key type clients do not know; ``perInstanceProperties[].name`` is output only.

Backing: ``FakeCompute(backing=[LabBacking(h) for h in hostlab.hosts(3)])`` gives each new
instance the next free lab host: its IP becomes the instance's internal (and external) IP,
its host key is published as the guest attributes ``hostkeys/<type>`` once the instance runs
(with ``enable-guest-attributes``), and the keys of the ``ssh-keys`` metadata are authorised on
it, as Google's guest agent does. Preemption shuts the lab host down (``LabHost.shut_down()``:
SIGTERM to its processes, SIGHUP to those of SSH logins) and kills what is left when the VM
powers off; deletion kills the lab host; a start heals it;
a lab host handed to a second instance gets a new host key and an empty home (a new disk).
Instances without backing get addresses in 10.128.0.0/16 and a generated host key.
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from hostlab import LabHost

API = "https://www.googleapis.com/compute/v1"
ROUTE = re.compile(r"^/compute/v1/projects/(?P<project>[a-z][-a-z0-9]*)/(?P<rest>.+)$")
WAIT_CAP_S = 20.0  # the real API answers a wait after at most ~2 minutes
STOPPED = ("TERMINATED", "STOPPED")  # what ``start`` starts; SUSPENDED needs ``resume``
GPU_MACHINES = {"a2-highgpu-1g": 1, "a2-highgpu-2g": 2, "a2-highgpu-4g": 4, "a2-highgpu-8g": 8,
                "a3-highgpu-8g": 8, "g2-standard-4": 1, "g2-standard-8": 1, "g2-standard-24": 2}
HTTP_UNAVAILABLE = (503, "SERVICE UNAVAILABLE")
HTTP_STATUS_OF = {"QUOTA_EXCEEDED": (403, "FORBIDDEN"), "RESOURCE_ALREADY_EXISTS": (409, "CONFLICT")}
Json = dict[str, Any]

PERMISSIONS = {
    "instances.aggregatedList": "compute.instances.list",
    "instances.bulkInsert": "compute.instances.create",
    "instances.get": "compute.instances.get",
    "instances.delete": "compute.instances.delete",
    "instances.start": "compute.instances.start",
    "instances.resume": "compute.instances.resume",
    "zoneOperations.list": "compute.zoneOperations.list",
    "instances.setMetadata": "compute.instances.setMetadata",
    "instances.getGuestAttributes": "compute.instances.getGuestAttributes",
    "zoneOperations.get": "compute.zoneOperations.get",
    "zoneOperations.wait": "compute.zoneOperations.get",
    "firewalls.list": "compute.firewalls.list",
    "firewalls.insert": "compute.firewalls.create",
    "firewalls.get": "compute.firewalls.get",
    "firewalls.delete": "compute.firewalls.delete",
    "globalOperations.get": "compute.globalOperations.get",
    "globalOperations.wait": "compute.globalOperations.get",
    "images.getFromFamily": "compute.images.getFromFamily",
    "images.get": "compute.images.get",
    "machineTypes.get": "compute.machineTypes.get",
    "acceleratorTypes.get": "compute.acceleratorTypes.get",
}


class Backing(Protocol):
    """A machine that plays a fake instance: reachable at ``address``, with an sshd."""

    address: str

    def host_key_line(self) -> str: ...

    def authorize(self, pubkey_line: str) -> None: ...

    def shut_down(self) -> None: ...

    def is_down(self) -> bool: ...

    def power_off(self) -> None: ...

    def power_on(self) -> None: ...

    def new_disk(self) -> None: ...


class LabBacking:
    """A hostlab host as the machine of a fake instance."""

    def __init__(self, host: LabHost) -> None:
        self.host = host
        self.address = host.address

    def host_key_line(self) -> str:
        return self.host.host_key_line

    def authorize(self, pubkey_line: str) -> None:
        self.host.authorize(pubkey_line)

    def shut_down(self) -> None:
        """The ACPI soft off: the guest OS shuts down (see ``LabHost.shut_down``)."""
        self.host.shut_down()

    def is_down(self) -> bool:
        return self.host.is_down()

    def power_off(self) -> None:
        self.host.kill()

    def power_on(self) -> None:
        self.host.heal()

    def new_disk(self) -> None:
        """Empty the home and give the host a new host key, as a re-created VM has."""
        for entry in Path(self.host.home).iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        self.host.rotate_host_key()


class ApiError(Exception):
    """An error answer, in the API's JSON shape."""

    def __init__(self, status: int, message: str, reason: str, domain: str = "global",
                 details: list[Json] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = {"error": {"code": status, "message": message, "errors": [
            {"message": message, "domain": domain, "reason": reason}]}}
        if details:
            self.body["error"]["details"] = details


@dataclass
class _Burst:
    remaining: int
    status: int
    method: str | None


@dataclass
class _Vm:
    project: str
    zone: str
    body: Json
    backing: Backing | None = None
    host_key: str = ""
    guest_attributes: dict[str, str] = field(default_factory=dict)
    published_for: str = ""  # the instance ID the guest agent last published host keys for


@dataclass
class _Op:
    body: Json
    scope: str  # "zones/Z" or "global"
    done: bool = False


@dataclass(frozen=True)
class _Steps:
    """What an operation does when it starts running (may fail it) and when it is done."""

    start: Callable[[], Json | None] = lambda: None
    finish: Callable[[], None] = lambda: None
    after: Callable[[], None] = lambda: None  # after DONE, e.g. the boot to RUNNING


class FakeCompute:
    """The fake server; see the module docstring. Use as a context manager, or start()/stop()."""

    def __init__(self, *, latency_s: float = 0.0, boot_s: float = 0.0,
                 backing: list[Backing] | None = None, host_key_delay_s: float = 0.0) -> None:
        self.latency_s = latency_s
        self.boot_s = boot_s
        self.calls: Counter[str] = Counter()
        self.requests: list[tuple[str, str, Json]] = []  # (method name, path, body), in order
        self._pool = list(backing or [])
        self._used: set[int] = set()
        self._busy: dict[int, str] = {}  # pool index -> instance name
        self._vms: dict[tuple[str, str, str], _Vm] = {}
        self._firewalls: dict[tuple[str, str], Json] = {}
        self._ops: dict[tuple[str, str, str], _Op] = {}
        self._bursts: list[_Burst] = []
        self._lost: list[str] = []  # methods whose next answer is lost after the request ran
        self._request_ids: dict[str, tuple[str, str, str]] = {}  # requestId -> op key
        self._exhausted: dict[str, bool] = {}  # zone -> the reason only in the per-VM operations
        self._refused: set[str] = set()
        self._quota: dict[str, tuple[str, int, bool]] = {}
        self._global_quota: dict[str, int] = {}
        self._os_login = (False, False)  # (on for the project, forced by an org policy)
        self._api_disabled = False
        self.host_key_delay_s = host_key_delay_s
        # A preempted guest's time to shut down before Compute Engine forces it off: the 30 s
        # between ACPI G2 soft off and G3 mechanical off of a spot VM (scheduling.
        # skipGuestOsShutdown false); and how long a guest whose processes have all ended
        # takes to power itself off (an unbacked VM's guest is done at once).
        self.stop_s = 30.0
        self.halt_s = 0.2
        self.early_waits = False
        self._denied: set[str] = set()
        self._withheld: set[tuple[str, str]] = set()
        self._retired: dict[str, tuple[str | None, str]] = {}  # image or family -> (state, replacement)
        self._no_accelerators: set[tuple[str, str]] = set()  # (zone, accelerator type)
        self._ips = itertools.count(2)
        self._cv = threading.Condition()
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []
        self._server: ThreadingHTTPServer | None = None

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> FakeCompute:
        handler = type("Handler", (_Handler,), {"fake": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        thread = threading.Thread(target=self._server.serve_forever, name="fake-compute",
                                  daemon=True)
        thread.start()
        self._threads.append(thread)
        return self

    def stop(self) -> None:
        """Stop serving and end every operation thread."""
        self._closed.set()
        with self._cv:
            self._cv.notify_all()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        for thread in self._threads:
            thread.join(timeout=10)

    def __enter__(self) -> FakeCompute:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        assert self._server is not None, "start() the fake first"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    # -- switches ------------------------------------------------------------------------
    def fail_next(self, count: int, status: int = 429, method: str | None = None) -> None:
        """Answer the next ``count`` requests (of ``method``, e.g. 'instances.bulkInsert') with ``status``."""
        with self._cv:
            self._bursts.append(_Burst(count, status, method))

    def lose_next(self, method: str) -> None:
        """The next ``method`` request runs, but its answer is a 503 (lost on the way back)."""
        with self._cv:
            self._lost.append(method)

    def exhaust(self, zone: str, exhausted: bool = True, *, summary_only: bool = False) -> None:
        """Creates and starts in ``zone`` fail for want of capacity. A bulkInsert's error list is
        ``[VM_MIN_COUNT_NOT_REACHED, ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS]``, or with
        ``summary_only`` the first alone (the reason is then only in the per-VM operations)."""
        with self._cv:
            if exhausted:
                self._exhausted[zone] = summary_only
            else:
                self._exhausted.pop(zone, None)

    def refuse_capacity(self, zone: str) -> None:
        """bulkInsert in ``zone`` answers HTTP 503 ``insufficientCapacity`` at the request."""
        with self._cv:
            self._refused.add(zone)

    def set_quota(self, region: str, metric: str, limit: int, *, at_request: bool = False) -> None:
        """At most ``limit`` instances in ``region``; more fail with QUOTA_EXCEEDED of ``metric``
        inside the operation, or (``at_request``) as HTTP 403 ``quotaExceeded`` at the request.
        A stopped VM's start fails the same way inside its operation where ``limit`` others
        run (a TERMINATED VM holds no CPU or GPU quota)."""
        with self._cv:
            self._quota[region] = (metric, limit, at_request)

    def set_global_quota(self, metric: str, limit: int) -> None:
        """A project-wide GPU quota (``GPUS_ALL_REGIONS``): more GPUs fail in every region."""
        with self._cv:
            self._global_quota[metric] = limit

    def os_login(self, enabled: bool = True, *, enforced: bool = False) -> None:
        """OS Login on for the project (instance metadata ``enable-oslogin`` overrides it), or
        forced by the org policy constraints/compute.requireOsLogin (nothing overrides it)."""
        with self._cv:
            self._os_login = (enabled, enforced)

    def disable_api(self) -> None:
        """The Compute Engine API is not enabled in the project: every call is a 403."""
        with self._cv:
            self._api_disabled = True

    def deny(self, permission: str) -> None:
        """Requests that need ``permission`` (e.g. compute.instances.create) get 403."""
        with self._cv:
            self._denied.add(permission)

    def withhold(self, zone: str, machine_type: str) -> None:
        """``machine_type`` does not exist in ``zone``: creating one there is a 400, and
        ``machineTypes.get`` a 404."""
        with self._cv:
            self._withheld.add((zone, machine_type))

    def preempt(self, name: str, *, after_s: float | None = None) -> None:
        """Take a spot VM back, as Compute Engine does: the instance is STOPPING at once and
        its guest gets an ACPI G2 soft off, so the guest OS shuts down (the backing's
        ``shut_down()``: SIGTERM to its processes); the VM is TERMINATED (its machine killed)
        ``halt_s`` after the guest has no process left, or ``after_s`` (default ``stop_s``,
        30 s) after the notice at the latest, when Compute Engine forces it off (ACPI G3).
        A VM whose ``scheduling.instanceTerminationAction`` is DELETE is then deleted."""
        with self._cv:
            vm = self._find(name)
            scheduling = vm.body.get("scheduling", {})
            assert scheduling.get("provisioningModel") == "SPOT" or scheduling.get("preemptible"), \
                f"{name} is not a spot VM"
            assert vm.body["status"] == "RUNNING", f"{name} is {vm.body['status']}, not RUNNING"
            vm.body["status"] = "STOPPING"
            self._record_op(vm.project, f"zones/{vm.zone}", "compute.instances.preempted",
                            vm.body["selfLink"], done=True)
        if vm.backing is not None:
            vm.backing.shut_down()
        deadline = time.monotonic() + (self.stop_s if after_s is None else after_s)
        self._later(0.0, lambda: self._finish_preemption(vm, deadline))

    def _finish_preemption(self, vm: _Vm, deadline: float) -> None:
        """Wait for the guest to be down (or for ``deadline``), then power the VM off."""
        while time.monotonic() < deadline:
            if vm.backing is None or vm.backing.is_down():
                if self._closed.wait(min(self.halt_s, max(0.0, deadline - time.monotonic()))):
                    return
                break
            if self._closed.wait(min(0.05, max(0.0, deadline - time.monotonic()))):
                return
        with self._cv:
            key = (vm.project, vm.zone, vm.body["name"])
            if self._vms.get(key) is not vm or vm.body["status"] != "STOPPING":
                return  # deleted (or otherwise handled) in the meantime
        self._power_off(vm, "TERMINATED")
        if vm.body.get("scheduling", {}).get("instanceTerminationAction") == "DELETE":
            with self._cv:
                if self._vms.get(key) is vm:
                    del self._vms[key]
                    self._release_backing(vm)

    def suspend(self, name: str) -> None:
        """Suspend a VM (as ``instances.suspend`` or a maintenance policy does): SUSPENDED."""
        with self._cv:
            vm = self._find(name)
            vm.body["status"] = "SUSPENDING"
        self._power_off(vm, "SUSPENDED")

    def _power_off(self, vm: _Vm, status: str) -> None:
        if vm.backing is not None:
            vm.backing.power_off()
        with self._cv:
            vm.body["status"] = status
            vm.body["lastStopTimestamp"] = _now()
            vm.guest_attributes.clear()  # nothing is published while the guest is down

    def _later(self, delay_s: float, fn: Callable[[], None]) -> None:
        def run() -> None:
            if not self._closed.wait(delay_s):
                fn()

        thread = threading.Thread(target=run, daemon=True, name="fake-later")
        with self._cv:
            self._threads.append(thread)
        thread.start()

    # -- inspection ----------------------------------------------------------------------
    def instances(self, label: tuple[str, str] | None = None) -> list[Json]:
        """Every instance (with ``label`` = (key, value), if given), as the API shows it."""
        with self._cv:
            return [json.loads(json.dumps(vm.body)) for vm in self._vms.values()
                    if label is None or vm.body.get("labels", {}).get(label[0]) == label[1]]

    def host_key(self, name: str) -> str:
        """The host key line (``type base64``) of the machine playing instance ``name``."""
        with self._cv:
            return self._find(name).host_key

    def firewalls(self) -> list[Json]:
        with self._cv:
            return [dict(f) for f in self._firewalls.values()]

    def operations(self, kind: str | None = None) -> list[Json]:
        with self._cv:
            return [dict(o.body) for o in self._ops.values()
                    if kind is None or o.body["operationType"] == kind]

    def pending_operations(self) -> int:
        with self._cv:
            return sum(not o.done for o in self._ops.values())

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Block until no operation is in flight."""
        with self._cv:
            assert self._cv.wait_for(lambda: self.pending_operations() == 0, timeout), \
                "operations still running"

    # -- request handling ----------------------------------------------------------------
    def handle(self, verb: str, path: str, query: dict[str, str], body: Json) -> tuple[int, Json]:
        match = ROUTE.match(path)
        if match is None:
            return 404, ApiError(404, f"no such path {path}", "notFound").body
        project, rest = match["project"], match["rest"]
        try:
            method, action = self._route(verb, project, rest, query, body)
            self._count(method, path, body)
            self._gate(method, project, rest)
            request_id = query.get("requestId", "")
            with self._cv:
                known = self._request_ids.get(request_id) if request_id else None
            if known is not None:  # a retried mutation: the operation of the first request
                return 200, self._get_op(*known)
            answer = action()
            if request_id and answer.get("kind") == "compute#operation":
                scope = f"zones/{_last(answer['zone'])}" if answer.get("zone") else "global"
                with self._cv:
                    self._request_ids[request_id] = (project, scope, answer["name"])
            with self._cv:
                lost = method in self._lost
                if lost:
                    self._lost.remove(method)
            if lost:
                raise _burst_error(503)
            return 200, answer
        except ApiError as exc:
            return exc.status, exc.body

    def _route(self, verb: str, project: str, rest: str, query: dict[str, str],
               body: Json) -> tuple[str, Callable[[], Json]]:
        parts = rest.split("/")
        table: list[tuple[str, str, Callable[[], Json]]] = []
        if parts[:2] == ["aggregated", "instances"] and len(parts) == 2:
            table = [("GET", "instances.aggregatedList",
                      lambda: self._aggregated(project, query.get("filter", "")))]
        elif parts[0] == "zones" and len(parts) >= 3:
            table = self._zonal_routes(project, parts[1], parts[2:], query, body)
        elif parts[:2] == ["global", "firewalls"]:
            table = self._firewall_routes(project, parts[2:], query, body)
        elif parts[:2] == ["global", "operations"] and len(parts) >= 3:
            table = self._op_routes("globalOperations", project, "global", parts[2:])
        elif parts[:2] == ["global", "images"] and len(parts) in (3, 4):
            table = self._image_routes(project, parts[2:])
        for want_verb, method, action in table:
            if want_verb == verb:
                return method, action
        raise ApiError(404, f"no method {verb} /{rest}", "notFound")

    def _zonal_routes(self, project: str, zone: str, parts: list[str], query: dict[str, str],
                      body: Json) -> list[tuple[str, str, Callable[[], Json]]]:
        if parts[0] in ("machineTypes", "acceleratorTypes") and len(parts) == 2:
            return self._type_routes(project, zone, parts[0], parts[1])
        if parts == ["operations"]:
            return [("GET", "zoneOperations.list",
                     lambda: self._list_ops(project, zone, query.get("filter", "")))]
        if parts[0] == "operations" and len(parts) >= 2:
            return self._op_routes("zoneOperations", project, f"zones/{zone}", parts[1:])
        if parts[0] != "instances":
            return []
        if len(parts) == 1:
            return []
        if parts[1] == "bulkInsert":
            return [("POST", "instances.bulkInsert", lambda: self._bulk_insert(project, zone, body))]
        name = parts[1]
        verbs: dict[tuple[str, ...], list[tuple[str, str, Callable[[], Json]]]] = {
            (): [("GET", "instances.get", lambda: self._get(project, zone, name)),
                 ("DELETE", "instances.delete", lambda: self._delete(project, zone, name))],
            ("start",): [("POST", "instances.start", lambda: self._start(project, zone, name))],
            ("resume",): [("POST", "instances.resume",
                           lambda: self._start(project, zone, name, resume=True))],
            ("setMetadata",): [("POST", "instances.setMetadata",
                                lambda: self._set_metadata(project, zone, name, body))],
            ("getGuestAttributes",): [("GET", "instances.getGuestAttributes",
                                       lambda: self._guest_attributes(project, zone, name, query))],
        }
        return verbs.get(tuple(parts[2:]), [])

    def _firewall_routes(self, project: str, parts: list[str], query: dict[str, str],
                         body: Json) -> list[tuple[str, str, Callable[[], Json]]]:
        if not parts:
            return [("POST", "firewalls.insert", lambda: self._insert_firewall(project, body)),
                    ("GET", "firewalls.list", lambda: self._list_firewalls(project, query))]
        name = parts[0]
        return [("GET", "firewalls.get", lambda: self._get_firewall(project, name)),
                ("DELETE", "firewalls.delete", lambda: self._delete_firewall(project, name))]

    def _op_routes(self, kind: str, project: str, scope: str,
                   parts: list[str]) -> list[tuple[str, str, Callable[[], Json]]]:
        name = parts[0]
        if parts[1:] == ["wait"]:
            return [("POST", f"{kind}.wait", lambda: self._wait(project, scope, name))]
        return [("GET", f"{kind}.get", lambda: self._get_op(project, scope, name))]

    def _count(self, method: str, path: str, body: Json) -> None:
        with self._cv:
            self.calls[method] += 1
            self.requests.append((method, path, body))

    def _gate(self, method: str, project: str, rest: str) -> None:
        """A disabled API first, then injected bursts, then permissions."""
        with self._cv:
            if self._api_disabled:
                raise _service_disabled(project)
            for burst in self._bursts:
                if burst.remaining > 0 and burst.method in (None, method):
                    burst.remaining -= 1
                    raise _burst_error(burst.status)
            permission = PERMISSIONS[method]
            if permission in self._denied:
                raise ApiError(403, f"Required '{permission}' permission for "
                               f"'projects/{project}/{rest}'", "forbidden")

    # -- instances -----------------------------------------------------------------------
    def _aggregated(self, project: str, filter_: str) -> Json:
        test = _filter(filter_)
        with self._cv:
            zones = sorted({vm.zone for vm in self._vms.values() if vm.project == project})
            items: Json = {}
            for zone in zones:
                found = [vm.body for vm in self._vms.values()
                         if vm.project == project and vm.zone == zone and test(vm.body)]
                items[f"zones/{zone}"] = {"instances": found} if found else _no_results(zone)
            return {"kind": "compute#instanceAggregatedList",
                    "id": f"projects/{project}/aggregated/instances", "items": items,
                    "selfLink": f"{API}/projects/{project}/aggregated/instances"}

    def _get(self, project: str, zone: str, name: str) -> Json:
        with self._cv:
            return dict(self._vm(project, zone, name).body)

    def _bulk_insert(self, project: str, zone: str, body: Json) -> Json:
        per_instance = body.get("perInstanceProperties", {})
        names = list(per_instance)
        count = int(body.get("count", len(names)))
        props = body.get("instanceProperties", {})
        machine_type = _last(props.get("machineType", ""))
        if not names or count != len(names):
            raise ApiError(400, "Invalid value for field 'resource.count': "
                           f"'{count}'. count must equal the number of perInstanceProperties.",
                           "invalid")
        for name, entry in per_instance.items():
            if "name" in (entry or {}):  # documented as output only
                raise ApiError(400, f"Invalid value for field 'resource.perInstanceProperties["
                               f"{name}].name': '{entry['name']}'. The field is output only.",
                               "invalid")
        if (zone, machine_type) in self._withheld or not machine_type:
            raise ApiError(400, "Invalid value for field 'resource.instanceProperties.machineType':"
                           f" '{machine_type}'. Machine type with name '{machine_type}' does not "
                           f"exist in zone '{zone}'.", "invalid")
        region = zone.rsplit("-", 1)[0]
        with self._cv:
            if zone in self._refused:
                raise ApiError(503, f"The zone 'projects/{project}/zones/{zone}' does not have "
                               "enough resources available to fulfill the request.  Try a "
                               "different zone, or try again later.", "insufficientCapacity")
            quota = self._regional_quota(region, len(names))
        if quota is not None and quota[2]:
            metric, limit, _ = quota
            raise ApiError(403, f"Quota '{metric}' exceeded.  Limit: {limit:.1f} in region "
                           f"{region}.", "quotaExceeded", "usageLimits")
        group = f"{uuid.uuid4()}"
        status: Json = {"targetVmCount": count, "status": "CREATING"}
        target = f"{API}/projects/{project}/zones/{zone}/instances/{names[0]}"
        steps = _Steps(start=lambda: self._create(project, zone, names, props, group, status),
                       finish=lambda: self._set_status(project, zone, names, "STAGING"),
                       after=lambda: self._boot(project, zone, names))
        return self._launch(project, f"zones/{zone}", "bulkInsert", target, steps, extra={
            "operationGroupId": group,
            "instancesBulkInsertOperationMetadata": {"perLocationStatus": {f"zones/{zone}": status}},
        })

    def _regional_quota(self, region: str, adding: int) -> tuple[str, int, bool] | None:
        """The region's quota if ``adding`` more instances would exceed it."""
        if region not in self._quota:
            return None
        used = sum(vm.zone.rsplit("-", 1)[0] == region for vm in self._vms.values())
        return self._quota[region] if used + adding > self._quota[region][1] else None

    def _create(self, project: str, zone: str, names: list[str], props: Json, group: str,
                status: Json) -> Json | None:
        """Called when the bulkInsert starts running: all instances, or an error and none. Each
        VM also gets an ``insert`` operation of the bulkInsert's group, failed with the reason
        when the zone has no room, as Compute Engine records them."""
        with self._cv:
            error = self._refusal(project, zone, names, props)
            per_vm = None
            if error is not None:
                per_vm = error.get("per_vm") or error
                error = {"errors": error["errors"]}
            else:
                for name in names:
                    self._vms[(project, zone, name)] = self._new_vm(project, zone, name, props)
            for name in names:
                op = self._record_op(project, f"zones/{zone}", "insert",
                                     f"{API}/projects/{project}/zones/{zone}/instances/{name}",
                                     done=True)
                op.body["operationGroupId"] = group
                if per_vm is not None:
                    op.body.update(error={"errors": per_vm["errors"]}, **_http_status(per_vm))
            status.update(status="DONE" if error is None else "FAILED",
                          createdVmCount=0 if error is not None else len(names))
        return error

    def _refusal(self, project: str, zone: str, names: list[str], props: Json) -> Json | None:
        """Why ``names`` cannot be created in ``zone`` now (the operation's error), or None."""
        if zone in self._exhausted:
            per_vm = {"errors": [_zone_exhausted(project, zone)]}
            summary = {"code": "VM_MIN_COUNT_NOT_REACHED",
                       "message": f"Requested minimum count of {len(names)} VMs could not be "
                                  "created."}
            errors = [summary] if self._exhausted[zone] else [summary, *per_vm["errors"]]
            return {"errors": errors, "per_vm": per_vm}
        wanted = _gpus(props) * len(names)
        for metric, limit in self._global_quota.items():
            used = sum(_gpus(vm.body) for vm in self._vms.values())
            if wanted and used + wanted > limit:
                return _global_quota_error(metric, limit)
        quota = self._regional_quota(zone.rsplit("-", 1)[0], len(names))
        if quota is not None:
            return _quota_error(quota[0], quota[1], zone.rsplit("-", 1)[0])
        taken = [n for n in names if (project, zone, n) in self._vms]  # names are per zone
        if taken:
            return {"errors": [{"code": "RESOURCE_ALREADY_EXISTS", "message":
                                f"The resource 'projects/{project}/zones/{zone}/instances/"
                                f"{taken[0]}' already exists"}]}
        return None

    def _new_vm(self, project: str, zone: str, name: str, props: Json) -> _Vm:
        vm = _Vm(project, zone, {}, backing=self._take_backing(name))
        n = next(self._ips)
        internal = vm.backing.address if vm.backing else f"10.128.{n // 250}.{n % 250 + 2}"
        vm.host_key = vm.backing.host_key_line() if vm.backing else _host_key()
        vm.body = _instance_json(project, zone, name, props, internal,
                                 vm.backing.address if vm.backing else f"34.1.{n // 250}.{n % 250}")
        return vm

    def _take_backing(self, name: str) -> Backing | None:
        free = [i for i in range(len(self._pool)) if i not in self._busy]
        if not free:
            return None
        i = free[0]
        self._busy[i] = name
        backing = self._pool[i]
        if i in self._used:
            backing.new_disk()
        self._used.add(i)
        return backing

    def _release_backing(self, vm: _Vm) -> None:
        for i, backing in enumerate(self._pool):
            if backing is vm.backing:
                self._busy.pop(i, None)

    def _set_status(self, project: str, zone: str, names: list[str], status: str) -> None:
        with self._cv:
            for name in names:
                vm = self._vms.get((project, zone, name))
                if vm is not None:
                    vm.body["status"] = status

    def _boot(self, project: str, zone: str, names: list[str]) -> None:
        """STAGING -> RUNNING after boot_s; then the guest agent takes keys and publishes its own."""
        if self._closed.wait(self.boot_s):
            return
        for name in names:
            with self._cv:
                vm = self._vms.get((project, zone, name))
                if vm is None or vm.body["status"] != "STAGING":
                    continue
            if vm.backing is not None:
                vm.backing.power_on()
            with self._cv:
                vm.body["status"] = "RUNNING"
                vm.body["lastStartTimestamp"] = _now()
                self._guest_agent(vm)

    def _guest_agent(self, vm: _Vm) -> None:
        """What Google's guest agent does at boot: ssh-keys in (unless OS Login is on), and, on
        the first boot of this instance ID only, host keys out after ``host_key_delay_s``."""
        metadata = {i["key"]: i.get("value", "") for i in vm.body["metadata"].get("items", [])}
        if (metadata.get("enable-guest-attributes", "").upper() == "TRUE"
                and vm.published_for != vm.body["id"]):
            vm.published_for = vm.body["id"]
            self._later(self.host_key_delay_s, lambda: self._publish_host_keys(vm))
        enabled, enforced = self._os_login
        own = metadata.get("enable-oslogin", "").upper()
        os_login = enforced or (own == "TRUE" if own in ("TRUE", "FALSE") else enabled)
        if vm.backing is not None and not os_login:
            for line in metadata.get("ssh-keys", "").splitlines():
                if ":" in line:
                    vm.backing.authorize(line.split(":", 1)[1])

    def _publish_host_keys(self, vm: _Vm) -> None:
        """As the guest agent writes them: ``hostkeys/TYPE`` = the .pub file's second field
        (with the newline of a key without a comment), and a key type clients may not know."""
        with self._cv:
            if vm.body.get("status") != "RUNNING":
                return
            kind, b64 = vm.host_key.split()[:2]
            vm.guest_attributes[f"hostkeys/{kind}"] = b64 + "\n"
            vm.guest_attributes["hostkeys/sk-ssh-ed25519@openssh.com"] = "AAAAGnNrLXNzaC1lZDI1NTE5"

    def _delete(self, project: str, zone: str, name: str) -> Json:
        with self._cv:
            vm = self._vm(project, zone, name)

        def start() -> Json | None:
            with self._cv:
                vm.body["status"] = "STOPPING"
            return None

        def finish() -> None:
            if vm.backing is not None:
                vm.backing.power_off()
            with self._cv:
                self._vms.pop((project, zone, name), None)
                self._release_backing(vm)

        return self._launch(project, f"zones/{zone}", "delete", vm.body["selfLink"],
                            _Steps(start=start, finish=finish))

    def _start(self, project: str, zone: str, name: str, resume: bool = False) -> Json:
        with self._cv:
            vm = self._vm(project, zone, name)
            if not resume and vm.body["status"] in ("SUSPENDING", "SUSPENDED"):
                raise ApiError(400, f"The instance 'projects/{project}/zones/{zone}/instances/"
                               f"{name}' is suspended. Use the resume method to restart it.",
                               "resourceNotReady")
        wake_from = ("SUSPENDED",) if resume else STOPPED

        def start() -> Json | None:
            with self._cv:
                if vm.body["status"] not in wake_from:
                    return None
                if zone in self._exhausted:
                    return _stockout(project, zone)
                region = zone.rsplit("-", 1)[0]
                if region in self._quota:  # a stopped VM holds no CPU or GPU quota: it needs it
                    metric, limit, _ = self._quota[region]
                    running = sum(v is not vm and v.zone.rsplit("-", 1)[0] == region
                                  and v.body["status"] not in (*STOPPED, "SUSPENDED")
                                  for v in self._vms.values())
                    if running + 1 > limit:
                        return _quota_error(metric, limit, region)
                vm.body["status"] = "STAGING"
            return None

        return self._launch(project, f"zones/{zone}", "resume" if resume else "start",
                            vm.body["selfLink"],
                            _Steps(start=start, after=lambda: self._boot(project, zone, [name])))

    def _set_metadata(self, project: str, zone: str, name: str, body: Json) -> Json:
        with self._cv:
            vm = self._vm(project, zone, name)
            if body.get("fingerprint") != vm.body["metadata"]["fingerprint"]:
                raise ApiError(412, "Supplied fingerprint does not match current metadata "
                               "fingerprint.", "conditionNotMet")

        def finish() -> None:
            with self._cv:
                vm.body["metadata"] = {"kind": "compute#metadata", "fingerprint": _fingerprint(),
                                       "items": body.get("items", [])}
                if vm.body["status"] == "RUNNING":
                    self._guest_agent(vm)

        return self._launch(project, f"zones/{zone}", "setMetadata", vm.body["selfLink"],
                            _Steps(finish=finish))

    def _guest_attributes(self, project: str, zone: str, name: str,
                          query: dict[str, str]) -> Json:
        path = query.get("queryPath", "")
        with self._cv:
            vm = self._vm(project, zone, name)
            items = [{"namespace": k.split("/")[0], "key": k.split("/", 1)[1], "value": v}
                     for k, v in sorted(vm.guest_attributes.items()) if k.startswith(path)]
        if not items:
            raise _not_found(f"projects/{project}/zones/{zone}/instances/{name}"
                             f"/guestAttributes/{path}")
        return {"kind": "compute#guestAttributes", "queryPath": path,
                "queryValue": {"items": items},
                "selfLink": f"{API}/projects/{project}/zones/{zone}/instances/{name}"
                            f"/guestAttributes/{path}"}

    def _vm(self, project: str, zone: str, name: str) -> _Vm:
        vm = self._vms.get((project, zone, name))
        if vm is None:
            raise _not_found(f"projects/{project}/zones/{zone}/instances/{name}")
        return vm

    def _find(self, name: str) -> _Vm:
        found = [vm for key, vm in self._vms.items() if key[2] == name]
        assert len(found) == 1, f"{len(found)} instances named {name}"
        return found[0]

    # -- catalog -------------------------------------------------------------------------
    # Images, machine types and accelerator types: by default every one a request names
    # exists (READY images; every type in every zone, at most CATALOG_MAX_CARDS GPUs a VM),
    # unless a switch below (or ``withhold``) takes it away.
    def retire_image(self, image: str, state: str | None = "DEPRECATED",
                     replacement: str = "") -> None:
        """The image or image family named ``image`` (a path's last part) is ``state``:
        DEPRECATED, OBSOLETE or DELETED (its ``deprecated.state``, ``replacement`` its
        ``deprecated.replacement``), or None: gone (a 404)."""
        with self._cv:
            self._retired[_last(image)] = (state, replacement)

    def withhold_accelerator(self, zone: str, accelerator_type: str) -> None:
        """``accelerator_type`` does not exist in ``zone``: ``acceleratorTypes.get`` is a 404."""
        with self._cv:
            self._no_accelerators.add((zone, accelerator_type))

    def _image_routes(self, project: str, parts: list[str]) -> list[tuple[str, str, Callable[[], Json]]]:
        if parts[0] == "family" and len(parts) == 2:
            return [("GET", "images.getFromFamily", lambda: self._image(project, parts[1], True))]
        if len(parts) == 1:
            return [("GET", "images.get", lambda: self._image(project, parts[0], False))]
        return []

    def _type_routes(self, project: str, zone: str, collection: str,
                     name: str) -> list[tuple[str, str, Callable[[], Json]]]:
        if collection == "machineTypes":
            return [("GET", "machineTypes.get", lambda: self._machine_type(project, zone, name))]
        return [("GET", "acceleratorTypes.get", lambda: self._accelerator_type(project, zone, name))]

    def _image(self, project: str, name: str, family: bool) -> Json:
        """``images.getFromFamily`` (``family``: the family's newest image) or ``images.get``."""
        path = f"projects/{project}/global/images/{'family/' if family else ''}{name}"
        with self._cv:
            state, replacement = self._retired.get(name, ("", ""))
        if state is None:
            raise _not_found(path)
        return _image_json(project, f"{name}-v20250605" if family else name,
                           name if family else "", state, replacement)

    def _machine_type(self, project: str, zone: str, name: str) -> Json:
        with self._cv:
            withheld = (zone, name) in self._withheld
        if withheld:
            raise _not_found(f"projects/{project}/zones/{zone}/machineTypes/{name}")
        return _machine_type_json(project, zone, name)

    def _accelerator_type(self, project: str, zone: str, name: str) -> Json:
        with self._cv:
            withheld = (zone, name) in self._no_accelerators
        if withheld:
            raise _not_found(f"projects/{project}/zones/{zone}/acceleratorTypes/{name}")
        zone_url = f"{API}/projects/{project}/zones/{zone}"
        return {"kind": "compute#acceleratorType", "id": str(10000 + sum(map(ord, name))),
                "creationTimestamp": "1969-12-31T16:00:00.000-08:00", "name": name,
                "description": "NVIDIA " + name.removeprefix("nvidia-").removeprefix("tesla-").upper(),
                "zone": zone_url, "selfLink": f"{zone_url}/acceleratorTypes/{name}",
                "maximumCardsPerInstance": CATALOG_MAX_CARDS}

    # -- firewalls -----------------------------------------------------------------------
    def _insert_firewall(self, project: str, body: Json) -> Json:
        name = body.get("name", "")
        with self._cv:
            if (project, name) in self._firewalls:
                raise ApiError(409, f"The resource 'projects/{project}/global/firewalls/{name}' "
                               "already exists", "alreadyExists")
        link = f"{API}/projects/{project}/global/firewalls/{name}"
        rule = {**body, "kind": "compute#firewall", "id": str(uuid.uuid4().int % 10**18),
                "creationTimestamp": _now(), "selfLink": link,
                "network": _network_url(project, body.get("network", "default"))}

        def finish() -> None:
            with self._cv:
                self._firewalls[(project, name)] = rule

        return self._launch(project, "global", "insert", link, _Steps(finish=finish))

    def _list_firewalls(self, project: str, query: dict[str, str]) -> Json:
        """A page of the project's rules by name, ``maxResults`` (at most 500, the default) a
        page; ``nextPageToken`` while more follow (the token: the next name, opaque to
        clients). Filters are not modelled: a request with one is refused."""
        if query.get("filter"):
            raise ApiError(400, "the fake does not model firewall list filters", "invalid")
        size = min(int(query.get("maxResults") or 500), 500)
        with self._cv:
            rules = sorted((dict(r) for (p, _), r in self._firewalls.items() if p == project),
                           key=lambda r: r["name"])
        start = next((i for i, r in enumerate(rules) if r["name"] >= query.get("pageToken", "")),
                     len(rules))
        page = rules[start:start + size]
        link = f"{API}/projects/{project}/global/firewalls"
        answer: Json = {"kind": "compute#firewallList", "id": f"projects/{project}/global/firewalls",
                        "items": page, "selfLink": link}
        if start + size < len(rules):
            answer["nextPageToken"] = rules[start + size]["name"]
        return answer

    def add_firewall(self, project: str, rule: Json) -> None:
        """A rule that is already there (made by someone else), as the API would show it."""
        name = rule["name"]
        with self._cv:
            self._firewalls[(project, name)] = {
                "kind": "compute#firewall", "id": str(uuid.uuid4().int % 10**18),
                "creationTimestamp": _now(), "priority": 1000, "direction": "INGRESS",
                "disabled": False, "logConfig": {"enable": False}, **rule,
                "selfLink": f"{API}/projects/{project}/global/firewalls/{name}",
                "network": _network_url(project, rule.get("network", "default"))}

    def add_default_network_rules(self, project: str) -> None:
        """The four rules a new project's ``default`` network comes with."""
        every = [{"IPProtocol": "tcp", "ports": ["0-65535"]},
                 {"IPProtocol": "udp", "ports": ["0-65535"]}, {"IPProtocol": "icmp"}]
        for name, allowed, ranges in [
                ("default-allow-internal", every, ["10.128.0.0/9"]),
                ("default-allow-ssh", [{"IPProtocol": "tcp", "ports": ["22"]}], ["0.0.0.0/0"]),
                ("default-allow-rdp", [{"IPProtocol": "tcp", "ports": ["3389"]}], ["0.0.0.0/0"]),
                ("default-allow-icmp", [{"IPProtocol": "icmp"}], ["0.0.0.0/0"])]:
            self.add_firewall(project, {
                "name": name, "description": f"Allow {name.rsplit('-', 1)[1]} from anywhere"
                if name != "default-allow-internal" else
                "Allow internal traffic on the default network", "priority": 65534,
                "sourceRanges": ranges, "allowed": allowed})

    def _get_firewall(self, project: str, name: str) -> Json:
        with self._cv:
            if (project, name) not in self._firewalls:
                raise _not_found(f"projects/{project}/global/firewalls/{name}")
            return dict(self._firewalls[(project, name)])

    def _delete_firewall(self, project: str, name: str) -> Json:
        link = self._get_firewall(project, name)["selfLink"]

        def finish() -> None:
            with self._cv:
                self._firewalls.pop((project, name), None)

        return self._launch(project, "global", "delete", link, _Steps(finish=finish))

    # -- operations ----------------------------------------------------------------------
    def _launch(self, project: str, scope: str, kind: str, target: str, steps: _Steps,
                extra: Json | None = None) -> Json:
        with self._cv:
            op = self._record_op(project, scope, kind, target)
            op.body.update(extra or {})
        thread = threading.Thread(target=self._progress, args=(op, steps), daemon=True,
                                  name=f"fake-op-{op.body['name']}")
        with self._cv:
            self._threads.append(thread)
        thread.start()
        return dict(op.body)

    def _record_op(self, project: str, scope: str, kind: str, target: str,
                   done: bool = False) -> _Op:
        name = f"operation-{int(time.time() * 1000)}-{uuid.uuid4().hex[:12]}"
        base = f"{API}/projects/{project}/{scope}"
        body: Json = {"kind": "compute#operation", "id": str(uuid.uuid4().int % 10**18),
                      "name": name, "operationType": kind, "targetLink": target,
                      "status": "DONE" if done else "PENDING", "user": "anonymous@fake.example",
                      "progress": 100 if done else 0, "insertTime": _now(),
                      "selfLink": f"{base}/operations/{name}"}
        if scope != "global":
            body["zone"] = base
        op = _Op(body, scope, done=done)
        self._ops[(project, scope, name)] = op
        return op

    def _progress(self, op: _Op, steps: _Steps) -> None:
        if self._closed.wait(self.latency_s / 2):
            return
        with self._cv:
            op.body.update(status="RUNNING", startTime=_now(), progress=50)
        error = steps.start()
        if error is None and not self._closed.wait(self.latency_s / 2):
            steps.finish()
        with self._cv:
            op.body.update(status="DONE", endTime=_now(), progress=100)
            if error is not None:
                op.body.update(error=error, **_http_status(error))
            op.done = True
            self._cv.notify_all()
        if error is None:
            steps.after()

    def _get_op(self, project: str, scope: str, name: str) -> Json:
        with self._cv:
            return dict(self._op(project, scope, name).body)

    def _wait(self, project: str, scope: str, name: str) -> Json:
        """Long-polls until DONE or WAIT_CAP_S; with ``early_waits``, answers at once."""
        with self._cv:
            op = self._op(project, scope, name)
            if not self.early_waits:
                self._cv.wait_for(lambda: op.done or self._closed.is_set(), WAIT_CAP_S)
            return dict(op.body)

    def _list_ops(self, project: str, zone: str, filter_: str) -> Json:
        test = _filter(filter_)
        with self._cv:
            items = [dict(o.body) for (p, scope, _), o in self._ops.items()
                     if p == project and scope == f"zones/{zone}" and test(o.body)]
        link = f"{API}/projects/{project}/zones/{zone}/operations"
        return {"kind": "compute#operationList", "id": f"projects/{project}/zones/{zone}/operations",
                "items": items, "selfLink": link}

    def _op(self, project: str, scope: str, name: str) -> _Op:
        op = self._ops.get((project, scope, name))
        if op is None:
            raise _not_found(f"projects/{project}/{scope}/operations/{name}")
        return op


class _Handler(BaseHTTPRequestHandler):
    fake: FakeCompute
    protocol_version = "HTTP/1.1"

    def _serve(self) -> None:
        parts = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        body = json.loads(raw) if raw.strip() else {}
        status, payload = self.fake.handle(self.command, parts.path, query, body)
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=UTF-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_DELETE = _serve

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: tests read ``fake.requests`` instead."""


# -- JSON shapes -------------------------------------------------------------------------
def _instance_json(project: str, zone: str, name: str, props: Json, internal: str,
                   external: str) -> Json:
    zone_url = f"{API}/projects/{project}/zones/{zone}"
    nics = []
    for i, nic in enumerate(props.get("networkInterfaces") or [{}]):
        access = [{"kind": "compute#accessConfig", "type": "ONE_TO_ONE_NAT", "name": "External NAT",
                   "natIP": external, "networkTier": a.get("networkTier", "PREMIUM")}
                  for a in nic.get("accessConfigs", [])]
        nics.append({"kind": "compute#networkInterface", "name": f"nic{i}",
                     "network": _network_url(project, nic.get("network", "default")),
                     "subnetwork": nic.get("subnetwork", ""), "networkIP": internal,
                     "accessConfigs": access, "fingerprint": _fingerprint(), "stackType": "IPV4_ONLY"})
    disks = [{"kind": "compute#attachedDisk", "type": "PERSISTENT", "mode": "READ_WRITE",
              "source": f"{zone_url}/disks/{name}", "deviceName": "persistent-disk-0", "index": 0,
              "boot": d.get("boot", False), "autoDelete": d.get("autoDelete", False),
              "diskSizeGb": d.get("initializeParams", {}).get("diskSizeGb", "10"),
              "interface": "SCSI"} for d in props.get("disks", [])]
    accelerators = [{"acceleratorType": f"{zone_url}/acceleratorTypes/{_last(a['acceleratorType'])}",
                     "acceleratorCount": a.get("acceleratorCount", 1)}
                    for a in props.get("guestAccelerators", [])]
    scheduling = {"onHostMaintenance": "MIGRATE", "automaticRestart": True, "preemptible": False,
                  "provisioningModel": "STANDARD", **props.get("scheduling", {})}
    return {
        "kind": "compute#instance", "id": str(uuid.uuid4().int % 10**18),
        "creationTimestamp": _now(), "name": name, "description": props.get("description", ""),
        "tags": {"items": props.get("tags", {}).get("items", []), "fingerprint": _fingerprint()},
        "machineType": f"{zone_url}/machineTypes/{_last(props['machineType'])}",
        "status": "PROVISIONING", "zone": zone_url, "canIpForward": False,
        "networkInterfaces": nics, "disks": disks, "guestAccelerators": accelerators,
        "metadata": {"kind": "compute#metadata", "fingerprint": _fingerprint(),
                     "items": props.get("metadata", {}).get("items", [])},
        "serviceAccounts": props.get("serviceAccounts", []),
        "selfLink": f"{zone_url}/instances/{name}", "scheduling": scheduling,
        "cpuPlatform": "Intel Cascade Lake", "labels": props.get("labels", {}),
        "labelFingerprint": _fingerprint(), "startRestricted": False, "deletionProtection": False,
        "fingerprint": _fingerprint(),
    }


def _zone_exhausted(project: str, zone: str) -> Json:
    """The reason of a bulkInsert stockout, in the operation and in each VM's insert operation."""
    return {"code": "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS",
            "message": f"The zone 'projects/{project}/zones/{zone}' does not have enough "
                       "resources available to fulfill the request.  '(resource type:compute)'.",
            "errorDetails": [{"errorInfo": {
                "reason": "resource_availability", "domain": "compute.googleapis.com",
                "metadata": {"zone": zone, "vmType": "compute"}}}]}


def _http_status(error: Json) -> Json:
    status, text = HTTP_STATUS_OF.get(error["errors"][-1]["code"], HTTP_UNAVAILABLE)
    return {"httpErrorStatusCode": status, "httpErrorMessage": text}


def _gpus(body: Json) -> int:
    """GPUs of an instance (or instanceProperties): attached, or built into the machine type."""
    attached = sum(int(a.get("acceleratorCount", 1)) for a in body.get("guestAccelerators", []))
    return attached + GPU_MACHINES.get(_last(body.get("machineType", "")), 0)


def _global_quota_error(metric: str, limit: int) -> Json:
    return {"errors": [{
        "code": "QUOTA_EXCEEDED",
        "message": f"Quota '{metric}' exceeded.  Limit: {limit:.1f} globally.",
        "errorDetails": [{"quotaInfo": {
            "metricName": f"compute.googleapis.com/{metric.lower()}",
            "limitName": f"{metric.replace('_', '-')}-per-project",
            "dimensions": {"global": "global"}, "limit": limit}}]}]}


def _service_disabled(project: str) -> ApiError:
    number = sum(map(ord, project)) * 7919  # a project number, stable per project
    message = (f"Compute Engine API has not been used in project {number} before or it is "
               "disabled. Enable it by visiting https://console.developers.google.com/apis/api/"
               f"compute.googleapis.com/overview?project={number} then retry. If you enabled "
               "this API recently, wait a few minutes for the action to propagate to our "
               "systems and retry.")
    return ApiError(403, message, "accessNotConfigured", "usageLimits", details=[{
        "@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": "SERVICE_DISABLED",
        "domain": "googleapis.com",
        "metadata": {"service": "compute.googleapis.com", "consumer": f"projects/{number}"}}])


def _stockout(project: str, zone: str) -> Json:
    return {"errors": [{"code": "ZONE_RESOURCE_POOL_EXHAUSTED", "message":
                        f"The zone 'projects/{project}/zones/{zone}' does not have enough resources "
                        "available to fulfill the request.  Try a different zone, or try again "
                        "later."}]}


def _quota_error(metric: str, limit: int, region: str) -> Json:
    return {"errors": [{
        "code": "QUOTA_EXCEEDED",
        "message": f"Quota '{metric}' exceeded.  Limit: {limit:.1f} in region {region}.",
        "errorDetails": [{"quotaInfo": {
            "metricName": f"compute.googleapis.com/{metric.lower()}",
            "limitName": f"{metric}-per-project-region", "dimensions": {"region": region},
            "limit": limit}}]}]}


def _not_found(resource: str) -> ApiError:
    """The API's 404 for a resource path (``projects/P/zones/Z/instances/N``)."""
    return ApiError(404, f"The resource '{resource}' was not found", "notFound")


def _burst_error(status: int) -> ApiError:
    if status == 429:
        return ApiError(429, "Rate Limit Exceeded", "rateLimitExceeded", "usageLimits")
    return ApiError(status, "The service is currently unavailable.", "backendError")


def _no_results(zone: str) -> Json:
    return {"warning": {"code": "NO_RESULTS_ON_PAGE",
                        "message": f"There are no results for scope 'zones/{zone}' on this page.",
                        "data": [{"key": "scope", "value": f"zones/{zone}"}]}}


FILTER_TERM = re.compile(
    r'^\(?\s*(labels\.[a-z][-_a-z0-9]*|name|operationType|operationGroupId|status)\s*'
    r'(=|!=|eq|ne)\s*"?([^"()]*)"?\s*\)?$')


def _filter(text: str) -> Callable[[Json], bool]:
    """The API's filter, in the forms used here: ``labels.KEY = VALUE``, ``name != X``, AND."""
    terms = [t for t in re.split(r"\s+AND\s+", text.strip()) if t]
    tests = []
    for term in terms:
        match = FILTER_TERM.match(term.strip())
        if match is None:
            raise ApiError(400, f"Invalid value for field 'filter': '{text}'. Invalid list filter "
                           "expression.", "invalid")
        tests.append(_term(*match.groups()))
    return lambda body: all(t(body) for t in tests)


def _term(field_: str, op: str, value: str) -> Callable[[Json], bool]:
    def read(body: Json) -> str:
        if field_.startswith("labels."):
            return str(body.get("labels", {}).get(field_[len("labels."):], ""))
        return str(body.get(field_, ""))

    negate = op in ("!=", "ne")
    return lambda body: (read(body) == value.strip()) != negate


def _network_url(project: str, network: str) -> str:
    if network.startswith(API):
        return network
    return f"{API}/projects/{project}/global/networks/{_last(network)}"


def _host_key() -> str:
    key = ed25519.Ed25519PrivateKey.generate().public_key()
    return key.public_bytes(serialization.Encoding.OpenSSH,
                            serialization.PublicFormat.OpenSSH).decode()


def _last(link: str) -> str:
    return link.rstrip("/").rsplit("/", 1)[-1]


def _fingerprint() -> str:
    return uuid.uuid4().hex[:16]


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000-00:00", time.gmtime())


# -- catalog JSON shapes -----------------------------------------------------------------
CATALOG_MAX_CARDS = 8  # maximumCardsPerInstance of every accelerator type in the fake
GPU_SHAPES = {  # machine family with GPUs built in -> (GPU, vCPUs and MB of memory per GPU)
    "a2-highgpu": ("nvidia-tesla-a100", 12, 87040), "a2-ultragpu": ("nvidia-a100-80gb", 12, 174080),
    "a3-highgpu": ("nvidia-h100-80gb", 26, 239616),
}
MB_PER_CPU = {"standard": 4096, "highmem": 8192, "highcpu": 1024}


def _image_json(project: str, name: str, family: str, state: str, replacement: str) -> Json:
    body: Json = {
        "kind": "compute#image", "id": str(uuid.uuid5(uuid.NAMESPACE_URL, name).int % 10**18),
        "creationTimestamp": "2025-06-05T10:21:33.140-07:00", "name": name,
        "description": f"Image {name}", "sourceType": "RAW", "status": "READY",
        "archiveSizeBytes": "32212254720", "diskSizeGb": "50",
        "selfLink": f"{API}/projects/{project}/global/images/{name}",
        "labelFingerprint": "42WmSpB8rSM=", "storageLocations": ["us", "eu", "asia"],
        "architecture": "X86_64",
    }
    if family:
        body["family"] = family
    if state:
        body["deprecated"] = {"state": state, "deprecated": _now(),
                              **({"replacement": replacement} if replacement else {})}
    return body


def _machine_type_json(project: str, zone: str, name: str) -> Json:
    """vCPUs and memory as the name says (n1-standard-8: 8 vCPUs); GPU families with theirs."""
    family, _, size = name.rpartition("-")
    gpu = GPU_SHAPES.get(family)
    count = int(size.rstrip("g")) if size.rstrip("g").isdigit() else 1
    if gpu is not None:
        cpus, memory_mb = gpu[1] * count, gpu[2] * count
    else:
        cpus = count if size.isdigit() else 2
        memory_mb = cpus * MB_PER_CPU.get(family.rpartition("-")[2], 4096)
    body: Json = {
        "kind": "compute#machineType", "id": str(uuid.uuid5(uuid.NAMESPACE_URL, name).int % 10**12),
        "creationTimestamp": "1969-12-31T16:00:00.000-08:00", "name": name,
        "description": f"{cpus} vCPUs, {memory_mb / 1024:g} GB RAM", "guestCpus": cpus,
        "memoryMb": memory_mb, "imageSpaceGb": 0, "maximumPersistentDisks": 128,
        "maximumPersistentDisksSizeGb": "263168", "zone": zone, "isSharedCpu": False,
        "selfLink": f"{API}/projects/{project}/zones/{zone}/machineTypes/{name}",
        "architecture": "X86_64",
    }
    if gpu is not None:
        body["accelerators"] = [{"guestAcceleratorType": gpu[0], "guestAcceleratorCount": count}]
    return body
