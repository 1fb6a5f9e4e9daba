"""pytest plugin: Kubernetes pods as real processes (a fake kubelet's container runtime).

Load it with ``pytest_plugins = [..., "podlab"]`` in tests/conftest.py. It provides the
session-scoped fixture ``podlab`` (a :class:`PodLab` with nodes ``node-1``..``node-3``) and
the function-scoped ``pods`` (the same lab; after the test every pod left is removed and
every node killed by the test is back)::

    def test_hello(pods: PodLab) -> None:
        pod = pods.run_pod(PodRun(name="w-0", namespace="default", node="node-1",
                                  command=("echo",), args=("hi",)))
        assert pod.wait(30).reason == "Completed"
        assert pod.log_path.read_text().endswith(" stdout F hi\n")

It knows nothing of the Kubernetes API: its caller (the fake API server's kubelet) resolves a
pod spec into a :class:`PodRun` (command, env, user, volumes as host directories, the DNS
names of peers as ``hosts_entries``) and reads back a :class:`PodProcess`'s ``ip``,
``log_path`` and ``state()``.

What a pod is here:

- network: a network namespace of its own (``<tag>n<k>``) with one veth (``eth0`` inside,
  ``<tag>h<kk>``, kk = k in hex, on the bridge of the lab's own :class:`hostlab.HostLab`), the address
  ``.k`` of the lab's /24 (k = 2..254; the bridge, reachable from this machine, is ``.1``
  and the pods' default route), ``lo`` up. Two pods (on one node or not) may listen on the
  same port. ``create_pod`` makes it, so ``ip`` is known before the container starts (the
  caller publishes DNS from it); ``remove_pod`` deletes it (the veth goes with it) and
  releases the address, which is handed out again only after every other free one (the
  least recently released first): unique for the lab's life up to 253 pods.
- names: ``/etc/hosts`` is a file of the pod's (kubelet's layout: localhost, then the pod's
  address with its FQDN ``hostname.subdomain.namespace.svc.cluster.local``, the shorter
  names the search path would complete (``pod_dns_names``) and its bare host name, then the
  caller's entries, name -> address);
  ``PodProcess.set_hosts_entries`` rewrites it in place while the pod runs (kubelet never
  does: a cluster DNS answers peers created later). ``/etc/resolv.conf`` has Kubernetes'
  search path and a name server on 127.0.0.1 where nothing listens: a name not in
  /etc/hosts fails at once. ``/etc/hostname`` holds the host name.
- the container: the shim ``tests/podshim.py`` (stdlib only, ``python -S``, as root; see its
  docstring) joins the network namespace and makes a PID namespace whose PID 1 is the
  command; that process gets mount, UTS (host name = ``hostname``) and IPC namespaces, a
  root file system that is an overlay of this machine's root (writes stay in a tmpfs of the
  pod, so mount points such as /orchestrate/code are made there, never on the host) plus the
  host's other top-level mounts bound as they are (writes there, and a mount point made
  under one, do reach the host), the host's /dev, fresh /proc, /sys, /dev/shm, the volumes
  bound at their paths (read-only ones remounted read-only), then ``chroot``, the working
  directory (made if missing, as runc does), ``run_as_user``/``run_as_group`` (no
  supplementary groups; the group defaults to the user's passwd group, else 0) and
  ``execvpe`` of ``command + args`` with exactly ``env`` plus what a runtime adds (``PATH``
  when not given, ``HOSTNAME``, ``HOME=/`` when not given). There is no image: a pod without
  ``command`` ends at once with exit code 128 and reason ``StartError``, as does one whose
  command cannot be executed.
- logs and status: the shim writes the CRI log (``log_path``, there from ``create_pod``) and
  ``status.json``; a container killed by signal N ends with exit code 128+N and ``signal``
  N. A PID 1 without a SIGTERM handler ignores SIGTERM (the kernel's rule for a namespace's
  init), so ``terminate`` kills it after the grace, as on a real node.
- ``hostlab.plain_user()`` (via ``PodLab.plain_user()``) is an unprivileged uid that may
  execute this run's Python (hostlab's ACL entries).

What a real kubelet and container runtime do that this does not: images (the container sees
this machine's files), cgroups and resource limits (so no OOMKilled), capabilities, seccomp
and AppArmor (a root container keeps every capability), user namespaces, the pause container
(the named network namespace holds the network instead), restarts (restartPolicy is the
caller's), probes, service environment variables (``KUBERNETES_SERVICE_HOST``...), log
rotation, supplementary groups from the image, ``fsGroup``, and a DNS server.

Everything the lab creates carries the owner's pid: its directory (``/tmp/podlab-<pid>-...``;
the shims' command lines name it), hostlab's names (``orch<pid><letter>...``: the pods'
namespaces match hostlab's stale-name pattern, and a veth goes with its namespace). A later
lab kills and removes what a lab whose pid is gone left. ``close()`` runs at exit and on
SIGTERM/SIGHUP as well. Where network namespaces are unavailable (or with
``ORCHESTRATE_LAB_FORCE_LOOPBACK=1``) the fixtures skip with the reason.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import hostlab
import pytest
from hostlab import HostLab, LabError

SHIM = Path(__file__).with_name("podshim.py")
NODES = ("node-1", "node-2", "node-3")
CLUSTER_DOMAIN = "cluster.local"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # containerd's
STALE_DIR = re.compile(r"^podlab-(\d+)-")
_OPEN_POD_LABS: set[PodLab] = set()


class PodLabError(LabError):
    """The pod lab could not create, run, stop or remove a pod."""


class PodLabUnavailable(PodLabError):
    """Pods cannot run here (no root, no network namespaces); the message says why."""


# -- what the caller gives and gets ---------------------------------------------------
@dataclass(frozen=True)
class HostPath:
    """A volume: a directory (or file) of this machine, bound at a mount path in the pod."""

    path: str
    read_only: bool = False


@dataclass(frozen=True)
class PodRun:
    """One pod with one container, resolved from its spec by the caller."""

    name: str
    namespace: str
    node: str
    command: Sequence[str] = ()  # the container's command (required: there is no image)
    args: Sequence[str] = ()
    hostname: str = ""  # default: name
    subdomain: str = ""  # with it, the FQDN hostname.subdomain.namespace.svc.cluster.local
    env: Mapping[str, str] = field(default_factory=dict)
    working_dir: str = "/"
    run_as_user: int | None = None  # None: root
    run_as_group: int | None = None  # None: the user's passwd group, else 0
    mounts: Mapping[str, HostPath] = field(default_factory=dict)  # mount path -> volume
    hosts_entries: Mapping[str, str] = field(default_factory=dict)  # DNS name -> address
    uid: str = ""  # the pod's UID, for its directory's name; default: a serial

    @property
    def host_name(self) -> str:
        return self.hostname or self.name


@dataclass(frozen=True)
class Waiting:
    """Not started yet."""

    reason: str  # ContainerCreating


@dataclass(frozen=True)
class Running:
    """Executing its command."""

    started_at: str  # RFC 3339, seconds


@dataclass(frozen=True)
class Terminated:
    """Ended; what its shim saw (``message``: why a StartError)."""

    exit_code: int  # 128+N when killed by signal N
    reason: str  # Completed (0), Error, StartError (128: not started)
    signal: int | None
    started_at: str
    finished_at: str
    message: str | None = None


ContainerState = Waiting | Running | Terminated


@dataclass(frozen=True)
class LabUser:
    """An unprivileged user of this machine (hostlab's plain user)."""

    name: str
    uid: int
    gid: int


def pod_dns_names(hostname: str, subdomain: str, namespace: str) -> list[str]:
    """The names a cluster DNS resolves to a pod's address, FQDN first: with a subdomain (a
    headless service), ``hostname.subdomain.namespace.svc.cluster.local`` and what Kubernetes'
    search path completes to it; none without. For the caller's ``hosts_entries`` of peers;
    a pod's own /etc/hosts line is these and its bare host name (as kubelet writes it)."""
    if not subdomain:
        return []
    base = f"{hostname}.{subdomain}"
    return [f"{base}.{namespace}.svc.{CLUSTER_DOMAIN}", f"{base}.{namespace}.svc",
            f"{base}.{namespace}", base]


# -- process helpers ---------------------------------------------------------------
def clean_stale() -> None:
    """Kill the shims of pod labs whose process is gone and remove their directories
    (hostlab's clean_stale, run by HostLab.start, removes their namespaces and what runs
    there)."""
    hostlab.remove_stale_dirs(STALE_DIR, tries=50, pause_s=0.02)


def unavailable() -> str | None:
    """Why pods cannot run here (None: they can)."""
    if os.geteuid() != 0:
        return "the pod lab needs root (namespaces, mounts, veths)"
    for program in ("ip", "setfacl"):
        if shutil.which(program) is None:
            return f"{program} is missing (Debian: iproute2, acl)"
    if os.environ.get(hostlab.FORCE_LOOPBACK_ENV) == "1":
        return f"{hostlab.FORCE_LOOPBACK_ENV}=1: no network namespaces for pods"
    return None


# -- a pod -------------------------------------------------------------------------
class PodProcess:
    """A pod of the lab: its network namespace and address, and its container's shim."""

    def __init__(self, lab: PodLab, run: PodRun, slot: int, directory: Path) -> None:
        self.lab = lab
        self.run = run
        self.slot = slot
        self.ip = str(lab.network.network_address + slot)
        self.netns = f"{lab.tag}n{slot}"
        self.veth = f"{lab.tag}h{slot:02x}"  # 15 characters at most, with a 7-digit pid
        self.dir = directory
        self.shim: subprocess.Popen[bytes] | None = None
        self.lost = False  # its node was killed: no status after that
        self.removed = False

    def __repr__(self) -> str:
        return f"PodProcess({self.run.namespace}/{self.run.name} on {self.run.node}, {self.ip})"

    @property
    def name(self) -> str:
        return self.run.name

    @property
    def node(self) -> str:
        return self.run.node

    @property
    def log_path(self) -> Path:
        """The container's CRI log."""
        return self.dir / "container.log"

    @property
    def status_path(self) -> Path:
        return self.dir / "status.json"

    def state(self) -> ContainerState:
        """What the container's status file says (a lost pod keeps its last state)."""
        try:
            status: dict[str, Any] = json.loads(self.status_path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            if self.shim is not None and self.shim.poll() is not None and not self.lost:
                return Terminated(128, "StartError", None, "", "",
                                  f"the shim ended without a status: {self._shim_output()}")
            return Waiting("ContainerCreating")
        if status["state"] == "running":
            return Running(status["startedAt"])
        return Terminated(status["exitCode"], status["reason"], status["signal"],
                          status["startedAt"], status["finishedAt"], status["message"])

    def wait(self, timeout: float) -> Terminated:
        """The terminated state, once the container has ended; PodLabError after ``timeout``."""
        deadline = time.monotonic() + timeout
        while not isinstance(state := self.state(), Terminated):
            if time.monotonic() > deadline:
                raise PodLabError(f"{self!r} still {state} after {timeout:.0f} s; log: "
                                  f"{self.log_tail()}")
            time.sleep(0.02)
        self._shim_ended(10)  # it exits right after the status: reap it
        return state

    def log_tail(self, n: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-n:]
        return "(no log)"

    def set_hosts_entries(self, entries: Mapping[str, str]) -> None:
        """Rewrite the pod's /etc/hosts in place (the same file: the bind mount shows it)."""
        with open(self.dir / "hosts", "r+", encoding="utf-8") as f:
            f.write(_hosts_file(self.run, self.ip, entries))
            f.truncate()

    def start(self) -> None:
        """Start the container (its shim); returns at once."""
        if self.shim is not None or self.lost or self.removed:
            raise PodLabError(f"{self!r} cannot start: it was started, lost with its node, or "
                              f"removed already (shim={self.shim}, lost={self.lost}, "
                              f"removed={self.removed})")
        if not self.run.command:
            self._fail_start("no command: a pod of the lab has no image, so its container "
                             "needs `command` (received command=[], "
                             f"args={list(self.run.args)})")
            return
        with open(self.dir / "shim.out", "ab") as out:
            self.shim = subprocess.Popen([sys.executable, "-S", str(SHIM), str(self.dir)],
                                         env={}, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def terminate(self, grace_s: float) -> None:
        """Stop the container as kubelet does: SIGTERM to its PID 1, then after ``grace_s``
        SIGKILL (which ends every process of its PID namespace); returns once it is gone.
        Safe from any thread, and together with ``kill()``."""
        if self._signal(signal.SIGTERM) and not self._shim_ended(grace_s):
            self._signal(signal.SIGKILL)
        if not self._shim_ended(30):
            raise PodLabError(f"{self!r} outlived SIGKILL by 30 s")

    def terminate_in_background(self, grace_s: float) -> threading.Thread:
        """``terminate(grace_s)`` in a daemon thread (join it to wait)."""
        thread = threading.Thread(target=self.terminate, args=(grace_s,), daemon=True,
                                  name=f"terminate {self.run.name}")
        thread.start()
        return thread

    def kill(self) -> None:
        """SIGKILL the container now; returns once it is gone (its status written)."""
        self._signal(signal.SIGKILL)
        if not self._shim_ended(30):
            raise PodLabError(f"{self!r} outlived SIGKILL by 30 s")

    def processes(self) -> list[int]:
        """Every process in the pod's network namespace (its shim included)."""
        return hostlab._netns_pids(self.netns)

    # -- internals -------------------------------------------------------------
    def _fail_start(self, message: str) -> None:
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        status = {"state": "terminated", "exitCode": 128, "reason": "StartError",
                  "signal": None, "message": message, "startedAt": now, "finishedAt": now}
        self.status_path.write_text(json.dumps(status), encoding="utf-8")

    def _container_pid(self) -> int | None:
        """The container's PID 1 (as this machine sees it) while its shim runs, else None."""
        path = self.dir / "container.pid"
        deadline = time.monotonic() + 30
        while self.shim is not None and self.shim.poll() is None:
            with contextlib.suppress(FileNotFoundError, ValueError):
                pid = int(path.read_text())
                # its shim's child, until the shim reaps it: never a recycled pid
                return pid if hostlab._parent(pid) == self.shim.pid else None
            if time.monotonic() > deadline:
                raise PodLabError(f"{self!r}: no container pid after 30 s: {self._shim_output()}")
            time.sleep(0.01)
        return None

    def _signal(self, sig: int) -> bool:
        """Send ``sig`` to the container's PID 1; False when there is none (ended, lost)."""
        pid = self._container_pid()
        if pid is None:
            return False
        hostlab._signal(pid, sig)
        return True

    def _shim_ended(self, timeout: float) -> bool:
        if self.shim is None:
            return True
        try:
            self.shim.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def _kill_all(self) -> None:
        """SIGKILL the shim (first: it writes nothing more) and every process of the pod."""
        if self.shim is not None:
            with contextlib.suppress(ProcessLookupError):
                self.shim.kill()
            self.shim.wait(10)
        hostlab._kill_namespace(self.netns)

    def _shim_output(self) -> str:
        with contextlib.suppress(OSError):
            return (self.dir / "shim.out").read_text(errors="replace")[-2000:] or "(empty)"
        return "(none)"


def _hosts_file(run: PodRun, ip: str, entries: Mapping[str, str]) -> str:
    lines = ["# Kubernetes-managed hosts file (tests/podlab.py).",
             "127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback",
             "fe00::0\tip6-localnet", "fe00::0\tip6-mcastprefix", "fe00::1\tip6-allnodes",
             "fe00::2\tip6-allrouters",
             f"{ip}\t" + "\t".join([*pod_dns_names(run.host_name, run.subdomain, run.namespace),
                                    run.host_name])]
    by_address: dict[str, list[str]] = collections.defaultdict(list)
    for name, address in entries.items():
        by_address[address].append(name)
    if by_address:
        lines.append("# Entries of the cluster DNS (the lab's caller).")
        lines += [f"{address}\t" + "\t".join(names) for address, names in by_address.items()]
    return "\n".join(lines) + "\n"


def _resolv_conf(namespace: str) -> str:
    """Kubernetes' search path; a name server where nothing listens (lookups fail at once)."""
    return (f"search {namespace}.svc.{CLUSTER_DOMAIN} svc.{CLUSTER_DOMAIN} {CLUSTER_DOMAIN}\n"
            "nameserver 127.0.0.1\noptions ndots:5 timeout:1 attempts:1\n")


def _container_env(run: PodRun) -> dict[str, str]:
    env = {"PATH": DEFAULT_PATH, "HOSTNAME": run.host_name, **run.env}
    env.setdefault("HOME", "/")
    return env


# -- the lab -----------------------------------------------------------------------
class PodLab:
    """Nodes that run pods as real processes; see the module docstring."""

    def __init__(self, hosts: HostLab, nodes: Sequence[str]) -> None:
        if hosts.network is None or hosts.bridge is None:
            raise PodLabUnavailable(hosts.reason or "the host lab has no bridge")
        self.pid = os.getpid()
        self.hostlab = hosts
        self.tag = hosts.tag
        self.network = hosts.network
        self.bridge = hosts.bridge
        self.nodes = list(nodes)
        self.down: set[str] = set()  # nodes killed (kill_node) and not started again
        self.dir = Path(tempfile.mkdtemp(prefix=f"podlab-{self.pid}-"))
        self._free_slots = collections.deque(range(2, 255))  # least recently released first
        self._pods: list[PodProcess] = []
        self._serial = 0
        self._lock = threading.RLock()
        self._closed = False

    @property
    def bridge_address(self) -> str:
        """This machine's address on the pods' network (their default route)."""
        return str(self.network.network_address + 1)

    @classmethod
    def start(cls, nodes: Sequence[str] = NODES) -> PodLab:
        """An empty lab on nodes ``nodes``, cleaning stale labs first.

        Raises:
            PodLabUnavailable: pods cannot run here (the message says why).
        """
        reason = unavailable()
        if reason:
            raise PodLabUnavailable(reason)
        clean_stale()
        hosts = HostLab.start()
        try:
            if not hosts.can_partition:
                raise PodLabUnavailable(hosts.reason)
            lab = cls(hosts, nodes)
        except BaseException:
            hosts.close_quietly()
            raise
        _OPEN_POD_LABS.add(lab)
        _install_signal_cleanup()
        atexit.register(lab.close_quietly)  # after HostLab.start's: runs before the hostlab's
        return lab

    def plain_user(self) -> LabUser:
        """hostlab's unprivileged user (made on first use), who may run this Python."""
        entry = pwd.getpwnam(self.hostlab.plain_user())
        return LabUser(entry.pw_name, entry.pw_uid, entry.pw_gid)

    def pods(self) -> list[PodProcess]:
        """The pods not removed yet, oldest first."""
        with self._lock:
            return list(self._pods)

    def create_pod(self, run: PodRun) -> PodProcess:
        """The pod's sandbox: its network namespace, address and files; no container yet."""
        with self._lock:
            if self._closed:
                raise PodLabError("the pod lab is closed")
            if run.node not in self.nodes:
                raise PodLabError(f"no node {run.node!r} in the lab. Received: "
                                  f"node={run.node!r}; nodes: {', '.join(self.nodes)}")
            if run.node in self.down:
                raise PodLabError(f"node {run.node!r} was killed; start_node() it first")
            if not self._free_slots:
                raise PodLabError(f"no pod address left in {self.network} (253 pods at once)")
            slot = self._free_slots.popleft()
            self._serial += 1
            directory = self.dir / f"{run.namespace}_{run.name}_{run.uid or self._serial}"
            pod = PodProcess(self, run, slot, directory)
            self._pods.append(pod)
        try:
            directory.mkdir()
            self._plug(pod)
            self._write_files(pod)
        except BaseException:
            self.remove_pod(pod)
            raise
        return pod

    def run_pod(self, run: PodRun) -> PodProcess:
        """``create_pod`` then ``start``: returns once the shim runs (the container may not)."""
        pod = self.create_pod(run)
        pod.start()
        return pod

    def kill_node(self, node: str) -> None:
        """Lose ``node``: every process of its pods SIGKILLed at once, shims first, so that no
        status is written after this (a lost node reports nothing). The pods stay until
        ``remove_pod``; ``run_pod`` refuses the node until ``start_node``."""
        with self._lock:
            self.down.add(node)
            on_node = [pod for pod in self._pods if pod.node == node]
        for pod in on_node:
            if pod.shim is not None:
                with contextlib.suppress(ProcessLookupError):
                    pod.shim.kill()
        for pod in on_node:
            pod.lost = True
            pod._kill_all()

    def start_node(self, node: str) -> None:
        """Let ``node`` run pods again after ``kill_node`` (it starts empty)."""
        with self._lock:
            self.down.discard(node)

    def remove_pod(self, pod: PodProcess) -> None:
        """Kill what runs of the pod, delete its network namespace, release its address (its
        files stay until ``close``)."""
        with self._lock:
            if pod.removed:
                return
            pod.removed = True
        try:
            if not pod.lost:
                pod.kill()
            pod._kill_all()
            hostlab._cmd("ip", "netns", "del", pod.netns, check=False)
        finally:
            with self._lock:
                self._pods.remove(pod)
                self._free_slots.append(pod.slot)

    def _plug(self, pod: PodProcess) -> None:
        ns, cmd = pod.netns, hostlab._cmd
        cmd("ip", "netns", "add", ns)
        cmd("ip", "link", "add", pod.veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        cmd("ip", "link", "set", pod.veth, "master", self.bridge, "up")
        script = (f"addr add {pod.ip}/{self.network.prefixlen} dev eth0\nlink set eth0 up\n"
                  f"link set lo up\nroute add default via {self.bridge_address}\n")
        subprocess.run(["ip", "-n", ns, "-batch", "-"], input=script, text=True, check=True,
                       capture_output=True)

    def _write_files(self, pod: PodProcess) -> None:
        run, d = pod.run, pod.dir
        (d / "hosts").write_text(_hosts_file(run, pod.ip, run.hosts_entries), encoding="utf-8")
        (d / "hostname").write_text(run.host_name + "\n", encoding="utf-8")
        (d / "resolv.conf").write_text(_resolv_conf(run.namespace), encoding="utf-8")
        pod.log_path.touch()  # empty until the container writes (the shim appends)
        (d / "rootfs").mkdir()
        (d / "layer").mkdir()
        binds = [[str(d / "hosts"), "/etc/hosts", False],
                 [str(d / "hostname"), "/etc/hostname", False],
                 [str(d / "resolv.conf"), "/etc/resolv.conf", False]]
        for mount_path, volume in run.mounts.items():
            if not os.path.isabs(mount_path) or not os.path.exists(volume.path):
                raise PodLabError(f"a volume needs an absolute mount path and an existing host "
                                  f"path. Received: {mount_path!r} -> {volume.path!r}")
            binds.append([os.path.realpath(volume.path), os.path.normpath(mount_path),
                          volume.read_only])
        config = {"netns": f"/run/netns/{pod.netns}", "hostname": run.host_name,
                  "rootfs": str(d / "rootfs"), "layer": str(d / "layer"), "binds": binds,
                  "uid": run.run_as_user, "gid": run.run_as_group,
                  "working_dir": run.working_dir or "/",
                  "command": [*run.command, *run.args], "env": _container_env(run)}
        (d / "shim.json").write_text(json.dumps(config), encoding="utf-8")
        for name in ("hosts", "hostname", "resolv.conf"):
            (d / name).chmod(0o644)

    # -- teardown ----------------------------------------------------------------
    def close(self) -> None:
        """Kill every pod, delete their namespaces, close the host lab (bridge, user, ACL
        entries) and remove the lab's directory; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pods = list(self._pods)
        _OPEN_POD_LABS.discard(self)
        problems: list[str] = []
        for pod in pods:
            if pod.shim is not None:
                with contextlib.suppress(ProcessLookupError):
                    pod.shim.kill()
        for pod in pods:
            try:
                pod._kill_all()
                hostlab._cmd("ip", "netns", "del", pod.netns)
            except (LabError, OSError, subprocess.SubprocessError) as exc:
                problems.append(str(exc))
        try:
            self._wait_links_gone([pod.veth for pod in pods])
            self.hostlab.close()
        except (LabError, OSError, subprocess.SubprocessError) as exc:
            problems.append(str(exc))
        hostlab._kill(hostlab.pids_naming(str(self.dir)))  # a shim of ours that outlived its Popen
        shutil.rmtree(self.dir, ignore_errors=True)
        if problems:
            raise PodLabError("pod lab teardown incomplete: " + "; ".join(problems))

    def close_quietly(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    @staticmethod
    def _wait_links_gone(links: Sequence[str]) -> None:
        deadline = time.monotonic() + 10  # veths of deleted namespaces go asynchronously
        while remaining := hostlab._existing_links(links):
            if time.monotonic() > deadline:
                raise PodLabError(f"links still present after deletion: {', '.join(remaining)}")
            time.sleep(0.05)


# -- signals ---------------------------------------------------------------------------
def _install_signal_cleanup() -> None:
    """On SIGTERM or SIGHUP: close the pod labs, then hand over to the handler that was there
    or, for the default, to hostlab's cleanup (closes its labs, then dies of the signal)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGHUP):
        previous = signal.getsignal(sig)
        if previous is signal.SIG_IGN or getattr(previous, "_podlab", False):
            continue

        def handler(signum: int, frame: FrameType | None, previous: Any = previous) -> None:
            for lab in list(_OPEN_POD_LABS):
                lab.close_quietly()
            if callable(previous):
                previous(signum, frame)
            else:
                hostlab._close_open_labs(signum, frame)

        handler._podlab = True  # type: ignore[attr-defined]
        signal.signal(sig, handler)


# -- pytest hooks and fixtures ------------------------------------------------------------
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "pods: runs Kubernetes pods as real processes (tests/podlab.py)")


@pytest.fixture(scope="session")
def podlab() -> Iterator[PodLab]:
    """The session's pod lab (started on first use; skips, saying why, where pods cannot run)."""
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    try:
        lab = PodLab.start()
    except PodLabUnavailable as exc:
        pytest.skip(str(exc))
    try:
        yield lab
    finally:
        lab.close()


@pytest.fixture
def pods(podlab: PodLab) -> Iterator[PodLab]:
    """The pod lab for one test; afterwards no pod is left and every node is up."""
    yield podlab
    for pod in reversed(podlab.pods()):
        podlab.remove_pod(pod)
    for node in podlab.nodes:
        podlab.start_node(node)
