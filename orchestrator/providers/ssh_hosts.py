"""The cloud-neutral base of every provider whose hosts are reached over SSH (static, gcp): one
runner per host, waiting for SSH, each host's root, a JSON cache of the hosts, the cluster's key
pair, and preparing a host (code, worker package, setup) before it runs tasks."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import hashlib
import json
import posixpath
import select
import shlex
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import worker as worker_package
from orchestrator import early_claim, paths
from orchestrator import spec as specs
from orchestrator.errors import AuthError, HostUnreachableError, ProviderError
from orchestrator.files import private_dir, write_atomic
from orchestrator.hosts import Host, SSHEndpoint
from orchestrator.providers.base import Provider
from orchestrator.providers.keys import PRIVATE_NAME, KeyPair, ensure_key_pair, remove_key_pair
from orchestrator.remote.base import Runner, probe_argv, quote_argv
from orchestrator.remote.fanout import fan_out
from orchestrator.remote.ssh import SSHRunner
from orchestrator.remote.sync import (
    Packer,
    Upload,
    read_stamps,
    stamps_script,
    sync_dir,
    upload_of,
)

SETUP_STAMP = ".orchestrate-setup"
SYNC_DIGESTS = "sync-digests.json"  # under the cluster's home here: the digests of trees packed (Packer)
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
    homes_recorded = False  # whether ``up`` records each SSH user's home for the next command

    def __init__(self, spec: specs.ClusterSpec, spec_path: Path) -> None:
        super().__init__(spec, spec_path)
        self._known: dict[str, Host] = {}
        self._runners: dict[str, SSHRunner] = {}
        self._homes: dict[str, str] = {}  # the SSH user's $HOME on each host, once asked
        self._expected_homes: dict[str, str] = {}  # ... as recorded: checked by claim_root
        self._root_notes: list[str] = []  # what ``up`` found of the roots, for ``notes()``
        # Each host's commands a next command may run early (early_claim): the claim first
        self._repeatable: dict[str, tuple[SSHEndpoint, list[str]]] = {}
        self._up_hosts: list[str] = []  # the hosts of this command's ``up``
        self._remember_lock = threading.Lock()
        self._upload: Upload | None = None
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
                early = early_claim.runner(self.spec_path, host.name, host.ssh)
                if early is not None:  # its early launches are taken where byte-identical
                    early.early_start = functools.partial(early_claim.launched, self.spec_path,
                                                          host.name, host.ssh)
                    runner = early
                else:  # another endpoint: what started early there is stopped
                    early_claim.void(self.spec_path, host.name, wait=False)
                    runner = SSHRunner(host.name, host.ssh,
                                       connect_deadline_s=self.connect_deadline_s)
                runner.connect_deadline_s = self.connect_deadline_s
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
            return paths.normalise_root(self.config.root)
        home_dir = self.home_of(host)
        if not home_dir.startswith("/"):
            raise ProviderError(f"{host.name}: the SSH user's home is {home_dir!r}, not absolute",
                                fix="set provider.root to an absolute directory")
        return paths.host_root(home_dir, self.spec.name)

    def planned_root(self, home_dir: str) -> str:
        """The root a dry run shows, ``home_dir`` standing for the SSH user's home directory."""
        if self.config.root:
            return paths.normalise_root(self.config.root)
        return paths.host_root(home_dir, self.spec.name)

    def home_of(self, host: Host) -> str:
        """The SSH user's home directory on ``host``, asked once."""
        with self._lock:
            known = self._homes.get(host.name)
        if known is None:
            known = self.runner_to(host).run('printf %s "$HOME"').stdout.strip()
            with self._lock:
                self._homes[host.name] = known
        return known

    # -- the root: made and marked by ``up``, deleted by ``down`` only when marked -----------
    def unsafe_root(self, host: Host) -> str | None:
        """Why ``host.root`` may not be a cluster's directory (``paths.unsafe_root``), with the
        SSH user's home on the host; None when it may."""
        return paths.unsafe_root(host.root, self.home_of(host))

    def claim_root(self, host: Host, trees: Sequence[str] = (),
                   files: Sequence[str] = ()) -> list[str]:
        """Make the root (0700) and mark it as this cluster's; a root that already existed is
        used as it is and left unmarked (``down`` then leaves it), unless it is the default one
        under ``~/.orchestrate``, which is orchestrate's own. In the same command, once the
        root is ours, the stamps of ``trees`` and the first lines of ``files`` are read and
        returned (``sync.stamps_script``: "" for each where none could be read); and where an
        earlier command recorded the SSH user's home (``expect_homes``), it is checked there
        rather than asked first: one round trip in all.

        Raises:
            ProviderError: the root is unsafe, not a directory, or another cluster's.
        """
        with self._lock:
            home = self._homes.get(host.name)
            expected = None if home is not None else self._expected_homes.pop(host.name, None)
        home = home or expected or self.home_of(host)
        self._refuse_root(host, paths.unsafe_root(host.root, home))
        ours = _claimed(self.spec.name)
        script = self._claim_command(host, home, trees, files, expected)
        reads = len(trees) + len(files)
        runner = self.runner(host)
        endpoint = _endpoint_of(runner)
        answer = None if endpoint is None else early_claim.answer(self.spec_path, host.name,
                                                                  endpoint, script)
        if answer is None:
            answer = runner.run(script).stdout
        first, _, rest = answer.partition("\n")
        if first == "home-changed":  # asked now, and checked again with the home it has now
            return self.claim_root(host, trees, files)
        with self._lock:
            self._homes[host.name] = home
        found, _, owner = (first if first in ours else answer.strip()).partition(" ")
        if found == "not-a-directory":
            raise ProviderError(f"{host.name}: provider.root {host.root} exists and is not a "
                                "directory", fix="point provider.root at a directory, or remove "
                                "what is there")
        if found == "marked" and owner != self.spec.name:
            raise ProviderError(
                f"{host.name}: provider.root {host.root} belongs to cluster {owner!r} (its "
                f"{paths.ROOT_MARKER} says so)",
                fix=f"give each cluster a provider.root of its own, or take {owner!r} down first")
        # The next command's claim, as it will build it (early_claim runs it while it imports)
        ahead = self._claim_command(host, home, trees, files, home if self.homes_recorded else None)
        if endpoint is not None:
            self._note_repeatable(host.name, endpoint, ahead, claim=True)
        if found == "foreign":
            with self._lock:
                self._root_notes.append(
                    f"{host.name}: {host.root} existed before 'up', which did not make it: "
                    "'down' will leave it and what 'up' put in it (code, lib, runs)")
        return read_stamps(rest, reads) if reads else []

    def _claim_command(self, host: Host, home: str, trees: Sequence[str], files: Sequence[str],
                       expected: str | None) -> str:
        """``claim_root``'s one command: the claim, then the reads once the root is ours; where
        the SSH user's home is ``expected``, all of it only if the home is still that."""
        adopt = host.root == paths.host_root(home, self.spec.name)
        script = _claim_script(host.root, self.spec.name, adopt)
        if trees or files:  # a failed mkdir of the trees' parents prints no stamp: "" for each
            patterns = "|".join(shlex.quote(answer) for answer in _claimed(self.spec.name))
            script = (f"a=$({script}) || exit 1; printf '%s\\n' \"$a\"; "
                      f"case \"$a\" in {patterns}) ({stamps_script(trees, files)}) || :;; esac")
        if expected is not None:
            script = (f"if [ \"$HOME\" != {shlex.quote(expected)} ]; then echo home-changed; "
                      f"else {script}; fi")
        return script

    def expect_homes(self, homes: Mapping[str, str]) -> None:
        """The SSH user's home on each named host, as an earlier command found it: the root's
        claim checks it on the host (``claim_root``) instead of asking for it first."""
        with self._lock:
            self._expected_homes.update({n: h for n, h in homes.items() if h.startswith("/")})

    def known_home(self, name: str) -> str | None:
        """The SSH user's home on host ``name``: as found on it by this command, else as
        recorded (``expect_homes``); None when neither knows it."""
        with self._lock:
            return self._homes.get(name) or self._expected_homes.get(name)

    def _refuse_root(self, host: Host, why: str | None) -> None:
        if why is not None:
            raise ProviderError(
                f"{host.name}: provider.root {host.root} is {why}: 'down' deletes the root 'up' "
                "made, so it must be a directory of this cluster's own",
                fix=f"set provider.root to a new directory for this cluster (e.g. "
                f"/srv/orchestrate/{self.spec.name}), or leave it out: the default is "
                f"~/.orchestrate/clusters/{self.spec.name}")

    def remove_root(self, host: Host) -> tuple[bool, str]:
        """Delete the root if ``up`` made it for this cluster (its marker names it): checked
        and deleted in one command. Returns whether it was, and what to tell the user."""
        why = self.unsafe_root(host)
        if why is not None:
            return False, (f"{host.name}: {host.root} not removed: provider.root is {why}; "
                           "remove what is yours in it by hand")
        answer = self.runner(host).run(_remove_script(host.root, self.spec.name)).stdout
        found, _, owner = answer.strip().partition(" ")
        reasons = {
            "removed": "",
            "absent": "not there (already removed)",
            "symlink": "it is a symbolic link, which 'up' never makes",
            "not-a-directory": "it is not a directory",
            "unmarked": f"no {paths.ROOT_MARKER} marker of cluster {self.spec.name!r} in it "
                        "('up' did not make it); remove it by hand if it is yours",
            "marked": f"its {paths.ROOT_MARKER} names cluster {owner!r}, not "
                      f"{self.spec.name!r}",
        }
        reason = reasons.get(found, f"unexpected answer {answer.strip()[:200]!r}")
        if found == "removed":
            return True, f"{host.name}:{host.root}"
        return False, f"{host.name}: {host.root} not removed: {reason}"

    # -- the hosts as last reached, cached in a JSON file ------------------------------------
    @property
    def hosts_file(self) -> Path:
        return paths.hosts_cache(self.spec.name, self.kind)

    def remember(self, host: Host) -> None:
        """``host`` as just reached: ``runner`` goes to it from now on, ``save_hosts`` writes it."""
        with self._lock:
            self._known[host.name] = host

    def forget(self, name: str) -> None:
        """``name`` is no host of the cluster's any more (``save_hosts`` leaves it out)."""
        with self._lock:
            self._known.pop(name, None)

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
        private_dir(self.hosts_file.parent)
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
        early_claim.forget(self.spec_path)

    def remember_claims(self, hosts: Sequence[Host]) -> None:
        """``hosts`` are this command's, all claimed: keep their repeatable commands for the
        next command's early claim (``orchestrator/early_claim.py``)."""
        with self._lock:
            self._up_hosts = [h.name for h in hosts]
        self._remember()

    def early_run_id(self) -> str | None:
        return early_claim.run_id(self.spec_path)

    def remember_launches(self, run_id: str, scripts: dict[str, list[tuple[str, list[str]]]],
                          run_dirs: dict[str, str]) -> None:
        """Keep them for the next ``train`` where its hosts' claims are kept (its own are
        the ones the launches follow), else keep none."""
        with self._lock:
            claimed = set(self._up_hosts) == set(scripts) and all(
                n in self._repeatable for n in scripts)
        if claimed:
            early_claim.remember_launches(self.spec_path, run_id, scripts, run_dirs,
                                          _claimed(self.spec.name))
        else:
            early_claim.forget_launches(self.spec_path)

    def run_repeatable(self, host: Host, argv: Sequence[str], timeout_s: float) -> str:
        """What ``argv`` prints on ``host``: a command that only reads, which the next command
        of this spec may run early (its answer, where it ran so, is taken)."""
        runner = self.runner(host)
        script = quote_argv(argv)
        endpoint = _endpoint_of(runner)
        if endpoint is None:
            return runner.run(script, timeout_s=timeout_s).stdout
        found = early_claim.answer(self.spec_path, host.name, endpoint, script)
        if found is None:
            found = runner.run(script, timeout_s=timeout_s).stdout
        self._note_repeatable(host.name, endpoint, script)
        return found

    def _note_repeatable(self, name: str, endpoint: SSHEndpoint, script: str,
                         claim: bool = False) -> None:
        with self._lock:
            known, scripts = self._repeatable.get(name) or (endpoint,
                                                             early_claim.kept(self.spec_path, name, endpoint))
            scripts = list(scripts) if known == endpoint else []
            if claim:
                scripts = [script, *scripts[1:]] if scripts else [script]
            elif not scripts:
                return  # none before the claim: the root is claimed first
            elif script not in scripts:
                scripts.append(script)
            changed = self._repeatable.get(name) != (endpoint, scripts)
            self._repeatable[name] = (endpoint, scripts)
        if changed and not claim:
            self._remember()

    def _remember(self) -> None:
        # One writer at a time, each with what is known when it writes: the last write is the
        # newest (the hosts' reads are noted from threads of their own)
        with self._remember_lock:
            with self._lock:
                names = list(self._up_hosts)
                kept = [(n, *self._repeatable[n]) for n in names if n in self._repeatable]
            if not names:
                return
            if len(kept) == len(names):
                early_claim.remember(self.spec_path, kept)
            else:
                early_claim.forget(self.spec_path)

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

    def upload(self) -> Upload:
        """What ``up`` sends of the workdir to each host (``sync.upload_of``, surveyed once),
        checked.

        Raises:
            SpecError: the workdir is ``/`` or a home directory, and the spec does not allow it.
            RemoteError: it is over the size limit.
        """
        if self._upload is None:
            self._upload = upload_of(specs.workdir_of(self.spec, self.spec_path), self.config)
        self._upload.check(self.spec_path)
        return self._upload

    def prepare(self, host: Host, packer: Packer | None = None) -> bool:
        """Make and mark the root, sync the code and the worker package, run setup when it or
        the code changed (``packer``: the archives shared by the hosts prepared together).
        What the host holds (both trees' stamps and setup's) is read in one command.

        Idempotent: returns whether anything changed on the host.
        """
        runner = self.runner(host)
        code, lib, setup = self.claim_root(host, self.trees(host.root),
                                           [self.setup_stamp_path(host.root)])
        code_changed, lib_changed = self.sync_code(runner, host.root, packer, (code, lib))
        return self.run_setup(runner, runner, host.root, code_changed, setup) or code_changed \
            or lib_changed

    def packer(self) -> Packer:
        """The archives of one sync to this cluster's hosts; a tree this machine packed before,
        unchanged since, is known by its digest without being packed again."""
        return Packer(paths.cluster_home(self.spec.name) / SYNC_DIGESTS)

    @staticmethod
    def trees(root: str) -> tuple[str, str]:
        """Where the workdir and the worker package go under ``root``."""
        return paths.code_dir(root), f"{paths.lib_dir(root)}/worker"

    @staticmethod
    def setup_stamp_path(root: str) -> str:
        """The file that says which setup last ran under ``root`` (its digest)."""
        return f"{root}/{SETUP_STAMP}"

    def sync_code(self, runner: Runner, root: str, packer: Packer | None = None,
                  stamps: tuple[str, str] | None = None) -> tuple[bool, bool]:
        """Sync the workdir and the worker package under ``root``; whether each changed
        (``stamps``: what ``remote_stamps`` read of both trees, when it was read already)."""
        workdir = specs.workdir_of(self.spec, self.spec_path)
        code_dir, lib_dir = self.trees(root)
        code, lib = stamps or (None, None)
        packs = packer or self.packer()
        try:
            code_changed = sync_dir(runner, str(workdir), code_dir, self.config.sync_excludes,
                                    allowed_secrets=self.upload().allowed_secrets, packer=packs,
                                    stamp=code)
            lib_changed = sync_dir(runner, str(Path(worker_package.__file__).parent), lib_dir,
                                   ("__pycache__", "*.pyc"), packer=packs, stamp=lib)
        finally:
            if packer is None:
                packs.close()
        return code_changed, lib_changed

    def run_setup(self, files: Runner, runner: Runner, root: str, code_changed: bool,
                  current: str | None = None) -> bool:
        """Run ``setup`` through ``runner`` when it or the code changed since it last ran (its
        stamp under ``root``, read and written through ``files``, unless ``current`` is what
        was read already); whether it ran."""
        setup = self.config.setup
        stamp = hashlib.sha256("\n".join(setup).encode()).hexdigest()
        stamp_path = shlex.quote(self.setup_stamp_path(root))
        if current is None:
            current = files.run(f"cat {stamp_path} 2>/dev/null || true").stdout.strip()
        if not setup or (current == stamp and not code_changed):
            return False
        code_dir = shlex.quote(paths.code_dir(root))
        for command in setup:
            # Setup commands are the user's own shell, run as written in the synced code dir.
            runner.run(f"cd {code_dir} && {command}", timeout_s=3600)
        files.run(f"echo {stamp} > {stamp_path}")
        return True

    def prepare_all(self, hosts: Sequence[Host]) -> None:
        """``prepare`` every host in parallel.

        Raises:
            SpecError: the workdir may not be uploaded (``upload``).
            RemoteError: naming every host that failed, and why.
        """
        self.upload()
        for host in hosts:  # what needs no host's home, before any is touched
            self._refuse_root(host, paths.unsafe_root(host.root))
        private_dir(paths.cluster_home(self.spec.name))
        packer = self.packer()  # every tree packed once at most, for all the hosts
        try:
            prepared = fan_out(hosts, lambda h: self.prepare(h, packer), name_of=lambda h: h.name)
        finally:
            packer.close()
        if any(prepared.values().values()) or prepared.failed:
            # the code, the worker or setup changed: a task started early may hold the old one
            early_claim.void(self.spec_path)
        prepared.raise_if_failed("prepare hosts")

    def notes(self) -> list[str]:
        with self._lock:
            return list(self._root_notes)

    def busy_ports(self, hosts: Sequence[Host]) -> set[tuple[str, int]]:
        """(address, port) pairs of the spec's range taken on each host, probed in parallel."""
        ports = self.spec.ports

        def probe(host: Host) -> list[int]:
            argv = probe_argv(self.python(host), "ports", str(ports.start), str(ports.end),
                              str(FREE_PORTS_SOUGHT))
            return [int(p) for p in self.run_repeatable(host, argv, timeout_s=30).split()]

        result = fan_out(hosts, probe, name_of=lambda h: h.name)
        by_name = {h.name: h for h in hosts}
        return {(by_name[r.name].address, p) for r in result.succeeded for p in r.value or []}


