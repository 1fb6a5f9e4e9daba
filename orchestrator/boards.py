"""Where a run's TensorBoard logs are, and their copy on this machine.

The chief of each attempt writes an event file of its own (``worker/tensorboard.py``), and the
trace of ``tensorboard.profile_steps`` under ``plugins/profile/``, in ``tensorboard.dir``/
CLUSTER/RUN_ID (a bucket TensorBoard reads itself, or storage every host mounts, this machine
too) or else in the run's directory on its host. An attempt's chief may run on another host
than the one before (a lost host replaced), so a run's files may lie on several hosts:
``local_logs`` copies every attempt's chief's files here, into the run's directory on this
machine, over each host's bulk connection (never the control path a watch loop polls on). Event
files only grow: a file already here at its size on the host is not copied again.
"""

from __future__ import annotations

import importlib.util
import posixpath
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator import paths
from orchestrator.errors import OrchestratorError, StateError
from orchestrator.hosts import Host
from orchestrator.paths import RunPaths
from orchestrator.remote.base import Runner
from orchestrator.spec import ClusterSpec
from orchestrator.state import RunRecord

# Event files, as TensorBoard names them (worker/tensorboard.py, tf.summary), in the directory
# or in directories under it (Keras's TensorBoard callback writes train/ and validation/, a
# command job's script may too), and the profilers' traces (TensorFlow's and JAX's, as the
# Profile tab reads them: plugins/profile/<time>/<host>.xplane.pb): anything else a host lists
# is left there.
EVENT_PATH = re.compile(r"(?:[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}/){0,3}"
                        r"events\.out\.tfevents\.[A-Za-z0-9._-]{1,200}"
                        r"|(?:[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}/)?plugins/profile/"
                        r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}/[A-Za-z0-9_-][A-Za-z0-9._-]{0,200}"
                        r"\.xplane\.pb")
COPY_EVERY_S = 30.0  # while a run trains, how often its logs are copied here
COPY_BUSY_MAX = 0.05  # the most of the time copying may take (as the checkpoint mirror's)
# Lists "SIZE PATH" for each event file under $1 (nothing where the directory is not there).
LIST_SCRIPT = ('cd -- "$1" 2>/dev/null || exit 0; find . -maxdepth 5 -type f '
               "\\( -name 'events.out.tfevents.*' -o -name '*.xplane.pb' \\) | "
               "while IFS= read -r f; do "
               'printf "%s %s\\n" "$(wc -c < "$f")" "${f#./}"; done; exit 0')


@dataclass
class Logs:
    """A run's TensorBoard directory on this machine (or its gs:// URL, which TensorBoard
    reads itself), and what getting it there said."""

    directory: Path | str  # a str for a URL only
    copied: int = 0  # files copied (new, or grown) this time
    notes: list[str] = field(default_factory=list)  # hosts that could not be read, and why


def chief_key(spec: ClusterSpec) -> str:
    return "chief:0" if spec.separate_chief else "worker:0"


def local_logs(spec: ClusterSpec, run: RunRecord, hosts: Callable[[], Mapping[str, Host]],
               runner_for: Callable[[Host], Runner]) -> Logs:
    """The run's logs as a directory on this machine: storage this machine mounts, the chief's
    own directory where it ran here, or a copy of every attempt's chief's files (``hosts()``:
    the cluster's, asked for only then); or the bucket's URL."""
    if not spec.tensorboard.enabled:
        raise StateError(f"cluster {spec.name!r} writes no TensorBoard logs "
                         "(tensorboard.enabled is false in its spec)",
                         fix="set tensorboard: {enabled: true} for the runs to come")
    if spec.tensorboard.dir and "://" in spec.tensorboard.dir:
        return Logs(posixpath.join(spec.tensorboard.dir, spec.name, run.id))
    if spec.tensorboard.dir:
        shared = Path(posixpath.join(spec.tensorboard.dir, spec.name, run.id))
        if not shared.is_dir():
            raise StateError(f"run {run.id} has no TensorBoard logs at {shared} on this machine",
                             fix="mount the storage tensorboard.dir names here, or look from a "
                                 "machine that mounts it")
        return Logs(shared)
    here = paths.run_home(spec.name, run.id) / "tensorboard"
    logs = Logs(here)
    sources: dict[str, tuple[Host, str]] = {}
    chief = chief_key(spec)
    by_name = hosts()
    for attempt in run.attempts:
        for task in (t for t in attempt.tasks if t.task == chief):
            host = by_name.get(task.host)
            if host is None:
                logs.notes.append(f"{task.host} (attempt {attempt.number}'s chief) is no longer "
                                  "one of the cluster's hosts: its logs are not here")
            else:
                sources.setdefault(host.name, (host, RunPaths.of(host.root, run.id)
                                               .tensorboard_dir))
    for host, directory in sources.values():
        if host.is_local and Path(directory) == here:
            continue  # the chief ran on this machine, in this very directory
        try:
            logs.copied += _pull(runner_for(host), directory, here)
        except OrchestratorError as exc:
            logs.notes.append(f"{host.name}: {exc.message}")
    if not here.is_dir() or not any(here.rglob("events.out.tfevents.*")):
        said = "; ".join(logs.notes) or "no chief has written any yet"
        raise StateError(f"run {run.id} has no TensorBoard logs yet ({said})",
                         fix="look again once its chief has trained a few steps")
    return logs


