"""Where hosts come from: `local` now; one module per provider, chosen by the spec's provider.kind."""

from __future__ import annotations

from pathlib import Path

from orchestrator.errors import ProviderError
from orchestrator.providers.base import DownReport, Provider
from orchestrator.spec import ClusterSpec


def for_spec(spec: ClusterSpec, spec_path: Path) -> Provider:
    """The provider named by ``spec.provider.kind``, imported only when used."""
    kind = spec.provider.kind
    if kind == "local":
        from orchestrator.providers.local import LocalProvider

        return LocalProvider(spec, spec_path)
    raise ProviderError(f"unknown provider kind {kind!r}", fix="use provider.kind: local")


__all__ = ["DownReport", "Provider", "for_spec"]
