"""provider.kind kubernetes end to end: 'up', 'train' and 'down' through the official client
against the fake API server, whose controllers (tests/kubecluster.py) run the JobSet's pods as
real processes (tests/podlab.py): real TensorFlow over gRPC between pods that find each other
by their JobSet DNS names, as an unprivileged uid, with the code from ConfigMaps and the
checkpoints on a ReadWriteMany claim."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_gcs import FakeGCS
from helpers import REPO, scalar_steps, tensorboard_logs, traced_names
from kubecluster import FakeCluster, ksa_principal, wait_for
from podlab import PodLab
from rich.console import Console

from orchestrator.api import Cluster, statuses
from orchestrator.console import render_status
from orchestrator.errors import RunFailed
from orchestrator.providers.kubernetes import manifests
from orchestrator.state import Store

IMAGE = "registry.test/orchestrate-worker:1"
pytestmark = pytest.mark.tf


def k8s_spec(cluster: FakeCluster, tmp_path: Path, body: str, workers: int = 3,
             provider: str = "  volume: {claim: shared}\n") -> Path:
    """A project with the digits example, and its spec for ``cluster``'s namespace ml
    (``provider``: more of the provider's fields; by default the claim ``shared``)."""
    cluster.namespace_with_claim()
    kubeconfig = cluster.kube.write_kubeconfig(tmp_path / "kubeconfig")
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(REPO / "examples" / "digits.py", project / "digits.py")
    user = cluster.lab.plain_user()
    path = project / "spec.yaml"
    path.write_text(f"""\
name: k8s-e2e
workers: {workers}
container: {{image: {IMAGE}, python: {sys.executable}}}
provider:
  kind: kubernetes
  kubeconfig: {kubeconfig}
  namespace: ml
{provider.rstrip()}
  run_as_user: {user.uid}
  run_as_group: {user.gid}
  fs_group: {user.gid}
""" + body)
    return path


def at_step(cluster: FakeCluster, step: int, index: int,
            act: Callable[[dict[str, Any]], None]) -> tuple[Callable[[Any, Any], None],
                                                           list[dict[str, Any]]]:
    """A listener that, once the chief reports ``step``, calls ``act`` with the running pod of
    worker ``index`` (once), and the list of the pods it acted on."""
    acted: list[dict[str, Any]] = []

    def listener(view: Any, event: Any) -> None:
        if acted or event is None or event.kind != "progress" or event.task != "worker:0" \
                or (event.get("step") or 0) < step:
            return
        pod = next(p for p in cluster.store.list("pods", "ml") if p["metadata"][
            "annotations"].get(manifests.JOB_INDEX_KEY) == str(index)
            and p.get("status", {}).get("phase") == "Running")
        acted.append(pod)
        act(pod)

    return listener, acted


def train_beside(api: Cluster, listener: Callable[[Any, Any], None],
                 beside: Callable[[], None]) -> Any:
    """``up``, then ``train`` to its end while ``beside`` runs in a thread (acting on the
    cluster as the run goes); the run's result."""
    helper = threading.Thread(target=beside)
    try:
        api.up()
        helper.start()
        return api.train(listener=listener).wait()
    finally:
        if helper.ident is not None:  # started
            helper.join()
        api.provider.close()


def train_killing_worker_1(cluster: FakeCluster, path: Path, step: int = 35) -> Any:
    """``up`` and ``train`` the spec at ``path``, SIGKILLing worker 1's container once the
    chief reports ``step``; the run's result."""
    api = Cluster.from_spec(path)
    listener, killed = at_step(cluster, step, 1, lambda pod: cluster.kill_container(
        pod["metadata"]["name"], "ml"))
    try:
        api.up()
        result = api.train(listener=listener).wait()
    finally:
        api.provider.close()
    assert killed
    return result


def test_up_train_down_with_a_jobset_of_three_pods(
        kube_cluster_factory: Callable[..., FakeCluster], tmp_path: Path) -> None:
    cluster = kube_cluster_factory(images={IMAGE})
    path = k8s_spec(cluster, tmp_path, """\
job: {module: digits, epochs: 2, steps_per_epoch: 30, progress_every_steps: 5}
checkpoint: {every_steps: 10}
""")
    api = Cluster.from_spec(path)
    try:
        hosts = api.up()
        assert [h.address for h in hosts] == [f"k8s-e2e-worker-{i}-0.k8s-e2e" for i in range(3)]
        result = api.train().wait()
        logs = list(api.logs(result.run_id))  # the pods' logs, through the API
    finally:
        api.provider.close()
    assert result.status == "succeeded"
    assert len(result.attempts) == 1 and result.attempts[0].last_step == 60
    assert Path(result.model_path).stat().st_size > 0  # read back from the claim
    assert {task for task, _ in logs} == {"worker:0", "worker:1", "worker:2"}
    digests = set(result.digests.values())
    assert len(digests) == 1 and "" not in digests  # every pod ended with the same weights
    record = api.run(result.run_id)
    tasks = record.attempts[0].tasks
    assert [t.launcher for t in tasks] == ["pod"] * 3
    assert [t.step for t in tasks] == [60, 60, 60]
    assert tasks[0].checkpoint_step == 60  # the chief's last checkpoint, on the claim
    pods = cluster.store.list("pods", "ml", label_selector=manifests.selector("k8s-e2e"))
    users = {p["spec"]["securityContext"]["runAsUser"] for p in pods}
    assert users == {cluster.lab.plain_user().uid}
    nodes = {p["spec"]["nodeName"] for p in pods}
    assert len(nodes) == 3  # one pod per node

    report = Cluster.from_spec(path).down()
    assert "JobSet k8s-e2e" in report.removed
    for resource in ("jobsets", "jobs", "pods", "secrets", "configmaps", "services"):
        left = cluster.store.list(resource, "ml")
        assert left == [], f"{resource} left: {[o['metadata']['name'] for o in left]}"


def test_a_killed_pod_restarts_the_group_from_the_chiefs_checkpoint(
        kube_cluster_factory: Callable[..., FakeCluster], tmp_path: Path) -> None:
    cluster = kube_cluster_factory(images={IMAGE})
    path = k8s_spec(cluster, tmp_path, """\
job: {module: digits, epochs: 4, steps_per_epoch: 30, progress_every_steps: 5}
checkpoint: {every_steps: 10}
retry: {max_restarts: 2, backoff_initial_s: 0}
""")
    result = train_killing_worker_1(cluster, path)
    assert result.status == "succeeded"
    first, second = result.attempts
    assert (first.cause, first.failed_task, first.exit_code) == ("crashed", "worker:1", 137)
    assert second.resumed_from_step is not None and second.resumed_from_step >= 30
    assert len(set(result.digests.values())) == 1
    jobsets = cluster.store.list("jobsets", "ml")
    assert [j["metadata"]["labels"]["orchestrate/attempt"] for j in jobsets] == ["2"]


def test_a_pod_no_node_can_hold_says_why_and_starts_once_one_can(
        kube_cluster_factory: Callable[..., FakeCluster], tmp_path: Path) -> None:
    cluster = kube_cluster_factory(images={IMAGE})
    path = k8s_spec(cluster, tmp_path, """\
  gpus_per_pod: 1
job: {module: digits, epochs: 1, steps_per_epoch: 20, progress_every_steps: 5}
""", workers=2)
    api = Cluster.from_spec(path)
    said: list[str] = []
    states: set[str] = set()
    status_said: list[str] = []

    def listener(view: Any, event: Any) -> None:
        said.extend(m for m in view.messages if "is waiting" in m and m not in said)
        states.update(t.state for t in view.tasks.values())

    def add_gpus_once_status_tells() -> None:
        """'orchestrate status' (another process would read the same store) says why the
        run waits; then the autoscaler's new nodes come, in effect."""
        for _ in range(600):
            runs = Store().runs(api.name, limit=1)
            if runs and "is waiting: no node can take its pod" in runs[0].message:
                console = Console(record=True, width=300)
                render_status(console, [c.to_dict() for c in statuses(api.name)])
                status_said.append(console.export_text())
                break
            time.sleep(0.2)
        for node in ("node-1", "node-2", "node-3"):
            cluster.set_gpus(node, 1)

    result = train_beside(api, listener, add_gpus_once_status_tells)
    assert result.status == "succeeded" and len(result.attempts) == 1
    assert "waiting" in states
    assert status_said and "now: worker:0 is waiting: no node can take its pod" in \
        status_said[0], status_said
    assert not Store().runs(api.name, limit=1)[0].message.startswith("worker:")  # replaced
    assert said, "the wait was never explained"
    assert "no node can take its pod: 0/3 nodes are available: 3 Insufficient nvidia.com/gpu" \
        in said[0]
    assert "provider.gpus_per_pod" in said[0]  # and the fix


def test_a_spot_preemption_saves_every_task_at_one_step_and_loses_none(
        kube_cluster_factory: Callable[..., FakeCluster], tmp_path: Path) -> None:
    cluster = kube_cluster_factory(images={IMAGE})
    path = k8s_spec(cluster, tmp_path, """\
job: {module: digits, epochs: 4, steps_per_epoch: 30, progress_every_steps: 5}
checkpoint: {every_steps: 50}
timeouts: {stop_grace_s: 30}
""")
    api = Cluster.from_spec(path)
    listener, preempted = at_step(cluster, 35, 2, lambda pod: threading.Thread(
        target=cluster.preempt_node, args=(pod["spec"]["nodeName"], 15), daemon=True).start())
    try:
        api.up()
        result = api.train(listener=listener).wait()
    finally:
        api.provider.close()
    assert preempted
    assert result.status == "succeeded"
    first, second = result.attempts
    assert first.cause == "preempted", first.detail
    assert second.resumed_from_step == first.last_step  # saved at the step every task had
    assert first.steps_lost == 0
    assert len(set(result.digests.values())) == 1


def cli(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "ORCHESTRATE_HOME": str(home)})


