"""provider.kind kubernetes end to end: 'up', 'train' and 'down' through the official client
against the fake API server, whose controllers (tests/kubecluster.py) run the JobSet's pods as
real processes (tests/podlab.py): real TensorFlow over gRPC between pods that find each other
by their JobSet DNS names, as an unprivileged uid, with the code from ConfigMaps and the
checkpoints on a ReadWriteMany claim."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import REPO
from kubecluster import FakeCluster

from orchestrator.api import Cluster
from orchestrator.providers.kubernetes import manifests

IMAGE = "registry.test/orchestrate-worker:1"
pytestmark = pytest.mark.tf


def k8s_spec(cluster: FakeCluster, tmp_path: Path, body: str, workers: int = 3) -> Path:
    """A project with the digits example, and its spec for ``cluster``'s namespace ml."""
    store = cluster.store
    store.create("namespaces", {"metadata": {"name": "ml"}})
    store.create("persistentvolumeclaims", {"metadata": {"name": "shared"}, "spec": {
        "accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}}},
        namespace="ml")
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
  volume: {{claim: shared}}
  run_as_user: {user.uid}
  run_as_group: {user.gid}
  fs_group: {user.gid}
""" + body)
    return path


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
    api = Cluster.from_spec(path)
    killed: list[str] = []

    def kill_at_step_35(view: Any, event: Any) -> None:
        if not killed and event is not None and event.kind == "progress" and \
                event.task == "worker:0" and (event.get("step") or 0) >= 35:
            pod = next(p for p in cluster.store.list("pods", "ml") if p["metadata"][
                "labels"].get("orchestrate/role") == "worker" and p["metadata"]["annotations"][
                manifests.JOB_INDEX_KEY] == "1" and p.get("status", {}).get("phase") == "Running")
            killed.append(pod["metadata"]["name"])
            cluster.kill_container(pod["metadata"]["name"], "ml")

    try:
        api.up()
        result = api.train(listener=kill_at_step_35).wait()
    finally:
        api.provider.close()
    assert killed
    assert result.status == "succeeded"
    first, second = result.attempts
    assert (first.cause, first.failed_task, first.exit_code) == ("crashed", "worker:1", 137)
    assert second.resumed_from_step is not None and second.resumed_from_step >= 30
    assert len(set(result.digests.values())) == 1
    jobsets = cluster.store.list("jobsets", "ml")
    assert [j["metadata"]["labels"]["orchestrate/attempt"] for j in jobsets] == ["2"]
