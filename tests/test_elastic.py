"""Elastic groups (``elastic:``): a machine lost for good, and the run goes on with the workers
left, from the chief's snapshot, at the batch the policy keeps. Real TensorFlow on namespace SSH
hosts as an unprivileged user; the spec's refusals and the resized spec in-process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import REPO, events_in, release_run, write_spec
from hostlab import HostLab

from orchestrator import elastic, paths, spec
from orchestrator.api import Cluster
from orchestrator.errors import ProviderError, SpecError
from orchestrator.events import Event
from orchestrator.hosts import Host
from orchestrator.providers.local import LocalProvider
from orchestrator.state import AttemptRecord, Store, TaskRecord
from orchestrator.supervisor import SPARE, Supervisor
from orchestrator.view import RunView

SPEC = "name: e\nworkers: 3\njob: {job}\n"


@pytest.mark.parametrize(("policy", "per_replica", "rate", "global_batch"), [
    ("keep_per_replica", 16, 0.002, 32), ("keep_global", 24, 0.003, 48)])
def test_a_smaller_group_keeps_what_its_policy_says(policy: str, per_replica: int, rate: float,
                                                    global_batch: int) -> None:
    full = spec.parse(SPEC.format(job="{module: m, per_replica_batch_size: 16}") +
                      f"elastic: {{min_workers: 2, batch: {policy}}}\n")
    two = elastic.resized(full, 2)
    assert two.workers == 2 and two.elastic == full.elastic
    assert two.job.per_replica_batch_size == per_replica  # type: ignore[union-attr]
    assert elastic.describe(full, 2) == (f"2 worker(s): global batch {global_batch} "
                                         f"({per_replica} per replica), learning rate {rate:g}")
    assert elastic.describe(full, 3) == \
        "3 worker(s): global batch 48 (16 per replica), learning rate 0.003"
    assert elastic.resized(full, 3) is full


@pytest.mark.parametrize(("text", "said", "fix"), [
    ("elastic: {min_workers: 4}", "min_workers is 4, over the 3 workers",
     "set elastic.min_workers to 3 or fewer"),
    ("elastic: {min_workers: 0}", "greater than or equal to 1", ""),
    ("elastic: {min_workers: 2, batch: keep_global}\njob: {module: m, per_replica_batch_size: 5}",
     "keep_global keeps the global batch of 15 (3 x 5), which 2 worker(s) cannot split evenly",
     "raise elastic.min_workers"),
    ("elastic: {min_workers: 2}\nseparate_chief: true", "separate_chief gives it a task",
     "remove separate_chief"),
    ("elastic: {min_workers: 2, max_workers: 2}", "max_workers is 2, under the 3 workers",
     "set elastic.max_workers to 3 or more"),
    ("elastic: {min_workers: 2, max_workers: 5, batch: keep_global}\n"
     "job: {module: m, per_replica_batch_size: 4}",
     "keep_global keeps the global batch of 12 (3 x 4), which 5 worker(s) cannot split evenly",
     "lower elastic.max_workers"),
])
def test_an_elastic_section_that_cannot_work_is_refused_with_its_fix(
        text: str, said: str, fix: str) -> None:
    body = SPEC.format(job="{module: m}")
    if "\njob:" in text:  # the case's own job
        body = body.replace("job: {module: m}\n", "")
    with pytest.raises(SpecError) as caught:
        spec.parse(body + text + "\n")
    assert said in str(caught.value) and fix in str(caught.value), str(caught.value)


def test_plan_shows_every_size_the_group_may_train_at(tmp_path: Path) -> None:
    path = tmp_path / "e.yaml"
    path.write_text(f"name: e\nworkdir: {REPO}\nworkers: 3\n"
                    "job: {module: examples.digits, per_replica_batch_size: 16}\n"
                    "elastic: {min_workers: 2}\n")
    shown = subprocess.run([sys.executable, "-m", "orchestrator.cli", "plan", str(path)],
                           cwd=REPO, capture_output=True, text=True, timeout=120,
                           env={**os.environ, "COLUMNS": "300",
                                "ORCHESTRATE_HOME": str(tmp_path / "home")})
    assert shown.returncode == 0, shown.stderr
    assert ("  elastic    down to 2 worker(s) when a machine is lost for good "
            "(keep_per_replica): 3 worker(s): global batch 48 (16 per replica), learning rate "
            "0.003; 2 worker(s): global batch 32 (16 per replica), learning rate 0.002") \
        in shown.stdout, shown.stdout


def test_a_larger_group_keeps_what_its_policy_says() -> None:
    """Past workers (elastic.max_workers): keep_global splits the same global batch over more
    replicas; keep_per_replica's global batch and learning rate grow with the group."""
    body = SPEC.format(job="{module: m, per_replica_batch_size: 16}")
    grows = spec.parse(body + "elastic: {min_workers: 2, max_workers: 4, batch: keep_global}\n")
    assert (grows.max_workers, grows.spares) == (4, 1)
    assert elastic.describe(grows, 4) == \
        "4 worker(s): global batch 48 (12 per replica), learning rate 0.003"
    kept = spec.parse(body + "elastic: {min_workers: 2, max_workers: 4}\n")
    assert elastic.describe(kept, 4) == \
        "4 worker(s): global batch 64 (16 per replica), learning rate 0.004"
    assert (spec.parse(body).max_workers, spec.parse(body).spares) == (3, 0)


