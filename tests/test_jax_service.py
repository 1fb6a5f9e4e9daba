"""JAX's coordination service in a process of its own (``worker.jax_service``), as the chief
starts it (``keras_jax._Service``): jaxlib's real service, no JAX import, no training.

The trainings that rely on it (a killed chief whose worker saves in its place) are in
tests/test_keras_jax_managed.py."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from worker.runtimes.keras_jax import Processes, _Service

pytest.importorskip("jaxlib")
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """A port something else holds: what a task's port taken on its host looks like."""
    with socket.socket(socket.AF_INET6) as held:
        held.bind(("::", 0))
        held.listen()
        yield held


@contextlib.contextmanager
def service_on(port: int) -> Iterator[_Service]:
    """The chief's service for 2 processes on ``port``, killed afterwards if it still runs."""
    service = _Service.start(Processes(f"[::1]:{port}", 2, 0), snapshot_s=0.0)
    try:
        yield service
    finally:
        if service.process.poll() is None:
            service.process.kill()
            service.process.wait()


def test_a_service_that_cannot_bind_its_port_is_an_error_naming_it_not_a_wait(
        listener: socket.socket) -> None:
    port = listener.getsockname()[1]
    # The port takes connections (the listener's): a wait for the port alone would pass, and
    # JAX would then talk to whatever holds it, or wait its own 300 s.
    socket.create_connection(("::1", port), timeout=5).close()
    with service_on(port) as service, pytest.raises(RuntimeError) as raised:
        service.await_serving(limit_s=120)
    assert service.process.poll() is not None
    message = str(raised.value)
    assert f"before it served on [::]:{port}" in message
    assert "is the port taken?" in message and "`ports: {start, end}`" in message


def test_a_service_that_serves_says_so_takes_connections_and_ends_when_told() -> None:
    with socket.socket(socket.AF_INET6) as probe:
        probe.bind(("::", 0))
        port = probe.getsockname()[1]
    with service_on(port) as service:
        service.await_serving(limit_s=120)
        assert service.process.poll() is None
        socket.create_connection(("::1", port), timeout=5).close()
        service.shutdown()  # "end" on its stdin: it exits at once, not after its grace
        assert service.process.returncode == 0


FAILING = """\
import sys, time
import jax
index, port = int(sys.argv[1]), int(sys.argv[2])
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                           process_id=index, heartbeat_timeout_seconds=300,
                           shutdown_timeout_seconds=300)
print("connected", flush=True)
if index == 0:
    from worker.runtimes.keras_jax import _fail_now
    _fail_now()
time.sleep(300)  # alive, and never at the shutdown barrier
"""


def test_a_failed_task_exits_at_once_not_after_jaxs_shutdown_barrier(tmp_path: Path) -> None:
    """A JAX process that failed would wait at exit for every process at JAX's shutdown
    barrier, which its peers, stuck on it in a collective, never reach (the runtime's timeout
    is 10 s; here 300 s, against a limit of 60): the controller saw an error said, and a task
    that lived on, and took the attempt for hung. `_fail_now` leaves that wait out."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    procs = [subprocess.Popen([sys.executable, str(script), str(i), str(port)], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in (0, 1)]
    try:
        chief, peer = procs
        assert chief.wait(timeout=60) == 1, chief.communicate()
        assert "connected" in chief.communicate()[0]
        assert peer.poll() is None  # the peer lives on: the chief did not wait for it
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
