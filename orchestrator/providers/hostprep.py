"""What every SSH-reached host needs before it runs tasks, shared by the static and gcp providers."""

from __future__ import annotations

import hashlib
import shlex
from collections.abc import Callable, Sequence
from pathlib import Path

import worker as worker_package
from orchestrator import spec as specs
from orchestrator.hosts import Host
from orchestrator.providers.base import Provider
from orchestrator.remote.base import Runner
from orchestrator.remote.fanout import fan_out
from orchestrator.remote.sync import sync_dir
from orchestrator.spec import PortRange

SETUP_STAMP = ".orchestrate-setup"
PORT_PROBE = (
    "import socket, sys\n"
    "start, end, want = map(int, sys.argv[1:4])\n"
    "free = 0\n"
    "for port in range(start, end + 1):\n"
    "    if free >= want:\n"
    "        break\n"
    "    s = socket.socket()\n"
    "    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does: TIME_WAIT is free\n"
    "    try:\n"
    "        s.bind(('', port)); free += 1\n"
    "    except OSError:\n"
    "        print(port)\n"
    "    finally:\n"
    "        s.close()\n"
)


def prepare(runner: Runner, host: Host, *, workdir: Path, excludes: Sequence[str],
            setup: Sequence[str]) -> bool:
    """Sync the code and the worker package, run setup when it or the code changed.

    Idempotent: returns whether anything changed on the host.
    """
    code_changed = sync_dir(runner, str(workdir), f"{host.root}/code", excludes)
    lib_changed = sync_dir(runner, str(Path(worker_package.__file__).parent),
                           f"{host.root}/lib/worker", ("__pycache__", "*.pyc"))
    stamp = hashlib.sha256("\n".join(setup).encode()).hexdigest()
    stamp_path = shlex.quote(f"{host.root}/{SETUP_STAMP}")
    current = runner.run(f"cat {stamp_path} 2>/dev/null || true").stdout.strip()
    if not setup or (current == stamp and not code_changed):
        return code_changed or lib_changed
    code_dir = shlex.quote(f"{host.root}/code")
    for command in setup:
        # Setup commands are the user's own shell, run as written in the synced code dir.
        runner.run(f"cd {code_dir} && {command}", timeout_s=3600)
    runner.run(f"echo {stamp} > {stamp_path}")
    return True


def busy_ports(hosts: Sequence[Host], runner_for: Callable[[Host], Runner], python: str,
               ports: PortRange) -> set[tuple[str, int]]:
    """(address, port) pairs of the range that are taken on each host, probed in parallel."""
    def probe(host: Host) -> list[int]:
        argv = [python, "-c", PORT_PROBE, str(ports.start), str(ports.end), "4"]
        return [int(p) for p in runner_for(host).run(argv, timeout_s=30).stdout.split()]

    result = fan_out(hosts, probe, name_of=lambda h: h.name)
    by_name = {h.name: h for h in hosts}
    return {(by_name[r.name].address, p) for r in result.succeeded for p in r.value or []}


class SSHHostsProvider(Provider):
    """A provider whose hosts are reached over SSH and prepared by ``prepare``."""

    config: specs.SSHHosts  # set by the subclass to its own provider section of the spec

    def python(self, host: Host) -> str:
        return self.config.python

    def prepare(self, host: Host) -> bool:
        """Idempotent: returns whether anything changed on the host."""
        return prepare(self.runner(host), host,
                       workdir=specs.workdir_of(self.spec, self.spec_path),
                       excludes=self.config.sync_excludes, setup=self.config.setup)

    def busy_ports(self, hosts: Sequence[Host]) -> set[tuple[str, int]]:
        return busy_ports(hosts, self.runner, self.config.python, self.spec.ports)
