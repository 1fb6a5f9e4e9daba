"""The controller; ``from orchestrator import Cluster, ClusterSpec`` is the Python API."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orchestrator.api import Cluster, Run
    from orchestrator.spec import ClusterSpec

__all__ = ["Cluster", "ClusterSpec", "Run"]


def __getattr__(name: str) -> Any:
    """Load the API on first use, so that ``import orchestrator.cli`` stays fast."""
    if name in ("Cluster", "Run"):
        from orchestrator import api

        return getattr(api, name)
    if name == "ClusterSpec":
        from orchestrator.spec import ClusterSpec

        return ClusterSpec
    raise AttributeError(f"module 'orchestrator' has no attribute {name!r}")
