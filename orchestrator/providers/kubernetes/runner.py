"""A task's pod, as the watch loop sees a host: its status from the pod watch, its output from
a log follower, its stop by deleting it; a command "on the host" is a pod of its own.

A pod of the attempt's JobSet is named by the Job controller (``<job>-<random>``), so a task
is found by its labels: the cluster, the run, the attempt, its role and its JobSet index. Its
handle carries them (``PodRef``), so a later controller (``--attach``, ``down``, ``logs``)
finds it from the record alone.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from orchestrator.errors import RemoteError
from orchestrator.paths import lib_dir
from orchestrator.providers.kubernetes import manifests
from orchestrator.remote.base import (
    POLL_LOG_MAX,
    ExecResult,
    LaunchSpec,
    LogPoll,
    Runner,
    TaskHandle,
    TaskState,
    TaskStatus,
)
from orchestrator.spec import KubernetesProvider as KubernetesConfig

if TYPE_CHECKING:
    from orchestrator.providers.kubernetes.provider import KubernetesProvider

REF_PREFIX = "pod:"
COMMAND_ROLE = "command"  # a one-off pod's role label: a command on "the host"
STOP_WAIT_S = 30.0  # after the grace: how long the kubelet may take to report the pod gone


@dataclass(frozen=True)
class PodRef:
    """A task's pod by its labels: ``pod:RUN:ATTEMPT:ROLE:INDEX`` in its handle's paths."""

    run_id: str
    attempt: int
    role: str
    index: int

    def text(self) -> str:
        return f"{REF_PREFIX}{self.run_id}:{self.attempt}:{self.role}:{self.index}"

    @classmethod
    def of(cls, handle: TaskHandle) -> PodRef:
        words = handle.log_path.removeprefix(REF_PREFIX).split(":")
        if not handle.log_path.startswith(REF_PREFIX) or len(words) != 4 or \
                not words[1].isdigit() or not words[3].isdigit():
            raise RemoteError(f"{handle.log_path!r} names no pod", host=handle.host)
        return cls(words[0], int(words[1]), words[2], int(words[3]))

    def labels(self) -> dict[str, str]:
        return {manifests.RUN_LABEL: self.run_id, manifests.ATTEMPT_LABEL: str(self.attempt),
                manifests.ROLE_LABEL: self.role, manifests.JOB_INDEX_KEY: str(self.index)}

    def handle(self, host: str) -> TaskHandle:
        return TaskHandle(host, self.attempt, self.text(), self.text())


def container_state(pod: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The task container's state: ("waiting" | "running" | "terminated" | "", its fields)."""
    for status in pod.get("status", {}).get("containerStatuses") or []:
        if status.get("name") == manifests.CONTAINER:
            for kind, fields in (status.get("state") or {}).items():
                return kind, dict(fields or {})
    return "", {}


# A container waiting for one of these will not start without a change.
STUCK_WAITING = {
    "ErrImagePull": "check container.image, and that the nodes may pull it "
                    "(provider.image_pull_secrets, or the node pool's service account)",
    "ImagePullBackOff": "check container.image, and that the nodes may pull it "
                        "(provider.image_pull_secrets, or the node pool's service account)",
    "InvalidImageName": "fix container.image",
    "CreateContainerConfigError": "create what the pod refers to (a Secret or ConfigMap), "
                                  "or report it as a bug if the tool made the reference",
    "CreateContainerError": "see 'kubectl describe pod' for the runtime's message",
}


def node_marked_not_ready(pod: dict[str, Any]) -> bool:
    """Whether the node lifecycle controller marked the running pod not ready: its Ready
    condition False while ContainersReady stays True and its container runs. A task's pod has
    no readiness probe, so only that controller does this, once the pod's node stopped
    posting its status (the node's grace, 40 to 50 s): the pod's kubelet is gone, and the pod
    would otherwise count as running until its eviction (300 s) and after."""
    conditions = {c.get("type"): c.get("status")
                  for c in pod.get("status", {}).get("conditions") or []}
    return conditions.get("Ready") == "False" and conditions.get("ContainersReady") == "True" \
        and container_state(pod)[0] == "running"


def unschedulable(pod: dict[str, Any]) -> str | None:
    """The scheduler's message for a pod no node can take now (PodScheduled False,
    Unschedulable, not bound), with the fix; None once it is placed or while it is merely
    on its way."""
    if pod.get("spec", {}).get("nodeName"):
        return None
    for condition in pod.get("status", {}).get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False" \
                and condition.get("reason") == "Unschedulable":
            message = str(condition.get("message") or "")
            return f"{message} ({_scheduling_fix(message)})"
    return None


