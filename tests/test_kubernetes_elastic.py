"""Elastic groups on Kubernetes: a pod that no node can take stands for a machine that cannot be
had. Command jobs (no TensorFlow: the pods' own size is what is checked) on the fake API server
whose controllers run the JobSet's pods as real processes (tests/kubecluster.py), as an
unprivileged uid, each pod asking for more than half a node's CPU, so one pod fits a node."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubecluster import FakeCluster, wait_for
from podlab import HostPath

from orchestrator.api import Cluster
from orchestrator.events import Event
from orchestrator.providers.kubernetes import manifests
from orchestrator.view import RunView

IMAGE = "registry.test/orchestrate-worker:1"
NAME = "k8s-elastic"
# The group's size, printed; it ends once it is 3 and the test has put the flag in place,
# else it waits to be stopped (a lost node, the planned stop that grows it).
SIZED = ("python -c 'import json, os, time; n = len(json.loads(os.environ[\"TF_CONFIG\"])"
         "[\"cluster\"][\"worker\"]); print(\"workers\", n, flush=True); "
         "[time.sleep(0.2) for _ in iter(lambda: n == 3 and os.path.exists(\"/flags/go\"), "
         "True)]'")


@pytest.fixture
def flags() -> Iterator[Path]:
    """A directory every pod sees at /flags (read-only): the test's word to the tasks."""
    where = Path(tempfile.mkdtemp(prefix="k8s-flags-"))
    where.chmod(0o755)
    yield where
    shutil.rmtree(where, ignore_errors=True)


def elastic_spec(cluster: FakeCluster, tmp_path: Path, workers: int, elastic: str,
                 repair_s: int = 6) -> Path:
    cluster.namespace_with_claim()
    kubeconfig = cluster.kube.write_kubeconfig(tmp_path / "kubeconfig")
    user = cluster.lab.plain_user()
    project = tmp_path / "project"
    project.mkdir()
    path = project / "spec.yaml"
    path.write_text(f"""\
name: {NAME}
workers: {workers}
container: {{image: {IMAGE}, python: {sys.executable}}}
provider:
  kind: kubernetes
  kubeconfig: {kubeconfig}
  namespace: ml
  volume: {{claim: shared}}
  resources: {{cpu: "5"}}
  run_as_user: {user.uid}
  run_as_group: {user.gid}
  fs_group: {user.gid}
job:
  command: {json.dumps(SIZED.replace("python", sys.executable, 1))}
retry: {{max_restarts: 3, backoff_initial_s: 0}}
timeouts: {{repair_s: {repair_s}, stop_grace_s: 5}}
elastic: {elastic}
""")
    return path


def pods(cluster: FakeCluster, **labels: str) -> list[dict[str, Any]]:
    selector = ",".join([manifests.selector(NAME), *(f"{k}={v}" for k, v in labels.items())])
    return list(cluster.store.list("pods", "ml", label_selector=selector))


def group_sizes(cluster: FakeCluster, attempt: int) -> list[int]:
    """The workers in the cluster each pod of ``attempt`` is given (its TF cluster)."""
    sizes = []
    for pod in pods(cluster, **{manifests.ATTEMPT_LABEL: str(attempt)}):
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        sizes.append(len(json.loads(env["ORCHESTRATE_TF_CLUSTER"])["worker"]))
    return sizes


def sizes_printed(api: Cluster, run_id: str, attempt: int) -> dict[str, set[str]]:
    """What each task of ``attempt`` printed: its 'workers N' lines, by task."""
    printed: dict[str, set[str]] = {}
    for task, line in api.logs(run_id, attempt=attempt):
        if line.startswith("workers "):
            printed.setdefault(task, set()).add(line)
    return printed


