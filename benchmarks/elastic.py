"""Benchmark: a machine lost for good, an elastic group against one that waits for it.

A 3-worker digits job on 3 namespace sshd hosts (the static provider), paced at 0.2 s a step
(tests/workloads/paced_digits.py) so that a step count over a stretch of time measures how
much of it was spent training. At the chief's step 25 the third host is cut off from the
network; it comes back WINDOW_S later (for the elastic group, not before it has taken a step
on 2 workers: on a loaded machine the shrink alone can outlast the window, and the run is there
to show the smaller group training), and once the group trains at full size again the rest of
the job runs unpaced. Two runs, each under the real Supervisor in this
process:

- elastic (``elastic: {min_workers: 2, grow_check_s: 1}``, ``timeouts.repair_s: 5``): the group
  goes on with 2 workers once the host does not come back within repair_s, then grows back to 3
  at a planned stop once the host is back;
- waiting (no ``elastic``, ``timeouts.repair_s`` longer than the outage): today's behaviour
  without it, the group waits for the host, then restarts on all three.

Measured per run, on this process's clock and the chief's own event times:
- steps in the window: the chief's steps completed in the WINDOW_S after the cut (each step
  counted once: a step redone is not progress), and the steps it completed on 2 workers;
- the outage: the cut to the host's return (WINDOW_S, or more where the shrink outlasted it);
- shrink: the cut to the chief's first step on 2 workers (elastic only);
- back at full size: the host's return to the chief's first step on 3 workers;
- steps redone over the run.
And the cold start of the same job hand-launched (3 hosts, unpaced), for scale.

    python benchmarks/elastic.py            # both runs, WINDOW_S 60 s
    python benchmarks/elastic.py --quick    # the elastic run alone, 45 s window, an epoch less; no cold start
"""

from __future__ import annotations

import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import describe_machine, note, parser, publish, ratio, show, temp_home
from jobs import PACED, Target, by_hand, digits_spec, namespace_lab, supervise, write_spec

from orchestrator import paths
from orchestrator.events import Event
from orchestrator.view import RunView

WORKERS, CHIEF, AT_STEP = 3, "worker:0", 25
STEPS_PER_EPOCH, EVERY = 100, 10
SETTINGS = {
    "retry": {"max_restarts": 3, "backoff_initial_s": 0.2, "backoff_max_s": 1},
    "timeouts": {"stop_grace_s": 30, "poll_s": 3, "hang_s": 10, "startup_s": 120},
}


def job(directory: Path, target: Target, *, elastic: bool, window_s: float, epochs: int,
        paced: bool = True) -> Path:
    timeouts = {**SETTINGS["timeouts"], "repair_s": 5 if elastic else window_s + 60}
    sections: dict[str, Any] = {**SETTINGS, "timeouts": timeouts,
                                "env": {"DIGITS_PACE_S": "0.2" if paced else "0"}}
    if elastic:
        sections["elastic"] = {"min_workers": 2, "grow_check_s": 1}
    name = "elastic" if elastic else "waiting"
    return write_spec(directory, digits_spec(name, WORKERS, target, epochs=epochs,
                                             steps_per_epoch=STEPS_PER_EPOCH,
                                             checkpoint_every=EVERY, module=PACED, **sections),
                      stem=f"{name}{'' if paced else '-unpaced'}")


@dataclass
class Outage:
    """The run's listener: cuts the third host off at the chief's step AT_STEP, brings it back
    ``window_s`` later (an elastic group's, once it has also taken a step on fewer workers), and
    keeps the chief's steps (step -> first time done) and firsts."""

    target: Target
    window_s: float
    cluster: str
    elastic: bool
    cut_at: float | None = None
    back_at: float | None = None
    steps: dict[int, float] = field(default_factory=dict)  # the chief's, first completion
    first_step: dict[int, float] = field(default_factory=dict)  # per attempt
    sizes: dict[int, int] = field(default_factory=dict)  # replicas, per attempt
    timer: threading.Timer | None = None
    on_fewer: int = 0  # the chief's steps done on fewer than WORKERS
    due: bool = False  # the window is over: the host comes back (at once, or at such a step)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, view: RunView, event: Event | None) -> None:
        if event is None or event.task != CHIEF:
            return
        if event.kind == "connected":
            self.sizes[event.attempt] = int(event.get("replicas"))
        if event.kind != "progress":
            return
        step = int(event.get("step"))
        if step not in self.steps and self.sizes.get(event.attempt, WORKERS) < WORKERS:
            with self.lock:
                self.on_fewer += 1
                if self.due:
                    self._restore()
        self.steps.setdefault(step, event.time)
        self.first_step.setdefault(event.attempt, event.time)
        if self.back_at is not None and self.sizes.get(event.attempt) == WORKERS \
                and event.attempt > 1:  # back at full size: the rest of the job unpaced
            for h in self.target.hosts:
                run_dir = Path(paths.RunPaths.of(paths.host_root(h.home, self.cluster),
                                                 view.run_id).run_dir)
                if run_dir.is_dir():
                    (run_dir / "release").touch()
        if self.cut_at is None and step >= AT_STEP:
            self.cut_at = time.time()
            self.target.hosts[2].cut()
            self.timer = threading.Timer(self.window_s, self._back)
            self.timer.start()

    def _back(self) -> None:
        with self.lock:
            self.due = True
            if self.on_fewer or not self.elastic:
                self._restore()

    def _restore(self) -> None:  # under the lock
        if self.back_at is None:
            self.back_at = time.time()
            self.target.hosts[2].restore()

    def figures(self, result: Any) -> dict[str, Any]:
        assert self.cut_at is not None and self.back_at is not None
        full = [n for n, size in sorted(self.sizes.items()) if size == WORKERS and n > 1]
        smaller = [n for n, size in sorted(self.sizes.items()) if size < WORKERS]
        done = [s for s, at in self.steps.items() if self.cut_at < at <= self.cut_at + self.window_s]
        back = self.first_step.get(full[0]) if full else None
        return {
            "steps_in_window": len(done),
            "steps_on_fewer": self.on_fewer,
            "outage_s": round(self.back_at - self.cut_at, 2),
            "shrink_s": round(self.first_step[smaller[0]] - self.cut_at, 2) if smaller else None,
            "back_at_full_size_s": round(back - self.back_at, 2) if back else None,
            "sizes": [self.sizes.get(a.number) for a in result.attempts],
            "causes": [a.cause for a in result.attempts[:-1]],
            "steps_redone": sum(a.steps_lost or 0 for a in result.attempts),
            # where each restart's time went, as the supervisor records it (failure to step)
            "phases": [{k: round(v, 2) for k, v in a.phases.items()}
                       for a in result.attempts[:-1]],
            "status": result.status,
        }


