"""Benchmark: checkpoints of 1 MiB, 100 MiB and 1 GiB on 3 SSH hosts: what they cost training,
what crosses the controller's link, and how fast a relaunch gives them to the other hosts.

Three namespace hosts with sshd; the job is ``tests.workloads.big_state`` (a checkpoint of
BIG_STATE_MIB MiB of incompressible state, a trivial model), 3 workers, a real run under the
Supervisor per configuration: (a) no checkpointing, (b) a checkpoint every N steps with
``checkpoint.mirror: never`` (the controller copies nothing), (c) the same with ``mirror:
always`` (the controller pulls each checkpoint), (d) the same with ``checkpoint.dir`` on a
directory every host sees (shared storage). Figures per size:

- steps/s of the chief (its own event timestamps, the first 20% of the steps left out), and
  the ratios b/a, c/a, d/a, c/b and d/b. Goal: c/b and d/b >= 0.95.
- bytes through the controller's link, counted by the kernel: every host's traffic to the
  controller goes through a tc class at 10 Gbit/s (it slows nothing) whose byte counter is read
  before and after the run, and around the final model download (the model, the size of the
  state, is not a checkpoint: its bytes are reported apart); per checkpoint, beside the
  product's own figure (``RunResult.checkpoint_bytes``). (b) is the control traffic alone
  (polls, log reads); the excess of (c) and (d) over it is what their checkpoints cost. Also the
  mirror's pulls (copied, failed) and this process's CPU time (the supervisor and its mirror
  thread) over the run. Goal: shared storage moves 0 checkpoint bytes through the controller.
- the relaunch copy: the chief's checkpoint directory as a run of (b) left it (hard-linked at
  its last checkpoint: tf_keras deletes it when training ends) given to the 2 other hosts by
  ``share_chief_checkpoint`` (a pipelined chain, chief -> h1 -> h2; the index and the newest
  checkpoint, not the older ones kept), their copies removed first, against a plain copy of
  the same bytes from the chief's host to ONE other host (a
  Python socket sender and receiver in the two namespaces, already started: no SSH, no
  hashing, no checks). Also the bytes through the controller during the chain copy, and a
  second copy right after (nothing changed: nothing should be sent). Twice: with the lab's
  links as they are, where the 3 hosts' pieces share this machine's 2 cores (the chain runs 3
  processes where the plain copy runs 2, so it is bound by the CPU they share), and with each
  host's link capped at LINK_RATE (``LabHost.limit_link``), as separate machines are bound by
  their own NIC or disk. Goal: chain <= 1.3x the plain copy, on capped links.

A size whose 3 workers would not fit in this machine's free memory (big_state holds about 6x
its state per worker, 8x at its peak) is not trained: its chief's directory is made by hand
(the layout tf_keras leaves: an index and up to 3 checkpoints), the controller's copy is pulled
once per new checkpoint (``CheckpointMirror.pull``, what mirror: always does after each
checkpoint event), and the relaunch copy is measured on it. On a 23 GiB machine that is 1 GiB,
so 300 MiB is trained as well, as the largest size that fits.

    python benchmarks/checkpoints.py           # 3 repeats (1 at 300 MiB); 12 to 22 min (root)
    python benchmarks/checkpoints.py --quick   # 1 MiB trained on 2 workers, 16 MiB by hand, once
"""

from __future__ import annotations

import contextlib
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import (
    REPO,
    describe_machine,
    median_of,
    note,
    parser,
    publish,
    ratio,
    repeats,
    show,
    spread,
    temp_home,
)
from hostlab import HostLab, LabHost
from jobs import PORTS, namespace_lab, static_provider, supervise, write_spec

from orchestrator import paths, supervisor
from orchestrator import plan as planning
from orchestrator import spec as specs
from orchestrator.api import Cluster
from orchestrator.checkpoints import CheckpointMirror, Copied, WorkerCommand, share_chief_checkpoint
from orchestrator.events import Event
from orchestrator.hosts import Host
from orchestrator.providers import for_spec
from orchestrator.providers.base import Provider
from orchestrator.view import RunView, human_bytes
from worker.transfer import listing

WORKERS = 3
RATE = "10gbit"  # a throttle that slows nothing: it is there for its byte counter
WARMUP = 0.2  # the first 20% of the chief's steps are left out of steps/s
STEPS_GOAL = 0.95  # c/b and d/b
COPY_GOAL = 1.3  # chain copy to 2 hosts / plain copy to 1, on capped links
# Each host's link in the capped copies: 250 MB/s, about what a balanced persistent disk
# writes, and well under what the lab's shared cores push through a chain of 3 (~550 MB/s).
LINK_RATE = "2gbit"
SHARED_SLACK = 0.05  # measured excess of (d) over (b) per checkpoint, as a share of a checkpoint
PLAIN_PORT = 29870  # inside the receiving host's own namespace: no other process uses it
KEEP = 3  # checkpoints tf_keras keeps in the chief's directory (worker/runtimes/tf_keras.py)
# Resident memory of one big_state worker: about 0.65 GiB of TensorFlow and 6x the state while
# it trains, 8x at its peaks (building the model, the final save); measured at 100 and 256 MiB.
WORKER_BASE_GIB = 0.7
PEAK_PER_STATE = 8.0
MEMORY_MARGIN_GIB = 2.0
CONFIGS = ("none", "off", "on", "shared")
OUTCOMES = ("copied", "skipped", "failed")
LABELS = {"none": "(a) no checkpoints", "off": "(b) mirror never", "on": "(c) mirror always",
          "shared": "(d) shared storage"}
