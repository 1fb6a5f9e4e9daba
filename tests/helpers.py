"""Small helpers shared by the end-to-end tests: spec files for lab hosts, events on a host."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import paramiko
import pytest
from hostlab import HostLab, LabHost

from orchestrator import cli, paths
from orchestrator.events import Event, parse_line
from orchestrator.remote.ssh import Link, SSHRunner
from orchestrator.state import AttemptRecord, Store

REPO = Path(__file__).resolve().parent.parent


def write_spec(tmp_path: Path, lab: HostLab, hosts: list[LabHost], body: str,
               provider_extra: str = "", known_hosts: str | None = None,
               user: str | None = None) -> Path:
    """A static-provider spec for ``hosts`` (workers = len(hosts)) followed by ``body``;
    ``user`` logs in on every host instead of each host's own (e.g. ``lab.plain_user()``)."""
    host_lines = "".join(
        f"    - {{address: {h.address}, ssh_port: {h.port}, user: {user or h.user}, "
        f"key_file: {lab.client_key_path}}}\n" for h in hosts
    )
    path = tmp_path / "cluster.yaml"
    path.write_text(
        f"workdir: {REPO}\nworkers: {len(hosts)}\n"
        f"provider:\n  kind: static\n  python: {sys.executable}\n"
        f"  known_hosts: {known_hosts or lab.known_hosts_path}\n"
        f"  connect_timeout_s: 2\n  wait_for_host_s: 4\n{provider_extra}"
        f"  hosts:\n{host_lines}" + textwrap.dedent(body)
    )
    return path


def private_examples(path: Path, tmp_path: Path) -> None:
    """The spec ``write_spec`` wrote at ``path`` runs a copy of examples/ of its own: the
    repository changes as other tests run (their caches), and a workdir that changed stops
    what a train started early."""
    code = tmp_path / "code"
    shutil.copytree(REPO / "examples", code / "examples")
    path.write_text(path.read_text().replace(f"workdir: {REPO}", f"workdir: {code}"))


def first_attempt_pgids(run_id: str) -> list[int]:
    """The process groups of the first attempt's tasks of run ``run_id``, as the store has
    them, in order."""
    store = Store()
    try:
        return sorted(t.pgid for t in store.get_run(run_id).attempts[0].tasks)
    finally:
        store.close()


def events_in(host: LabHost, path: str) -> list[Event]:
    """The worker events in a log file on ``host``."""
    text = host.run(["cat", path]).stdout
    return [e for e in map(parse_line, text.splitlines()) if e is not None]


def namespace_commands(host: LabHost) -> set[str]:
    """The names of the processes running in ``host``'s network namespace."""
    pids = subprocess.run(["ip", "netns", "pids", str(host.namespace)], capture_output=True,
                          text=True, check=True).stdout.split()
    names = set()
    for pid in pids:
        with contextlib.suppress(FileNotFoundError):
            names.add(Path(f"/proc/{pid}/comm").read_text().strip())
    return names


def as_from_a_terminal() -> None:
    """A child's signals as a terminal's shell leaves them (``preexec_fn=``): SIGINT, SIGQUIT and
    SIGHUP at their defaults. A suite started as a background job (``bash .ci/run &``) inherits
    SIGINT and SIGQUIT ignored, under ``nohup`` SIGHUP too, and every child keeps them ignored:
    a test that sends its child one of them must not depend on how the suite was started."""
    for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


GCP_PROJECT = "test-project"


def write_gcp_spec(tmp_path: Path, name: str = "gcp-test", workers: int = 3,
                   **provider: object) -> Path:
    """A managed-mode spec of the gcp provider in ``us-central1-a`` (``provider`` overrides)."""
    settings = {"kind": "gcp", "project": GCP_PROJECT, "zones": ["us-central1-a"], **provider}
    path = tmp_path / f"{name}.yaml"
    path.write_text(json.dumps({
        "name": name, "workers": workers, "workdir": str(REPO),
        "provider": settings, "job": {"module": "examples.digits"},
    }))
    return path


class CountingRunner(SSHRunner):
    """The real runner, noting the session channels it opens (one per command, one per SFTP
    session): what a poll costs in round trips to the host."""

    def __init__(self, host: LabHost) -> None:
        super().__init__(host.name, host.endpoint())
        self.channels: list[Link] = []

    def __enter__(self) -> CountingRunner:
        return self

    def _open_channel(self, link: Link) -> paramiko.Channel:
        self.channels.append(link)
        return super()._open_channel(link)


