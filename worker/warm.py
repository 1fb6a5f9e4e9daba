"""A warm task: the next attempt's process, started before a failure, waiting to be told to go.

The controller starts it as it would start the task (the same command line, log and
environment, less ``TF_CONFIG``), with ``ORCHESTRATE_WARM`` naming a go file. It imports what
the task imports first (TensorFlow, its Keras, the user's module), none of which may touch
TensorFlow's runtime: MultiWorkerMirroredStrategy must be created before any op. A module that
does (a tensor made at import) makes the process useless as a warm task: it says so (event
``warm_unusable``, which turns the run's warm tasks off once the controller reads it) and at
the go starts the task afresh in its place (``exec``), as a cold start would.

Then it waits. The go file (JSON: argv after ``-m worker``, env, cwd), written by the
controller once the group is to restart, makes it the task: its environment updated, the
worker's command runs in this process, so only the strategy's handshake, the build and the
restore are left.

On the chief's host (``ORCHESTRATE_WARM_VERIFY`` = the checkpoint directory and the result
file) it also checks every new checkpoint as the chief writes it, every tensor read back as
``verify-checkpoint`` does, at most 5% of the time, and at once when the controller asks
(``worker.verified``), so that a relaunch finds the newest checkpoint already verified.

A warm task whose predecessor on this host (``ORCHESTRATE_WARM_PEER``: its process group) is
gone for ``ORPHAN_S`` without a go exits: its controller is gone too. One with no predecessor (a
run's first attempt, started while the controller's doctor checks the hosts) waits at most
``ORCHESTRATE_WARM_WAIT_S`` seconds from its start.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import resource
import sys
import time
from collections.abc import Callable
from typing import Any

from worker import verified
from worker.events import emit
from worker.tfimport import keras, tensorflow

GO_ENV = "ORCHESTRATE_WARM"
VERIFY_ENV = "ORCHESTRATE_WARM_VERIFY"  # "DIR:RESULT_FILE:REQUEST_FILE" (JSON list)
PEER_ENV = "ORCHESTRATE_WARM_PEER"
WAIT_ENV = "ORCHESTRATE_WARM_WAIT_S"  # a task with no predecessor: how long it waits for its go
ORPHAN_S = 600.0
EXPIRED_EXIT = 76
POLL_S = 0.05  # how often a waiting task looks for its go file (0.8% of a core at 0.02 s)
PEER_EVERY_S = 1.0
VERIFY_SHARE = 0.05  # of the time, at most, spent checking checkpoints in the background


def main(argv: list[str], run: Callable[[list[str]], int]) -> int:
    """Prepare for ``argv`` (``python -m worker`` arguments), wait for the go, then ``run``."""
    since = time.time()
    go_path = os.environ.pop(GO_ENV)
    emit("warming", pid=os.getpid())
    reason = _prepare(argv)
    ready = time.time()
    if reason:
        emit("warm_unusable", reason=reason)
    else:
        emit("ready", since=round(since, 3), imported_s=round(ready - since, 3),
             rss_mib=round(_rss_kib() / 1024, 1))
    verifier = _verifier()  # reading a checkpoint back needs no runtime: unfit or not
    peer = int(os.environ.get(PEER_ENV, "0") or 0)
    wait_s = float(os.environ.get(WAIT_ENV, "0") or 0)
    peer_gone: float | None = None
    peer_checked = 0.0
    while not os.path.exists(go_path):
        if verifier is not None:
            verifier.tick()
        if wait_s and time.time() - since > wait_s and not os.path.exists(go_path):
            emit("warm_expired", reason=f"no go within {wait_s:g}s of its start")
            return EXPIRED_EXIT
        if peer and time.monotonic() - peer_checked >= PEER_EVERY_S:
            peer_checked = time.monotonic()
            alive = verified.group_alive(peer)
            peer_gone = None if alive else peer_gone or time.monotonic()
            if peer_gone is not None and time.monotonic() - peer_gone > ORPHAN_S and \
                    not os.path.exists(go_path):
                # Not 0: a go written as this exits must fail the attempt, not pass for its end.
                emit("warm_expired", reason=f"no go within {ORPHAN_S:.0f}s of the attempt's end")
                return EXPIRED_EXIT
        time.sleep(POLL_S)
    with open(go_path, encoding="utf-8") as f:
        go: dict[str, Any] = json.load(f)
    os.remove(go_path)
    for name in (VERIFY_ENV, PEER_ENV, WAIT_ENV):
        os.environ.pop(name, None)
    os.environ.update(go["env"])
    os.chdir(go["cwd"])
    emit("go", since=round(since, 3), ready_at=round(ready, 3),
         waited_s=round(time.time() - ready, 3), cold=bool(reason))
    if reason:  # TensorFlow's runtime started here: the task needs a fresh interpreter
        sys.stdout.flush()
        os.execv(sys.executable, [sys.executable, "-m", "worker", *go["argv"]])
    sys.argv = [sys.argv[0], *go["argv"]]
    return run(list(go["argv"]))


def _prepare(argv: list[str]) -> str:
    """Import what the task will import; why this process cannot be a warm task, or ""."""
    mode = argv[0] if argv else ""
    if mode != "managed":
        return f"mode {mode!r} has no warm start"
    if _job_field(argv, "backend") == "jax":
        return _prepare_jax(argv)
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    tensorflow()  # the point: imported before the go

    if os.environ["TF_USE_LEGACY_KERAS"] == "1":
        import tf_keras  # noqa: F401
    else:
        keras()  # imported with TensorFlow: here for a TensorFlow that did not
    module = _import_module(argv)
    if _runtime_started():
        return (f"importing {module} runs TensorFlow ops (the runtime started before the "
                "strategy could be created), so this task starts cold; make no tensors at "
                "import time to let the tasks start warm")
    return ""


def _prepare_jax(argv: list[str]) -> str:
    """A JAX job: JAX, Keras and the module imported; JAX's backends must not be started yet
    (``jax.distributed.initialize`` must come first)."""
    import jax  # noqa: F401  (the point: imported before the go)

    keras()
    from jax._src import xla_bridge

    module = _import_module(argv)
    if xla_bridge.backends_are_initialized():
        return (f"importing {module} runs JAX computations (JAX's devices were started before "
                "jax.distributed.initialize could run), so this task starts cold; make no "
                "arrays at import time to let the tasks start warm")
    return ""


def _import_module(argv: list[str]) -> str:
    """Import the job's module (if it fails, the task imports it again after the go and reports
    the error); its name."""
    module = _job_field(argv, "module")
    if module:
        try:
            importlib.import_module(module)
        except Exception:
            sys.modules.pop(module, None)
    return module


def _job_field(argv: list[str], name: str) -> str:
    if "--job" not in argv[:-1]:
        return ""
    try:
        value = json.loads(argv[argv.index("--job") + 1]).get(name, "")
    except (ValueError, AttributeError):
        return ""
    return str(value)


def _runtime_started() -> bool:
    from tensorflow.python.eager import context

    return getattr(context.context(), "_context_handle", None) is not None


def _rss_kib() -> int:
    """This process's resident memory now (its peak where /proc is not there)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