def pod_waiting(pod: dict[str, Any]) -> str | None:
    """Why ``pod`` is not running, with the fix: unschedulable, or its container stuck."""
    unplaced = unschedulable(pod)
    if unplaced:
        return f"no node can take its pod: {unplaced}"
    kind, fields = container_state(pod)
    reason = str(fields.get("reason") or "")
    if kind == "waiting" and reason in STUCK_WAITING:
        message = str(fields.get("message") or "")
        return f"its container cannot start: {reason}: {message} (fix: {STUCK_WAITING[reason]})"
    return None


def _scheduling_fix(message: str) -> str:
    fixes = []
    if "Insufficient" in message:
        fixes.append("ask for less (provider.gpus_per_pod, provider.resources) or add nodes "
                     "that have it: a cluster autoscaler may be adding them now")
    if "node affinity/selector" in message:
        fixes.append("check provider.node_selector against the nodes' labels")
    if "untolerated taint" in message:
        fixes.append("add the taint to provider.tolerations, or set provider.spot")
    if "persistentvolumeclaim" in message.lower():
        fixes.append("check provider.volume.claim")
    return "fix: " + "; ".join(fixes or ["see 'kubectl describe pod' and the nodes"])


def _epoch(stamp: str | None) -> float | None:
    if not stamp:
        return None
    try:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


class PodRunner(Runner):
    """One task's pod, through the provider's API client, pod watch and log followers."""

    def __init__(self, provider: KubernetesProvider, host_name: str) -> None:
        super().__init__(host_name)
        self.provider = provider

    # -- a command on "the host": a pod of the image -------------------------------------
    def _exec(self, script: str, timeout_s: float | None = None,
              input: str | None = None) -> ExecResult:
        return self.provider.run_pod(script, timeout_s=timeout_s, input=input)

    def put_file(self, local_path: str, remote_path: str, mode: int | None = None) -> None:
        raise RemoteError("files reach pods through the code ConfigMaps and the volume, not "
                          "one by one", host=self.host_name)

    def get_file(self, remote_path: str, local_path: str) -> None:
        self.provider.fetch_file(remote_path, local_path)

    # -- the task's pod ------------------------------------------------------------------
    def start(self, spec: LaunchSpec) -> TaskHandle:
        raise RemoteError("a task's pod is started by its JobSet", host=self.host_name)

    def poll(self, handle: TaskHandle) -> TaskStatus:
        return self._status(handle, status=True) or TaskStatus(TaskState.RUNNING)

    def poll_log(self, handle: TaskHandle, offset: int, *, status: bool = True,
                 limit: int = POLL_LOG_MAX) -> LogPoll:
        """The pod's status (an exit only once its log is read to the end), then its log's
        bytes from ``offset``, from memory: no request to the API server."""
        got = self._status(handle, status=status)
        follower = self.provider.follower(PodRef.of(handle))
        if follower is None:
            return LogPoll(got, b"", offset)
        data, next_offset, more = follower.read(offset, limit)
        if got is not None and got.state is TaskState.EXITED and (
                more or not follower.ended.is_set()):
            got = TaskStatus(TaskState.RUNNING) if status else None  # its last lines first
        return LogPoll(got, data, next_offset, more)

    def read_log(self, handle: TaskHandle, offset: int) -> tuple[bytes, int]:
        data = self.provider.read_log(PodRef.of(handle))
        return data[offset:], len(data)

    def _status(self, handle: TaskHandle, *, status: bool) -> TaskStatus | None:
        found = self.provider.pod(PodRef.of(handle))
        if found is None:  # not made yet by the Job controller: still starting
            return TaskStatus(TaskState.RUNNING) if status else None
        kind, fields = container_state(found.pod)
        if kind == "terminated":
            return TaskStatus(TaskState.EXITED, int(fields.get("exitCode", 1)),
                              _epoch(fields.get("finishedAt")))
        if found.deleted or found.pod.get("status", {}).get("phase") in ("Failed", "Succeeded"):
            return TaskStatus(TaskState.LOST)  # gone (its node lost, evicted) with no exit code
        if node_marked_not_ready(found.pod):
            return TaskStatus(TaskState.LOST)  # its node stopped reporting: nothing more will
        return TaskStatus(TaskState.RUNNING) if status else None

    def waiting(self, handle: TaskHandle) -> str | None:
        """What keeps the task's pod from running: the scheduler's reason, or its
        container's, with the fix; None while it is merely on its way."""
        found = self.provider.pod(PodRef.of(handle))
        return None if found is None or found.deleted else pod_waiting(found.pod)

    def unplaced(self, handle: TaskHandle) -> str | None:
        """The scheduler's reason when no node can take the task's pod now."""
        return self.provider.unplaced(PodRef.of(handle))

    def queued(self, handle: TaskHandle) -> str | None:
        """Why the attempt's JobSet waits in its Kueue queue (while its pod is not made)."""
        if self.provider.pod(PodRef.of(handle)) is not None:
            return None
        return self.provider.queued(PodRef.of(handle).attempt)

    def process_states(self, handle: TaskHandle, python: str, timeout_s: float = 15.0) -> str:
        """'R' while the pod's container runs (a pod has no stopped processes to see)."""
        found = self.provider.pod(PodRef.of(handle))
        if found is None or found.deleted:
            return ""
        kind, _ = container_state(found.pod)
        return "R" if kind == "running" else ""

    def signal(self, handle: TaskHandle, sig: str) -> None:
        """TERM: delete the pod with its grace (the kubelet sends SIGTERM, then SIGKILL);
        KILL: delete it at once."""
        grace = None if sig == "TERM" else 0
        self.provider.delete_pod(PodRef.of(handle), grace)

    def stop(self, handle: TaskHandle, grace_s: float = 5.0) -> TaskStatus:
        """Delete the pod with ``grace_s`` (0: SIGKILL at once), and wait until it ended."""
        ref = PodRef.of(handle)
        current = self._status(handle, status=True)
        if current is not None and current.state is not TaskState.RUNNING:
            return current
        if grace_s <= 0:  # the pod is gone from the API at once: ask its kubelet first
            self.provider.ask_kubelet(ref)
        self.provider.delete_pod(ref, math.ceil(grace_s))
        deadline = time.monotonic() + grace_s + STOP_WAIT_S
        while time.monotonic() < deadline:
            found = self.provider.pod(ref)
            if found is None or found.deleted or container_state(found.pod)[0] == "terminated":
                break
            self.provider.watch().wait(self.provider.watch().version, 0.5)
        got = self._status(handle, status=True)
        return got if got is not None else TaskStatus(TaskState.LOST)


