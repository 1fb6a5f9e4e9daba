"""A light stand-in for a training task (controller benchmark): progress events at a set rate, no TensorFlow.

    python light_task.py --rate 5 --seconds 30
"""

from __future__ import annotations

import argparse
import time

from worker.events import emit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=5.0, help="progress events per second")
    parser.add_argument("--seconds", type=float, default=30.0, help="how long to report progress")
    args = parser.parse_args()
    total = max(1, round(args.rate * args.seconds))
    emit("training", step=0, total_steps=total)
    start = time.monotonic()
    for step in range(1, total + 1):
        time.sleep(max(0.0, start + step / args.rate - time.monotonic()))
        emit("progress", step=step, total_steps=total, loss=1.0 / step, metrics={},
             steps_per_s=args.rate, examples_per_s=args.rate * 32)


if __name__ == "__main__":
    main()
