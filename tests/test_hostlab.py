"""The host lab itself: hosts talk across namespaces, faults work, teardown leaves nothing."""

from __future__ import annotations

import contextlib
import os
import pwd
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from hostlab import FORCE_LOOPBACK_ENV, HostLab, LabHost, clean_stale, hosts_file

from orchestrator.errors import HostUnreachableError
from orchestrator.remote.base import LaunchSpec
from orchestrator.remote.ssh import SSHRunner

pytestmark = pytest.mark.ssh

FETCH = """
import sys, time, urllib.request
for _ in range(100):
    try:
        print(urllib.request.urlopen(sys.argv[1], timeout=1).read().decode()); break
    except OSError:
        time.sleep(0.1)
else:
    sys.exit("never answered")
"""


# The addresses this host's name resolves to, in order (gloo binds the first it can).
RESOLVE_OWN_NAME = ("import socket; print(*dict.fromkeys(i[4][0] for i in socket.getaddrinfo("
                    "socket.gethostname(), None, type=socket.SOCK_STREAM)))")


def in_namespace(host: LabHost, *argv: str, cwd: str | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        ["ip", "netns", "exec", str(host.namespace), *argv],
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def leftovers(tag: str) -> list[str]:
    """Every namespace, link, user and /etc/netns entry (a host's own /etc files) whose name
    holds ``tag``."""
    netns = Path("/etc/netns")
    listings = (
        subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout,
        subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout,
        Path("/etc/passwd").read_text(),
        "\n".join(str(p) for p in netns.iterdir()) if netns.is_dir() else "",
    )
    return [line for text in listings for line in text.splitlines() if tag in line]


def tcp_connects(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=1).close()
    except OSError:
        return False
    return True


def children_in(host: LabHost, parent: int) -> list[int]:
    """The processes of ``host`` whose parent is ``parent``."""
    pids = subprocess.run(["ip", "netns", "pids", str(host.namespace)], capture_output=True,
                          text=True).stdout.split()
    found = []
    for pid in pids:
        with contextlib.suppress(OSError):
            if int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) == parent:
                found.append(int(pid))
    return found


