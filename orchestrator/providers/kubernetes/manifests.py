"""PURE: the Kubernetes objects of a cluster, from the spec and an attempt's plan.

- **One JobSet per attempt** (``jobset.x-k8s.io/v1alpha2``), named after the cluster: a
  replicated Job per role (``worker``, and ``chief`` with ``separate_chief``), one pod each,
  from ONE pod template per role. JobSet gives every pod a stable DNS name,
  ``<jobset>-<replicatedJob>-<jobIndex>-0.<jobset>`` (its headless Service is the subdomain),
  so the cluster's TF_CONFIG is known before any pod exists; each pod's own TF_CONFIG comes
  from its index (the ``jobset.sigs.k8s.io/job-index`` annotation, through the Downward API)
  in ``worker/indexed.py``. ``failurePolicy.maxRestarts: 0``: the JobSet fails with its first
  failed pod and this project's supervisor restarts the group (its budget, backoff, causes,
  the checkpoint it restores from), by a new JobSet.
- **A Secret per attempt** with the values of ``spec.secrets`` (read at launch), which the
  pods take through ``secretKeyRef``: never in the JobSet's plain env.
- **ConfigMaps of the code** (the spec's workdir, and the ``worker`` package), made by
  ``up``, named by their content's hash: a new upload never changes the files under pods that
  run.

Every object carries ``app.kubernetes.io/managed-by: orchestrate`` and the cluster's label,
which ``down`` deletes by. In every pod, ``ROOT`` holds ``code/`` and ``lib/`` (the
ConfigMaps, read-only) and ``runs/`` (``provider.volume``'s claim: checkpoints and the final
model outlive the pod; without a volume, an emptyDir, and both are in ``checkpoint.dir``'s
gs:// bucket).
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from orchestrator.errors import PlanError, ProviderError
from orchestrator.hosts import Host
from orchestrator.paths import code_dir, lib_dir
from orchestrator.plan import ClusterPlan, Role, TaskPlan
from orchestrator.spec import (
    GKE_SPOT_LABEL,
    ClusterSpec,
    KubernetesProvider,
    KubernetesToleration,
)

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGER = "orchestrate"
CLUSTER_LABEL = "orchestrate/cluster"
RUN_LABEL = "orchestrate/run"
ATTEMPT_LABEL = "orchestrate/attempt"
ROLE_LABEL = "orchestrate/role"
CONTENT_LABEL = "orchestrate/content"  # a ConfigMap's: what it carries (code, lib)
SLOT_LABEL = "orchestrate/slot"  # a reservation pod's: the task index it holds room for
RESERVE_ROLE = "reserve"  # a reservation pod's role label (never a task's)
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
HOSTNAME_LABEL = "kubernetes.io/hostname"  # every node's, its name
JOB_INDEX_KEY = "jobset.sigs.k8s.io/job-index"
CONTAINER = "task"
ROOT = "/orchestrate"  # in every pod
PORT_NAME = "tf-grpc"
# Set per task from its index (worker/indexed.py), so not in the shared template.
PER_TASK_ENV = ("TF_CONFIG", "ORCHESTRATE_TASK", "KERAS_DISTRIBUTION_PROCESS_ID")
# A ConfigMap is one etcd object: the API server refuses one over 1 MiB (data and metadata).
CONFIGMAP_MAX_BYTES = 1 << 20
CONFIGMAP_OVERHEAD = 16 << 10  # metadata, keys and item paths, with room to spare
DNS_LABEL_MAX = 63


def jobset_name(cluster: str) -> str:
    """The JobSet of the cluster's attempt (one at a time), and its pods' DNS subdomain."""
    return cluster


def pod_hostname(cluster: str, role: Role, index: int) -> str:
    """The host name JobSet gives the pod of ``role`` ``index`` (its only pod: index 0)."""
    return f"{jobset_name(cluster)}-{role}-{index}-0"


def roles(spec: ClusterSpec, *, spares: bool = False) -> list[tuple[Role, int]]:
    """Every task, the chief first (worker 0 unless ``separate_chief``); ``spares``: then
    the workers past ``workers`` an elastic group may grow to (``elastic.max_workers``)."""
    chief: list[tuple[Role, int]] = [("chief", 0)] if spec.separate_chief else []
    most = spec.workers + (spec.spares if spares else 0)
    return chief + [("worker", i) for i in range(most)]


def hosts(spec: ClusterSpec, *, spares: bool = False) -> list[Host]:
    """A host per task: its pod, reached at its JobSet DNS name (``host.subdomain``, which
    the pods' search path completes), each pod a machine of its own (its own IP), all with the
    same ``ROOT`` whose ``runs/`` every pod shares (``provider.volume``), or, without a
    volume, its own ``runs/`` that is gone with the pod (checkpoints and the model in gs://).

    ``spares``: then the workers past ``workers`` an elastic group may grow to
    (``elastic.max_workers``), named as the workers are. A pod's name is its index in the
    group, so an elastic group's hosts are always the first N of these: a group of fewer
    workers leaves out the last ones, whichever pod could not be placed."""
    config = _config(spec)
    shared = config.volume is not None
    out = []
    for role, index in roles(spec, spares=spares):
        name = pod_hostname(spec.name, role, index)
        if len(name) > DNS_LABEL_MAX:  # the cluster name is at most 40: never; kept honest
            raise PlanError(f"pod host name {name!r} is over {DNS_LABEL_MAX} characters",
                            fix="give the cluster a shorter name")
        out.append(Host(name=name, address=f"{name}.{jobset_name(spec.name)}", root=ROOT,
                        node=name, shared_fs=shared, ephemeral=not shared))
    return out


def labels(cluster: str, **more: str) -> dict[str, str]:
    """The labels of every object made for ``cluster`` (``down`` finds them by these)."""
    return {MANAGED_BY: MANAGER, CLUSTER_LABEL: cluster, **more}


def selector(cluster: str) -> str:
    """The label selector of every object made for ``cluster``."""
    return f"{MANAGED_BY}={MANAGER},{CLUSTER_LABEL}={cluster}"


@dataclass(frozen=True)
class Files:
    """A ConfigMap that carries a directory into every pod: its name, and (key, path, mode)
    of each file, as the volume's ``items`` map them."""

    name: str
    items: tuple[tuple[str, str, int], ...]

    def volume(self, volume_name: str) -> dict[str, Any]:
        return {"name": volume_name, "configMap": {
            "name": self.name, "defaultMode": 0o644,
            "items": [{"key": key, "path": path, **({"mode": mode} if mode != 0o644 else {})}
                      for key, path, mode in self.items]}}


def configmap(cluster: str, content: str, namespace: str,
              files: Mapping[str, tuple[bytes, int]]) -> tuple[dict[str, Any], Files]:
    """The ConfigMap of ``files`` (relative path -> (bytes, mode)), and how pods mount it.

    Raises:
        ProviderError: the files are over what one ConfigMap holds.
    """
    size = sum(len(data) for data, _ in files.values())
    if size + CONFIGMAP_OVERHEAD > CONFIGMAP_MAX_BYTES:
        raise ProviderError(
            f"the {content} is {size / (1 << 20):.1f} MiB: over the 1 MiB a ConfigMap holds",
            fix="keep data and outputs out of workdir (read data from gs:// or the volume), "
                "or put the code in container.image")
    digest = hashlib.sha256()
    data: dict[str, str] = {}
    binary: dict[str, str] = {}
    items = []
    for i, path in enumerate(sorted(files)):
        blob, mode = files[path]
        digest.update(f"{path}\0{mode:o}\0{len(blob)}\0".encode())
        digest.update(blob)
        key = f"{i:05d}.{re.sub(r'[^-._a-zA-Z0-9]', '_', path)[-200:]}"
        try:
            data[key] = blob.decode()
        except UnicodeDecodeError:
            binary[key] = base64.b64encode(blob).decode()
        items.append((key, path, 0o755 if mode & 0o111 else 0o644))
    name = f"{cluster}-{content}-{digest.hexdigest()[:10]}"
    manifest: dict[str, Any] = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": namespace,
                     "labels": labels(cluster, **{CONTENT_LABEL: content})},
        "immutable": True, "data": data,
    }
    if binary:
        manifest["binaryData"] = binary
    return manifest, Files(name, tuple(items))