def measure(directory: Path, target: Target, *, elastic: bool, window_s: float,
            quick: bool = False) -> dict[str, Any]:
    # enough steps at 0.2 s each for the window and the return (then the job is released)
    epochs = max(2, int((AT_STEP * 0.2 + window_s + 20) / (STEPS_PER_EPOCH * 0.2)) + 1)
    if quick:
        # One epoch less: what is left once the group is back at full size runs unpaced, and
        # that rest (3 workers over the lab's SSH hosts, ~20 CPU-s) was the smoke run's
        # costliest part. No step is taken while the host is found lost and the group shrinks
        # (repair_s and a relaunch, ~20 s of the window), so the steps still outlast the
        # window and the grow by some 50 even were the shrink instant.
        epochs -= 1
    path = job(directory, target, elastic=elastic, window_s=window_s, epochs=epochs)
    name = "elastic" if elastic else "waiting"
    outage = Outage(target, window_s, name, elastic)
    note(f"{name}: {WORKERS} workers, {epochs * STEPS_PER_EPOCH} steps; the third host cut off "
         f"at step {AT_STEP} for {window_s:.0f}s")
    try:
        result = supervise(path, outage)
    finally:
        if outage.timer is not None:
            outage.timer.join()
        target.hosts[2].heal()
    return outage.figures(result)


def main() -> None:
    cli = parser(__doc__, full_repeats=1)
    args = cli.parse_args()
    started, host = time.monotonic(), describe_machine()
    window_s = 45.0 if args.quick else 60.0
    runs: dict[str, dict[str, Any]] = {}
    cold: float | None = None
    with temp_home("elastic"), tempfile.TemporaryDirectory(prefix="orchestrate-bench-") as scratch, \
            namespace_lab(WORKERS) as (lab, reason):
        if lab is None:
            raise SystemExit(f"elastic.py needs the namespace lab: {reason}")
        target = Target("namespaces", lab, tuple(lab.hosts(WORKERS)))
        directory = Path(scratch)
        runs["elastic"] = measure(directory, target, elastic=True, window_s=window_s,
                                  quick=args.quick)
        if not args.quick:
            runs["waiting"] = measure(directory, target, elastic=False, window_s=window_s)
            unpaced = job(directory, target, elastic=False, window_s=window_s, epochs=1,
                          paced=False)
            cold = by_hand(unpaced, target).first_step_s()
    for figures in runs.values():
        figures["shrink_over_cold_start"] = ratio(figures["shrink_s"], cold)
        figures["back_over_cold_start"] = ratio(figures["back_at_full_size_s"], cold)
    rows = [[name, r["steps_in_window"], r["steps_on_fewer"], show(r["outage_s"], "s"),
             show(r["shrink_s"], "s"),
             show(r["back_at_full_size_s"], "s"), r["sizes"], r["steps_redone"], r["status"]]
            for name, r in runs.items()]
    publish("elastic", args, host, started,
            {"window_s": window_s, "cut_at_step": AT_STEP, "pace_s": 0.2,
             "cold_start_s": None if cold is None else round(cold, 2), "runs": runs},
            ["run", f"steps in {window_s:.0f}s after the cut", "on 2", "outage", "cut to a step on 2",
             "return to a step on 3", "replicas by attempt", "steps redone", "status"], rows)


if __name__ == "__main__":
    main()
