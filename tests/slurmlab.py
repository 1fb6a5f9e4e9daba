"""pytest plugin: a real Slurm cluster on this machine, on hostlab's network namespaces.

Load it with ``pytest_plugins = [..., "slurmlab"]`` in tests/conftest.py. It provides the
session-scoped fixture ``slurmlab`` (a :class:`SlurmLab`) and the function-scoped ``slurm``
(the same lab; after each test it cancels the lab's jobs and waits until every node is idle
again, restarting a killed slurmd), for tests marked ``slurm``::

    @pytest.mark.slurm
    def test_hostname(slurm: SlurmLab) -> None:
        out = slurm.run("srun", "-N3", "hostname", user=slurm.user).stdout
        assert sorted(out.split()) == ["n1", "n2", "n3"]

The lab is a :class:`hostlab.HostLab` of its own (not the session's ``hostlab``, whose hosts
other tests kill) with four hosts: host 0 is the LOGIN node (its sshd lets the lab's plain,
unprivileged user in with ``key_file``), hosts 1..3 are the compute nodes ``n1``..``n3``.
What runs, and where:

- munged, in the root namespace, with its own socket, key (1024 fresh random bytes), pid,
  seed and log files under the lab's directory (``SlurmLab.dir``); nothing in /etc/munge
  is used. Slurm finds its socket through ``AuthInfo=socket=...`` in slurm.conf. A Unix
  socket's path is reachable from every network namespace (the file system is shared).
- slurmctld, in the root network namespace, on a free port; ``SlurmctldHost=<hostname>(<bridge
  address>)``, so the login node and the nodes reach it by address. It runs in a mount
  namespace of its own with the lab's /etc/hosts and /etc/resolv.conf (below).
- one slurmd per node, started with ``nsenter --net`` into the node's namespace and
  ``unshare --uts --mount``: a UTS namespace with the node's name as host name, and a mount
  namespace of its own where the lab's conf directory is bound over /etc/slurm and files of
  the lab over /etc/hosts (the nodes, the login node, the controller) and /etc/resolv.conf
  (a name server on 127.0.0.1 that refuses at once: no DNS timeouts). Every job step's
  tasks are children of that slurmd, so ``scontrol``/``srun``/``sbatch`` work in a step
  with no environment variable set. (``ip netns exec`` would remount /sys, and slurmd then
  finds no cgroup file system and does not start.)
- on the login node, ``ip netns exec`` (which starts hostlab's sshds) binds each entry of
  ``/etc/netns/<namespace>/`` over ``/etc/<entry>``: the lab writes ``slurm/`` (slurm.conf
  and an empty plugstack.conf), ``hosts`` and ``resolv.conf`` there and restarts the sshd,
  so the plain user logged in over SSH runs Slurm's commands with no environment set.
  The node hosts' sshds get the same files. The login node's sshd runs in a UTS namespace
  of its own whose host name is ``login`` (``LOGIN_NAME``).
- on this machine (root namespace), commands need ``SLURM_CONF``: ``SlurmLab.env`` or
  ``SlurmLab.run(...)``.

How srun is found. slurmd answers srun at the address srun's request came from. slurmctld,
though, sends a step's srun its messages (node failure, step complete on scancel, time limit)
at the host NAME srun gave (its short host name), which Slurm 22.05 looks up among the
NodeName lines of slurm.conf only (``slurm_conf_get_nodeaddr``); a name that is not there
gives 0.0.0.0, i.e. slurmctld's own host, and an srun elsewhere never hears that its node
failed. So the login node has a host name of its own (hostlab's namespaces share this
machine's), and slurm.conf names it and this machine as FUTURE nodes (``NodeName=login
NodeAddr=<login address> State=FUTURE``): never used, not shown by sinfo.

Everything the lab creates carries the owner's pid: its directory
(``/tmp/slurmlab-<pid>-...``), the hostlab names (``orch<pid><letter>...``). A later lab
stops the processes of a lab whose pid is gone (any process whose command line names its
directory) and removes its directory; hostlab removes its namespaces, users and /etc/netns
entries. ``close()`` runs at exit and on
SIGTERM/SIGHUP as well.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import hostlab
import pytest
from hostlab import HostLab, LabError, LabHost

SLURMCTLD = "/usr/sbin/slurmctld"
SLURMD = "/usr/sbin/slurmd"
MUNGED = "/usr/sbin/munged"
N_NODES = 3
LOGIN_NAME = "login"  # the login node's host name (its own UTS namespace)
STALE_DIR = re.compile(r"^slurmlab-(\d+)-")
NODE_STATE = "%N %T"  # sinfo -N: one line per node, the long state (idle, idle*, down*, ...)
_OPEN_SLURM_LABS: set[SlurmLab] = set()


class SlurmLabError(LabError):
    """The Slurm lab could not start, control or stop a part of the cluster."""


# -- process helpers ----------------------------------------------------------
def _cmd(*argv: str, check: bool = True, timeout: float = 60,
         env: dict[str, str] | None = None, cwd: str | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          timeout=timeout, env=env, cwd=cwd)
    if check and proc.returncode != 0:
        raise SlurmLabError(f"{shlex.join(argv)} exited {proc.returncode}: "
                            f"{(proc.stderr or proc.stdout).strip()}")
    return proc


def _ns_of(pid: int, kind: str) -> str | None:
    """The namespace id (``mnt:[4026...]``) of ``pid``, None when it is gone."""
    try:
        return os.readlink(f"/proc/{pid}/ns/{kind}")
    except OSError:
        return None


def _pids_in_mount_ns(mnt: str, net: str) -> list[int]:
    """Every process in mount namespace ``mnt`` and network namespace ``net``."""
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            pid = int(entry.name)
            if _ns_of(pid, "mnt") == mnt and _ns_of(pid, "net") == net:
                pids.append(pid)
    return pids


def _stop(proc: subprocess.Popen[bytes] | None, grace: float = 5) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds; reaps it."""
    if proc is None:
        return
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _free_port() -> int:
    """A TCP port no address of this machine listens on now."""
    with socket.socket() as s:
        s.bind(("", 0))
        port: int = s.getsockname()[1]
        return port


