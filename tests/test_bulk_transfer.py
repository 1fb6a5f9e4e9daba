"""Bulk transfers stay off the control path: the checkpoint mirror's one worker thread, and a
run whose large checkpoint is pulled over a slow link while the chief's log keeps arriving."""

from __future__ import annotations

import itertools
import os
import random
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import write_spec
from hostlab import HostLab

from orchestrator import paths, plan, spec
from orchestrator.api import Cluster
from orchestrator.checkpoints import CheckpointMirror, WorkerCommand
from orchestrator.events import Event
from orchestrator.hosts import Host
from orchestrator.remote.base import Runner
from orchestrator.remote.local import LocalRunner
from orchestrator.remote.ssh import SSHRunner
from orchestrator.view import RunView

REPO = Path(__file__).resolve().parent.parent


# -- the mirror, with a local "chief" ---------------------------------------------------------
class SlowLink(LocalRunner):
    """A LocalRunner whose downloads wait while ``gate`` is closed: a transfer on a slow link."""

    def __init__(self) -> None:
        super().__init__("chief")
        self.gate = threading.Event()
        self.gate.set()
        self.downloading = threading.Event()

    def get_file(self, remote_path: str, local_path: str) -> None:
        self.downloading.set()
        assert self.gate.wait(60), "the test never opened the gate"
        super().get_file(remote_path, local_path)


class Calls:
    """What the mirror reported, in order: ("pulling", step or None) and ("mirrored", step)."""

    def __init__(self) -> None:
        self.items: list[tuple[str, int | None]] = []
        self.lock = threading.Lock()

    def pulling(self, step: int | None) -> None:
        with self.lock:
            self.items.append(("pulling", step))

    def mirrored(self, step: int) -> None:
        with self.lock:
            self.items.append(("mirrored", step))

    def of(self, kind: str) -> list[int | None]:
        with self.lock:
            return [step for k, step in self.items if k == kind]


@pytest.fixture
def two_hosts(tmp_path: Path) -> plan.ClusterPlan:
    hosts = [Host(name, "127.0.0.1", str(tmp_path / name)) for name in ("chief", "other")]
    s = spec.parse("name: demo\nworkers: 2\njob: {module: m}\n")
    return plan.build(s, hosts, run_id="r1", python=sys.executable, local_workdir=str(tmp_path))


@pytest.fixture
def link() -> SlowLink:
    return SlowLink()


@pytest.fixture
def calls() -> Calls:
    return Calls()


@pytest.fixture
def busy_max() -> float:
    """The mirror's pacing (a test that needs a second pull at once parametrizes it to 1.0)."""
    return spec.MIRROR_BUSY_MAX


@pytest.fixture
def mirror(tmp_path: Path, link: SlowLink, calls: Calls,
           busy_max: float) -> Iterator[CheckpointMirror]:
    def runner_for(host: Host) -> Runner:
        return link if host.name == "chief" else LocalRunner(host.name)

    m = CheckpointMirror(tmp_path / "mirror", runner_for, worker_here,
                         on_mirrored=calls.mirrored, on_pulling=calls.pulling, busy_max=busy_max)
    yield m
    link.gate.set()
    assert m.close()


def worker_here(host: Host) -> WorkerCommand:
    return WorkerCommand(sys.executable, str(REPO))


def chief_writes(p: plan.ClusterPlan, step: int) -> None:
    directory = Path(p.paths["chief"].chief_checkpoint_dir)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "checkpoint").write_text(f"step {step}\n")


def mirrored_text(m: CheckpointMirror) -> str:
    return (m.current / "chief" / "checkpoint").read_text()


def test_a_requested_checkpoint_is_copied_and_reported(
        mirror: CheckpointMirror, two_hosts: plan.ClusterPlan, calls: Calls) -> None:
    assert mirror.wait(timeout_s=0) and not mirror.has_checkpoint() and mirror.step is None
    chief_writes(two_hosts, 10)
    mirror.request(two_hosts, 10)
    assert mirror.wait()
    assert mirror.has_checkpoint() and mirror.step == 10 and mirrored_text(mirror) == "step 10\n"
    assert calls.items == [("pulling", 10), ("pulling", None), ("mirrored", 10)]


def test_requests_during_a_pull_coalesce_to_the_newest(
        mirror: CheckpointMirror, two_hosts: plan.ClusterPlan, link: SlowLink,
        calls: Calls) -> None:
    link.gate.clear()
    chief_writes(two_hosts, 10)
    mirror.request(two_hosts, 10)
    assert link.downloading.wait(30)
    chief_writes(two_hosts, 30)
    mirror.request(two_hosts, 20)
    mirror.request(two_hosts, 30)
    assert not mirror.wait(timeout_s=0.2)  # a pull is in flight and another one is wanted
    link.gate.set()
    assert mirror.wait()
    assert calls.of("pulling") == [10, None, 30, None]
    assert calls.of("mirrored") == [10, 30]
    assert mirror.step == 30 and mirrored_text(mirror) == "step 30\n"