SETTINGS = {"retry": {"max_restarts": 0},
            "timeouts": {"stop_grace_s": 1, "startup_s": 300, "hang_s": 300}}


@dataclass(frozen=True)
class Size:
    """One checkpoint size: a checkpoint every ``every`` steps of ``steps``, at most
    ``max_repeats`` repeats; ``train=False``: the chief's directory is only made by hand."""

    mib: int
    every: int
    steps: int
    max_repeats: int = 99
    train: bool = True
    workers: int = WORKERS  # that train; the relaunch copy is always to the other 2 hosts

    @property
    def name(self) -> str:
        return f"{self.mib} MiB" if self.mib < 1024 else f"{self.mib // 1024} GiB"

    @property
    def need_gib(self) -> float:
        """Memory its workers need at their peak."""
        return self.workers * (WORKER_BASE_GIB + PEAK_PER_STATE * self.mib / 1024)


# N is chosen per size so that several checkpoints (5 to 10) fall inside the measured window
# (the last 80% of the steps) while a save (tens of ms at 1 MiB, about a second at 300 MiB:
# each of the 3 workers writes the whole state) stays a modest share of each interval.
FULL = (Size(1, 25, 330), Size(100, 50, 330), Size(300, 100, 560, max_repeats=1),
        Size(1024, 100, 560, max_repeats=1))
# --quick trains on 2 of the 3 hosts: each TensorFlow task's start costs the 2-core CI machine
# some 7 CPU-s, and 4 runs of 3 workers were most of the smoke run's CPU. Its relaunch copy
# still goes from the chief's host to the 2 others (a chain of 3). 2 workers step about twice
# as fast: a checkpoint every 20 steps leaves the mirror's pull (about 0.3 s) the time it had
# between checkpoints every 10 on 3 workers, so that it copies one rather than racing the next.
QUICK = (Size(1, 20, 70, workers=2), Size(16, 0, 0, train=False))


def available_gib() -> float:
    words = Path("/proc/meminfo").read_text().split()
    return int(words[words.index("MemAvailable:") + 1]) / 2**20


# -- one run -------------------------------------------------------------------------------
@dataclass
class Recorder:
    """The run's listener: the chief's steps and checkpoints (worker timestamps), and (``keep``)
    a hard-linked copy of the chief's checkpoint directory at each of its checkpoints. With
    ``instrumented``, also the mirror's pulls and the bytes the final model download sent."""

    hosts: list[LabHost]
    keep: Path | None = None
    steps: list[tuple[int, float]] = field(default_factory=list)
    checkpoints: list[tuple[int, float]] = field(default_factory=list)
    mirrored: set[int] = field(default_factory=set)
    finished: bool = False
    pulls: list[tuple[str, float, int]] = field(default_factory=list)  # outcome, s, bytes
    pull_errors: list[str] = field(default_factory=list)
    pulling: int = 0
    fetch_bytes: int = 0
    fetch_overlapped_pull: bool = False

    def __call__(self, view: RunView, event: Event | None) -> None:
        if view.mirrored_step is not None:
            self.mirrored.add(view.mirrored_step)
        if event is None or event.attempt != 1 or event.task != "worker:0":
            return
        if event.kind == "progress":
            self.steps.append((int(event.get("step")), event.time))
        elif event.kind == "checkpoint":
            self.checkpoints.append((int(event.get("step")), event.time))
            if self.keep is not None:
                snapshot(Path(str(event.get("path"))), self.keep)
        elif event.kind == "finished":
            self.finished = True

    def window(self) -> tuple[tuple[int, float], tuple[int, float]] | None:
        steps = sorted(self.steps)
        if len(steps) < 3:
            return None
        return next(s for s in steps if s[0] >= steps[-1][0] * WARMUP), steps[-1]

    def steps_per_s(self) -> float | None:
        window = self.window()
        if window is None:
            return None
        first, last = window
        return (last[0] - first[0]) / (last[1] - first[1]) if last[1] > first[1] else None

    def checkpoints_in_window(self) -> int:
        window = self.window()
        if window is None:
            return 0
        return sum(1 for _, at in self.checkpoints if window[0][1] <= at <= window[1][1])


def sent_to_controller(hosts: list[LabHost]) -> int:
    return sum(h.throttled_bytes() for h in hosts)