@pytest.mark.parametrize(("listed", "most", "said", "fix"), [
    (2, 3, "2 host(s) listed for 2 task(s) and 1 spare(s) (workers: 2, elastic.max_workers: 3)",
     "list 3 hosts: one per worker, then the spares the group may grow onto"),
    (4, 3, "4 host(s) listed for 2 task(s) and 1 spare(s)", "list 3 hosts"),
    # without spares, one host per task, as before; the fix names max_workers
    (3, 2, "3 host(s) listed for 2 task(s) (workers: 2, separate_chief: false)",
     "(or set elastic.max_workers: the hosts past workers are then spares)"),
])
def test_static_hosts_list_the_spares_after_the_workers(tmp_path: Path, listed: int, most: int,
                                                       said: str, fix: str) -> None:
    hosts = "".join(f"    - {{address: 10.0.0.{i + 1}, user: u, key_file: k}}\n"
                    for i in range(listed))
    path = tmp_path / "s.yaml"
    path.write_text("name: s\nworkers: 2\njob: {module: m}\n"
                    f"elastic: {{min_workers: 1, max_workers: {most}}}\n"
                    f"provider:\n  kind: static\n  hosts:\n{hosts}")
    with pytest.raises(SpecError) as caught:
        spec.load(path)
    assert (caught.value.file, caught.value.field) == (str(path), "provider.hosts")
    assert said in caught.value.message and fix in (caught.value.fix or ""), str(caught.value)


def test_a_group_with_spares_starts_without_them_and_plans_every_size(tmp_path: Path) -> None:
    """workers 2, max_workers 4 on local processes: the first attempt's plan has 2 tasks, the
    spares wait in _left_out (the resized record says so), and plan shows 4 sizes down to
    min_workers with the spares named."""
    path = tmp_path / "e.yaml"
    path.write_text(f"workdir: {REPO}\nname: e\nworkers: 2\n"
                    "job: {module: examples.digits, per_replica_batch_size: 16}\n"
                    "elastic: {min_workers: 1, max_workers: 4, grow_check_s: 0}\n")
    loaded = spec.load(path)
    provider = LocalProvider(loaded, path)
    assert [h.name for h in provider.spare_hosts()] == ["local-2", "local-3"]
    supervisor = Supervisor(loaded, provider, Store(), workdir=REPO)
    supervisor._await_spares()
    assert supervisor._left_out == {"local-2": SPARE, "local-3": SPARE}
    sized, hosts = supervisor._sized()
    assert (sized.workers, [h.name for h in hosts]) == (2, ["local-0", "local-1"])
    plan = supervisor._plan("r", 1, busy=False)
    assert supervisor._resized_text(plan) == (f"2 of 4 workers (without local-2: {SPARE}; "
                                              f"local-3: {SPARE})")
    # one spare ready: the next attempt has 3 tasks, the last one on it
    supervisor._returned = {"local-3": provider.spare_hosts()[1]}
    supervisor._repair_hosts()
    sized, hosts = supervisor._sized()
    assert (sized.workers, [h.name for h in hosts]) == (3, ["local-0", "local-1", "local-3"])
    document = Cluster.from_spec(path).plan_document()
    entry = document["elastic"]
    assert (entry["min_workers"], entry["max_workers"], list(entry["sizes"])) == \
        (1, 4, [4, 3, 2, 1])
    assert [h["name"] for h in entry["spares"]] == ["local-2", "local-3"]
    assert entry["summary"].startswith("from 2 up to 4 onto local-2, local-3 as the grow check "
                                       "finds them; down to 1 worker(s)")
    assert [h["name"] for h in document["hosts"]] == ["local-0", "local-1"]


