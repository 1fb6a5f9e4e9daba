"""Benchmark: Kubernetes, `orchestrate train` against the same JobSet applied by hand.

Against the fake API server of tests/fake_kube.py with the controllers of tests/kubecluster.py,
whose pods are real processes, each in its own network namespace (tests/podlab.py), on this
machine: 3 nodes, the digits job (examples/digits.py), 3 workers, the code in ConfigMaps,
checkpoints on a ReadWriteMany claim. In one run, taking turns:

- cold start: the JobSet `orchestrate plan` prints, applied by hand (`create` through the API,
  the clock starts with it), to the chief's first step (its own event time);
- submit to first step: `Cluster.train()` (the clock starts with it: `up` finds the
  ConfigMaps made, the doctor asks the cluster, the Secret and the JobSet are made) to the
  chief's first step (goal: at most 1.10x the cold start);
- a pod killed to the first step after the relaunch: worker:1's container SIGKILLed once the
  chief reports step 10; the group is stopped and a new JobSet submitted, resuming from the
  chief's checkpoint (goal: at most 1.5x the cold start, which is what a person re-applying
  the JobSet at once, from the same checkpoint, would wait at best);
- scale: 64 pods (--quick: 8) of a light task (benchmarks/light_task.py: 1 progress event a
  second, no TensorFlow, command mode) watched by `orchestrate train --plain` in a process of
  its own: its CPU time over the run's wall time, and the API requests per minute while every
  pod reports (goal: the watch carries the load: requests per minute do not grow with the
  pods, at most 2 per pod per minute).

What the fake cannot say about a real cluster: an API server's and etcd's latency, image
pulls (the pods use this machine's files), the scheduler's and the kubelet's real timing, and
a cluster DNS's. The figures compare the orchestrator's own overhead with applying the same
objects by hand on the same fake.

    python benchmarks/kubernetes.py              # 3 repeats
    python benchmarks/kubernetes.py --quick      # once, 8 pods for the scale figure
"""

from __future__ import annotations

import sys
from pathlib import Path

# This file's name is the kubernetes client package's: its directory goes last on the path, so
# `import kubernetes` finds the client (and `common` is still found here).
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE)]

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
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
from fake_kube import FakeKube
from kubecluster import FakeCluster
from podlab import PodLab

from orchestrator.api import Cluster
from orchestrator.events import parse_line
from orchestrator.providers.kubernetes import manifests

IMAGE = "registry.test/orchestrate-worker:1"
NAMESPACE = "ml"


@contextmanager
def fake_cluster(lab: PodLab) -> Iterator[FakeCluster]:
    kube = FakeKube(log_poll_s=0.05).start()
    cluster = FakeCluster(kube, lab, images={IMAGE}, node_monitor_grace_s=1.0, eviction_s=2)
    cluster.start()
    try:
        cluster.namespace_with_claim(NAMESPACE)
        yield cluster
    finally:
        cluster.close()
        kube.close()


def project(directory: Path, cluster: FakeCluster, lab: PodLab, name: str, body: str,
            workers: int) -> Path:
    directory.mkdir(parents=True)
    shutil.copy(REPO / "examples" / "digits.py", directory / "digits.py")
    shutil.copy(REPO / "benchmarks" / "light_task.py", directory / "light_task.py")
    kubeconfig = cluster.kube.write_kubeconfig(directory.parent / f"{name}.kubeconfig")
    user = lab.plain_user()
    path = directory / "spec.yaml"
    path.write_text(f"""\
name: {name}
workers: {workers}
container: {{image: {IMAGE}, python: {sys.executable}}}
provider:
  kind: kubernetes
  kubeconfig: {kubeconfig}
  namespace: {NAMESPACE}
  volume: {{claim: shared}}
  run_as_user: {user.uid}
  run_as_group: {user.gid}
  fs_group: {user.gid}
""" + body)
    return path