def clean_stale() -> None:
    """Stop what slurm labs of processes that no longer exist left running here, and remove
    their directories (hostlab's clean_stale does their namespaces, users, /etc/netns)."""
    hostlab.remove_stale_dirs(STALE_DIR, tries=20, pause_s=0.05)


def unavailable() -> str | None:
    """Why a Slurm lab cannot run here (None: it can)."""
    if os.geteuid() != 0:
        return "the Slurm lab needs root (namespaces, slurmd, munged)"
    for program in (SLURMCTLD, SLURMD, MUNGED):
        if not os.path.exists(program):
            return f"{program} is missing (Debian: slurmctld slurmd slurm-client munge)"
    for program in ("srun", "sbatch", "scontrol", "nsenter", "unshare", "runuser"):
        if shutil.which(program) is None:
            return f"{program} is missing (Debian: slurm-client, util-linux)"
    if os.environ.get(hostlab.FORCE_LOOPBACK_ENV) == "1":
        return f"{hostlab.FORCE_LOOPBACK_ENV}=1: no network namespaces for the Slurm nodes"
    return None


def _start_login_sshd(host: LabHost) -> None:
    """LabHost.start_sshd for the login node: the same sshd, started the same way (``ip netns
    exec``, so /etc/netns/NS/ applies), in a UTS namespace whose host name is LOGIN_NAME.
    hostlab's namespaces share this machine's host name, and srun tells slurmctld its host
    by name: with this machine's name, slurmctld's messages to the login node's sruns would
    go to this machine (see the module docstring)."""
    argv = ["ip", "netns", "exec", str(host.namespace), "unshare", "--uts", "sh", "-c",
            f'hostname {LOGIN_NAME} && exec "$@"', "sh", hostlab.SSHD, "-D", "-e",
            "-f", str(host.dir / "sshd_config")]
    with open(host.dir / "sshd.log", "ab") as log:
        host.sshd = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
    host._wait_for_banner()


