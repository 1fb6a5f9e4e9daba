"""The kubernetes provider against the fake API server (tests/fake_kube.py), over HTTP with the
official client: what 'up' checks and makes, the attempt's Secret and JobSet, the pod watch
and the log follower (through dropped streams and a compacted history), 'down', and the
errors a user reads. No controller runs here: the pods are written into the fake's store as
the Job controller and the kubelet would (tests/test_kubernetes_e2e.py runs real ones)."""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from fake_kube import FakeKube, kueue_crd_objects
from fake_kube import KubeError as StoreError

from orchestrator import providers
from orchestrator import spec as specs
from orchestrator.errors import ProviderError
from orchestrator.plan import build
from orchestrator.providers.kubernetes import manifests
from orchestrator.providers.kubernetes import provider as provider_module
from orchestrator.providers.kubernetes.client import KubeError, LogFollower, PodState
from orchestrator.providers.kubernetes.provider import KubernetesProvider
from orchestrator.providers.kubernetes.runner import PodRef
from orchestrator.remote.base import TaskState

SPEC = """\
name: demo
workers: {workers}
job: {{module: m}}
container: {{image: registry.test/orchestrate-worker:1}}
secrets: [WANDB_API_KEY]
provider:
  kind: kubernetes
  kubeconfig: {kubeconfig}
  namespace: ml
  volume: {{claim: shared}}
"""


@pytest.fixture
def fake() -> Iterator[FakeKube]:
    with FakeKube(bookmark_interval_s=0.2) as server:
        server.store.create("namespaces", {"metadata": {"name": "ml"}})
        ready_node(server, "node-1", "2026-11-25T09:00:00Z")  # a node that holds the pods
        server.store.create("persistentvolumeclaims", {
            "metadata": {"name": "shared"}, "spec": {
                "accessModes": ["ReadWriteMany"],
                "resources": {"requests": {"storage": "10Gi"}}}}, namespace="ml")
        yield server


def make_provider(tmp_path: Path, fake: FakeKube, workers: int = 2,
                  extra: str = "") -> KubernetesProvider:
    kubeconfig = fake.write_kubeconfig(tmp_path / "kubeconfig")
    project = tmp_path / "project"
    project.mkdir(exist_ok=True)
    (project / "m.py").write_text("def build_model():\n    pass\n")
    (project / "data.bin").write_bytes(bytes(range(256)))
    (project / "dev.kubeconfig").write_text("a kubeconfig is never uploaded")
    path = project / "spec.yaml"
    path.write_text(SPEC.format(workers=workers, kubeconfig=kubeconfig) + extra)
    provider = providers.for_spec(specs.load(path), path)
    assert isinstance(provider, KubernetesProvider)
    return provider


@pytest.fixture
def provider(tmp_path: Path, fake: FakeKube) -> Iterator[KubernetesProvider]:
    made = make_provider(tmp_path, fake)
    try:
        yield made
    finally:
        made.close()