def chief_first_step(cluster: FakeCluster, attempt: str | None = None,
                     timeout_s: float = 300) -> float:
    """The time (the chief's own clock) of its first progress event, from its pod's log."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for pod in cluster.store.list("pods", NAMESPACE):
            meta = pod["metadata"]
            if meta.get("annotations", {}).get(manifests.JOB_INDEX_KEY) != "0" or (
                    attempt is not None and meta["labels"].get(manifests.ATTEMPT_LABEL) != attempt):
                continue
            log = cluster.store.log_source(NAMESPACE, meta["name"], manifests.CONTAINER, False)
            if log is None or not log.exists():
                continue
            for line in log.read_text(errors="replace").splitlines():
                event = parse_line(line.split(" ", 3)[-1])
                if event is not None and event.kind == "progress":
                    return event.time
        time.sleep(0.05)
    raise RuntimeError("the chief reported no step")


def cold_start(lab: PodLab, work: Path) -> float:
    """The JobSet `plan` prints, applied by hand, to the chief's first step."""
    with fake_cluster(lab) as cluster:
        path = project(work / "cold", cluster, lab, "bench-k8s", DIGITS, 3)
        api = Cluster.from_spec(path)
        try:
            api.up()  # the ConfigMaps the JobSet mounts
            manifest = api.plan_document()["creates"]["kubernetes"]["manifest"]
            started = time.time()
            cluster.store.create("jobsets", manifest, namespace=NAMESPACE)
            return chief_first_step(cluster) - started
        finally:
            api.provider.close()


def orchestrated(lab: PodLab, work: Path, kill_at: int) -> tuple[float, float]:
    """`train` to the chief's first step; and a pod killed at ``kill_at`` to the first step
    after the relaunch."""
    with fake_cluster(lab) as cluster:
        path = project(work / "train", cluster, lab, "bench-k8s", DIGITS_LONG, 3)
        api = Cluster.from_spec(path)
        api.up()
        killed: list[float] = []
        firsts: dict[int, float] = {}  # the chief's first step per attempt, its own clock

        def listener(view: Any, event: Any) -> None:
            if event is not None and event.kind == "progress" and event.task == "worker:0":
                firsts.setdefault(event.attempt, event.time)
            if not killed and event is not None and event.kind == "progress" and \
                    event.task == "worker:0" and (event.get("step") or 0) >= kill_at:
                pod = next(p for p in cluster.store.list("pods", NAMESPACE)
                           if p["metadata"]["annotations"].get(manifests.JOB_INDEX_KEY) == "1"
                           and p.get("status", {}).get("phase") == "Running")
                killed.append(time.time())
                cluster.kill_container(pod["metadata"]["name"], NAMESPACE)

        try:
            started = time.time()
            result = api.train(listener=listener).wait()
        finally:
            api.provider.close()
        if result.status != "succeeded" or len(result.attempts) != 2 or not killed:
            raise RuntimeError(f"the run went otherwise: {result.status}, "
                               f"{len(result.attempts)} attempt(s)")
        return firsts[1] - started, firsts[2] - killed[0]


def scale(lab: PodLab, work: Path, pods: int, seconds: float) -> dict[str, float]:
    """`orchestrate train` of ``pods`` light tasks, in a process of its own: its CPU share and
    the API requests per minute while every pod reports."""
    with fake_cluster(lab) as cluster:
        body = (f'job: {{command: "python light_task.py --rate 1 --seconds {seconds:g}"}}\n'
                "timeouts: {startup_s: 600}\n")
        path = project(work / "scale", cluster, lab, "bench-k8s-scale", body, pods)
        started = time.monotonic()
        controller = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.cli", "train", str(path), "--plain"],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env={**os.environ})
        window: dict[str, float] = {}

        def steady() -> None:  # every pod Running: count the requests from now on
            while controller.poll() is None:
                running = [p for p in cluster.store.list("pods", NAMESPACE)
                           if p.get("status", {}).get("phase") == "Running"
                           and p["metadata"]["labels"].get(manifests.ROLE_LABEL) == "worker"]
                if len(running) >= pods and "start" not in window:
                    time.sleep(2.0)  # the streams opened
                    window["start"], window["requests"] = time.monotonic(), len(
                        cluster.kube.requests)
                    time.sleep(max(1.0, seconds / 2))
                    window["end"], window["requests_end"] = time.monotonic(), len(
                        cluster.kube.requests)
                    return
                time.sleep(0.2)

        counter = threading.Thread(target=steady, daemon=True)
        counter.start()
        _, status, usage = os.wait4(controller.pid, 0)
        controller.returncode = os.waitstatus_to_exitcode(status)
        wall = time.monotonic() - started
        counter.join(10)
        if controller.returncode != 0 or "start" not in window:
            raise RuntimeError(f"the scale run failed ({controller.returncode}): "
                               f"{controller.stderr.read()[-2000:] if controller.stderr else ''}")
        minutes = (window["end"] - window["start"]) / 60
        per_minute = (window["requests_end"] - window["requests"]) / minutes
        return {"controller_cpu_share": (usage.ru_utime + usage.ru_stime) / wall,
                "requests_per_minute": per_minute, "wall_s": wall}


