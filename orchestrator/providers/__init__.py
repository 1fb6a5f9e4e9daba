"""Where hosts come from (`local`, `static`, `gcp`, `slurm`, `kubernetes`): one module each,
by provider.kind."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

from orchestrator import spec as specs
from orchestrator.errors import ProviderError
from orchestrator.providers.base import DownReport, HostHealth, Provider
from orchestrator.spec import ClusterSpec


@dataclass(frozen=True)
class Registered:
    """One provider: its section of the spec, and its class, imported only when used (the gcp
    one loads google-cloud-compute, which takes seconds)."""

    model: type[specs.Model]
    class_path: str  # "package.module:Class"

    def load(self) -> type[Provider]:
        module, name = self.class_path.split(":")
        cls: type[Provider] = getattr(importlib.import_module(module), name)
        return cls


REGISTRY: dict[str, Registered] = {
    "local": Registered(specs.LocalProvider, "orchestrator.providers.local:LocalProvider"),
    "static": Registered(specs.StaticProvider, "orchestrator.providers.static:StaticProvider"),
    "gcp": Registered(specs.GcpProvider, "orchestrator.providers.gcp.provider:GcpProvider"),
    "slurm": Registered(specs.SlurmProvider, "orchestrator.providers.slurm:SlurmProvider"),
    "kubernetes": Registered(specs.KubernetesProvider,
                             "orchestrator.providers.kubernetes.provider:KubernetesProvider"),
}


def provider_class(kind: str) -> type[Provider]:
    """The class of the provider named ``kind``.

    Raises:
        ProviderError: no provider has that name.
    """
    registered = REGISTRY.get(kind)
    if registered is None:
        raise ProviderError(f"unknown provider kind {kind!r}",
                            fix=f"use provider.kind: {', '.join(REGISTRY)}")
    return registered.load()


def for_spec(spec: ClusterSpec, spec_path: Path) -> Provider:
    """The provider named by ``spec.provider.kind``, imported only when used."""
    return provider_class(spec.provider.kind)(spec, spec_path)


__all__ = ["REGISTRY", "DownReport", "HostHealth", "Provider", "Registered", "for_spec",
           "provider_class"]
