"""pytest plugin: real OpenSSH test hosts, each a Linux network namespace with its own IP.

Load it with ``pytest_plugins = ["hostlab"]`` in tests/conftest.py (or ``-p hostlab``).
It provides the session-scoped fixture ``hostlab`` (a :class:`HostLab`)::

    @pytest.mark.ssh
    def test_echo(hostlab: HostLab) -> None:
        (host,) = hostlab.hosts(1)
        with SSHRunner(host.name, host.endpoint()) as runner:
            assert runner.run(["echo", "hi"]).stdout == "hi\\n"

``hostlab.hosts(n)`` returns the first ``n`` hosts of a pool shared by the
session, creating missing ones and healing the others (link up, sshd running)
first; processes a test leaves on a host stay there. Every host is a network
namespace with a veth on the lab's bridge (198.18.K.0/24, K from the pid; the
bridge, reachable from the controller, is ``hostlab.bridge_address``), its own
sshd on port 22 with a fresh ed25519 host key, and its own user (a uid-0 alias
whose home is in the lab's temp dir). ``hostlab.client_key_path`` is authorised
on every host; ``hostlab.known_hosts_path`` holds every host key.

A cloud-style login: ``hostlab.shared_user()`` names one user (made on first use)
that every host lets in with the keys given to ``LabHost.authorize(line)``, and
whose ``$HOME`` on each host is that host's home, as if each host had its own
account of that name (a cloud guest agent creating the user of ``ssh-keys``).

Hosts share this machine's file system (only the network is per host), so an
absolute path is the same directory on every host, as on a shared mount. The
exception is ``LabHost.private_dir`` (``/etc/orchlab-<pid><letter>-private``):
each host sees a directory of its own there (mode 1777), as if every host had
its own disk at that path. ``ip netns exec NS``, which starts each host's sshd,
bind-mounts ``/etc/netns/NS/ENTRY`` over ``/etc/ENTRY`` for the processes it
starts; the controller sees the empty mount point. None in the loopback fallback.

Host names: the namespaces share this machine's host name, which this machine's
/etc/hosts maps to loopback (as Debian's 127.0.1.1 line does). Each host gets an /etc/hosts
of its own the same way (``LabHost.hosts_path``, /etc/netns/NS/hosts): this machine's, with
the host name (and its short form) mapped to the host's lab address instead, so a process
that looks its own host's name up (JAX's gloo collectives advertise that address to their
peers) finds the address the other hosts reach, as on a well-configured real host.
``LabHost.map_hostname(address)`` maps it elsewhere (e.g. Debian's 127.0.1.1) until
``heal()``. None in the loopback fallback, where every host's name is this machine's.

An unprivileged login: ``hostlab.plain_user()`` names a user with a uid of its own (not a
root alias), made on first use, whose ``$HOME`` on each host is that host's
``LabHost.plain_home`` (owned by it), and who can execute this test run's Python (each
directory on the way to the interpreter, its library and its site-packages that others may
not enter gets a POSIX ACL entry for that user alone, removed when the lab closes).

Fault tools on a :class:`LabHost`: ``kill()`` (SIGKILL every process in the
namespace, sshd included: a power loss), ``shut_down()`` (the guest OS shutting down on an
ACPI soft off: SIGTERM to every process, SIGHUP too to those of SSH logins, as systemd
does; ``is_down()`` says when none is left), ``restart_sshd()``, ``cut()``/``restore()`` (link
down/up), ``throttle(rate, to=address)``/``unthrottle()`` (a slow link to one
address, e.g. ``hostlab.bridge_address``: a controller outside the cloud),
``rotate_host_key()``, and ``run(cmd)`` (a command inside the host).

Where ``ip netns add`` is refused (or with ``ORCHESTRATE_LAB_FORCE_LOOPBACK=1``)
the hosts are sshds on 127.0.0.2, .3, ... with a free port each;
``hostlab.can_partition`` is then False and ``hostlab.reason`` says why. Tests
that cut or kill hosts carry ``@pytest.mark.netns`` and are skipped with that
reason; ``cut()``, ``kill()`` and ``throttle()`` skip the same way.

Every name the lab creates holds the owner's pid (``orch<pid><letter>...``) so a
later lab removes what an interrupted one left, and only when that pid is gone.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import ipaddress
import itertools
import os
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from orchestrator.hosts import SSHEndpoint

FORCE_LOOPBACK_ENV = "ORCHESTRATE_LAB_FORCE_LOOPBACK"
SSHD = "/usr/sbin/sshd"
INIT_DIR = "/usr/libexec/podman"  # podman 4.3's helpers: catatonit, its init for --init
STALE_NAME = re.compile(r"^orch(\d+)[a-z](?:br|t|g|q|[hpnu]\d+)$")
STALE_DIR = re.compile(r"^orchlab-(\d+)[a-z]-")
HOSTS_FILE = "hosts"  # each host's own /etc/hosts, in /etc/netns/NS/
_LAB_SERIAL = itertools.count()
_OPEN_LABS: set[HostLab] = set()


class LabError(RuntimeError):
    """The lab could not create, control or remove a test host."""


# -- small process helpers ---------------------------------------------------
def _cmd(*argv: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=timeout)
    if check and proc.returncode != 0:
        raise LabError(f"{shlex.join(argv)} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill(pids: Sequence[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def pids_naming(text: str) -> list[int]:
    """Processes (not this one) whose command line holds ``text`` (an exact lab path)."""
    needle = text.encode()
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if needle in Path(f"/proc/{entry.name}/cmdline").read_bytes():
                    pids.append(int(entry.name))
    return pids


def remove_stale_dirs(stale: re.Pattern[str], *, tries: int, pause_s: float) -> None:
    """The temp directories named by ``stale`` (group 1: the pid of the lab that made them)
    whose lab is gone: every process naming one is killed (up to ``tries`` rounds, ``pause_s``
    apart), then it is removed. Under the cleaners' lock."""
    with cleaning():
        for entry in Path(tempfile.gettempdir()).iterdir():
            match = stale.match(entry.name)
            if not match or _pid_alive(int(match.group(1))):
                continue
            for _ in range(tries):
                pids = pids_naming(str(entry))
                if not pids:
                    break
                _kill(pids)
                time.sleep(pause_s)
            shutil.rmtree(entry, ignore_errors=True)


