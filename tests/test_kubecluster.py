"""The fake cluster (tests/kubecluster.py): JobSets through the official client, run as real
processes by its controllers and kubelet on the pod lab."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeAlias

import pytest
from kubecluster import FakeCluster, wait_for
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from podlab import PodLab

pytestmark = pytest.mark.pods

Json = dict[str, Any]
# The generated client returns Optional fields throughout; these tests read fields the fake
# always sets, so they hold the API objects as Any.
Core: TypeAlias = Any
Custom: TypeAlias = Any
Batch: TypeAlias = Any
NS = "default"
IMAGE = "python:3.11"
GROUP, VERSION = "jobset.x-k8s.io", "v1alpha2"

# Answers every peer's connection with its host name; asks each peer the same through its
# DNS name <jobset>-<rjob>-<i>-0.<subdomain>, then prints its index from the Downward API.
PEERS = """
import os, socket, sys, threading, time
me, n, base = int(os.environ["INDEX"]), int(os.environ["N"]), os.environ["BASE"]
server = socket.create_server(("0.0.0.0", 5000))
def answer():
    for _ in range(n - 1):
        conn, _ = server.accept()
        conn.sendall(socket.gethostname().encode())
        conn.close()
thread = threading.Thread(target=answer)
thread.start()
for i in [i for i in range(n) if i != me]:
    peer = f"{base}-{i}-0.{os.environ['SUBDOMAIN']}"
    for _ in range(600):
        try:
            with socket.create_connection((peer, 5000), timeout=1) as conn:
                print("peer", peer, "says", conn.recv(100).decode(), flush=True)
                break
        except OSError:
            time.sleep(0.05)
    else:
        sys.exit(f"no answer from {peer}")
thread.join()
print("index", me, "completion", os.environ["JOB_COMPLETION_INDEX"], "uid", os.getuid(), flush=True)
"""

# Index FAIL_INDEX exits 3 once every pod runs; the others wait, and on SIGTERM say so, take a
# moment (the test reads the line through the API meanwhile) and exit 143.
FAIL_ONE = """
import os, signal, sys, time
def stop(signum, frame):  # os.write: a print here may land inside the main thread's print
    os.write(1, b"got SIGTERM\\n")
    time.sleep(float(os.environ.get("LINGER", "0")))
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
print("running", os.environ["INDEX"], flush=True)
if os.environ["INDEX"] == os.environ.get("FAIL_INDEX"):
    time.sleep(float(os.environ.get("FAIL_AFTER", "0")))
    sys.exit(3)
while True:
    time.sleep(0.1)