def secret_name(cluster: str) -> str:
    return f"{cluster}-secrets"


def secret(cluster: str, namespace: str, values: Mapping[str, str], *, run_id: str,
           attempt: int) -> dict[str, Any]:
    """The Secret the attempt's pods read ``spec.secrets`` from."""
    return {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": {"name": secret_name(cluster), "namespace": namespace,
                     "labels": labels(cluster, **{RUN_LABEL: run_id, ATTEMPT_LABEL: str(attempt)})},
        "data": {key: base64.b64encode(value.encode()).decode() for key, value in values.items()},
    }


def jobset(spec: ClusterSpec, plan: ClusterPlan, *, code: Files, lib: Files,
           secrets: Sequence[str] = (), avoid_nodes: Sequence[str] = ()) -> dict[str, Any]:
    """The JobSet of ``plan``'s attempt: a replicated Job per role, one pod each.

    Args:
        code, lib: the ConfigMaps of the workdir and of the worker package (``configmap``).
        secrets: the names of ``spec.secrets``: the pods read them from ``secret_name``.
        avoid_nodes: nodes the pods must not go to (lost under an earlier attempt, while
            the cluster may still count them Ready), by their ``kubernetes.io/hostname``.

    Raises:
        PlanError: the plan's tasks differ in more than TF_CONFIG and the task's name (one
            template cannot start them).
    """
    config = _config(spec)
    name = jobset_name(spec.name)
    run = {RUN_LABEL: plan.run_id, ATTEMPT_LABEL: str(plan.attempt)}
    by_role: dict[Role, list[TaskPlan]] = {}
    for task in plan.tasks:
        by_role.setdefault(task.role, []).append(task)
    _check_one_template(plan)
    replicated = [
        {"name": role, "replicas": len(tasks), "template": {
            "metadata": {"labels": labels(spec.name, **run, **{ROLE_LABEL: role})},
            # Indexed (JobSet's default, said here): the pod's host name is the Job's name
            # and its index, 0, as the DNS scheme above has it
            "spec": {"parallelism": 1, "completions": 1, "backoffLimit": 0,
                     "completionMode": "Indexed",
                     "template": _pod_template(spec, config, plan, tasks[0], code, lib, secrets,
                                               labels(spec.name, **run, **{ROLE_LABEL: role}),
                                               avoid_nodes)}}}
        for role, tasks in by_role.items()
    ]
    metadata_labels = labels(spec.name, **run)
    if config.queue:
        metadata_labels[QUEUE_LABEL] = config.queue
    return {
        "apiVersion": JOBSET_API, "kind": "JobSet",
        "metadata": {"name": name, "namespace": config.namespace, "labels": metadata_labels},
        "spec": {
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
            "failurePolicy": {"maxRestarts": 0},
            "replicatedJobs": replicated,
            # Queued: made suspended, so no pod starts before Kueue admits it (Kueue's own
            # webhook does the same; Kueue resumes it once the quota is there)
            **({"suspend": True} if config.queue else {}),
        },
    }


