"""Deterministic names and labels of a cluster's Compute Engine resources."""

from __future__ import annotations

CLUSTER_LABEL = "orchestrate-cluster"


def instance_name(cluster: str, index: int) -> str:
    """The VM of task ``index``."""
    return f"{cluster}-{index}"


def network_tag(cluster: str) -> str:
    return f"orchestrate-{cluster}"


def firewall_name(cluster: str) -> str:
    return f"orchestrate-{cluster}-grpc"


def firewall_description(cluster: str) -> str:
    """Firewall rules carry no labels: the description marks the rule as the cluster's."""
    return f"{CLUSTER_LABEL}={cluster}: gRPC between the cluster's VMs only"


def ssh_keys_value(user: str, public_line: str, cluster: str) -> str:
    """The ``ssh-keys`` metadata line: ``user:ssh-ed25519 AAAA... comment``."""
    return f"{user}:{public_line} orchestrate-{cluster}"
