"""Training state across hosts: verify the chief's checkpoint, give it to every task, keep this
machine's copy of it, and fetch the model.

Checkpoint bytes never travel through the controller when they need not: with shared storage
nothing is copied; otherwise the chief's host streams its checkpoint straight to the other hosts
(``python -m worker.transfer``, a pipelined chain, only the files a host lacks). The controller
sends each host a few hundred bytes of metadata and a one-time token, on stdin. Only this
machine's own copy (``CheckpointMirror``, ``checkpoint.mirror``) crosses the controller's link,
and only the files that changed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shlex
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator import containers
from orchestrator.errors import OrchestratorError, RemoteError
from orchestrator.hosts import Host
from orchestrator.plan import ClusterPlan
from orchestrator.remote.base import Runner, quote_argv
from orchestrator.spec import AUTO_MIRROR_MAX_BYTES, MIRROR_BUSY_MAX, Container
from worker.transfer import holds_checkpoint, listing, needed

RunnerFor = Callable[[Host], Runner]
INDEX = "checkpoint"  # TF's checkpoint index file in a checkpoint directory
# A piece of the chain gives up when its peer keeps it waiting this long (to connect, for a
# line, for 1 MiB of the stream); a copy that keeps moving is never cut short, whatever its
# size, which nobody knows before the pieces agree on what to send.
CHAIN_IDLE_S = 120.0
CHAIN_MAX_S = 24 * 3600.0  # the SSH command of a piece, which its own idle timeout ends first
STRAGGLER_S = 30.0  # after a piece failed: how long the others get to stop and report


@dataclass(frozen=True)
class WorkerCommand:
    """How to run ``python -m worker...`` on a host: its interpreter and the worker's lib dir."""

    python: str
    lib: str
    container: Container | None = None

    def argv(self, module: str, *args: str, stdlib_only: bool = False) -> list[str]:
        """``stdlib_only``: a module that imports only the standard library starts without
        ``site`` (-S), some tens of ms sooner: what a relaunch waits for, once per piece.
        Others need TensorFlow: with ``container``, they run in the image (the absolute paths
        among ``args`` mounted), since the host may have none."""
        if self.container is not None and not stdlib_only:
            return containers.worker_argv(self.container, [a for a in args if a.startswith("/")],
                                          module, *args, pythonpath=self.lib)
        return ["env", f"PYTHONPATH={self.lib}", self.python, *(["-S"] if stdlib_only else []),
                "-m", module, *args]


@dataclass(frozen=True)
class Listing:
    """The files of a checkpoint directory on a host (``python -m worker.transfer list``)."""

    exists: bool
    files: tuple[dict[str, Any], ...]

    @property
    def bytes(self) -> int:
        return sum(int(f["size"]) for f in self.files)

    @property
    def has_checkpoint(self) -> bool:
        """An index file at the top or in ``chief/`` (BackupAndRestore's layout)."""
        return holds_checkpoint(list(self.files))

    def needed_by(self, present: Listing) -> list[str]:
        """Files of this listing that ``present`` lacks with the same size and mtime."""
        return needed(list(self.files), list(present.files))


def has_checkpoint(runner: Runner, directory: str) -> bool:
    """An index in ``directory`` or in its ``chief/`` (see ``Listing.has_checkpoint``)."""
    q = shlex.quote
    return runner.run(f"test -f {q(directory)}/{INDEX} || test -f {q(directory)}/chief/{INDEX}",
                      check=False).ok


def list_dir(runner: Runner, worker: WorkerCommand, directory: str,
             newest: bool = False) -> Listing:
    """The files of ``directory`` on a host; with ``newest``, only the checkpoint its index
    names (see ``worker.transfer.listing``)."""
    argv = worker.argv("worker.transfer", "list", directory, *(["--newest"] if newest else []))
    result = runner.run(argv, timeout_s=120)
    report = _report(result.stdout, runner, "list the checkpoint files")
    return Listing(bool(report["exists"]), tuple(report["files"]))


def _report(stdout: str, runner: Runner, what: str) -> dict[str, Any]:
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RemoteError(f"could not {what}: it printed nothing", host=runner.host_name)
    report: dict[str, Any] = json.loads(lines[-1])
    return report