"""


@pytest.fixture
def api(kube_cluster: FakeCluster) -> Iterator[client.ApiClient]:
    with client.ApiClient(kube_cluster.kube.configuration()) as api_client:
        yield api_client


@pytest.fixture
def core(api: client.ApiClient) -> Core:
    return client.CoreV1Api(api)


@pytest.fixture
def custom(api: client.ApiClient) -> Custom:
    return client.CustomObjectsApi(api)


@pytest.fixture
def batch(api: client.ApiClient) -> Batch:
    return client.BatchV1Api(api)


def python_container(script: str, env: dict[str, str] | None = None, **fields: Any) -> Json:
    variables = [{"name": k, "value": v} for k, v in (env or {}).items()]
    return {"name": "worker", "image": IMAGE, "command": [sys.executable, "-c", script],
            "env": variables, **fields}


def jobset(name: str, script: str, replicas: int = 3, max_restarts: int | None = 0,
           env: dict[str, str] | None = None, grace_s: int = 10, **pod_fields: Any) -> Json:
    """A JobSet with one replicated job ``w``: ``replicas`` Jobs of one pod each, backoffLimit 0,
    restartPolicy Never; the container gets INDEX from the Downward API."""
    container = python_container(script, env)
    container["env"].append({"name": "INDEX", "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.annotations['jobset.sigs.k8s.io/job-index']"}}})
    pod_spec = {"restartPolicy": "Never", "terminationGracePeriodSeconds": grace_s,
                "containers": [container], **pod_fields}
    spec: Json = {"replicatedJobs": [{"name": "w", "replicas": replicas, "template": {"spec": {
        "parallelism": 1, "completions": 1, "backoffLimit": 0,
        "template": {"spec": pod_spec}}}}]}
    if max_restarts is not None:
        spec["failurePolicy"] = {"maxRestarts": max_restarts}
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "JobSet",
            "metadata": {"name": name, "namespace": NS}, "spec": spec}


def create_jobset(custom: Custom, manifest: Json) -> Json:
    created: Json = custom.create_namespaced_custom_object(GROUP, VERSION, NS, "jobsets", manifest)
    return created


def get_jobset(custom: Custom, name: str) -> Json:
    found: Json = custom.get_namespaced_custom_object(GROUP, VERSION, NS, "jobsets", name)
    return found


def condition(obj: Any, kind: str) -> Any:
    conditions = (obj.get("status") or {}).get("conditions") if isinstance(obj, dict) \
        else obj.status.conditions
    for found in conditions or []:
        found_type = found["type"] if isinstance(found, dict) else found.type
        if found_type == kind:
            return found
    return None


def jobset_condition(custom: Custom, name: str, kind: str) -> Json | None:
    found = condition(get_jobset(custom, name), kind)
    return found if found and found["status"] == "True" else None


def pods_of(core: Core, name: str) -> list[Any]:
    selected: list[Any] = core.list_namespaced_pod(
        NS, label_selector=f"jobset.sigs.k8s.io/jobset-name={name}").items
    return selected


def log(core: Core, pod: str) -> str:
    try:
        text: str = core.read_namespaced_pod_log(pod, NS)
    except ApiException:
        return ""
    return text


def events(core: Core, name: str, reason: str) -> list[Any]:
    found: list[Any] = core.list_namespaced_event(
        NS, field_selector=f"involvedObject.name={name},reason={reason}").items
    return found


def waiting_reason(core: Core, name: str) -> str | None:
    pod = core.read_namespaced_pod(name, NS)
    for status in pod.status.container_statuses or []:
        if status.state.waiting is not None:
            reason: str = status.state.waiting.reason
            return reason
    return None


def plain_pod(name: str, script: str, **spec: Any) -> Json:
    return {"metadata": {"name": name}, "spec": {
        "restartPolicy": "Never", "terminationGracePeriodSeconds": 10,
        "containers": [python_container(script)], **spec}}


def record_changes(cluster: FakeCluster) -> list[tuple[str, str, Json]]:
    """Every change the store makes from now on, in order (type, resource, object)."""
    changes: list[tuple[str, str, Json]] = []
    lock = threading.Lock()

    def keep(type_: str, resource: str, obj: Json) -> None:
        with lock:
            changes.append((type_, resource, obj))

    cluster.store.subscribe(keep)
    return changes


def test_jobset_of_three_peers_resolves_connects_logs_and_completes(
        kube_cluster: FakeCluster, core: Core, custom: Custom, batch: Batch, pods: PodLab) -> None:
    user = pods.plain_user()
    manifest = jobset("peers", PEERS, env={"N": "3", "BASE": "peers-w", "SUBDOMAIN": "peers"},
                      securityContext={"runAsUser": user.uid})
    create_jobset(custom, manifest)

    done = wait_for(lambda: jobset_condition(custom, "peers", "Completed"), 60,
                    "the JobSet to complete", kube_cluster)

    assert done["reason"] == "AllJobsCompleted"
    assert done["message"] == "jobset completed successfully"
    final = get_jobset(custom, "peers")
    assert final["status"]["terminalState"] == "Completed"
    assert final["status"]["replicatedJobsStatus"][0]["succeeded"] == 3
    jobs = batch.list_namespaced_job(NS).items
    assert sorted(j.metadata.name for j in jobs) == ["peers-w-0", "peers-w-1", "peers-w-2"]
    assert all(condition(j, "Complete").status == "True" for j in jobs)
    service = core.read_namespaced_service("peers", NS)
    assert service.spec.cluster_ip == "None"
    assert service.spec.publish_not_ready_addresses is True
    assert service.spec.selector == {"jobset.sigs.k8s.io/jobset-name": "peers"}
    workers = sorted(pods_of(core, "peers"), key=lambda p: p.spec.hostname)
    assert [p.spec.hostname for p in workers] == ["peers-w-0-0", "peers-w-1-0", "peers-w-2-0"]
    assert len({p.spec.node_name for p in workers}) == 3
    for index, pod in enumerate(workers):
        assert pod.status.phase == "Succeeded"
        assert pod.metadata.labels["jobset.sigs.k8s.io/restart-attempt"] == "0"
        text = log(core, pod.metadata.name)
        assert f"index {index} completion 0 uid {user.uid}" in text
        others = [f"peers-w-{i}-0" for i in range(3) if i != index]
        assert all(f"says {other}" in text for other in others), text


def test_a_failed_pod_fails_the_jobset_and_the_others_get_sigterm(
        kube_cluster: FakeCluster, core: Core, custom: Custom, batch: Batch) -> None:
    create_jobset(custom, jobset("fail", FAIL_ONE, env={"FAIL_INDEX": "1", "FAIL_AFTER": "1",
                                                        "LINGER": "3"}))
    wait_for(lambda: all(log(core, p.metadata.name) for p in pods_of(core, "fail"))
             and len(pods_of(core, "fail")) == 3, 60, "three running pods", kube_cluster)
    survivors = [p.metadata.name for p in pods_of(core, "fail")
                 if p.metadata.annotations["jobset.sigs.k8s.io/job-index"] != "1"]

    failed = wait_for(lambda: jobset_condition(custom, "fail", "Failed"), 60,
                      "the JobSet to fail", kube_cluster)

    assert failed["reason"] == "ReachedMaxRestarts"
    assert failed["message"] == ("jobset failed due to reaching max number of restarts "
                                 "(first failed job: fail-w-1)")
    assert get_jobset(custom, "fail")["status"]["terminalState"] == "Failed"
    job = batch.read_namespaced_job("fail-w-1", NS)
    assert condition(job, "Failed").reason == "BackoffLimitExceeded"
    assert condition(job, "Failed").message == "Job has reached the specified backoff limit"
    wait_for(lambda: all("got SIGTERM" in log(core, name) for name in survivors), 30,
             f"{survivors} to log their SIGTERM", kube_cluster)
    wait_for(lambda: not any(p.metadata.name in survivors for p in pods_of(core, "fail")), 30,
             "the other pods to go", kube_cluster)


def test_max_restarts_one_restarts_the_set_once_then_fails_it(
        kube_cluster: FakeCluster, core: Core, custom: Custom, batch: Batch) -> None:
    changes = record_changes(kube_cluster)
    create_jobset(custom, jobset("again", FAIL_ONE, replicas=2, max_restarts=1, grace_s=2,
                                 env={"FAIL_INDEX": "0", "FAIL_AFTER": "1"}))

    failed = wait_for(lambda: jobset_condition(custom, "again", "Failed"), 60,
                      "the JobSet to fail", kube_cluster)

    assert failed["reason"] == "ReachedMaxRestarts"
    status = get_jobset(custom, "again")["status"]
    assert status["restarts"] == 1
    restarting = condition(get_jobset(custom, "again"), "RestartingJobSet")
    assert restarting["status"] == "False" and restarting["reason"] == "JobSetFailed"
    attempts = {(obj["metadata"]["name"], obj["metadata"]["labels"]["jobset.sigs.k8s.io/restart-attempt"])
                for type_, resource, obj in list(changes) if resource == "jobs" and type_ == "ADDED"}
    assert {("again-w-0", "0"), ("again-w-1", "0"), ("again-w-0", "1")} <= attempts
    jobs = batch.list_namespaced_job(NS).items
    assert {j.metadata.labels["jobset.sigs.k8s.io/restart-attempt"] for j in jobs} == {"1"}
    restart_events = events(core, "again", "RestartJobSetFailurePolicyAction")
    assert restart_events[0].message == ("applying RestartJobSet failure policy action "
                                         "(first failed job: again-w-0)")


def test_a_gpu_pod_waits_unschedulable_until_a_node_has_gpus(
        kube_cluster_factory: Callable[..., FakeCluster]) -> None:
    cluster = kube_cluster_factory(spot={"node-3"})
    with client.ApiClient(cluster.kube.configuration()) as api:
        check_gpu_and_spot_scheduling(cluster, client.CoreV1Api(api))


def check_gpu_and_spot_scheduling(cluster: FakeCluster, core: Core) -> None:
    gpu = plain_pod("gpu", "print('cuda', flush=True)")
    gpu["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "1"}}
    spot = plain_pod("spot", "pass", nodeSelector={"cloud.google.com/gke-spot": "true"})
    core.create_namespaced_pod(NS, gpu)
    core.create_namespaced_pod(NS, spot)

    unschedulable = wait_for(lambda: condition(core.read_namespaced_pod("gpu", NS), "PodScheduled"),
                             30, "the scheduler's verdict", cluster)

    expected = ("0/3 nodes are available: 1 node(s) had untolerated taint "
                "{cloud.google.com/gke-spot: true}, 2 Insufficient nvidia.com/gpu. preemption: 0/3 "
                "nodes are available: 1 Preemption is not helpful for scheduling, 2 No preemption "
                "victims found for incoming pod.")
    assert (unschedulable.status, unschedulable.reason) == ("False", "Unschedulable")
    assert unschedulable.message == expected
    assert core.read_namespaced_pod("gpu", NS).status.phase == "Pending"
    warning = wait_for(lambda: events(core, "gpu", "FailedScheduling"), 10, "FailedScheduling")
    assert (warning[0].type, warning[0].message) == ("Warning", expected)
    spot_verdict = wait_for(lambda: condition(core.read_namespaced_pod("spot", NS), "PodScheduled"),
                            30, "the spot pod's verdict", cluster)
    assert spot_verdict.message == (
        "0/3 nodes are available: 1 node(s) had untolerated taint {cloud.google.com/gke-spot: "
        "true}, 2 node(s) didn't match Pod's node affinity/selector. preemption: 0/3 nodes are "
        "available: 3 Preemption is not helpful for scheduling.")

    cluster.set_gpus("node-2", 1)

    done = wait_for(lambda: core.read_namespaced_pod("gpu", NS).status.phase == "Succeeded", 30,
                    "the GPU pod to run", cluster)
    assert done
    placed = core.read_namespaced_pod("gpu", NS)
    assert placed.spec.node_name == "node-2"
    assert condition(placed, "PodScheduled").status == "True"
    assert events(core, "gpu", "Scheduled")[0].message == "Successfully assigned default/gpu to node-2"


def test_unknown_image_and_missing_secret_keep_the_pod_waiting(
        kube_cluster: FakeCluster, core: Core) -> None:
    bad_image = plain_pod("bad-image", "pass")
    bad_image["spec"]["containers"][0]["image"] = "ghcr.io/nobody/nothing:1"
    no_secret = plain_pod("no-secret", "pass")
    no_secret["spec"]["containers"][0]["env"] = [{"name": "TOKEN", "valueFrom": {
        "secretKeyRef": {"name": "creds", "key": "token"}}}]
    core.create_namespaced_pod(NS, bad_image)
    core.create_namespaced_pod(NS, no_secret)

    wait_for(lambda: waiting_reason(core, "bad-image") == "ImagePullBackOff", 30,
             "ImagePullBackOff", kube_cluster)
    wait_for(lambda: waiting_reason(core, "no-secret") == "CreateContainerConfigError", 30,
             "CreateContainerConfigError", kube_cluster)

    pulled = events(core, "bad-image", "Failed")
    assert any(e.message.startswith('Failed to pull image "ghcr.io/nobody/nothing:1": failed to '
                                    "pull and unpack image") for e in pulled)
    assert any(e.message == "Error: ErrImagePull" for e in pulled)
    assert events(core, "bad-image", "BackOff")[0].message == \
        'Back-off pulling image "ghcr.io/nobody/nothing:1"'
    assert core.read_namespaced_pod("bad-image", NS).status.phase == "Pending"
    waiting = core.read_namespaced_pod("no-secret", NS).status.container_statuses[0].state.waiting
    assert waiting.message == 'secret "creds" not found'


WRITER = """
import os, stat
print("token", os.environ["TOKEN"], flush=True)
print("config", open("/etc/app/settings/app.conf").read(), flush=True)
print("mode", oct(os.stat("/etc/app/settings/app.conf").st_mode & 0o777), flush=True)
st = os.stat("/data")
print("data group", st.st_gid, "setgid", bool(st.st_mode & stat.S_ISGID), flush=True)
with open("/data/out.txt", "w") as f:
    f.write("from the writer")
