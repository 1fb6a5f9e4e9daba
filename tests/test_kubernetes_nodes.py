"""What the kubernetes provider reads from Node objects (orchestrator/providers/kubernetes/
nodes.py): quantities, the Ready condition and the taints of a lost node, and whether a node
can hold one of the job's pods, by the scheduler's rules."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

from orchestrator.providers.kubernetes import manifests, nodes
from orchestrator.providers.kubernetes.runner import node_marked_not_ready

GPU = "nvidia.com/gpu"


@pytest.mark.parametrize(("text", "value"), [
    ("8", Decimal(8)), ("7500m", Decimal("7.5")), ("60Gi", Decimal(60 * 2**30)),
    ("1e3", Decimal(1000)), ("1.5k", Decimal(1500)), (".5", Decimal("0.5")), (2, Decimal(2)),
    ("128974848", Decimal(128974848)), ("129M", Decimal(129_000_000)), ("100n", Decimal("1e-7")),
])
def test_quantities_read_as_kubernetes_writes_them(text: str | int, value: Decimal) -> None:
    assert nodes.quantity(text) == value


@pytest.mark.parametrize("text", ["", "8 Gi", "Gi", "1.2.3", "5x", "-1"])
def test_what_is_not_a_quantity_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="not a Kubernetes quantity"):
        nodes.quantity(text)


def node(name: str = "n1", *, ready: str = "True", labels: dict[str, str] | None = None,
         taints: list[dict[str, Any]] | None = None,
         allocatable: dict[str, str] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels or {}},
            "spec": {"taints": taints} if taints else {},
            "status": {"allocatable": {"cpu": "8", "memory": "32Gi", "pods": "110",
                                       **(allocatable or {})},
                       "conditions": [{"type": "Ready", "status": ready,
                                       "reason": "KubeletReady" if ready == "True"
                                       else "NodeStatusUnknown",
                                       "message": "Kubelet stopped posting node status.",
                                       "lastTransitionTime": "2026-11-25T10:00:00Z"}]}}


def test_a_lost_node_is_one_not_ready_or_tainted_unreachable() -> None:
    assert nodes.trouble(node()) is None
    assert nodes.trouble(node(ready="Unknown")) == (
        "is not Ready (Ready=Unknown, NodeStatusUnknown: Kubelet stopped posting node status.)")
    tainted = node(taints=[{"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}])
    assert nodes.trouble(tainted) == "is tainted node.kubernetes.io/unreachable"
    assert nodes.trouble({"metadata": {"name": "x"}}) == "is not Ready (Ready=missing)"
    assert nodes.ready_since(node()) == "2026-11-25T10:00:00Z" and nodes.ready_since(None) == ""


def test_tolerations_match_taints_by_the_core_rules() -> None:
    spot = {"key": "cloud.google.com/gke-spot", "value": "true", "effect": "NoSchedule"}
    assert nodes.tolerates([{"key": "cloud.google.com/gke-spot", "operator": "Equal",
                             "value": "true", "effect": "NoSchedule"}], spot)
    assert nodes.tolerates([{"key": "cloud.google.com/gke-spot", "operator": "Exists"}], spot)
    assert nodes.tolerates([{"operator": "Exists"}], spot)  # no key: every taint
    assert not nodes.tolerates([{"key": "cloud.google.com/gke-spot", "operator": "Equal",
                                 "value": "false"}], spot)
    assert not nodes.tolerates([{"key": "cloud.google.com/gke-spot", "operator": "Exists",
                                 "effect": "NoExecute"}], spot)
    assert not nodes.tolerates([], spot)


def holds(n: dict[str, Any], **requests: str | int) -> tuple[int, str | None]:
    return nodes.pods_it_holds(n, node_selector={"pool": "gpu"}, tolerations=[],
                               requests={GPU if k == "gpus" else k: v
                                         for k, v in requests.items()})


def test_a_node_holds_as_many_pods_as_its_scarcest_resource_allows() -> None:
    gpu = node(labels={"pool": "gpu"}, allocatable={GPU: "8"})
    assert holds(gpu, cpu="3", memory="8Gi", gpus=2) == (2, None)  # cpu: 8 // 3
    assert holds(gpu, gpus=8) == (1, None)
    assert holds(gpu) == (110, None)  # nothing asked: the node's pod limit
    assert holds(gpu, cpu="500m")[0] == 16


@pytest.mark.parametrize(("made", "asked", "why"), [
    (node(labels={"pool": "cpu"}), {}, "n1 lacks the label pool=gpu (provider.node_selector)"),
    (node(labels={"pool": "gpu"}), {"nvidia.com/gpu": 1}, "n1 has 0 nvidia.com/gpu, a pod asks 1"),
    (node(labels={"pool": "gpu"}), {"memory": "64Gi"}, "n1 has 32Gi memory, a pod asks 64Gi"),
    (node(labels={"pool": "gpu"}, ready="Unknown"), {}, "n1 is not Ready"),
    (node(labels={"pool": "gpu"}, taints=[{"key": "cloud.google.com/gke-spot", "value": "true",
                                           "effect": "NoSchedule"}]), {},
     "n1 has the taint cloud.google.com/gke-spot=true:NoSchedule (provider.tolerations)"),
])
def test_a_node_that_cannot_hold_a_pod_says_why(made: dict[str, Any], asked: dict[str, Any],
                                                why: str) -> None:
    count, said = nodes.pods_it_holds(made, node_selector={"pool": "gpu"}, tolerations=[],
                                      requests=asked)
    assert count == 0 and said is not None and said.startswith(why), said


def test_a_cordoned_node_holds_nothing() -> None:
    cordoned = node(labels={"pool": "gpu"})
    cordoned["spec"]["unschedulable"] = True
    assert holds(cordoned) == (0, "n1 is cordoned")


def pod_with(ready: str, containers_ready: str, state: dict[str, Any]) -> dict[str, Any]:
    return {"spec": {"nodeName": "node-1"}, "status": {
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": ready},
                       {"type": "ContainersReady", "status": containers_ready}],
        "containerStatuses": [{"name": manifests.CONTAINER, "state": state}]}}


@pytest.mark.parametrize(("ready", "containers_ready", "state", "marked"), [
    # the node lifecycle controller's mark: only Ready, on a pod whose container still runs
    ("False", "True", {"running": {}}, True),
    ("True", "True", {"running": {}}, False),
    # the kubelet's own: the container ended (or is not ready: a probe), both conditions go
    ("False", "False", {"terminated": {"exitCode": 1}}, False),
    ("False", "False", {"running": {}}, False),
])
def test_a_running_pod_marked_not_ready_by_the_node_controller_is_lost(
        ready: str, containers_ready: str, state: dict[str, Any], marked: bool) -> None:
    assert node_marked_not_ready(pod_with(ready, containers_ready, state)) is marked