def snapshot(chief_dir: Path, keep: Path) -> None:
    """Hard-link the checkpoints that ``chief_dir``'s index lists (and the index) into ``keep``,
    replacing what it held: the directory a relaunch would copy, before tf_keras deletes it."""
    try:
        index = (chief_dir / "checkpoint").read_text()
    except OSError:
        return
    listed = {Path(line.split('"')[1]).name for line in index.splitlines() if '"' in line}
    fresh = keep.with_name(keep.name + ".new")
    shutil.rmtree(fresh, ignore_errors=True)
    fresh.mkdir(parents=True)
    for path in chief_dir.iterdir():
        if path.is_file() and (path.name == "checkpoint" or path.name.split(".")[0] in listed):
            with contextlib.suppress(OSError):  # deleted by the next save meanwhile
                os.link(path, fresh / path.name)
    shutil.rmtree(keep, ignore_errors=True)
    fresh.rename(keep)


@contextlib.contextmanager
def instrumented(recorder: Recorder) -> Iterator[None]:
    """Count the run's mirror pulls and the bytes of its final model download (which follows
    training: it is no checkpoint's cost), by wrapping the two functions in this process."""
    fetch_name = "fetch_file"  # what the supervisor calls to download the model
    real_fetch, real_pull = getattr(supervisor, fetch_name), CheckpointMirror.pull

    def fetch(*args: Any, **kwargs: Any) -> str:
        recorder.fetch_overlapped_pull = recorder.pulling > 0
        before = sent_to_controller(recorder.hosts)
        try:
            path: str = real_fetch(*args, **kwargs)
            return path
        finally:
            recorder.fetch_bytes += sent_to_controller(recorder.hosts) - before

    def pull(self: CheckpointMirror, *args: Any, **kwargs: Any) -> bool:
        """Each pull's outcome ("copied"; "skipped": no checkpoint; "failed": an error, e.g. a
        file deleted by the next save, its files thrown away), seconds and bytes downloaded."""
        outcome, pulled, started = "failed", self.bytes_pulled, time.monotonic()
        recorder.pulling += 1
        try:
            copied = real_pull(self, *args, **kwargs)
            outcome = "copied" if copied else "skipped"
            return copied
        except Exception as exc:
            recorder.pull_errors.append(failed_file(str(exc)))
            raise
        finally:
            recorder.pulling -= 1
            recorder.pulls.append((outcome, time.monotonic() - started, self.bytes_pulled - pulled))

    setattr(supervisor, fetch_name, fetch)
    CheckpointMirror.pull = pull  # type: ignore[method-assign]
    try:
        yield
    finally:
        setattr(supervisor, fetch_name, real_fetch)
        CheckpointMirror.pull = real_pull  # type: ignore[method-assign]


def failed_file(error: str) -> str:
    """Why a pull failed, without the run's paths: the file it could not download (a TF temp
    file of a save in progress, or a checkpoint file deleted meanwhile: ``ckpt-N.index``), or
    the error's first line."""
    match = re.search(r"download of (\S+) to ", error)
    if match is None:  # e.g. the index names a checkpoint saved after the listing
        return re.sub(r"ckpt-\d+", "ckpt-N", error.splitlines()[0])[:200] if error else "?"
    name = Path(match.group(1)).name
    if ".tempstate" in name:
        return "a temp file of a save in progress"
    return re.sub(r"ckpt-\d+", "ckpt-N", name)


@dataclass
class Sample:
    config: str
    run_id: str
    steps_per_s: float | None
    checkpoints: int
    in_window: int
    mirrored: int
    pulls: list[tuple[str, float, int]]
    pull_errors: list[str]
    controller_bytes: int  # every host to the controller during the run, less the model download
    model_fetch_bytes: int
    product: dict[str, int]
    seconds: float
    controller_cpu: float  # this process's CPU time (the supervisor, its mirror thread) / wall


def train(path: Path, config: str, hosts: list[LabHost], keep: Path | None) -> Sample:
    recorder = Recorder(hosts, keep)
    before = sent_to_controller(hosts)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    started = time.monotonic()
    with instrumented(recorder):
        result = supervise(path, recorder)
    seconds = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_SELF)
    total = sent_to_controller(hosts) - before
    if not recorder.finished or not recorder.fetch_bytes:
        raise RuntimeError(f"{path.parent.name}: the chief never finished ({result.status})")
    if recorder.fetch_overlapped_pull:
        note(f"{path.parent.name}: a mirror pull was still running during the model download")
    name = specs.load(path).name
    for local in (paths.mirror_dir(name, result.run_id), paths.fetched_model_dir(name, result.run_id)):
        shutil.rmtree(local, ignore_errors=True)  # the size of the state each
    cpu = (after.ru_utime + after.ru_stime) - (usage.ru_utime + usage.ru_stime)
    return Sample(config, result.run_id, recorder.steps_per_s(), len(recorder.checkpoints),
                  recorder.checkpoints_in_window(), len(recorder.mirrored),
                  recorder.pulls, recorder.pull_errors,
                  total - recorder.fetch_bytes, recorder.fetch_bytes,
                  dict(result.checkpoint_bytes), seconds, cpu / seconds)


