"""Benchmark: checkpoints of 1 MiB, 100 MiB and 1 GiB on 3 SSH hosts: what they cost training,
what crosses the controller's link, and how fast a relaunch gives them to the other hosts.

Three namespace hosts with sshd; the job is ``tests.workloads.big_state`` (a checkpoint of
BIG_STATE_MIB MiB of incompressible state, a trivial model), 3 workers, a real run under the
Supervisor per configuration: (a) no checkpointing, (b) a checkpoint every N steps with
``checkpoint.mirror: never`` (the controller copies nothing), (c) the same with ``mirror:
always`` (the controller pulls each checkpoint), (d) the same with ``checkpoint.dir`` on a
directory every host sees (shared storage). Figures per size:

- steps/s of the chief (its own event timestamps, the first 20% of the steps left out), and
  the ratios b/a, c/a, d/a, c/b and d/b. Goal: c/b and d/b >= 0.95.
- bytes through the controller's link, counted by the kernel: every host's traffic to the
  controller goes through a tc class at 10 Gbit/s (it slows nothing) whose byte counter is read
  before the run and once more before the final model is downloaded; per checkpoint, beside
  the product's own figure (``RunResult.checkpoint_bytes``). (b) is the control traffic alone
  (polls, log reads); the excess of (c) and (d) over it is what their checkpoints cost. Goal:
  shared storage moves 0 checkpoint bytes through the controller.
- the relaunch copy: the chief's checkpoint directory as a run of (b) left it (hard-linked at
  its last checkpoint: tf_keras deletes it when training ends) given to the 2 other hosts by
  ``share_chief_checkpoint`` (a pipelined chain, chief -> h1 -> h2), their copies removed
  first, against a plain copy of the same bytes from the chief's host to ONE other host (a
  Python socket sender and receiver in the two namespaces: no hashing, no checks). Also the
  bytes through the controller during the chain copy, and a second copy right after (nothing
  changed: nothing should be sent). Goal: chain <= 1.3x the plain copy.

    python benchmarks/checkpoints.py           # 3 sizes; 2 repeats (1 at 1 GiB); ~20 min (root)
    python benchmarks/checkpoints.py --quick   # 1 MiB, once, few steps
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import (
    REPO,
    describe_machine,
    median_of,
    note,
    parser,
    publish,
    ratio,
    repeats,
    show,
    spread,
    temp_home,
)
from hostlab import HostLab, LabHost
from jobs import PORTS, namespace_lab, static_provider, supervise, write_spec

from orchestrator import paths
from orchestrator import plan as planning
from orchestrator import spec as specs
from orchestrator.api import Cluster
from orchestrator.checkpoints import Copied, WorkerCommand, share_chief_checkpoint
from orchestrator.events import Event
from orchestrator.hosts import Host
from orchestrator.providers import for_spec
from orchestrator.view import RunView, human_bytes

WORKERS = 3
RATE = "10gbit"  # a throttle that slows nothing: it is there for its byte counter
WARMUP = 0.2  # the first 20% of the chief's steps are left out of steps/s
STEPS_GOAL = 0.95  # c/b and d/b
COPY_GOAL = 1.3  # chain copy to 2 hosts / plain copy to 1
SHARED_SLACK = 0.05  # measured excess of (d) over (b) per checkpoint, as a share of a checkpoint
PLAIN_PORT = 29870  # inside the receiving host's own namespace: no other process uses it
CONFIGS = ("none", "off", "on", "shared")
LABELS = {"none": "(a) no checkpoints", "off": "(b) mirror never", "on": "(c) mirror always",
          "shared": "(d) shared storage"}
SETTINGS = {"retry": {"max_restarts": 0},
            "timeouts": {"stop_grace_s": 1, "startup_s": 300, "hang_s": 300}}


@dataclass(frozen=True)
class Size:
    """One checkpoint size: ``every`` steps between checkpoints, ``steps`` in the run, and at
    most ``max_repeats`` repeats (a 1 GiB run takes minutes)."""

    mib: int
    every: int
    steps: int
    max_repeats: int = 99

    @property
    def name(self) -> str:
        return f"{self.mib} MiB" if self.mib < 1024 else f"{self.mib // 1024} GiB"


# A checkpoint every N steps with N chosen so that a save (tens of ms at 1 MiB, seconds at
# 1 GiB: every one of the 3 workers writes the whole state) takes a comparable share of each
# interval, and at least 4 checkpoints fall inside the measured window (the last 80% of steps).
FULL = (Size(1, 25, 165), Size(100, 50, 330), Size(1024, 100, 560, max_repeats=1))
QUICK = (Size(1, 10, 70),)


# -- one run -------------------------------------------------------------------------------
@dataclass
class Recorder:
    """The run's listener: the chief's steps and checkpoints (worker timestamps), the bytes the
    hosts sent the controller up to the final model download, and (``keep``) a hard-linked copy
    of the chief's checkpoint directory at each of its checkpoints."""

    hosts: list[LabHost]
    keep: Path | None = None
    steps: list[tuple[int, float]] = field(default_factory=list)
    checkpoints: list[tuple[int, float]] = field(default_factory=list)
    mirrored: set[int] = field(default_factory=set)
    finished: bool = False
    fetched: bool = False
    before_fetch: int | None = None

    def __call__(self, view: RunView, event: Event | None) -> None:
        if view.mirrored_step is not None:
            self.mirrored.add(view.mirrored_step)
        if event is not None and event.attempt == 1 and event.task == "worker:0":
            if event.kind == "progress":
                self.steps.append((int(event.get("step")), event.time))
            elif event.kind == "checkpoint":
                self.checkpoints.append((int(event.get("step")), event.time))
                if self.keep is not None:
                    snapshot(Path(str(event.get("path"))), self.keep)
            elif event.kind == "finished":
                self.finished = True
        if self.finished and not self.fetched:
            # From the chief's end of training to the model download: the last count before the
            # download is what the run's checkpoints and control traffic cost.
            self.fetched = any(m.startswith("fetched the model") for m in view.messages)
            if not self.fetched:
                self.before_fetch = sent_to_controller(self.hosts)

    def steps_per_s(self) -> float | None:
        steps = sorted(self.steps)
        if len(steps) < 3:
            return None
        first = next(s for s in steps if s[0] >= steps[-1][0] * WARMUP)
        last = steps[-1]
        return (last[0] - first[0]) / (last[1] - first[1]) if last[1] > first[1] else None

    def checkpoints_in_window(self) -> int:
        steps = sorted(self.steps)
        if not steps:
            return 0
        start = next(s for s in steps if s[0] >= steps[-1][0] * WARMUP)
        return sum(1 for _, at in self.checkpoints if start[1] <= at <= steps[-1][1])


