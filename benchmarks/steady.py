"""Benchmark: steady-state cost, steps per second of one job under `orchestrate train` versus hand-launched.

The same 2-worker digits job (checkpoint every 50 steps, a progress event every step) runs
under the orchestrator and hand-launched with the same TF_CONFIG, alternating, on the local
provider and on sshd hosts in network namespaces. The rate is the chief's, from its own event
timestamps, leaving out the first 20% of the steps; the controller's CPU time over the run's
wall time says what the orchestrator took from the workers. Goal: a ratio of at least 0.98.

    python benchmarks/steady.py             # 3 x 200 steps, local + namespaces, 5 repeats
    python benchmarks/steady.py --quick     # 2 x 40 steps, local, once
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from common import describe_machine, median_of, parser, publish, ratio, repeats, show, spread, temp_home
from jobs import BY_HAND, LOCAL, TRAIN, Target, compare, digits_spec, namespace_lab, write_spec

GOAL_RATIO = 0.98
WORKERS = 2


def measure(target: Target, runs: int, directory: Path, *, epochs: int, steps: int,
            warm_up: bool) -> dict[str, Any]:
    spec = digits_spec(f"steady-{target.name[:5]}", WORKERS, target, epochs=epochs,
                       steps_per_epoch=steps, checkpoint_every=50, timeouts={"stop_grace_s": 1})
    found = compare(write_spec(directory, spec), target, runs, [TRAIN, BY_HAND], warm_up=warm_up)
    managed = [r.steps_per_s() for r in found[TRAIN]]
    manual = [r.steps_per_s() for r in found[BY_HAND]]
    paired_ratios = [m / h for m, h in zip(managed, manual, strict=True) if m and h]
    value = ratio(median_of(managed), median_of(manual))
    return {
        "target": target.name, "workers": WORKERS, "steps": epochs * steps,
        "orchestrated_steps_per_s": spread(managed, 2), "by_hand_steps_per_s": spread(manual, 2),
        "ratio": value, "paired_ratio": spread(paired_ratios),
        "controller_cpu_share": spread([r.controller_cpu_share for r in found[TRAIN]]),
        "goal_met": value is not None and value >= GOAL_RATIO,
    }


def main() -> None:
    args = parser(__doc__, full_repeats=5).parse_args()
    host, started = describe_machine(), time.monotonic()
    runs = repeats(args)
    epochs, steps = (2, 40) if args.quick else (3, 200)
    results: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    with temp_home("steady"), tempfile.TemporaryDirectory(prefix="orchestrate-bench-") as scratch:
        results.append(measure(LOCAL, runs, Path(scratch), epochs=epochs, steps=steps,
                               warm_up=not args.quick))
        if args.quick:
            skipped["namespaces"] = "--quick measures the local provider only"
        else:
            with namespace_lab(WORKERS) as (lab, reason):
                if lab is None:
                    skipped["namespaces"] = reason
                else:
                    target = Target("namespaces", lab, tuple(lab.hosts(WORKERS)))
                    results.append(measure(target, runs, Path(scratch), epochs=epochs, steps=steps,
                                           warm_up=True))
    rows = [[r["target"], r["workers"], r["steps"], show(r["by_hand_steps_per_s"]),
             show(r["orchestrated_steps_per_s"]), r["ratio"], show(r["controller_cpu_share"]),
             "yes" if r["goal_met"] else "no"] for r in results]
    rows += [[name, "-", "-", "skipped", why, "", "", ""] for name, why in skipped.items()]
    publish("steady", args, host, started,
            {"goal": f"orchestrated / hand-launched steps per second >= {GOAL_RATIO}",
             "job": f"examples.digits, {epochs} x {steps} steps, checkpoint every 50, "
                    "progress every step; rate after the first 20% of steps",
             "results": results, "skipped": skipped},
            ["target", "workers", "steps", "by hand steps/s", "orchestrated steps/s", "ratio",
             "controller CPU (cores)", "goal"],
            rows)


if __name__ == "__main__":
    main()