def drop_run(hosts: list[LabHost], spec: specs.ClusterSpec, run_id: str) -> None:
    """The run's files on every host (the chief's saved model is the size of the state)."""
    for host in hosts:
        root = paths.host_root(host.home, spec.name)
        shutil.rmtree(paths.RunPaths.of(root, run_id).run_dir, ignore_errors=True)


# -- a relaunch: the plan, the chief's directory, the copies -------------------------------
@dataclass
class Relaunch:
    """The plan of a relaunch (attempt 2) of a run, with the provider for its runners."""

    plan: planning.ClusterPlan
    provider: Provider
    hosts: list[LabHost]

    @property
    def chief_dir(self) -> Path:
        """The chief's checkpoint directory (tf_keras writes ``chief/`` inside it)."""
        return Path(self.plan.checkpoints.of(self.plan.chief.host))

    @property
    def targets(self) -> list[Host]:
        return [t.host for t in self.plan.tasks[1:]]

    def lab_host(self, host: Host) -> LabHost:
        return next(h for h in self.hosts if h.address == host.address)

    def worker_for(self, host: Host) -> WorkerCommand:
        return WorkerCommand(self.provider.python(host), paths.lib_dir(host.root))

    def clear_targets(self) -> None:
        for host in self.targets:
            shutil.rmtree(self.plan.checkpoints.of(host), ignore_errors=True)


@contextlib.contextmanager
def relaunch(path: Path, run_id: str, hosts: list[LabHost], *, up: bool) -> Iterator[Relaunch]:
    """A relaunch of ``run_id`` (``up``: the cluster's code and worker synced first); every
    host's copy of the run's checkpoints is removed at the end."""
    spec = specs.load(path)
    provider = for_spec(spec, path)
    try:
        found = provider.up() if up else provider.hosts()
        plan = planning.build(spec, found, run_id=run_id, attempt=2,
                              python=provider.python(found[0]),
                              local_workdir=str(specs.workdir_of(spec, path)),
                              busy_ports=provider.busy_ports(found))
        chosen = Relaunch(plan, provider, hosts)
        try:
            yield chosen
        finally:
            chosen.clear_targets()
            shutil.rmtree(chosen.chief_dir, ignore_errors=True)
    finally:
        provider.close()


def install_kept(r: Relaunch, keep: Path) -> None:
    """The kept checkpoints as the chief's directory, as they were when training ended."""
    shutil.rmtree(r.chief_dir, ignore_errors=True)
    r.chief_dir.mkdir(parents=True)
    keep.rename(r.chief_dir / "chief")


def write_checkpoint(chief: Path, number: int, size: int, block: bytes) -> None:
    """Checkpoint ``number`` as tf_keras writes it (data, index, the ``checkpoint`` file that
    names the newest and the kept ones); the oldest beyond KEEP is deleted."""
    chief.mkdir(parents=True, exist_ok=True)
    with open(chief / f"ckpt-{number}.data-00000-of-00001", "wb") as f:
        left = size
        while left:
            left -= f.write(block[:left])
    (chief / f"ckpt-{number}.index").write_bytes(os.urandom(1557))
    kept = list(range(max(1, number - KEEP + 1), number + 1))
    for old in chief.glob("ckpt-*"):
        if int(old.name.split(".")[0].split("-")[1]) not in kept:
            old.unlink()
    index = "".join([f'model_checkpoint_path: "ckpt-{number}"\n',
                     *(f'all_model_checkpoint_paths: "ckpt-{n}"\n' for n in kept)])
    (chief / "checkpoint.tmp").write_text(index)
    (chief / "checkpoint.tmp").rename(chief / "checkpoint")


def measure_pulls(r: Relaunch, size: Size, runs: int, home: Path) -> dict[str, Any]:
    """The controller's copy (mirror: always) pulled after each of ``runs`` new checkpoints of
    a chief's directory made by hand; the first pull, of the first checkpoint, is not counted."""
    chief = r.chief_dir / "chief"
    block = os.urandom(min(size.mib << 20, 64 << 20))  # repeated: nothing on the way compresses
    state = (size.mib << 20) + 8  # tf_keras' data file: the state and a few bytes
    mirror = CheckpointMirror(home / "mirror", r.provider.runner, r.worker_for, mode="always")
    pulls: list[dict[str, Any]] = []
    for number in range(1, runs + 2):
        write_checkpoint(chief, number, state, block)
        before, product = sent_to_controller(r.hosts), mirror.bytes_pulled
        started = time.monotonic()
        if not mirror.pull(r.plan, number * 100):
            raise RuntimeError(f"the mirror did not pull checkpoint {number}")
        took = time.monotonic() - started
        if number > 1:
            pulls.append({"seconds": took, "controller_bytes": sent_to_controller(r.hosts) - before,
                          "product_bytes": mirror.bytes_pulled - product})
            note(f"{size.name}: mirror pull of checkpoint {number} took {took:.2f}s, "
                 f"{human_bytes(pulls[-1]['controller_bytes'])} through the controller")
    shutil.rmtree(home / "mirror", ignore_errors=True)
    seconds = median_of([p["seconds"] for p in pulls])
    return {"checkpoint_bytes": state, "pulls": len(pulls),
            "seconds": spread([p["seconds"] for p in pulls]),
            "controller_bytes": spread([p["controller_bytes"] for p in pulls], 0),
            "product_bytes": spread([p["product_bytes"] for p in pulls], 0),
            "mb_per_s": round(state / seconds / 1e6, 1) if seconds else None}