def sent_to_controller(hosts: list[LabHost]) -> int:
    return sum(h.throttled_bytes() for h in hosts)


def snapshot(chief_dir: Path, keep: Path) -> None:
    """Hard-link the checkpoints that ``chief_dir``'s index lists (and the index) into ``keep``,
    replacing what it held: the directory a relaunch would copy, before tf_keras deletes it."""
    fresh = keep.with_name(keep.name + ".new")
    shutil.rmtree(fresh, ignore_errors=True)
    fresh.mkdir(parents=True)
    try:
        index = (chief_dir / "checkpoint").read_text()
    except OSError:
        return
    listed = {Path(line.split('"')[1]).name for line in index.splitlines() if '"' in line}
    for path in chief_dir.iterdir():
        if path.is_file() and (path.name == "checkpoint" or path.name.split(".")[0] in listed):
            with contextlib.suppress(OSError):  # deleted by the next save meanwhile
                os.link(path, fresh / path.name)
    shutil.rmtree(keep, ignore_errors=True)
    fresh.rename(keep)


@dataclass
class Sample:
    config: str
    run_id: str
    steps_per_s: float | None
    checkpoints: int
    in_window: int
    mirrored: int
    controller_bytes: int  # every host to the controller, from the start to the model download
    model_fetch_bytes: int  # from there to the end of the run
    product: dict[str, int]
    seconds: float