@dataclass
class Copied:
    """What one copy of the chief's checkpoint to the other hosts did."""

    hosts: list[str] = field(default_factory=list)  # the hosts that were sent files
    up_to_date: list[str] = field(default_factory=list)  # the hosts that had them all
    cleared: list[str] = field(default_factory=list)  # hosts whose stale copy was moved aside
    chain_error: str = ""  # why the host-to-host copy failed, when it was relayed through here
    through_controller: int = 0  # bytes the relay moved through this machine's link
    files: int = 0  # files sent down the chain
    bytes: int = 0  # bytes sent down the chain (each host received them once)
    hops: int = 0  # hosts the bytes went through (every host of the chain, up to date or not)
    seconds: float = 0.0
    cpu_s: dict[str, float] = field(default_factory=dict)  # each host's piece of the chain

    @property
    def host_to_host_bytes(self) -> int:
        return 0 if self.chain_error else self.bytes * self.hops


def share_chief_checkpoint(plan: ClusterPlan, runner_for: RunnerFor,
                           worker_for: Callable[[Host], WorkerCommand],
                           source: Host | None = None) -> Copied:
    """Copy the chief's checkpoint directory to one host of every other machine, host to host.
    ``source``: the host whose copy of that directory is sent (default: the chief's), e.g. a
    survivor's that saved the group's state there after the chief died.

    The hosts form a chain (chief -> h1 -> h2 ...), each receiving on its first task's port
    (free: the plan probed it, and no task runs during a relaunch) and forwarding as it
    receives, so the chief's link carries the bytes once whatever the number of hosts. The
    pieces start together and agree among themselves on what to send (see
    ``worker.transfer``): only the newest checkpoint (the one the index names, which the
    relaunch restores), and of it only the files some host lacks; a host sees the new
    directory whole or not at all. When the hosts cannot reach each other the copy goes
    through this machine instead (``Copied.chain_error`` says why).
    """
    started = time.monotonic()
    chief = source or plan.chief.host
    targets = list({t.host.machine: t.host for t in plan.tasks
                    if t.host.machine != chief.machine}.values())
    if not targets or plan.checkpoints.shared:
        return Copied()
    try:
        copied = _run_chain(plan, chief, targets, runner_for, worker_for)
    except OrchestratorError as exc:  # e.g. a firewall between hosts: relay it through here
        copied = _share_through_here(plan, chief, targets, runner_for, worker_for)
        copied.chain_error = exc.message
    copied.seconds = time.monotonic() - started
    return copied


def _share_through_here(plan: ClusterPlan, chief: Host, targets: list[Host],
                        runner_for: RunnerFor,
                        worker_for: Callable[[Host], WorkerCommand]) -> Copied:
    """What the chain does, through this machine: list every host, move stale copies aside
    when the source (``chief``) has no checkpoint, relay the whole directory to the hosts that
    lack files."""
    layout = plan.checkpoints
    with ThreadPoolExecutor(max_workers=min(32, len(targets) + 1)) as pool:
        listed = list(pool.map(lambda h: list_dir(runner_for(h), worker_for(h), layout.of(h),
                                                  newest=h is chief), [chief, *targets]))
    source, present = listed[0], listed[1:]
    if not source.has_checkpoint:  # a copy left from before would restore a different state
        stale = [h for h, p in zip(targets, present, strict=True) if p.has_checkpoint]
        for host in stale:
            directory = layout.of(host)
            runner_for(host).run(["mv", directory, f"{directory}.stale-{int(time.time())}"])
        return Copied(cleared=[h.name for h in stale])
    lacking = [h for h, p in zip(targets, present, strict=True) if source.needed_by(p)]
    copied = Copied(up_to_date=[h.name for h in targets if h not in lacking],
                    hosts=[h.name for h in lacking])
    if lacking:
        copied.files, copied.bytes = len(source.files), source.bytes
        copied.through_controller = relay_through_here(plan, lacking, source, runner_for,
                                                       worker_for, chief)
    return copied


