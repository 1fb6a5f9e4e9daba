"""pytest plugin: a Kubernetes cluster whose JobSets run as real processes (controllers and a
kubelet on top of ``fake_kube.FakeKube`` and ``podlab.PodLab``).

Load it with ``pytest_plugins = [..., "kubecluster"]``; the fixture ``kube_cluster`` is a
started :class:`FakeCluster` on a fresh ``FakeKube`` and the session's pod lab (nodes
``node-1``..``node-3``; ``kube_cluster_factory(**options)`` makes one with other options)::

    def test_hello(kube_cluster: FakeCluster) -> None:
        custom = client.CustomObjectsApi(client.ApiClient(kube_cluster.kube.configuration()))
        custom.create_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", "default",
                                               "jobsets", jobset_manifest)

Each component is one thread with one level-triggered reconcile loop (woken by every change
the store reports, and every ``poll_s``), and talks to the store's internal API:

- nodes: Node objects for the lab's nodes: capacity/allocatable (cpu, memory, pods,
  ``nvidia.com/gpu`` for nodes given GPUs, ``set_gpus`` later as a device plugin does),
  ``kubernetes.io/hostname``, GKE's spot label and ``cloud.google.com/gke-spot=true:NoSchedule``
  taint for spot nodes, the four conditions with Ready=True.
- scheduler: binds pods without ``spec.nodeName`` to a Ready node that matches their
  nodeSelector and required node affinity, tolerates its NoSchedule/NoExecute taints and has
  room for their requests (cpu, memory, pods, extended resources), least requested first; else
  PodScheduled=False/Unschedulable and a ``FailedScheduling`` event, in the real message format.
  A pod needs its PersistentVolumeClaims to exist and be Bound. It adds the
  DefaultTolerationSeconds admission plugin's tolerations (not-ready and unreachable, NoExecute,
  ``eviction_s``) when it binds a pod that lacks them (there is no admission hook).
- storage: PersistentVolumeClaims are bound at once (a dynamic provisioner): volumeName
  ``pvc-<uid>``, capacity as requested; a directory per claim shared by every pod (RWX).
- kubelet: image check against ``images`` (``ErrImagePull`` then ``ImagePullBackOff``, events
  ``Failed`` and ``BackOff``), volumes (configMap and secret with items and modes, emptyDir,
  persistentVolumeClaim with subPath, fsGroup, readOnly; emptyDir's medium Memory is a plain
  directory), env (value, fieldRef, secretKeyRef,
  configMapKeyRef; ``CreateContainerConfigError``), securityContext runAsUser/runAsGroup,
  workingDir, command+args; the pod's sandbox, its status through Pending, Running and
  Succeeded/Failed, its log, a cluster DNS (pods with hostname+subdomain whose headless Service
  exists and selects them, pushed into every pod's /etc/hosts), graceful deletion (SIGTERM, the
  grace period, then the pod goes), and the processes of pods deleted by other means.
- Job controller (batch/v1, what JobSet uses): pods from the template (Indexed and NonIndexed),
  their names, labels, annotations, env ``JOB_COMPLETION_INDEX``, hostname, ownerReferences;
  status (active, ready, succeeded, failed, terminating, completedIndexes, startTime,
  completionTime); backoffLimit -> FailureTarget then Failed (active pods deleted); all
  completions -> SuccessCriteriaMet then Complete; events.
- JobSet controller (v1alpha2): the webhook's defaults (written on the first reconcile), the
  headless Service, a Job per replica with JobSet's labels and annotations, replicatedJobsStatus,
  the default failure policy (restart while ``restarts < maxRestarts``: every Job deleted with
  Foreground, then recreated with the next restart-attempt; else Failed/ReachedMaxRestarts, or
  FailedJobs without a failurePolicy, with "(first failed job: ...)" as JobSet writes it), success
  policy (All/Any, targetReplicatedJobs) -> Completed, terminalState, the active Jobs of a
  finished JobSet deleted (Foreground), conditions and events as JobSet emits them; spec.suspend
  passed to its Jobs (a suspended Job makes no pods) with the Suspended condition.
- Kueue (``kueue=True``): its LocalQueue and Workload CRDs; a JobSet labelled
  ``kueue.x-k8s.io/queue-name`` gets a Workload it owns, QuotaReserved False (Pending with
  ``kueue_pending``, or Inadmissible when the LocalQueue is missing) until ``admit_queued``,
  then QuotaReserved and Admitted True and the JobSet unsuspended. No quota arithmetic, no
  ClusterQueues, cohorts, flavors' node selectors or admission checks; Kueue's webhook does not
  suspend a JobSet (the tool submits it suspended).
- what a node gives every pod beyond its spec (``node_hosts``, ``node_files``): names it
  resolves (GKE's metadata server, Google's APIs: ``fake_gcs.FakeGCS.hosts_entries()``) and
  files standing in for the image's (a CA store that trusts a fake's certificate); and
  Workload Identity's answer to "who is the pod at this address" (``pod_principal``: its
  ServiceAccount's ``iam.gke.io/gcp-service-account``, else the KSA's principal in the
  project's workload identity pool), which ``FakeGCS``'s metadata server asks.
- node lifecycle: ``lose_node`` (the processes are gone and nothing reports; a log request for
  a pod bound to it fails with 500 "dial tcp ...:10250: i/o timeout" after the server's dial
  (``FakeKube.kubelet_dial_s``); after
  ``node_monitor_grace_s`` (real default 40 s, 50 s from Kubernetes 1.32) Ready goes Unknown,
  ``NodeStatusUnknown``/"Kubelet stopped posting node status.", taints unreachable NoSchedule
  and NoExecute; pods' Ready goes False, their phase stays; after their toleration
  (``eviction_s``, real 300 s) they are deleted and stay Terminating), ``restore_node``,
  ``preempt_node`` (GKE spot preemption by graceful node shutdown: SIGTERM, min(grace, the pod's
  terminationGracePeriodSeconds), phase Failed, reason Terminated, DisruptionTarget; the node goes
  NotReady, and after ``node_monitor_grace_s`` its Node object and its pods are deleted, as
  GKE and the pod garbage collector do), ``kill_container``.

Not modelled: container restarts (restartPolicy OnFailure and Always behave as Never: a failed
container fails its pod; podlab cannot restart a container in its sandbox), pods with more than
one container (only the first runs; init containers and sidecars are ignored), probes (a running
container is ready), Job backoff delays, podFailurePolicy, successPolicy of Jobs, suspending a Job
that has pods, ttlSecondsAfterFinished, activeDeadlineSeconds, the job-tracking finalizer (the Job
controller remembers pods in memory), JobSet's failurePolicy rules, startupPolicy, coordinator,
exclusive placement, in-place and per-Job restarts, TTL, the node's heartbeat (Node objects are
only written on changes), node addresses that anything can reach (InternalIP is made up), the
pod's IP while it waits for its image or its configuration (there is no sandbox yet), preemption
of lower-priority pods, pod and node affinity other than required node affinity, topology spread,
services other than the headless ones' DNS, admission (defaults are written later), the sandbox of
a pod whose volume is missing (the pod stays ContainerCreating, event FailedMount), supplementary
groups (podlab has none: fsGroup sets the volume's group, the process gets it only as its
runAsGroup).
"""

from __future__ import annotations

import base64
import contextlib
import copy
import hashlib
import os
import re
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fake_kube import FakeKube, KubeError, Store, kueue_crd_objects, now_rfc3339
from podlab import (
    HostPath,
    PodLab,
    PodLabError,
    PodProcess,
    PodRun,
    Running,
    Terminated,
    pod_dns_names,
)

Json = dict[str, Any]
GPU = "nvidia.com/gpu"
SPOT_LABEL = "cloud.google.com/gke-spot"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
WI_ANNOTATION = "iam.gke.io/gcp-service-account"
WI_PROJECT, WI_PROJECT_NUMBER = "orchestrate-test", "123456789012"
NOT_READY_TAINT = "node.kubernetes.io/not-ready"
UNREACHABLE_TAINT = "node.kubernetes.io/unreachable"
JOBSET = "jobset.sigs.k8s.io/"
JOBSET_NAME, JOBSET_UID = JOBSET + "jobset-name", JOBSET + "jobset-uid"
RESTARTS = JOBSET + "restart-attempt"
REPLICATED_JOB = JOBSET + "replicatedjob-name"
JOB_INDEX = JOBSET + "job-index"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
CONTROLLER_UID = "batch.kubernetes.io/controller-uid"
NODE_CONDITIONS = ("MemoryPressure", "DiskPressure", "PIDPressure", "Ready")
SHUTDOWN_MESSAGE = "Pod was terminated in response to imminent node shutdown."
BACKOFF_LIMIT_MESSAGE = "Job has reached the specified backoff limit"
COMPLETIONS_MESSAGE = "Reached expected number of succeeded pods"
QUANTITY = re.compile(r"^([0-9.]+)([a-zA-Z]*)$")
UNITS = {"": 1.0, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2.0 ** 10,
         "Mi": 2.0 ** 20, "Gi": 2.0 ** 30, "Ti": 2.0 ** 40}


def parse_quantity(value: Any) -> float:
    """A resource quantity ("500m", "2", "1Gi") as a number."""
    match = QUANTITY.match(str(value))
    if not match or match.group(2) not in UNITS:
        raise ValueError(f"not a quantity: {value!r}")
    return float(match.group(1)) * UNITS[match.group(2)]


def normalize_image(ref: str) -> str:
    """containerd's full reference: ``python:3.11`` -> ``docker.io/library/python:3.11``."""
    name, _, digest = ref.partition("@")
    first = name.split("/", 1)[0]
    if "/" not in name:
        name = f"docker.io/library/{name}"
    elif "." not in first and ":" not in first and first != "localhost":
        name = f"docker.io/{name}"
    if not digest and ":" not in name.rsplit("/", 1)[-1]:
        name += ":latest"
    return name + (f"@{digest}" if digest else "")


def _condition(obj: Json, kind: str) -> Json | None:
    return next((c for c in (obj.get("status") or {}).get("conditions") or []
                 if c.get("type") == kind), None)


