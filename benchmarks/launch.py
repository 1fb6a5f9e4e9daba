"""Benchmark: launch overhead, `orchestrate train` to the first step versus the same tasks hand-launched.

For 2 and 3 workers, on the local provider and on sshd hosts in network namespaces (static
provider), in one run: the time from the start of `orchestrate train` to the chief's first
completed step, and from the first start of the same worker processes (same argv, TF_CONFIG,
environment, directory; no controller) to theirs. Where `train` has its preflight doctor,
`train --no-doctor` is measured as well; where it keeps a passing doctor report for the next
train, `train --recheck` (the doctor runs) and `train` (it starts on the kept pass) both are.
The kinds take turns, the order rotating every repeat; the overhead is the median of each
repeat's difference. Also reported: when every task's worker process was up (its `started`
event; a warm task's `warming`), which is where the launch path's own cost shows before
TensorFlow's start-up. Goal: at most 10% over the hand-launched time (README row 1: <= 1.10x).

    python benchmarks/launch.py              # 2 and 3 workers, local + namespaces, 5 repeats
    python benchmarks/launch.py --quick      # 2 local workers, `train` only, once
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from common import describe_machine, median_of, parser, publish, ratio, repeats, show, spread, temp_home
from jobs import (
    BY_HAND,
    LOCAL,
    TRAIN,
    Target,
    compare,
    digits_spec,
    namespace_lab,
    train_variants,
    write_spec,
)

GOAL_OVERHEAD = 0.10


def measure(target: Target, workers: int, runs: int, directory: Path, kinds: list[str],
            warm_up: bool) -> dict[str, Any]:
    spec = digits_spec(f"launch-{target.name[:5]}-{workers}", workers, target, epochs=1,
                       steps_per_epoch=10, checkpoint_every=10, timeouts={"stop_grace_s": 1})
    found = compare(write_spec(directory, spec), target, runs, [BY_HAND, *kinds], warm_up=warm_up)
    manual = [r.first_step_s() for r in found[BY_HAND]]
    result: dict[str, Any] = {
        "target": target.name, "workers": workers, "by_hand_s": spread(manual),
        "by_hand_all_started_s": spread([r.all_started_s() for r in found[BY_HAND]]),
        "orchestrated": {}}
    for kind in kinds:
        managed = [r.first_step_s() for r in found[kind]]
        overhead = [m - h for m, h in zip(managed, manual, strict=True)
                    if m is not None and h is not None]
        fraction = ratio(median_of(overhead), median_of(manual))
        result["orchestrated"][kind] = {
            "first_step_s": spread(managed), "overhead_s": spread(overhead),
            "all_started_s": spread([r.all_started_s() for r in found[kind]]),
            "ratio": ratio(median_of(managed), median_of(manual)), "overhead_fraction": fraction,
            "goal_met": fraction is not None and fraction <= GOAL_OVERHEAD,
        }
    return result


def main() -> None:
    args = parser(__doc__, full_repeats=5).parse_args()
    host, started = describe_machine(), time.monotonic()
    runs = repeats(args)
    workers = (2,) if args.quick else (2, 3)
    results: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    with temp_home("launch"), tempfile.TemporaryDirectory(prefix="orchestrate-bench-") as scratch:
        kinds = [TRAIN] if args.quick else train_variants()
        for n in workers:
            results.append(measure(LOCAL, n, runs, Path(scratch), kinds, warm_up=not args.quick))
        if args.quick:
            skipped["namespaces"] = "--quick measures the local provider only"
        else:
            with namespace_lab(max(workers)) as (lab, reason):
                if lab is None:
                    skipped["namespaces"] = reason
                else:
                    target = Target("namespaces", lab, tuple(lab.hosts(max(workers))))
                    for n in workers:
                        results.append(measure(target, n, runs, Path(scratch), kinds, warm_up=True))
    rows = [[r["target"], r["workers"], kind, show(r["by_hand_s"], "s"), show(o["first_step_s"], "s"),
             show(o["overhead_s"], "s"), f"{100 * (o['overhead_fraction'] or 0):.1f}%",
             f"{show(r['by_hand_all_started_s'], 's')} / {show(o['all_started_s'], 's')}",
             "yes" if o["goal_met"] else "no"]
            for r in results for kind, o in r["orchestrated"].items()]
    rows += [[name, "-", "skipped", why, "", "", "", "", ""] for name, why in skipped.items()]
    publish("launch", args, host, started,
            {"goal": f"overhead <= {GOAL_OVERHEAD:.0%} of hand-launched time to first step",
             "job": "examples.digits, 1 epoch x 10 steps, progress every step",
             "results": results, "skipped": skipped},
            ["target", "workers", "launcher", "by hand", "launcher's", "overhead", "overhead %",
             "tasks up (by hand / launcher)", "goal"],
            rows)


if __name__ == "__main__":
    main()