class BoardCopy:
    """This machine's copy of a run's logs kept current while it trains, the way the
    checkpoint mirror keeps its copy: a thread of its own that copies what the chiefs wrote
    (``local_logs``) every ``COPY_EVERY_S``, and less often when copying is slow, so that it
    takes at most ``COPY_BUSY_MAX`` of the time; over each host's bulk connection, never the
    control path. ``close`` makes one last copy (the run's end) and stops it.

    A copy that finds nothing yet, or a host it cannot read, is tried again at the next turn
    (``orchestrate tensorboard`` says why when asked); anything else is said once, and the
    copying ends: the logs stay on the hosts, where ``orchestrate tensorboard`` gets them.
    """

    def __init__(self, spec: ClusterSpec, run: Callable[[], RunRecord],
                 hosts: Callable[[], Mapping[str, Host]], runner_for: Callable[[Host], Runner],
                 say: Callable[[str], None], *, every_s: float = COPY_EVERY_S) -> None:
        self.spec, self.run, self.hosts, self.runner_for = spec, run, hosts, runner_for
        self.say = say
        self.every_s = every_s
        self.copied = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="orchestrate-tensorboard",
                                        daemon=True)

    @staticmethod
    def wanted(spec: ClusterSpec) -> bool:
        """Logs a chief writes on its own host's disk (not on storage this machine mounts)."""
        return spec.tensorboard.enabled and not spec.tensorboard.dir

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _loop(self) -> None:
        wait = self.every_s
        while not self._stop.wait(wait):
            began = time.monotonic()
            if not self._copy():
                return
            wait = max(self.every_s, (time.monotonic() - began) * (1 / COPY_BUSY_MAX - 1))
        self._copy()  # what the chief wrote last

    def _copy(self) -> bool:
        try:
            self.copied += local_logs(self.spec, self.run(), self.hosts, self.runner_for).copied
        except StateError:
            pass  # nothing written yet: the next turn
        except Exception as exc:
            self.say(f"TensorBoard logs are no longer copied here during the run: "
                     f"{type(exc).__name__}: {str(exc)[:300]} ('orchestrate tensorboard' "
                     "copies them when asked)")
            return False
        return True


def _pull(runner: Runner, remote_dir: str, here: Path) -> int:
    """Copy the event files of ``remote_dir`` that are new or have grown; how many."""
    listed = runner.run(["sh", "-c", LIST_SCRIPT, "sh", remote_dir]).stdout
    copied = 0
    for line in listed.splitlines():
        size, _, name = line.strip().partition(" ")
        if not size.isdigit() or not EVENT_PATH.fullmatch(name):
            continue  # not an event file: never a path this machine would follow
        mine = here / name
        if mine.is_file() and mine.stat().st_size >= int(size):
            continue
        here.mkdir(parents=True, exist_ok=True, mode=0o700)
        mine.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        runner.get_file(posixpath.join(remote_dir, name), str(mine))
        copied += 1
    return copied


def serve(refresh: Callable[[], Logs], say: Callable[[str], None], *, port: int = 0,
          refresh_s: float = 30.0) -> None:
    """Run TensorBoard on this machine (127.0.0.1 only) over ``refresh()``'s directory until
    Ctrl-C, calling ``refresh`` again every ``refresh_s`` (a copy then takes in what the chief
    wrote since). TensorBoard's Python loader is used (``--load_fast=false``): it drops the
    steps an attempt redid, as its faster data server does not."""
    logs = refresh()
    if importlib.util.find_spec("tensorboard") is None:
        raise StateError(f"TensorBoard is not installed here (the logs are in {logs.directory})",
                         fix='pip install -e ".[tensorboard]", or point any TensorBoard at '
                             "that directory")
    if isinstance(logs.directory, str) and not any(
            importlib.util.find_spec(reader) for reader in ("tensorflow", "gcsfs")):
        raise StateError(f"the logs are in {logs.directory}, and TensorBoard reads gs:// "
                         "through TensorFlow's file systems or gcsfs, neither installed here",
                         fix="pip install gcsfs (with credentials for the bucket: gcloud auth "
                             "application-default login), or run TensorBoard where TensorFlow "
                             "is installed")
    port = port or _free_port()
    for note in logs.notes:
        say(f"note: {note}")
    with tempfile.TemporaryFile() as said:
        board = subprocess.Popen(
            [sys.executable, "-m", "tensorboard.main", "--logdir", str(logs.directory),
             "--host", "127.0.0.1", "--port", str(port), "--load_fast", "false",
             "--reload_interval", "5"], stdin=subprocess.DEVNULL, stdout=said, stderr=said)
        try:
            say(f"TensorBoard at http://127.0.0.1:{port}/ on {logs.directory} "
                "(Ctrl-C ends it)")
            while True:
                try:
                    board.wait(refresh_s)
                    break
                except subprocess.TimeoutExpired:
                    for note in _refreshed(refresh):
                        say(f"note: {note}")
            said.seek(0)
            tail = said.read()[-2000:].decode(errors="replace").strip()
            raise StateError(f"TensorBoard ended by itself (exit {board.returncode}): {tail}",
                             fix="see its message; --port picks another port")
        finally:
            if board.poll() is None:
                board.terminate()
                try:
                    board.wait(10)
                except subprocess.TimeoutExpired:
                    board.kill()
                    board.wait()


def _refreshed(refresh: Callable[[], Logs]) -> list[str]:
    try:
        return refresh().notes
    except OrchestratorError as exc:
        return [exc.message]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