# -- the lab ------------------------------------------------------------------
@dataclass(eq=False)
class SlurmNode:
    """A compute node: a hostlab host whose namespace runs slurmd as node ``name``."""

    name: str
    address: str
    host: LabHost
    lab: SlurmLab = field(repr=False)
    slurmd: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    namespaces: tuple[str, str] | None = field(default=None, repr=False)  # slurmd's (mnt, net)

    @property
    def running(self) -> bool:
        return self.slurmd is not None and self.slurmd.poll() is None

    @property
    def log_path(self) -> Path:
        return self.lab.dir / "log" / f"slurmd-{self.name}.log"

    def start(self) -> None:
        """Start slurmd (after killing what is left of a slurmd that died)."""
        if self.running:
            return
        if self.slurmd is not None:
            self.kill()
        lab, etc = self.lab, self.lab.dir / "etc"
        (lab.dir / "spool" / self.name).mkdir(mode=0o755, exist_ok=True)
        script = (
            f"mount --bind {shlex.quote(str(lab.dir / 'hosts'))} /etc/hosts && "
            f"mount --bind {shlex.quote(str(lab.dir / 'resolv.conf'))} /etc/resolv.conf && "
            f"mount --bind {shlex.quote(str(etc))} /etc/slurm && "
            f"hostname {self.name} && "
            f'exec "$@"'
        )
        argv = ["nsenter", f"--net=/var/run/netns/{self.host.namespace}",
                "unshare", "--uts", "--mount", "--propagation", "private",
                "sh", "-c", script, "sh", SLURMD, "-D", "-N", self.name, "-f", lab.conf_path]
        with open(self.lab.dir / "log" / f"slurmd-{self.name}.out", "ab") as out:
            self.slurmd = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                           stderr=subprocess.STDOUT, start_new_session=True)
        # slurmd's namespaces, once unshare has made them: kill() finds its processes by them,
        # also after slurmd itself is gone
        ours = _ns_of(os.getpid(), "mnt")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self.slurmd.poll() is None:
            mnt, net = _ns_of(self.slurmd.pid, "mnt"), _ns_of(self.slurmd.pid, "net")
            if mnt is not None and net is not None and mnt != ours:
                self.namespaces = (mnt, net)
                return
            time.sleep(0.005)
        raise SlurmLabError(f"slurmd of {self.name} did not start: "
                            f"{self.lab._tail(f'slurmd-{self.name}.out')}")

    def kill(self) -> None:
        """SIGKILL slurmd and every process in its mount namespace (the steps' slurmstepds and
        tasks), until none is left."""
        proc = self.slurmd
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        if self.namespaces is not None:
            mnt, net = self.namespaces
            for _ in range(100):
                pids = _pids_in_mount_ns(mnt, net)
                if not pids:
                    break
                hostlab._kill(pids)
                time.sleep(0.02)
            else:
                raise SlurmLabError(f"processes of {self.name} keep appearing: {pids}")
        proc.wait(10)
        self.slurmd = self.namespaces = None


