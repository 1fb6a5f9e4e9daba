"""JAX's coordination service in a process of its own (``worker.jax_service``), as the chief
starts it (``keras_jax._Service``): jaxlib's real service, no JAX import, no training.

The trainings that rely on it (a killed chief whose worker saves in its place) are in
tests/test_keras_jax_managed.py."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import pytest

from worker.runtimes.keras_jax import Processes, _Service

pytest.importorskip("jaxlib")


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