def _pod_template(spec: ClusterSpec, config: KubernetesProvider, plan: ClusterPlan,
                  task: TaskPlan, code: Files, lib: Files, secrets: Sequence[str],
                  pod_labels: dict[str, str], avoid_nodes: Sequence[str] = ()) -> dict[str, Any]:
    assert spec.container is not None  # the spec requires it on kubernetes
    env: list[dict[str, Any]] = [{"name": key, "value": value} for key, value in task.env.items()
                                 if key not in PER_TASK_ENV]
    env += [
        {"name": "ORCHESTRATE_TF_CLUSTER",
         "value": json.dumps({r: list(eps) for r, eps in plan.cluster_def.items()},
                             separators=(",", ":"))},
        {"name": "ORCHESTRATE_TASK_TYPE", "value": task.role},
        {"name": "ORCHESTRATE_TASK_INDEX",
         "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{JOB_INDEX_KEY}']"}}},
        *({"name": key, "valueFrom": {"secretKeyRef": {"name": secret_name(spec.name),
                                                       "key": key}}} for key in secrets),
    ]
    gpus = config.gpus_per_pod
    requests, limits = pod_resources(config)
    mounts: list[dict[str, Any]] = [
        {"name": "code", "mountPath": code_dir(ROOT), "readOnly": True},
        {"name": "lib", "mountPath": lib_dir(ROOT), "readOnly": True},
        runs_mount(spec.name, config),
    ]
    volumes: list[dict[str, Any]] = [
        code.volume("code"), lib.volume("lib"), runs_volume(config),
    ]
    if gpus:  # NCCL's buffers: the default 64 MiB /dev/shm is too small
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": spec.container.image,
        "imagePullPolicy": {"missing": "IfNotPresent", "always": "Always",
                            "never": "Never"}[spec.container.pull],
        "command": [spec.container.python, "-m", "worker.indexed", *task.argv],
        "workingDir": task.cwd,
        "env": env,
        "ports": [{"name": PORT_NAME, "containerPort": task.port, "protocol": "TCP"}],
        "volumeMounts": mounts,
    }
    if requests or limits:
        container["resources"] = {**({"requests": requests} if requests else {}),
                                  **({"limits": limits} if limits else {})}
    pod: dict[str, Any] = {
        "restartPolicy": "Never",
        # the grace a planned stop gives every task to save at one step (timeouts.stop_grace_s)
        "terminationGracePeriodSeconds": math.ceil(spec.timeouts.stop_grace_s),
        "enableServiceLinks": False,  # no FOO_SERVICE_HOST variables in the task's env
        "containers": [container],
        "volumes": volumes,
    }
    _place_as_a_task(pod, config, avoid_nodes)
    return {"metadata": {"labels": pod_labels}, "spec": pod}


