"""Typed records of the machines a cluster runs on, shared by providers, plan and remote."""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SSHEndpoint:
    """How to reach a host over SSH.

    ``host_keys`` are OpenSSH public-key lines (``ssh-ed25519 AAAA...``) the host
    must present; with none, ``known_hosts`` is consulted; with neither, the
    connection is refused unless ``trust_on_first_use`` is set.
    """

    address: str
    user: str
    port: int = 22
    key_file: str | None = None
    host_keys: tuple[str, ...] = ()
    known_hosts: str | None = None
    trust_on_first_use: bool = False
    connect_timeout_s: float = 10.0

    @classmethod
    def from_json(cls, fields: dict[str, Any]) -> SSHEndpoint:
        """The endpoint ``dataclasses.asdict`` wrote as JSON (its host keys a list)."""
        return cls(**{**fields, "host_keys": tuple(str(k) for k in fields["host_keys"])})


@dataclass(frozen=True)
class Host:
    """One machine of a cluster.

    ``address`` is where the other tasks reach this host's gRPC port; ``root`` is
    the directory on the host that holds everything of this cluster (absolute,
    or relative to the SSH user's home). ``ssh`` is None for this machine.
    ``task_port`` pins the gRPC port (e.g. one a firewall opens); otherwise the
    plan picks one from the spec's range.

    A scheduler places a host's task on one of its machines (``node``: a Slurm node's name);
    ``ssh`` then reaches the machine the scheduler is driven from (a login node), not the
    host, and the task's files are on a file system every node shares (``shared_fs``: the
    ``root`` is the same directory on every host of the cluster). An ``ephemeral`` host's
    files are gone with its task (a pod without a volume): what must outlive the task (the
    final model) goes next to the checkpoints, in ``checkpoint.dir``'s bucket.
    """

    name: str
    address: str
    root: str
    ssh: SSHEndpoint | None = None
    task_port: int | None = None
    labels: tuple[tuple[str, str], ...] = field(default=())
    node: str | None = None
    shared_fs: bool = False
    ephemeral: bool = False

    @property
    def is_local(self) -> bool:
        """Whether the host is this machine (its files are this machine's)."""
        return self.ssh is None and self.node is None

    @property
    def machine(self) -> str:
        """Identifies the physical machine: hosts that share it share this string."""
        if self.node is not None:
            return f"node:{self.node}"
        return machine_id(self.ssh.address, self.ssh.port) if self.ssh else machine_id(None)

    def label(self, key: str) -> str | None:
        """The value of label ``key``, None without it."""
        return dict(self.labels).get(key)


def machine_id(ssh_address: str | None, ssh_port: int = 22) -> str:
    """The machine SSH reaches at ``ssh_address`` (None: this one), as :attr:`Host.machine`."""
    if ssh_address is None or is_loopback(ssh_address):
        return "this-machine"
    return host_port(ssh_address, ssh_port)


def host_port(address: str, port: int) -> str:
    """``address:port``, with an IPv6 address in brackets: ``[fd00::2]:23456``."""
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def is_loopback(address: str) -> bool:
    """True for 127.0.0.0/8, ::1 and 'localhost'."""
    if address.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def one_per_machine(hosts: Sequence[Host]) -> list[Host]:
    """The first host of each machine, in order: for what is done once per machine (the
    container engine's images and containers are the machine's, not a task's)."""
    machines: dict[str, Host] = {}
    for host in hosts:
        machines.setdefault(host.machine, host)
    return list(machines.values())