def _endpoint_of(runner: Runner) -> SSHEndpoint | None:
    """Where ``runner`` goes over SSH; None for another kind of runner (a test's, this
    machine's), whose commands are never run early."""
    return runner.endpoint if isinstance(runner, SSHRunner) else None


def _claimed(cluster: str) -> tuple[str, ...]:
    """What ``_claim_script`` prints when the root is ``cluster``'s to use."""
    return "created", "adopted", "foreign", f"marked {cluster}"


def _claim_script(root: str, cluster: str, adopt: bool) -> str:
    """Make ``root`` (umask 077) and mark it; print created, adopted, marked OWNER, foreign (it
    existed, unmarked: left so) or not-a-directory. ``adopt`` marks an existing unmarked one."""
    r, m = shlex.quote(root), shlex.quote(f"{root}/{paths.ROOT_MARKER}")
    parent = shlex.quote(posixpath.dirname(root) or "/")
    mark = f"printf '%s\\n' {shlex.quote(cluster)} >{m}.tmp && mv -f -- {m}.tmp {m}"
    return (
        f"umask 077; mkdir -p -- {parent} || exit 1; "
        f"if mkdir -- {r} 2>/dev/null; then {mark} && echo created; "
        f"elif [ ! -d {r} ]; then echo not-a-directory; "
        f"elif [ -f {m} ] && [ ! -L {m} ]; then printf 'marked %s\\n' \"$(head -c 200 -- {m})\"; "
        f"elif [ -L {r} ]; then echo foreign; "
        + (f"else {mark} && echo adopted; fi" if adopt else "else echo foreign; fi")
    )