DIGITS = "job: {module: digits, epochs: 1, steps_per_epoch: 10, progress_every_steps: 1}\n"
DIGITS_LONG = ("job: {module: digits, epochs: 2, steps_per_epoch: 20, progress_every_steps: 1}\n"
               "checkpoint: {every_steps: 5}\nretry: {max_restarts: 2, backoff_initial_s: 0}\n")


def main() -> None:
    args = parser(__doc__).parse_args()
    began = time.monotonic()
    host = describe_machine()
    pods, seconds = (8, 20.0) if args.quick else (64, 60.0)
    cold: list[float] = []
    submit: list[float] = []
    recover: list[float] = []
    scaled: list[dict[str, float]] = []
    lab = PodLab.start()
    try:
        with temp_home("k8s"):
            for round_ in range(repeats(args)):
                work = Path(tempfile.mkdtemp(prefix="orchestrate-bench-k8s-"))
                try:
                    turns = ["cold", "train"] if round_ % 2 == 0 else ["train", "cold"]
                    for turn in turns:
                        if turn == "cold":
                            cold.append(cold_start(lab, work))
                            note(f"cold start: {cold[-1]:.1f}s")
                        else:
                            first, again = orchestrated(lab, work, kill_at=10)
                            submit.append(first)
                            recover.append(again)
                            note(f"train: first step {first:.1f}s; killed pod to first step "
                                 f"{again:.1f}s")
                finally:
                    shutil.rmtree(work, ignore_errors=True)
            work = Path(tempfile.mkdtemp(prefix="orchestrate-bench-k8s-"))
            try:
                scaled.append(scale(lab, work, pods, seconds))
                note(f"{pods} pods: controller CPU {scaled[-1]['controller_cpu_share']:.1%}, "
                     f"{scaled[-1]['requests_per_minute']:.0f} requests/min")
            finally:
                shutil.rmtree(work, ignore_errors=True)
    finally:
        lab.close()
    submit_ratio = ratio(median_of(submit), median_of(cold))
    recover_ratio = ratio(median_of(recover), median_of(cold))
    per_minute = median_of([s["requests_per_minute"] for s in scaled])
    figures = {
        "cold_start_s": spread(cold), "submit_to_first_step_s": spread(submit),
        "killed_to_first_step_s": spread(recover),
        "submit_over_cold": submit_ratio, "submit_goal_met": None if submit_ratio is None
        else submit_ratio <= 1.10,
        "recovery_over_cold": recover_ratio, "recovery_goal_met": None if recover_ratio is None
        else recover_ratio <= 1.5,
        "pods": pods, "controller_cpu_share": spread([s["controller_cpu_share"] for s in scaled]),
        "requests_per_minute": None if per_minute is None else round(per_minute, 1),
        "requests_per_pod_minute": None if per_minute is None else round(per_minute / pods, 2),
        "scale_goal_met": None if per_minute is None else per_minute / pods <= 2.0,
    }
    rows = [
        ["cold start (JobSet applied by hand)", show(figures["cold_start_s"], "s"), ""],
        ["train: submit to first step", show(figures["submit_to_first_step_s"], "s"),
         f"{submit_ratio}x (goal 1.10x)"],
        ["pod killed to first step", show(figures["killed_to_first_step_s"], "s"),
         f"{recover_ratio}x (goal 1.5x)"],
        [f"{pods} pods: controller CPU", show(figures["controller_cpu_share"]), ""],
        [f"{pods} pods: API requests/min", f"{figures['requests_per_minute']}",
         f"{figures['requests_per_pod_minute']}/pod (goal 2)"],
    ]
    publish("kubernetes", args, host, began, figures, ["figure", "value", "against cold"], rows)


if __name__ == "__main__":
    main()