def dead(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"


@pytest.mark.netns
def test_hosts_reach_each_other_over_tcp_across_namespaces(hostlab: HostLab, tmp_path: Path) -> None:
    server_host, client_host = hostlab.hosts(2)
    (tmp_path / "hello.txt").write_text("hello from the other namespace")
    server = in_namespace(
        server_host,
        sys.executable,
        "-m",
        "http.server",
        "8123",
        "--bind",
        server_host.address,
        cwd=str(tmp_path),
    )
    try:
        url = f"http://{server_host.address}:8123/hello.txt"
        fetched = client_host.run([sys.executable, "-c", FETCH, url])
        assert fetched.stdout.strip() == "hello from the other namespace", fetched.stderr
    finally:
        server.kill()
        server.wait()


@pytest.mark.netns
def test_loopback_is_up_inside_each_host(hostlab: HostLab) -> None:
    for host in hostlab.hosts(2):
        assert "UP" in host.run(["ip", "-o", "link", "show", "lo"]).stdout


@pytest.mark.netns
def test_each_hosts_name_resolves_to_its_own_address_over_ssh_until_mapped_elsewhere(
        hostlab: HostLab) -> None:
    user = hostlab.plain_user()
    hosts = hostlab.hosts(2)
    for host in hosts:
        with SSHRunner(host.name, host.endpoint(user=user)) as r:
            own = r.run([sys.executable, "-c", RESOLVE_OWN_NAME]).stdout.split()
            assert own == [host.address]
            assert r.run([sys.executable, "-c", "import socket; print(socket.gethostbyname("
                          "'localhost'))"]).stdout.split() == ["127.0.0.1"]
    here = subprocess.run([sys.executable, "-c", RESOLVE_OWN_NAME], capture_output=True,
                          text=True, check=True).stdout.split()
    assert not set(here) & {h.address for h in hosts}  # this machine's /etc/hosts is untouched
    host = hosts[1]
    host.map_hostname("127.0.1.1")  # Debian's line: for the running sshd's logins at once
    with SSHRunner(host.name, host.endpoint(user=user)) as r:
        assert r.run([sys.executable, "-c", RESOLVE_OWN_NAME]).stdout.split() == ["127.0.1.1"]
    (healed,) = hostlab.hosts(2)[1:]
    with SSHRunner(healed.name, healed.endpoint()) as r:
        assert r.run([sys.executable, "-c", RESOLVE_OWN_NAME]).stdout.split() == [host.address]


def test_a_hosts_file_maps_the_names_to_the_address_alone() -> None:
    debian = ("127.0.0.1\tlocalhost\n127.0.1.1\tvm.example.com vm\n"
              "::1 localhost ip6-localhost VM # the IPv6 ones\n\n# a comment\n10.0.0.5 db\n")
    assert hosts_file(debian, ["vm.example.com", "vm"], "198.18.0.2") == (
        "127.0.0.1\tlocalhost\n::1 localhost ip6-localhost # the IPv6 ones\n\n# a comment\n"
        "10.0.0.5 db\n198.18.0.2 vm.example.com vm\n")


@pytest.mark.netns
def test_kill_stops_sshd_and_every_process_then_hosts_heals_it(hostlab: HostLab) -> None:
    host = hostlab.hosts(2)[1]
    sleeper = in_namespace(host, "sleep", "300")
    time.sleep(0.1)
    host.kill()
    assert sleeper.wait(5) == -9
    assert not host.sshd_running
    pids = subprocess.run(["ip", "netns", "pids", str(host.namespace)], capture_output=True)
    assert pids.stdout.split() == []
    with (
        SSHRunner(host.name, host.endpoint(connect_timeout_s=1.0), connect_deadline_s=1.5) as r,
        pytest.raises(HostUnreachableError),
    ):
        r.run(["true"])
    hostlab.hosts(2)
    assert host.sshd_running


# Writes its pid, then each signal it gets, to the file $1; never exits by itself.
SIGNAL_LOG = """trap 'echo TERM >>"$1"' TERM
trap 'echo HUP >>"$1"' HUP
echo "ready $$" >>"$1"
while :; do sleep 1 & wait $!; done
"""


def detached(script: str, *args: str) -> str:
    """A command line that starts ``sh -c script args`` in a session of its own and returns."""
    return f"setsid sh -c {shlex.quote(script)} sh {shlex.join(args)} >/dev/null 2>&1 </dev/null &"


def wait_for_lines(path: Path, wanted: set[str], timeout: float = 20) -> list[str]:
    """The lines of ``path`` once they include ``wanted`` (the first word of each counts)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = path.read_text().split("\n") if path.exists() else []
        if wanted <= {line.split(" ")[0] for line in lines if line}:
            return [line for line in lines if line]
        assert time.monotonic() < deadline, f"{path} never held {sorted(wanted)}: {lines}"
        time.sleep(0.05)


@pytest.mark.netns
def test_shut_down_terms_every_process_hangs_up_ssh_logins_and_kills_nothing(
        hostlab: HostLab, tmp_path: Path) -> None:
    user = hostlab.plain_user()
    host = hostlab.hosts(2)[1]
    login_log, service_log = Path(host.plain_home, "signals"), tmp_path / "service-signals"
    login_log.unlink(missing_ok=True)
    service = in_namespace(host, "sh", "-c", SIGNAL_LOG, "sh", str(service_log))
    with SSHRunner(host.name, host.endpoint(user=user)) as r:  # detached, in a session of its own
        r.run(detached(SIGNAL_LOG, str(login_log)))
    task = int(wait_for_lines(login_log, {"ready"})[0].split()[1])
    wait_for_lines(service_log, {"ready"})
    with SSHRunner(host.name, host.endpoint(connect_timeout_s=1.0), connect_deadline_s=1.5) as open_:
        assert open_.run(["true"]).exit_code == 0
        assert host.sshd is not None
        connection = children_in(host, host.sshd.pid)  # the open connection's own sshd
        assert connection
        host.shut_down()
        # the login's processes get SIGTERM and SIGHUP (session scope), a service SIGTERM alone
        assert sorted(wait_for_lines(login_log, {"TERM", "HUP"})[1:]) == ["HUP", "TERM"]
        assert wait_for_lines(service_log, {"TERM"})[1:] == ["TERM"]
        deadline = time.monotonic() + 10
        while host.sshd_running or tcp_connects(host.address, host.port):  # sshd took its TERM
            assert time.monotonic() < deadline, "the listening sshd outlived SIGTERM"
            time.sleep(0.05)
        deadline = time.monotonic() + 10
        while not all(dead(pid) for pid in connection):  # the open connection is hung up
            assert time.monotonic() < deadline, "an SSH connection outlived the shutdown"
            time.sleep(0.05)
        with pytest.raises(HostUnreachableError):
            open_.run(["true"])
    assert not dead(task) and service.poll() is None and not host.is_down()  # nothing killed
    host.kill()  # the power off
    assert dead(task) and service.wait(5) == -9 and host.is_down()
    assert service_log.read_text().split("\n")[1:] == ["TERM", ""]
    hostlab.hosts(2)
    assert host.sshd_running


@pytest.mark.netns
def test_cut_and_restore_take_the_link_down_and_up(hostlab: HostLab) -> None:
    host = hostlab.hosts(1)[0]
    assert tcp_connects(host.address, host.port)
    host.cut()
    try:
        assert not tcp_connects(host.address, host.port)
    finally:
        host.restore()
    with SSHRunner(host.name, host.endpoint()) as r:
        assert r.run(["echo", "back"]).stdout == "back\n"


def test_a_second_lab_leaves_nothing_behind_after_close(hostlab: HostLab) -> None:
    lab = HostLab.start()
    try:
        hosts = lab.hosts(2)
        with SSHRunner(hosts[0].name, hosts[0].endpoint()) as r:
            home = hosts[0].home
            handle = r.start(LaunchSpec(("sleep", "300"), home, f"{home}/t.log", f"{home}/t.rc"))
        sshd_pids = [h.sshd.pid for h in hosts if h.sshd]
        files = [h.hosts_path for h in hosts if h.hosts_path]
        assert len(files) == 2 * lab.can_partition and all(Path(f).is_file() for f in files)
        assert lab.tag != hostlab.tag
        assert lab.network is None or lab.network != hostlab.network
        assert leftovers(lab.tag)
    finally:
        lab.close()
    assert leftovers(lab.tag) == []
    assert not any(Path(f).exists() for f in files)
    assert all(dead(pid) for pid in [*sshd_pids, handle.pgid])
    assert not lab.dir.exists()


def test_loopback_fallback_serves_ssh_and_skips_partition_faults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(FORCE_LOOPBACK_ENV, "1")
    lab = HostLab.start()
    try:
        (host,) = lab.hosts(1)
        assert host.address.startswith("127.0.0.") and host.namespace is None
        assert not lab.can_partition and FORCE_LOOPBACK_ENV in lab.reason
        with SSHRunner(host.name, host.endpoint()) as r:
            assert r.run(["echo", "$LOGNAME"]).stdout == "$LOGNAME\n"
            assert r.run("echo $LOGNAME").stdout == f"{host.user}\n"
        with pytest.raises(pytest.skip.Exception, match="loopback"):
            host.cut()
        with pytest.raises(pytest.skip.Exception, match="loopback"):
            host.kill()
    finally:
        lab.close()
    assert leftovers(lab.tag) == []


ORPHAN = """
import sys, time
sys.path[:0] = sys.argv[1:3]
from hostlab import HostLab
lab = HostLab.start()
(host,) = lab.hosts(1)
print(lab.tag, host.sshd.pid, flush=True)
time.sleep(300)
"""


def test_a_lab_whose_process_was_killed_is_removed_by_the_next_cleanup() -> None:
    tests = Path(__file__).parent
    orphan = subprocess.Popen(
        [sys.executable, "-c", ORPHAN, str(tests), str(tests.parent)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert orphan.stdout is not None
    tag, sshd_pid = orphan.stdout.readline().split()
    orphan.kill()
    orphan.wait()
    assert leftovers(tag)
    clean_stale()
    assert leftovers(tag) == []
    assert dead(int(sshd_pid))
    assert not list(Path(tempfile.gettempdir()).glob(f"orchlab-{tag[4:]}-*"))


@pytest.mark.netns
def test_stale_objects_are_removed_only_when_their_owner_is_gone() -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale, live = f"orch{gone.pid}zbr", f"orch{os.getpid()}zbr"
    for name in (stale, live):
        subprocess.run(["ip", "link", "add", name, "type", "bridge"], check=True)
    try:
        clean_stale()
        assert leftovers(stale) == [] and leftovers(live) != []
    finally:
        for name in (stale, live):
            subprocess.run(["ip", "link", "del", name], capture_output=True)


def test_plain_user_is_unprivileged_with_a_home_per_host_and_runs_this_python(
        hostlab: HostLab) -> None:
    user = hostlab.plain_user()
    hosts = hostlab.hosts(2)
    for host in hosts:
        with SSHRunner(host.name, host.endpoint(user=user)) as r:
            uid, home = r.run('id -u; echo "$HOME"').stdout.split()
            assert int(uid) != 0 and home == host.plain_home
            assert not r.run(["touch", "/etc/orchestrate-plain-user-probe"], check=False).ok
            r.run(["touch", f"{home}/mine"])  # its own home is writable
            version = r.run([sys.executable, "-c", "import sys; print(sys.version)"]).stdout
            assert version.strip() == sys.version
    assert Path(hosts[0].plain_home, "mine").is_file()


def test_a_lab_with_a_plain_user_removes_it_and_its_acl_entries(hostlab: HostLab) -> None:
    lab = HostLab.start()
    try:
        lab.hosts(1)
        user = lab.plain_user()
        uid = pwd.getpwnam(user).pw_uid
        entries = list(lab.acl_entries)
    finally:
        lab.close()
    assert user not in Path("/etc/passwd").read_text()
    for directory, _ in entries:
        acl = subprocess.run(["getfacl", "-n", "-p", directory], capture_output=True,
                             text=True, check=True).stdout
        assert f"user:{uid}:" not in acl, acl
