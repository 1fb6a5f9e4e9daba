"""The cloud-neutral base of every provider whose hosts are reached over SSH (static, gcp): one
runner per host, waiting for SSH, each host's root, a JSON cache of the hosts, the cluster's key
pair, and preparing a host (code, worker package, setup) before it runs tasks."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import shlex
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import worker as worker_package
from orchestrator import paths
from orchestrator import spec as specs
from orchestrator.errors import AuthError, HostUnreachableError, ProviderError
from orchestrator.files import write_atomic
from orchestrator.hosts import Host, SSHEndpoint
from orchestrator.providers.base import Provider
from orchestrator.providers.keys import PRIVATE_NAME, KeyPair, ensure_key_pair, remove_key_pair
from orchestrator.remote.base import Runner, probe_argv
from orchestrator.remote.fanout import fan_out
from orchestrator.remote.ssh import SSHRunner
from orchestrator.remote.sync import sync_dir

SETUP_STAMP = ".orchestrate-setup"
FREE_PORTS_SOUGHT = 4  # per host: probing stops once this many free ports were seen
POLL_FIRST_S = 0.25
POLL_MAX_S = 5.0


class SSHHostsProvider(Provider):
    """A provider whose hosts are reached over SSH and prepared by ``prepare``.

    It keeps one runner per host name, always to the host as last reached (``remember``), and
    can save the hosts it reached to a JSON file that later commands read instead of asking again.
    """

    config: specs.SSHHosts  # set by the subclass to its own provider section of the spec
    host_noun = "host"  # how messages name one of the hosts
    ssh_fix = "check that this machine can reach the host's SSH port, then run 'orchestrate up' again"
    auth_fix: str | None = None  # when the host answers but refuses the key; None: the error's
    auth_patience_s = float("inf")  # how long a host may refuse the key before it is given up

    def __init__(self, spec: specs.ClusterSpec, spec_path: Path) -> None:
        super().__init__(spec, spec_path)
        self._known: dict[str, Host] = {}
        self._runners: dict[str, SSHRunner] = {}
        self._lock = threading.RLock()

    # -- runners ---------------------------------------------------------------------------
    @property
    def connect_deadline_s(self) -> float:
        """How long a runner of the provider retries connecting before the host counts as lost."""
        return 3 * self.config.connect_timeout_s

    def runner(self, host: Host) -> SSHRunner:
        """One runner per host, to the host as last reached (a repaired one may have moved)."""
        with self._lock:
            return self.runner_to(self._known.get(host.name, host))

    def runner_to(self, host: Host) -> SSHRunner:
        """The runner of ``host.name`` to exactly ``host``: replaced when its endpoint changed."""
        assert host.ssh is not None
        with self._lock:
            runner = self._runners.get(host.name)
            if runner is None or runner.endpoint != host.ssh:
                if runner is not None:
                    runner.close()
                runner = SSHRunner(host.name, host.ssh, connect_deadline_s=self.connect_deadline_s)
                self._runners[host.name] = runner
            return runner

    def drop_runner(self, name: str) -> None:
        """Close the runner of ``name`` (its connection died with the machine)."""
        with self._lock:
            runner = self._runners.pop(name, None)
        if runner is not None:
            runner.close()

    @contextlib.contextmanager
    def check_runners(self, hosts: Sequence[Host]) -> Iterator[Callable[[Host], Runner]]:
        """Runners of their own for one of ``hosts`` each, made here: a check gives a host one
        connect timeout (not the provider's patience with a booting machine); closed on exit."""
        own: dict[str, SSHRunner] = {}
        for host in hosts:
            assert host.ssh is not None
            own.setdefault(host.name, SSHRunner(host.name, host.ssh,
                                                connect_deadline_s=host.ssh.connect_timeout_s))
        try:
            yield lambda host: own[host.name]
        finally:
            for runner in own.values():
                runner.close()

    def close(self) -> None:
        with self._lock:
            runners = list(self._runners.values())
            self._runners.clear()
        for runner in runners:
            runner.close()

    # -- reaching a host -------------------------------------------------------------------
    def wait_for_ssh(self, host: Host, deadline: float) -> SSHRunner:
        """The runner of ``host`` once a command runs there: a booting machine refuses
        connections, then our key, until its SSH server (or guest agent) is ready.

        Raises:
            ProviderError: it does not answer by ``deadline`` (a ``time.monotonic()`` value).
        """
        runner = self.runner_to(host)
        wait = POLL_FIRST_S
        refused_since: float | None = None  # the host answers and refuses the key, since then
        while True:
            try:
                runner.run(["true"], timeout_s=30)
                return runner
            except HostUnreachableError as exc:
                refused_since = None
                if time.monotonic() > deadline:
                    raise ProviderError(
                        f"{self.host_noun} {host.name} does not accept SSH in time: {exc.message}",
                        fix=self.ssh_fix) from exc
            except AuthError as exc:
                now = time.monotonic()
                refused_since = now if refused_since is None else refused_since
                if now > deadline or now - refused_since > self.auth_patience_s:
                    raise ProviderError(
                        f"{self.host_noun} {host.name} refuses the SSH key: {exc.message}",
                        fix=self.auth_fix or exc.fix or self.ssh_fix) from exc
            time.sleep(wait)
            wait = min(2 * wait, POLL_MAX_S)

    def resolve_root(self, host: Host) -> str:
        """The cluster's directory on ``host``: ``provider.root``, else one under the SSH user's
        home directory, which is asked for over SSH.

        Raises:
            ProviderError: the home directory is not absolute.
        """
        if self.config.root:
            return self.config.root
        home_dir = self.runner_to(host).run('printf %s "$HOME"').stdout.strip()
        if not home_dir.startswith("/"):
            raise ProviderError(f"{host.name}: the SSH user's home is {home_dir!r}, not absolute",
                                fix="set provider.root to an absolute directory")
        return paths.host_root(home_dir, self.spec.name)

    def planned_root(self, home_dir: str) -> str:
        """The root a dry run shows, ``home_dir`` standing for the SSH user's home directory."""
        return self.config.root or paths.host_root(home_dir, self.spec.name)

    # -- the hosts as last reached, cached in a JSON file ------------------------------------
    @property
    def hosts_file(self) -> Path:
        return paths.hosts_cache(self.spec.name, self.kind)

    def remember(self, host: Host) -> None:
        """``host`` as just reached: ``runner`` goes to it from now on, ``save_hosts`` writes it."""
        with self._lock:
            self._known[host.name] = host

    def remembered(self) -> dict[str, Host]:
        """The hosts as last reached, here or (read from the cache file) by an earlier command."""
        with self._lock:
            if not self._known:
                self.load_hosts()
            return dict(self._known)

    def save_hosts(self, names: Sequence[str], extra: Mapping[str, object] | None = None) -> None:
        """Write the remembered hosts of ``names``, in that order, and ``extra`` to the file."""
        with self._lock:
            hosts = [self._known[n] for n in names if n in self._known]
        self.hosts_file.parent.mkdir(parents=True, exist_ok=True)
        document = {"hosts": [host_to_json(h) for h in hosts], **(extra or {})}
        write_atomic(self.hosts_file, json.dumps(document, indent=1))

    def load_hosts(self) -> None:
        """Remember the hosts of the file; none when it is missing or unreadable."""
        try:
            records = json.loads(self.hosts_file.read_text())["hosts"]
            hosts = [self.restored(host_from_json(r)) for r in records]
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return
        with self._lock:
            self._known.update({h.name: h for h in hosts})

    def restored(self, host: Host) -> Host:
        """A host read from the file, as the spec says it is reached now; default: as saved."""
        return host

    def forget_hosts(self) -> None:
        with self._lock:
            self._known.clear()
        self.hosts_file.unlink(missing_ok=True)

    # -- the cluster's own key pair ----------------------------------------------------------
    def key_pair(self) -> KeyPair:
        """The cluster's key pair, made on first use, for machines the provider makes."""
        return ensure_key_pair(paths.key_dir(self.spec.name))

    @property
    def key_file(self) -> str:
        """The private half of ``key_pair()``."""
        return str(paths.key_dir(self.spec.name) / PRIVATE_NAME)

    def remove_key_pair(self) -> None:
        remove_key_pair(paths.key_dir(self.spec.name))

    # -- preparing a host --------------------------------------------------------------------
    def python(self, host: Host) -> str:
        return self.config.python

    def prepare(self, host: Host) -> bool:
        """Sync the code and the worker package, run setup when it or the code changed.

        Idempotent: returns whether anything changed on the host.
        """
        runner = self.runner(host)
        workdir = specs.workdir_of(self.spec, self.spec_path)
        code_changed = sync_dir(runner, str(workdir), paths.code_dir(host.root), self.config.sync_excludes)
        lib_changed = sync_dir(runner, str(Path(worker_package.__file__).parent),
                               f"{paths.lib_dir(host.root)}/worker", ("__pycache__", "*.pyc"))
        setup = self.config.setup
        stamp = hashlib.sha256("\n".join(setup).encode()).hexdigest()
        stamp_path = shlex.quote(f"{host.root}/{SETUP_STAMP}")
        current = runner.run(f"cat {stamp_path} 2>/dev/null || true").stdout.strip()
        if not setup or (current == stamp and not code_changed):
            return code_changed or lib_changed
        code_dir = shlex.quote(paths.code_dir(host.root))
        for command in setup:
            # Setup commands are the user's own shell, run as written in the synced code dir.
            runner.run(f"cd {code_dir} && {command}", timeout_s=3600)
        runner.run(f"echo {stamp} > {stamp_path}")
        return True

    def prepare_all(self, hosts: Sequence[Host]) -> None:
        """``prepare`` every host in parallel.

        Raises:
            RemoteError: naming every host that failed, and why.
        """
        fan_out(hosts, self.prepare, name_of=lambda h: h.name).raise_if_failed("prepare hosts")

    def busy_ports(self, hosts: Sequence[Host]) -> set[tuple[str, int]]:
        """(address, port) pairs of the spec's range taken on each host, probed in parallel."""
        ports = self.spec.ports

        def probe(host: Host) -> list[int]:
            argv = probe_argv(self.python(host), "ports", str(ports.start), str(ports.end),
                              str(FREE_PORTS_SOUGHT))
            return [int(p) for p in self.runner(host).run(argv, timeout_s=30).stdout.split()]

        result = fan_out(hosts, probe, name_of=lambda h: h.name)
        by_name = {h.name: h for h in hosts}
        return {(by_name[r.name].address, p) for r in result.succeeded for p in r.value or []}


def host_to_json(host: Host) -> dict[str, Any]:
    return dataclasses.asdict(host)


def host_from_json(record: Mapping[str, Any]) -> Host:
    if "ssh" not in record and "ssh_address" in record:  # the gcp cache of earlier versions
        return Host(name=record["name"], address=record["address"], root=record["root"],
                    ssh=SSHEndpoint(address=record["ssh_address"], user="",
                                    host_keys=tuple(record["host_keys"])),
                    labels=(("zone", record["zone"]),))
    ssh = record["ssh"]
    endpoint = None if ssh is None else SSHEndpoint(**{**ssh, "host_keys": tuple(ssh["host_keys"])})
    return Host(name=record["name"], address=record["address"], root=record["root"], ssh=endpoint,
                task_port=record["task_port"], labels=tuple((k, v) for k, v in record["labels"]))
