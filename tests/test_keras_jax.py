"""Keras 3 on JAX across real processes (jax's distributed service, gloo collectives on CPU):
a command job whose script follows Keras's distribution guide and only calls
``keras.distribution.initialize()``; every process ends with the same weights, and the losses
are one process's at the same global batch; a process SIGKILLed restarts the whole group.
Also on two SSH lab hosts as the unprivileged user: gloo advertises the address the host's
name resolves to, and every lab host's name resolves to its own lab address there (the lab
gives each namespace an /etc/hosts of its own, as a real host's must map its name to the
address peers reach, not to Debian's 127.0.1.1).
"""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path
from typing import Any

import pytest
from helpers import REPO, write_spec
from hostlab import HostLab

from orchestrator.api import Cluster

pytestmark = pytest.mark.tf  # Keras 3 imports TensorFlow too, and JAX keeps the cores busy

CRASH_ONCE = '''\
"""keras_jax, with process 1 SIGKILLing itself after the first epoch of the first attempt."""
import os
import signal

import keras

import keras_jax


class CrashOnce(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if os.environ["ORCHESTRATE_ATTEMPT"] == "1" and \\
                os.environ["KERAS_DISTRIBUTION_PROCESS_ID"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)


keras_jax.main([CrashOnce()])
'''


def project(tmp_path: Path, workers: int, script: str = "keras_jax.py", name: str = "jax") -> Path:
    """A project with the example and its local spec of ``workers`` processes."""
    code = tmp_path / f"project-{workers}"
    code.mkdir()
    shutil.copy(REPO / "examples" / "keras_jax.py", code / "keras_jax.py")
    (code / "crash_once.py").write_text(CRASH_ONCE)
    path = code / "spec.yaml"
    path.write_text(textwrap.dedent(f"""\
        name: {name}-{workers}
        workers: {workers}
        job: {{command: [python, {script}], backend: jax}}
        env: {{EPOCHS: "3"}}
        retry: {{max_restarts: 2, backoff_initial_s: 0}}
        """))
    return path


def results(api: Cluster, run_id: str, attempt: int | None = None) -> dict[str, dict[str, Any]]:
    """The ``result`` line each task printed (of its last attempt, or of ``attempt``)."""
    found: dict[str, dict[str, Any]] = {}
    for task, line in api.logs(run_id, attempt=attempt):
        if line.startswith("result "):
            found[task] = json.loads(line.removeprefix("result "))
    return found


def train(path: Path) -> tuple[Cluster, Any]:
    api = Cluster.from_spec(path)
    return api, api.train().wait()


def test_a_keras_distribution_script_trains_on_jax_across_processes(tmp_path: Path) -> None:
    api, result = train(project(tmp_path, 2))
    assert result.status == "succeeded" and len(result.attempts) == 1
    both = results(api, result.run_id)
    assert set(both) == {"worker:0", "worker:1"}
    assert {r["process"] for r in both.values()} == {0, 1}
    assert {(r["processes"], r["devices"]) for r in both.values()} == {(2, 2)}
    assert len({r["weights_sha256"] for r in both.values()}) == 1  # identical on every process
    model_dir = api.plan().tasks[0].env["ORCHESTRATE_MODEL_DIR"].replace("<next-run>",
                                                                         result.run_id)
    assert (Path(model_dir) / "model.keras").stat().st_size > 0  # process 0 kept the save
    # one process at the same global batch sees the same batches: the same losses
    one_api, one = train(project(tmp_path, 1))
    (alone,) = results(one_api, one.run_id).values()
    assert alone["processes"] == 1
    assert alone["loss"] == pytest.approx(both["worker:0"]["loss"], rel=1e-4)


def test_a_killed_process_restarts_the_whole_jax_group(tmp_path: Path) -> None:
    api, result = train(project(tmp_path, 2, script="crash_once.py", name="jax-crash"))
    assert result.status == "succeeded"
    first, second = result.attempts
    assert (first.cause, first.failed_task, first.exit_code) == ("crashed", "worker:1", 137)
    again = results(api, result.run_id, attempt=second.number)
    assert set(again) == {"worker:0", "worker:1"}
    assert len({r["weights_sha256"] for r in again.values()}) == 1


@pytest.mark.ssh
def test_a_keras_distribution_script_trains_on_jax_across_ssh_hosts_as_a_plain_user(
        hostlab: HostLab, tmp_path: Path, orchestrate_home: Path) -> None:
    hosts = hostlab.hosts(2)
    path = write_spec(tmp_path, hostlab, hosts, """\
        name: jax-ssh
        job: {command: [python, examples/keras_jax.py], backend: jax}
        env: {EPOCHS: "3"}
        retry: {max_restarts: 1, backoff_initial_s: 0}
        """, user=hostlab.plain_user())
    api, result = train(path)
    assert result.status == "succeeded" and len(result.attempts) == 1, result.attempts
    both = results(api, result.run_id)
    assert set(both) == {"worker:0", "worker:1"}
    assert {r["process"] for r in both.values()} == {0, 1}
    assert {(r["processes"], r["devices"]) for r in both.values()} == {(2, 2)}
    assert len({r["weights_sha256"] for r in both.values()}) == 1  # identical on both hosts
    for h, task in zip(hosts, result.attempts[0].tasks, strict=True):
        assert task.log.startswith(h.plain_home)  # each ran on its own host, as the plain user
