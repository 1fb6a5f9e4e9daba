"""Training state across hosts: mirror, verify and share the chief's checkpoint; fetch the model."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from orchestrator.errors import OrchestratorError, RemoteError
from orchestrator.hosts import Host
from orchestrator.plan import ClusterPlan
from orchestrator.remote.base import Runner
from orchestrator.remote.fanout import fan_out

RunnerFor = Callable[[Host], Runner]


def share_chief_checkpoint(plan: ClusterPlan, runner_for: RunnerFor) -> list[str]:
    """Copy the chief's ``checkpoints/chief`` to every other machine of the plan.

    Every task restores from ``checkpoints/chief`` on its own disk, so without the
    copy the others would start from step 0 and the group would disagree.
    Returns the names of the hosts that received it (none when there is no
    checkpoint yet, or all tasks share the chief's machine).
    """
    chief = plan.chief.host
    targets = list({t.host.machine: t.host for t in plan.tasks
                    if t.host.machine != chief.machine}.values())
    source = plan.paths[chief.name].chief_checkpoint_dir
    runner = runner_for(chief)
    if not targets or not runner.run(["test", "-f", f"{source}/checkpoint"], check=False).ok:
        return []
    archive = f"{plan.paths[chief.name].run_dir}/chief-checkpoint.tar.gz"
    runner.run(["tar", "-C", source, "-czf", archive, "."])
    with tempfile.TemporaryDirectory(prefix="orchestrate-ckpt-") as scratch:
        local = str(Path(scratch) / "chief-checkpoint.tar.gz")
        runner.get_file(archive, local)

        def install(host: Host) -> None:
            paths = plan.paths[host.name]
            _install(runner_for(host), local, paths.chief_checkpoint_dir,
                     f"{paths.run_dir}/chief-checkpoint.tar.gz")

        fan_out(targets, install, name_of=lambda h: h.name).raise_if_failed(
            "copy the chief's checkpoint")
    return [h.name for h in targets]


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
    ``close``); requests coalesce, only the newest matters. Each pull lands in a fresh
    directory that replaces the previous one with a rename, under the lock that every read of
    the copy takes, so the mirror is never seen half-written.

    Args:
        directory: where the copy lives on this machine (``current`` inside it).
        runner_for: the runner of a host.
        on_mirrored: called with the step of each checkpoint copied here.
        on_pulling: called with the step when a pull starts, and with None when it ends
            (copied or not).
    """

    def __init__(self, directory: Path, runner_for: RunnerFor,
                 on_mirrored: Callable[[int], None] = lambda step: None,
                 on_pulling: Callable[[int | None], None] = lambda step: None) -> None:
        self.directory = directory
        self.runner_for = runner_for
        self.on_mirrored = on_mirrored
        self.on_pulling = on_pulling
        self._wake = threading.Condition()  # guards the four fields below
        self._wanted: tuple[ClusterPlan, int] | None = None
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None
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

    def has_checkpoint(self) -> bool:
        with self._copy_lock:
            return (self.current / "checkpoint").is_file()

    def request(self, plan: ClusterPlan, step: int) -> None:
        """Pull the chief's checkpoint of ``step`` soon; replaces a request not yet started."""
        with self._wake:
            if self._closed:
                return
            self._wanted = (plan, step)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._serve, daemon=True,
                                                name="orchestrate-mirror")
                self._thread.start()
            self._wake.notify_all()

    def wait(self, timeout_s: float = 60.0) -> bool:
        """Wait until no pull is wanted or running; False if that took longer than ``timeout_s``."""
        with self._wake:
            return self._wake.wait_for(lambda: self._wanted is None and not self._busy, timeout_s)

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
                self._wake.wait_for(lambda: self._wanted is not None or self._closed)
                if self._wanted is None:  # closed
                    return
                (plan, step), self._wanted = self._wanted, None
                self._busy = True
            try:
                self._pull_and_report(plan, step)
            finally:
                with self._wake:
                    self._busy = False
                    self._wake.notify_all()

    def _pull_and_report(self, plan: ClusterPlan, step: int) -> None:
        self.on_pulling(step)
        try:
            self.pull(plan, step)
        except (OrchestratorError, OSError, tarfile.TarError):
            return  # the next checkpoint event asks again; a relaunch uses the copy we have
        finally:
            self.on_pulling(None)
        self.on_mirrored(step)

    def pull(self, plan: ClusterPlan, step: int | None = None) -> None:
        """Copy the chief's checkpoint here now, on the calling thread."""
        chief = plan.chief.host
        source = plan.paths[chief.name].chief_checkpoint_dir
        archive = f"{plan.paths[chief.name].run_dir}/mirror.tar.gz"
        runner = self.runner_for(chief)
        runner.run(["tar", "-C", source, "-czf", archive, "."], timeout_s=120)
        self.directory.mkdir(parents=True, exist_ok=True)
        fresh = Path(tempfile.mkdtemp(prefix="incoming-", dir=self.directory))
        local = fresh.with_suffix(".tar.gz")
        try:
            runner.get_file(archive, str(local))
            with tarfile.open(local) as tar:
                tar.extractall(fresh, filter="data")
            self._swap_in(fresh, step)
        finally:
            local.unlink(missing_ok=True)
            shutil.rmtree(fresh, ignore_errors=True)

    def _swap_in(self, fresh: Path, step: int | None) -> None:
        old = self.directory / "previous"
        with self._copy_lock:
            shutil.rmtree(old, ignore_errors=True)
            if self.current.exists():
                os.replace(self.current, old)
            os.replace(fresh, self.current)
            self._step = step
        shutil.rmtree(old, ignore_errors=True)

    def push(self, host: Host, dest: str, run_dir: str) -> None:
        """Install the mirrored checkpoint as ``dest`` on ``host``."""
        with tempfile.TemporaryDirectory(prefix="orchestrate-push-") as scratch:
            local = Path(scratch) / "checkpoint.tar.gz"
            with self._copy_lock, tarfile.open(local, "w:gz") as tar:
                tar.add(self.current, arcname=".")
            _install(self.runner_for(host), str(local), dest, f"{run_dir}/mirror-push.tar.gz")


def _install(runner: Runner, local_archive: str, dest: str, remote_archive: str) -> None:
    q = shlex.quote
    runner.run(["mkdir", "-p", remote_archive.rsplit("/", 1)[0]])
    runner.put_file(local_archive, remote_archive)
    runner.run(f"rm -rf {q(dest)} && mkdir -p {q(dest)} && "
               f"tar -C {q(dest)} -xzf {q(remote_archive)} && rm -f {q(remote_archive)}")


def verify_on(runner: Runner, python: str, lib: str, directory: str) -> dict[str, Any]:
    """Run ``python -m worker verify-checkpoint`` on a host: the newest checkpoint that restores.

    A directory in which no checkpoint restores is moved aside, so the tasks start afresh
    instead of failing on it again and again.
    """
    argv = ["env", f"PYTHONPATH={lib}", python, "-m", "worker", "verify-checkpoint",
            "--dir", directory]
    result = runner.run(argv, check=False, timeout_s=300)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RemoteError(f"checkpoint check printed nothing (exit {result.exit_code}): "
                          f"{(result.stderr or result.stdout).strip()[-500:]}",
                          host=runner.host_name)
    report: dict[str, Any] = json.loads(lines[-1])
    if not report["ok"]:
        runner.run(["mv", directory, f"{directory}.unusable-{int(time.time())}"])
    return report