def test_a_request_made_as_a_pull_ends_is_never_missed(
        mirror: CheckpointMirror, two_hosts: plan.ClusterPlan, calls: Calls) -> None:
    rng = random.Random(7)
    for step in range(1, 41):
        chief_writes(two_hosts, step)
        mirror.request(two_hosts, step)
        time.sleep(rng.uniform(0, 0.02))  # land anywhere in the pull, or just after it
    assert mirror.wait()
    assert mirror.step == 40 and mirrored_text(mirror) == "step 40\n"
    assert calls.of("mirrored")[-1] == 40


def test_a_request_from_the_mirrored_callback_is_served_before_wait_says_idle(
        tmp_path: Path, two_hosts: plan.ClusterPlan) -> None:
    seen: list[int] = []

    def next_one(step: int) -> None:
        seen.append(step)
        if step < 5:
            chief_writes(two_hosts, step + 1)
            m.request(two_hosts, step + 1)

    # Paced to 0.1% of the time, each request of the callback would wait 999 times its pull:
    # wait() serves them at once all the same.
    m = CheckpointMirror(tmp_path / "mirror", lambda h: LocalRunner(h.name), worker_here,
                         on_mirrored=next_one, busy_max=0.001)
    chief_writes(two_hosts, 1)
    m.request(two_hosts, 1)
    assert m.wait()
    assert seen == [1, 2, 3, 4, 5] and m.step == 5
    assert m.close()


def test_pulls_are_paced_to_their_share_of_the_time_and_wait_serves_the_pending_one_now(
        tmp_path: Path, two_hosts: plan.ClusterPlan, calls: Calls) -> None:
    class Slow(LocalRunner):
        def get_file(self, remote_path: str, local_path: str) -> None:
            time.sleep(0.05)  # every pull takes 50 ms or more
            super().get_file(remote_path, local_path)

    # 1% of the time: after a pull of T >= 50 ms, the next waits 99 T >= 4.95 s.
    m = CheckpointMirror(tmp_path / "mirror", lambda h: Slow(h.name), worker_here,
                         on_mirrored=calls.mirrored, on_pulling=calls.pulling, busy_max=0.01)
    chief_writes(two_hosts, 10)
    m.request(two_hosts, 10)
    assert m.wait() and m.step == 10
    chief_writes(two_hosts, 20)
    m.request(two_hosts, 20)
    m.request(two_hosts, 30)  # replaces 20 while it waits its turn
    time.sleep(1.0)
    assert calls.of("pulling") == [10, None]  # not yet: its turn is seconds away
    assert m.wait(timeout_s=30)  # a relaunch wants the newest copy: served at once
    assert calls.of("pulling") == [10, None, 30, None] and m.step == 30
    assert m.close()


def test_a_failed_pull_is_reported_and_the_next_request_still_served(
        mirror: CheckpointMirror, two_hosts: plan.ClusterPlan, calls: Calls) -> None:
    mirror.request(two_hosts, 10)  # the chief has written nothing yet: nothing to pull
    assert mirror.wait()
    assert calls.items == [("pulling", 10), ("pulling", None)]
    assert not mirror.has_checkpoint() and mirror.step is None
    chief_writes(two_hosts, 20)
    mirror.request(two_hosts, 20)
    assert mirror.wait() and mirror.step == 20


# Unpaced: paced, the second pull waits (1 / busy_max - 1) times the first one's length, which
# on a loaded machine (the first pull's listing starts a Python on the "chief") is over 30 s.
@pytest.mark.parametrize("busy_max", [1.0])
def test_push_installs_the_whole_current_copy_while_a_newer_one_is_pulled(
        mirror: CheckpointMirror, two_hosts: plan.ClusterPlan, link: SlowLink,
        tmp_path: Path) -> None:
    chief_writes(two_hosts, 10)
    mirror.request(two_hosts, 10)
    assert mirror.wait()
    link.gate.clear()
    link.downloading.clear()
    chief_writes(two_hosts, 20)
    mirror.request(two_hosts, 20)
    assert link.downloading.wait(30)
    other = two_hosts.paths["other"]
    mirror.push(two_hosts.tasks[1].host, two_hosts.checkpoints.of(two_hosts.tasks[1].host))
    assert Path(other.chief_checkpoint_dir, "checkpoint").read_text() == "step 10\n"
    link.gate.set()
    assert mirror.wait() and mirror.step == 20


