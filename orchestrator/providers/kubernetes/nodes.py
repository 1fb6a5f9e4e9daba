"""What the tool reads from Node objects (pure): whether the cluster counts a node lost, and
whether a node can hold one of the job's pods (its labels, taints and allocatable resources
against the pod's node selector, tolerations and requests), as the scheduler decides it."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from decimal import Decimal, InvalidOperation
from typing import Any

UNREACHABLE_TAINTS = ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready")
_SUFFIX = {"n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1),
           "k": Decimal("1e3"), "M": Decimal("1e6"), "G": Decimal("1e9"), "T": Decimal("1e12"),
           "P": Decimal("1e15"), "E": Decimal("1e18"), "Ki": Decimal(2) ** 10,
           "Mi": Decimal(2) ** 20, "Gi": Decimal(2) ** 30, "Ti": Decimal(2) ** 40,
           "Pi": Decimal(2) ** 50, "Ei": Decimal(2) ** 60}
_QUANTITY = re.compile(r"^([+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))([numkMGTPE]i?|[eE][+-]?[0-9]+)?$")


def quantity(text: str | int | float) -> Decimal:
    """A Kubernetes quantity ("7500m", "60Gi", "1e3", 8) as a number.

    Raises:
        ValueError: not a quantity.
    """
    match = _QUANTITY.match(str(text).strip())
    if match is None:
        raise ValueError(f"{text!r} is not a Kubernetes quantity")
    number, suffix = match.group(1), match.group(2) or ""
    try:
        if suffix[:1] in ("e", "E"):
            return Decimal(number) * Decimal(10) ** int(suffix[1:])
        if suffix not in _SUFFIX:
            raise ValueError(f"{text!r} is not a Kubernetes quantity")
        return Decimal(number) * _SUFFIX[suffix]
    except InvalidOperation:
        raise ValueError(f"{text!r} is not a Kubernetes quantity") from None


def ready(node: Mapping[str, Any]) -> dict[str, Any]:
    """The node's Ready condition ({} when it has none)."""
    return next((dict(c) for c in (node.get("status") or {}).get("conditions") or []
                 if c.get("type") == "Ready"), {})


def ready_since(node: Mapping[str, Any] | None) -> str:
    """When the node's Ready condition last changed ("" when unknown)."""
    return str(ready(node).get("lastTransitionTime", "")) if node else ""


def trouble(node: Mapping[str, Any]) -> str | None:
    """How the cluster says a node is lost: not Ready, or tainted unreachable or not-ready."""
    condition = ready(node)
    if condition.get("status") != "True":
        said = ": ".join(str(condition[k]) for k in ("reason", "message") if condition.get(k))
        return f"is not Ready (Ready={condition.get('status', 'missing')}" + \
            (f", {said})" if said else ")")
    taints = [t.get("key") for t in (node.get("spec") or {}).get("taints") or []
              if t.get("key") in UNREACHABLE_TAINTS]
    return f"is tainted {taints[0]}" if taints else None


def tolerates(tolerations: Sequence[Mapping[str, Any]], taint: Mapping[str, Any]) -> bool:
    """Whether one of ``tolerations`` tolerates ``taint`` (the core/v1 matching rules)."""
    for t in tolerations:
        if t.get("effect") and t.get("effect") != taint.get("effect"):
            continue
        if t.get("operator", "Equal") == "Exists":
            if not t.get("key") or t.get("key") == taint.get("key"):
                return True
        elif t.get("key") == taint.get("key") and (t.get("value") or "") == \
                (taint.get("value") or ""):
            return True
    return False


def pods_it_holds(node: Mapping[str, Any], *, node_selector: Mapping[str, str],
                  tolerations: Sequence[Mapping[str, Any]],
                  requests: Mapping[str, str | int]) -> tuple[int, str | None]:
    """How many of the job's pods ``node`` could hold if nothing else ran there, and why
    none (None when it holds at least one). Cordoned and not-Ready nodes hold none."""
    name = (node.get("metadata") or {}).get("name", "?")
    labels = (node.get("metadata") or {}).get("labels") or {}
    spec = node.get("spec") or {}
    if spec.get("unschedulable"):
        return 0, f"{name} is cordoned"
    lost = trouble(node)
    if lost:
        return 0, f"{name} {lost}"
    wrong = [f"{k}={v}" for k, v in node_selector.items() if labels.get(k) != v]
    if wrong:
        return 0, f"{name} lacks the label {wrong[0]} (provider.node_selector)"
    for taint in spec.get("taints") or []:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and \
                not tolerates(tolerations, taint):
            value = f"={taint['value']}" if taint.get("value") else ""
            return 0, (f"{name} has the taint {taint.get('key')}{value}:{taint.get('effect')} "
                       "(provider.tolerations)")
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    holds = math.inf
    for resource, asked in requests.items():
        need = quantity(asked)
        if need <= 0:
            continue
        has = quantity(allocatable.get(resource, 0))
        if has < need:
            return 0, f"{name} has {allocatable.get(resource, 0)} {resource}, a pod asks {asked}"
        holds = min(holds, int(has // need))
    pods = allocatable.get("pods")
    if pods is not None:
        holds = min(holds, int(quantity(pods)))
    return (int(holds) if holds != math.inf else 110), None
