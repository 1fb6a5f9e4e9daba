"""Which task runs TensorFlow's coordination service, and the others' wait for its port before
they ask for it (worker/runtimes/common.py): asked too early, gRPC tries again only after a
second."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from worker.runtimes.common import await_port, coordination_leader


def config(cluster: dict[str, list[str]], role: str, index: int) -> str:
    return json.dumps({"cluster": cluster, "task": {"type": role, "index": index}})


WORKERS = {"worker": ["10.0.0.1:2222", "10.0.0.2:2222"]}
WITH_CHIEF = {"chief": ["10.0.0.9:2222"], "worker": ["10.0.0.1:2222"]}


@pytest.mark.parametrize(("tf_config", "expected"), [
    (config(WORKERS, "worker", 0), ("10.0.0.1:2222", True)),
    (config(WORKERS, "worker", 1), ("10.0.0.1:2222", False)),
    (config(WITH_CHIEF, "chief", 0), ("10.0.0.9:2222", True)),
    (config(WITH_CHIEF, "worker", 0), ("10.0.0.9:2222", False)),
    (config({"worker": ["[fd00::1]:2222", "[fd00::2]:2222"]}, "worker", 1),
     ("[fd00::1]:2222", False)),
    (None, None), ("", None), ("not json", None), (json.dumps({"cluster": {}}), None),
    (json.dumps([1, 2]), None),
])
def test_the_leader_is_the_chief_or_else_worker_0_as_tensorflow_picks_it(
        tf_config: str | None, expected: tuple[str, bool] | None) -> None:
    assert coordination_leader(tf_config) == expected


def test_a_task_waits_for_the_leaders_port_and_goes_once_it_listens() -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # a free port: nothing listens there yet
    accepted: list[tuple[str, int]] = []
    listening = threading.Event()

    def leader() -> None:
        time.sleep(0.3)
        with socket.create_server(("127.0.0.1", port)) as server:
            listening.set()
            conn, peer = server.accept()
            conn.close()
            accepted.append(peer)

    thread = threading.Thread(target=leader, daemon=True)
    thread.start()
    await_port(f"127.0.0.1:{port}", limit_s=30)
    assert listening.is_set()  # it returned only once the port listened ...
    thread.join(timeout=10)
    assert len(accepted) == 1  # ... having connected to it


def test_a_leader_that_never_listens_is_waited_for_only_so_long() -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    done = threading.Event()
    thread = threading.Thread(target=lambda: (await_port(f"127.0.0.1:{port}", limit_s=0.2),
                                              done.set()), daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert done.is_set()  # then TensorFlow's own wait goes on