def test_close_ends_the_thread_and_later_requests_are_ignored(
        mirror: CheckpointMirror, two_hosts: plan.ClusterPlan, calls: Calls) -> None:
    chief_writes(two_hosts, 10)
    before = set(threading.enumerate())
    mirror.request(two_hosts, 10)
    started = [t for t in set(threading.enumerate()) - before if t.name == "orchestrate-mirror"]
    assert len(started) == 1  # its one thread (another test's mirror may still end its pull)
    assert mirror.wait()
    assert mirror.close()
    assert not started[0].is_alive()
    chief_writes(two_hosts, 20)
    mirror.request(two_hosts, 20)
    assert mirror.wait(timeout_s=0) and mirror.step == 10
    assert calls.of("mirrored") == [10]


class CountingLink(LocalRunner):
    """A LocalRunner that counts the files it downloads."""

    def __init__(self) -> None:
        super().__init__("chief")
        self.got: list[str] = []

    def get_file(self, remote_path: str, local_path: str) -> None:
        self.got.append(Path(remote_path).name)
        super().get_file(remote_path, local_path)


def test_a_pull_downloads_only_the_files_that_changed(tmp_path: Path,
                                                      two_hosts: plan.ClusterPlan) -> None:
    link = CountingLink()
    m = CheckpointMirror(tmp_path / "mirror", lambda h: link, worker_here)
    chief = Path(two_hosts.paths["chief"].chief_checkpoint_dir)
    chief.mkdir(parents=True)
    (chief / "ckpt-1.data-00000-of-00001").write_bytes(os.urandom(1 << 20))
    (chief / "ckpt-1.index").write_bytes(b"i1")
    (chief / "checkpoint").write_text('model_checkpoint_path: "ckpt-1"\n')
    assert m.pull(two_hosts, 1)
    assert sorted(link.got) == ["checkpoint", "ckpt-1.data-00000-of-00001", "ckpt-1.index"]
    assert link.got[0] == "checkpoint"  # the index first: a newer save cannot outrun it

    link.got.clear()
    (chief / "ckpt-2.index").write_bytes(b"i2")
    (chief / "checkpoint").write_text('model_checkpoint_path: "ckpt-2"\n')
    assert m.pull(two_hosts, 2)
    assert sorted(link.got) == ["checkpoint", "ckpt-2.index"]  # ckpt-1's 1 MiB stays
    copy = m.current / "chief"
    assert (copy / "ckpt-1.data-00000-of-00001").read_bytes() == \
        (chief / "ckpt-1.data-00000-of-00001").read_bytes()
    assert m.bytes_pulled == (1 << 20) + 2 * len('model_checkpoint_path: "ckpt-1"\n') + 4
    assert m.close()


def test_auto_turns_the_mirror_off_above_its_limit_and_says_so_once(
        tmp_path: Path, two_hosts: plan.ClusterPlan) -> None:
    said: list[str] = []
    m = CheckpointMirror(tmp_path / "mirror", lambda h: LocalRunner(h.name), worker_here,
                         mode="auto", max_bytes=1000, on_off=said.append)
    chief_writes(two_hosts, 10)
    assert m.pull(two_hosts, 10)  # small: kept
    big = Path(two_hosts.paths["chief"].chief_checkpoint_dir) / "ckpt-2.data-00000-of-00001"
    big.write_bytes(os.urandom(4000))
    for step in (20, 30):
        m.request(two_hosts, step)
        assert m.wait()
    assert not m.enabled and len(said) == 1
    assert "checkpoint.mirror: always" in said[0] and "above" in said[0]
    assert m.step == 10 and not (m.current / "chief" / big.name).exists()  # the older copy stays
    m.request(two_hosts, 40)  # ignored from now on
    assert m.wait(timeout_s=0) and len(said) == 1
    assert m.close()


def test_never_pulls_nothing(tmp_path: Path, two_hosts: plan.ClusterPlan) -> None:
    link = CountingLink()
    m = CheckpointMirror(tmp_path / "mirror", lambda h: link, worker_here, mode="never")
    chief_writes(two_hosts, 10)
    m.request(two_hosts, 10)
    assert m.wait() and not m.pull(two_hosts, 10)
    assert link.got == [] and not m.has_checkpoint()
    assert m.close()