def train(path: Path, config: str, hosts: list[LabHost], keep: Path | None) -> Sample:
    recorder = Recorder(hosts, keep)
    before = sent_to_controller(hosts)
    started = time.monotonic()
    result = supervise(path, recorder)
    seconds = time.monotonic() - started
    after = sent_to_controller(hosts)
    if not recorder.finished or recorder.before_fetch is None:
        raise RuntimeError(f"{path.parent.name}: the chief never finished ({result.status})")
    name = specs.load(path).name
    for local in (paths.mirror_dir(name, result.run_id), paths.fetched_model_dir(name, result.run_id)):
        shutil.rmtree(local, ignore_errors=True)  # a GiB each at the largest size
    return Sample(config, result.run_id, recorder.steps_per_s(), len(recorder.checkpoints),
                  recorder.checkpoints_in_window(), len(recorder.mirrored),
                  recorder.before_fetch - before, after - recorder.before_fetch,
                  dict(result.checkpoint_bytes), seconds)


def drop_run(hosts: list[LabHost], spec: specs.ClusterSpec, run_id: str) -> None:
    """The run's files on every host (the chief's saved model is the size of the state)."""
    for host in hosts:
        root = paths.host_root(host.home, spec.name)
        shutil.rmtree(paths.RunPaths.of(root, run_id).run_dir, ignore_errors=True)


# -- the relaunch copy ---------------------------------------------------------------------
RECEIVER = """
import socket, sys
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("", int(sys.argv[2])))
srv.listen(1)
print("ready", flush=True)
conn, _ = srv.accept()
view, total = memoryview(bytearray(1 << 20)), 0
with open(sys.argv[1], "wb") as out:
    while n := conn.recv_into(view):
        out.write(view[:n])
        total += n
print(total, flush=True)
"""
SENDER = """
import socket, sys, time
for _ in range(100):
    try:
        sock = socket.create_connection((sys.argv[1], int(sys.argv[2])))
        break
    except OSError:
        time.sleep(0.05)
view = memoryview(bytearray(1 << 20))
for name in sys.argv[3:]:
    with open(name, "rb", buffering=0) as f:
        while n := f.readinto(view):
            sock.sendall(view[:n])
sock.close()
"""


def in_namespace(host: LabHost, *argv: str) -> list[str]:
    return ["ip", "netns", "exec", str(host.namespace), *argv]