def relay_through_here(plan: ClusterPlan, targets: Sequence[Host], source: Listing,
                       runner_for: RunnerFor, worker_for: Callable[[Host], WorkerCommand],
                       chief: Host | None = None) -> int:
    """The fallback when hosts cannot copy to each other: download the chief's whole checkpoint
    directory here (a temp dir, removed after), then upload it to every target in parallel.
    ``chief``: the host it is read from (default: the chief's). Returns the bytes that crossed
    this machine's link (down once, up once per target)."""
    chief = chief or plan.chief.host
    directory = plan.checkpoints.of(chief)
    with tempfile.TemporaryDirectory(prefix="orchestrate-relay-") as scratch:
        local = Path(scratch)
        runner = runner_for(chief)
        for f in source.files:
            target = local / f["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            runner.get_file(f"{directory}/{f['path']}", str(target))
            os.utime(target, ns=(int(f["mtime_ns"]), int(f["mtime_ns"])))
        with ThreadPoolExecutor(max_workers=min(32, len(targets))) as pool:
            sent = list(pool.map(lambda h: install_from_here(
                runner_for(h), worker_for(h), local, plan.checkpoints.of(h)), targets))
    return source.bytes + sum(sent)


def _run_chain(plan: ClusterPlan, chief: Host, chain: Sequence[Host], runner_for: RunnerFor,
               worker_for: Callable[[Host], WorkerCommand]) -> Copied:
    """Start the receivers and the sender (``chief``: the host whose copy is sent) at once;
    when one of them fails, stop the others (a sender would otherwise wait out its timeout for
    an acknowledgement)."""
    token = secrets.token_hex(32)
    timeout = CHAIN_IDLE_S
    ports = {h.name: next(t.port for t in plan.tasks if t.host.name == h.name) for h in chain}
    pid_files = {h.name: f"{plan.paths[h.name].run_dir}/.transfer-{token[:12]}.pid"
                 for h in [chief, *chain]}
    request = json.dumps({"token": token})

    def address(host: Host) -> str:
        return f"{host.address}:{ports[host.name]}"

    def run(host: Host, args: list[str], what: str) -> dict[str, Any]:
        # The shell writes the pid that exec keeps; the process removes the file as it exits.
        runner, pid_file = runner_for(host), shlex.quote(pid_files[host.name])
        argv = worker_for(host).argv("worker.transfer", *args, "--pid-file", pid_files[host.name],
                                     stdlib_only=True)
        script = (f"mkdir -p $(dirname {pid_file}) && echo $$ > {pid_file} && "
                  f"exec {quote_argv(argv)}")
        result = runner.run(script, check=False, timeout_s=CHAIN_MAX_S, input=request)
        return _report(result.stdout, runner, what)

    def receive(i: int) -> dict[str, Any]:
        host = chain[i]
        args = ["receive", "--dest", plan.checkpoints.of(host), "--port", str(ports[host.name]),
                "--timeout", f"{timeout:.0f}"]
        if i + 1 < len(chain):
            args += ["--forward", address(chain[i + 1])]
        return run(host, args, "receive the chief's checkpoint")

    def send_all() -> dict[str, Any]:
        args = ["send", "--source", plan.checkpoints.of(chief), "--to", address(chain[0]),
                "--newest", "--timeout", f"{timeout:.0f}"]
        return run(chief, args, "send the chief's checkpoint")

    def stop(host: Host, signal: str) -> None:
        pid_file = shlex.quote(pid_files[host.name])
        # Best effort: a host that does not answer cannot be stopped, nor hold up the rest.
        with contextlib.suppress(OrchestratorError):
            runner_for(host).run(f"[ -f {pid_file} ] && kill -{signal} $(cat {pid_file}) "
                                 f"2>/dev/null; rm -f {pid_file}", check=False, timeout_s=30)

    pool = ThreadPoolExecutor(max_workers=2 * len(chain) + 2)
    try:
        futures = {pool.submit(receive, i): host for i, host in enumerate(chain)}
        futures[pool.submit(send_all)] = chief
        waiting = None
        for future in as_completed(futures):
            if not _outcome(future).get("ok"):  # stop the rest: they cannot succeed now
                list(pool.map(lambda h: stop(h, "TERM"), futures.values()))
                waiting = STRAGGLER_S  # a host lost mid-copy may never answer its command
                break
        done = wait(futures, timeout=waiting).done
        outcomes: list[tuple[Host, dict[str, Any]]] = [
            (host, _outcome(f) if f in done else
             {"ok": False, "error": f"did not answer within {STRAGGLER_S:g} s of being "
                                    "stopped (is the host up?)"})
            for f, host in futures.items()]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    failed = [f"{host.name}: {report.get('error', 'failed')}" for host, report in outcomes
              if not report.get("ok")]
    if failed:
        raise OrchestratorError(
            "could not copy the chief's checkpoint to the other hosts:\n  " + "\n  ".join(failed),
            fix="the hosts must reach each other on the task ports (as training needs); "
                "'orchestrate doctor' checks that")
    sent = next(report for host, report in outcomes if host is chief)
    received = [(host, report) for host, report in outcomes if host is not chief]
    return Copied(hosts=[h.name for h, r in received if r.get("received")],
                  up_to_date=[h.name for h, r in received if r.get("up_to_date")],
                  cleared=[h.name for h, r in received if r.get("cleared")],
                  files=int(sent["files"]), bytes=int(sent["bytes"]),
                  hops=len(chain) if sent["bytes"] else 0,
                  cpu_s={h.name: float(r.get("cpu_s") or 0.0) for h, r in outcomes})


def _outcome(future: Any) -> dict[str, Any]:
    try:
        report: dict[str, Any] = future.result()
    except OrchestratorError as exc:
        return {"ok": False, "error": exc.message}
    return report


def install_from_here(runner: Runner, worker: WorkerCommand, local_dir: Path, dest: str) -> int:
    """Upload ``local_dir`` to a staging dir beside ``dest`` on the host, then swap it in.
    Returns the bytes uploaded."""
    parent = dest.rstrip("/").rsplit("/", 1)[0] or "/"
    staging = f"{parent}/.orchestrate-upload-{secrets.token_hex(6)}"
    sent = 0
    try:
        for path in sorted(p for p in local_dir.rglob("*") if p.is_file()):
            remote = f"{staging}/{path.relative_to(local_dir).as_posix()}"
            runner.put_file(str(path), remote)
            sent += path.stat().st_size
        runner.run(["mkdir", "-p", staging])
        runner.run(worker.argv("worker.transfer", "install", "--dest", dest),
                   input=json.dumps({"staging": staging}), timeout_s=120)
    finally:
        runner.run(["rm", "-rf", staging], check=False)
    return sent


def fetch_file(host: Host, runner: Runner, remote_path: str, local_dir: Path) -> str:
    """Download one file from ``host`` into ``local_dir``; returns the local path."""
    local = local_dir / Path(remote_path).name
    local_dir.mkdir(parents=True, exist_ok=True)
    runner.get_file(remote_path, str(local))
    return str(local)


class CheckpointMirror:
    """A copy of the chief's checkpoint on this machine, refreshed after every checkpoint event.

    A chief whose host is gone then loses nothing that was checkpointed: the relaunch pushes
    the mirror back. One long-lived thread pulls (started by the first request, stopped by
    ``close``); requests coalesce, only the newest matters. A pull lists the chief's files,
    downloads only those that changed (no archive, no gzip: the chief's CPU trains) over the
    runner's bulk connection, hard-links the rest from the previous copy, and swaps the new
    directory in under the lock that every read of the copy takes.

    Under ``mode="auto"`` a checkpoint larger than ``max_bytes`` turns the mirror off for the
    rest of the run (``on_off`` is told why, once); ``never`` never pulls.

    Pulls are paced to ``busy_max`` of the time (see ``MIRROR_BUSY_MAX``): a request that comes
    sooner waits, and is replaced by newer ones while it waits. ``wait`` lifts the pacing while it
    waits, for the request pending then and any that come meanwhile (one from ``on_mirrored``):
    a relaunch wants the newest copy at once.

    Args:
        directory: where the copy lives on this machine (``current`` inside it).
        runner_for: the runner of a host.
        worker_for: how to run the worker's modules on a host.
        on_mirrored: called with the step of each checkpoint copied here.
        on_pulling: called with the step when a pull starts, and with None when it ends.
        on_off: called once with the reason when ``auto`` turns the mirror off.
        busy_max: the fraction of the time the mirror may spend pulling.
        clock: monotonic seconds (tests pass a fake one).
    """

    def __init__(self, directory: Path, runner_for: RunnerFor,
                 worker_for: Callable[[Host], WorkerCommand], *, mode: str = "auto",
                 max_bytes: int = AUTO_MIRROR_MAX_BYTES,
                 on_mirrored: Callable[[int], None] = lambda step: None,
                 on_pulling: Callable[[int | None], None] = lambda step: None,
                 on_off: Callable[[str], None] = lambda why: None,
                 busy_max: float = MIRROR_BUSY_MAX,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.directory = directory
        self.runner_for = runner_for
        self.worker_for = worker_for
        self.mode = mode
        self.max_bytes = max_bytes
        self.on_mirrored = on_mirrored
        self.on_pulling = on_pulling
        self.on_off = on_off
        self.off_reason = "checkpoint.mirror is never" if mode == "never" else ""
        self.bytes_pulled = 0  # through this machine's link, for the run's figures
        self.bytes_pushed = 0
        self.busy_max = busy_max
        self.clock = clock
        self._wake = threading.Condition()  # guards the six fields below
        self._wanted: tuple[ClusterPlan, int] | None = None
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._not_before = 0.0  # the pacing: no pull starts before this (clock's seconds)
        self._waiting = 0  # callers in ``wait``: while any, requests are served unpaced
        self._copy_lock = threading.Lock()  # guards ``current`` on disk and _step
        self._step: int | None = None

    @property
    def current(self) -> Path:
        return self.directory / "current"

    @property
    def step(self) -> int | None:
        """The step of the checkpoint copied here (None before the first pull)."""
        with self._copy_lock:
            return self._step

    @property
    def enabled(self) -> bool:
        return not self.off_reason

    def has_checkpoint(self) -> bool:
        with self._copy_lock:
            return (self.current / INDEX).is_file() or (self.current / "chief" / INDEX).is_file()

    def request(self, plan: ClusterPlan, step: int) -> None:
        """Pull the chief's checkpoint of ``step`` soon; replaces a request not yet started."""
        with self._wake:
            if self._closed or not self.enabled:
                return
            self._wanted = (plan, step)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._serve, daemon=True,
                                                name="orchestrate-mirror")
                self._thread.start()
            self._wake.notify_all()

    def wait(self, timeout_s: float = 60.0) -> bool:
        """Wait until no pull is wanted or running, serving every request meanwhile at once,
        paced or not; False if that took longer than ``timeout_s``."""
        with self._wake:
            self._waiting += 1
            self._wake.notify_all()
            try:
                return self._wake.wait_for(lambda: self._wanted is None and not self._busy,
                                           timeout_s)
            finally:
                self._waiting -= 1

    def close(self, timeout_s: float = 10.0) -> bool:
        """Stop the thread: drop a pull not yet started, let one in flight end (its callbacks
        still come) for up to ``timeout_s``. True when the thread has ended."""
        with self._wake:
            self._closed = True
            self._wanted = None
            self._wake.notify_all()
            thread = self._thread
        if thread is None:
            return True
        thread.join(timeout_s)
        return not thread.is_alive()

    def _serve(self) -> None:
        while True:
            with self._wake:
                while not self._closed and (self._wanted is None or (
                        not self._waiting and (left := self._not_before - self.clock()) > 0)):
                    self._wake.wait(left if self._wanted is not None else None)
                if self._wanted is None:  # closed
                    return
                (plan, step), self._wanted = self._wanted, None
                self._busy = True
            started = self.clock()
            try:
                self._pull_and_report(plan, step)
            finally:
                with self._wake:
                    ended = self.clock()
                    self._not_before = ended + (ended - started) * (1 / self.busy_max - 1)
                    self._busy = False
                    self._wake.notify_all()

    def _pull_and_report(self, plan: ClusterPlan, step: int) -> None:
        self.on_pulling(step)
        try:
            copied = self.pull(plan, step)
        except (OrchestratorError, OSError, ValueError):
            return  # the next checkpoint event asks again; a relaunch uses the copy we have
        finally:
            self.on_pulling(None)
        if copied:
            self.on_mirrored(step)

    def pull(self, plan: ClusterPlan, step: int | None = None) -> bool:
        """Copy the chief's checkpoint here now, on the calling thread; False when the mirror
        is (or just turned) off."""
        if not self.enabled:
            return False
        chief = plan.chief.host
        source = plan.checkpoints.of(chief)
        runner = self.runner_for(chief)
        listing = list_dir(runner, self.worker_for(chief), source)
        if not listing.has_checkpoint:
            return False
        if self.mode == "auto" and listing.bytes > self.max_bytes:
            self._turn_off(listing.bytes)
            return False
        self.directory.mkdir(parents=True, exist_ok=True)
        fresh = Path(tempfile.mkdtemp(prefix="incoming-", dir=self.directory))
        try:
            self._fill(fresh, runner, source, listing)
            _check_index(fresh)
            self._swap_in(fresh, step)
        finally:
            shutil.rmtree(fresh, ignore_errors=True)
        return True

    def _turn_off(self, size: int) -> None:
        gib = size / (1 << 30)
        self.off_reason = (
            f"the chief's checkpoint is {gib:.1f} GiB, above the {self.max_bytes / (1 << 30):g} "
            "GiB that this machine copies under checkpoint.mirror: auto; this machine keeps no "
            "copy from now on (set checkpoint.mirror: always to keep one, or put checkpoint.dir "
            "on shared storage)")
        self.on_off(self.off_reason)

    def _fill(self, fresh: Path, runner: Runner, source: str, listing: Listing) -> None:
        """Hard-link what the current copy has unchanged, download the rest (index first)."""
        with self._copy_lock:
            have = _local_listing(self.current)
            keep = {f["path"] for f in listing.files} - set(listing.needed_by(have))
            for rel in keep:
                target = fresh / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                os.link(self.current / rel, target)
        order = sorted(listing.needed_by(have), key=lambda p: (Path(p).name != INDEX, p))
        mtimes = {f["path"]: int(f["mtime_ns"]) for f in listing.files}
        for rel in order:
            target = fresh / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            runner.get_file(f"{source}/{rel}", str(target))
            self.bytes_pulled += target.stat().st_size
            os.utime(target, ns=(mtimes[rel], mtimes[rel]))

    def _swap_in(self, fresh: Path, step: int | None) -> None:
        old = self.directory / "previous"
        with self._copy_lock:
            shutil.rmtree(old, ignore_errors=True)
            if self.current.exists():
                os.replace(self.current, old)
            os.replace(fresh, self.current)
            self._step = step
        shutil.rmtree(old, ignore_errors=True)

    def push(self, host: Host, dest: str) -> None:
        """Install the mirrored checkpoint as ``dest`` on ``host``."""
        with self._copy_lock:
            self.bytes_pushed += install_from_here(self.runner_for(host), self.worker_for(host),
                                                   self.current, dest)


def _local_listing(directory: Path) -> Listing:
    found = listing(str(directory))
    return Listing(bool(found["exists"]), tuple(found["files"]))


def _check_index(directory: Path) -> None:
    """The copy's index must name a checkpoint whose files came too (a pull that raced a new
    save fails here; the next checkpoint event asks again)."""
    for index in (directory / INDEX, directory / "chief" / INDEX):
        if not index.is_file():
            continue
        match = re.search(r'^model_checkpoint_path:\s*"([^"]+)"', index.read_text(), re.M)
        if match and not (index.parent / f"{Path(match.group(1)).name}.index").is_file():
            raise ValueError(f"the copied index names {match.group(1)}, which was not copied")


def verify_on(runner: Runner, worker: WorkerCommand, directory: str) -> dict[str, Any]:
    """Run ``python -m worker verify-checkpoint`` on a host: the newest checkpoint that restores.

    The report's ``dir`` is the directory it checked (``DIR/chief`` in BackupAndRestore's
    layout). A local directory in which no checkpoint restores is moved aside, so the tasks
    start afresh instead of failing on it again and again.
    """
    result = runner.run(worker.argv("worker", "verify-checkpoint", "--dir", directory),
                        check=False, timeout_s=600)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RemoteError(f"checkpoint check printed nothing (exit {result.exit_code}): "
                          f"{(result.stderr or result.stdout).strip()[-500:]}",
                          host=runner.host_name)
    report: dict[str, Any] = json.loads(lines[-1])
    if not report["ok"] and "://" not in directory:
        runner.run(["mv", directory, f"{directory}.unusable-{int(time.time())}"])
    return report
