"""Benchmark: what watching costs, steps per second with the chief's TensorBoard logs written
every step and every 100 steps against none, and the controller's CPU meanwhile.

The same 2-worker digits job (checkpoint every 50 steps, a progress event every step, so the
run's history and its metrics file are kept too) runs under `orchestrate train` on the local
provider with `tensorboard: {enabled: false}`, `{every_steps: 1}` and `{every_steps: 100}`,
taking turns, the order rotating every repeat. The rate is the chief's, from its own event
timestamps, leaving out the first 20% of the steps. Goal: every 100 steps at most 2% slower
than none (a ratio of at least 0.98). Whole runs on a shared machine vary by more than 2%
from one to the next; so the writer itself is timed too: microseconds a write, and their share
of the steps' time at the job's pace.

    python benchmarks/watching.py            # 3 x 200 steps, 5 repeats
    python benchmarks/watching.py --quick    # 1 x 40 steps, once
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from common import describe_machine, median_of, note, parser, publish, ratio, repeats, show, spread, temp_home
from jobs import LOCAL, Run, digits_spec, orchestrated, write_spec

from worker.tensorboard import Board

GOAL_RATIO = 0.98
WORKERS = 2
VARIANTS = {"none": {"enabled": False}, "every 100 steps": {"every_steps": 100},
            "every step": {"every_steps": 1}}


def measure(runs: int, directory: Path, *, epochs: int, steps: int) -> dict[str, list[Run]]:
    paths = {}
    for index, (name, board) in enumerate(VARIANTS.items()):
        spec = digits_spec(f"board-{index}", WORKERS, LOCAL, epochs=epochs,
                           steps_per_epoch=steps, checkpoint_every=50,
                           timeouts={"stop_grace_s": 1}, tensorboard=board,
                           metrics={"textfile": str(directory / f"board-{index}.prom")})
        paths[name] = write_spec(directory, spec)
    names = list(VARIANTS)
    found: dict[str, list[Run]] = {name: [] for name in names}
    for i in range(runs):
        for name in names[i % len(names):] + names[:i % len(names)]:
            run = orchestrated(paths[name])
            found[name].append(run)
            note(f"tensorboard {name}: {run.steps_per_s() or 0:.1f} steps/s, controller "
                 f"{run.controller_cpu_share or 0:.3f} cores")
    return found


def write_cost_us(writes: int) -> float:
    """Microseconds one write of the chief's board takes (the loss, 2 metrics, the learning
    rate and the speed, framed, CRC'd, flushed to a file), timed over ``writes`` writes: what
    a step pays when it writes, whatever the noise of whole runs."""
    with tempfile.TemporaryDirectory(prefix="orchestrate-board-") as directory:
        board = Board(directory, 1, 1)
        board.begin(0)
        began = time.perf_counter()
        for step in range(1, writes + 1):
            board.scalars(step, {"loss": 0.5, "accuracy": 0.9, "top_5": 0.99}, 64, 0.004)
        spent = time.perf_counter() - began
        board.close()
    return spent / writes * 1e6


def main() -> None:
    args = parser(__doc__, full_repeats=5).parse_args()
    host, started = describe_machine(), time.monotonic()
    runs = repeats(args)
    epochs, steps = (1, 40) if args.quick else (3, 200)
    with temp_home("watching"), tempfile.TemporaryDirectory(prefix="orchestrate-bench-") as scratch:
        found = measure(runs, Path(scratch), epochs=epochs, steps=steps)
    write_us = round(median_of([write_cost_us(200 if args.quick else 5000)
                                for _ in range(runs)]) or 0.0, 1)
    none = [r.steps_per_s() for r in found["none"]]
    results = []
    for name, variant in found.items():
        rates = [r.steps_per_s() for r in variant]
        paired = [m / n for m, n in zip(rates, none, strict=True) if m and n]
        value = ratio(median_of(rates), median_of(none))
        results.append({
            "tensorboard": name, "steps_per_s": spread(rates, 2), "ratio_to_none": value,
            "paired_ratio": spread(paired),
            "controller_cpu_share": spread([r.controller_cpu_share for r in variant]),
        })
    every_100 = next(r for r in results if r["tensorboard"] == "every 100 steps")
    goal_met = every_100["ratio_to_none"] is not None and every_100["ratio_to_none"] >= GOAL_RATIO
    # What a write costs a step, at the job's own pace without logs: every step, every 100.
    step_us = 1e6 / (median_of(none) or 1.0)
    share = {"every step": round(write_us / step_us, 5),
             "every 100 steps": round(write_us / step_us / 100, 7)}
    rows = [[r["tensorboard"], show(r["steps_per_s"]), r["ratio_to_none"],
             show(r["paired_ratio"]), show(r["controller_cpu_share"])] for r in results]
    publish("watching", args, host, started,
            {"goal": f"steps/s with TensorBoard every 100 steps / without >= {GOAL_RATIO}",
             "job": f"examples.digits on {WORKERS} local workers, {epochs} x {steps} steps, "
                    "checkpoint every 50, progress every step (history and metrics file on); "
                    "rate after the first 20% of steps",
             "results": results, "goal_met": goal_met, "write_us": write_us,
             "write_share_of_steps": share},
            ["tensorboard", "steps/s", "ratio to none", "paired ratio", "controller CPU (cores)"],
            [*rows, [f"one write: {write_us} us", "", "", "share of the steps' time:",
                     f"{share['every step']:.3%} every step, {share['every 100 steps']:.5%} "
                     "every 100"]])


if __name__ == "__main__":
    main()