# The plain copy: one Python process reads the files and writes them to a socket, the other
# writes what it receives to one file, 1 MiB at a time (as worker.transfer does), nothing else.
RECEIVER = """
import resource, socket, sys
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("", int(sys.argv[2])))
srv.listen(1)
print("ready", flush=True)
conn, _ = srv.accept()
view, total = memoryview(bytearray(1 << 20)), 0
with open(sys.argv[1], "wb") as out:
    while n := conn.recv_into(view):
        out.write(view[:n])
        total += n
usage = resource.getrusage(resource.RUSAGE_SELF)
print(total, usage.ru_utime + usage.ru_stime, flush=True)
"""
SENDER = """
import resource, socket, sys, time
for _ in range(100):
    try:
        sock = socket.create_connection((sys.argv[1], int(sys.argv[2])))
        break
    except OSError:
        time.sleep(0.05)
view = memoryview(bytearray(1 << 20))
for name in sys.argv[3:]:
    with open(name, "rb", buffering=0) as f:
        while n := f.readinto(view):
            sock.sendall(view[:n])
sock.close()
usage = resource.getrusage(resource.RUSAGE_SELF)
print(usage.ru_utime + usage.ru_stime, flush=True)
"""


def in_namespace(host: LabHost, *argv: str) -> list[str]:
    return ["ip", "netns", "exec", str(host.namespace), *argv]