def eventually(check: Callable[[], Any], timeout_s: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_up_puts_the_code_in_configmaps_and_is_idempotent(provider: KubernetesProvider,
                                                          fake: FakeKube) -> None:
    hosts = provider.up()
    assert [h.name for h in hosts] == ["demo-worker-0-0", "demo-worker-1-0"]
    maps = {m["metadata"]["name"]: m for m in fake.store.list("configmaps", "ml")}
    code = next(m for name, m in maps.items() if name.startswith("demo-code-"))
    lib = next(m for name, m in maps.items() if name.startswith("demo-lib-"))
    assert code["immutable"] is True and lib["metadata"]["labels"]["orchestrate/cluster"] == "demo"
    assert "def build_model" in "".join(code["data"].values())
    assert base64.b64decode(next(iter(code["binaryData"].values()))) == bytes(range(256))
    assert any(key.endswith("worker_indexed.py") for key in lib["data"])
    assert not any("kubeconfig" in key for key in code.get("data", {}))
    provider.up()
    assert len(fake.store.list("configmaps", "ml")) == 2  # the same content: nothing new


@pytest.mark.parametrize(("breaks", "says", "fix"), [
    (lambda fake: fake.store.delete("customresourcedefinitions", "jobsets.jobset.x-k8s.io"),
     "the JobSet API is not installed", "install JobSet"),
    (lambda fake: fake.store.delete("namespaces", "ml"), "namespace ml does not exist",
     "kubectl create namespace ml"),
    (lambda fake: fake.forbid("create", "jobsets"), "may not create jobsets", "Role"),
    (lambda fake: fake.store.delete("persistentvolumeclaims", "shared", "ml"),
     "no PersistentVolumeClaim shared", "ReadWriteMany"),
])
def test_up_refuses_a_cluster_that_cannot_run_the_job(
        provider: KubernetesProvider, fake: FakeKube, breaks: Callable[[FakeKube], Any],
        says: str, fix: str) -> None:
    breaks(fake)
    with pytest.raises(ProviderError) as err:
        provider.up()
    assert says in err.value.message
    assert fix in (err.value.fix or "")
    assert fake.store.list("configmaps", "ml") == []  # nothing made


def test_a_claim_that_not_every_pod_can_mount_is_refused(provider: KubernetesProvider,
                                                         fake: FakeKube) -> None:
    fake.store.delete("persistentvolumeclaims", "shared", "ml")
    fake.store.create("persistentvolumeclaims", {"metadata": {"name": "shared"}, "spec": {
        "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}},
        namespace="ml")
    problems = provider.cloud_check().problems
    assert [p.message for p in problems] == [
        "PersistentVolumeClaim shared is ReadWriteOnce: every pod must mount it at once "
        "(ReadWriteMany)"]


def test_the_kubeconfig_and_its_context_are_explained(tmp_path: Path, fake: FakeKube) -> None:
    provider = make_provider(tmp_path, fake, extra="  context: nope\n")
    with pytest.raises(ProviderError) as err:
        provider.up()
    assert "context 'nope'" in err.value.message and "fake" in (err.value.fix or "")
    (tmp_path / "kubeconfig").unlink()
    with pytest.raises(ProviderError, match="no kubeconfig at"):
        make_provider_without_kubeconfig(tmp_path).up()


def make_provider_without_kubeconfig(tmp_path: Path) -> KubernetesProvider:
    path = tmp_path / "project" / "spec.yaml"
    provider = providers.for_spec(specs.load(path), path)
    assert isinstance(provider, KubernetesProvider)
    return provider


def test_calls_retry_what_the_server_asks_to_and_explain_the_rest(
        provider: KubernetesProvider, fake: FakeKube) -> None:
    slept: list[float] = []
    provider.kube.sleep = slept.append
    fake.fail_next("get", "persistentvolumeclaims", 503, times=2)
    fake.fail_next("get", "persistentvolumeclaims", 429, retry_after=3)
    assert provider.cloud_check().problems == ()
    assert len(slept) == 3 and slept[-1] == 3.0  # Retry-After is honoured
    fake.forbid("get", "persistentvolumeclaims")
    what = "read PersistentVolumeClaim shared"
    with pytest.raises(KubeError) as err:
        provider.kube.call(what, provider.kube.core.read_namespaced_persistent_volume_claim,
                           "shared", "ml")
    assert err.value.code == 403 and err.value.reason == "Forbidden"
    assert 'cannot get resource "persistentvolumeclaims"' in err.value.message
    assert "namespace ml" in (err.value.fix or "")


def plan_of(provider: KubernetesProvider, attempt: int = 1, secret: str = "s3cr3t") -> Any:
    plan = build(provider.spec, provider.hosts(), run_id="r1", attempt=attempt,
                 python="python3", local_workdir="/")
    tasks = tuple(type(t)(**{**t.__dict__, "env": {**t.env, "WANDB_API_KEY": secret}})
                  for t in plan.tasks)
    return type(plan)(**{**plan.__dict__, "tasks": tasks})


def test_an_attempt_is_one_jobset_and_its_secret(provider: KubernetesProvider,
                                                 fake: FakeKube) -> None:
    provider.up()
    handles = provider.start_group(plan_of(provider))
    assert handles is not None and [h.host for h in handles] == ["demo-worker-0-0",
                                                                 "demo-worker-1-0"]
    assert PodRef.of(handles[1]) == PodRef("r1", 1, "worker", 1)
    jobset = fake.store.get("jobsets", "demo", "ml")
    assert jobset["metadata"]["labels"]["orchestrate/attempt"] == "1"
    secret = fake.store.get("secrets", "demo-secrets", "ml")
    assert base64.b64decode(secret["data"]["WANDB_API_KEY"]) == b"s3cr3t"
    assert "s3cr3t" not in json.dumps(jobset)
    # the next attempt replaces both, once the previous JobSet is gone
    provider.start_group(plan_of(provider, attempt=2, secret="n3w"))
    assert fake.store.get("jobsets", "demo", "ml")["metadata"]["labels"][
        "orchestrate/attempt"] == "2"
    assert base64.b64decode(fake.store.get("secrets", "demo-secrets", "ml")["data"][
        "WANDB_API_KEY"]) == b"n3w"


def write_pod(fake: FakeKube, ref: PodRef, name: str, state: dict[str, Any] | None = None,
              phase: str = "Running", node: str = "node-1",
              owner: dict[str, Any] | None = None) -> dict[str, Any]:
    """A pod of the attempt as the Job controller makes it (its labels; ``owner`` holds its
    deletion), with a status as the kubelet reports it."""
    labels = manifests.labels("demo", **ref.labels())
    labels[manifests.JOB_INDEX_KEY] = str(ref.index)
    meta: dict[str, Any] = {"name": name, "labels": labels}
    if owner is not None:
        meta["ownerReferences"] = [{
            "apiVersion": owner["apiVersion"], "kind": owner["kind"], "controller": True,
            "name": owner["metadata"]["name"], "uid": owner["metadata"]["uid"],
            "blockOwnerDeletion": True}]
    pod = fake.store.create("pods", {
        "metadata": meta,
        "spec": {"nodeName": node, "containers": [{"name": "task", "image": "i"}]}},
        namespace="ml")
    return set_state(fake, name, state or {"running": {"startedAt": "2026-11-25T10:00:00Z"}},
                     phase, pod)


def set_state(fake: FakeKube, name: str, state: dict[str, Any], phase: str,
              pod: dict[str, Any] | None = None) -> dict[str, Any]:
    pod = pod or fake.store.get("pods", name, "ml")
    pod["status"] = {"phase": phase, "containerStatuses": [{"name": "task", "state": state}]}
    return fake.store.update_status("pods", pod, "ml")


def cri_log(path: Path, lines: list[str], start: datetime) -> None:
    with path.open("a") as f:
        for i, line in enumerate(lines):
            stamp = (start + timedelta(microseconds=i)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
            f.write(f"{stamp} stdout F {line}\n")


def test_a_pods_status_and_log_come_from_the_watch_and_the_follower(
        provider: KubernetesProvider, fake: FakeKube, tmp_path: Path) -> None:
    provider.up()
    ref = PodRef("r1", 1, "worker", 0)
    handle = ref.handle("demo-worker-0-0")
    runner = provider.runner(provider.hosts()[0])
    assert runner.poll(handle).state is TaskState.RUNNING  # no pod yet: still starting
    write_pod(fake, ref, "demo-worker-0-abcde")
    log = tmp_path / "task.log"
    start = datetime.now(timezone.utc)
    cri_log(log, ["one", "two"], start)
    fake.store.set_log_source("ml", "demo-worker-0-abcde", "task", log)
    calls = len(fake.requests)
    got = eventually(lambda: runner.poll_log(handle, 0).data == b"one\ntwo\n")
    assert got
    assert runner.poll_log(handle, 4).data == b"two\n"
    polls_cost = len(fake.requests) - calls
    assert polls_cost <= 3  # the log stream and a reconnect at most: polls are from memory
    # the streams drop and come back: nothing is lost or read twice
    fake.drop_watches(abrupt=True)
    follower = provider.follower(ref)
    assert follower is not None
    follower.drop_stream()
    eventually(lambda: follower.streams >= 2)
    cri_log(log, ["three"], start + timedelta(seconds=1))
    eventually(lambda: runner.poll_log(handle, 0).data == b"one\ntwo\nthree\n")
    # the container ends: the exit shows once its log is read to the end
    cri_log(log, ["last words"], start + timedelta(seconds=2))
    set_state(fake, "demo-worker-0-abcde", {"terminated": {
        "exitCode": 3, "reason": "Error", "finishedAt": "2026-11-25T10:01:00Z"}}, "Failed")
    polled = eventually(lambda: (p := runner.poll_log(handle, 0)).status is not None
                        and p.status.state is TaskState.EXITED and p)
    assert polled.status.exit_code == 3
    assert polled.data.endswith(b"last words\n")


def test_the_watch_survives_a_compacted_history_and_sees_deletions(
        provider: KubernetesProvider, fake: FakeKube) -> None:
    provider.up()
    watch = provider.watch()
    ref = PodRef("r1", 1, "worker", 1)
    write_pod(fake, ref, "demo-worker-1-xyz12")
    eventually(lambda: provider.pod(ref) is not None)
    fake.compact()
    fake.drop_watches()  # the watch comes back with a version the server no longer has: 410
    fake.store.delete("pods", "demo-worker-1-xyz12", "ml", grace_period_seconds=0)
    found = eventually(lambda: (p := provider.pod(ref)) is not None and p.deleted and p)
    assert found.name == "demo-worker-1-xyz12"
    runner = provider.runner(provider.hosts()[1])
    assert runner.poll(ref.handle("demo-worker-1-0")).state is TaskState.LOST
    assert watch.error is None or "410" not in watch.error


def test_stop_deletes_the_pod_with_the_grace(provider: KubernetesProvider,
                                             fake: FakeKube) -> None:
    provider.up()
    ref = PodRef("r1", 1, "worker", 0)
    write_pod(fake, ref, "demo-worker-0-stop1")
    eventually(lambda: provider.pod(ref) is not None)
    deleted: list[dict[str, Any]] = []

    def kubelet(pod: dict[str, Any]) -> None:  # the container saves and exits 75 on TERM
        deleted.append(pod)
        set_state(fake, pod["metadata"]["name"], {"terminated": {
            "exitCode": 75, "reason": "Error", "finishedAt": "2026-11-25T10:02:00Z"}}, "Failed")
        fake.store.finish_pod_deletion("ml", pod["metadata"]["name"])

    fake.store.register_pod_terminator(kubelet)
    status = provider.runner(provider.hosts()[0]).stop(ref.handle("demo-worker-0-0"), 60)
    assert deleted[0]["metadata"]["deletionGracePeriodSeconds"] == 60
    assert (status.state, status.exit_code) == (TaskState.EXITED, 75)


def test_down_deletes_what_the_tool_made_and_nothing_else(provider: KubernetesProvider,
                                                          fake: FakeKube) -> None:
    provider.up()
    provider.start_group(plan_of(provider))
    write_pod(fake, PodRef("r1", 1, "worker", 0), "demo-worker-0-down1")
    fake.store.create("configmaps", {"metadata": {"name": "theirs", "labels": {
        "orchestrate/cluster": "demo"}}, "data": {"a": "b"}}, namespace="ml")
    fake.store.create("secrets", {"metadata": {"name": "other-team"}}, namespace="ml")
    report = provider.down()
    assert "JobSet demo" in report.removed
    assert fake.store.list("jobsets", "ml") == []
    assert [m["metadata"]["name"] for m in fake.store.list("configmaps", "ml")] == ["theirs"]
    assert [s["metadata"]["name"] for s in fake.store.list("secrets", "ml")] == ["other-team"]
    assert fake.store.list("pods", "ml") == []
    assert not provider.state_path.exists()


def test_a_follower_skips_the_lines_it_had_when_it_follows_again(
        provider: KubernetesProvider, fake: FakeKube, tmp_path: Path) -> None:
    """Lines at the same instant, and a stream that drops between them."""
    provider.up()
    write_pod(fake, PodRef("r1", 1, "worker", 0), "demo-worker-0-same1")
    log = tmp_path / "same.log"
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    log.write_text(f"{stamp} stdout F a\n{stamp} stdout F b\n")
    fake.store.set_log_source("ml", "demo-worker-0-same1", "task", log)
    follower = LogFollower(provider.kube, "demo-worker-0-same1", "task", lambda: False).start()
    try:
        eventually(lambda: bytes(follower.data) == b"a\nb\n")
        follower.drop_stream()  # followed again from before the stamp: a and b come again
        eventually(lambda: follower.streams >= 2)
        with log.open("a") as f:
            f.write(f"{stamp} stdout F c\n")
        eventually(lambda: bytes(follower.data) == b"a\nb\nc\n")
        time.sleep(0.2)  # and nothing more comes
        assert bytes(follower.data) == b"a\nb\nc\n"
    finally:
        follower.stop()


def ready_node(fake: FakeKube, name: str, since: str) -> None:
    """Node ``name`` Ready since ``since`` (made if missing), with no taints."""
    condition = {"type": "Ready", "status": "True", "reason": "KubeletReady",
                 "message": "kubelet is posting ready status", "lastTransitionTime": since}
    try:
        node = fake.store.get("nodes", name)
    except StoreError:
        node = fake.store.create("nodes", {"metadata": {
            "name": name, "labels": {manifests.HOSTNAME_LABEL: name}}, "spec": {}})
    node["status"] = {"conditions": [condition]}
    fake.store.update_status("nodes", node)


def test_a_lost_node_is_named_avoided_and_its_stuck_pods_do_not_hold_the_next_attempt(
        provider: KubernetesProvider, fake: FakeKube) -> None:
    """A node that died a moment ago still counts Ready, but the API server cannot reach its
    kubelet: a survivor's pod is asked before it is deleted at once, the lost host is named
    with the server's own words, the next JobSet keeps off the node until it is Ready again,
    and a pod of the old JobSet stuck terminating there is deleted with no grace."""
    provider.up()
    for node in ("node-1", "node-2"):
        ready_node(fake, node, "2026-11-25T09:00:00Z")
    fake.kubelet_dial_s = 0.2
    said: list[str] = []
    provider.progress = said.append
    provider.start_group(plan_of(provider))
    jobset = fake.store.get("jobsets", "demo", "ml")
    refs = [PodRef("r1", 1, "worker", i) for i in range(2)]
    write_pod(fake, refs[0], "demo-worker-0-aaaaa", node="node-1", owner=jobset)
    write_pod(fake, refs[1], "demo-worker-1-bbbbb", node="node-2", owner=jobset)
    eventually(lambda: all(provider.pod(r) is not None for r in refs))
    fake.kubelet_down("node-2", "10.128.0.2")
    hosts = provider.hosts()
    # worker:1 stopped at once (a crash's survivors): its kubelet is asked first
    provider.runner(hosts[1]).stop(refs[1].handle(hosts[1].name), 0)
    eventually(lambda: (p := provider.pod(refs[1])) is not None and p.deleted)
    lost = provider.lost_hosts(hosts)
    assert list(lost) == [hosts[1].name], lost
    assert lost[hosts[1].name] == ('the kubelet of node node-2 does not answer (Get '
                                   '"https://10.128.0.2:10250/containerLogs/ml/demo-worker-1-bbbbb/'
                                   'task": dial tcp 10.128.0.2:10250: i/o timeout)')
    # the cluster marks the node now; a pod of the old JobSet deleted with its grace stays
    # terminating there (no kubelet confirms it) and would hold the JobSet's deletion
    marked = fake.store.get("nodes", "node-2")
    marked["status"]["conditions"][0].update(status="Unknown", reason="NodeStatusUnknown",
                                             lastTransitionTime="2026-11-25T10:00:40Z")
    fake.store.update_status("nodes", marked)

    def kubelet(pod: dict[str, Any]) -> None:  # node-1's confirms a deletion, node-2's is gone
        if pod["spec"]["nodeName"] == "node-1":
            fake.store.finish_pod_deletion("ml", pod["metadata"]["name"])

    fake.store.register_pod_terminator(kubelet)
    write_pod(fake, PodRef("r1", 1, "worker", 1), "demo-worker-1-ccccc", node="node-2",
              owner=jobset)
    fake.store.delete("pods", "demo-worker-1-ccccc", "ml")
    assert fake.store.get("pods", "demo-worker-1-ccccc", "ml")["metadata"]["deletionTimestamp"]
    provider.start_group(plan_of(provider, attempt=2))
    assert any("pod demo-worker-1-ccccc is stuck terminating on lost node node-2" in line
               for line in said), said
    template = fake.store.get("jobsets", "demo", "ml")["spec"]["replicatedJobs"][0][
        "template"]["spec"]["template"]["spec"]
    assert template["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"] == [
        {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "NotIn",
                               "values": ["node-2"]}]}]
    # a command's pod (the checkpoint's check before the attempt) keeps off it too: bound
    # there it would never start, and the node's eviction would delete it under the command
    assert command_pod_of(provider, fake)["affinity"] == template["affinity"]
    # the node comes back (Ready since after it was lost): the next JobSet may go there again
    fake.kubelet_up("node-2")
    ready_node(fake, "node-2", "2026-11-25T10:05:00Z")
    provider.start_group(plan_of(provider, attempt=3))
    template = fake.store.get("jobsets", "demo", "ml")["spec"]["replicatedJobs"][0][
        "template"]["spec"]["template"]["spec"]
    assert "affinity" not in template
    assert "affinity" not in command_pod_of(provider, fake)


def command_pod_of(provider: KubernetesProvider, fake: FakeKube) -> dict[str, Any]:
    """The spec of the pod ``run_pod`` makes for a command, which then ends (exit 0)."""
    made: dict[str, Any] = {}
    ran = threading.Thread(target=lambda: made.update(result=provider.run_pod("true")))
    ran.start()
    try:
        pod = eventually(lambda: next((p for p in fake.store.list("pods", "ml")
                                       if "-cmd-" in p["metadata"]["name"]), None))
        set_state(fake, pod["metadata"]["name"], {"terminated": {"exitCode": 0}}, "Succeeded",
                  pod)
    finally:
        ran.join(30)
    assert made["result"].exit_code == 0
    spec: dict[str, Any] = pod["spec"]
    return spec


def test_up_says_when_the_nodes_cannot_hold_the_pods_and_goes_on(tmp_path: Path,
                                                                   fake: FakeKube) -> None:
    """The nodes there are now, against the pod's selector, tolerations and requests: said
    with each node's reason, never blocking (a node pool may autoscale from zero)."""
    made = make_provider(tmp_path, fake, workers=3, extra="  gpus_per_pod: 2\n"
                         "  node_selector: {pool: gpu}\n  resources: {memory: 20Gi}\n")
    try:
        fake.store.delete("nodes", "node-1")
        for name, labels, gpus in (("cpu-1", {"pool": "cpu"}, "0"), ("gpu-1", {"pool": "gpu"}, "4"),
                                   ("gpu-2", {"pool": "gpu"}, "1")):
            ready_node(fake, name, "2026-11-25T09:00:00Z")
            made_node = fake.store.get("nodes", name)
            made_node["metadata"]["labels"].update(labels)
            made_node = fake.store.update("nodes", made_node)
            made_node["status"]["allocatable"] = {"cpu": "16", "memory": "64Gi", "pods": "110",
                                                  "nvidia.com/gpu": gpus}
            fake.store.update_status("nodes", made_node)
        (problem,) = [p for p in made.cluster_problems() if "node" in p.message]
        assert not problem.blocking
        assert problem.message == (
            "the nodes now hold 2 of the 3 pods at most (each asks 20Gi memory, 2 "
            "nvidia.com/gpu): cpu-1 lacks the label pool=gpu (provider.node_selector); "
            "gpu-2 has 1 nvidia.com/gpu, a pod asks 2"), problem.message
        assert "gcloud container node-pools create" in problem.fix
        made.up()  # said, not refused
        with_elastic(made, "{min_workers: 2, max_workers: 4}")
        (problem,) = [p for p in made.cluster_problems() if "node" in p.message]
        assert problem.message.startswith(
            "the nodes now hold 2 of the 3 pods at most (each asks 20Gi memory, 2 "
            "nvidia.com/gpu); elastic: the group goes on with 2 once the pods left waiting "
            "pass timeouts.repair_s: cpu-1 lacks"), problem.message
        # a fourth GPU node: the pods fit, nothing is said
        ready_node(fake, "gpu-3", "2026-11-25T09:00:00Z")
        node = fake.store.get("nodes", "gpu-3")
        node["metadata"]["labels"]["pool"] = "gpu"
        node = fake.store.update("nodes", node)
        node["status"]["allocatable"] = {"memory": "64Gi", "nvidia.com/gpu": "8"}
        fake.store.update_status("nodes", node)
        # gpu-3 holds 3 (its memory): room for the 3 workers and 2 spares, not for
        # elastic.max_workers' 6: said, not blocking
        with_elastic(made, "{min_workers: 2, max_workers: 6}")
        (problem,) = [p for p in made.cluster_problems() if "node" in p.message]
        assert not problem.blocking and problem.message.startswith(
            "the nodes now hold 5 pods at most (each asks 20Gi memory, 2 nvidia.com/gpu): the "
            "group starts with 3 and grows to 5 of elastic.max_workers (6) until more nodes "
            "are added: cpu-1 lacks"), problem.message
        with_elastic(made, None)
        assert not [p for p in made.cluster_problems() if "node" in p.message]
        # credentials that may not list nodes: said, with the fix
        fake.forbid("list", "nodes")
        (problem,) = [p for p in made.cluster_problems() if "node" in p.message]
        assert not problem.blocking and "may not list nodes" in problem.message
        assert "ClusterRole" in problem.fix
    finally:
        made.close()


def with_elastic(made: KubernetesProvider, elastic: str | None) -> None:
    """The provider's spec with ``elastic`` (YAML flow text), or without it."""
    made.spec = specs.ClusterSpec.model_validate({
        **made.spec.model_dump(), "elastic": None if elastic is None else
        specs.parse(f"name: x\njob: {{module: m}}\nworkers: 3\nelastic: {elastic}\n").elastic})


def test_up_checks_the_kueue_queue_it_is_given(tmp_path: Path, fake: FakeKube) -> None:
    made = make_provider(tmp_path, fake, extra="  queue: team-a\n")
    try:
        def queue_problems() -> list[Any]:
            return [p for p in made.cluster_problems() if "queue" in p.message.lower()
                    or "Kueue" in p.message]

        (missing,) = queue_problems()  # no Kueue at all
        assert missing.blocking and "Kueue is not installed" in missing.message
        assert "remove provider.queue" in missing.fix
        with pytest.raises(ProviderError, match="Kueue is not installed"):
            made.up()
        for crd in kueue_crd_objects():
            fake.store.create("customresourcedefinitions", crd)
        (no_queue,) = queue_problems()
        assert no_queue.blocking and no_queue.message == (
            "provider.queue: no LocalQueue team-a in namespace ml")
        assert "kubectl -n ml get localqueues" in no_queue.fix
        fake.store.create("localqueues", {"metadata": {"name": "team-a"},
                                          "spec": {"clusterQueue": "cq"}}, namespace="ml")
        assert queue_problems() == []
        fake.forbid("get", "localqueues")
        (unreadable,) = queue_problems()
        assert not unreadable.blocking and "may not read LocalQueue team-a" in unreadable.message
    finally:
        made.close()


def test_up_checks_the_service_account_the_pods_run_as(tmp_path: Path, fake: FakeKube) -> None:
    made = make_provider(tmp_path, fake, extra="  service_account: trainer\n")
    try:
        def account_problems() -> list[Any]:
            return [p for p in made.cluster_problems() if "ServiceAccount" in p.message]

        (missing,) = account_problems()
        assert missing.blocking and missing.message == (
            "provider.service_account: no ServiceAccount trainer in namespace ml")
        assert "kubectl -n ml create serviceaccount trainer" in missing.fix
        with pytest.raises(ProviderError, match="no ServiceAccount trainer"):
            made.up()
        fake.store.create("serviceaccounts", {"metadata": {"name": "trainer"}}, namespace="ml")
        assert account_problems() == []
        fake.forbid("get", "serviceaccounts")
        (unreadable,) = account_problems()
        assert not unreadable.blocking and "may not read ServiceAccount trainer" in \
            unreadable.message
    finally:
        made.close()


def test_a_node_whose_kubelet_was_silent_for_a_moment_is_avoided_only_for_a_while(
        provider: KubernetesProvider, fake: FakeKube, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kubelet that did not answer once, on a node the cluster never marks (it stays Ready,
    unchanged, well past the node monitor's grace): the node was not lost, and the JobSets
    after that grace may go there again."""
    monkeypatch.setattr(provider_module, "NODE_MONITOR_GRACE_MAX_S", 0.5)
    provider.up()
    ready_node(fake, "node-2", "2026-11-25T09:00:00Z")
    fake.kubelet_dial_s = 0.1
    provider.start_group(plan_of(provider))
    ref = PodRef("r1", 1, "worker", 1)
    write_pod(fake, ref, "demo-worker-1-ddddd", node="node-2")
    eventually(lambda: provider.pod(ref) is not None)
    fake.kubelet_down("node-2", "10.128.0.2")
    hosts = provider.hosts()
    assert list(provider.lost_hosts(hosts)) == [hosts[1].name]
    fake.kubelet_up("node-2")  # back at once: the node monitor never noticed

    def avoided() -> list[str]:
        template = fake.store.get("jobsets", "demo", "ml")["spec"]["replicatedJobs"][0][
            "template"]["spec"]["template"]["spec"]
        terms = template.get("affinity", {}).get("nodeAffinity", {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution", {}).get("nodeSelectorTerms", [])
        return [v for t in terms for e in t["matchExpressions"] for v in e["values"]]

    provider.start_group(plan_of(provider, attempt=2))
    assert avoided() == ["node-2"]  # within the grace: it may yet be marked
    time.sleep(0.6)
    provider.start_group(plan_of(provider, attempt=3))
    assert avoided() == []


def test_an_elastic_slot_whose_pod_was_never_placed_is_refused_and_a_later_controller_sees_it(
        tmp_path: Path, fake: FakeKube) -> None:
    """repair, for an elastic group: a slot whose pod of the newest attempt the scheduler never
    placed is refused with its reason (even once the pod is deleted, as the stop deletes it);
    one whose pod ran is back at once (the next JobSet places it again); a controller that did
    not start the attempt (train --attach) finds the group from the watch."""
    made = make_provider(tmp_path, fake, workers=3, extra="elastic: {min_workers: 2}\n")
    later = make_provider(tmp_path, fake, workers=3, extra="elastic: {min_workers: 2}\n")
    try:
        made.up()
        hosts = made.hosts()
        for provider in (made, later):
            provider.watch()  # the controllers' watches, from the attempt's start
        for index in (0, 1):
            write_pod(fake, PodRef("r1", 2, "worker", index), f"demo-worker-{index}-abcde")
        unplaced = write_pod(fake, PodRef("r1", 2, "worker", 2), "demo-worker-2-abcde",
                             node="")  # never bound
        message = "0/3 nodes are available: 3 Insufficient cpu."
        unplaced["status"] = {"phase": "Pending", "conditions": [{
            "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
            "message": message}]}
        fake.store.update_status("pods", unplaced, "ml")
        fake.store.delete("pods", "demo-worker-2-abcde", "ml")  # the stop deleted it
        for provider in (made, later):  # (later: a controller that did not start it)
            eventually(lambda p=provider: "Unschedulable" in str(
                p.watch().pods.get("demo-worker-2-abcde", PodState({})).pod.get("status")))
            with pytest.raises(ProviderError) as caught:
                provider.repair(hosts[2], 5)
            assert caught.value.message.startswith(
                f"no node can take a worker's pod: {message} (fix: ask for less"), \
                caught.value.message
            assert provider.repair(hosts[1], 5) is hosts[1]  # it ran: placed again
        assert later._current_group() == {hosts[0].name, hosts[1].name, hosts[2].name}
        # seen unplaced by the watch, then bound as the stop freed its peers' room, its
        # container never started: still refused
        bound = write_pod(fake, PodRef("r1", 3, "worker", 1), "demo-worker-1-fghij", node="")
        bound["status"] = unplaced["status"]
        fake.store.update_status("pods", bound, "ml")
        ref = PodRef("r1", 3, "worker", 1)
        eventually(lambda: made.unplaced(ref))
        made._started = ("r1", 3)
        fake.store.bind("ml", "demo-worker-1-fghij", "node-1")
        pod = fake.store.get("pods", "demo-worker-1-fghij", "ml")
        pod["status"] = {"phase": "Pending", "conditions": [
            {"type": "PodScheduled", "status": "True"}]}
        fake.store.update_status("pods", pod, "ml")
        eventually(lambda: made.watch().pods["demo-worker-1-fghij"].pod["spec"].get("nodeName"))
        with pytest.raises(ProviderError, match="no node can take a worker's pod: 0/3 nodes"):
            made.repair(hosts[1], 5)
        assert fake.store.list("pods", "ml", label_selector=f"{manifests.ROLE_LABEL}="
                               f"{manifests.RESERVE_ROLE}") == []  # none asked for yet
    finally:
        made.close()
        later.close()