def _place_as_a_task(pod: dict[str, Any], config: KubernetesProvider,
                     avoid_nodes: Sequence[str]) -> None:
    """Set what places a task's pod and who it runs as on ``pod`` (its spec): the node
    selector and tolerations (``placement``), the lost nodes avoided, the service account,
    the image pull secrets and the security context."""
    node_selector, tolerations = placement(config)
    if node_selector:
        pod["nodeSelector"] = node_selector
    if tolerations:
        pod["tolerations"] = tolerations
    if avoid_nodes:
        pod["affinity"] = avoiding(avoid_nodes)
    if config.service_account:
        pod["serviceAccountName"] = config.service_account
    if config.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": s} for s in config.image_pull_secrets]
    security = security_context(config)
    if security:
        pod["securityContext"] = security


def reservation(spec: ClusterSpec, host: Host, index: int,
                avoid_nodes: Sequence[str] = ()) -> dict[str, Any]:
    """A pod that holds a node's room for worker ``index`` of an elastic group that goes on
    without it: placed as a task's pod is (its requests, node selector, tolerations, the
    lost nodes avoided), of the tasks' image (so the node pulls it before the task needs
    it), sleeping until the group grows onto it and the attempt's JobSet takes its place.
    Pending, it is the scheduler's queue for that room: the pod is bound the moment a node
    has it."""
    assert spec.container is not None  # the spec requires it on kubernetes
    config = _config(spec)
    requests, limits = pod_resources(config)
    container: dict[str, Any] = {
        "name": CONTAINER, "image": spec.container.image,
        "imagePullPolicy": {"missing": "IfNotPresent", "always": "Always",
                            "never": "Never"}[spec.container.pull],
        "command": [spec.container.python, "-c",
                    "import time\nwhile True: time.sleep(3600)"],
    }
    if requests or limits:
        container["resources"] = {**({"requests": requests} if requests else {}),
                                  **({"limits": limits} if limits else {})}
    pod: dict[str, Any] = {"restartPolicy": "Never", "terminationGracePeriodSeconds": 0,
                           "enableServiceLinks": False, "containers": [container]}
    _place_as_a_task(pod, config, avoid_nodes)
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": reservation_name(host), "namespace": config.namespace,
                         "labels": labels(spec.name, **{ROLE_LABEL: RESERVE_ROLE,
                                                        SLOT_LABEL: str(index)})},
            "spec": pod}


def reservation_name(host: Host) -> str:
    """The reservation pod of ``host`` (one at a time): its host name and ``-r``."""
    return f"{host.name}-r"


def avoiding(nodes: Sequence[str]) -> dict[str, Any]:
    """A pod's affinity that keeps it off ``nodes`` (by their ``kubernetes.io/hostname``)."""
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": HOSTNAME_LABEL, "operator": "NotIn", "values": sorted(nodes)}]}]}}}