def plain_copy(source: LabHost, target: LabHost, files: list[str],
               out: str) -> tuple[float, float, float]:
    """Seconds to stream ``files`` from ``source`` into one file ``out`` on ``target``, and the
    CPU seconds of the sender and of the receiver."""
    receiver = subprocess.Popen(in_namespace(target, sys.executable, "-c", RECEIVER, out, str(PLAIN_PORT)),
                                stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    try:
        assert receiver.stdout is not None
        if receiver.stdout.readline().strip() != "ready":
            raise RuntimeError("the plain-copy receiver did not start")
        started = time.monotonic()
        sent = subprocess.run(in_namespace(source, sys.executable, "-c", SENDER, target.address,
                                           str(PLAIN_PORT), *files), check=True, timeout=600,
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        received_text, receiver_cpu = receiver.stdout.readline().split()
        received = int(received_text)
        receiver.wait(60)
        took = time.monotonic() - started
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()
    expected = sum(os.path.getsize(f) for f in files)
    if received != expected:
        raise RuntimeError(f"the plain copy received {received} of {expected} bytes")
    return took, float(sent.stdout.split()[-1]), float(receiver_cpu)


def measure_copies(r: Relaunch, runs: int) -> dict[str, Any]:
    """The copies with the links as they are (``relaunch``), and with every host's link at
    LINK_RATE (``relaunch_capped``, the one the goal is for)."""
    found = {"relaunch": measure_copies_at(r, runs, None)}
    for host in r.hosts:
        host.limit_link(LINK_RATE)
    try:
        found["relaunch_capped"] = measure_copies_at(r, runs, LINK_RATE)
    finally:
        for host in r.hosts:
            host.limit_link(None)
    return found


def measure_copies_at(r: Relaunch, runs: int, link: str | None) -> dict[str, Any]:
    """``runs`` times, alternating which goes first: the chain copy of the chief's directory
    to the other hosts (their copies removed first) and the same again at once; a plain copy
    of the same files from the chief's host to the first other host."""
    # What the chain sends: the index and the newest checkpoint (not the older ones kept).
    files = [str(r.chief_dir / f["path"]) for f in listing(str(r.chief_dir), newest=True)["files"]]
    size = sum(os.path.getsize(f) for f in files)
    source, first = r.lab_host(r.plan.chief.host), r.lab_host(r.targets[0])
    plain_out = f"{first.home}/plain-copy.bin"
    chain: list[dict[str, Any]] = []
    again: list[dict[str, Any]] = []
    plain: list[float] = []
    plain_cpu: list[float] = []  # the busier of the plain copy's two processes

    def timed_chain() -> tuple[Copied, float, int]:
        before = sent_to_controller(r.hosts)
        started = time.monotonic()
        copied = share_chief_checkpoint(r.plan, r.provider.runner, r.worker_for)
        return copied, time.monotonic() - started, sent_to_controller(r.hosts) - before

    def one_chain() -> None:
        r.clear_targets()
        os.sync()  # no writeback of an earlier copy's pages during this one
        copied, took, through = timed_chain()
        if copied.chain_error:  # relayed through this machine instead: not the chain's time
            raise RuntimeError(f"the host-to-host chain failed: {copied.chain_error}")
        if sorted(copied.hosts) != sorted(h.name for h in r.targets) or copied.bytes != size:
            raise RuntimeError(f"the chain copied {copied} of {size} bytes")
        chain.append({"seconds": took, "controller_bytes": through,
                      "busiest_cpu_s": max(copied.cpu_s.values())})
        copied, took, through = timed_chain()
        again.append({"seconds": took, "controller_bytes": through, "bytes": copied.bytes})

    def one_plain() -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(plain_out)
        os.sync()
        took, sender_cpu, receiver_cpu = plain_copy(source, first, files, plain_out)
        plain.append(took)
        plain_cpu.append(max(sender_cpu, receiver_cpu))
        os.remove(plain_out)

    for i in range(runs):
        for step in ((one_chain, one_plain) if i % 2 == 0 else (one_plain, one_chain)):
            step()
        note(f"relaunch copy of {human_bytes(size)}, links {link or 'as they are'}: "
             f"chain to {len(r.targets)} hosts "
             f"{chain[-1]['seconds']:.2f}s ({human_bytes(chain[-1]['controller_bytes'])} through the "
             f"controller), again {again[-1]['seconds']:.2f}s, plain copy to 1 host {plain[-1]:.2f}s; "
             f"CPU of the busiest piece: chain {chain[-1]['busiest_cpu_s']:.2f}s, "
             f"plain {plain_cpu[-1]:.2f}s")
    chain_s, plain_s = median_of([c["seconds"] for c in chain]), median_of(plain)
    value = ratio(chain_s, plain_s, 2)
    return {
        "link": link or "as they are", "bytes": size, "files": len(files), "hosts": len(r.targets),
        "chain_s": spread([c["seconds"] for c in chain]), "plain_s": spread(plain),
        "chain_over_plain": value, "goal_met": (value is not None and value <= COPY_GOAL) if link else None,
        # On separate hosts each piece has its own cores: the busiest one's CPU, against the
        # busier of the plain copy's sender and receiver, is what the lab can say of that.
        "busiest_cpu_s": spread([c["busiest_cpu_s"] for c in chain]),
        "plain_busiest_cpu_s": spread(plain_cpu),
        "busiest_cpu_over_plain": ratio(median_of([c["busiest_cpu_s"] for c in chain]),
                                        median_of(plain_cpu), 2),
        "chain_mb_per_s": round(size / chain_s / 1e6, 1) if chain_s else None,
        "plain_mb_per_s": round(size / plain_s / 1e6, 1) if plain_s else None,
        "controller_bytes": spread([c["controller_bytes"] for c in chain], 0),
        "again_s": spread([a["seconds"] for a in again]),
        "again_bytes_sent": max(a["bytes"] for a in again),
        "again_controller_bytes": spread([a["controller_bytes"] for a in again], 0),
    }


# -- one size ------------------------------------------------------------------------------
def spec_for(directory: Path, project: Path, size: Size, config: str, lab: HostLab,
             hosts: list[LabHost], shared: Path, workers: int | None = None) -> Path:
    """The job of ``size`` in ``config`` on the first ``workers`` hosts (``size.workers``)."""
    workers = size.workers if workers is None else workers
    checkpoint: dict[str, Any] = {"every_steps": max(1, size.every), "mirror": "never"}
    if config == "none":
        checkpoint["every_steps"] = max(1, size.steps * 10)
    elif config == "on":
        checkpoint["mirror"] = "always"  # auto turns itself off above 1 GiB
    elif config == "shared":
        checkpoint = {"every_steps": max(1, size.every), "dir": str(shared)}
    spec = {
        "name": f"bench-ck-{size.mib}", "workers": workers, "workdir": str(project),
        "job": {"module": "tests.workloads.big_state", "epochs": 1,
                "steps_per_epoch": max(1, size.steps), "progress_every_steps": 1},
        "checkpoint": checkpoint, "env": {"BIG_STATE_MIB": str(size.mib)}, "ports": PORTS,
        "provider": static_provider(lab, hosts[:workers]), **SETTINGS,
    }
    where = directory / f"{size.mib}" / (config if workers == size.workers else f"{config}-{workers}")
    where.mkdir(parents=True, exist_ok=True)
    return write_spec(where, spec)


def measure_size(size: Size, directory: Path, project: Path, lab: HostLab, hosts: list[LabHost],
                 shared: Path, runs: int, copy_runs: int) -> dict[str, Any]:
    specs_by = {c: spec_for(directory, project, size, c, lab, hosts, shared) for c in CONFIGS}
    # The relaunch copies are to every other host: where fewer trained, the same cluster on
    # all of them (its code synced to the hosts that did not train, ``relaunch(up=True)``).
    wide = specs_by["off"] if size.workers == len(hosts) else \
        spec_for(directory, project, size, "off", lab, hosts, shared, workers=len(hosts))
    samples: dict[str, list[Sample]] = {c: [] for c in CONFIGS}
    found: dict[str, Any] = {"size_mib": size.mib, "every_steps": size.every, "steps": size.steps,
                             "workers": size.workers}
    keep = directory / f"keep-{size.mib}"
    free = available_gib()
    try:
        if not size.train:
            found["not_trained"] = "--quick makes this size's checkpoints by hand"
        elif free - MEMORY_MARGIN_GIB < size.need_gib:
            found["not_trained"] = (
                f"its {size.workers} workers need about {size.need_gib:.0f} GiB at their peak "
                f"({WORKER_BASE_GIB} GiB + {PEAK_PER_STATE:g}x the state each), "
                f"{free:.1f} GiB is available")
        if "not_trained" in found:
            note(f"{size.name}: not trained ({found['not_trained']}): the chief's checkpoints "
                 "are made by hand")
            with relaunch(wide, f"by-hand-{size.mib}", hosts, up=True) as r:
                found["mirror_pull"] = measure_pulls(r, size, copy_runs, directory)
                found.update(measure_copies(r, copy_runs))
            return found
        for i in range(runs):
            for config in CONFIGS[i % len(CONFIGS):] + CONFIGS[:i % len(CONFIGS)]:
                path = specs_by[config]
                keeping = config == "off" and "relaunch" not in found
                sample = train(path, config, hosts, keep if keeping else None)
                samples[config].append(sample)
                note(f"{size.name}, {LABELS[config]}: {sample.steps_per_s or 0:.1f} steps/s, "
                     f"{sample.checkpoints} checkpoints ({sample.in_window} measured), "
                     f"{human_bytes(sample.controller_bytes)} to the controller "
                     f"(product: {human_bytes(sample.product.get('through_controller', 0))}), "
                     f"{sample.mirrored} mirrored (pulls: "
                     f"{', '.join(f'{sum(1 for p in sample.pulls if p[0] == o)} {o}' for o in OUTCOMES)}), "
                     f"controller CPU "
                     f"{sample.controller_cpu:.0%} of a core, model fetch "
                     f"{human_bytes(sample.model_fetch_bytes)}, {sample.seconds:.0f}s")
                if keeping:
                    if not keep.is_dir():
                        raise RuntimeError(f"{size.name}: no checkpoint of the chief was kept")
                    with relaunch(wide, sample.run_id, hosts, up=wide != path) as r:
                        install_kept(r, keep)
                        found.update(measure_copies(r, copy_runs))
                drop_run(hosts, specs.load(path), sample.run_id)
    finally:
        with contextlib.suppress(Exception):
            Cluster.from_spec(wide).down()  # the cluster's directory on every host
        shutil.rmtree(keep, ignore_errors=True)
    return {**found, **summarize(size, samples)}


def summarize(size: Size, samples: dict[str, list[Sample]]) -> dict[str, Any]:
    rates = {c: median_of([s.steps_per_s for s in samples[c]]) for c in CONFIGS}
    configs: dict[str, Any] = {}
    for c in CONFIGS:
        runs = samples[c]
        product = [s.product.get("through_controller", 0) for s in runs]
        configs[c] = {
            "steps_per_s": spread([s.steps_per_s for s in runs], 2),
            "ratio_to_none": ratio(rates[c], rates["none"]),
            "checkpoints": spread([s.checkpoints for s in runs], 0),
            "checkpoints_measured": spread([s.in_window for s in runs], 0),
            "mirrored": spread([s.mirrored for s in runs], 0),
            "pulls": {o: spread([sum(1 for p in s.pulls if p[0] == o) for s in runs], 0)
                      for o in OUTCOMES},
            "failed_pull_bytes": spread([sum(p[2] for p in s.pulls if p[0] == "failed")
                                         for s in runs], 0),
            "pull_s": spread([p[1] for s in runs for p in s.pulls if p[0] == "copied"], 2),
            "pull_failures": dict(Counter(e for s in runs for e in s.pull_errors)),
            "controller_cpu": spread([s.controller_cpu for s in runs]),
            "controller_bytes": spread([s.controller_bytes for s in runs], 0),
            "controller_bytes_per_checkpoint": spread(
                [s.controller_bytes / s.checkpoints if s.checkpoints else None for s in runs], 0),
            "product_through_controller": spread(product, 0),
            "product_per_checkpoint": spread([p / s.checkpoints if s.checkpoints else None
                                              for p, s in zip(product, runs, strict=True)], 0),
            "product_host_to_host": max(s.product.get("host_to_host", 0) for s in runs),
            "model_fetch_bytes": spread([s.model_fetch_bytes for s in runs], 0),
            "run_s": spread([s.seconds for s in runs], 1),
        }
    baseline = configs["off"]["controller_bytes_per_checkpoint"]["median"]
    for c in ("on", "shared"):
        value = configs[c]["controller_bytes_per_checkpoint"]["median"]
        configs[c]["excess_per_checkpoint"] = (None if value is None or baseline is None
                                               else round(value - baseline))
    shared_excess = configs["shared"]["excess_per_checkpoint"]
    on_over_off, shared_over_off = ratio(rates["on"], rates["off"]), ratio(rates["shared"], rates["off"])
    return {
        "repeats": len(samples["none"]), "configs": configs,
        "on_over_off": on_over_off, "shared_over_off": shared_over_off,
        "goals": {  # None: not measured at this size
            "shared_moves_no_checkpoint_bytes": None if shared_excess is None else (
                configs["shared"]["product_through_controller"]["max"] == 0
                and shared_excess <= SHARED_SLACK * (size.mib << 20)),
            "mirror_keeps_0_95": None if on_over_off is None else on_over_off >= STEPS_GOAL,
            "shared_keeps_0_95": None if shared_over_off is None else shared_over_off >= STEPS_GOAL,
        },
    }


def make_project(directory: Path) -> Path:
    """A small user project holding only the workload (the repository would sync tens of MB)."""
    project = directory / "project"
    target = project / "tests" / "workloads"
    target.mkdir(parents=True)
    for name in ("__init__.py", "big_state.py", "pace.py"):
        shutil.copy2(REPO / "tests" / "workloads" / name, target / name)
    return project


def yes_no(value: bool | None) -> str:
    return "-" if value is None else "yes" if value else "no"


HEADER = ["size", "config", "steps/s", "/ (a)", "checkpoints", "to controller", "per checkpoint",
          "product says", "pulls ok/failed", "controller CPU"]


def rows_of(results: list[dict[str, Any]]) -> list[list[Any]]:
    rows: list[list[Any]] = []
    blank = [""] * (len(HEADER) - 3)
    for r in results:
        size = Size(r["size_mib"], 0, 0).name
        if "not_trained" in r:
            pull = r["mirror_pull"]
            rows.append([size, "not trained", r["not_trained"].split(" (")[0], *blank])
            rows.append([size, "mirror pull", show(pull["seconds"], "s"), "", "", "",
                         human_bytes(pull["controller_bytes"]["median"] or 0),
                         human_bytes(pull["product_bytes"]["median"] or 0), "", ""])
        else:
            for c in CONFIGS:
                f = r["configs"][c]
                per = f["controller_bytes_per_checkpoint"]["median"]
                pulls = "" if c != "on" else \
                    f"{show(f['pulls']['copied'])}/{show(f['pulls']['failed'])}"
                rows.append([size, LABELS[c], show(f["steps_per_s"]), f["ratio_to_none"] or "-",
                             show(f["checkpoints"]), human_bytes(f["controller_bytes"]["median"] or 0),
                             "-" if per is None else human_bytes(per),
                             human_bytes(f["product_through_controller"]["median"] or 0), pulls,
                             f"{(f['controller_cpu']['median'] or 0):.0%}"])
            rows.append([size, "c/b, d/b", r["on_over_off"], r["shared_over_off"], *blank[:-2],
                         " ".join(f"{k}={yes_no(v)}" for k, v in r["goals"].items())])
        for copy in (r["relaunch"], r["relaunch_capped"]):
            rows.append([size, f"relaunch copy, links {copy['link']}",
                         f"{human_bytes(copy['bytes'])} chain to {copy['hosts']}",
                         show(copy["chain_s"], "s"), f"plain to 1: {show(copy['plain_s'], 's')}",
                         f"x{copy['chain_over_plain']} ({yes_no(copy['goal_met'])})",
                         f"again {show(copy['again_s'], 's')}",
                         human_bytes(copy["controller_bytes"]["median"] or 0),
                         f"busiest CPU x{copy['busiest_cpu_over_plain']}", ""])
    return rows


def main() -> None:
    args = parser(__doc__, full_repeats=3).parse_args()
    host_facts, started = describe_machine(), time.monotonic()
    sizes = QUICK if args.quick else FULL
    with temp_home("checkpoints"), tempfile.TemporaryDirectory(prefix="orchestrate-bench-") as scratch, \
            namespace_lab(WORKERS) as (lab, why):
        if lab is None:
            note(f"skipped: {why}")
            publish("checkpoints", args, host_facts, started, {"skipped": why}, ["skipped"], [[why]])
            return
        directory = Path(scratch)
        project = make_project(directory)
        shared = directory / "shared"  # the lab's hosts share this machine's file system
        shared.mkdir()
        shared.chmod(0o1777)
        hosts = lab.hosts(WORKERS)
        for host in hosts:
            host.throttle(RATE, to=str(lab.bridge_address))
        results = []
        try:
            for size in sizes:
                runs = repeats(args) if args.repeats is not None else min(repeats(args), size.max_repeats)
                results.append(measure_size(size, directory, project, lab, hosts, shared, runs,
                                            copy_runs=1 if args.quick else 3))
        finally:
            for host in hosts:
                host.unthrottle()
    publish("checkpoints", args, host_facts, started,
            {"job": f"tests.workloads.big_state, "
                    f"{' / '.join(str(s.workers) for s in sizes if s.train)} workers on "
                    f"{WORKERS} namespace hosts",
             "rate": RATE, "warmup": WARMUP,
             "goals": {"steps": f"c/b and d/b >= {STEPS_GOAL}",
                       "copy": f"chain to 2 hosts <= {COPY_GOAL}x a plain copy to 1, "
                               f"every host's link at {LINK_RATE}",
                       "shared": "0 checkpoint bytes through the controller"},
             "results": results},
            HEADER, rows_of(results))


if __name__ == "__main__":
    main()