def test_a_command_job_keeps_its_own_batch() -> None:
    with pytest.raises(SpecError) as caught:
        spec.parse(SPEC.format(job="{command: python train.py}") +
                   "elastic: {min_workers: 2, batch: keep_global}\n")
    assert "a command job's script sets itself" in str(caught.value)
    command = spec.parse(SPEC.format(job="{command: python train.py}") +
                         "elastic: {min_workers: 1}\n")
    assert elastic.resized(command, 1).workers == 1


def wait_for(what: str, found: Callable[[], bool], timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not found():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:.0f} s: {what}")
        time.sleep(0.2)


@pytest.mark.ssh
@pytest.mark.tf
def test_a_lost_host_shrinks_the_group_at_the_same_global_batch_and_its_return_grows_it_back(
        hostlab: HostLab, tmp_path: Path, orchestrate_home: Path) -> None:
    """3 hosts, the third cut off at step 15: the chief saves the step the group completed, the
    host does not come back within timeouts.repair_s, and the run goes on with 2 workers from
    that snapshot, each replica's batch 24 instead of 16 (keep_global: the global batch of 48
    and the learning rate stay). Its controller is killed then, and 'train --attach' takes the
    smaller attempt over as it is, without the lost host, and looks for it again. The host
    back, the grow check finds it, every task saves at one step, and the group goes on with 3
    again from that step: one model on all three."""
    hosts = hostlab.hosts(3)
    path = write_spec(tmp_path, hostlab, hosts, """\
        name: elastic-e2e
        job: {module: tests.workloads.paced_digits, epochs: 1, steps_per_epoch: 120,
              progress_every_steps: 1, per_replica_batch_size: 16}
        checkpoint: {every_steps: 10}
        retry: {max_restarts: 1, backoff_initial_s: 0.2, backoff_max_s: 1}
        timeouts: {stop_grace_s: 30, poll_s: 4, hang_s: 10, repair_s: 5}
        elastic: {min_workers: 2, batch: keep_global, grow_check_s: 1}
        env: {DIGITS_PACE_S: "0.25"}
        """, user=hostlab.plain_user())
    roots = [paths.host_root(h.plain_home, "elastic-e2e") for h in hosts]
    store = Store(orchestrate_home / "state.db")

    def steps_of(attempt: int, task: int) -> list[int]:
        runs = store.runs("elastic-e2e")
        tasks = runs[0].attempts[attempt - 1].tasks if runs and \
            len(runs[0].attempts) >= attempt else []
        if len(tasks) <= task:
            return []
        return [e.get("step") for e in events_in(hosts[task], tasks[task].log)
                if e.kind == "progress"]

    controller = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli", "train", str(path), "--plain"], cwd=REPO,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    done: list[str] = []
    try:
        wait_for("worker:2 at step 15", lambda: any(s >= 15 for s in steps_of(1, 2)))
        hosts[2].cut()
        wait_for("a step on 2 workers", lambda: bool(steps_of(2, 0)))
    finally:
        controller.kill()  # the controller dies while the group trains on 2
        controller.wait()

    seen: list[RunView] = []

    def listener(view: RunView, event: Event | None) -> None:
        seen[:] = [view]
        if event is None or event.kind not in ("progress", "started"):
            return
        if event.attempt == 2 and event.kind == "progress" and "restored" not in done:
            done.append("restored")  # the smaller group, taken over: the host comes back
            hosts[2].restore()
        elif event.attempt == 3 and event.kind == "started" and "released" not in done:
            done.append("released")
            for root in roots:
                release_run(root, view.run_id)

    cluster = Cluster.from_spec(path)
    try:
        result = cluster.train(listener=listener, attach=True).wait()
    finally:
        hosts[2].heal()
    assert done == ["restored", "released"], done
    messages = seen[0].messages
    assert any(m.startswith("attempt 2 runs without elastic-e2e-2 (elastic)") for m in messages)
    assert any("attached to attempt 2 of run" in m for m in messages), messages
    first, second, third = result.attempts
    lost = first.tasks[2].host
    # shrunk: the host cut off, not back within repair_s
    assert (first.cause, first.failed_task) == ("host_lost", "worker:2"), first.detail
    assert not first.resized and not third.resized
    assert second.resized.startswith(f"2 of 3 workers (without {lost}: host {lost} "), \
        second.resized
    assert "did not come back within 5s" in second.resized
    assert first.snapshot_step is not None and second.resumed_from_step == first.snapshot_step
    assert [t.task for t in second.tasks] == ["worker:0", "worker:1"]
    assert [t.host for t in second.tasks] == [t.host for t in first.tasks[:2]]
    # grown back: a planned stop, every task saved at one step, none redone
    assert (second.status, second.cause) == ("stopped", "resized"), second.detail
    assert second.detail.startswith(f"{lost} back: every task saves, and the group grows to 3 ")
    assert third.resumed_from_step == second.last_step and second.steps_lost == 0
    assert [t.host for t in third.tasks] == [t.host for t in first.tasks]
    sizes = [(3, 48), (2, 48), (3, 48)]
    for number, attempt in enumerate(result.attempts):
        for h, task in zip(hosts, attempt.tasks, strict=False):
            assert task.log.startswith(h.plain_home)
            built = next(e for e in events_in(h, task.log) if e.kind == "built")
            assert (built.get("replicas"), built.get("global_batch_size")) == sizes[number]
            assert built.get("learning_rate") == pytest.approx(0.003)  # 0.001 x 3, kept
    assert result.status == "succeeded" and len(result.digests) == 3
    assert len(set(result.digests.values())) == 1
    shown = subprocess.run([sys.executable, "-m", "orchestrator.cli", "status", "elastic-e2e",
                            "--no-chart"], cwd=REPO, capture_output=True, text=True,
                           timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert " on 2 of 3 workers (without " in shown.stdout, shown.stdout
    assert "; resized in -: " in shown.stdout, shown.stdout
    cluster.down()


@pytest.mark.ssh
@pytest.mark.tf
def test_a_group_grows_past_workers_onto_a_spare_once_it_answers(
        hostlab: HostLab, tmp_path: Path, orchestrate_home: Path) -> None:
    """workers 2, elastic.max_workers 3: the third listed host is a spare, down as the run
    starts, so the run starts on 2 and 'up' and the doctor never ask it. Once it answers, the
    grow check prepares it (its root made, the code synced, as the unprivileged user), every
    task saves at one step, and the group goes on with 3 from that step, its global batch and
    learning rate grown with it (keep_per_replica). 'down' removes what was made on the spare
    too."""
    hosts = hostlab.hosts(3)
    path = write_spec(tmp_path, hostlab, hosts, """\
        name: elastic-grow
        job: {module: tests.workloads.paced_digits, epochs: 1, steps_per_epoch: 80,
              progress_every_steps: 1, per_replica_batch_size: 16}
        checkpoint: {every_steps: 10}
        retry: {max_restarts: 1, backoff_initial_s: 0.2, backoff_max_s: 1}
        timeouts: {stop_grace_s: 30, poll_s: 4, hang_s: 10}
        elastic: {min_workers: 2, max_workers: 3, grow_check_s: 1}
        env: {DIGITS_PACE_S: "0.25"}
        """, user=hostlab.plain_user())
    path.write_text(path.read_text().replace("\nworkers: 3\n", "\nworkers: 2\n"))
    roots = [paths.host_root(h.plain_home, "elastic-grow") for h in hosts]
    done: list[str] = []
    seen: list[RunView] = []

    def listener(view: RunView, event: Event | None) -> None:
        seen[:] = [view]
        if event is None or event.kind not in ("progress", "started"):
            return
        if event.attempt == 1 and event.kind == "progress" and int(event.get("step")) >= 10 \
                and "restored" not in done:
            done.append("restored")  # the spare answers now
            hosts[2].restore()
        elif event.attempt == 2 and event.kind == "started" and "released" not in done:
            done.append("released")
            for root in roots:
                release_run(root, view.run_id)

    hosts[2].cut()
    cluster = Cluster.from_spec(path)
    try:
        result = cluster.train(listener=listener).wait()
    finally:
        hosts[2].heal()
    assert done == ["restored", "released"], done
    first, second = result.attempts
    spare = "elastic-grow-2"
    assert first.resized == f"2 of 3 workers (without {spare}: {SPARE})", first.resized
    assert [t.host for t in first.tasks] == ["elastic-grow-0", "elastic-grow-1"]
    assert any(m.startswith(f"1 spare(s) to grow onto (elastic.max_workers 3): {spare}")
               for m in seen[0].messages), seen[0].messages
    # grown: a planned stop, every task saved at one step, none redone
    assert (first.status, first.cause) == ("stopped", "resized"), first.detail
    assert first.detail.startswith(f"{spare} back: every task saves, and the group grows to 3 ")
    assert second.resumed_from_step == first.last_step and first.steps_lost == 0
    assert not second.resized
    assert [t.host for t in second.tasks] == [f"elastic-grow-{i}" for i in range(3)]
    sizes = [(2, 32, 0.002), (3, 48, 0.003)]
    for number, attempt in enumerate(result.attempts):
        for h, task in zip(hosts, attempt.tasks, strict=False):
            assert task.log.startswith(h.plain_home)  # the unprivileged user's own home
            built = next(e for e in events_in(h, task.log) if e.kind == "built")
            replicas, batch, rate = sizes[number]
            assert (built.get("replicas"), built.get("global_batch_size")) == (replicas, batch)
            assert built.get("learning_rate") == pytest.approx(rate)
    assert result.status == "succeeded" and len(result.digests) == 3
    assert len(set(result.digests.values())) == 1
    assert Path(roots[2]).is_dir()
    report = cluster.down()
    assert not Path(roots[2]).exists(), report
    assert f"{spare}:{roots[2]}" in report.removed, report


@pytest.mark.ssh
def test_the_doctor_says_which_spare_does_not_answer_without_blocking(
        hostlab: HostLab, tmp_path: Path) -> None:
    """1 worker and 2 spares: the one cut off is named, with why and what the run does about
    it, as a warning; the spare that answers is not; the worker's host is checked as ever."""
    hosts = hostlab.hosts(3)
    path = write_spec(tmp_path, hostlab, hosts, """\
        name: spares
        job: {command: "true"}
        elastic: {min_workers: 1, max_workers: 3, grow_check_s: 30}
        """)
    path.write_text(path.read_text().replace("\nworkers: 3\n", "\nworkers: 1\n"))
    hosts[2].cut()
    try:
        report = Cluster.from_spec(path).doctor(tensorflow="never")
    finally:
        hosts[2].heal()
    spare = [p for p in report.problems if p.check == "spare"]
    assert [(p.hosts, p.blocking) for p in spare] == [(("spares-2",), False)], report.problems
    assert spare[0].message.startswith("spare spares-2 does not answer now (")
    assert spare[0].message.endswith("): the group starts with 1 worker(s) and grows onto it "
                                     "once it does (the grow check asks it every 30s)")
    assert report.ok, report.problems
    assert [c.name for c in report.hosts] == ["spares-0"]


def test_a_loss_that_would_leave_fewer_than_min_workers_fails_the_run_saying_so(
        tmp_path: Path) -> None:
    """The supervisor's choice when a host's repair failed: go on without it while
    min_workers are left, else the repair's own error, with why the group did not shrink."""
    path = tmp_path / "e.yaml"
    path.write_text(f"workdir: {REPO}\n" + SPEC.format(job="{module: examples.digits}") +
                    "elastic: {min_workers: 2, grow_check_s: 0}\n")
    loaded = spec.load(path)
    supervisor = Supervisor(loaded, LocalProvider(loaded, path), Store(), workdir=REPO)
    names = [h.name for h in supervisor.provider.hosts()]
    gone = ProviderError(f"host {names[2]} did not come back within 5s", fix="bring it back")
    supervisor._leave_out(names[2], gone)
    sized, hosts = supervisor._sized()
    assert (sized.workers, [h.name for h in hosts]) == (2, names[:2])
    with pytest.raises(ProviderError) as caught:
        supervisor._leave_out(names[1], ProviderError(f"host {names[1]} is gone", fix="wait"))
    assert caught.value.message == (f"host {names[1]} is gone; without it 1 worker(s) would be "
                                    "left, fewer than elastic.min_workers (2)")
    assert caught.value.fix == "wait"
    assert supervisor._grow_thread is None  # grow_check_s: 0, never looked for


def test_hosts_that_are_slots_leave_out_the_last_and_grow_back_in_order(tmp_path: Path) -> None:
    """A provider whose hosts are slots the scheduler places (a JobSet's pods, named by their
    index): whichever one could not be placed, the group is the first N, and the grow check
    asks for the missing ones in order, stopping at the first not back."""
    path = tmp_path / "e.yaml"
    path.write_text(f"workdir: {REPO}\n" + SPEC.format(job="{module: examples.digits}") +
                    "elastic: {min_workers: 1, grow_check_s: 0.01}\n")
    loaded = spec.load(path)
    asked: list[str] = []

    class Slots(LocalProvider):
        interchangeable_hosts = True

        def repair(self, host: Host, deadline_s: float) -> Host:
            asked.append(host.name)
            supervisor._grow_stop.set()  # one round of the grow check
            raise ProviderError("no node has room", fix="add one")

    supervisor = Supervisor(loaded, Slots(loaded, path), Store(), workdir=REPO)
    names = [h.name for h in supervisor.provider.hosts()]
    supervisor._leave_out(names[0], ProviderError("no node can take a worker's pod", fix="x"))
    supervisor._leave_out(names[1], ProviderError("no node can take a worker's pod", fix="x"))
    assert supervisor._left_out == {names[2]: "no node can take a worker's pod",
                                    names[1]: "no node can take a worker's pod"}
    assert [h.name for h in supervisor._sized()[1]] == names[:1]
    supervisor._grow_stop.set()  # the thread _leave_out started: stopped; then one round here
    supervisor._grow_thread.join(5)  # type: ignore[union-attr]
    supervisor._grow_stop.clear()
    supervisor._check_for_returns()
    assert asked == [names[1]]  # the first missing slot; the next waits for it


def test_attach_to_a_smaller_attempt_leaves_out_what_it_ran_without_with_its_reasons(
        tmp_path: Path) -> None:
    """What 'train --attach' reads back from the record of an attempt on fewer workers: the
    hosts its tasks are not on, each with its own reason from ``resized``."""
    path = tmp_path / "e.yaml"
    path.write_text(f"workdir: {REPO}\nname: e\nworkers: 4\njob: {{module: examples.digits}}\n"
                    "elastic: {min_workers: 2, grow_check_s: 0}\n")
    loaded = spec.load(path)
    supervisor = Supervisor(loaded, LocalProvider(loaded, path), Store(), workdir=REPO)
    names = [h.name for h in supervisor.provider.hosts()]
    tasks = [TaskRecord(task=f"worker:{i}", host=names[i], endpoint="", pgid=0, log="", rc="")
             for i in (0, 2)]
    resized = (f"2 of 4 workers (without {names[1]}: host {names[1]} is gone: no route; "
               f"a: b; {names[3]}: no zone could create 1 VM(s) (x))")
    attempt = AttemptRecord("r", 2, "running", 0.0, None, "", "", "", None, None, None, None,
                            tasks, resized=resized)
    supervisor._left_out_by(attempt)
    assert supervisor._left_out == {
        names[1]: f"host {names[1]} is gone: no route; a: b",
        names[3]: "no zone could create 1 VM(s) (x)"}
    sized, hosts = supervisor._sized()
    assert (sized.workers, [h.name for h in hosts]) == (2, [names[0], names[2]])


def test_attach_to_an_attempt_cut_short_leaves_out_only_the_spares(tmp_path: Path) -> None:
    """An attempt whose controller died as it launched: its record may have no resize written
    and tasks on some hosts only. The workers' hosts stay in the group (the next attempt
    launches on them); the spares it has no task on wait for the grow check again."""
    path = tmp_path / "e.yaml"
    path.write_text(f"workdir: {REPO}\nname: e\nworkers: 2\njob: {{module: examples.digits}}\n"
                    "elastic: {min_workers: 1, max_workers: 3, grow_check_s: 0}\n")
    loaded = spec.load(path)
    supervisor = Supervisor(loaded, LocalProvider(loaded, path), Store(), workdir=REPO)
    task = TaskRecord(task="worker:0", host="local-0", endpoint="", pgid=0, log="", rc="")
    attempt = AttemptRecord("r", 1, "running", 0.0, None, "", "", "", None, None, None, None,
                            [task], resized="")
    supervisor._left_out_by(attempt)
    assert supervisor._left_out == {"local-2": SPARE}
    sized, hosts = supervisor._sized()
    assert (sized.workers, [h.name for h in hosts]) == (2, ["local-0", "local-1"])
