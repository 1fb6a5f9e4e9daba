"""Where hosts come from: `local`, `static` and `gcp`; one module per provider, chosen by provider.kind."""

from __future__ import annotations

from pathlib import Path

from orchestrator.errors import ProviderError
from orchestrator.providers.base import DownReport, HostHealth, Provider
from orchestrator.spec import ClusterSpec


def for_spec(spec: ClusterSpec, spec_path: Path) -> Provider:
    """The provider named by ``spec.provider.kind``, imported only when used."""
    kind = spec.provider.kind
    if kind == "local":
        from orchestrator.providers.local import LocalProvider

        return LocalProvider(spec, spec_path)
    if kind == "static":
        from orchestrator.providers.static import StaticProvider

        return StaticProvider(spec, spec_path)
    if kind == "gcp":
        from orchestrator.providers.gcp.provider import GcpProvider

        return GcpProvider(spec, spec_path)
    raise ProviderError(f"unknown provider kind {kind!r}", fix="use provider.kind: local, static or gcp")


__all__ = ["DownReport", "HostHealth", "Provider", "for_spec"]
