"""`python -m worker managed|command|verify-checkpoint|preflight ...`: what the controller runs on a host."""

from __future__ import annotations

import argparse
import os
import sys

from worker.runtimes import RUNTIMES

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")


def main(argv: list[str] | None = None) -> int:
    if os.environ.get("ORCHESTRATE_WARM"):  # a warm task: prepare, wait for the go, then run
        from worker import warm

        return warm.main(list(sys.argv[1:] if argv is None else argv), main)
    parser = argparse.ArgumentParser(prog="python -m worker")
    sub = parser.add_subparsers(dest="mode", required=True)
    for runtime in RUNTIMES.values():
        runtime.add_arguments(sub.add_parser(runtime.mode, help=runtime.help))
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
        # Only tf.train and tf.io here: with tf.keras as tf_keras, TensorFlow's import leaves out
        # Keras 3 (and JAX: worker/tfimport.py), about a third of its CPU on the recovery's path.
        os.environ["TF_USE_LEGACY_KERAS"] = "1"
        from worker.checkpoints import main as verify_main

        return verify_main(args.dir)
    return RUNTIMES[args.mode].run(args, parser)


if __name__ == "__main__":
    sys.exit(main())