def command_pod(provider_name: str, namespace: str, image: str, python_lib: str,
                script: str, files: manifests.Files | None, config: KubernetesConfig,
                input: str | None, *, like_a_task: bool = False,
                avoid_nodes: Sequence[str] = ()) -> dict[str, Any]:
    """A one-off pod that runs ``script`` in the image with the cluster's volume;
    ``like_a_task``: placed and given resources (GPUs) as a task's pod is. ``avoid_nodes``:
    the lost nodes it must not go to (the scheduler counts a lost node Ready for the node
    monitor's grace, and a pod bound there never starts and is evicted)."""
    name = f"{provider_name}-cmd-{uuid.uuid4().hex[:8]}"
    env = [{"name": "PYTHONPATH", "value": python_lib}]
    if input is not None:
        env.append({"name": "ORCHESTRATE_INPUT", "value": input})
        script = f'printf %s "$ORCHESTRATE_INPUT" | ( {script} )'
    mounts = [manifests.runs_mount(provider_name, config)]
    volumes = [manifests.runs_volume(config)]
    if files is not None:
        mounts.append({"name": "lib", "mountPath": lib_dir(manifests.ROOT), "readOnly": True})
        volumes.append(files.volume("lib"))
    pod: dict[str, Any] = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace,
                     "labels": manifests.labels(provider_name,
                                                **{manifests.ROLE_LABEL: COMMAND_ROLE})},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 0,
            "enableServiceLinks": False,
            "containers": [{"name": manifests.CONTAINER, "image": image,
                            "command": ["sh", "-c", script], "workingDir": "/",
                            "env": env, "volumeMounts": mounts}],
            "volumes": volumes,
        },
    }
    node_selector, tolerations = manifests.placement(config) if like_a_task else \
        (dict(config.node_selector), [])
    if node_selector:
        pod["spec"]["nodeSelector"] = node_selector
    if tolerations:
        pod["spec"]["tolerations"] = tolerations
    if avoid_nodes:
        pod["spec"]["affinity"] = manifests.avoiding(avoid_nodes)
    requests, limits = manifests.pod_resources(config) if like_a_task else ({}, {})
    if requests or limits:
        pod["spec"]["containers"][0]["resources"] = {
            **({"requests": requests} if requests else {}), **({"limits": limits} if limits else {})}
    if config.service_account:
        pod["spec"]["serviceAccountName"] = config.service_account
    if config.image_pull_secrets:
        pod["spec"]["imagePullSecrets"] = [{"name": s} for s in config.image_pull_secrets]
    security = manifests.security_context(config)
    if security:
        pod["spec"]["securityContext"] = security
    return pod