print("wrote as", os.getuid(), os.getgid(), flush=True)
"""


def test_configmap_items_secret_env_and_a_shared_claim_with_subpath_and_fsgroup(
        kube_cluster: FakeCluster, core: Core, pods: PodLab) -> None:
    user, fs_group = pods.plain_user(), 4321
    core.create_namespaced_config_map(NS, {"metadata": {"name": "app"},
                                           "data": {"app.conf": "lr=0.1", "unused": "x"}})
    core.create_namespaced_secret(NS, {"metadata": {"name": "creds"},
                                       "stringData": {"token": "s3cret"}})
    core.create_namespaced_persistent_volume_claim(NS, {"metadata": {"name": "shared"}, "spec": {
        "accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}}})
    writer = plain_pod("writer", WRITER, securityContext={
        "runAsUser": user.uid, "runAsGroup": fs_group, "fsGroup": fs_group}, volumes=[
        {"name": "settings", "configMap": {"name": "app", "items": [
            {"key": "app.conf", "path": "app.conf", "mode": 0o640}]}},
        {"name": "data", "persistentVolumeClaim": {"claimName": "shared"}}])
    writer["spec"]["containers"][0].update(
        env=[{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}}],
        volumeMounts=[{"name": "settings", "mountPath": "/etc/app/settings", "readOnly": True},
                      {"name": "data", "mountPath": "/data", "subPath": "run-1"}])
    core.create_namespaced_pod(NS, writer)
    wait_for(lambda: core.read_namespaced_pod("writer", NS).status.phase in ("Succeeded", "Failed"),
             30, "the writer to end", kube_cluster)
    reader = plain_pod("reader", "print(open('/in/run-1/out.txt').read(), flush=True)", volumes=[
        {"name": "data", "persistentVolumeClaim": {"claimName": "shared", "readOnly": True}}])
    reader["spec"]["containers"][0]["volumeMounts"] = [{"name": "data", "mountPath": "/in"}]
    core.create_namespaced_pod(NS, reader)

    wait_for(lambda: core.read_namespaced_pod("reader", NS).status.phase in ("Succeeded", "Failed"),
             30, "the reader to end", kube_cluster)

    written = log(core, "writer")
    assert core.read_namespaced_pod("writer", NS).status.phase == "Succeeded", written
    assert "token s3cret" in written
    assert "config lr=0.1" in written
    assert "mode 0o640" in written
    assert f"data group {fs_group} setgid True" in written
    assert f"wrote as {user.uid} {fs_group}" in written
    assert core.read_namespaced_pod("reader", NS).status.phase == "Succeeded"
    assert "from the writer" in log(core, "reader")
    claim = core.read_namespaced_persistent_volume_claim("shared", NS)
    assert claim.status.phase == "Bound"


# Keeps a ring of 40 files in /data/churn, each removed soon after it is written, as a pod
# saving checkpoints (temp files renamed or deleted) does on a shared claim.
CHURN = """
import os, time
os.makedirs("/data/churn", exist_ok=True)
print("churning", flush=True)
i = 0
while True:
    open(f"/data/churn/tmp-{i}", "w").close()
    if i >= 40:
        os.remove(f"/data/churn/tmp-{i - 40}")
    i += 1