def orchestrate(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``orchestrate ARGS`` in this process, as its entry point runs it: (exit code, out, err)."""
    with mock.patch.object(sys, "argv", ["orchestrate", *args]), \
            pytest.raises(SystemExit) as exited:
        cli.main()
    out, err = capsys.readouterr()
    code = exited.value.code
    return code if isinstance(code, int) else 1, out, err


@contextlib.contextmanager
def orchestrate_home_at(home: Path) -> Iterator[None]:
    """ORCHESTRATE_HOME set to ``home`` for a while (for a module-scoped fixture, which the
    per-test ``orchestrate_home`` fixture does not cover), then as it was."""
    previous = os.environ.get("ORCHESTRATE_HOME")
    os.environ["ORCHESTRATE_HOME"] = str(home)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("ORCHESTRATE_HOME")
        else:
            os.environ["ORCHESTRATE_HOME"] = previous


def release_run(root: str, run_id: str) -> bool:
    """Let a paced run (``tests.workloads.pace``) go at full speed from now on, where its
    directory is under ``root`` (a host's cluster root, reached by path); whether it was."""
    run_dir = Path(paths.RunPaths.of(root, run_id).run_dir)
    if not run_dir.is_dir():
        return False
    (run_dir / "release").touch()
    return True


@contextlib.contextmanager
def silent_listener(address: str = "127.0.0.1") -> Iterator[int]:
    """A TCP port on ``address`` that accepts connections and never answers them: a peer that
    waits as one without a route would. Yields the port; every connection is closed after."""
    server = socket.create_server((address, 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except TimeoutError:
                continue
            except OSError:
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join(5)
        server.close()
        for conn in held:
            conn.close()


# TensorFlow's own abort. Once in a fresh-clone CI run (2026-11-24), a tf_keras task resumed
# after 'down' died of SIGABRT inside TF's C++ runtime, 16 steps past an epoch's end: abseil's
# check "Mutex corrupt: both reader and writer lock held" (a lock on memory that was no longer
# a mutex). The controller classified it (crashed, exit 134), restarted the group from the
# chief's checkpoint and the run succeeded, as it should. It did not come back in 78 runs of
# the same stop-and-resume since (tf_keras, down at step 25, resume).
TF_ABORT = "Mutex corrupt"


def only_tf_aborts_before_the_last(attempts: Sequence[AttemptRecord]) -> None:
    """Every attempt but the last ended in TensorFlow's own abort (``TF_ABORT``), the one
    failure a test of something else lets the controller's retry absorb; anything else fails."""
    for a in attempts[:-1]:
        assert (a.cause, a.exit_code) == ("crashed", 134) and TF_ABORT in a.evidence, \
            f"attempt {a.number} ended {a.status}: {a.cause} in {a.failed_task}: {a.detail}"


def tensorboard_logs(directory: str | Path) -> Any:
    """The TensorBoard logs in ``directory`` as TensorBoard itself loads them (its
    EventAccumulator: every record's CRC checked, the steps an attempt redid purged), without
    TensorFlow (TensorBoard's own stand-in, as where TensorFlow is not installed)."""
    import types

    sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("tensorboard.compat.notf"))
    from tensorboard.backend.event_processing import event_accumulator

    logs = event_accumulator.EventAccumulator(
        str(directory), size_guidance={event_accumulator.SCALARS: 0,
                                       event_accumulator.TENSORS: 0})
    logs.Reload()
    return logs


def traced_names(path: Path) -> set[str]:
    """What a profiler's trace (an ``XSpace``, the ``.xplane.pb`` TensorFlow's and JAX's
    profilers write) saw: the names of the events of every plane. Read with the message
    definition TensorFlow ships, loaded alone (importing tensorflow would take seconds)."""
    import importlib.util

    found = importlib.util.find_spec("tensorflow")
    assert found is not None and found.submodule_search_locations, "TensorFlow is not installed"
    package = Path(next(iter(found.submodule_search_locations)))
    source = package / "tsl" / "profiler" / "protobuf" / "xplane_pb2.py"
    loader = importlib.util.spec_from_file_location("orchestrate_tests_xplane_pb2", source)
    assert loader is not None and loader.loader is not None
    xplane = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(xplane)
    space = xplane.XSpace.FromString(path.read_bytes())
    return {metadata.name for plane in space.planes
            for metadata in plane.event_metadata.values() if metadata.name}


def scalar_steps(logs: Any, tag: str) -> list[tuple[int, float]]:
    """(step, value) of one scalar, in order."""
    return [(e.step, e.value) for e in logs.Scalars(tag)]


def png_size(path: Path) -> tuple[int, int]:
    """The width and height of a PNG image, read from its header (which must be a PNG's)."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", f"{path} is not a PNG"
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def prometheus_samples(text: str) -> dict[str, float]:
    """Every sample of a run's metrics as Prometheus' own parser reads them, keyed by name and
    labels, e.g. ``orchestrate_restarts_total{cause="crashed"}``; each must carry the cluster
    and run labels, which the key leaves out."""
    from prometheus_client.parser import text_string_to_metric_families

    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("cluster") and labels.pop("run"), sample
            key = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            found[sample.name + ("{" + key + "}" if key else "")] = sample.value
    return found