class SlurmLab:
    """A Slurm cluster of three nodes and a login node; see the module docstring."""

    def __init__(self, hosts: HostLab) -> None:
        self.pid = os.getpid()
        self.hostlab = hosts
        self.dir = Path(tempfile.mkdtemp(prefix=f"slurmlab-{self.pid}-"))
        self.conf_path = str(self.dir / "etc" / "slurm.conf")
        self.env = {"SLURM_CONF": self.conf_path}
        self.user = ""
        self.login: LabHost
        self.nodes: list[SlurmNode] = []
        self.key_file = hosts.client_key_path
        self.known_hosts = hosts.known_hosts_path
        self.controller_host = socket.gethostname().split(".")[0]
        self.munged: subprocess.Popen[bytes] | None = None
        self.slurmctld: subprocess.Popen[bytes] | None = None
        self.netns_paths: list[Path] = []  # what the lab wrote under /etc/netns, to remove
        self._lock = threading.RLock()
        self._closed = False

    # -- start --------------------------------------------------------------
    @classmethod
    def start(cls) -> SlurmLab:
        """Start the cluster: munged, slurmctld, three slurmds; returns once every node is idle."""
        reason = unavailable()
        if reason:
            raise SlurmLabError(reason)
        clean_stale()
        hosts = HostLab.start()
        try:
            if not hosts.can_partition:
                raise SlurmLabError(hosts.reason)
            lab = cls(hosts)
        except BaseException:
            hosts.close_quietly()
            raise
        _OPEN_SLURM_LABS.add(lab)
        atexit.register(lab.close_quietly)  # after HostLab.start's: runs before the hostlab's
        try:
            lab._start()
        except BaseException:
            lab.close_quietly()
            raise
        return lab

    def _start(self) -> None:
        all_hosts = self.hostlab.hosts(1 + N_NODES)
        self.user = self.hostlab.plain_user()
        self.login = all_hosts[0]
        self.nodes = [SlurmNode(f"n{i}", host.address, host, self)
                      for i, host in enumerate(all_hosts[1:], start=1)]
        self.dir.chmod(0o711)  # the plain user reads the conf and reaches munge's socket
        for sub, mode in (("etc", 0o755), ("munge", 0o755), ("state", 0o700), ("spool", 0o755),
                          ("log", 0o755)):
            (self.dir / sub).mkdir(mode=mode)
            (self.dir / sub).chmod(mode)
        self._start_munged()
        self._write_files()
        self._write_netns_files()
        self._start_slurmctld()
        for node in self.nodes:
            node.start()
        self.wait_idle(timeout=60)

    @property
    def bridge_address(self) -> str:
        return str(self.hostlab.bridge_address)

    @property
    def munge_socket(self) -> str:
        return str(self.dir / "munge" / "munge.socket")

    def _start_munged(self) -> None:
        munge = self.dir / "munge"
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        argv = [MUNGED, "--foreground", "--force", f"--socket={self.munge_socket}",
                f"--key-file={key}", f"--pid-file={munge / 'munged.pid'}",
                f"--seed-file={munge / 'munged.seed'}", f"--log-file={self.dir / 'log' / 'munged.log'}",
                "--num-threads=4"]
        with open(self.dir / "log" / "munged.out", "ab") as out:
            self.munged = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                           stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 15
        while not os.path.exists(self.munge_socket):
            if self.munged.poll() is not None or time.monotonic() > deadline:
                raise SlurmLabError(f"munged did not start: {self._tail('munged.out')} "
                                    f"{self._tail('munged.log')}")
            time.sleep(0.02)

    @staticmethod
    def node_hardware() -> str:
        """What slurmd detects here (``slurmd -C``: CPUs, boards, sockets, cores, threads), for
        the nodes' lines: a node whose line differs would be drained ("Low CPUs")."""
        out = _cmd(SLURMD, "-C", check=False, timeout=30).stdout
        words = dict(w.split("=", 1) for w in out.split("\n", 1)[0].split() if "=" in w)
        keys = ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore")
        if all(words.get(key, "").isdigit() for key in keys):
            return " ".join(f"{key}={words[key]}" for key in keys)
        return f"CPUs={os.cpu_count() or 1}"

    def slurm_conf(self, ctld_port: int, slurmd_port: int) -> str:
        d = self.dir
        hardware = self.node_hardware()
        lines = [
            "# a Slurm test cluster of tests/slurmlab.py",
            "ClusterName=slurmlab",
            f"SlurmctldHost={self.controller_host}({self.bridge_address})",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket},cred_expire=10",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={d / 'state'}",
            f"SlurmdSpoolDir={d / 'spool' / '%n'}",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}",
            f"SlurmdPidFile={d / 'spool' / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={d / 'log' / 'slurmd-%n.log'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            f"PlugStackConfig={d / 'etc' / 'plugstack.conf'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={d / 'log' / 'jobcomp.txt'}",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "PreemptType=preempt/none",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=batch_sched_delay=0",
            "SlurmdParameters=config_overrides",
            "JobRequeue=1",
            "ReturnToService=2",
            "SlurmdTimeout=10",
            "InactiveLimit=0",
            "KillWait=5",
            "MinJobAge=30",
            "MailProg=/bin/true",
            f"TmpFS={d / 'spool'}",
            "",
        ]
        for node in self.nodes:
            lines.append(f"NodeName={node.name} NodeAddr={node.address} NodeHostname={node.name} "
                         f"{hardware} RealMemory=1000 State=UNKNOWN")
        # The hosts where srun runs but no slurmd: the login node and this machine. slurmctld
        # sends a step's srun its messages (node failure, step cancelled, time limit) at the
        # host name srun gave (its short host name), looked up among the NodeName lines only
        # (22.05's slurm_conf_get_nodeaddr); a name not there gives 0.0.0.0, and the message
        # reaches no srun on another host. FUTURE: never used, not shown by sinfo.
        lines.append(f"NodeName={LOGIN_NAME} NodeAddr={self.login.address} State=FUTURE")
        if self.controller_host not in (LOGIN_NAME, *(node.name for node in self.nodes)):
            lines.append(f"NodeName={self.controller_host} NodeAddr={self.bridge_address} "
                         "State=FUTURE")
        names = ",".join(node.name for node in self.nodes)
        lines += [
            f"PartitionName=main Nodes={names} Default=YES MaxTime=INFINITE State=UP",
            f"PartitionName=short Nodes={names} Default=NO MaxTime=3 State=UP",
        ]
        return "\n".join(lines) + "\n"

    def _write_files(self) -> None:
        ctld_port = _free_port()
        slurmd_port = _free_port()
        while slurmd_port == ctld_port:
            slurmd_port = _free_port()
        self.ctld_port, self.slurmd_port = ctld_port, slurmd_port
        etc = self.dir / "etc"
        Path(self.conf_path).write_text(self.slurm_conf(ctld_port, slurmd_port))
        (etc / "plugstack.conf").write_text("# no SPANK plugins in the Slurm lab\n")
        for path in etc.iterdir():
            path.chmod(0o644)
        # /etc/hosts of slurmctld, the login node and the nodes: every host by its name (Slurm
        # itself reaches them by address: SlurmctldHost's, NodeAddr, srun's; see the FUTURE
        # nodes in slurm_conf), so that no lookup waits for DNS.
        hosts = ["127.0.0.1 localhost", f"{self.bridge_address} {self.controller_host} slurmctld",
                 f"{self.login.address} {LOGIN_NAME}",
                 *(f"{node.address} {node.name}" for node in self.nodes)]
        (self.dir / "hosts").write_text("\n".join(hosts) + "\n")
        # a name server that refuses at once: a lookup of an unknown name fails in no time
        (self.dir / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
        for name in ("hosts", "resolv.conf"):
            (self.dir / name).chmod(0o644)

    def _write_netns_files(self) -> None:
        """/etc/netns/<namespace>/{slurm/, hosts, resolv.conf} for every host of the lab
        (``ip netns exec`` binds them over /etc/... for the sshd it starts); then restart
        the sshds, which are started before the files exist."""
        for host in [self.login, *(node.host for node in self.nodes)]:
            base = Path("/etc/netns") / str(host.namespace)
            conf_dir = base / "slurm"
            conf_dir.mkdir(mode=0o755)
            self.netns_paths.append(conf_dir)
            for name in ("slurm.conf", "plugstack.conf"):
                shutil.copy(self.dir / "etc" / name, conf_dir / name)
            for name in ("hosts", "resolv.conf"):
                shutil.copy(self.dir / name, base / name)
                self.netns_paths.append(base / name)
            if host is self.login:
                # its sshd (and so every login) in a UTS namespace named LOGIN_NAME, whenever
                # hostlab starts it (heal, restart_sshd); see _start_login_sshd
                host.start_sshd = functools.partial(_start_login_sshd, host)  # type: ignore[method-assign]
            host.restart_sshd()

    def _start_slurmctld(self) -> None:
        """slurmctld in the root network namespace, in a mount namespace of its own where the
        lab's hosts and resolv.conf are /etc's (it resolves the host names of sruns)."""
        script = (f"mount --bind {shlex.quote(str(self.dir / 'hosts'))} /etc/hosts && "
                  f"mount --bind {shlex.quote(str(self.dir / 'resolv.conf'))} /etc/resolv.conf && "
                  'exec "$@"')
        argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
                SLURMCTLD, "-D", "-i", "-f", self.conf_path]
        with open(self.dir / "log" / "slurmctld.out", "ab") as out:
            self.slurmctld = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                              stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 30
        while True:
            if self.slurmctld.poll() is not None:
                raise SlurmLabError(f"slurmctld exited: {self._tail('slurmctld.out')} "
                                    f"{self._tail('slurmctld.log')}")
            if self.run("scontrol", "ping", check=False, timeout=10).stdout.count("UP"):
                return
            if time.monotonic() > deadline:
                raise SlurmLabError(f"slurmctld does not answer: {self._tail('slurmctld.log')}")
            time.sleep(0.05)

    def _tail(self, log: str, n: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return (self.dir / "log" / log).read_text(errors="replace")[-n:]
        return f"(no {log})"

    # -- use ----------------------------------------------------------------
    def node(self, name: str) -> SlurmNode:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)

    def login_host_key(self) -> str:
        """The login host's public host key line (``ssh-ed25519 AAAA...``)."""
        return self.login.host_key_line

    @property
    def user_home(self) -> str:
        """The plain user's home (its passwd entry's): where ``run(..., user=)`` starts."""
        return str(self.hostlab.dir / "plain-home")

    def run(self, *argv: str, user: str | None = None, check: bool = True, timeout: float = 60,
            cwd: str | None = None) -> subprocess.CompletedProcess[str]:
        """A Slurm command on this machine with ``SLURM_CONF`` set; with ``user``, as that user
        (``runuser -u USER --``), in ``cwd`` (default: the plain user's home)."""
        cmd = list(argv)
        if user is not None:
            cmd = ["runuser", "-u", user, "--", *cmd]
            cwd = cwd or self.user_home
        return _cmd(*cmd, check=check, timeout=timeout, env={**os.environ, **self.env}, cwd=cwd)

    def squeue(self, user: str | None = None) -> list[dict[str, str]]:
        """The lab's jobs that are left (pending, running, completing): id, name, state, user,
        nodes (the node list, "" while pending)."""
        argv = ["squeue", "-h", "-o", "%i\t%j\t%T\t%u\t%N"]
        if user is not None:
            argv += ["-u", user]
        jobs = []
        for line in self.run(*argv).stdout.splitlines():
            parts = line.split("\t")
            if len(parts) == 5:
                jobs.append(dict(zip(("id", "name", "state", "user", "nodes"), parts, strict=True)))
        return jobs

    def node_states(self) -> dict[str, str]:
        """Each node's state as sinfo says it (``idle``, ``idle*``, ``down*``, ``mixed``, ...)."""
        out = self.run("sinfo", "-h", "-N", "-o", NODE_STATE, check=False, timeout=20).stdout
        states: dict[str, str] = {}
        for line in out.splitlines():
            name, _, state = line.strip().partition(" ")
            states.setdefault(name, state)
        return states

    def heal(self) -> None:
        """The lab's hosts healed (links, sshds) and every node's slurmd running."""
        self.hostlab.hosts(1 + N_NODES)
        for node in self.nodes:
            node.start()

    def wait_idle(self, timeout: float = 60) -> None:
        """Return once every node is idle (heals first). A node left down or drained by a
        restart is resumed."""
        with self._lock:
            self.heal()
        deadline = time.monotonic() + timeout
        resumed: set[str] = set()
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            states = self.node_states()
            if len(states) == len(self.nodes) and all(s == "idle" for s in states.values()):
                return
            for name, state in states.items():
                # ReturnToService=2 brings a node back when its slurmd registers; one that is
                # down or drained with a responding slurmd (no '*') is resumed by hand
                if state.rstrip("~#!%$@^-") in ("down", "drained", "draining") and name not in resumed:
                    self.run("scontrol", "update", f"NodeName={name}", "State=RESUME", check=False)
                    resumed.add(name)
            time.sleep(0.1)
        raise SlurmLabError(f"nodes not idle after {timeout:.0f} s: {states}; "
                            f"jobs {self.squeue()}; slurmctld log: {self._tail('slurmctld.log')}")

    def kill_node(self, name: str) -> None:
        """SIGKILL the node's slurmd and every process of it (its steps' tasks): a lost node."""
        with self._lock:
            self.node(name).kill()

    def start_node(self, name: str) -> None:
        """Start the node's slurmd again (ReturnToService=2 brings the node back to service)."""
        with self._lock:
            self.node(name).start()

    def cancel_all(self, timeout: float = 60) -> None:
        """scancel every job of the lab and wait until squeue lists none."""
        deadline = time.monotonic() + timeout
        jobs = self.squeue()
        while jobs:
            self.run("scancel", *sorted({job["id"].split("_")[0] for job in jobs}), check=False)
            if time.monotonic() > deadline:
                raise SlurmLabError(f"jobs left after scancel: {jobs}")
            time.sleep(0.1)
            jobs = self.squeue()

    # -- stop ---------------------------------------------------------------
    def close(self) -> None:
        """Stop slurmds, slurmctld and munged, remove the /etc/netns files, close the hostlab
        and remove the lab's directory; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        _OPEN_SLURM_LABS.discard(self)
        problems: list[str] = []
        for node in self.nodes:
            try:
                node.kill()
            except (LabError, OSError, subprocess.SubprocessError) as exc:
                problems.append(str(exc))
        for proc in (self.slurmctld, self.munged):
            try:
                _stop(proc)
            except (OSError, subprocess.SubprocessError) as exc:
                problems.append(str(exc))
        for path in reversed(self.netns_paths):
            try:
                if path.is_dir():
                    shutil.rmtree(path)
                else:
                    path.unlink(missing_ok=True)
            except OSError as exc:
                problems.append(str(exc))
        try:
            self.hostlab.close()
        except (LabError, OSError, subprocess.SubprocessError) as exc:
            problems.append(str(exc))
        hostlab._kill(hostlab.pids_naming(str(self.dir)))  # anything of ours that outlived its parent
        shutil.rmtree(self.dir, ignore_errors=True)
        if problems:
            raise SlurmLabError("slurm lab teardown incomplete: " + "; ".join(problems))

    def close_quietly(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


# -- signals --------------------------------------------------------------------
def _install_signal_cleanup() -> None:
    """On SIGTERM or SIGHUP: close the Slurm labs, then hand over to the handler that was there
    (hostlab's, which closes its labs and dies of the signal) or, for the default, to hostlab's
    own cleanup (closes the session's host labs too, then dies of the signal)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGHUP):
        previous = signal.getsignal(sig)
        if previous is signal.SIG_IGN or getattr(previous, "_slurmlab", False):
            continue

        def handler(signum: int, frame: FrameType | None, previous: Any = previous) -> None:
            for lab in list(_OPEN_SLURM_LABS):
                lab.close_quietly()
            if callable(previous):
                previous(signum, frame)
            else:
                hostlab._close_open_labs(signum, frame)

        handler._slurmlab = True  # type: ignore[attr-defined]
        signal.signal(sig, handler)


# -- pytest hooks and fixtures ----------------------------------------------------
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slurm: runs against the real Slurm test cluster (tests/slurmlab.py)")


@pytest.fixture(scope="session")
def slurmlab() -> Iterator[SlurmLab]:
    """The session's Slurm cluster (started on first use; skips where it cannot run)."""
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    _install_signal_cleanup()
    try:
        lab = SlurmLab.start()
    except SlurmLabError as exc:
        if "network namespaces are unavailable" in str(exc):
            pytest.skip(str(exc))
        raise
    try:
        yield lab
    finally:
        lab.close()


@pytest.fixture
def slurm(slurmlab: SlurmLab) -> Iterator[SlurmLab]:
    """The Slurm lab for one test; afterwards no job of it is left and every node is idle."""
    yield slurmlab
    slurmlab.cancel_all()
    slurmlab.wait_idle()