def _remove_script(root: str, cluster: str) -> str:
    """Delete ``root`` only if it is a directory (not a link) whose marker names ``cluster``;
    print removed, absent, symlink, not-a-directory, unmarked or marked OWNER."""
    r, m = shlex.quote(root), shlex.quote(f"{root}/{paths.ROOT_MARKER}")
    return (
        f"if [ ! -e {r} ] && [ ! -L {r} ]; then echo absent; "
        f"elif [ -L {r} ]; then echo symlink; "
        f"elif [ ! -d {r} ]; then echo not-a-directory; "
        f"elif [ ! -f {m} ] || [ -L {m} ]; then echo unmarked; "
        f"elif [ \"$(head -c 200 -- {m})\" != {shlex.quote(cluster)} ]; then "
        f"printf 'marked %s\\n' \"$(head -c 200 -- {m})\"; "
        f"else rm -rf -- {r} && echo removed; fi"
    )


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
                task_port=record["task_port"], labels=tuple((k, v) for k, v in record["labels"]),
                node=record.get("node"), shared_fs=bool(record.get("shared_fs", False)),
                ephemeral=bool(record.get("ephemeral", False)))


def port_opens(address: str, port: int, deadline: float, every_s: float = POLL_FIRST_S) -> bool:
    """Whether a TCP connection to ``address:port`` opens before ``deadline`` (a
    ``time.monotonic()`` value), tried afresh every ``every_s``.

    One connect begun while a host was cut off waits for the kernel to resend its SYN (after
    1 s, then 3 s, 7 s): a host back in between is seen up to seconds late. Here a new connect
    starts every ``every_s`` and the earlier ones stay open (up to 16, the oldest dropped),
    so a host is seen within ``every_s`` of its return and a slow link still gets whole round
    trips. Nothing is sent: each socket is closed once it has connected.
    """
    pending: list[socket.socket] = []
    try:
        while True:
            now = time.monotonic()
            if now >= deadline:
                return False
            with contextlib.suppress(OSError):
                infos = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
                sock = socket.socket(infos[0][0], socket.SOCK_STREAM)
                sock.setblocking(False)
                if sock.connect_ex(infos[0][4]) in (0, *_IN_PROGRESS):
                    pending.append(sock)
                else:  # refused or unreachable at once: try again next round
                    sock.close()
            if len(pending) > 16:
                pending.pop(0).close()
            _, writable, _ = select.select([], pending, [], min(every_s, deadline - now))
            for sock in writable:
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                    return True
                pending.remove(sock)
                sock.close()
            time.sleep(max(0.0, every_s - (time.monotonic() - now)))
    finally:
        for sock in pending:
            sock.close()


_IN_PROGRESS = (errno.EINPROGRESS, errno.EALREADY, errno.EWOULDBLOCK)