class _Verifier:
    """Checks the newest checkpoint of a directory whenever it changes (see the module doc)."""

    def __init__(self, base: str, result: str, request: str) -> None:
        self.base, self.result, self.request = base, result, request
        self.done: tuple[str, str] | None = None
        self.next_at = 0.0

    def tick(self) -> None:
        asked = os.path.exists(self.request)
        if not asked and time.monotonic() < self.next_at:
            return
        current = verified.newest(self.base)
        if current is None or current == self.done:
            if asked:
                with contextlib.suppress(OSError):
                    os.remove(self.request)
            self.next_at = time.monotonic() + 0.2
            return
        path, sig = current
        started = time.monotonic()
        problem = _restores(path)
        seconds = time.monotonic() - started
        if problem is not None and verified.newest(self.base) != current:
            return  # deleted or replaced while it was read: not a verdict on it
        verified.write_result(self.result, {
            "path": path, "signature": sig, "ok": problem is None, "problem": problem,
            "seconds": round(seconds, 4), "at": round(time.time(), 3)})
        self.done = current
        self.next_at = time.monotonic() + max(0.2, seconds * (1 / VERIFY_SHARE - 1))
        if asked:
            with contextlib.suppress(OSError):
                os.remove(self.request)


def _restores(path: str) -> str | None:
    from worker.checkpoints import check

    return check(path)


def _verifier() -> _Verifier | None:
    setting = os.environ.get(VERIFY_ENV, "")
    if not setting:
        return None
    base, result, request = json.loads(setting)
    return _Verifier(base, result, request)
