"""The command runtime: run an unmodified training script with TF_CONFIG set; report its start
and its end as events (the script itself reports no steps)."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import time

from worker.events import emit
from worker.runtimes.common import WorkerRuntime, emit_error
from worker.storage import IndexWatch, check_checkpoint_storage, is_chief_task, is_url

STORAGE_ERROR = 2


def run_command(argv: list[str]) -> int:
    """Run ``argv`` with TF_CONFIG set; return its exit code (128 + N for signal N).

    The chief's checkpoints (in ORCHESTRATE_CHECKPOINT_DIR, the directory the spec names)
    are reported as events as the script writes them, so that the controller can copy them.
    """
    # Unless the job says Keras 3, tf.keras is tf_keras in the script: the Keras whose fit()
    # works under MWMS.
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    checkpoints = os.environ.get("ORCHESTRATE_CHECKPOINT_DIR", "")
    if checkpoints and not check_checkpoint_storage(checkpoints):
        return STORAGE_ERROR
    started = time.monotonic()
    try:
        proc = subprocess.Popen(argv)
    except OSError as exc:
        emit_error(exc, "connect")
        return 127
    emit("started", pid=proc.pid, mode="command", argv=argv)
    watch = IndexWatch(checkpoints).start() if checkpoints and not is_url(checkpoints) \
        and is_chief_task() else None
    signal.signal(signal.SIGTERM, lambda *_: proc.terminate())
    code = proc.wait()
    # The script has ended: a SIGTERM now (a 'down' TERMs every group, and this one's script
    # had already stopped at its peer's step) must not turn its code into 143. Python puts
    # the default action back for a handler that is a function as it shuts down, and a
    # loaded host's shutdown lasts; an ignored signal stays ignored.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if watch is not None:
        watch.stop()
    elapsed = round(time.monotonic() - started, 3)
    if code == 0:
        emit("finished", metrics={}, model_path="", seconds=elapsed)
    else:
        emit("error", phase="train", type="CommandFailed",
             message=f"{argv[0]} exited with {code}", exit_code=code)
    return code if code >= 0 else 128 - code


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("argv", nargs=argparse.REMAINDER)


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    cmd: list[str] = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not cmd:
        parser.error("command mode needs the command after --")
    return run_command(cmd)


RUNTIME = WorkerRuntime("command", "run an unmodified training script", _add_arguments, _run)