def test_training_outlives_its_controller_and_train_attach_takes_it_over(
        kube_cluster_factory: Callable[..., FakeCluster], tmp_path: Path,
        orchestrate_home: Path) -> None:
    """The controller SIGKILLed mid-run: the pods train on; 'train --attach' finds them from
    the attempt's record through the API and watches them to the end; 'logs' and 'down' go
    through the API too."""
    cluster = kube_cluster_factory(images={IMAGE})
    path = k8s_spec(cluster, tmp_path, """\
job: {module: tests.workloads.paced_digits, epochs: 2, steps_per_epoch: 30,
      progress_every_steps: 1}
env: {DIGITS_PACE_S: "0.2"}
checkpoint: {every_steps: 10}
""", workers=2)
    project = path.parent
    shutil.copytree(REPO / "examples", project / "examples",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (project / "tests" / "workloads").mkdir(parents=True)
    for name in ("__init__.py", "pace.py", "paced_digits.py"):
        shutil.copy(REPO / "tests" / "workloads" / name, project / "tests" / "workloads" / name)
    store = Store(orchestrate_home / "state.db")
    controller = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli", "train", str(path), "--plain"], cwd=REPO,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "ORCHESTRATE_HOME": str(orchestrate_home)})

    def training() -> bool:
        for pod in cluster.store.list("pods", "ml"):
            log = cluster.store.log_source("ml", pod["metadata"]["name"], "task", False)
            if log is not None and log.exists() and '"progress"' in log.read_text(errors="replace"):
                return True
        return False

    try:
        wait_for(training, 300, "a step in a pod's log", cluster)
    finally:
        controller.kill()
        controller.wait()
    attach = cli("train", str(path), "--attach", "--plain", home=orchestrate_home)
    assert attach.returncode == 0, attach.stdout + attach.stderr
    (run,) = store.runs("k8s-e2e")
    assert run.status == "succeeded" and len(run.attempts) == 1, run.message
    logs = cli("logs", "k8s-e2e", home=orchestrate_home)
    assert logs.returncode == 0, logs.stderr
    for task in ("worker:0", "worker:1"):
        assert f"[{task}]" in logs.stdout, logs.stdout[-2000:]
    down = cli("down", str(path), home=orchestrate_home)
    assert down.returncode == 0, down.stdout + down.stderr
    assert cluster.store.list("jobsets", "ml") == []


def test_a_lost_node_restarts_the_group_on_the_nodes_left(
        kube_cluster_factory: Callable[..., FakeCluster], tmp_path: Path) -> None:
    """A node gone with its pod, with the real order of things: the peers fail (collective_s)
    while the cluster still counts the node Ready (its grace, 40-50 s, here 60 s) and long
    before the pod's eviction (300 s). The kubelet that does not answer names the lost node;
    the group restarts from the chief's checkpoint on the nodes left: the new JobSet avoids
    the lost node, which the scheduler still counts Ready."""
    cluster = kube_cluster_factory(images={IMAGE}, node_monitor_grace_s=60, eviction_s=300)
    path = k8s_spec(cluster, tmp_path, """\
job: {module: digits, epochs: 4, steps_per_epoch: 30, progress_every_steps: 5}
checkpoint: {every_steps: 10}
retry: {max_restarts: 3, backoff_initial_s: 0}
timeouts: {collective_s: 20}
""")
    api = Cluster.from_spec(path)
    listener, lost = at_step(cluster, 35, 1, lambda pod: cluster.lose_node(
        pod["spec"]["nodeName"]))
    try:
        api.up()
        result = api.train(listener=listener).wait()
    finally:
        api.provider.close()
    assert lost
    node = lost[0]["spec"]["nodeName"]
    assert result.status == "succeeded"
    first = result.attempts[0]
    assert (first.cause, first.failed_task) == ("host_lost", "worker:1"), first.detail
    assert f"the kubelet of node {node} does not answer" in first.detail, first.detail
    assert ":10250: i/o timeout" in first.detail, first.detail
    assert result.attempts[-1].resumed_from_step is not None
    assert result.attempts[-1].resumed_from_step >= 30
    now = cluster.store.list("pods", "ml", label_selector="orchestrate/attempt="
                             + str(len(result.attempts)))
    assert now and node not in {p["spec"]["nodeName"] for p in now}
    assert len(set(result.digests.values())) == 1


def test_a_jobset_queued_in_kueue_waits_past_the_startup_timeout_and_runs_once_admitted(
        kube_cluster_factory: Callable[..., FakeCluster], tmp_path: Path) -> None:
    """provider.queue: the JobSet is submitted suspended with the queue label; while Kueue
    holds it (no quota), the view and 'status' say why, with the Workload's own message, and
    the wait does not count against timeouts.startup_s (30 s here, the queue ~35 s); once
    admitted, the pods are made and the run trains in its first attempt."""
    cluster = kube_cluster_factory(images={IMAGE}, kueue=True)
    path = k8s_spec(cluster, tmp_path, """\
  queue: team-a
job: {module: digits, epochs: 1, steps_per_epoch: 10, progress_every_steps: 5}
timeouts: {startup_s: 30}
""", workers=2)
    cluster.store.create("localqueues", {"metadata": {"name": "team-a"},
                                         "spec": {"clusterQueue": "cluster-queue"}}, namespace="ml")
    api = Cluster.from_spec(path)
    said: list[str] = []
    told = threading.Event()

    def listener(view: Any, event: Any) -> None:
        said.extend(m for m in view.messages if "is waiting" in m and m not in said)
        if any("queued in Kueue's LocalQueue team-a" in m for m in said):
            told.set()

    def admit_later() -> None:
        if told.wait(60):
            time.sleep(35)  # longer than the startup timeout, queued
        submitted.append(cluster.store.get("jobsets", "k8s-e2e", "ml"))
        cluster.admit_queued()

    submitted: list[dict[str, Any]] = []
    result = train_beside(api, listener, admit_later)
    assert result.status == "succeeded" and len(result.attempts) == 1, \
        ([(a.cause, a.detail) for a in result.attempts], said)
    assert submitted[0]["spec"]["suspend"] is True
    assert submitted[0]["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    queued = [m for m in said if "queued in Kueue's LocalQueue team-a, not admitted" in m]
    assert queued and "insufficient unused quota for nvidia.com/gpu in flavor default-flavor" \
        in queued[0], said
    assert "kubectl -n ml describe localqueue team-a" in queued[0]


def test_doctor_import_tf_runs_one_pod_like_a_task_and_says_what_the_image_lacks(
        kube_cluster_factory: Callable[..., FakeCluster], tmp_path: Path) -> None:
    """'doctor --import-tf' on Kubernetes: one pod of the image, placed and given GPUs as a
    task's: no node for it yet (said, not blocking), TensorFlow that sees no GPU in a pod given
    one, an interpreter without TensorFlow (both blocking, with the fix)."""
    cluster = kube_cluster_factory(images={IMAGE})
    path = k8s_spec(cluster, tmp_path, "  gpus_per_pod: 1\njob: {module: digits}\n", workers=2)
    api = Cluster.from_spec(path)
    no_tf = Path(tempfile.mkdtemp(prefix="no-tf-"))
    try:
        api.up()
        (unplaced,) = [p for p in api.doctor(tensorflow="always").problems if p.check == "image"]
        assert not unplaced.blocking
        assert "could not run the probe: no node can take its pod: 0/3 nodes are available: " \
               "3 Insufficient nvidia.com/gpu" in unplaced.message, unplaced.message
        for node in ("node-1", "node-2", "node-3"):
            cluster.set_gpus(node, 1)
        (blind,) = [p for p in api.doctor(tensorflow="always").problems if p.check == "image"]
        assert blind.blocking and "sees 0 GPU(s) in a pod given 1 (nvidia.com/gpu)" in \
            blind.message, blind.message
        assert "tensorflow[and-cuda]" in blind.fix
        assert not [p for p in api.doctor().problems if p.check == "image"]  # only when asked
        # an interpreter of the image without TensorFlow (its site-packages left out)
        wrapper = no_tf / "python"
        wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
        no_tf.chmod(0o755)
        wrapper.chmod(0o755)
        path.write_text(path.read_text().replace(f"python: {sys.executable}", f"python: {wrapper}"))
        (missing,) = [p for p in Cluster.from_spec(path).doctor(tensorflow="always").problems
                      if p.check == "image"]
        assert missing.blocking and "cannot import TensorFlow: ModuleNotFoundError: No module " \
            "named 'tensorflow'" in missing.message, missing.message
        assert not cluster.store.list("pods", "ml")  # every probe pod deleted
    finally:
        api.provider.close()
        shutil.rmtree(no_tf, ignore_errors=True)


@contextlib.contextmanager
def bucket_cluster(factory: Callable[..., FakeCluster], lab: PodLab,
                   writers: tuple[str, ...]) -> Iterator[tuple[FakeCluster, FakeGCS]]:
    """A cluster whose nodes reach a fake Cloud Storage with GKE's metadata server (each pod
    is who its ServiceAccount is, by Workload Identity), and its bucket ``ckpt-bucket``, which
    ``writers`` may write."""
    clusters: list[FakeCluster] = []
    with FakeGCS.start(lab.bridge_address,
                       lambda ip: clusters[0].pod_principal(ip) if clusters else None) as gcs:
        clusters.append(factory(images={IMAGE}, node_hosts=gcs.hosts_entries(),
                                node_files=gcs.pod_mounts()))
        gcs.create_bucket("ckpt-bucket", writers=writers)
        yield clusters[0], gcs


NO_VOLUME = "  service_account: trainer\n"
TRAINER = ksa_principal("ml", "trainer")


def test_checkpoints_in_a_bucket_by_workload_identity_survive_a_killed_pod(
        kube_cluster_factory: Callable[..., FakeCluster], pods: PodLab, tmp_path: Path) -> None:
    """No volume: TensorFlow in the pods checkpoints to gs:// as the pods' ServiceAccount (no
    key anywhere), a killed pod's group resumes from the bucket, and the chief's final model is
    left there."""
    with bucket_cluster(kube_cluster_factory, pods, (TRAINER,)) as (cluster, gcs):
        # 2 pods, 90 steps (it was 3 and 120: the bucket is the point, and each pod and
        # step was seconds of the suite's busiest lane); the kill at step 35 leaves 55
        path = k8s_spec(cluster, tmp_path, """\
job: {module: digits, epochs: 3, steps_per_epoch: 30, progress_every_steps: 5}
checkpoint: {dir: 'gs://ckpt-bucket/runs', every_steps: 10}
retry: {max_restarts: 2, backoff_initial_s: 0}
""", workers=2, provider=NO_VOLUME)
        cluster.store.create("serviceaccounts", {"metadata": {"name": "trainer"}}, namespace="ml")
        result = train_killing_worker_1(cluster, path)
        objects = gcs.objects("ckpt-bucket")
        # (an upload's PUTs carry no token: the session's upload_id is its credential)
        principals = {seen.principal for seen in gcs.requests
                      if seen.server == "gcs" and "upload_id=" not in seen.path}
        written = {urllib.parse.unquote(seen.path) for seen in gcs.requests
                   if seen.method == "POST" and "uploadType=resumable" in seen.path}
    assert result.status == "succeeded"
    first, second = result.attempts
    assert (first.cause, first.failed_task) == ("crashed", "worker:1")
    assert second.resumed_from_step is not None and second.resumed_from_step >= 30
    assert len(set(result.digests.values())) == 1
    run = f"runs/k8s-e2e/{result.run_id}"
    assert result.model_path == f"gs://ckpt-bucket/{run}/model/model.keras"
    assert objects[f"{run}/model/model.keras"][:2] == b"PK"  # a .keras file is a zip
    # the chief's checkpoints went to the bucket (BackupAndRestore removes them at the end)
    assert any(f"name={run}/chief/checkpoint" in path for path in written), sorted(written)[:5]
    assert principals == {TRAINER}  # every request was the pods' own identity
    pods_made = cluster.store.list("pods", "ml")
    assert all(v.get("emptyDir") == {} for p in pods_made for v in p["spec"]["volumes"]
               if v["name"] == "runs")


def test_a_keras3_module_on_jax_checkpoints_to_a_bucket_and_a_killed_pod_resumes_from_it(
        kube_cluster_factory: Callable[..., FakeCluster], pods: PodLab, tmp_path: Path) -> None:
    """``job.backend: jax`` with no volume: the chief's Keras-format checkpoints (.weights.h5,
    .state.npz and the index) go to gs:// through TensorFlow's file systems, as Keras reaches
    remote paths; a killed pod's group verifies and resumes from the chief's snapshot there."""
    with bucket_cluster(kube_cluster_factory, pods, (TRAINER,)) as (cluster, gcs):
        path = k8s_spec(cluster, tmp_path, """\
job: {module: keras3_digits, backend: jax, epochs: 1, steps_per_epoch: 40,
      progress_every_steps: 1, deterministic: true}
checkpoint: {dir: 'gs://ckpt-bucket/runs', every_steps: 10}
retry: {max_restarts: 2, backoff_initial_s: 0}
tensorboard: {dir: 'gs://ckpt-bucket/tb', every_steps: 5, profile_steps: [3, 4]}
""", workers=2, provider=NO_VOLUME)
        shutil.copy(REPO / "examples" / "keras3_digits.py", path.parent / "keras3_digits.py")
        cluster.store.create("serviceaccounts", {"metadata": {"name": "trainer"}}, namespace="ml")
        result = train_killing_worker_1(cluster, path, step=15)
        objects = gcs.objects("ckpt-bucket")
        principals = {seen.principal for seen in gcs.requests
                      if seen.server == "gcs" and "upload_id=" not in seen.path}
    assert result.status == "succeeded"
    first, second = result.attempts
    assert (first.cause, first.failed_task) == ("crashed", "worker:1")
    # The chief's pod lives: it saved the state of the step the kill broke, into the bucket.
    assert first.snapshot == \
        f"worker:0 saved its state at step {first.snapshot_step} after worker:1 failed", \
        first.snapshot
    assert second.resumed_from_step == first.snapshot_step >= 15
    assert len(result.digests) == 2 and len(set(result.digests.values())) == 1
    run = f"runs/k8s-e2e/{result.run_id}"
    index = objects[f"{run}/chief/checkpoint"].decode()
    assert 'model_checkpoint_path: "ckpt-40"' in index, index
    assert objects[f"{run}/chief/ckpt-40.weights.h5"][:8] == b"\x89HDF\r\n\x1a\n"
    assert objects[f"{run}/chief/ckpt-40.state.npz"][:2] == b"PK"
    kept = sorted(key.rsplit("/", 1)[1] for key in objects
                  if key.startswith(f"{run}/chief/") and not key.endswith("/"))
    newest = sorted({10, 20, 30, 40, first.snapshot_step})[-3:]  # the snapshot's among them
    assert kept == ["checkpoint", *(f"ckpt-{s}.{kind}" for s in newest
                                    for kind in ("state.npz", "weights.h5"))], kept
    assert objects[f"{run}/model/model.keras"][:2] == b"PK"
    assert result.model_path == f"gs://ckpt-bucket/{run}/model/model.keras"
    assert principals == {TRAINER}
    # The chief's TensorBoard log in the bucket, one file an attempt, as TensorBoard loads it
    # (attempt 1's chief was stopped mid-run: what it had uploaded, at most 10 s behind).
    board = f"tb/k8s-e2e/{result.run_id}/"
    assert Cluster.from_spec(path).tensorboard().directory == f"gs://ckpt-bucket/{board}"[:-1]
    here = tmp_path / "tb"
    for key, data in objects.items():
        if key.startswith(board) and not key.endswith("/"):
            (here / key[len(board):]).parent.mkdir(parents=True, exist_ok=True)
            (here / key[len(board):]).write_bytes(data)
    assert len(list(here.glob("events.out.tfevents.*"))) == 2
    logs = tensorboard_logs(here)
    loss = [step for step, _ in scalar_steps(logs, "train/loss")]
    assert loss[-4:] == [25, 30, 35, 40] and loss == sorted(set(loss)), loss
    assert scalar_steps(logs, "run/attempt")[-1] == (second.resumed_from_step, 2.0)
    # steps 3 and 4 traced by JAX's profiler, in the pod, and copied into the bucket
    (trace,) = here.glob("plugins/profile/*/*.xplane.pb")
    assert "PjitFunction(train_step)" in traced_names(trace)


def test_a_service_account_that_may_not_write_the_bucket_stops_the_run_at_once(
        kube_cluster_factory: Callable[..., FakeCluster], pods: PodLab, tmp_path: Path) -> None:
    with bucket_cluster(kube_cluster_factory, pods, ()) as (cluster, _):
        path = k8s_spec(cluster, tmp_path, """\
job: {module: digits, epochs: 1, steps_per_epoch: 10}
checkpoint: {dir: 'gs://ckpt-bucket/runs'}
retry: {max_restarts: 3, backoff_initial_s: 0}
""", workers=2, provider=NO_VOLUME)
        cluster.store.create("serviceaccounts", {"metadata": {"name": "trainer"}}, namespace="ml")
        api = Cluster.from_spec(path)
        try:
            api.up()
            with pytest.raises(RunFailed) as info:
                api.train().wait()
        finally:
            api.provider.close()
    text = str(info.value)
    assert "failed after 1 attempt(s)" in text and "user_error" in text, text
    assert "cannot write the checkpoint location gs://ckpt-bucket/runs/k8s-e2e/" in text, text
    assert f"PermissionDeniedError: HTTP 403 from Cloud Storage: {TRAINER} does not have " \
           "storage." in text, text  # Cloud Storage's own words, whole, not a JSON fragment
    assert "fix: give the identity the tasks run as write access to the bucket" in text
    assert "roles/storage.objectUser" in text