"""


def test_a_claim_whose_files_vanish_while_a_pod_mounts_it_with_fsgroup_still_mounts(
        kube_cluster: FakeCluster, core: Core) -> None:
    """kubelet's fsGroup walk fails the mount on a file removed under it (FailedMount) and tries
    again; no pod is lost and no controller raises."""
    core.create_namespaced_persistent_volume_claim(NS, {"metadata": {"name": "shared"}, "spec": {
        "accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}}})
    claim = [{"name": "data", "persistentVolumeClaim": {"claimName": "shared"}}]
    mount = [{"name": "data", "mountPath": "/data"}]
    churner = plain_pod("churner", CHURN, volumes=claim)
    churner["spec"]["containers"][0]["volumeMounts"] = mount
    core.create_namespaced_pod(NS, churner)
    wait_for(lambda: "churning" in log(core, "churner"), 30, "the churner to start", kube_cluster)
    names = [f"mounter-{i}" for i in range(6)]
    for name in names:
        mounter = plain_pod(name, "import os; print(len(os.listdir('/data/churn')), flush=True)",
                            securityContext={"fsGroup": 4321}, volumes=claim)
        mounter["spec"]["containers"][0]["volumeMounts"] = mount
        core.create_namespaced_pod(NS, mounter)

    wait_for(lambda: all(core.read_namespaced_pod(n, NS).status.phase == "Succeeded"
                         for n in names), 60, "every mounter to succeed", kube_cluster)

    assert kube_cluster.errors() == []
    for name in names:
        for event in events(core, name, "FailedMount"):
            assert event.message.startswith('MountVolume.SetUp failed for volume "data" : lstat '), \
                event.message
            assert event.message.endswith(": no such file or directory"), event.message
        assert log(core, name).strip().isdigit()
    core.delete_namespaced_pod("churner", NS, grace_period_seconds=0)


PREEMPTED = """
import os, signal, sys, time
def stop(signum, frame):  # os.write: a print here may land inside the main thread's print
    os.write(1, b"got SIGTERM, saving\\n")
    sys.exit(75)