def _is_true(obj: Json, kind: str) -> bool:
    found = _condition(obj, kind)
    return found is not None and found.get("status") == "True"


def _set_condition(status: Json, condition: Json) -> bool:
    """Set a condition (lastTransitionTime kept unless the status changes); False: no change."""
    conditions: list[Json] = status.setdefault("conditions", [])
    for i, current in enumerate(conditions):
        if current["type"] == condition["type"]:
            same = {k: current.get(k) for k in condition} == condition
            if same:
                return False
            stamp = current.get("lastTransitionTime") if current.get("status") == \
                condition.get("status") else now_rfc3339()
            conditions[i] = {**current, **condition, "lastTransitionTime": stamp}
            return True
    conditions.append({**condition, "lastTransitionTime": now_rfc3339()})
    return True


def _terminal(pod: Json) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def _deleting(obj: Json) -> bool:
    return bool(obj["metadata"].get("deletionTimestamp"))


def _requests(pod: Json) -> dict[str, float]:
    total: dict[str, float] = {"pods": 1.0}
    for container in pod["spec"].get("containers") or []:
        resources = container.get("resources") or {}
        asked = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
        for name, value in asked.items():
            if name in ("cpu", "memory") or "/" in name:
                total[name] = total.get(name, 0.0) + parse_quantity(value)
    return total


def _tolerates(tolerations: list[Json], taint: Json) -> bool:
    for toleration in tolerations:
        if toleration.get("effect") and toleration["effect"] != taint["effect"]:
            continue
        if toleration.get("operator") == "Exists":
            if not toleration.get("key") or toleration["key"] == taint["key"]:
                return True
        elif toleration.get("key") == taint["key"] and \
                toleration.get("value", "") == taint.get("value", ""):
            return True
    return False


def _matches_expression(labels: Mapping[str, str], expression: Json) -> bool:
    key, operator, values = expression["key"], expression["operator"], expression.get("values") or []
    if operator == "In":
        return labels.get(key) in values
    if operator == "NotIn":
        return labels.get(key) not in values
    if operator == "Exists":
        return key in labels
    if operator == "DoesNotExist":
        return key not in labels
    return False


