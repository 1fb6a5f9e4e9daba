"""provider.kind kubernetes: a cluster with the JobSet API (GKE), reached with a kubeconfig.

``up`` checks the cluster (the JobSet CRD, the namespace, what these credentials may do, the
claim of ``provider.volume``) and puts the code in ConfigMaps; ``train`` submits one JobSet
per attempt (``start_group``) and watches its pods; ``down`` deletes every object the tool
made, found by its labels. Manifests: ``manifests.py``; the API, watch and logs:
``client.py``; a task's pod as a host: ``runner.py``.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import shlex
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from orchestrator import paths
from orchestrator import plan as planning
from orchestrator.errors import ProviderError, RemoteError
from orchestrator.files import PRIVATE_DIR, write_atomic
from orchestrator.hosts import Host
from orchestrator.plan import ClusterPlan
from orchestrator.problems import Problem
from orchestrator.providers.base import CloudCheck, DownReport, HostHealth, Provider
from orchestrator.providers.kubernetes import manifests, nodes
from orchestrator.providers.kubernetes.client import (
    JOBSET_GROUP,
    JOBSET_VERSION,
    JOBSETS,
    Kube,
    KubeError,
    LogFollower,
    PodState,
    PodWatch,
)
from orchestrator.providers.kubernetes.runner import (
    COMMAND_ROLE,
    PodRef,
    PodRunner,
    command_pod,
    container_state,
    pod_waiting,
    unschedulable,
)
from orchestrator.remote.base import ExecResult, Runner, TaskHandle, probe_argv
from orchestrator.remote.fanout import fan_out
from orchestrator.remote.sync import files_of
from orchestrator.spec import ClusterSpec
from orchestrator.spec import KubernetesProvider as KubernetesConfig

# What the tool does, by resource: 'up' asks the API server whether these credentials may.
NEEDED = (
    *((verb, "jobsets", "jobset.x-k8s.io") for verb in ("create", "get", "list", "delete")),
    *((verb, "pods", "") for verb in ("create", "get", "list", "watch", "delete")),
    ("get", "pods/log", ""),
    *((verb, resource, "") for resource in ("secrets", "configmaps")
      for verb in ("create", "get", "list", "delete")),
    ("get", "persistentvolumeclaims", ""),
)
COMMAND_TIMEOUT_S = 300.0  # a command pod: scheduling and an image pull, then the command
GONE_WAIT_S = 120.0  # how long the previous attempt's JobSet may take to go
# A log request is the API server dialling the pod's kubelet: the real dial timeout is 30 s,
# so a node whose kubelet is gone answers 500 within this (or the request times out).
KUBELET_PROBE_S = 40.0
KUEUE_GROUP, KUEUE_VERSION = "kueue.x-k8s.io", "v1beta1"
# A dead node's Ready goes Unknown within the node monitor's grace (40 s; 50 s from 1.32):
# one found lost that is still Ready with no change well after that was not lost.
NODE_MONITOR_GRACE_MAX_S = 120.0
IMAGE_PROBE_S = 600.0  # the doctor's probe pod: a GPU image's first pull takes minutes
QUEUE_ASK_EVERY_S = 2.0  # the queued JobSet and its Workload, read at most this often
NO_WORKLOAD_S = 30.0  # a queued JobSet Kueue made no Workload for within this: Kueue ignores it
FETCH_MAX_BYTES = 64 << 20  # a file read back through a pod's log


class KubernetesProvider(Provider):
    """One JobSet per attempt in ``provider.namespace``; see the module docstring."""

    kind = "kubernetes"
    warm_tasks = False  # a warm task would be a second pod per task: not yet
    interchangeable_hosts = True  # a pod's name is its index: a smaller group is the first N
    # An elastic group's check for the room of a pod it goes on without: a reservation pod
    # is bound within moments of a node having room (it stays queued between checks).
    return_probe_s = 5.0

    def __init__(self, spec: ClusterSpec, spec_path: Path) -> None:
        super().__init__(spec, spec_path)
        if not isinstance(spec.provider, KubernetesConfig):
            raise ProviderError(f"provider.kind is {spec.provider.kind!r}, not kubernetes")
        self.config = spec.provider
        self._kube: Kube | None = None
        self._watch: PodWatch | None = None
        self._followers: dict[str, LogFollower] = {}
        self._runners: dict[str, PodRunner] = {}
        # node -> (its Ready condition's lastTransitionTime when it was found lost, when it
        # was found): the next attempts avoid it until it is Ready again after that
        self._lost_nodes: dict[str, tuple[str, float]] = {}
        self._unanswered: dict[str, str] = {}  # pod -> why its kubelet did not answer
        self._submitted: dict[int, float] = {}  # attempt -> when its JobSet was created
        self._queue_seen: tuple[float, int, str | None] = (float("-inf"), 0, None)
        self._group: set[str] | None = None  # the hosts of the attempt this controller started
        self._started: tuple[str, int] | None = None  # and its run and number
        self._seen_unplaced: dict[str, str] = {}  # pod -> the scheduler's reason, as last seen
        self._lock = threading.Lock()
        self.state_path = paths.hosts_cache(spec.name, self.kind)

    # -- the API -------------------------------------------------------------------------
    @property
    def kube(self) -> Kube:
        with self._lock:
            if self._kube is None:
                self._kube = Kube(self.config)
            return self._kube

    def watch(self) -> PodWatch:
        """The pods of the cluster, watched from the first call on."""
        kube = self.kube
        with self._lock:
            if self._watch is None:
                self._watch = PodWatch(kube, manifests.selector(self.spec.name)).start()
        if not self._watch.synced.wait(30):
            raise ProviderError(f"cannot list the cluster's pods {kube.where}: "
                                f"{self._watch.error or 'no answer'}",
                                fix="check that the cluster is up and these credentials work")
        return self._watch

    def close(self) -> None:
        with self._lock:
            watch, self._watch = self._watch, None
            followers, self._followers = list(self._followers.values()), {}
            kube, self._kube = self._kube, None
        for follower in followers:
            follower.stop()
        if watch is not None:
            watch.stop()
        if kube is not None:
            kube.close()

    # -- hosts ---------------------------------------------------------------------------
    def hosts(self) -> list[Host]:
        return manifests.hosts(self.spec)

    def spare_hosts(self) -> list[Host]:
        """The pods past ``workers`` an elastic group may grow to (``elastic.max_workers``):
        each one once a node has room for it (``repair``'s reservation pod)."""
        return manifests.hosts(self.spec, spares=True)[self.spec.num_tasks:]

    def _slots(self) -> dict[str, tuple[str, int]]:
        """Every host, spares included, and the (role, JobSet index) of its pod."""
        return dict(zip((h.name for h in self.all_hosts()),
                        manifests.roles(self.spec, spares=True), strict=True))

    def python(self, host: Host) -> str:
        assert self.spec.container is not None  # the spec requires it on kubernetes
        return self.spec.container.python

    def runner(self, host: Host) -> Runner:
        with self._lock:
            if host.name not in self._runners:
                self._runners[host.name] = PodRunner(self, host.name)
            return self._runners[host.name]

    def describe(self) -> dict[str, Any]:
        """What ``train`` applies, as ``plan`` shows it: the first attempt's JobSet, with the
        ConfigMaps 'up' would make of the code as it is now (read here, nothing is sent)."""
        where = (f"namespace {self.config.namespace}, context "
                 f"{self.config.context or '(the kubeconfig current one)'}")
        out: dict[str, Any] = {"where": where, "jobset": manifests.jobset_name(self.spec.name),
                               "pods": self.spec.num_tasks}
        try:
            code, lib = (m for _, m in self._code_maps())
            plan = planning.build(self.spec, self.hosts(), run_id="next-run",
                                  python=self.python(self.hosts()[0]), local_workdir="")
            out["manifest"] = manifests.jobset(self.spec, plan, code=code, lib=lib,
                                               secrets=self.spec.secrets)
        except (ProviderError, RemoteError) as exc:
            out["refused"] = str(exc)
        return {"kubernetes": out}

    # -- up ------------------------------------------------------------------------------
    def up(self) -> list[Host]:
        problems = self.cluster_problems()
        blocking = [p for p in problems if p.blocking]
        if blocking:
            first = blocking[0]
            more = f" (and {len(blocking) - 1} more: see 'orchestrate doctor')" \
                if len(blocking) > 1 else ""
            raise ProviderError(f"{first.message}{more}", fix=first.fix)
        code, lib = self._put_code()
        self.state_path.parent.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
        write_atomic(self.state_path, json.dumps({
            "server": self.kube.server, "context": self.kube.context,
            "namespace": self.config.namespace, "code": code.name, "lib": lib.name,
            "code_items": [list(i) for i in code.items],
            "lib_items": [list(i) for i in lib.items]}))
        return self.hosts()

    def cluster_problems(self) -> list[Problem]:
        """What keeps the cluster from running the job, as the doctor reports it."""
        kube = self.kube
        found: list[Problem] = []
        versions = kube.jobset_versions()
        if versions is None:
            found.append(Problem(
                "kubernetes", f"the JobSet API is not installed {kube.where}",
                "install JobSet (kubectl apply --server-side -f the manifests of a JobSet "
                "release, v0.8 or later): see the README's Kubernetes section"))
        elif JOBSET_VERSION not in versions:
            found.append(Problem(
                "kubernetes", f"the JobSet CRD serves {', '.join(versions) or 'no version'}, "
                f"not {JOBSET_VERSION}", "upgrade JobSet to v0.8 or later"))
        namespace = kube.call(f"read namespace {kube.namespace}", kube.core.read_namespace,
                              kube.namespace, missing_ok=True) if self._may_read_namespaces() \
            else {}
        if namespace is None:
            found.append(Problem("kubernetes", f"namespace {kube.namespace} does not exist "
                                 f"{kube.where}", f"kubectl create namespace {kube.namespace}, "
                                 "or set provider.namespace"))
            return found
        denied = [f"{verb} {resource}" for verb, resource, group in NEEDED
                  if not kube.allowed(verb, resource, group)[0]]
        if denied:
            found.append(Problem(
                "kubernetes", f"these credentials may not {', '.join(denied)} in namespace "
                f"{kube.namespace}", "ask for a Role with these verbs there (the README's "
                "Kubernetes section has one) and a RoleBinding to you"))
        if self.config.volume is not None:
            found += self._volume_problems(self.config.volume.claim)
        if self.config.service_account:
            found += self._account_problems(self.config.service_account)
        if self.config.queue:
            found += self._queue_problems(self.config.queue)
        found += self._node_problems()
        return found

    def _queue_problems(self, queue: str) -> list[Problem]:
        """provider.queue names a LocalQueue of Kueue in the namespace."""
        kube = self.kube
        try:
            local = kube.call(f"read LocalQueue {queue}", kube.custom.get_namespaced_custom_object,
                              KUEUE_GROUP, KUEUE_VERSION, kube.namespace, "localqueues", queue,
                              missing_ok=True)
        except KubeError as exc:
            if exc.code == 403:
                return [Problem("kubernetes", f"these credentials may not read LocalQueue "
                                f"{queue}: up cannot check provider.queue", "grant get on "
                                "localqueues.kueue.x-k8s.io", blocking=False)]
            raise
        if local is not None:
            return []
        if not kube.crd_versions(f"localqueues.{KUEUE_GROUP}"):
            return [Problem("kubernetes", f"provider.queue is {queue} but Kueue is not installed "
                            f"{kube.where} (no LocalQueue API)", "install Kueue with its JobSet "
                            "integration, or remove provider.queue")]
        return [Problem("kubernetes", f"provider.queue: no LocalQueue {queue} in namespace "
                        f"{kube.namespace}", f"kubectl -n {kube.namespace} get localqueues "
                        "lists them: name one, or ask for one")]

    def _account_problems(self, account: str) -> list[Problem]:
        """provider.service_account names a ServiceAccount of the namespace (a pod that names a
        missing one is never created: the Job's controller says so only in its events)."""
        kube = self.kube
        if not kube.allowed("get", "serviceaccounts")[0]:
            return [Problem("kubernetes", f"these credentials may not read ServiceAccount "
                            f"{account}: up cannot check provider.service_account", "grant get "
                            "on serviceaccounts", blocking=False)]
        found = kube.call(f"read ServiceAccount {account}",
                          kube.core.read_namespaced_service_account, account, kube.namespace,
                          missing_ok=True)
        if found is not None:
            return []
        return [Problem("kubernetes", f"provider.service_account: no ServiceAccount {account} "
                        f"in namespace {kube.namespace}", f"kubectl -n {kube.namespace} create "
                        f"serviceaccount {account}, and give it the bucket of checkpoint.dir "
                        "(the README's Kubernetes section: Workload Identity)")]

    def _node_problems(self) -> list[Problem]:
        """Whether the nodes there are now can hold the job's pods (their labels, taints and
        allocatable resources; not what already runs there). Said, never blocking: a node
        pool that autoscales from zero has no node until pods wait for one."""
        kube = self.kube
        if not kube.allowed("list", "nodes", namespaced=False)[0]:
            return [Problem(
                "kubernetes", "these credentials may not list nodes: up cannot tell whether a "
                "node can hold the pods, and a lost node shows as a crash", "grant get and "
                "list on nodes (a ClusterRole and a ClusterRoleBinding; the README's "
                "Kubernetes section has one)", blocking=False)]
        listing = kube.call("list the nodes", kube.core.list_node).get("items", [])
        node_selector, tolerations = manifests.placement(self.config)
        requests, _ = manifests.pod_resources(self.config)
        holds, why_not = 0, []
        for node in listing:
            count, why = nodes.pods_it_holds(node, node_selector=node_selector,
                                             tolerations=tolerations, requests=requests)
            holds += count
            if why:
                why_not.append(why)
        wanted, most = self.spec.num_tasks, self.spec.num_tasks + self.spec.spares
        if holds >= most:
            return []
        asks = ", ".join(f"{v} {k}" for k, v in requests.items()) or "nothing"
        shown = "; ".join(why_not[:3]) + (f"; and {len(why_not) - 3} more"
                                          if len(why_not) > 3 else "")
        fix = ("add a node pool that matches provider.node_selector, tolerations, gpus_per_pod "
               "and resources (GKE: gcloud container node-pools create ... --accelerator "
               "type=TYPE,count=N), or let one autoscale: the pods wait for it, with the reason "
               "in the view")
        if holds >= wanted:  # elastic.max_workers past what the nodes can ever hold
            return [Problem(
                "kubernetes", f"the nodes now hold {holds} pods at most (each asks {asks}): "
                f"the group starts with {wanted} and grows to {holds} of elastic.max_workers "
                f"({most}) until more nodes are added: {shown or 'every node is full'}",
                fix, blocking=False)]
        said = f"no node now can hold a pod (each asks {asks})" if holds == 0 else \
            f"the nodes now hold {holds} of the {wanted} pods at most (each asks {asks})"
        policy = self.spec.elastic
        if policy is not None and holds >= policy.min_workers:
            said += (f"; elastic: the group goes on with {holds} once the pods left waiting "
                     "pass timeouts.repair_s")
        return [Problem("kubernetes", f"{said}: {shown or 'the cluster has no node'}", fix,
                        blocking=False)]

    def _may_read_namespaces(self) -> bool:
        return self.kube.allowed("get", "namespaces")[0]

    def _volume_problems(self, claim: str) -> list[Problem]:
        kube = self.kube
        pvc = kube.call(f"read PersistentVolumeClaim {claim}",
                        kube.core.read_namespaced_persistent_volume_claim, claim, kube.namespace,
                        missing_ok=True)
        if pvc is None:
            return [Problem("kubernetes", f"provider.volume.claim: no PersistentVolumeClaim "
                            f"{claim} in namespace {kube.namespace}", "create a ReadWriteMany "
                            "claim (Filestore, NFS, gcsfuse CSI) and name it here")]
        modes = pvc.get("spec", {}).get("accessModes") or []
        if "ReadWriteMany" not in modes:
            return [Problem("kubernetes", f"PersistentVolumeClaim {claim} is "
                            f"{', '.join(modes) or 'of no access mode'}: every pod must mount "
                            "it at once (ReadWriteMany)", "use a ReadWriteMany claim "
                            "(Filestore, NFS, the gcsfuse CSI driver)")]
        return []

    def cloud_check(self) -> CloudCheck:
        """The cluster's problems. The pods are made per attempt, so there is no host to ask
        before 'train' (each pod's Python, TensorFlow and links show in its first events)."""
        unmade = tuple(h.name for h in self.hosts())
        try:
            return CloudCheck(problems=tuple(self.cluster_problems()), unprovisioned=unmade)
        except ProviderError as exc:
            return CloudCheck(problems=(Problem("kubernetes", exc.message, exc.fix or ""),),
                              unprovisioned=unmade)

    def _code_maps(self) -> list[tuple[dict[str, Any], manifests.Files]]:
        """The ConfigMaps of the workdir and of the worker package, as 'up' makes them.

        Raises:
            ProviderError: the workdir is over what a ConfigMap holds.
        """
        import worker

        workdir = (Path(self.spec_path).parent / self.spec.workdir).resolve()
        try:
            code = files_of(str(workdir), self.config.sync_excludes,
                            max_bytes=manifests.CONFIGMAP_MAX_BYTES)
        except RemoteError as exc:
            raise ProviderError(f"the workdir {workdir} is over the 1 MiB a ConfigMap holds",
                                fix="leave data and outputs out with provider.sync_excludes, "
                                    "or put the code in container.image") from exc
        package = Path(worker.__file__).parent
        lib = {f"worker/{path}": blob for path, blob in files_of(
            str(package), ("__pycache__", "*.pyc"),
            max_bytes=manifests.CONFIGMAP_MAX_BYTES).items()}
        return [manifests.configmap(self.spec.name, content, self.config.namespace, files)
                for content, files in (("code", code), ("lib", lib))]

    def _put_code(self) -> tuple[manifests.Files, manifests.Files]:
        """The ConfigMaps of the workdir and of the worker package, made if missing (their
        names are their content's hash: one that exists holds the same files)."""
        kube = self.kube
        made = []
        for manifest, mounted in self._code_maps():
            try:
                kube.call(f"create ConfigMap {mounted.name}",
                          kube.core.create_namespaced_config_map, kube.namespace, manifest)
            except KubeError as exc:
                if exc.code != 409:
                    raise
            made.append(mounted)
        return made[0], made[1]

    def _files(self) -> tuple[manifests.Files, manifests.Files]:
        try:
            state = json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            raise ProviderError(f"cluster {self.spec.name} is not up on Kubernetes",
                                fix="run 'orchestrate up' first") from None
        return (manifests.Files(state["code"], tuple(tuple(i) for i in state["code_items"])),
                manifests.Files(state["lib"], tuple(tuple(i) for i in state["lib_items"])))

    # -- an attempt ----------------------------------------------------------------------
    def start_group(self, plan: ClusterPlan) -> list[TaskHandle] | None:
        """The attempt's Secret and JobSet, once the previous attempt's JobSet is gone."""
        kube = self.kube
        code, lib = self._files()
        names = [key for key in self.spec.secrets if key in plan.chief.env]
        values = {key: plan.chief.env[key] for key in names}
        plain = dataclasses.replace(plan, tasks=tuple(
            dataclasses.replace(t, env={k: v for k, v in t.env.items() if k not in values})
            for t in plan.tasks))
        self._remove_jobset(wait=True)
        # the room an elastic group's reservation pods held passes to the tasks' pods
        for task in plan.tasks:
            self._release(task.host)
        with self._lock:
            self._group = {t.host.name for t in plan.tasks}
            self._started = (plan.run_id, plan.attempt)
        jobset = manifests.jobset(self.spec, plain, code=code, lib=lib, secrets=names,
                                  avoid_nodes=self._nodes_to_avoid())
        if names:
            secret = manifests.secret(self.spec.name, kube.namespace, values,
                                      run_id=plan.run_id, attempt=plan.attempt)
            kube.call(f"delete Secret {manifests.secret_name(self.spec.name)}",
                      kube.core.delete_namespaced_secret, manifests.secret_name(self.spec.name),
                      kube.namespace, missing_ok=True)
            kube.call("create the attempt's Secret", kube.core.create_namespaced_secret,
                      kube.namespace, secret)
        kube.call(f"create JobSet {jobset['metadata']['name']}",
                  kube.custom.create_namespaced_custom_object, JOBSET_GROUP, JOBSET_VERSION,
                  kube.namespace, JOBSETS, jobset)
        with self._lock:
            self._submitted[plan.attempt] = time.monotonic()
        self.watch()
        return [PodRef(plan.run_id, plan.attempt, t.role, t.index).handle(t.host.name)
                for t in plan.tasks]

    def _remove_jobset(self, *, wait: bool, grace_s: int | None = None) -> bool:
        """Delete the cluster's JobSet (its Jobs and pods go with it); whether there was one."""
        kube = self.kube
        name = manifests.jobset_name(self.spec.name)
        gone = kube.call(f"delete JobSet {name}", kube.custom.delete_namespaced_custom_object,
                         JOBSET_GROUP, JOBSET_VERSION, kube.namespace, JOBSETS, name,
                         propagation_policy="Foreground", grace_period_seconds=grace_s,
                         missing_ok=True)
        if gone is None or not wait:
            return gone is not None
        deadline = time.monotonic() + GONE_WAIT_S
        forced: set[str] = set()
        while time.monotonic() < deadline:
            if kube.call(f"read JobSet {name}", kube.custom.get_namespaced_custom_object,
                         JOBSET_GROUP, JOBSET_VERSION, kube.namespace, JOBSETS, name,
                         missing_ok=True) is None:
                return True
            self._force_stuck_pods(forced)
            time.sleep(0.5)
        raise ProviderError(f"JobSet {name} of the previous attempt is still there after "
                            f"{GONE_WAIT_S:.0f}s {kube.where}",
                            fix=f"kubectl -n {kube.namespace} get jobset {name} -o yaml shows "
                                "what holds it (a finalizer); delete it, then train again")

    def _force_stuck_pods(self, done: set[str]) -> None:
        """Delete with no grace the pods that wait to be deleted on a lost node: its kubelet
        will never confirm, and they hold the JobSet's deletion (as ``kubectl delete --force``
        would; the kubelet kills what is left of them if the node comes back)."""
        kube = self.kube
        with self._lock:
            lost = set(self._lost_nodes)
        for state in list(self.watch().pods.values()):
            meta, node = state.pod["metadata"], state.pod["spec"].get("nodeName")
            if state.deleted or state.name in done or not meta.get("deletionTimestamp") or \
                    node not in lost:
                continue
            done.add(state.name)
            self.progress(f"pod {state.name} is stuck terminating on lost node {node}: "
                          "deleted with no grace")
            kube.call(f"delete pod {state.name}", kube.core.delete_namespaced_pod, state.name,
                      kube.namespace, grace_period_seconds=0, missing_ok=True)

    # -- lost nodes ----------------------------------------------------------------------
    def lost_hosts(self, hosts: Sequence[Host]) -> dict[str, str]:
        """After a task failed: the tasks of ``hosts`` whose node was lost under their pod.
        A node the cluster has marked (gone, not Ready, tainted unreachable), else one whose
        kubelet does not answer: a node that just died still counts Ready for the node
        monitor's grace (40 to 50 s), but the API server cannot reach its kubelet for the
        pod's log. The next attempts' pods avoid a lost node (``start_group``)."""
        keys = self._slots()
        newest: dict[str, PodState] = {}
        for state in list(self.watch().pods.values()):
            labels = state.labels
            for host in hosts:
                role, index = keys.get(host.name, ("", -1))
                if (labels.get(manifests.ROLE_LABEL), labels.get(manifests.JOB_INDEX_KEY)) != \
                        (role, str(index)):
                    continue
                had = newest.get(host.name)
                if had is None or _attempt(state) > _attempt(had):
                    newest[host.name] = state
        # a task whose newest pod was never placed lost no node (the scheduler had none)
        newest = {name: state for name, state in newest.items()
                  if state.pod["spec"].get("nodeName")}
        seen: dict[str, dict[str, Any] | None] = {}
        try:
            for state in newest.values():
                node = state.pod["spec"]["nodeName"]
                if node not in seen:
                    seen[node] = self.kube.call(f"read node {node}", self.kube.core.read_node,
                                                 node, missing_ok=True)
        except KubeError:
            return {}  # nodes may not be read with these credentials: nothing to tell

        def check(item: tuple[str, PodState]) -> str | None:
            _, state = item
            node_name = state.pod["spec"]["nodeName"]
            node = seen[node_name]
            if node is None:
                return f"node {node_name} is gone"
            marked = nodes.trouble(node)
            if marked:
                return f"node {node_name} {marked}"
            with self._lock:
                unanswered = self._unanswered.get(state.name)
            if unanswered is None and not state.deleted and not _container_ended(state.pod):
                unanswered = self._kubelet_unreachable(state.name)
            return f"the kubelet of node {node_name} does not answer ({unanswered})" \
                if unanswered else None

        found = fan_out(list(newest.items()), check, name_of=lambda item: item[0]).values()
        lost = {name: why for name, why in found.items() if isinstance(why, str)}
        with self._lock:
            for name in lost:
                node_name = newest[name].pod["spec"]["nodeName"]
                self._lost_nodes[node_name] = (nodes.ready_since(seen[node_name]),
                                               time.monotonic())
        return lost

    def ask_kubelet(self, ref: PodRef) -> None:
        """Before the task's pod is deleted at once (a deleted pod's log cannot be asked
        for): whether its kubelet answers, remembered for ``lost_hosts``."""
        found = self.pod(ref)
        if found is None or found.deleted or _container_ended(found.pod) or \
                not found.pod["spec"].get("nodeName"):
            return
        unanswered = self._kubelet_unreachable(found.name)
        if unanswered:
            with self._lock:
                self._unanswered[found.name] = unanswered

    def _kubelet_unreachable(self, pod: str) -> str | None:
        """Why the API server cannot reach ``pod``'s kubelet, asking for one line of its log;
        None when it answers (whatever the answer)."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        kube = self.kube
        try:
            response = kube.stream(kube.core.read_namespaced_pod_log, pod, kube.namespace,
                                   container=manifests.CONTAINER, tail_lines=1,
                                   timeout_s=KUBELET_PROBE_S)
            response.release_conn()
        except ApiException as exc:
            message = _status_message(exc)
            return message if exc.status in (500, 502, 503) and ":10250" in message else None
        except (HTTPError, OSError):
            return f"no answer in {KUBELET_PROBE_S:.0f}s"
        return None

    def _nodes_to_avoid(self) -> list[str]:
        """The lost nodes the next JobSet avoids: each until it is Ready again after it was
        lost, or until it has stayed Ready past the node monitor's grace (a node whose kubelet
        did not answer for a moment, and that the cluster never marked, is not lost)."""
        with self._lock:
            lost = dict(self._lost_nodes)
        avoid = []
        for name, (since, found_at) in lost.items():
            try:
                node = self.kube.call(f"read node {name}", self.kube.core.read_node, name,
                                      missing_ok=True)
            except KubeError:
                avoid.append(name)
                continue
            if node is None:
                continue  # gone: nothing is placed there
            if not nodes.trouble(node) and (
                    nodes.ready_since(node) != since
                    or time.monotonic() - found_at > NODE_MONITOR_GRACE_MAX_S):
                with self._lock:
                    self._lost_nodes.pop(name, None)  # back, or never gone
                continue
            avoid.append(name)
        return avoid

    # -- Kueue ---------------------------------------------------------------------------
    def queued(self, attempt: int) -> str | None:
        """Why the attempt's JobSet waits in its Kueue queue (suspended, its Workload not
        admitted), from the Workload's QuotaReserved message; None once it is resumed.
        Asked at most every ``QUEUE_ASK_EVERY_S`` for all the tasks at once."""
        if not self.config.queue:
            return None
        with self._lock:
            asked_at, asked_for, said = self._queue_seen
        if asked_for == attempt and time.monotonic() - asked_at < QUEUE_ASK_EVERY_S:
            return said
        said = self._ask_queue(attempt)
        with self._lock:
            self._queue_seen = (time.monotonic(), attempt, said)
        return said

    def _ask_queue(self, attempt: int) -> str | None:
        kube, queue = self.kube, self.config.queue
        name = manifests.jobset_name(self.spec.name)
        jobset = kube.call(f"read JobSet {name}", kube.custom.get_namespaced_custom_object,
                           JOBSET_GROUP, JOBSET_VERSION, kube.namespace, JOBSETS, name,
                           missing_ok=True)
        if jobset is None or not jobset.get("spec", {}).get("suspend") or \
                jobset["metadata"].get("labels", {}).get(manifests.ATTEMPT_LABEL) != str(attempt):
            return None
        where = f"in Kueue's LocalQueue {queue}"
        try:
            listing = kube.call("list the JobSet's Kueue Workload",
                                kube.custom.list_namespaced_custom_object, KUEUE_GROUP,
                                KUEUE_VERSION, kube.namespace, "workloads",
                                label_selector=f"kueue.x-k8s.io/job-uid="
                                               f"{jobset['metadata']['uid']}")
        except KubeError as exc:
            return f"queued {where}, not admitted yet (its Workload cannot be read: {exc.message})"
        workloads = listing.get("items", [])
        if not workloads:
            with self._lock:
                submitted = self._submitted.get(attempt, time.monotonic())
            if time.monotonic() - submitted < NO_WORKLOAD_S:
                return f"queued {where}: Kueue has not made its Workload yet"
            return (f"suspended for {queue} but Kueue made no Workload for it in "
                    f"{NO_WORKLOAD_S:.0f}s (fix: turn on Kueue's JobSet integration, "
                    "integrations.frameworks: jobset.x-k8s.io/jobset, or remove provider.queue)")
        conditions = workloads[0].get("status", {}).get("conditions") or []
        reserved: dict[str, Any] = next(
            (c for c in conditions if c.get("type") == "QuotaReserved"), {})
        message = str(reserved.get("message") or "no quota reserved yet")
        fix = (f"kubectl -n {kube.namespace} describe localqueue {queue} shows the queue; "
               "the JobSet starts when Kueue admits it")
        if reserved.get("reason") == "Inadmissible":
            fix = "fix provider.queue or the queue's ClusterQueue"
        return f"queued {where}, not admitted: {message} ({fix})"

    def pod(self, ref: PodRef) -> PodState | None:
        return self.watch().find({manifests.CLUSTER_LABEL: self.spec.name, **ref.labels()})

    def follower(self, ref: PodRef) -> LogFollower | None:
        """The log follower of the task's pod, started once its container started."""
        found = self.pod(ref)
        if found is None:
            return None
        with self._lock:
            follower = self._followers.get(found.name)
        if follower is not None:
            return follower
        if not any(s.get("state", {}).get("running") or s.get("state", {}).get("terminated")
                   for s in found.pod.get("status", {}).get("containerStatuses") or []):
            return None
        follower = LogFollower(self.kube, found.name, manifests.CONTAINER,
                               lambda: self._terminated(found.name))
        with self._lock:
            if found.name in self._followers:
                return self._followers[found.name]
            self._followers[found.name] = follower
        return follower.start()

    def _terminated(self, name: str) -> bool:
        state = self.watch().pods.get(name)
        if state is None or state.deleted:
            return True
        return any(s.get("state", {}).get("terminated")
                   for s in state.pod.get("status", {}).get("containerStatuses") or [])

    def read_log(self, ref: PodRef) -> bytes:
        """The whole log of the task's pod, as the API server has it now."""
        found = self.pod(ref)
        if found is None or found.deleted:
            return b""
        kube = self.kube
        response = kube.stream(kube.core.read_namespaced_pod_log, found.name, kube.namespace,
                               container=manifests.CONTAINER, timeout_s=60)
        try:
            return bytes(response.data)
        finally:
            response.release_conn()

    def delete_pod(self, ref: PodRef, grace_s: int | None) -> None:
        found = self.pod(ref)
        if found is None or found.deleted:
            return
        kube = self.kube
        kube.call(f"delete pod {found.name}", kube.core.delete_namespaced_pod, found.name,
                  kube.namespace, grace_period_seconds=grace_s, missing_ok=True)

    # -- a command "on a host": a pod of its own -----------------------------------------
    def run_pod(self, script: str, *, timeout_s: float | None = None,
                input: str | None = None, like_a_task: bool = False) -> ExecResult:
        """``script`` in a pod of the image with the cluster's volume; its log is stdout.
        ``like_a_task``: placed and given resources as a task's pod, and given up (a
        RemoteError with the reason) once it cannot start (no node can hold it, its image
        cannot be pulled)."""
        assert self.spec.container is not None
        kube = self.kube
        _, lib = self._files()
        pod = command_pod(self.spec.name, kube.namespace, self.spec.container.image,
                          paths.lib_dir(manifests.ROOT), script, lib, self.config, input,
                          like_a_task=like_a_task, avoid_nodes=self._nodes_to_avoid())
        name = pod["metadata"]["name"]
        watch = self.watch()
        kube.call(f"create pod {name}", kube.core.create_namespaced_pod, kube.namespace, pod)
        limit_s = max(timeout_s or 0, COMMAND_TIMEOUT_S)
        deadline = time.monotonic() + limit_s
        try:
            version = watch.version
            while True:
                state = watch.pods.get(name)
                for status in (state.pod.get("status", {}).get("containerStatuses") or []
                               if state else []):
                    ended = status.get("state", {}).get("terminated")
                    if ended is not None:
                        log = self._pod_log(name)
                        return ExecResult(int(ended.get("exitCode", 1)), log, "")
                if state is not None and state.deleted:
                    raise RemoteError(f"command pod {name} was deleted before it ended")
                stuck = pod_waiting(state.pod) if like_a_task and state is not None else None
                if stuck:
                    raise RemoteError(stuck)
                if time.monotonic() > deadline:
                    raise RemoteError(f"command pod {name} did not end within {limit_s:.0f}s",
                                      fix=f"kubectl -n {kube.namespace} describe pod {name}")
                version = watch.wait(version, 1.0)
        finally:
            kube.call(f"delete pod {name}", kube.core.delete_namespaced_pod, name,
                      kube.namespace, grace_period_seconds=0, missing_ok=True)

    def image_problems(self) -> list[Problem]:
        """One pod of the image, placed and given resources as a task's pod: whether its
        Python imports TensorFlow and sees the GPUs the pod is given."""
        try:
            result = self.run_pod(shlex.join(probe_argv(self.python(self.hosts()[0]),
                                                        "tensorflow")),
                                  timeout_s=IMAGE_PROBE_S, like_a_task=True)
        except RemoteError as exc:
            return [Problem("image", f"a pod like a task's could not run the probe: "
                            f"{exc.message}", exc.fix or "see the reason", blocking=False)]
        lines = result.stdout.strip().splitlines()
        try:
            facts = json.loads(lines[-1]) if lines else {}
        except ValueError:
            facts = {}
        image = self.spec.container.image if self.spec.container else "?"
        if not isinstance(facts, dict) or "python" not in facts:
            said = (result.stdout + result.stderr).strip()[-500:]
            return [Problem("image", f"{image}: {self.python(self.hosts()[0])} did not run the "
                            f"probe (exit {result.exit_code}): {said}", "set container.python "
                            "to the image's interpreter")]
        if facts.get("error"):
            return [Problem("image", f"{image}: Python {facts['python']} cannot import "
                            f"TensorFlow: {facts['error']}", "install TensorFlow in the image "
                            "(docker/ builds one), or set container.python to the "
                            "interpreter that has it")]
        gpus, wanted = facts.get("gpus") or [], self.config.gpus_per_pod
        if wanted and len(gpus) != wanted:
            return [Problem("image", f"{image}: TensorFlow {facts.get('tensorflow')} sees "
                            f"{len(gpus)} GPU(s) in a pod given {wanted} "
                            f"({self.config.gpu_resource})", "a CUDA build of TensorFlow "
                            "(tensorflow[and-cuda]) in the image, on a node with the GPU "
                            "driver installed (GKE: the node pool's gpu-driver-version)")]
        return []

    def _pod_log(self, name: str) -> str:
        kube = self.kube
        response = kube.stream(kube.core.read_namespaced_pod_log, name, kube.namespace,
                               container=manifests.CONTAINER, timeout_s=60)
        try:
            return bytes(response.data).decode(errors="replace")
        finally:
            response.release_conn()

    def fetch_file(self, remote_path: str, local_path: str) -> None:
        """A file of the volume, read back through a command pod's log."""
        out = self.run_pod(f"head -c {FETCH_MAX_BYTES + 1} {_quote(remote_path)} | base64 -w0")
        if not out.ok:
            raise RemoteError(f"cannot read {remote_path} on the volume: {out.stdout[-500:]}")
        data = base64.b64decode(out.stdout.strip() or b"")
        if len(data) > FETCH_MAX_BYTES:
            raise RemoteError(f"{remote_path} is over {FETCH_MAX_BYTES >> 20} MiB",
                              fix="read it from provider.volume directly")
        Path(local_path).parent.mkdir(parents=True, exist_ok=True)
        Path(local_path).write_bytes(data)

    def host_health(self, host: Host) -> HostHealth:
        """A pod's host is the cluster: it answers while the API server does."""
        try:
            self.kube.call("ask the API server for its version",
                           self.kube.core.get_api_resources)
        except ProviderError:
            return HostHealth.UNREACHABLE
        return HostHealth.RUNNING

    def repair(self, host: Host, deadline_s: float) -> Host:
        """A lost pod needs no repair: the next JobSet makes a new one (away from a lost
        node). An elastic group's pod that no node could take (the watch gave up on it after
        ``timeouts.repair_s``) is refused, with the scheduler's reason; one the group goes on
        without (or a spare) is back once its reservation pod is bound to a node.

        Raises:
            ProviderError: no node can take the pod (now, or within ``deadline_s``).
        """
        if self.spec.elastic is None:
            return host
        fix = ("free or add a node the pods fit on (a cluster autoscaler may be adding one): "
               "the group grows back once one has room")
        unplaced = self._unplaced(host)
        if unplaced:
            raise ProviderError(f"no node can take a worker's pod: {unplaced}", fix=fix)
        if host.name in self._current_group():
            return host
        why = self._reserve(host, deadline_s)
        if why:
            raise ProviderError(f"no node has room for another worker's pod yet: {why}; its "
                                "reservation pod stays queued", fix=fix)
        return host

    def give_up(self, host: Host) -> None:
        """An elastic run ended without ``host``: its reservation pod goes."""
        self._release(host)

    def unplaced(self, ref: PodRef) -> str | None:
        """The scheduler's reason when no node can take the task's pod now (remembered: a pod
        bound only as the attempt is stopped, into the room its peers' deletion freed, was
        still never placed while it ran)."""
        found = self.pod(ref)
        if found is None or found.deleted:
            return None
        reason = unschedulable(found.pod)
        if reason:
            with self._lock:
                self._seen_unplaced[found.name] = reason
        return reason

    def _unplaced(self, host: Host) -> str | None:
        """The scheduler's reason when ``host``'s pod of the newest attempt was never placed
        while the attempt ran (as the watch saw it last, deleted or not): not bound, or bound
        with its container never started after this controller saw it unplaced."""
        key = self._slots()[host.name]
        found = [p for p in self._newest_pods() if _slot(p) == key]
        if not found:
            return None
        reason = unschedulable(found[0].pod)
        with self._lock:
            seen = self._seen_unplaced.get(found[0].name)
        if reason is None and seen and \
                container_state(found[0].pod)[0] not in ("running", "terminated"):
            reason = seen
        return reason

    def _current_group(self) -> set[str]:
        """The hosts of the newest attempt: the one this controller started, else (``train
        --attach``) those with a pod of the newest attempt the watch sees."""
        with self._lock:
            if self._group is not None:
                return set(self._group)
        names = {key: name for name, key in self._slots().items()}
        return {names[key] for p in self._newest_pods() if (key := _slot(p)) in names}

    def _newest_pods(self) -> list[PodState]:
        """The task pods of the newest attempt (deleted ones as last seen): the one this
        controller started, else the newest the watch has seen."""
        with self._lock:
            started = self._started
        pods = [p for p in self.watch().snapshot() if _slot(p) is not None]
        if started is None and pods:
            newest = max(pods, key=lambda p: (not p.deleted, _attempt(p)))
            started = (newest.labels.get(manifests.RUN_LABEL, ""), _attempt(newest))
        return [p for p in pods
                if (p.labels.get(manifests.RUN_LABEL, ""), _attempt(p)) == started]

    def _reservation(self, host: Host) -> PodState | None:
        state = self.watch().pods.get(manifests.reservation_name(host))
        return None if state is None or state.deleted else state

    def _reserve(self, host: Host, deadline_s: float) -> str | None:
        """Hold a node's room for ``host``'s pod with a reservation pod (made once, kept
        while it waits: the scheduler binds it the moment a node has room); None once it
        is bound, else the scheduler's reason after ``deadline_s``."""
        kube, watch = self.kube, self.watch()
        avoid = self._nodes_to_avoid()
        found = self._reservation(host)
        if found is not None and (
                found.pod.get("metadata", {}).get("deletionTimestamp")
                or found.pod.get("status", {}).get("phase") in ("Failed", "Succeeded")
                or (not found.pod["spec"].get("nodeName")
                    and manifests.avoided(found.pod) != sorted(avoid))):
            # its node was lost or preempted, or (still waiting) it avoids a node that is
            # back, or not one lost since: ask again
            self._release(host)
            found = None
        if found is None:
            _, index = self._slots()[host.name]
            pod = manifests.reservation(self.spec, host, index, avoid)
            try:
                kube.call(f"create pod {pod['metadata']['name']}",
                          kube.core.create_namespaced_pod, kube.namespace, pod)
            except KubeError as exc:
                if exc.code != 409:  # made by an earlier check, not yet in the watch: kept
                    raise
        deadline = time.monotonic() + deadline_s
        version = watch.version
        while True:
            found = self._reservation(host)
            if found is not None and found.pod.get("spec", {}).get("nodeName"):
                return None
            if time.monotonic() >= deadline:
                return (unschedulable(found.pod) if found is not None else None) or \
                    "the scheduler has not placed it yet"
            version = watch.wait(version, min(1.0, max(0.0, deadline - time.monotonic())))

    def _release(self, host: Host) -> None:
        """Delete ``host``'s reservation pod, if any, at once (it holds no work)."""
        name = manifests.reservation_name(host)
        state = self.watch().pods.get(name)
        if state is None or state.deleted:
            return
        kube = self.kube
        kube.call(f"delete pod {name}", kube.core.delete_namespaced_pod, name, kube.namespace,
                  grace_period_seconds=0, missing_ok=True)
        deadline = time.monotonic() + GONE_WAIT_S
        while time.monotonic() < deadline and not self.watch().pods[name].deleted:
            self.watch().wait(self.watch().version, 0.5)

    # -- down ----------------------------------------------------------------------------
    def down(self) -> DownReport:
        kube = self.kube
        selector = manifests.selector(self.spec.name)
        removed: list[str] = []
        listing = kube.call("list the cluster's JobSets",
                            kube.custom.list_namespaced_custom_object, JOBSET_GROUP,
                            JOBSET_VERSION, kube.namespace, JOBSETS, label_selector=selector,
                            missing_ok=True) or {}
        for item in listing.get("items", []):
            name = item["metadata"]["name"]
            kube.call(f"delete JobSet {name}", kube.custom.delete_namespaced_custom_object,
                      JOBSET_GROUP, JOBSET_VERSION, kube.namespace, JOBSETS, name,
                      propagation_policy="Foreground", missing_ok=True)
            removed.append(f"JobSet {name}")
        for kind, lister, deleter in (
                ("Pod", kube.core.list_namespaced_pod, kube.core.delete_namespaced_pod),
                ("Secret", kube.core.list_namespaced_secret, kube.core.delete_namespaced_secret),
                ("ConfigMap", kube.core.list_namespaced_config_map,
                 kube.core.delete_namespaced_config_map)):
            items = kube.call(f"list the cluster's {kind}s", lister, kube.namespace,
                              label_selector=selector).get("items", [])
            for item in items:
                name = item["metadata"]["name"]
                is_command = item["metadata"].get("labels", {}).get(
                    manifests.ROLE_LABEL) == COMMAND_ROLE
                kube.call(f"delete {kind} {name}", deleter, name, kube.namespace,
                          grace_period_seconds=0 if is_command else None, missing_ok=True)
                if kind != "Pod":
                    removed.append(f"{kind} {name}")
        with contextlib.suppress(OSError):
            self.state_path.unlink()
        return DownReport(removed=tuple(removed))

    def busy_ports(self, hosts: Sequence[Host]) -> set[tuple[str, int]]:
        return set()  # every pod has an address of its own


def _quote(text: str) -> str:
    return shlex.quote(text)


def _slot(state: PodState) -> tuple[str, int] | None:
    """A task pod's (role, JobSet index); None for any other pod (a command's, a
    reservation's)."""
    labels = state.labels
    role, index = labels.get(manifests.ROLE_LABEL), labels.get(manifests.JOB_INDEX_KEY, "")
    if role not in ("chief", "worker") or not index.isdigit() or \
            not labels.get(manifests.ATTEMPT_LABEL, "").isdigit():
        return None
    return role, int(index)


def _attempt(state: PodState) -> int:
    value = state.labels.get(manifests.ATTEMPT_LABEL, "")
    return int(value) if value.isdigit() else -1


def _container_ended(pod: dict[str, Any]) -> bool:
    return any(s.get("state", {}).get("terminated")
               for s in (pod.get("status") or {}).get("containerStatuses") or [])


def _status_message(exc: Any) -> str:
    """The message of an API error's Status body (its raw body when it is not one)."""
    body = exc.body.decode(errors="replace") if isinstance(exc.body, bytes) else str(exc.body)
    try:
        message = json.loads(body).get("message")
    except (ValueError, AttributeError):
        message = None
    return str(message or body or exc.reason)[:500]