signal.signal(signal.SIGTERM, stop)
print("training", flush=True)
while True:
    time.sleep(0.1)
"""


def test_a_lost_node_goes_unknown_and_its_pod_stays_terminating_until_force_deleted(
        kube_cluster: FakeCluster, core: Core, pods: PodLab) -> None:
    core.create_namespaced_pod(NS, plain_pod(
        "lonely", PREEMPTED, nodeSelector={"kubernetes.io/hostname": "node-2"}))
    wait_for(lambda: "training" in log(core, "lonely"), 30, "the pod to run", kube_cluster)

    kube_cluster.lose_node("node-2")
    # the API server cannot reach the node's kubelet for the log: 500 with the dial's error
    with pytest.raises(ApiException) as failed:
        core.read_namespaced_pod_log("lonely", NS, tail_lines=1)
    assert failed.value.status == 500
    said = json.loads(failed.value.body or "")
    ip = next(a.address for a in core.read_node("node-2").status.addresses
              if a.type == "InternalIP")
    assert "reason" not in said and said["message"] == (
        f'Get "https://{ip}:10250/containerLogs/default/lonely/worker": '
        f"dial tcp {ip}:10250: i/o timeout"), said

    ready = wait_for(lambda: (c := condition(core.read_node("node-2"), "Ready")) and
                     c.status == "Unknown" and c, 30, "the node to go Unknown", kube_cluster)
    assert (ready.reason, ready.message) == ("NodeStatusUnknown", "Kubelet stopped posting node status.")
    taints = {(t.key, t.effect) for t in core.read_node("node-2").spec.taints}
    assert ("node.kubernetes.io/unreachable", "NoExecute") in taints
    evicted = wait_for(lambda: core.read_namespaced_pod("lonely", NS).metadata.deletion_timestamp,
                       30, "the eviction", kube_cluster)
    assert evicted
    assert events(core, "lonely", "TaintManagerEviction")
    pod = core.read_namespaced_pod("lonely", NS)
    assert pod.status.phase == "Running"  # nobody reports for the node
    assert condition(pod, "Ready").status == "False"

    core.delete_namespaced_pod("lonely", NS, grace_period_seconds=0)

    wait_for(lambda: not core.list_namespaced_pod(NS).items, 10, "the pod to go", kube_cluster)
    wait_for(lambda: not [p for p in pods.pods() if p.name == "lonely"], 10,
             "its sandbox to go", kube_cluster)
    kube_cluster.restore_node("node-2")
    assert condition(core.read_node("node-2"), "Ready").status == "True"
    assert not core.read_node("node-2").spec.taints


def test_a_preempted_spot_node_sigterms_its_pod_which_ends_failed_terminated(
        kube_cluster: FakeCluster, core: Core) -> None:
    changes = record_changes(kube_cluster)
    core.create_namespaced_pod(NS, plain_pod(
        "spot-worker", PREEMPTED, nodeSelector={"kubernetes.io/hostname": "node-3"}))
    wait_for(lambda: "training" in log(core, "spot-worker"), 30, "the pod to run", kube_cluster)

    kube_cluster.preempt_node("node-3", grace_s=5)

    failed = [obj for type_, resource, obj in list(changes) if resource == "pods"
              and obj["metadata"]["name"] == "spot-worker" and obj["status"].get("phase") == "Failed"]
    assert failed, "the pod never went Failed"
    status = failed[0]["status"]
    assert status["reason"] == "Terminated"
    assert status["message"] == "Pod was terminated in response to imminent node shutdown."
    terminated = status["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 75
    source = kube_cluster.store.log_source(NS, "spot-worker", "worker", False)
    assert source is not None and "got SIGTERM, saving" in source.read_text()
    assert condition(core.read_node("node-3"), "Ready").status == "False"
    wait_for(lambda: not core.list_namespaced_pod(NS).items, 30, "the pod to be collected",
             kube_cluster)


def test_foreground_deletion_of_a_jobset_removes_jobs_pods_and_service_then_the_jobset(
        kube_cluster: FakeCluster, core: Core, custom: Custom, batch: Batch) -> None:
    create_jobset(custom, jobset("gone", FAIL_ONE, replicas=2, grace_s=5))
    wait_for(lambda: len([p for p in pods_of(core, "gone") if p.status.phase == "Running"]) == 2,
             60, "two running pods", kube_cluster)
    changes = record_changes(kube_cluster)

    custom.delete_namespaced_custom_object(GROUP, VERSION, NS, "jobsets", "gone",
                                           propagation_policy="Foreground")

    wait_for(lambda: not custom.list_namespaced_custom_object(
        GROUP, VERSION, NS, "jobsets")["items"], 60, "the JobSet to go", kube_cluster)
    deleted = [(resource, obj["metadata"]["name"]) for type_, resource, obj in list(changes)
               if type_ == "DELETED" and resource != "events"]
    assert deleted[-1] == ("jobsets", "gone")
    assert {d for d in deleted if d[0] in ("jobs", "services")} == {
        ("jobs", "gone-w-0"), ("jobs", "gone-w-1"), ("services", "gone")}
    assert len([d for d in deleted if d[0] == "pods"]) == 2
    assert not batch.list_namespaced_job(NS).items
    assert not core.list_namespaced_pod(NS).items
    assert not core.list_namespaced_service(NS).items


def test_kill_container_ends_the_pod_with_137(kube_cluster: FakeCluster, core: Core) -> None:
    core.create_namespaced_pod(NS, plain_pod("victim", PREEMPTED))
    wait_for(lambda: "training" in log(core, "victim"), 30, "the pod to run", kube_cluster)

    kube_cluster.kill_container("victim")

    wait_for(lambda: core.read_namespaced_pod("victim", NS).status.phase == "Failed", 30,
             "the pod to fail", kube_cluster)
    terminated = core.read_namespaced_pod("victim", NS).status.container_statuses[0].state.terminated
    assert (terminated.exit_code, terminated.reason) == (137, "Error")


STUBBORN = """
import os, signal, time
signal.signal(signal.SIGTERM, lambda signum, frame: os.write(1, b"ignoring SIGTERM\\n"))
print("up", flush=True)
while True:
    time.sleep(0.1)
"""


def test_deleting_again_with_grace_zero_kills_a_terminating_pod_at_once(
        kube_cluster: FakeCluster, core: Core, pods: PodLab) -> None:
    stubborn = plain_pod("stubborn", STUBBORN)
    stubborn["spec"]["terminationGracePeriodSeconds"] = 600
    core.create_namespaced_pod(NS, stubborn)
    wait_for(lambda: "up" in log(core, "stubborn"), 30, "the pod to run", kube_cluster)
    core.delete_namespaced_pod("stubborn", NS)
    wait_for(lambda: "ignoring SIGTERM" in log(core, "stubborn"), 30, "the SIGTERM", kube_cluster)
    assert core.read_namespaced_pod("stubborn", NS).metadata.deletion_grace_period_seconds == 600

    core.delete_namespaced_pod("stubborn", NS, grace_period_seconds=0)

    wait_for(lambda: not core.list_namespaced_pod(NS).items, 30, "the pod to go", kube_cluster)
    wait_for(lambda: not [p for p in pods.pods() if p.name == "stubborn"], 30,
             "its processes to go", kube_cluster)