# -- the lab's throttle -------------------------------------------------------------------------
@pytest.mark.ssh
@pytest.mark.netns
def test_throttle_slows_only_traffic_to_its_address_and_heal_removes_it(hostlab: HostLab) -> None:
    host, other = hostlab.hosts(2)
    assert hostlab.bridge_address is not None
    host.throttle("200mbit", to=hostlab.bridge_address)
    try:
        with SSHRunner(host.name, host.endpoint()) as runner:
            runner.run(["head", "-c", "2000000", "/dev/zero"])  # 2 MB to the controller
        assert host.throttled_bytes() >= 2_000_000
        before = host.throttled_bytes()
        to_other_host = (f"import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
                         f"[s.sendto(b'x' * 1400, ({other.address!r}, 9)) for _ in range(1000)]")
        assert host.run([sys.executable, "-c", to_other_host]).returncode == 0
        assert host.throttled_bytes() - before < 100_000  # 1.4 MB went to the other host
    finally:
        host.heal()
    qdiscs = host.run(["tc", "qdisc", "show", "dev", str(host.link)]).stdout
    assert "htb" not in qdiscs and "tbf" not in qdiscs and host.throttled_bytes() == 0


# -- acceptance: a large checkpoint over a slow link ------------------------------------------
MIB = 256  # the checkpoint's size
RATE_MBIT = 160  # the chief's link to the controller: 20 MB/s, so one pull takes ~13 s
POLL_S = 4
EVERY = 300  # one checkpoint, early; training goes on (paced) until the pull is done
# After the last step each task saves 256 MiB as the model and hashes it, printing nothing:
# under a full suite's load that was once over 60 s, and the watchdog called it hung.
HANG_S = 180
BODY = f"""\
name: bulk
job: {{module: tests.workloads.big_state, epochs: 1, steps_per_epoch: {2 * EVERY - 1},
       progress_every_steps: 1}}
checkpoint: {{every_steps: {EVERY}}}
retry: {{max_restarts: 2, backoff_initial_s: 0.2, backoff_max_s: 1}}
timeouts: {{stop_grace_s: 1, poll_s: {POLL_S}, hang_s: {HANG_S}, startup_s: 180}}
env: {{BIG_STATE_MIB: "{MIB}", BIG_STATE_PACE_FROM: "{EVERY}", BIG_STATE_PACE_S: "0.2"}}
"""
CACHES = "  sync_excludes: [.mypy_cache, .ruff_cache, .pytest_cache]\n"


@pytest.mark.ssh
@pytest.mark.tf
@pytest.mark.netns
def test_large_checkpoint_pulled_over_a_slow_link_never_holds_up_the_watch_loop(
        hostlab: HostLab, tmp_path: Path) -> None:
    hosts = hostlab.hosts(2)
    chief = hosts[0]
    assert hostlab.bridge_address is not None
    cluster = Cluster.from_spec(write_spec(tmp_path, hostlab, hosts, BODY, provider_extra=CACHES))
    chief_events: list[tuple[float, bool]] = []  # (when, while a pull ran)
    pull: dict[str, float] = {}
    throttled_bytes: list[int] = []

    def release(view: RunView) -> None:
        """The pull is over: full speed again, on the link and in training."""
        throttled_bytes.append(chief.throttled_bytes())
        chief.unthrottle()
        for h in hosts:
            run_dir = paths.RunPaths.of(paths.host_root(h.home, "bulk"), view.run_id).run_dir
            h.run(["touch", f"{run_dir}/release"])

    def listener(view: RunView, event: Event | None) -> None:
        now = time.monotonic()
        if event is not None and event.kind == "progress" and event.task == "worker:0":
            chief_events.append((now, view.mirroring_step is not None))
        if view.mirroring_step is not None:
            pull.setdefault("start", now)
        if view.mirrored_step is not None and "end" not in pull:
            pull["end"] = now
            release(view)

    chief.throttle(f"{RATE_MBIT}mbit", to=hostlab.bridge_address)
    try:
        result = cluster.train(listener=listener).wait()
    finally:
        for h in hosts:
            h.heal()
        cluster.down()

    assert result.status == "succeeded"
    assert [(a.status, a.cause) for a in result.attempts] == [("succeeded", "")], \
        [f"attempt {a.number}: {a.cause} {a.detail}" for a in result.attempts]
    assert "end" in pull, "the chief's checkpoint was never mirrored"
    # the pull crossed the slow link, where that many bytes need well over poll_s ...
    assert throttled_bytes[0] >= MIB * 2**20 * 0.9
    assert throttled_bytes[0] * 8 / (RATE_MBIT * 1e6) > 2 * POLL_S
    assert pull["end"] - pull["start"] > POLL_S
    # ... and the chief's log kept arriving all the while
    during = [when for when, pulling in chief_events if pulling]
    assert len(during) >= 10, f"only {len(during)} chief progress events while the pull ran"
    gaps = [b - a for a, b in itertools.pairwise(during)]
    # none of them waited behind the transfer as long as it takes to count a host as lost
    assert max(gaps) < POLL_S, f"the chief's events stalled for {max(gaps):.1f}s mid-pull"