def test_a_pod_no_node_can_take_after_a_lost_node_shrinks_the_group_and_grows_back_on_return(
        kube_cluster_factory: Callable[..., FakeCluster], tmp_path: Path, flags: Path) -> None:
    """3 pods on 3 nodes, one pod a node; worker:2's node lost. The group restarts at 3, the
    new JobSet avoiding the lost node, where one of its pods waits: no node has room. Past
    timeouts.repair_s the group goes on with 2 (the pods 0 and 1); a reservation pod then waits
    in the scheduler for the room of a third. The node back: the reservation is bound there,
    the group makes a planned stop and grows to 3, a pod taking the room it held."""
    cluster = kube_cluster_factory(images={IMAGE}, node_files={"/flags": HostPath(
        str(flags), read_only=True)})
    # repair_s counts from the attempt's start: the pods of the one before must be gone
    # before its pods have room, which a loaded machine takes seconds to see through
    path = elastic_spec(cluster, tmp_path, 3, "{min_workers: 2, grow_check_s: 1}", repair_s=15)
    api = Cluster.from_spec(path)
    done: list[str] = []
    small: list[int] = []
    seen: list[RunView] = []

    def listener(view: RunView, event: Event | None) -> None:
        seen[:] = [view]
        if event is None or event.kind != "started":
            return
        if event.attempt == 1 and event.task == "worker:2" and "lost" not in done:
            done.append("lost")
            (pod,) = pods(cluster, **{manifests.ATTEMPT_LABEL: "1",
                                      manifests.JOB_INDEX_KEY: "2"})
            cluster.lose_node(pod["spec"]["nodeName"])
            done.append(pod["spec"]["nodeName"])
        elif event.attempt == 3 and "back" not in done:
            done.append("back")  # the group of 2 runs: the node returns, empty
            small.extend(group_sizes(cluster, 3))
            (flags / "go").touch()
            cluster.restore_node(done[1])

    try:
        api.up()
        result = api.train(listener=listener).wait()
        printed = sizes_printed(api, result.run_id, 4) if len(result.attempts) == 4 else {}
    finally:
        api.provider.close()
    assert done[0::2] == ["lost", "back"], done
    lost = done[1]
    said = [(a.cause, a.failed_task, a.resized, a.detail) for a in result.attempts]
    assert result.status == "succeeded" and len(result.attempts) == 4, said
    first, second, third, fourth = result.attempts
    assert (first.cause, first.failed_task) == ("host_lost", "worker:2"), first.detail
    assert f"node {lost}" in first.detail, first.detail
    # the new JobSet avoids the lost node: one of its pods (whichever the scheduler came to
    # last) has nowhere to go, and the group of 2 is the pods 0 and 1 whichever it was
    unplaced = second.failed_task
    assert (second.cause, unplaced) in {("host_lost", f"worker:{i}") for i in range(3)}, \
        second.detail
    assert f"no machine could take {unplaced} within 15s (timeouts.repair_s): 0/3 nodes are " \
        "available" in second.detail, second.detail
    assert "Insufficient cpu" in second.detail, second.detail
    assert third.resized.startswith(f"2 of 3 workers (without {NAME}-worker-2-0: no node can "
                                    "take a worker's pod: 0/3 nodes are available"), third.resized
    assert (third.status, third.cause) == ("stopped", "resized"), third.detail
    assert len(third.tasks) == 2 and len(fourth.tasks) == 3 and not fourth.resized
    assert small == [2, 2]  # the cluster each pod of the group of 2 was given
    assert printed == {f"worker:{i}": {"workers 3"} for i in range(3)}, printed
    # the room the reservation held on the node that came back went to a pod of the group
    assert sorted(p["spec"]["nodeName"] for p in pods(cluster, **{
        manifests.ATTEMPT_LABEL: "4"})) == ["node-1", "node-2", "node-3"]
    assert pods(cluster, **{manifests.ROLE_LABEL: manifests.RESERVE_ROLE}) == []
    messages = seen[0].messages
    assert any(f"going on without {NAME}-worker-2-0 (elastic)" in m for m in messages), messages
    assert any(m.startswith(f"{NAME}-worker-2-0 back: ") for m in messages), messages
    Cluster.from_spec(path).down()
    assert pods(cluster) == []


def test_a_group_grows_past_workers_once_a_node_has_room_for_another_pod(
        kube_cluster_factory: Callable[..., FakeCluster], tmp_path: Path, flags: Path) -> None:
    """workers 2, elastic.max_workers 3, node-3 full with another team's pod: the group starts
    with 2 and a reservation pod for the third waits in the scheduler, kept past each grow
    check. That pod gone, the reservation is bound to node-3 at once, the group makes a planned
    stop and goes on with 3; the reservation's room passes to the third pod, and nothing of
    it is left."""
    cluster = kube_cluster_factory(images={IMAGE}, node_files={"/flags": HostPath(
        str(flags), read_only=True)})
    path = elastic_spec(cluster, tmp_path, 2, "{min_workers: 2, max_workers: 3, grow_check_s: 1}")
    cluster.store.create("pods", {"metadata": {"name": "other-team"}, "spec": {
        "nodeName": "node-3", "restartPolicy": "Never", "terminationGracePeriodSeconds": 0,
        "containers": [{
            "name": "main", "image": IMAGE, "command": ["sleep", "600"],
            "resources": {"requests": {"cpu": "6"}}}]}}, namespace="default")
    api = Cluster.from_spec(path)
    queued: list[dict[str, Any]] = []

    def listener(view: RunView, event: Event | None) -> None:
        if event is None or event.kind != "started" or event.attempt != 1 or queued:
            return
        reservation = wait_for(lambda: [p for p in pods(
            cluster, **{manifests.ROLE_LABEL: manifests.RESERVE_ROLE})
            if "Unschedulable" in str(p.get("status", {}).get("conditions"))], 30,
            "the spare's reservation pod to wait in the scheduler", cluster)
        queued.extend(reservation)
        time.sleep(2.5)  # two grow checks: the same reservation still waits
        assert [p["metadata"]["uid"] for p in pods(
            cluster, **{manifests.ROLE_LABEL: manifests.RESERVE_ROLE})] == \
            [reservation[0]["metadata"]["uid"]]
        (flags / "go").touch()
        cluster.store.delete("pods", "other-team", "default")

    try:
        api.up()
        result = api.train(listener=listener).wait()
        printed = sizes_printed(api, result.run_id, 2) if len(result.attempts) == 2 else {}
    finally:
        api.provider.close()
    assert result.status == "succeeded", [a.detail for a in result.attempts]
    assert [p["metadata"]["name"] for p in queued] == [f"{NAME}-worker-2-0-r"]
    first, second = result.attempts
    assert len(second.tasks) == 3 and not second.resized
    assert first.resized == f"2 of 3 workers (without {NAME}-worker-2-0: a spare, not grown " \
        "onto yet)", first.resized
    assert (first.status, first.cause) == ("stopped", "resized"), first.detail
    assert printed == {f"worker:{i}": {"workers 3"} for i in range(3)}, printed
    assert sorted(p["spec"]["nodeName"] for p in pods(cluster, **{
        manifests.ATTEMPT_LABEL: "2"})) == ["node-1", "node-2", "node-3"]
    assert pods(cluster, **{manifests.ROLE_LABEL: manifests.RESERVE_ROLE}) == []
    Cluster.from_spec(path).down()
    assert pods(cluster) == []