def avoided(pod: dict[str, Any]) -> list[str]:
    """The nodes ``pod``'s affinity keeps it off (``avoiding``), sorted."""
    terms = pod.get("spec", {}).get("affinity", {}).get("nodeAffinity", {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution", {}).get("nodeSelectorTerms") or []
    return sorted(value for term in terms for expression in term.get("matchExpressions") or []
                  if expression.get("key") == HOSTNAME_LABEL
                  and expression.get("operator") == "NotIn"
                  for value in expression.get("values") or [])


def runs_mount(cluster: str, config: KubernetesProvider) -> dict[str, Any]:
    """Where a pod sees the runs' directories: ``ROOT/runs``, the claim's ``sub_path``."""
    return {"name": "runs", "mountPath": f"{ROOT}/runs",
            **({"subPath": config.volume.sub_path or f"orchestrate/{cluster}"}
               if config.volume is not None else {})}


def runs_volume(config: KubernetesProvider) -> dict[str, Any]:
    """The volume of ``runs_mount``: ``provider.volume``'s claim."""
    return {"name": "runs", **({"persistentVolumeClaim": {"claimName": config.volume.claim}}
                               if config.volume is not None else {"emptyDir": {}})}


def security_context(config: KubernetesProvider) -> dict[str, Any]:
    """The pods' ``securityContext``: who the tasks run as, and the volume's group."""
    return {key: value for key, value in (("runAsUser", config.run_as_user),
                                          ("runAsGroup", config.run_as_group),
                                          ("fsGroup", config.fs_group)) if value is not None}


def pod_resources(config: KubernetesProvider) -> tuple[dict[str, Any], dict[str, Any]]:
    """A task pod's resource requests and limits (memory and GPUs are limited too)."""
    requests: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    if config.resources.cpu:
        requests["cpu"] = config.resources.cpu
    if config.resources.memory:
        requests["memory"] = limits["memory"] = config.resources.memory
    if config.gpus_per_pod:  # a quantity is a string to the typed client (a pod's body)
        requests[config.gpu_resource] = limits[config.gpu_resource] = str(config.gpus_per_pod)
    return requests, limits


def placement(config: KubernetesProvider) -> tuple[dict[str, str], list[dict[str, Any]]]:
    """A task pod's node selector and tolerations (spot adds GKE's label and taint)."""
    node_selector = dict(config.node_selector)
    tolerations = [_toleration(t) for t in config.tolerations]
    if config.spot:
        node_selector[GKE_SPOT_LABEL] = "true"
        tolerations.append({"key": GKE_SPOT_LABEL, "operator": "Equal", "value": "true",
                            "effect": "NoSchedule"})
    return node_selector, tolerations


def _toleration(t: KubernetesToleration) -> dict[str, Any]:
    out: dict[str, Any] = {"operator": t.operator}
    for field, key in (("key", "key"), ("value", "value"), ("effect", "effect"),
                       ("toleration_seconds", "tolerationSeconds")):
        if getattr(t, field) is not None:
            out[key] = getattr(t, field)
    return out


def _check_one_template(plan: ClusterPlan) -> None:
    """Every task must differ from the others only where ``worker.indexed`` sets it."""
    first = plan.tasks[0]
    shared = {k: v for k, v in first.env.items() if k not in PER_TASK_ENV}
    for task in plan.tasks[1:]:
        mine = {k: v for k, v in task.env.items() if k not in PER_TASK_ENV}
        differ = sorted(k for k in shared.keys() | mine.keys() if shared.get(k) != mine.get(k))
        if differ or task.argv != first.argv or task.cwd != first.cwd or task.port != first.port:
            what = ", ".join(differ) or "its command, directory or port"
            raise PlanError(f"task {task.key} differs from {first.key} in {what}: one pod "
                            "template cannot start both", fix="report this as a bug")


def _config(spec: ClusterSpec) -> KubernetesProvider:
    if not isinstance(spec.provider, KubernetesProvider):
        raise PlanError(f"provider.kind is {spec.provider.kind!r}, not kubernetes",
                        fix="report this as a bug")
    return spec.provider