def _netns_pids(namespace: str) -> list[int]:
    out = _cmd("ip", "netns", "pids", namespace, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _kill_namespace(namespace: str) -> None:
    """SIGKILL every process in ``namespace`` by pid until none is left."""
    for _ in range(50):
        pids = _netns_pids(namespace)
        if not pids:
            return
        _kill(pids)
        time.sleep(0.02)
    raise LabError(f"processes keep appearing in namespace {namespace}: {_netns_pids(namespace)}")


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _parent(pid: int) -> int:
    """The parent pid of ``pid`` (0 if it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
        return int(stat[stat.rindex(b")") + 2 :].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _of_ssh_login(pid: int, listener: int | None) -> bool:
    """Whether ``pid`` belongs to an SSH login: a process of the listening sshd's line
    (the per-connection sshds and what they run), or one whose environment sshd made
    (``SSH_CONNECTION``: a task detached with ``setsid`` keeps it, as it stays in the
    login's session-N.scope on a systemd machine)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            if b"\0SSH_CONNECTION=" in b"\0" + f.read():
                return True
    except OSError:
        return False
    seen = 0
    while listener is not None and pid > 1 and seen < 64:
        pid, seen = _parent(pid), seen + 1
        if pid == listener:
            return True
    return False


def _login_pids(user: str) -> list[int]:
    """Pids of processes whose environment says they descend from a login of ``user``."""
    needle = f"\0LOGNAME={user}\0".encode()
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                env = b"\0" + f.read()
        except OSError:
            continue
        if needle in env:
            pids.append(int(entry.name))
    return pids


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = Path(f"/proc/{entry.name}/stat").read_bytes()
            if int(stat[stat.rindex(b")") + 2 :].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _with_retries(*argv: str) -> None:
    """Run a user-database command, retrying while another one holds the passwd lock."""
    for _ in range(50):
        proc = _cmd(*argv, check=False)
        if proc.returncode == 0:
            return
        if "lock" not in proc.stderr:
            break
        time.sleep(0.1)
    raise LabError(f"{shlex.join(argv)} exited {proc.returncode}: {proc.stderr.strip()}")


def _free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        port: int = s.getsockname()[1]
        return port


def _answers_ssh(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=1) as s:
            s.settimeout(2)
            return s.recv(8).startswith(b"SSH-")
    except OSError:
        return False


def _keygen(path: Path, comment: str) -> str:
    """Make an unencrypted ed25519 key pair at ``path``; return the public line ``type base64``."""
    _cmd("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path))
    kind, b64 = path.with_suffix(".pub").read_text().split()[:2]
    return f"{kind} {b64}"


def hostname_aliases() -> list[str]:
    """This machine's host name and, where it has a domain, its short form."""
    name = socket.gethostname()
    return list(dict.fromkeys([name, name.split(".", 1)[0]]))


def _read_hosts() -> str:
    with contextlib.suppress(FileNotFoundError):
        return Path("/etc/hosts").read_text()
    return ""


def hosts_file(text: str, names: Sequence[str], address: str) -> str:
    """``text`` (an /etc/hosts) with ``names`` resolving to ``address`` alone: they leave
    every other line (a line left without a name goes) and a line of their own maps them."""
    drop = {name.lower() for name in names}
    lines = []
    for line in text.splitlines():
        entry, hash_, comment = line.partition("#")
        fields = entry.split()
        kept = [name for name in fields[1:] if name.lower() not in drop]
        if len(fields) < 2 or len(kept) == len(fields) - 1:
            lines.append(line)
        elif kept:
            lines.append(" ".join([fields[0], *kept]) + (f" {hash_}{comment}" if hash_ else ""))
    return "\n".join([*lines, f"{address} {' '.join(names)}"]) + "\n"


# -- tools and stale leftovers -----------------------------------------------
def ensure_tools(acl: bool = False) -> None:
    """Install openssh-server and iproute2 with apt-get where sshd or ip is missing (and acl,
    for ``setfacl``, when asked)."""
    missing = [
        pkg
        for present, pkg in (
            (os.path.exists(SSHD), "openssh-server"),
            (shutil.which("ip") is not None, "iproute2"),
            (not acl or shutil.which("setfacl") is not None, "acl"),
        )
        if not present
    ]
    if not missing:
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", *missing]
    if subprocess.run(install, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, check=True)
        subprocess.run(install, env=env, capture_output=True, check=True)


@contextlib.contextmanager
def cleaning() -> Iterator[None]:
    """Hold the cleaners' lock: one clean_stale (of any lab) at a time on this machine, since
    two that found the same stale user raced in userdel ("cannot remove entry ... from
    /etc/passwd" for the one that came second). The lock is on the temp directory itself,
    so it leaves nothing behind."""
    fd = os.open(tempfile.gettempdir(), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _delete_user(user: str) -> None:
    """userdel -f ``user``, which someone else may have deleted meanwhile."""
    try:
        _with_retries("userdel", "-f", user)
    except LabError:
        if _user_exists(user):
            raise


def _user_exists(user: str) -> bool:
    return any(line.split(":", 1)[0] == user
               for line in Path("/etc/passwd").read_text().splitlines())


def clean_stale() -> None:
    """Remove what labs of processes that no longer exist left behind, by exact name and pid."""
    with cleaning():
        _clean_stale()


def _clean_stale() -> None:
    for namespace in _lab_names(_cmd("ip", "netns", "list", check=False).stdout):
        _kill_namespace(namespace)
        _cmd("ip", "netns", "del", namespace, check=False)
    for link in _lab_names("\n".join(_link_names())):
        _cmd("ip", "link", "del", link, check=False)
    users = [line.split(":", 1)[0] for line in Path("/etc/passwd").read_text().splitlines()]
    for user in _lab_names("\n".join(users)):
        _kill(_login_pids(user))
        _delete_user(user)
    for entry in Path(tempfile.gettempdir()).iterdir():
        match = STALE_DIR.match(entry.name)
        if match and not _pid_alive(int(match.group(1))):
            _kill(_sshd_pids_in(entry))
            shutil.rmtree(entry, ignore_errors=True)
    netns = Path("/etc/netns")
    for name in _lab_names("\n".join(p.name for p in netns.iterdir()) if netns.is_dir() else ""):
        shutil.rmtree(netns / name, ignore_errors=True)
    for entry in Path("/etc").iterdir():
        match = STALE_DIR.match(entry.name)
        if match and entry.name.endswith("-private") and not _pid_alive(int(match.group(1))):
            shutil.rmtree(entry, ignore_errors=True)


def _lab_names(listing: str) -> list[str]:
    """Names in ``listing`` (one per line, first word) made by a lab whose process is gone."""
    names = []
    for line in listing.splitlines():
        name = line.split(" ", 1)[0].strip()
        match = STALE_NAME.match(name)
        if match and not _pid_alive(int(match.group(1))):
            names.append(name)
    return names


def _sshd_pids_in(lab_dir: Path) -> list[int]:
    """Pids in the lab's sshd pid files that still run an sshd with a config from that dir."""
    pids = []
    for pid_file in lab_dir.glob("host*/sshd.pid"):
        with contextlib.suppress(OSError, ValueError):
            pid = int(pid_file.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if str(lab_dir).encode() in cmdline:
                pids.append(pid)
    return pids


# -- the lab -----------------------------------------------------------------
@dataclass(eq=False)
class LabHost:
    """One test host: a namespace (or a loopback address) with its own sshd and user."""

    lab: HostLab
    index: int
    name: str
    address: str
    port: int
    user: str
    home: str
    namespace: str | None
    link: str | None
    dir: Path
    host_key_line: str = ""
    sshd: subprocess.Popen[bytes] | None = None
    is_cut: bool = False
    throttled_to: str | None = None
    podman: subprocess.Popen[bytes] | None = None
    podman_without_init: bool = False  # the running podman service's (see serve_podman)
    session_env: str = ""  # extra `SetEnv` words for the plain user's SSH sessions
    hostname_address: str = ""  # what the host name resolves to in the host (map_hostname)

    @property
    def plain_home(self) -> str:
        """The home of ``HostLab.plain_user()`` on this host."""
        return str(self.dir / "plain-home")

    @property
    def private_dir(self) -> str | None:
        """A directory that only this host sees at its path (see the module docstring)."""
        return f"/etc/{self.lab.private_name}" if self.namespace else None

    @property
    def hosts_path(self) -> str | None:
        """The host's own /etc/hosts, as this machine sees it (see the module docstring)."""
        return f"/etc/netns/{self.namespace}/{HOSTS_FILE}" if self.namespace else None

    def map_hostname(self, address: str | None = None) -> None:
        """Make this machine's host name resolve to ``address`` inside the host (None: the
        host's lab address, as the lab sets it up); ``heal()`` maps it back. It applies at
        once, to the running sshd's logins too (the file is rewritten in place)."""
        self.lab.require_partition()
        address = address or self.address
        path = Path(str(self.hosts_path))
        path.write_text(hosts_file(_read_hosts(), hostname_aliases(), address))
        path.chmod(0o644)
        self.hostname_address = address

    def endpoint(self, **overrides: Any) -> SSHEndpoint:
        """An SSHEndpoint for this host with the lab's client key and known_hosts."""
        fields: dict[str, Any] = {
            "address": self.address,
            "user": self.user,
            "port": self.port,
            "key_file": self.lab.client_key_path,
            "known_hosts": self.lab.known_hosts_path,
            "connect_timeout_s": 5.0,
        }
        fields.update(overrides)
        return SSHEndpoint(**fields)

    @property
    def authorized_keys_path(self) -> str:
        """This host's own authorized keys (the lab's file applies as well)."""
        return str(self.dir / "authorized_keys")

    def authorize(self, pubkey_line: str) -> None:
        """Let this host's user and the lab's shared user log in with ``pubkey_line``."""
        with open(self.authorized_keys_path, "a", encoding="utf-8") as f:
            f.write(pubkey_line.strip() + "\n")

    def run(self, cmd: Sequence[str] | str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run ``cmd`` (argv, or a shell script) inside the host, as root, without SSH."""
        argv = ["sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        if self.namespace:
            argv = ["ip", "netns", "exec", self.namespace, *argv]
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)

    @property
    def sshd_running(self) -> bool:
        return self.sshd is not None and self.sshd.poll() is None

    def kill(self) -> None:
        """SIGKILL every process of the host, sshd included, as if it lost power."""
        self.lab.require_partition()
        assert self.namespace is not None
        _kill_namespace(self.namespace)
        self._reap_sshd()

    def shut_down(self, *, hangup: bool = True) -> None:
        """Start the guest OS's shutdown, as an ACPI soft off (a spot VM's preemption notice)
        makes systemd do it: every process of the host is signalled now, none is killed; what
        still runs keeps running (and the link stays up) until ``kill()``, the power off.

        On shutdown systemd stops every unit at once (nothing orders the ones below after each
        other), each as its kill settings say (systemd.kill(5)); so here, per process:

        - the listening sshd (Debian's ssh.service has ``KillMode=process``): SIGTERM alone.
          It stops accepting logins; the connections it forked are not its unit's to stop.
        - an SSH login's processes, i.e. the per-connection sshds and all they started, tasks
          detached with ``setsid`` included (pam_systemd put the whole login in a
          session-N.scope; a new session or process group does not leave a cgroup): SIGTERM
          (with SIGCONT), then at once SIGHUP, because logind makes session scopes with
          ``SendSIGHUP=yes`` ("since bash and friends tend to ignore SIGTERM"). Open SSH
          connections drop; a task must ignore or handle SIGHUP as well to outlive the hangup
          and save. ``hangup=False`` sends SIGTERM alone, as a non-systemd init would.
        - any other process (started as root with ``run()`` or ``ip netns exec``, as a system
          service would be): SIGTERM (with SIGCONT) alone.

        Processes forked while this runs are signalled as well, for a few passes (systemd
        re-reads a cgroup until no new process shows up). Without a namespace this skips like
        ``kill()``.
        """
        self.lab.require_partition()
        assert self.namespace is not None
        listener = self.sshd.pid if self.sshd is not None and self.sshd.poll() is None else None
        signalled: set[int] = set()
        for _ in range(5):
            fresh = [pid for pid in _netns_pids(self.namespace) if pid not in signalled]
            if not fresh:
                return
            logins = [pid for pid in fresh if pid != listener and _of_ssh_login(pid, listener)]
            for pid in fresh:
                _signal(pid, signal.SIGTERM)
                _signal(pid, signal.SIGCONT)
            if hangup:
                for pid in logins:
                    _signal(pid, signal.SIGHUP)
            signalled.update(fresh)

    def is_down(self) -> bool:
        """Whether no process of the host is left (after ``shut_down()``: the guest is done
        and would power itself off)."""
        if self.sshd is not None:
            self.sshd.poll()  # reap the listener if it has exited
        if not self.namespace:
            return not self.sshd_running and not _login_pids(self.user)
        return not _netns_pids(self.namespace)

    def cut(self) -> None:
        """Take the host's network link down: it stops answering, nothing is closed."""
        self.lab.require_partition()
        _cmd("ip", "-n", str(self.namespace), "link", "set", str(self.link), "down")
        self.is_cut = True

    def restore(self) -> None:
        """Bring the host's link back up after ``cut()``."""
        if self.namespace:
            _cmd("ip", "-n", self.namespace, "link", "set", str(self.link), "up")
        self.is_cut = False

    def throttle(self, rate: str, *, to: str) -> None:
        """Slow what this host sends to address ``to`` down to ``rate`` (tc units: "80mbit").

        Like a controller on a laptop outside the cloud: an htb class with a token bucket,
        chosen by a u32 filter on the destination, so traffic to every other address (the
        other hosts) keeps the link's full speed. ``unthrottle()`` or ``heal()`` removes it.
        """
        self.lab.require_partition()
        self.unthrottle()
        dev = str(self.link)
        self.throttled_to = to
        for step in (
            f"qdisc add dev {dev} root handle 1: htb default 10",
            f"class add dev {dev} parent 1: classid 1:10 htb rate 10gbit",
            f"class add dev {dev} parent 1: classid 1:20 htb rate {rate} ceil {rate}",
            f"filter add dev {dev} parent 1: protocol ip prio 1 u32 match ip dst {to}/32 flowid 1:20",
            f"qdisc add dev {dev} parent 1:20 handle 20: tbf rate {rate} burst 64kb latency 100ms",
        ):
            _cmd("tc", "-n", str(self.namespace), *step.split())

    def limit_link(self, rate: str | None) -> None:
        """Cap what this host sends to every address but the throttled one at ``rate`` (None:
        back to 10 Gbit/s, which slows nothing), as a separate machine's own NIC or disk would:
        the lab's hosts share this machine's cores, so without a cap a copy between them is
        bound by the CPU they share. Needs ``throttle()`` first (it is that htb's default class)."""
        if not self.namespace or self.throttled_to is None:
            raise RuntimeError("limit_link needs throttle() first")
        rate = rate or "10gbit"
        _cmd("tc", "-n", self.namespace, "class", "change", "dev", str(self.link), "parent", "1:",
             "classid", "1:10", "htb", "rate", rate, "ceil", rate, "burst", "256k", "cburst", "256k")

    def unthrottle(self) -> None:
        """Remove ``throttle()``: the link is back at full speed."""
        if self.namespace and self.throttled_to is not None:
            _cmd("tc", "-n", self.namespace, "qdisc", "del", "dev", str(self.link), "root", check=False)
        self.throttled_to = None

    def throttled_bytes(self) -> int:
        """Bytes sent through the throttle so far (0 when there is none)."""
        if not self.namespace or self.throttled_to is None:
            return 0
        out = _cmd("tc", "-n", self.namespace, "-s", "class", "show", "dev", str(self.link)).stdout
        match = re.search(r"class htb 1:20 .*?\n\s*Sent (\d+) bytes", out, re.S)
        return int(match.group(1)) if match else 0

    def restart_sshd(self) -> None:
        self.stop_sshd()
        self.start_sshd()

    def rotate_host_key(self) -> None:
        """Give the host a new host key (as a re-created machine has) and restart its sshd."""
        for path in self.dir.glob("ssh_host_ed25519_key*"):
            path.unlink()
        self.host_key_line = _keygen(self.dir / "ssh_host_ed25519_key", self.name)
        self.lab.write_known_hosts()
        self.restart_sshd()

    def serve_podman(self, *, user: str | None, without_init: bool = False) -> str:
        """A rootful podman service in this host's network namespace, as a docker daemon is
        on a GPU VM; its socket given to ``user`` (None: root only, a user without access),
        and ``CONTAINER_HOST`` set for the plain user's SSH sessions, so that ``podman`` there
        is a client of it. Started with ``nsenter --net`` (``ip netns exec`` remounts /sys,
        and runc then finds no cgroup mount), in a mount namespace of its own where
        /etc/hosts is the host's (``hosts_path``), which podman copies into a container on the
        host's network. Returns the socket's URL.

        ``without_init``: in that mount namespace, podman's helper directory (``INIT_DIR``:
        catatonit, which ``--init`` runs) is an empty one, as on a host whose podman came
        without its Recommends. The service is restarted whenever this differs from the
        running one's."""
        if self.podman is not None and self.podman_without_init != without_init:
            self.stop_podman()
        if self.podman is None or self.podman.poll() is not None:
            socket_path = self.dir / "podman.sock"
            socket_path.unlink(missing_ok=True)
            argv = ["podman", "--runtime", "runc", "system", "service", "--time=0",
                    f"unix://{socket_path}"]
            binds: list[tuple[str, str]] = []
            if self.hosts_path is not None:
                # podman copies its own /etc/hosts into a --network host container, which
                # keeps the host's name: so the host's, as on a real machine (JAX's gloo
                # looks its own name up and tells its peers that address)
                binds.append((self.hosts_path, "/etc/hosts"))
            if without_init:
                empty = self.dir / "no-init"
                empty.mkdir(exist_ok=True)
                binds.append((str(empty), INIT_DIR))
            if binds:
                mounts = " && ".join(f"mount --bind {shlex.quote(source)} {shlex.quote(target)}"
                                     for source, target in binds)
                argv = ["unshare", "--mount", "--propagation", "slave", "sh", "-c",
                        f'{mounts} && exec "$@"', "sh", *argv]
            if self.namespace:
                argv = ["nsenter", f"--net=/var/run/netns/{self.namespace}", *argv]
            self.podman_without_init = without_init
            with open(self.dir / "podman.log", "ab") as log:
                self.podman = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                               stderr=subprocess.STDOUT, start_new_session=True)
            deadline = time.monotonic() + 30
            while not socket_path.exists():
                if self.podman.poll() is not None or time.monotonic() > deadline:
                    raise LabError(f"podman service of {self.name} did not start: "
                                   f"{(self.dir / 'podman.log').read_text()[-1000:]}")
                time.sleep(0.05)
        socket_path = self.dir / "podman.sock"
        if user is None:
            os.chown(socket_path, 0, 0)
        else:
            shutil.chown(socket_path, user)
        socket_path.chmod(0o600)
        url = f"unix://{socket_path}"
        if self.session_env != f"CONTAINER_HOST={url}":
            self.session_env = f"CONTAINER_HOST={url}"
            (self.dir / "sshd_config").write_text(self.lab._sshd_config(self))
            self.restart_sshd()
        return url

    def stop_podman(self) -> None:
        if self.podman is not None:
            if self.podman.poll() is None:
                self.podman.terminate()
                try:
                    self.podman.wait(15)
                except subprocess.TimeoutExpired:
                    self.podman.kill()
                    self.podman.wait(10)
            self.podman = None

    def start_sshd(self) -> None:
        argv = [SSHD, "-D", "-e", "-f", str(self.dir / "sshd_config")]
        if self.namespace:
            argv = ["ip", "netns", "exec", self.namespace, *argv]
        with open(self.dir / "sshd.log", "ab") as log:
            self.sshd = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._wait_for_banner()

    def stop_sshd(self) -> None:
        """Stop the listening sshd and, without a namespace, the sessions it forked."""
        if self.sshd is not None and self.sshd.poll() is None:
            sessions = [] if self.namespace else _children(self.sshd.pid)
            self.sshd.terminate()
            _kill(sessions)
            try:
                self.sshd.wait(5)
            except subprocess.TimeoutExpired:
                self.sshd.kill()
        self._reap_sshd()

    def heal(self) -> None:
        """Undo cut(), throttle(), map_hostname() and kill(): link up at full speed, the host
        name resolving to the host's address, sshd running."""
        if self.is_cut:
            self.restore()
        if self.throttled_to is not None:
            self.unthrottle()
        if self.namespace and self.hostname_address != self.address:
            self.map_hostname()
        if not self.sshd_running:
            self._reap_sshd()
            self.start_sshd()

    def _reap_sshd(self) -> None:
        if self.sshd is not None:
            with contextlib.suppress(ProcessLookupError):
                self.sshd.kill()
            self.sshd.wait(10)
            self.sshd = None

    def _wait_for_banner(self) -> None:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.sshd is None or self.sshd.poll() is not None:
                raise LabError(f"sshd of {self.name} exited: {self._log_tail()}")
            if _answers_ssh(self.address, self.port):
                return
            time.sleep(0.05)
        raise LabError(f"sshd of {self.name} on {self.address}:{self.port} never answered")

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return (self.dir / "sshd.log").read_text(errors="replace")[-2000:]
        return "(no log)"


class HostLab:
    """A set of SSH test hosts on one bridge, owned by this process; see the module docstring."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.tag = f"orch{self.pid}{'abcdefghijklmnopqrstuvwxyz'[next(_LAB_SERIAL) % 26]}"
        self.dir = Path(tempfile.mkdtemp(prefix=f"orchlab-{self.tag[4:]}-"))
        self.client_key_path = str(self.dir / "client_key")
        self.known_hosts_path = str(self.dir / "known_hosts")
        self.authorized_keys_path = str(self.dir / "authorized_keys")
        self.can_partition = True
        self.reason = ""
        self.bridge: str | None = None
        self.network: ipaddress.IPv4Network | None = None
        self.created: dict[str, list[str]] = {"netns": [], "link": [], "user": [], "path": []}
        self.acl_entries: list[tuple[str, str]] = []  # (directory, user) given by plain_user
        self.private_name = f"orchlab-{self.tag[4:]}-private"
        self._hosts: list[LabHost] = []
        self._lock = threading.Lock()
        self._close_lock = threading.RLock()  # re-entrant: a signal handler may close mid-close
        self._closed = False

    @property
    def bridge_address(self) -> str | None:
        """The controller's address on the lab network (None in the loopback fallback)."""
        return str(self.network.network_address + 1) if self.network else None

    @classmethod
    def start(cls) -> HostLab:
        """Create an empty lab (hosts come from ``hosts(n)``), cleaning stale labs first."""
        ensure_tools()
        clean_stale()
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        lab = cls()
        _OPEN_LABS.add(lab)
        atexit.register(lab.close_quietly)
        try:
            _keygen(Path(lab.client_key_path), "hostlab-client")
            Path(lab.authorized_keys_path).write_text(Path(lab.client_key_path + ".pub").read_text())
            lab._choose_mode()
        except BaseException:
            lab.close_quietly()
            raise
        return lab

    def hosts(self, n: int) -> list[LabHost]:
        """The first ``n`` hosts of the lab, created if missing, healed if cut or killed."""
        with self._lock:
            while len(self._hosts) < n:
                self._hosts.append(self._new_host(len(self._hosts)))
                self.write_known_hosts()
            chosen = self._hosts[:n]
            for host in chosen:
                host.heal()
        return chosen

    def shared_user(self) -> str:
        """A user every host lets in (see the module docstring); created on the first call."""
        user = f"{self.tag}g"
        with self._lock:
            if user not in self.created["user"]:
                self._add_user(user, str(self.dir))
        return user

    def plain_user(self) -> str:
        """An unprivileged user every host lets in (see the module docstring)."""
        user = f"{self.tag}q"
        with self._lock:
            if user not in self.created["user"]:
                _with_retries("useradd", "-M", "-s", "/bin/sh", "-p", "*", "-d",
                              str(self.dir / "plain-home"), user)
                self.created["user"].append(user)
                self.dir.chmod(0o711)  # the user's homes and the authorized keys are in here
                login_home = self.dir / "plain-home"  # its passwd home: sshd starts there
                login_home.mkdir(mode=0o700, exist_ok=True)
                shutil.chown(login_home, user, user)
                for host in self._hosts:
                    self._plain_home(host, user)
                self._let_run_python(user)
        return user

    def _plain_home(self, host: LabHost, user: str) -> None:
        home = Path(host.plain_home)
        home.mkdir(exist_ok=True)
        shutil.chown(home, user, user)
        home.chmod(0o700)

    def _let_run_python(self, user: str) -> None:
        """POSIX ACL entries (execute only, for ``user``) on the directories above this run's
        interpreter, its shared library and its site-packages that others may not enter."""
        if shutil.which("setfacl") is None:
            ensure_tools(acl=True)
        targets = [os.path.realpath(sys.executable), sysconfig.get_paths()["purelib"],
                   sysconfig.get_config_var("LIBDIR") or sys.base_prefix]
        closed: list[str] = []
        for target in targets:
            for parent in [*reversed(Path(target).parents), Path(target)]:
                mode = parent.stat().st_mode if parent.exists() else 0
                if parent.is_dir() and not mode & stat.S_IXOTH and str(parent) not in closed:
                    closed.append(str(parent))
        for directory in closed:
            _cmd("setfacl", "-m", f"u:{user}:x", directory)
            self.acl_entries.append((directory, user))

    def _remove_acl_entries(self) -> None:
        for directory, user in reversed(self.acl_entries):
            _cmd("setfacl", "-x", f"u:{user}", directory, check=False)
            left = _cmd("getfacl", "-c", "-n", directory, check=False).stdout
            if not re.search(r"^(user|group):\d+:", left, re.M):
                _cmd("setfacl", "-b", directory, check=False)  # no other named entry: as before
        self.acl_entries.clear()

    def require_partition(self) -> None:
        """Skip the calling test, with the reason, where hosts cannot be cut off or killed."""
        if not self.can_partition:
            pytest.skip(self.reason)

    def unused_address(self) -> tuple[str, int]:
        """An address and port in the lab network where no host answers."""
        if self.network is not None:
            return str(self.network.network_address + 250), 22
        return "127.0.0.250", _free_port("127.0.0.250")

    def write_known_hosts(self) -> None:
        lines = [
            f"{h.address if h.port == 22 else f'[{h.address}]:{h.port}'} {h.host_key_line}\n"
            for h in self._hosts
        ]
        Path(self.known_hosts_path).write_text("".join(lines))

    # -- setup -----------------------------------------------------------
    def _choose_mode(self) -> None:
        if os.environ.get(FORCE_LOOPBACK_ENV) == "1":
            self._use_loopback(f"{FORCE_LOOPBACK_ENV}=1 forces the loopback fallback")
            return
        try:
            self._make_bridge()
        except LabError as exc:
            self._use_loopback(f"network namespaces are unavailable here ({exc})")

    def _use_loopback(self, why: str) -> None:
        self.can_partition = False
        self.reason = f"{why}: test hosts are sshds on 127.0.0.x and cannot be cut off or killed"

    def _make_bridge(self) -> None:
        probe = f"{self.tag}t"
        _cmd("ip", "netns", "add", probe)
        _cmd("ip", "netns", "del", probe)
        # Labs of parallel pytest processes (xdist workers) choose their subnets one at a time:
        # a subnet is free only once no other lab's bridge holds an address in it.
        with open(Path(tempfile.gettempdir()) / "orchlab-subnets.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.network = _free_subnet(self.pid)
            bridge = f"{self.tag}br"
            _cmd("ip", "link", "add", bridge, "type", "bridge")
            self.created["link"].append(bridge)
            self.bridge = bridge
            _cmd("ip", "addr", "add", f"{self.bridge_address}/24", "dev", bridge)
        _cmd("ip", "link", "set", bridge, "up")

    def _new_host(self, i: int) -> LabHost:
        host = self._describe_host(i)
        host.dir.mkdir()
        Path(host.home).mkdir()
        if host.namespace:
            self._plug(host)
            self._make_private_dir(host)
            self.created["path"].append(str(host.hosts_path))
            host.map_hostname()
        self._add_user(host.user, host.home)
        if f"{self.tag}q" in self.created["user"]:
            self._plain_home(host, f"{self.tag}q")
        host.host_key_line = _keygen(host.dir / "ssh_host_ed25519_key", host.name)
        (host.dir / "sshd_config").write_text(self._sshd_config(host))
        try:
            host.start_sshd()
        except BaseException:
            host.stop_sshd()
            raise
        return host

    def _describe_host(self, i: int) -> LabHost:
        namespace: str | None = None
        if self.network is not None:
            address = str(self.network.network_address + 2 + i)
            port, namespace = 22, f"{self.tag}n{i}"
        else:
            address = f"127.0.0.{2 + i}"
            port = _free_port(address)
        link = f"{self.tag}p{i}" if namespace else None
        if len(f"{self.tag}h{i}") > 15:
            raise LabError(f"interface name {self.tag}h{i} is longer than 15 characters")
        return LabHost(
            lab=self,
            index=i,
            name=f"labhost{i}",
            address=address,
            port=port,
            user=f"{self.tag}u{i}",
            home=str(self.dir / f"home{i}"),
            namespace=namespace,
            link=link,
            dir=self.dir / f"host{i}",
        )

    def _plug(self, host: LabHost) -> None:
        """Make the host's namespace and connect it to the bridge with a veth pair."""
        ns, peer, veth = str(host.namespace), str(host.link), f"{self.tag}h{host.index}"
        _cmd("ip", "netns", "add", ns)
        self.created["netns"].append(ns)
        _cmd("ip", "link", "add", veth, "type", "veth", "peer", "name", peer, "netns", ns)
        self.created["link"].append(veth)
        _cmd("ip", "link", "set", veth, "master", str(self.bridge), "up")
        _cmd("ip", "-n", ns, "addr", "add", f"{host.address}/24", "dev", peer)
        _cmd("ip", "-n", ns, "link", "set", peer, "up")
        _cmd("ip", "-n", ns, "link", "set", "lo", "up")

    def _make_private_dir(self, host: LabHost) -> None:
        """The mount point /etc/NAME here, and /etc/netns/NS/NAME that ``ip netns exec``
        binds over it for the host's sshd and everything it starts (before sshd starts)."""
        netns, mount_point = Path("/etc/netns"), Path("/etc") / self.private_name
        if not mount_point.exists():
            self._mkdir(mount_point, 0o755)
        for _ in range(20):  # another lab may remove /etc/netns between our two mkdirs
            with contextlib.suppress(FileExistsError):
                self._mkdir(netns, 0o755)
            with contextlib.suppress(FileNotFoundError):
                self._mkdir(netns / str(host.namespace), 0o755)
                break
        self._mkdir(netns / str(host.namespace) / self.private_name, 0o1777)

    def _mkdir(self, path: Path, mode: int) -> None:
        """Make ``path`` (not its parents) and remember it for close()."""
        path.mkdir()
        self.created["path"].append(str(path))
        path.chmod(mode)

    def _add_user(self, user: str, home: str) -> None:
        uid_0_alias = ["-o", "-u", "0", "-g", "0", "-M", "-s", "/bin/sh", "-p", "*"]
        _with_retries("useradd", *uid_0_alias, "-d", home, user)
        self.created["user"].append(user)

    def _sshd_config(self, host: LabHost) -> str:
        settings = {
            "Port": str(host.port),
            "ListenAddress": host.address,
            "HostKey": str(host.dir / "ssh_host_ed25519_key"),
            "PidFile": str(host.dir / "sshd.pid"),
            "AuthorizedKeysFile": f"{self.authorized_keys_path} {host.authorized_keys_path}",
            "AllowUsers": f"{host.user} {self.tag}g {self.tag}q",
            "PasswordAuthentication": "no",
            "KbdInteractiveAuthentication": "no",
            "PubkeyAuthentication": "yes",
            "PermitRootLogin": "prohibit-password",
            "UsePAM": "no",
            "StrictModes": "no",
            "UseDNS": "no",
            "PrintMotd": "no",
            "Subsystem": "sftp internal-sftp",
        }
        shared = (f"Match User {self.tag}g\n    SetEnv HOME={host.home}\n"
                  f"Match User {self.tag}q\n    SetEnv HOME={host.plain_home} "
                  f"{host.session_env}\n")
        return "".join(f"{key} {value}\n" for key, value in settings.items()) + shared

    # -- teardown --------------------------------------------------------
    def close(self) -> None:
        """Remove every process, namespace, link, user and file of the lab, by pid and name."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        _OPEN_LABS.discard(self)
        problems: list[str] = []
        for step in (self._stop_hosts, self._delete_network, self._remove_acl_entries,
                     self._delete_users,
                     self._delete_paths):
            try:
                step()
            except (LabError, OSError, subprocess.SubprocessError) as exc:
                problems.append(str(exc))
        shutil.rmtree(self.dir, ignore_errors=True)
        if problems:
            raise LabError("lab teardown incomplete: " + "; ".join(problems))

    def close_quietly(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def _stop_hosts(self) -> None:
        for host in self._hosts:
            host.stop_podman()
            if host.namespace:
                _kill_namespace(host.namespace)
            else:
                _kill(_login_pids(host.user))
            host.stop_sshd()

    def _delete_network(self) -> None:
        """Delete the namespaces, then whatever links the kernel has not removed with them."""
        for ns in self.created["netns"]:
            _kill_namespace(ns)
            _cmd("ip", "netns", "del", ns)
        for link in self.created["link"]:
            _cmd("ip", "link", "del", link, check=False)
        deadline = time.monotonic() + 10  # veths of deleted namespaces go away asynchronously
        while remaining := _existing_links(self.created["link"]):
            if time.monotonic() > deadline:
                raise LabError(f"links still present after deletion: {', '.join(remaining)}")
            time.sleep(0.05)

    def _delete_users(self) -> None:
        for user in self.created["user"]:
            _kill(_login_pids(user))
            _delete_user(user)

    def _delete_paths(self) -> None:
        """Remove the directories and files the lab made, newest first: the hosts' /etc/hosts
        (which a lab built on this one may have removed already), the private directories with
        what tests left in them, /etc/netns/NS (empty by then), and /etc/netns if still empty."""
        for path in reversed(self.created["path"]):
            if Path(path).name == self.private_name:
                shutil.rmtree(path)
            elif path == "/etc/netns":
                with contextlib.suppress(OSError):  # another lab's namespace may use it now
                    os.rmdir(path)
            elif Path(path).name == HOSTS_FILE:
                Path(path).unlink(missing_ok=True)
            else:
                os.rmdir(path)


def _link_names() -> list[str]:
    return re.findall(r"^\d+: ([^:@\s]+)", _cmd("ip", "-o", "link", "show").stdout, re.M)


def _existing_links(names: Sequence[str]) -> list[str]:
    present = set(_link_names())
    return [name for name in names if name in present]


def _free_subnet(pid: int) -> ipaddress.IPv4Network:
    """A /24 of 198.18.0.0/15 that no address or route here overlaps, starting from the pid."""
    text = _cmd("ip", "-4", "-o", "addr", "show").stdout + _cmd("ip", "-4", "route").stdout
    used = [
        ipaddress.ip_network(m, strict=False)
        for m in re.findall(r"(?:inet |^)(\d+\.\d+\.\d+\.\d+(?:/\d+)?)", text, re.M)
    ]
    for k in range(512):
        idx = (pid + k) % 512
        net = ipaddress.IPv4Network(f"198.{18 + idx // 256}.{idx % 256}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise LabError("no free /24 left in 198.18.0.0/15 for a test lab")


def _close_open_labs(signum: int, frame: FrameType | None) -> None:
    for lab in list(_OPEN_LABS):
        lab.close_quietly()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install_signal_cleanup() -> None:
    """On SIGTERM or SIGHUP (left at their defaults), remove the labs, then die of the signal."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, _close_open_labs)


# -- pytest hooks and fixtures -----------------------------------------------
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "netns: cuts or kills lab hosts; skipped in the loopback fallback")


@pytest.fixture(scope="session")
def hostlab() -> Iterator[HostLab]:
    """The session's lab of SSH test hosts; ``hostlab.hosts(n)`` hands them out."""
    _install_signal_cleanup()
    lab = HostLab.start()
    try:
        yield lab
    finally:
        lab.close()


@pytest.fixture(autouse=True)
def _skip_netns_tests_without_namespaces(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("netns") is not None:
        lab: HostLab = request.getfixturevalue("hostlab")
        lab.require_partition()