def plain_copy(source: LabHost, target: LabHost, files: list[str], out: str) -> float:
    """Seconds to stream ``files`` from ``source`` into one file ``out`` on ``target``."""
    receiver = subprocess.Popen(in_namespace(target, sys.executable, "-c", RECEIVER, out, str(PLAIN_PORT)),
                                stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    try:
        assert receiver.stdout is not None
        if receiver.stdout.readline().strip() != "ready":
            raise RuntimeError("the plain-copy receiver did not start")
        started = time.monotonic()
        subprocess.run(in_namespace(source, sys.executable, "-c", SENDER, target.address,
                                    str(PLAIN_PORT), *files), check=True, timeout=600,
                       stdin=subprocess.DEVNULL)
        received = int(receiver.stdout.readline())
        receiver.wait(60)
        took = time.monotonic() - started
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()
    expected = sum(os.path.getsize(f) for f in files)
    if received != expected:
        raise RuntimeError(f"the plain copy received {received} of {expected} bytes")
    return took


@contextlib.contextmanager
def relaunch_plan(path: Path, run_id: str) -> Iterator[tuple[planning.ClusterPlan, Any]]:
    """The plan of a relaunch (attempt 2) of ``run_id``, and the provider for its runners."""
    spec = specs.load(path)
    provider = for_spec(spec, path)
    try:
        hosts = provider.hosts()
        yield planning.build(spec, hosts, run_id=run_id, attempt=2,
                             python=provider.python(hosts[0]),
                             local_workdir=str(specs.workdir_of(spec, path)),
                             busy_ports=provider.busy_ports(hosts)), provider
    finally:
        provider.close()


def measure_copies(path: Path, run_id: str, keep: Path, hosts: list[LabHost],
                   runs: int) -> dict[str, Any]:
    """Put the kept checkpoint back as the chief's, then ``runs`` times: the chain copy to the
    other hosts (their copies removed first), the same again at once, and a plain copy."""
    with relaunch_plan(path, run_id) as (plan, provider):
        layout = plan.checkpoints
        chief_dir = Path(layout.of(plan.chief.host))
        shutil.rmtree(chief_dir, ignore_errors=True)
        chief_dir.mkdir(parents=True)
        keep.rename(chief_dir / "chief")
        files = sorted(str(p) for p in chief_dir.rglob("*") if p.is_file())
        size = sum(os.path.getsize(f) for f in files)
        targets = list(plan.tasks[1:])
        lab_of = {h.address: h for h in hosts}
        source, first = lab_of[plan.chief.host.address], lab_of[targets[0].host.address]
        plain_out = f"{first.home}/plain-copy.bin"

        def worker_for(host: Host) -> WorkerCommand:
            return WorkerCommand(provider.python(host), paths.lib_dir(host.root))

        chain: list[dict[str, Any]] = []
        again: list[dict[str, Any]] = []
        plain: list[float] = []
        for i in range(runs):
            def timed_chain() -> tuple[Copied, float, int]:
                before = sent_to_controller(hosts)
                started = time.monotonic()
                copied = share_chief_checkpoint(plan, provider.runner, worker_for)
                return copied, time.monotonic() - started, sent_to_controller(hosts) - before

            def one_chain() -> None:
                for task in targets:
                    shutil.rmtree(layout.of(task.host), ignore_errors=True)
                os.sync()
                copied, took, through = timed_chain()
                if sorted(copied.hosts) != sorted(t.host.name for t in targets) or copied.bytes != size:
                    raise RuntimeError(f"the chain copied {copied} of {size} bytes")
                chain.append({"seconds": took, "controller_bytes": through, "files": copied.files,
                              "bytes": copied.bytes})
                copied, took, through = timed_chain()
                again.append({"seconds": took, "controller_bytes": through, "bytes": copied.bytes,
                              "hosts_sent": len(copied.hosts)})

            def one_plain() -> None:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(plain_out)
                os.sync()
                plain.append(plain_copy(source, first, files, plain_out))
                os.remove(plain_out)

            for step in ((one_chain, one_plain) if i % 2 == 0 else (one_plain, one_chain)):
                step()
            note(f"relaunch copy of {human_bytes(size)}: chain to {len(targets)} hosts "
                 f"{chain[-1]['seconds']:.2f}s ({chain[-1]['controller_bytes']} B through the "
                 f"controller), again {again[-1]['seconds']:.2f}s, plain copy to 1 host "
                 f"{plain[-1]:.2f}s")
        for task in targets:
            shutil.rmtree(layout.of(task.host), ignore_errors=True)
        shutil.rmtree(chief_dir, ignore_errors=True)
    chain_s = median_of([c["seconds"] for c in chain])
    plain_s = median_of(plain)
    value = ratio(chain_s, plain_s, 2)
    return {
        "bytes": size, "files": len(files), "hosts": len(targets),
        "chain_s": spread([c["seconds"] for c in chain]), "plain_s": spread(plain),
        "chain_over_plain": value, "goal_met": value is not None and value <= COPY_GOAL,
        "chain_mb_per_s": round(size / chain_s / 1e6, 1) if chain_s else None,
        "plain_mb_per_s": round(size / plain_s / 1e6, 1) if plain_s else None,
        "controller_bytes": spread([c["controller_bytes"] for c in chain], 0),
        "again_s": spread([a["seconds"] for a in again]),
        "again_bytes_sent": max(a["bytes"] for a in again),
        "again_controller_bytes": spread([a["controller_bytes"] for a in again], 0),
    }


# -- one size ------------------------------------------------------------------------------
def spec_for(directory: Path, project: Path, size: Size, config: str, lab: HostLab,
             hosts: list[LabHost], shared: Path) -> Path:
    checkpoint: dict[str, Any] = {"every_steps": size.every, "mirror": "never"}
    if config == "none":
        checkpoint["every_steps"] = size.steps * 10
    elif config == "on":
        checkpoint["mirror"] = "always"  # auto turns off above 1 GiB
    elif config == "shared":
        checkpoint = {"every_steps": size.every, "dir": str(shared)}
    spec = {
        "name": f"bench-ck-{size.mib}", "workers": WORKERS, "workdir": str(project),
        "job": {"module": "tests.workloads.big_state", "epochs": 1, "steps_per_epoch": size.steps,
                "progress_every_steps": 1},
        "checkpoint": checkpoint, "env": {"BIG_STATE_MIB": str(size.mib)}, "ports": PORTS,
        "provider": static_provider(lab, hosts), **SETTINGS,
    }
    where = directory / f"{size.mib}" / config
    where.mkdir(parents=True, exist_ok=True)
    return write_spec(where, spec)


def measure_size(size: Size, directory: Path, project: Path, lab: HostLab, hosts: list[LabHost],
                 shared: Path, runs: int, copy_runs: int) -> dict[str, Any]:
    specs_by = {c: spec_for(directory, project, size, c, lab, hosts, shared) for c in CONFIGS}
    samples: dict[str, list[Sample]] = {c: [] for c in CONFIGS}
    copies: dict[str, Any] = {}
    try:
        for i in range(runs):
            for config in CONFIGS[i % len(CONFIGS):] + CONFIGS[:i % len(CONFIGS)]:
                path = specs_by[config]
                keep = directory / f"keep-{size.mib}" if config == "off" and not copies else None
                sample = train(path, config, hosts, keep)
                samples[config].append(sample)
                note(f"{size.name}, {LABELS[config]}: {sample.steps_per_s or 0:.1f} steps/s, "
                     f"{sample.checkpoints} checkpoints ({sample.in_window} measured), "
                     f"{human_bytes(sample.controller_bytes)} to the controller "
                     f"(product: {human_bytes(sample.product.get('through_controller', 0))}), "
                     f"{sample.mirrored} mirrored, model fetch "
                     f"{human_bytes(sample.model_fetch_bytes)}, {sample.seconds:.0f}s")
                if keep is not None:
                    if not keep.is_dir():
                        raise RuntimeError(f"{size.name}: no checkpoint of the chief was kept")
                    copies = measure_copies(path, sample.run_id, keep, hosts, copy_runs)
                drop_run(hosts, specs.load(path), sample.run_id)
    finally:
        with contextlib.suppress(Exception):
            Cluster.from_spec(specs_by["none"]).down()  # the cluster's directory on every host
        shutil.rmtree(directory / f"keep-{size.mib}", ignore_errors=True)
    return summarize(size, samples, copies)


def summarize(size: Size, samples: dict[str, list[Sample]], copies: dict[str, Any]) -> dict[str, Any]:
    rates = {c: median_of([s.steps_per_s for s in samples[c]]) for c in CONFIGS}
    configs: dict[str, Any] = {}
    for c in CONFIGS:
        runs = samples[c]
        per = [s.controller_bytes / s.checkpoints if s.checkpoints else None for s in runs]
        product = [s.product.get("through_controller", 0) for s in runs]
        configs[c] = {
            "steps_per_s": spread([s.steps_per_s for s in runs], 2),
            "ratio_to_none": ratio(rates[c], rates["none"]),
            "checkpoints": spread([s.checkpoints for s in runs], 0),
            "checkpoints_measured": spread([s.in_window for s in runs], 0),
            "mirrored": spread([s.mirrored for s in runs], 0),
            "controller_bytes": spread([s.controller_bytes for s in runs], 0),
            "controller_bytes_per_checkpoint": spread(per, 0),
            "product_through_controller": spread(product, 0),
            "product_per_checkpoint": spread([p / s.checkpoints if s.checkpoints else None
                                              for p, s in zip(product, runs, strict=True)], 0),
            "product_host_to_host": max(s.product.get("host_to_host", 0) for s in runs),
            "model_fetch_bytes": spread([s.model_fetch_bytes for s in runs], 0),
            "run_s": spread([s.seconds for s in runs], 1),
        }
    baseline = configs["off"]["controller_bytes_per_checkpoint"]["median"]
    for c in ("on", "shared"):
        value = configs[c]["controller_bytes_per_checkpoint"]["median"]
        configs[c]["excess_per_checkpoint"] = (None if value is None or baseline is None
                                               else round(value - baseline))
    state = size.mib << 20
    shared_excess = configs["shared"]["excess_per_checkpoint"]
    on_over_off, shared_over_off = ratio(rates["on"], rates["off"]), ratio(rates["shared"], rates["off"])
    return {
        "size_mib": size.mib, "every_steps": size.every, "steps": size.steps,
        "repeats": len(samples["none"]), "configs": configs,
        "on_over_off": on_over_off, "shared_over_off": shared_over_off,
        "relaunch": copies,
        "goals": {
            "shared_moves_no_checkpoint_bytes": (
                configs["shared"]["product_through_controller"]["max"] == 0
                and shared_excess is not None and shared_excess <= SHARED_SLACK * state),
            "relaunch_copy_within_1_3x": bool(copies.get("goal_met")),
            "mirror_keeps_0_95": on_over_off is not None and on_over_off >= STEPS_GOAL,
            "shared_keeps_0_95": shared_over_off is not None and shared_over_off >= STEPS_GOAL,
        },
    }


def make_project(directory: Path) -> Path:
    """A small user project holding only the workload (the repository would sync tens of MB)."""
    project = directory / "project"
    target = project / "tests" / "workloads"
    target.mkdir(parents=True)
    for name in ("__init__.py", "big_state.py"):
        shutil.copy2(REPO / "tests" / "workloads" / name, target / name)
    return project


def rows_of(results: list[dict[str, Any]]) -> list[list[Any]]:
    rows: list[list[Any]] = []
    for r in results:
        size = Size(r["size_mib"], r["every_steps"], r["steps"]).name
        for c in CONFIGS:
            f = r["configs"][c]
            per = f["controller_bytes_per_checkpoint"]["median"]
            rows.append([size, LABELS[c], show(f["steps_per_s"]), f["ratio_to_none"] or "-",
                         show(f["checkpoints"]),
                         human_bytes(f["controller_bytes"]["median"] or 0),
                         "-" if per is None else human_bytes(per),
                         human_bytes(f["product_through_controller"]["median"] or 0),
                         show(f["mirrored"])])
        copy = r["relaunch"]
        rows.append([size, "relaunch copy", f"{human_bytes(copy['bytes'])} chain to {copy['hosts']}:",
                     show(copy["chain_s"], "s"), f"plain to 1: {show(copy['plain_s'], 's')}",
                     f"x{copy['chain_over_plain']}", f"again {show(copy['again_s'], 's')}",
                     f"ctl {human_bytes(copy['controller_bytes']['median'] or 0)}", ""])
        rows.append([size, "c/b, d/b", r["on_over_off"], r["shared_over_off"], "", "", "", "",
                     " ".join(f"{k}={'yes' if v else 'no'}" for k, v in r["goals"].items())])
    return rows


def main() -> None:
    args = parser(__doc__, full_repeats=2).parse_args()
    host_facts, started = describe_machine(), time.monotonic()
    sizes = QUICK if args.quick else FULL
    header = ["size", "config", "steps/s", "/ (a)", "checkpoints", "to controller",
              "per checkpoint", "product says", "mirrored"]
    with temp_home("checkpoints"), tempfile.TemporaryDirectory(prefix="orchestrate-bench-") as scratch, \
            namespace_lab(WORKERS) as (lab, why):
        if lab is None:
            note(f"skipped: {why}")
            publish("checkpoints", args, host_facts, started, {"skipped": why}, ["skipped"], [[why]])
            return
        directory = Path(scratch)
        project = make_project(directory)
        shared = Path(tempfile.mkdtemp(prefix="orchestrate-bench-shared-"))
        shared.chmod(0o1777)  # every host's user writes there
        hosts = lab.hosts(WORKERS)
        for host in hosts:
            host.throttle(RATE, to=str(lab.bridge_address))
        results = []
        try:
            for size in sizes:
                runs = min(repeats(args), size.max_repeats) if args.repeats is None else repeats(args)
                results.append(measure_size(size, directory, project, lab, hosts, shared, runs,
                                            copy_runs=1 if args.quick else 3))
        finally:
            for host in hosts:
                host.unthrottle()
            shutil.rmtree(shared, ignore_errors=True)
    publish("checkpoints", args, host_facts, started,
            {"job": f"tests.workloads.big_state, {WORKERS} workers on 3 namespace hosts",
             "rate": RATE, "warmup": WARMUP,
             "goals": {"steps": f"c/b and d/b >= {STEPS_GOAL}",
                       "copy": f"chain to 2 hosts <= {COPY_GOAL}x a plain copy to 1",
                       "shared": "0 checkpoint bytes through the controller"},
             "results": results},
            header, rows_of(results))


if __name__ == "__main__":
    main()
