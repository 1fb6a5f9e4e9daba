"""`python -m worker managed|command|verify-checkpoint|preflight ...`: what the controller runs on a host."""

from __future__ import annotations

import argparse
import json
import os
import sys

# tf_keras (Keras 2) is the Keras whose fit() works under MultiWorkerMirroredStrategy.
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker")
    sub = parser.add_subparsers(dest="mode", required=True)
    managed = sub.add_parser("managed", help="build, compile and fit a model from a user module")
    managed.add_argument("--job", required=True, help="the job as JSON (from the cluster plan)")
    command = sub.add_parser("command", help="run an unmodified training script")
    command.add_argument("argv", nargs=argparse.REMAINDER)
    verify = sub.add_parser("verify-checkpoint", help="find the newest checkpoint that restores")
    verify.add_argument("--dir", required=True)
    sub.add_parser("preflight", add_help=False,
                   help="check this host for a task; one JSON line (--help for options)")
    args, rest = parser.parse_known_args(argv)

    if args.mode == "preflight":
        from worker.preflight import main as preflight_main

        return preflight_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")

    if args.mode == "verify-checkpoint":
        from worker.checkpoints import main as verify_main

        return verify_main(args.dir)

    if args.mode == "managed":
        from worker.runtime import run_managed

        return run_managed(json.loads(args.job))
    from worker.runtime import run_command

    cmd = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not cmd:
        parser.error("command mode needs the command after --")
    return run_command(cmd)


if __name__ == "__main__":
    sys.exit(main())
