"""Firewall rules of the project that open the cluster's task ports wider than its own rule.

``up`` opens the gRPC port range only between VMs with the cluster's network tag. TensorFlow's
gRPC server binds every interface and has no authentication, so another ALLOW rule of the same
network that reaches the cluster's VMs on those ports from an IP range, another tag or a service
account opens the tasks to every machine it covers: the default network's
``default-allow-internal`` (all TCP from 10.128.0.0/9) is the common one. A DENY rule of higher
priority (a lower number) over the whole range, from everywhere, closes it again; the fix names
one that sits below the cluster's own rule (priority 1000), so the cluster's VMs still reach
each other.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from orchestrator.problems import Problem
from orchestrator.providers.gcp.names import firewall_name, network_tag
from orchestrator.spec import GcpProvider, PortRange

if TYPE_CHECKING:
    from orchestrator.providers.gcp.compute import Compute

CHECK = "gcp firewall"
DENY_PRIORITY = 1100  # below the cluster's own ALLOW rule (1000), above the defaults (65534)


def problems(config: GcpProvider, compute: Compute, cluster: str,
             ports: PortRange) -> list[Problem]:
    """A warning for each ALLOW rule that opens some task port of the cluster's VMs beyond them."""
    rules = [r for r in compute.list_firewalls()
             if _last(r.network) == _last(config.network) and not r.disabled
             and (r.direction or "INGRESS") == "INGRESS"]
    tags = {network_tag(cluster), *config.tags}
    ours = firewall_name(cluster)
    found = []
    for rule in sorted(rules, key=lambda r: (r.priority, r.name)):
        if rule.name == ours or not rule.allowed or not _targets(rule, tags, config):
            continue
        opened = _overlap(rule.allowed, ports.start, ports.end)
        sources = _wider_sources(rule, network_tag(cluster))
        if not opened or not sources or _denied(rules, rule, tags, config, opened):
            continue
        span = f"{opened[0]}-{opened[1]}" if opened[0] != opened[1] else str(opened[0])
        found.append(Problem(
            CHECK, f"firewall rule {rule.name} (network {_last(rule.network)}, priority "
            f"{rule.priority}) also opens TCP {span} of the cluster's VMs to "
            f"{', '.join(sources)}: TensorFlow's gRPC server on those ports has no "
            "authentication, so every machine those sources cover can reach the tasks",
            f"gcloud compute firewall-rules create {ours}-deny --project {config.project} "
            f"--network {_last(config.network)} --direction INGRESS --action DENY "
            f"--rules tcp:{ports.start}-{ports.end} --source-ranges 0.0.0.0/0 "
            f"--target-tags {network_tag(cluster)} --priority {DENY_PRIORITY} (the cluster's "
            f"own rule, priority 1000, still lets its VMs in), or narrow {rule.name}",
            blocking=False))
    return found


def _targets(rule: Any, tags: set[str], config: GcpProvider) -> bool:
    """Whether the rule applies to the cluster's VMs: to every instance, to one of their
    tags, or to their service account."""
    if rule.target_tags:
        return bool(tags & set(rule.target_tags))
    if rule.target_service_accounts:
        return config.service_account in rule.target_service_accounts
    return True


def _overlap(allowed: Iterable[Any], start: int, end: int) -> tuple[int, int] | None:
    """The part of ports ``start``-``end`` that TCP entries of ``allowed`` open (their span)."""
    spans = []
    for entry in allowed:
        if entry.I_p_protocol not in ("tcp", "all", "6"):
            continue
        for low, high in _ranges(entry.ports):
            if low <= end and high >= start:
                spans.append((max(low, start), min(high, end)))
    if not spans:
        return None
    return min(s[0] for s in spans), max(s[1] for s in spans)


def _ranges(ports: Sequence[str]) -> list[tuple[int, int]]:
    """``["22", "1000-2000"]`` as ranges; no ports means every port."""
    if not ports:
        return [(0, 65535)]
    out = []
    for item in ports:
        low, _, high = item.partition("-")
        if low.isdigit() and (not high or high.isdigit()):
            out.append((int(low), int(high or low)))
    return out


def _wider_sources(rule: Any, cluster_tag: str) -> list[str]:
    """What the rule lets in besides the cluster's own VMs."""
    return [*rule.source_ranges, *(f"tag {t}" for t in rule.source_tags if t != cluster_tag),
            *(f"service account {a}" for a in rule.source_service_accounts)]


def _denied(rules: Sequence[Any], allow: Any, tags: set[str], config: GcpProvider,
            opened: tuple[int, int]) -> bool:
    """Whether a DENY rule of the same or higher priority closes ``opened`` from everywhere
    (on the same priority, a DENY wins)."""
    for deny in rules:
        if not deny.denied or deny.priority > allow.priority or "0.0.0.0/0" not in \
                deny.source_ranges or not _targets(deny, tags, config):
            continue
        if _overlap(deny.denied, *opened) == opened:
            return True
    return False


def _last(link: str) -> str:
    return link.rstrip("/").rsplit("/", 1)[-1]