def _matches_node(pod: Json, node: Json) -> bool:
    labels: dict[str, str] = node["metadata"].get("labels") or {}
    if any(labels.get(k) != v for k, v in (pod["spec"].get("nodeSelector") or {}).items()):
        return False
    required = (((pod["spec"].get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution") or {})
    terms = required.get("nodeSelectorTerms") or []
    return not terms or any(all(_matches_expression(labels, e) for e in t.get("matchExpressions") or [])
                            for t in terms)


def _selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


# -- the cluster ---------------------------------------------------------------------------
def ksa_principal(namespace: str, account: str) -> str:
    """A Kubernetes service account's principal in the test project's workload identity pool
    (what a bucket's IAM binding names under Workload Identity Federation for GKE)."""
    return (f"principal://iam.googleapis.com/projects/{WI_PROJECT_NUMBER}/locations/global/"
            f"workloadIdentityPools/{WI_PROJECT}.svc.id.goog/subject/ns/{namespace}/sa/{account}")


@dataclass
class _PodRecord:
    """What the kubelet keeps of one pod it runs."""

    uid: str
    namespace: str
    name: str
    node: str
    container: str
    process: PodProcess | None = None
    pulls_failed: int = 0
    config_error: str = ""  # the last CreateContainerConfigError or FailedMount message
    reported: str = ""  # the last container state written: waiting, running, terminated
    stopping: threading.Thread | None = None
    shutdown: bool = False  # ended by a graceful node shutdown


@dataclass
class _Loop:
    """One controller: its reconcile function, run by one thread when woken or every poll_s."""

    name: str
    reconcile: Callable[[], None]
    wake: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    errors: list[str] = field(default_factory=list)


class FakeCluster:
    """Controllers, a scheduler and a kubelet on a FakeKube and a PodLab; see the module
    docstring."""

    def __init__(self, kube: FakeKube, lab: PodLab, *, gpus: Mapping[str, int] | None = None,
                 spot: Collection[str] = (), images: Collection[str] = ("python:3.11",),
                 cpu: str = "8", memory: str = "32Gi", max_pods: int = 110,
                 node_monitor_grace_s: float = 40.0, eviction_s: int = 300,
                 poll_s: float = 0.1, kueue: bool = False,
                 node_hosts: Mapping[str, str] | None = None,
                 node_files: Mapping[str, HostPath] | None = None,
                 kueue_pending: str = "couldn't assign flavors to pod set worker: insufficient "
                                      "unused quota for nvidia.com/gpu in flavor default-flavor, "
                                      "8 more needed") -> None:
        """Args:
            kube: the API server (started); its store gets the controllers.
            lab: the pod lab whose nodes become the cluster's nodes.
            gpus: node -> number of ``nvidia.com/gpu`` it has (default: none).
            spot: nodes labelled and tainted as GKE spot nodes.
            images: the references the fake registry has (normalised as containerd does).
            node_monitor_grace_s: how long a silent node stays Ready (real: 40 s; 50 s from 1.32).
            eviction_s: the tolerationSeconds the DefaultTolerationSeconds admission adds
                (real: 300 s).
            kueue: Kueue installed (its LocalQueue and Workload CRDs; the test makes the
                LocalQueues) with its JobSet integration.
            kueue_pending: why Kueue does not admit a Workload yet (its QuotaReserved message).
            node_hosts: names every pod resolves beyond the cluster DNS (name -> address), as
                a GKE node gives ``metadata.google.internal`` (its metadata server) and the
                internet gives Google's APIs: ``fake_gcs.FakeGCS.hosts_entries()``.
            node_files: files every pod sees at these paths beyond its volumes, standing in
                for what the image holds (e.g. a CA store that trusts a fake's certificate).
        """
        self.kube = kube
        self.store: Store = kube.store
        self.lab = lab
        self.nodes = list(lab.nodes)
        self.gpus = dict(gpus or {})
        self.spot = set(spot)
        self.images = set(images)
        self.capacity = {"cpu": cpu, "memory": memory, "pods": str(max_pods)}
        self.node_monitor_grace_s = node_monitor_grace_s
        self.eviction_s = eviction_s
        self.poll_s = poll_s
        self.kueue = kueue
        self.kueue_pending = kueue_pending
        self.node_hosts = dict(node_hosts or {})
        self.node_files = dict(node_files or {})
        self._kueue_admits = False
        self.dir = Path(tempfile.mkdtemp(prefix="kubecluster-"))
        self.dir.chmod(0o755)  # the pods' users read their volumes below it
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._records: dict[str, _PodRecord] = {}
        self._hosts: dict[str, str] = {}
        self._down: dict[str, float] = {}  # node -> when it stopped reporting
        self._shut_down: set[str] = set()  # nodes whose VM was preempted (deleted later)
        self._unreachable_since: dict[str, float] = {}
        self._job_pods: dict[str, dict[str, Json]] = {}  # job uid -> pod uid -> last seen pod
        self._counted: dict[str, dict[str, str]] = {}  # job uid -> pod uid -> counted outcome
        self._loops = [_Loop("scheduler", self._schedule), _Loop("storage", self._bind_claims),
                       _Loop("kubelet", self._kubelet), _Loop("job-controller", self._sync_jobs),
                       _Loop("jobset-controller", self._sync_jobsets),
                       _Loop("kueue", self._sync_kueue),
                       _Loop("node-lifecycle", self._node_lifecycle)]
        self._started = False

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> FakeCluster:
        """Register the nodes and start every controller's thread."""
        for node in self.nodes:
            self.store.create("nodes", self._node_object(node))
        if self.kueue:
            for crd in kueue_crd_objects():
                self.store.create("customresourcedefinitions", crd)
        self.store.register_pod_terminator(lambda pod: self._wake_all())
        self.store.subscribe(lambda type_, resource, obj: self._wake_all())
        for loop in self._loops:
            loop.thread = threading.Thread(target=self._run, args=(loop,), daemon=True,
                                           name=f"kubecluster {loop.name}")
            loop.thread.start()
        self._started = True
        return self

    def close(self) -> None:
        """Stop the controllers (threads joined) and remove every pod process the kubelet made."""
        self._stop.set()
        self._wake_all()
        for loop in self._loops:
            if loop.thread is not None:
                loop.thread.join(30)
        with self._lock:
            records = list(self._records.values())
            self._records.clear()
        for record in records:
            if record.stopping is not None:
                record.stopping.join(30)
            if record.process is not None:
                self.lab.remove_pod(record.process)
        for node in self.nodes:
            self.lab.start_node(node)
        shutil.rmtree(self.dir, ignore_errors=True)

    def errors(self) -> list[str]:
        """What the controllers' loops raised (a test may assert there is nothing)."""
        return [f"{loop.name}: {e}" for loop in self._loops for e in loop.errors]

    def _wake_all(self) -> None:
        for loop in self._loops:
            loop.wake.set()

    def _run(self, loop: _Loop) -> None:
        while not self._stop.is_set():
            loop.wake.wait(self.poll_s)
            loop.wake.clear()
            if self._stop.is_set():
                return
            try:
                loop.reconcile()
            except KubeError as exc:  # a conflict or a vanished object: the next pass retries
                if exc.code not in (404, 409):
                    loop.errors.append(str(exc))
                loop.wake.set()
                time.sleep(0.02)
            except Exception as exc:  # a controller keeps running, as one does
                loop.errors.append(f"{type(exc).__name__}: {exc}")
                time.sleep(self.poll_s)

    def namespace_with_claim(self, namespace: str = "ml", claim: str = "shared") -> None:
        """Namespace ``namespace`` with a ReadWriteMany claim ``claim`` of 1Gi in it (bound by
        the storage loop), as a team's namespace for training has."""
        self.store.create("namespaces", {"metadata": {"name": namespace}})
        self.store.create("persistentvolumeclaims", {"metadata": {"name": claim}, "spec": {
            "accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}}},
            namespace=namespace)

    # -- faults --------------------------------------------------------------------------
    def lose_node(self, node: str) -> None:
        """The node stops: its processes are gone, nothing reports for it any more."""
        with self._lock:
            self._down[node] = time.monotonic()
        self.kube.kubelet_down(node, self._address(node))
        self.lab.kill_node(node)
        self._wake_all()

    def _address(self, node: str) -> str:
        """The node's InternalIP, as its Node object says."""
        try:
            addresses = self.store.get("nodes", node)["status"].get("addresses") or []
        except KubeError:
            return "10.128.0.255"
        return next((a["address"] for a in addresses if a["type"] == "InternalIP"), "10.128.0.255")

    def restore_node(self, node: str) -> None:
        """The node is back, empty: Ready again, its taints gone. Its kubelet finds no container
        of the pods still bound to it: the deleted ones go, the others end Failed
        (ContainerStatusUnknown, as kubelet reports a container it cannot find). A preempted
        node's Node object is made again, as a managed instance group recreates the VM."""
        with self._lock:
            self._down.pop(node, None)
            self._shut_down.discard(node)
            self._unreachable_since.pop(node, None)
            stale = [r for r in self._records.values() if r.node == node]
            for record in stale:
                del self._records[record.uid]
        self.kube.kubelet_up(node)
        for record in stale:
            if record.process is not None:
                self.lab.remove_pod(record.process)
        self.lab.start_node(node)
        try:
            current = self.store.get("nodes", node)
        except KubeError:
            self.store.create("nodes", self._node_object(node))
        else:
            fresh = self._node_object(node)
            current["status"]["conditions"] = fresh["status"]["conditions"]
            self.store.update_status("nodes", current)
            self._patch_node(node, ready=("True", "KubeletReady", "kubelet is posting ready status"),
                             taints=[])
        for pod in self.store.list("pods", field_selector=f"spec.nodeName={node}"):
            if _deleting(pod):
                with contextlib.suppress(KubeError):
                    self.store.finish_pod_deletion(pod["metadata"]["namespace"],
                                                   pod["metadata"]["name"])
            elif not _terminal(pod):
                self._container_unknown(pod)
        self._wake_all()

    def _container_unknown(self, pod: Json) -> None:
        terminated = {"exitCode": 137, "reason": "ContainerStatusUnknown", "message":
                      "The container could not be located when the pod was terminated",
                      "startedAt": None, "finishedAt": None}

        def change(status: Json) -> None:
            status["phase"] = "Failed"
            status["containerStatuses"] = [self._container_status(pod, {"terminated": terminated})]
            for kind in ("Ready", "ContainersReady"):
                _set_condition(status, {"type": kind, "status": "False", "reason": "PodFailed"})

        self._update_pod_status(pod, change)

    def preempt_node(self, node: str, grace_s: int = 15) -> None:
        """A GKE spot preemption by graceful node shutdown: the node goes NotReady ("node is
        shutting down", not-ready taints), every pod on it gets SIGTERM and
        ``min(grace_s, terminationGracePeriodSeconds)`` and ends Failed/Terminated; after
        ``node_monitor_grace_s`` the Node object and its pods go. Returns once the pods ended."""
        with self._lock:
            self._shut_down.add(node)  # the kubelet starts nothing more there
            records = [r for r in self._records.values() if r.node == node and r.process]
            for record in records:
                record.shutdown = True
        self._patch_node(node, ready=("False", "KubeletNotReady", "node is shutting down"),
                         taints=[self._taint(NOT_READY_TAINT, "NoSchedule"),
                                 self._taint(NOT_READY_TAINT, "NoExecute")])
        threads = []
        for record in records:
            assert record.process is not None
            try:
                pod = self.store.get("pods", record.name, record.namespace)
                grace = min(grace_s, int(pod["spec"].get("terminationGracePeriodSeconds", 30)))
            except KubeError:
                grace = grace_s
            threads.append(record.process.terminate_in_background(grace))
        for thread in threads:
            thread.join()
        for record in records:
            self._report_shutdown(record)
        with self._lock:
            self._down[node] = time.monotonic()
        self.kube.kubelet_down(node, self._address(node))
        self.lab.kill_node(node)
        self._wake_all()

    def pod_principal(self, ip: str) -> str | None:
        """Who the pod at ``ip`` is to Google Cloud, as GKE's metadata server answers under
        Workload Identity (it knows a pod by its address): the Google service account its
        Kubernetes service account's ``iam.gke.io/gcp-service-account`` annotation names, else
        the KSA's own principal of the project's workload identity pool; None for no pod."""
        with self._lock:
            record = next((r for r in self._records.values() if r.process is not None
                           and not r.process.removed and r.process.ip == ip), None)
        if record is None:
            return None
        try:
            pod = self.store.get("pods", record.name, record.namespace)
        except KubeError:
            return None
        account = pod["spec"].get("serviceAccountName") or "default"
        try:
            ksa = self.store.get("serviceaccounts", account, record.namespace)
        except KubeError:
            ksa = {}
        email = ((ksa.get("metadata") or {}).get("annotations") or {}).get(WI_ANNOTATION)
        return email or ksa_principal(record.namespace, account)

    def kill_container(self, name: str, namespace: str = "default") -> None:
        """SIGKILL the pod's container (it ends with 137, reason Error)."""
        with self._lock:
            record = next((r for r in self._records.values()
                           if (r.name, r.namespace) == (name, namespace)), None)
        if record is None or record.process is None:
            raise PodLabError(f"no running pod {namespace}/{name} in the cluster")
        record.process.kill()
        self._wake_all()

    def set_gpus(self, node: str, count: int) -> None:
        """The node now has ``count`` GPUs (its device plugin registered them)."""
        self.gpus[node] = count
        current = self.store.get("nodes", node)
        for key in ("capacity", "allocatable"):
            current["status"][key][GPU] = str(count)
        self.store.update_status("nodes", current)

    # -- nodes ---------------------------------------------------------------------------
    def _node_object(self, node: str) -> Json:
        capacity = {**self.capacity, "ephemeral-storage": "100Gi"}
        if self.gpus.get(node):
            capacity[GPU] = str(self.gpus[node])
        labels = {"kubernetes.io/hostname": node, "kubernetes.io/os": "linux",
                  "kubernetes.io/arch": "amd64"}
        spec: Json = {}
        if node in self.spot:
            labels[SPOT_LABEL] = "true"
            spec["taints"] = [{"key": SPOT_LABEL, "value": "true", "effect": "NoSchedule"}]
        now = now_rfc3339()
        conditions = [{"type": kind, "status": "False", "reason": f"KubeletHasNo{kind}",
                       "message": f"kubelet has no {kind}", "lastHeartbeatTime": now,
                       "lastTransitionTime": now} for kind in NODE_CONDITIONS[:3]]
        conditions.append({"type": "Ready", "status": "True", "reason": "KubeletReady",
                           "message": "kubelet is posting ready status", "lastHeartbeatTime": now,
                           "lastTransitionTime": now})
        index = self.nodes.index(node) + 2
        index_hex = hashlib.md5(node.encode()).hexdigest()
        return {"metadata": {"name": node, "labels": labels}, "spec": spec, "status": {
            "capacity": capacity, "allocatable": dict(capacity), "conditions": conditions,
            "addresses": [{"type": "InternalIP", "address": f"10.128.0.{index}"},
                          {"type": "Hostname", "address": node}],
            "nodeInfo": {"kubeletVersion": "v1.31.0", "kubeProxyVersion": "v1.31.0",
                         "containerRuntimeVersion": "podlab://1", "operatingSystem": "linux",
                         "architecture": "amd64", "osImage": "Debian GNU/Linux 12 (bookworm)",
                         "kernelVersion": os.uname().release, "machineID": index_hex,
                         "systemUUID": index_hex, "bootID": index_hex}}}

    @staticmethod
    def _taint(key: str, effect: str) -> Json:
        return {"key": key, "effect": effect, "timeAdded": now_rfc3339()}

    def _patch_node(self, node: str, ready: tuple[str, str, str], taints: list[Json],
                    all_conditions: bool = False) -> None:
        """Set the node's Ready condition (every condition with ``all_conditions``) and replace
        the taints the node lifecycle owns (not-ready, unreachable) with ``taints``."""
        try:
            current = self.store.get("nodes", node)
        except KubeError:
            return
        status, message = ready[0], ready[2]
        for kind in NODE_CONDITIONS if all_conditions else ("Ready",):
            reason = ready[1] if kind == "Ready" or all_conditions else ""
            _set_condition(current["status"], {"type": kind, "status": status, "reason": reason,
                                               "message": message})
        self.store.update_status("nodes", current)
        current = self.store.get("nodes", node)
        owned = (NOT_READY_TAINT, UNREACHABLE_TAINT)
        kept = [t for t in current["spec"].get("taints") or [] if t["key"] not in owned]
        current["spec"]["taints"] = kept + taints
        if not current["spec"]["taints"]:
            del current["spec"]["taints"]
        self.store.update("nodes", current)

    def _node_lifecycle(self) -> None:
        now = time.monotonic()
        with self._lock:
            down = dict(self._down)
            shut_down = set(self._shut_down)
        for node, since in down.items():
            if now - since < self.node_monitor_grace_s:
                continue
            if node in shut_down:
                self._delete_node(node)
            elif node not in self._unreachable_since:
                self._mark_unreachable(node)
        self._evict(now)

    def _mark_unreachable(self, node: str) -> None:
        self._patch_node(node, ready=("Unknown", "NodeStatusUnknown",
                                      "Kubelet stopped posting node status."),
                         taints=[self._taint(UNREACHABLE_TAINT, "NoSchedule"),
                                 self._taint(UNREACHABLE_TAINT, "NoExecute")],
                         all_conditions=True)
        with self._lock:
            self._unreachable_since[node] = time.monotonic()
        for pod in self.store.list("pods", field_selector=f"spec.nodeName={node}"):
            if not _terminal(pod):
                self._update_pod_status(pod, lambda status: _set_condition(
                    status, {"type": "Ready", "status": "False"}))

    def _evict(self, now: float) -> None:
        """The taint manager: pods on an unreachable node go once their toleration runs out."""
        with self._lock:
            unreachable = dict(self._unreachable_since)
        for node, since in unreachable.items():
            taint = {"key": UNREACHABLE_TAINT, "effect": "NoExecute"}
            for pod in self.store.list("pods", field_selector=f"spec.nodeName={node}"):
                if _deleting(pod):
                    continue
                tolerations = [t for t in pod["spec"].get("tolerations") or []
                               if _tolerates([t], taint)]
                seconds = [t.get("tolerationSeconds") for t in tolerations]
                if tolerations and None in seconds:
                    continue
                limit = min((s for s in seconds if s is not None), default=0)
                if now - since >= limit:
                    self.store.record_event(pod, "TaintManagerEviction",
                                            f"Marking for deletion Pod {pod['metadata']['namespace']}/"
                                            f"{pod['metadata']['name']}",
                                            component="taint-eviction-controller")
                    self.store.delete("pods", pod["metadata"]["name"], pod["metadata"]["namespace"])

    def _delete_node(self, node: str) -> None:
        """The preempted VM is gone: its Node object goes and the pod garbage collector
        force-deletes the pods bound to it."""
        with contextlib.suppress(KubeError):
            self.store.delete("nodes", node)
        for pod in self.store.list("pods", field_selector=f"spec.nodeName={node}"):
            with contextlib.suppress(KubeError):
                self.store.delete("pods", pod["metadata"]["name"], pod["metadata"]["namespace"],
                                  grace_period_seconds=0)

    # -- storage -------------------------------------------------------------------------
    def _bind_claims(self) -> None:
        for claim in self.store.list("persistentvolumeclaims"):
            if (claim.get("status") or {}).get("phase") == "Bound" or _deleting(claim):
                continue
            spec = claim["spec"]
            claim["spec"]["volumeName"] = f"pvc-{claim['metadata']['uid']}"
            claim.setdefault("metadata", {}).setdefault("annotations", {})[
                "pv.kubernetes.io/bind-completed"] = "yes"
            claim = self.store.update("persistentvolumeclaims", claim)
            storage = ((spec.get("resources") or {}).get("requests") or {}).get("storage", "1Gi")
            claim["status"] = {"phase": "Bound", "accessModes": spec.get("accessModes") or [],
                               "capacity": {"storage": storage}}
            self.store.update_status("persistentvolumeclaims", claim)
            self._claim_dir(claim["metadata"]["namespace"], claim["metadata"]["name"])

    def _claim_dir(self, namespace: str, name: str) -> Path:
        path = self.dir / "volumes" / f"{namespace}_{name}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    # -- scheduler -----------------------------------------------------------------------
    def _schedule(self) -> None:
        pods = self.store.list("pods")
        nodes = self.store.list("nodes")
        used: dict[str, dict[str, float]] = {n["metadata"]["name"]: {} for n in nodes}
        for pod in pods:
            node = pod["spec"].get("nodeName")
            if node in used and not _terminal(pod):
                for name, value in _requests(pod).items():
                    used[node][name] = used[node].get(name, 0.0) + value
        for pod in pods:
            spec = pod["spec"]
            if spec.get("nodeName") or _deleting(pod) or \
                    spec.get("schedulerName", "default-scheduler") != "default-scheduler":
                continue
            self._schedule_pod(pod, nodes, used)

    def _schedule_pod(self, pod: Json, nodes: list[Json], used: dict[str, dict[str, float]]) -> None:
        claim_problem = self._claim_problem(pod)
        asked = _requests(pod)
        fits: list[tuple[float, str]] = []
        reasons: dict[str, int] = {}
        helpless: dict[str, int] = {}
        for node in nodes:
            name = node["metadata"]["name"]
            why = [claim_problem] if claim_problem else self._unfit(pod, node, asked, used[name])
            if not why:
                allocatable = node["status"].get("allocatable") or {}
                load = sum(used[name].get(r, 0.0) / parse_quantity(allocatable[r])
                           for r in ("cpu", "memory", "pods") if r in allocatable)
                fits.append((load, name))
                continue
            for reason in why:
                reasons[reason] = reasons.get(reason, 0) + 1
            victimless = all(r.startswith(("Insufficient", "Too many")) for r in why)
            key = "No preemption victims found for incoming pod" if victimless else \
                "Preemption is not helpful for scheduling"
            helpless[key] = helpless.get(key, 0) + 1
        meta = pod["metadata"]
        if fits:
            chosen = min(fits)[1]
            self._add_default_tolerations(pod)
            self.store.bind(meta["namespace"], meta["name"], chosen)
            for name, value in asked.items():
                used[chosen][name] = used[chosen].get(name, 0.0) + value
            self.store.record_event(pod, "Scheduled", f"Successfully assigned {meta['namespace']}/"
                                    f"{meta['name']} to {chosen}", component="default-scheduler")
            return
        total = len(nodes)
        message = f"0/{total} nodes are available: " + ", ".join(
            sorted(f"{n} {r}" for r, n in reasons.items())) + "."
        if claim_problem:
            message = f"0/{total} nodes are available: {claim_problem}."
        message += f" preemption: 0/{total} nodes are available: " + ", ".join(
            sorted(f"{n} {r}" for r, n in helpless.items())) + "."
        condition = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                     "message": message}
        changed = [False]

        def mark(status: Json) -> None:
            changed[0] = _set_condition(status, condition)

        self._update_pod_status(pod, mark)
        if changed[0]:
            self.store.record_event(pod, "FailedScheduling", message, "Warning",
                                    component="default-scheduler")

    def _claim_problem(self, pod: Json) -> str:
        for volume in pod["spec"].get("volumes") or []:
            claim = (volume.get("persistentVolumeClaim") or {}).get("claimName")
            if not claim:
                continue
            try:
                found = self.store.get("persistentvolumeclaims", claim, pod["metadata"]["namespace"])
            except KubeError:
                return f'persistentvolumeclaim "{claim}" not found'
            if (found.get("status") or {}).get("phase") != "Bound":
                return "pod has unbound immediate PersistentVolumeClaims"
        return ""

    def _unfit(self, pod: Json, node: Json, asked: Mapping[str, float],
               used: Mapping[str, float]) -> list[str]:
        """Why the pod cannot go on the node, as the first failing filter plugin says it."""
        if node["spec"].get("unschedulable"):
            return ["node(s) were unschedulable"]
        tolerations = pod["spec"].get("tolerations") or []
        for taint in node["spec"].get("taints") or []:
            if taint["effect"] in ("NoSchedule", "NoExecute") and not _tolerates(tolerations, taint):
                return [f"node(s) had untolerated taint {{{taint['key']}: {taint.get('value', '')}}}"]
        if not _matches_node(pod, node):
            return ["node(s) didn't match Pod's node affinity/selector"]
        allocatable = node["status"].get("allocatable") or {}
        short = []
        for name, value in sorted(asked.items()):
            have = parse_quantity(allocatable.get(name, "0"))
            if used.get(name, 0.0) + value > have + 1e-9:
                short.append("Too many pods" if name == "pods" else f"Insufficient {name}")
        return short

    def _add_default_tolerations(self, pod: Json) -> None:
        tolerations = list(pod["spec"].get("tolerations") or [])
        added = False
        for key in (NOT_READY_TAINT, UNREACHABLE_TAINT):
            if not any(t.get("key") == key and t.get("effect") in (None, "", "NoExecute")
                       for t in tolerations):
                tolerations.append({"key": key, "operator": "Exists", "effect": "NoExecute",
                                    "tolerationSeconds": self.eviction_s})
                added = True
        if added:
            meta = pod["metadata"]
            self.store.patch("pods", meta["name"], {"spec": {"tolerations": tolerations}},
                             meta["namespace"])

    # -- pod status ----------------------------------------------------------------------
    def _update_pod_status(self, pod: Json, change: Callable[[Json], Any]) -> Json | None:
        """Apply ``change`` to the pod's current status and write it (retries conflicts); None
        when the pod is gone."""
        meta = pod["metadata"]
        for _ in range(20):
            try:
                current = self.store.get("pods", meta["name"], meta["namespace"])
            except KubeError:
                return None
            if current["metadata"]["uid"] != meta["uid"]:
                return None
            status = current.setdefault("status", {})
            change(status)
            try:
                return self.store.update_status("pods", current, meta["namespace"])
            except KubeError as exc:
                if exc.code == 404:
                    return None
                if exc.code != 409:
                    raise
        raise KubeError(409, "Conflict", f"pod {meta['name']}: too many conflicts")

    @staticmethod
    def _container_status(pod: Json, state: Json, ready: bool = False, cid: str = "") -> Json:
        container = pod["spec"]["containers"][0]
        status = {"name": container["name"], "image": container.get("image", ""),
                  "imageID": "", "ready": ready, "restartCount": 0, "started": "running" in state,
                  "state": state}
        if cid:
            status["containerID"] = cid
            status["imageID"] = normalize_image(container.get("image", "")) + "@sha256:" + \
                hashlib.sha256(container.get("image", "").encode()).hexdigest()
        return status

    def _set_waiting(self, pod: Json, reason: str, message: str | None = None) -> None:
        waiting: Json = {"reason": reason}
        if message:
            waiting["message"] = message

        def change(status: Json) -> None:
            status["phase"] = "Pending"
            status.setdefault("startTime", now_rfc3339())
            status["containerStatuses"] = [self._container_status(pod, {"waiting": waiting})]
            _set_condition(status, {"type": "Initialized", "status": "True"})
            _set_condition(status, {"type": "Ready", "status": "False", "reason":
                                    "ContainersNotReady", "message": "containers with unready "
                                    f"status: [{pod['spec']['containers'][0]['name']}]"})
            _set_condition(status, {"type": "ContainersReady", "status": "False"})

        self._update_pod_status(pod, change)

    # -- kubelet -------------------------------------------------------------------------
    def _kubelet(self) -> None:
        pods = {p["metadata"]["uid"]: p for p in self.store.list("pods")}
        with self._lock:
            down = set(self._down)
            gone = [r for uid, r in self._records.items() if uid not in pods]
            for record in gone:
                del self._records[record.uid]
        for record in gone:  # deleted by other means (grace 0, namespace): no kubelet asked
            if record.process is not None:
                self.lab.remove_pod(record.process)
        for pod in pods.values():
            node = pod["spec"].get("nodeName")
            if node and node in self.nodes and node not in down:
                self._sync_pod(pod)
        self._publish_dns(pods)

    def _sync_pod(self, pod: Json) -> None:
        uid = pod["metadata"]["uid"]
        with self._lock:
            record = self._records.get(uid)
        if record is None:
            if _terminal(pod):
                return
            record = _PodRecord(uid, pod["metadata"]["namespace"], pod["metadata"]["name"],
                                pod["spec"]["nodeName"], pod["spec"]["containers"][0]["name"])
            with self._lock:
                self._records[uid] = record
        if _deleting(pod):
            self._sync_deletion(pod, record)
        elif record.process is None:
            if record.node in self._shut_down or _terminal(pod):
                return
            self._admit(pod, record)
        else:
            self._report(pod, record)

    def _admit(self, pod: Json, record: _PodRecord) -> None:
        container = pod["spec"]["containers"][0]
        image = container.get("image", "")
        if normalize_image(image) not in {normalize_image(i) for i in self.images}:
            self._image_missing(pod, record, image)
            return
        try:
            mounts = self._volumes(pod)
            env = self._env(pod, container, "")
        except _ConfigError as exc:
            if record.config_error == str(exc):
                return  # kubelet retries with a backoff; one event per distinct error here
            record.config_error = str(exc)
            if exc.reason == "FailedMount":
                self.store.record_event(pod, "FailedMount", str(exc), "Warning", component="kubelet")
                self._set_waiting(pod, "ContainerCreating")
            else:
                self._set_waiting(pod, "CreateContainerConfigError", str(exc))
                self.store.record_event(pod, "Failed", f"Error: {exc}", "Warning",
                                        component="kubelet")
            return
        run = self._pod_run(pod, container, env, mounts)
        try:
            process = self.lab.create_pod(run)
            env = self._env(pod, container, process.ip)
            if env != run.env:  # status.podIP: known once the sandbox has its address
                self.lab.remove_pod(process)
                process = self.lab.create_pod(self._pod_run(pod, container, env, mounts))
        except PodLabError:
            if record.node in self.lab.down:
                return  # the node was lost meanwhile
            raise
        record.process = process
        with self._lock:
            entries = {**self.node_hosts,
                       **{k: v for k, v in self._hosts.items() if v != process.ip}}
        process.set_hosts_entries(entries)
        self._update_pod_status(pod, lambda status: status.update(
            podIP=process.ip, podIPs=[{"ip": process.ip}], hostIP=self._host_ip(record.node),
            hostIPs=[{"ip": self._host_ip(record.node)}]))
        self._set_waiting(pod, "ContainerCreating")
        self.store.record_event(pod, "Pulled", f'Container image "{image}" already present on '
                                "machine", component="kubelet")
        process.start()
        self.store.record_event(pod, "Created", f"Created container {record.container}",
                                component="kubelet")
        self.store.record_event(pod, "Started", f"Started container {record.container}",
                                component="kubelet")
        self.store.set_log_source(record.namespace, record.name, record.container,
                                  process.log_path)
        record.reported = "waiting"

    def _host_ip(self, node: str) -> str:
        return f"10.128.0.{self.nodes.index(node) + 2}"

    def _image_missing(self, pod: Json, record: _PodRecord, image: str) -> None:
        full = normalize_image(image)
        error = (f'failed to pull and unpack image "{full}": failed to resolve reference '
                 f'"{full}": pull access denied, repository does not exist or may require '
                 "authorization: server message: insufficient_scope: authorization failed")
        record.pulls_failed += 1
        if record.pulls_failed == 1:
            self.store.record_event(pod, "Pulling", f'Pulling image "{image}"', component="kubelet")
            self.store.record_event(pod, "Failed", f'Failed to pull image "{image}": {error}',
                                    "Warning", component="kubelet")
            self.store.record_event(pod, "Failed", "Error: ErrImagePull", "Warning",
                                    component="kubelet")
            self._set_waiting(pod, "ErrImagePull", error)
        elif record.pulls_failed == 2:
            self.store.record_event(pod, "BackOff", f'Back-off pulling image "{image}"',
                                    component="kubelet")
            self.store.record_event(pod, "Failed", "Error: ImagePullBackOff", "Warning",
                                    component="kubelet")
            self._set_waiting(pod, "ImagePullBackOff",
                              f'Back-off pulling image "{image}": ErrImagePull: {error}')

    def _pod_run(self, pod: Json, container: Json, env: dict[str, str],
                 mounts: dict[str, HostPath]) -> PodRun:
        spec, meta = pod["spec"], pod["metadata"]
        pod_context = spec.get("securityContext") or {}
        context = {**pod_context, **(container.get("securityContext") or {})}
        return PodRun(name=meta["name"], namespace=meta["namespace"], node=spec["nodeName"],
                      command=tuple(container.get("command") or ()),
                      args=tuple(container.get("args") or ()), hostname=spec.get("hostname", ""),
                      subdomain=spec.get("subdomain", ""), env=env,
                      working_dir=container.get("workingDir") or "/",
                      run_as_user=context.get("runAsUser"), run_as_group=context.get("runAsGroup"),
                      mounts={**self.node_files, **mounts}, uid=meta["uid"])

    def _report(self, pod: Json, record: _PodRecord) -> None:
        assert record.process is not None
        if record.shutdown:  # preempt_node reports it
            return
        state = record.process.state()
        if isinstance(state, Running) and record.reported == "waiting":
            self._report_running(pod, record, state)
        elif isinstance(state, Terminated) and record.reported != "terminated":
            self._report_terminated(pod, record, state)

    def _report_running(self, pod: Json, record: _PodRecord, state: Running) -> None:
        cid = self._container_id(record)

        def change(status: Json) -> None:
            status["phase"] = "Running"
            status["containerStatuses"] = [self._container_status(
                pod, {"running": {"startedAt": state.started_at}}, True, cid)]
            for kind in ("Ready", "ContainersReady"):
                _set_condition(status, {"type": kind, "status": "True", "reason": None,
                                        "message": None})

        self._update_pod_status(pod, change)
        record.reported = "running"

    def _report_terminated(self, pod: Json, record: _PodRecord, state: Terminated,
                           shutdown: bool = False) -> None:
        cid = self._container_id(record)
        terminated: Json = {"exitCode": state.exit_code, "reason": state.reason,
                            "startedAt": state.started_at or None,
                            "finishedAt": state.finished_at or None, "containerID": cid}
        if state.signal:
            terminated["signal"] = state.signal
        if state.message:
            terminated["message"] = state.message
        succeeded = state.exit_code == 0 and not shutdown

        def change(status: Json) -> None:
            status["phase"] = "Succeeded" if succeeded else "Failed"
            status["containerStatuses"] = [self._container_status(
                pod, {"terminated": terminated}, False, cid)]
            reason = "PodCompleted" if succeeded else "PodFailed"
            for kind in ("Ready", "ContainersReady"):
                _set_condition(status, {"type": kind, "status": "False", "reason": reason,
                                        "message": None})
            if shutdown:
                status.update(reason="Terminated", message=SHUTDOWN_MESSAGE)
                _set_condition(status, {"type": "DisruptionTarget", "status": "True",
                                        "reason": "TerminationByKubelet",
                                        "message": SHUTDOWN_MESSAGE})

        self._update_pod_status(pod, change)
        record.reported = "terminated"

    def _report_shutdown(self, record: _PodRecord) -> None:
        assert record.process is not None
        state = record.process.state()
        try:
            pod = self.store.get("pods", record.name, record.namespace)
        except KubeError:
            return
        if isinstance(state, Terminated):
            self._report_terminated(pod, record, state, shutdown=True)

    @staticmethod
    def _container_id(record: _PodRecord) -> str:
        return "containerd://" + hashlib.sha256(record.uid.encode()).hexdigest()

    def _sync_deletion(self, pod: Json, record: _PodRecord) -> None:
        """Graceful deletion: SIGTERM and the pod's grace period, then confirm."""
        meta = pod["metadata"]
        process = record.process
        if process is not None and record.stopping is None and record.reported != "terminated":
            grace = int(meta.get("deletionGracePeriodSeconds") or 0)
            self.store.record_event(pod, "Killing", f"Stopping container {record.container}",
                                    component="kubelet")
            record.stopping = process.terminate_in_background(grace)
            return
        if record.stopping is not None and record.stopping.is_alive():
            return
        if process is not None:
            state = process.state()
            if isinstance(state, Terminated) and record.reported != "terminated":
                self._report_terminated(pod, record, state)
        with contextlib.suppress(KubeError):
            self.store.finish_pod_deletion(meta["namespace"], meta["name"])
        with self._lock:
            self._records.pop(record.uid, None)
        if process is not None:
            self.lab.remove_pod(process)

    def _publish_dns(self, pods: Mapping[str, Json]) -> None:
        """The cluster DNS: a headless Service's pods by hostname.subdomain, in every /etc/hosts."""
        services = {(s["metadata"]["namespace"], s["metadata"]["name"]): s
                    for s in self.store.list("services")}
        with self._lock:
            records = dict(self._records)
        entries: dict[str, str] = {}
        for uid, record in records.items():
            pod = pods.get(uid)
            if pod is None or record.process is None or _terminal(pod) or \
                    record.reported == "terminated":
                continue
            spec = pod["spec"]
            service = services.get((record.namespace, spec.get("subdomain", "")))
            if not spec.get("hostname") or service is None or not _selects(
                    service["spec"].get("selector") or {}, pod["metadata"].get("labels") or {}):
                continue
            if not service["spec"].get("publishNotReadyAddresses") and record.reported != "running":
                continue
            for name in pod_dns_names(spec["hostname"], spec["subdomain"], record.namespace):
                entries[name] = record.process.ip
        with self._lock:
            if entries == self._hosts:
                return
            self._hosts = entries
        for record in records.values():
            process = record.process
            if process is not None and not process.removed and not process.lost:
                with contextlib.suppress(OSError):
                    process.set_hosts_entries({**self.node_hosts, **{
                        k: v for k, v in entries.items() if v != process.ip}})

    # -- kubelet: configuration ------------------------------------------------------------
    def _volumes(self, pod: Json) -> dict[str, HostPath]:
        meta, spec = pod["metadata"], pod["spec"]
        base = self.dir / "pods" / meta["uid"]
        fs_group = (spec.get("securityContext") or {}).get("fsGroup")
        roots: dict[str, Path] = {}
        for volume in spec.get("volumes") or []:
            roots[volume["name"]] = self._volume(meta["namespace"], volume, base / volume["name"])
        mounts: dict[str, HostPath] = {}
        for mount in spec["containers"][0].get("volumeMounts") or []:
            if mount["name"] not in roots:
                raise _ConfigError("FailedMount", f'volume "{mount["name"]}" not found')
            path = roots[mount["name"]]
            if mount.get("subPath"):
                path = path / mount["subPath"]
                path.mkdir(parents=True, exist_ok=True)
            mounts[mount["mountPath"]] = HostPath(str(path), bool(mount.get("readOnly")))
        if fs_group is not None:
            for volume in spec.get("volumes") or []:
                _apply_fs_group(roots[volume["name"]], int(fs_group),
                                read_only="secret" in volume or "configMap" in volume,
                                volume=volume["name"])
        return mounts

    def _volume(self, namespace: str, volume: Json, target: Path) -> Path:
        name = volume["name"]
        if "emptyDir" in volume:
            target.mkdir(parents=True, exist_ok=True)
            target.chmod(0o777)
            return target
        if "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]["claimName"]
            return self._claim_dir(namespace, claim)
        for kind, resource, key in (("configMap", "configmaps", "name"),
                                    ("secret", "secrets", "secretName")):
            if kind not in volume:
                continue
            source = volume[kind]
            try:
                obj = self.store.get(resource, source[key], namespace)
            except KubeError as exc:
                if source.get("optional"):
                    obj = {}
                else:
                    singular = "configmap" if kind == "configMap" else "secret"
                    raise _ConfigError("FailedMount", f'MountVolume.SetUp failed for volume "{name}" '
                                       f': {singular} "{source[key]}" not found') from exc
            files = _decoded(obj, kind == "secret")
            target.mkdir(parents=True, exist_ok=True)
            items = source.get("items") or [{"key": k, "path": k} for k in files]
            for item in items:
                if item["key"] not in files:
                    raise _ConfigError("FailedMount", f'MountVolume.SetUp failed for volume '
                                       f'"{name}" : configmap references non-existent config key: '
                                       f'{item["key"]}')
                path = target / item["path"]
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(files[item["key"]])
                path.chmod(int(item.get("mode", source.get("defaultMode", 0o644))))
            return target
        raise _ConfigError("FailedMount", f'volume "{name}": a source this fake cannot mount '
                           f"(received {sorted(k for k in volume if k != 'name')})")

    def _env(self, pod: Json, container: Json, pod_ip: str) -> dict[str, str]:
        env: dict[str, str] = {}
        namespace = pod["metadata"]["namespace"]
        for var in container.get("env") or []:
            if "value" in var or "valueFrom" not in var:
                env[var["name"]] = _expand(str(var.get("value", "")), env)
                continue
            source = var["valueFrom"]
            if "fieldRef" in source:
                env[var["name"]] = _field_ref(pod, source["fieldRef"]["fieldPath"], pod_ip)
                continue
            for kind, resource, label in (("secretKeyRef", "secrets", "Secret"),
                                          ("configMapKeyRef", "configmaps", "ConfigMap")):
                if kind not in source:
                    continue
                ref = source[kind]
                try:
                    obj = self.store.get(resource, ref["name"], namespace)
                except KubeError as exc:
                    if ref.get("optional"):
                        break
                    raise _ConfigError("CreateContainerConfigError",
                                       f'{label.lower()} "{ref["name"]}" not found') from exc
                files = _decoded(obj, kind == "secretKeyRef")
                if ref["key"] not in files:
                    if ref.get("optional"):
                        break
                    raise _ConfigError("CreateContainerConfigError", f"couldn't find key "
                                       f"{ref['key']} in {label} {namespace}/{ref['name']}")
                env[var["name"]] = files[ref["key"]].decode(errors="replace")
        return env

    # -- Job controller ------------------------------------------------------------------
    def _sync_jobs(self) -> None:
        pods = self.store.list("pods")
        for job in self.store.list("jobs"):
            uid = job["metadata"]["uid"]
            owned = [p for p in pods if (p["metadata"].get("labels") or {}).get(CONTROLLER_UID) == uid]
            self._sync_job(job, owned)
        live = {j["metadata"]["uid"] for j in self.store.list("jobs")}
        for uid in [u for u in self._job_pods if u not in live]:
            self._job_pods.pop(uid, None)
            self._counted.pop(uid, None)

    def _sync_job(self, job: Json, pods: list[Json]) -> None:
        uid, spec = job["metadata"]["uid"], job["spec"]
        seen = self._job_pods.setdefault(uid, {})
        counted = self._counted.setdefault(uid, {})
        current = {p["metadata"]["uid"]: p for p in pods}
        for pod_uid, pod in current.items():
            seen[pod_uid] = pod
            phase = (pod.get("status") or {}).get("phase")
            if pod_uid not in counted and (phase in ("Succeeded", "Failed") or _deleting(pod)):
                counted[pod_uid] = "succeeded" if phase == "Succeeded" else "failed"
        for pod_uid in [u for u in seen if u not in current]:
            counted.setdefault(pod_uid, "failed")  # gone before it ended
        indexed = spec.get("completionMode") == "Indexed"
        active = [p for p in pods if not _terminal(p) and not _deleting(p)]
        done = {_index(seen[u]) for u, outcome in counted.items() if outcome == "succeeded"}
        succeeded = len(done) if indexed else sum(o == "succeeded" for o in counted.values())
        failed = sum(o == "failed" for o in counted.values())
        status = copy.deepcopy(job.get("status") or {})
        status.setdefault("startTime", now_rfc3339())
        finished = _is_true(job, "Complete") or _is_true(job, "Failed")
        if not finished and not _deleting(job):
            self._job_progress(job, status, active, failed, succeeded, done)
        active = [p for p in self.store.list("pods", job["metadata"]["namespace"],
                                             f"{CONTROLLER_UID}={uid}")
                  if not _terminal(p) and not _deleting(p)]
        terminating = [p for p in current.values() if _deleting(p) and not _terminal(p)]
        status.update(active=len(active), succeeded=succeeded, failed=failed,
                      terminating=len(terminating), ready=sum(_is_true(p, "Ready") for p in active),
                      uncountedTerminatedPods={})
        if indexed:
            status["completedIndexes"] = _ranges(sorted(done))
        self._job_finish(job, status, active + terminating)
        if status != job.get("status"):
            job["status"] = status
            self.store.update_status("jobs", job)

    def _job_progress(self, job: Json, status: Json, active: list[Json], failed: int,
                      succeeded: int, done: set[int]) -> None:
        spec = job["spec"]
        completions = int(spec.get("completions") or spec.get("parallelism", 1))
        if failed > int(spec.get("backoffLimit", 6)):
            _set_condition(status, {"type": "FailureTarget", "status": "True", "reason":
                                    "BackoffLimitExceeded", "message": BACKOFF_LIMIT_MESSAGE})
            for pod in active:
                self._delete_job_pod(job, pod)
            return
        if succeeded >= completions:
            _set_condition(status, {"type": "SuccessCriteriaMet", "status": "True", "reason":
                                    "CompletionsReached", "message": COMPLETIONS_MESSAGE})
            return
        if spec.get("suspend"):
            return
        room = int(spec.get("parallelism", 1)) - len(active)
        if spec.get("completionMode") == "Indexed":
            running = {_index(p) for p in active}
            wanted = [i for i in range(completions) if i not in done and i not in running]
        else:
            wanted = [-1] * (completions - succeeded - len(active))
        for index in wanted[:max(room, 0)]:
            self._create_job_pod(job, index)

    def _job_finish(self, job: Json, status: Json, unfinished: list[Json]) -> None:
        if unfinished or _is_true(job, "Complete") or _is_true(job, "Failed"):
            return
        if _is_true({"status": status}, "FailureTarget"):
            _set_condition(status, {"type": "Failed", "status": "True", "reason":
                                    "BackoffLimitExceeded", "message": BACKOFF_LIMIT_MESSAGE})
            self.store.record_event(job, "BackoffLimitExceeded", BACKOFF_LIMIT_MESSAGE, "Warning",
                                    component="job-controller")
        elif _is_true({"status": status}, "SuccessCriteriaMet"):
            _set_condition(status, {"type": "Complete", "status": "True", "reason":
                                    "CompletionsReached", "message": COMPLETIONS_MESSAGE})
            status["completionTime"] = now_rfc3339()
            self.store.record_event(job, "Completed", "Job completed", component="job-controller")

    def _create_job_pod(self, job: Json, index: int) -> None:
        meta, template = job["metadata"], job["spec"]["template"]
        pod_meta = copy.deepcopy(template.get("metadata") or {})
        pod_spec = copy.deepcopy(template["spec"])
        labels = pod_meta.setdefault("labels", {})
        annotations = pod_meta.setdefault("annotations", {})
        prefix = f"{meta['name']}-"
        if index >= 0:
            prefix = f"{meta['name']}-{index}-"
            labels[COMPLETION_INDEX] = annotations[COMPLETION_INDEX] = str(index)
            if pod_spec.get("subdomain") and not pod_spec.get("hostname"):
                pod_spec["hostname"] = f"{meta['name']}-{index}"
            for container in pod_spec.get("containers") or []:
                env = container.setdefault("env", [])
                if not any(v.get("name") == "JOB_COMPLETION_INDEX" for v in env):
                    env.append({"name": "JOB_COMPLETION_INDEX", "valueFrom": {"fieldRef": {
                        "apiVersion": "v1",
                        "fieldPath": f"metadata.annotations['{COMPLETION_INDEX}']"}}})
        pod_meta.pop("name", None)
        pod_meta.update(generateName=prefix, namespace=meta["namespace"], ownerReferences=[{
            "apiVersion": "batch/v1", "kind": "Job", "name": meta["name"], "uid": meta["uid"],
            "controller": True, "blockOwnerDeletion": True}])
        pod = self.store.create("pods", {"metadata": pod_meta, "spec": pod_spec},
                                meta["namespace"])
        self.store.record_event(job, "SuccessfulCreate", f"Created pod: {pod['metadata']['name']}",
                                component="job-controller")

    def _delete_job_pod(self, job: Json, pod: Json) -> None:
        with contextlib.suppress(KubeError):
            self.store.delete("pods", pod["metadata"]["name"], pod["metadata"]["namespace"])
            self.store.record_event(job, "SuccessfulDelete",
                                    f"Deleted pod: {pod['metadata']['name']}",
                                    component="job-controller")

    # -- JobSet controller ---------------------------------------------------------------
    def _sync_jobsets(self) -> None:
        try:
            jobsets = self.store.list("jobsets")
        except KubeError:
            return  # the CRD is not installed
        for jobset in jobsets:
            if not _deleting(jobset):
                self._sync_jobset(jobset)

    def _sync_jobset(self, jobset: Json) -> None:
        meta = jobset["metadata"]
        if _default_jobset(jobset):
            jobset = self.store.update("jobsets", jobset)
        spec = jobset["spec"]
        status = copy.deepcopy(jobset.get("status") or {})
        status.setdefault("restarts", 0)
        restarts = int(status["restarts"])
        jobs = [j for j in self.store.list("jobs", meta["namespace"], f"{JOBSET_UID}={meta['uid']}")]
        previous = [j for j in jobs if int(j["metadata"]["labels"].get(RESTARTS, "0")) < restarts]
        current = [j for j in jobs if j not in previous]
        failed = [j for j in current if _is_true(j, "Failed")]
        succeeded = [j for j in current if _is_true(j, "Complete")]
        active = [j for j in current if j not in failed and j not in succeeded]
        status["replicatedJobsStatus"] = [_replicated_status(rj, current)
                                          for rj in spec["replicatedJobs"]]
        if status.get("terminalState"):
            self._delete_jobs(active)
        else:
            self._delete_jobs(previous)
            if failed:
                self._jobset_failed(jobset, status, failed)
            elif not (succeeded and self._jobset_succeeded(jobset, status, succeeded)):
                self._create_service(jobset)
                self._create_jobs(jobset, restarts, {j["metadata"]["name"] for j in jobs})
                self._suspend_or_resume(jobset, status, active)
                if all(s["ready"] + s["succeeded"] >= rj.get("replicas", 1) for s, rj in
                       zip(status["replicatedJobsStatus"], spec["replicatedJobs"], strict=True)) and \
                        _condition({"status": status}, "RestartingJobSet"):
                    _set_condition(status, {"type": "RestartingJobSet", "status": "False",
                                            "reason": "JobsReady", "message": "all jobs are ready"})
        if status != jobset.get("status"):
            jobset["status"] = status
            self.store.update_status("jobsets", jobset)

    def _suspend_or_resume(self, jobset: Json, status: Json, jobs: list[Json]) -> None:
        """JobSet's spec.suspend on its Jobs (a suspended Job has no pods), and its condition."""
        suspended = bool(jobset["spec"].get("suspend"))
        for job in jobs:
            if bool(job["spec"].get("suspend")) != suspended:
                job["spec"]["suspend"] = suspended
                self.store.update("jobs", job)
        if suspended:
            _set_condition(status, {"type": "Suspended", "status": "True",
                                    "reason": "SuspendedJobs", "message": "jobset is suspended"})
        elif _condition({"status": status}, "Suspended"):
            _set_condition(status, {"type": "Suspended", "status": "False",
                                    "reason": "ResumeJobs", "message": "jobset is resumed"})

    # -- Kueue ---------------------------------------------------------------------------
    def admit_queued(self) -> None:
        """Kueue finds quota for every pending Workload: each is admitted and its JobSet
        resumed (the pods are made then)."""
        with self._lock:
            self._kueue_admits = True
        self._wake_all()

    def _sync_kueue(self) -> None:
        """Kueue's JobSet integration, for a JobSet labelled with a queue: a Workload owned by
        it, pending with ``kueue_pending`` (or inadmissible when the LocalQueue is missing)
        until ``admit_queued``, then admitted and the JobSet unsuspended."""
        if not self.kueue:
            return
        with self._lock:
            admits = self._kueue_admits
        for jobset in self.store.list("jobsets"):
            meta = jobset["metadata"]
            queue = (meta.get("labels") or {}).get(QUEUE_LABEL)
            if not queue or _deleting(jobset):
                continue
            namespace = meta["namespace"]
            owned = [w for w in self.store.list("workloads", namespace)
                     if any(r.get("uid") == meta["uid"]
                            for r in w["metadata"].get("ownerReferences") or [])]
            if not owned:
                owned = [self._make_workload(jobset, queue)]
            workload = owned[0]
            admitted = _is_true(workload, "Admitted")
            if admits and not admitted and _condition(workload, "QuotaReserved") is not None \
                    and (_condition(workload, "QuotaReserved") or {}).get("reason") == "Pending":
                status = copy.deepcopy(workload.get("status") or {})
                status["admission"] = {"clusterQueue": "cluster-queue", "podSetAssignments": [
                    {"name": ps["name"], "count": ps["count"], "flavors": {}}
                    for ps in workload["spec"]["podSets"]]}
                _set_condition(status, {"type": "QuotaReserved", "status": "True", "reason":
                                        "QuotaReserved", "message":
                                        "Quota reserved in ClusterQueue cluster-queue"})
                _set_condition(status, {"type": "Admitted", "status": "True", "reason": "Admitted",
                                        "message": "The workload is admitted"})
                workload["status"] = status
                self.store.update_status("workloads", workload)
                admitted = True
            if admitted and jobset["spec"].get("suspend"):
                jobset["spec"]["suspend"] = False
                self.store.update("jobsets", jobset)

    def _make_workload(self, jobset: Json, queue: str) -> Json:
        meta = jobset["metadata"]
        namespace = meta["namespace"]
        try:
            self.store.get("localqueues", queue, namespace)
            reason, message = "Pending", self.kueue_pending
        except KubeError:
            reason, message = "Inadmissible", f"LocalQueue {queue} doesn't exist"
        workload = self.store.create("workloads", {
            "metadata": {"name": f"jobset-{meta['name']}-{meta['uid'][:5]}",
                         "labels": {"kueue.x-k8s.io/job-uid": meta["uid"]},
                         "ownerReferences": [_owner(jobset)]},
            "spec": {"queueName": queue, "podSets": [
                {"name": rj["name"], "count": int(rj.get("replicas", 1))}
                for rj in jobset["spec"]["replicatedJobs"]]}}, namespace=namespace)
        workload["status"] = {"conditions": []}
        _set_condition(workload["status"], {"type": "QuotaReserved", "status": "False",
                                             "reason": reason, "message": message})
        return self.store.update_status("workloads", workload)

    def _jobset_failed(self, jobset: Json, status: Json, failed: list[Json]) -> None:
        first = min(failed, key=lambda j: (_condition(j, "Failed") or {}).get("lastTransitionTime", ""))
        name = first["metadata"]["name"]
        policy = jobset["spec"].get("failurePolicy")
        if policy is None:
            self._fail_jobset(jobset, status, "FailedJobs",
                              f"jobset failed due to one or more job failures (first failed job: {name})")
        elif int(status.get("restartsCountTowardsMax", 0)) >= int(policy.get("maxRestarts", 0)):
            self._fail_jobset(jobset, status, "ReachedMaxRestarts", "jobset failed due to reaching "
                              f"max number of restarts (first failed job: {name})")
        else:
            status["restarts"] = int(status["restarts"]) + 1
            status["restartsCountTowardsMax"] = int(status.get("restartsCountTowardsMax", 0)) + 1
            message = f"applying RestartJobSet failure policy action (first failed job: {name})"
            _set_condition(status, {"type": "RestartingJobSet", "status": "True",
                                    "reason": "DefaultFailurePolicy", "message": message})
            self.store.record_event(jobset, "RestartJobSetFailurePolicyAction", message, "Warning",
                                    component="jobset-controller")

    def _fail_jobset(self, jobset: Json, status: Json, reason: str, message: str) -> None:
        _set_condition(status, {"type": "Failed", "status": "True", "reason": reason,
                                "message": message})
        if _condition({"status": status}, "RestartingJobSet"):
            _set_condition(status, {"type": "RestartingJobSet", "status": "False",
                                    "reason": "JobSetFailed", "message": "jobset failed"})
        status["terminalState"] = "Failed"
        self.store.record_event(jobset, reason, message, "Warning", component="jobset-controller")

    def _jobset_succeeded(self, jobset: Json, status: Json, succeeded: list[Json]) -> bool:
        policy = jobset["spec"].get("successPolicy") or {}
        targets = policy.get("targetReplicatedJobs") or [
            rj["name"] for rj in jobset["spec"]["replicatedJobs"]]
        by_name = {rj["name"]: rj for rj in jobset["spec"]["replicatedJobs"]}
        done = {rj: sum(j["metadata"]["labels"].get(REPLICATED_JOB) == rj for j in succeeded)
                for rj in targets}
        if policy.get("operator", "All") == "Any":
            complete = any(done.values())
        else:
            complete = all(done[rj] >= int(by_name[rj].get("replicas", 1)) for rj in targets)
        if complete:
            _set_condition(status, {"type": "Completed", "status": "True", "reason":
                                    "AllJobsCompleted", "message": "jobset completed successfully"})
            if _condition({"status": status}, "RestartingJobSet"):
                _set_condition(status, {"type": "RestartingJobSet", "status": "False", "reason":
                                        "JobSetCompleted", "message": "jobset completed successfully"})
            status["terminalState"] = "Completed"
            self.store.record_event(jobset, "AllJobsCompleted", "jobset completed successfully",
                                    component="jobset-controller")
        return complete

    def _delete_jobs(self, jobs: list[Json]) -> None:
        for job in jobs:
            if not _deleting(job):
                with contextlib.suppress(KubeError):
                    self.store.delete("jobs", job["metadata"]["name"], job["metadata"]["namespace"],
                                      propagation_policy="Foreground")

    def _create_service(self, jobset: Json) -> None:
        meta, network = jobset["metadata"], jobset["spec"]["network"]
        if not network.get("enableDNSHostnames", True):
            return
        name = network.get("subdomain") or meta["name"]
        try:
            self.store.get("services", name, meta["namespace"])
        except KubeError:
            self.store.create("services", {
                "metadata": {"name": name, "namespace": meta["namespace"],
                             "ownerReferences": [_owner(jobset)]},
                "spec": {"clusterIP": "None", "clusterIPs": ["None"],
                         "selector": {JOBSET_NAME: meta["name"]},
                         "publishNotReadyAddresses": network.get("publishNotReadyAddresses", True)}},
                meta["namespace"])

    def _create_jobs(self, jobset: Json, restarts: int, existing: set[str]) -> None:
        meta, spec = jobset["metadata"], jobset["spec"]
        global_index = 0
        total = sum(int(rj.get("replicas", 1)) for rj in spec["replicatedJobs"])
        for rj in spec["replicatedJobs"]:
            replicas = int(rj.get("replicas", 1))
            for index in range(replicas):
                name = f"{meta['name']}-{rj['name']}-{index}"
                if name not in existing:
                    self._create_job(jobset, rj, index, global_index, total, restarts)
                global_index += 1

    def _create_job(self, jobset: Json, rj: Json, index: int, global_index: int, total: int,
                    restarts: int) -> None:
        meta, network = jobset["metadata"], jobset["spec"]["network"]
        name = f"{meta['name']}-{rj['name']}-{index}"
        template = copy.deepcopy(rj["template"])
        marks = {JOBSET_NAME: meta["name"], JOBSET_UID: meta["uid"], REPLICATED_JOB: rj["name"],
                 RESTARTS: str(restarts), JOBSET + "replicatedjob-replicas": str(rj.get("replicas", 1)),
                 JOBSET + "global-replicas": str(total), JOB_INDEX: str(index),
                 JOBSET + "job-key": hashlib.sha1(f"{meta['namespace']}/{name}".encode()).hexdigest(),
                 JOBSET + "job-global-index": str(global_index)}
        job_meta = template.get("metadata") or {}
        pod_template = template["spec"]["template"]
        pod_meta = pod_template.setdefault("metadata", {})
        for obj_meta in (job_meta, pod_meta):
            obj_meta["labels"] = {**(obj_meta.get("labels") or {}), **marks}
            obj_meta["annotations"] = {**(obj_meta.get("annotations") or {}), **marks}
        if network.get("enableDNSHostnames", True):
            pod_template["spec"]["subdomain"] = network.get("subdomain") or meta["name"]
        template["spec"]["suspend"] = bool(jobset["spec"].get("suspend", False))
        job = {"metadata": {**job_meta, "name": name, "namespace": meta["namespace"],
                            "ownerReferences": [_owner(jobset)]},
               "spec": template["spec"]}
        try:
            self.store.create("jobs", job, meta["namespace"])
        except KubeError as exc:
            if exc.code == 409:
                return
            self.store.record_event(jobset, "JobCreationFailed", str(exc), "Warning",
                                    component="jobset-controller")
            raise


class _ConfigError(Exception):
    """A pod the kubelet cannot start yet: ``reason`` is the container's waiting reason, or
    FailedMount (the pod stays ContainerCreating)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _decoded(obj: Json, is_secret: bool) -> dict[str, bytes]:
    files = {k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()}
    for key, value in (obj.get("data") or {}).items():
        files[key] = base64.b64decode(value) if is_secret else str(value).encode()
    return files


def _expand(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) expansion from the variables defined before; $$ escapes."""
    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env.get(name, match.group(0))
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", replace, value)


def _field_ref(pod: Json, path: str, pod_ip: str) -> str:
    meta, spec = pod["metadata"], pod["spec"]
    match = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if match:
        return str((meta.get(match.group(1)) or {}).get(match.group(2), ""))
    simple = {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"],
              "metadata.uid": meta["uid"], "spec.nodeName": spec.get("nodeName", ""),
              "spec.serviceAccountName": spec.get("serviceAccountName", ""),
              "status.podIP": pod_ip, "status.hostIP": ""}
    if path not in simple:
        raise _ConfigError("CreateContainerConfigError", f"unsupported fieldPath: {path}")
    return str(simple[path])


def _apply_fs_group(root: Path, gid: int, read_only: bool, volume: str) -> None:
    """kubelet's SetVolumeOwnership: group ``gid``; files g+rw (g+r for configMap and secret
    volumes), directories also setgid and ug+x. As kubelet's walkDeep does, a file that another
    pod removes while the walk reads (a shared claim's checkpoint temp files) fails the mount, to
    be tried again; a failed chown or chmod is ignored (kubelet only logs it)."""
    mask = 0o440 if read_only else 0o660

    def walk(path: Path) -> None:
        try:
            info = path.lstat()
            children = sorted(path.iterdir()) if stat.S_ISDIR(info.st_mode) else []
        except FileNotFoundError as exc:
            raise _ConfigError("FailedMount", f'MountVolume.SetUp failed for volume "{volume}" : '
                               f"lstat {path}: no such file or directory") from exc
        for child in children:
            walk(child)
        if stat.S_ISLNK(info.st_mode):
            return
        with contextlib.suppress(OSError):
            os.lchown(path, -1, gid)
        mode = info.st_mode & 0o7777
        with contextlib.suppress(OSError):
            path.chmod(mode | mask | 0o2110 if stat.S_ISDIR(info.st_mode) else mode | mask)

    walk(root)


def _index(pod: Json) -> int:
    return int((pod["metadata"].get("annotations") or {}).get(COMPLETION_INDEX, "-1"))


def _ranges(indexes: list[int]) -> str:
    """Job's completedIndexes: "0-2,4"."""
    parts: list[str] = []
    for i in indexes:
        if parts and parts[-1].split("-")[-1] == str(i - 1):
            parts[-1] = f"{parts[-1].split('-')[0]}-{i}"
        else:
            parts.append(str(i))
    return ",".join(parts)


def _owner(obj: Json) -> Json:
    return {"apiVersion": obj["apiVersion"], "kind": obj["kind"], "name": obj["metadata"]["name"],
            "uid": obj["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}


def _default_jobset(jobset: Json) -> bool:
    """JobSet's webhook defaults; True when something was set."""
    before = copy.deepcopy(jobset["spec"])
    spec = jobset["spec"]
    spec.setdefault("successPolicy", {"operator": "All"})
    spec["successPolicy"].setdefault("operator", "All")
    network = spec.setdefault("network", {})
    network.setdefault("enableDNSHostnames", True)
    network.setdefault("publishNotReadyAddresses", True)
    spec.setdefault("startupPolicy", {"startupPolicyOrder": "AnyOrder"})
    if spec.get("failurePolicy") is not None:
        spec["failurePolicy"].setdefault("restartStrategy", "Recreate")
    for rj in spec.get("replicatedJobs") or []:
        rj.setdefault("replicas", 1)
        job_spec = rj["template"]["spec"]
        job_spec.setdefault("completionMode", "Indexed")
        pod_spec = job_spec["template"]["spec"]
        if not pod_spec.get("restartPolicy"):
            pod_spec["restartPolicy"] = "OnFailure"
    return bool(spec != before)


def _replicated_status(rj: Json, jobs: list[Json]) -> Json:
    mine = [j for j in jobs if j["metadata"]["labels"].get(REPLICATED_JOB) == rj["name"]]
    counts = {"name": rj["name"], "ready": 0, "succeeded": 0, "failed": 0, "active": 0,
              "suspended": 0}
    for job in mine:
        status, spec = job.get("status") or {}, job["spec"]
        if _is_true(job, "Failed"):
            counts["failed"] += 1
        elif _is_true(job, "Complete"):
            counts["succeeded"] += 1
        elif spec.get("suspend"):
            counts["suspended"] += 1
        else:
            wanted = min(int(spec.get("parallelism", 1)), int(spec.get("completions") or 1))
            if status.get("ready", 0) + status.get("succeeded", 0) >= wanted:
                counts["ready"] += 1
            if status.get("active", 0) > 0:
                counts["active"] += 1
    return counts


# -- pytest fixtures -------------------------------------------------------------------------
@pytest.fixture
def kube_cluster_factory(pods: PodLab) -> Iterator[Callable[..., FakeCluster]]:
    """Make started FakeClusters (each on a fresh FakeKube) with ``FakeCluster``'s keyword
    options; small ``node_monitor_grace_s`` (1 s) and ``eviction_s`` (2 s) unless given. All
    are closed after the test, and every pod left is removed (the ``pods`` fixture); the test
    fails if a controller's loop raised (``FakeCluster.errors()``)."""
    made: list[tuple[FakeCluster, FakeKube]] = []

    def make(**options: Any) -> FakeCluster:
        options.setdefault("node_monitor_grace_s", 1.0)
        options.setdefault("eviction_s", 2)
        kube = FakeKube(log_poll_s=0.05).start()
        cluster = FakeCluster(kube, pods, **options)
        made.append((cluster, kube))
        return cluster.start()

    yield make
    errors = []
    for cluster, kube in reversed(made):
        try:
            cluster.close()
        finally:
            kube.close()
        errors += cluster.errors()
    if errors:
        pytest.fail(f"the fake cluster's controllers raised: {errors}")


@pytest.fixture
def kube_cluster(kube_cluster_factory: Callable[..., FakeCluster]) -> FakeCluster:
    """A started FakeCluster with the default options (no GPUs, no spot nodes)."""
    return kube_cluster_factory()


def wait_for(predicate: Callable[[], Any], timeout: float, what: str,
             cluster: FakeCluster | None = None) -> Any:
    """``predicate()``'s first truthy value; AssertionError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            errors = f"; controller errors: {cluster.errors()}" if cluster else ""
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}{errors}")
        time.sleep(0.05)
