"""Two ways to stop a group (real local processes, command mode, no TensorFlow).

A planned stop (``down``, Ctrl-C, a task's SIGTERM from outside) sends SIGTERM and waits for
every task to save at the same step and exit; after a crash the survivors are killed at once.
The scripts here act out the worker's side of the protocol: on SIGTERM a task prints a
``stopped`` event with the step it saved at and exits 75, as ``python -m worker managed``
does (tests/test_keras3_worker.py checks that side with real TensorFlow).
"""

from __future__ import annotations

import textwrap
import threading
from pathlib import Path

import pytest

from orchestrator import spec
from orchestrator.api import Cluster
from orchestrator.errors import RunFailed, StateError
from orchestrator.events import Event, parse_line
from orchestrator.providers.local import LocalProvider
from orchestrator.remote.local import live_group_members
from orchestrator.state import Store
from orchestrator.supervisor import Supervisor
from orchestrator.view import RunView

# Every task counts steps; on SIGTERM it "saves" at the step it reached and exits 75. In
# attempt 1, worker:1 gets SIGTERM from outside (here: from itself) at step 5; its peer learns
# the step to save at from a file, as TensorFlow's PreemptionCheckpointHandler tells peers
# through its coordination service, and saves at the same step.
SAVES_ON_TERM = """
import json, os, signal, sys, time
task, attempt = os.environ["ORCHESTRATE_TASK"], os.environ["ORCHESTRATE_ATTEMPT"]
flag = os.path.join(os.environ["FLAGS"], "term-" + attempt)
step = 0
def say(event, **fields):  # one os.write a line: the SIGTERM handler says too, and a print
    # there that lands inside the main thread's print fails ("reentrant call")
    os.write(1, ("@orchestrate " + json.dumps({"event": event, "task": task,
                                               "attempt": int(attempt), "time": time.time(),
                                               **fields}) + "\\n").encode())
def stop(signal_name):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # more TERMs come (the group's, down's)
    # The first task to stop decides the step (a link fails where the flag exists): 'down'
    # TERMs every task at once, and a shared temporary name made one of them fail.
    mine = flag + "." + task.replace(":", "-")
    with open(mine, "w") as f:
        f.write(str(step))
    try:
        os.link(mine, flag)
    except FileExistsError:
        pass
    with open(flag) as f:
        say("stopped", step=int(f.read()), signal=signal_name)  # the step agreed on
    sys.exit(75)
signal.signal(signal.SIGTERM, lambda *_: stop("SIGTERM"))
say("training", step=0, total_steps=10)
while step < 10:
    time.sleep(0.2)
    step += 1
    say("progress", step=step, total_steps=10, loss=1.0 / step)
    if os.path.exists(flag):
        stop("peer")
    if attempt == "1" and task == "worker:1" and step == 5 and os.environ.get("SELF_TERM"):
        os.kill(os.getpid(), signal.SIGTERM)
    if os.environ.get("FOREVER"):
        step = min(step, 8)
say("finished", metrics={}, model_path="")
"""


def make(tmp_path: Path, script: str, env: dict[str, str], grace: float = 20) -> Path:
    (tmp_path / "job.py").write_text(textwrap.dedent(script))
    (tmp_path / "flags").mkdir()
    lines = "".join(f"  {k}: '{v}'\n" for k, v in {"FLAGS": str(tmp_path / "flags"), **env}.items())
    path = tmp_path / "c.yaml"
    path.write_text(
        f"name: stops\nworkers: 2\nworkdir: {tmp_path}\njob:\n  command: python job.py\n"
        "retry: {max_restarts: 2, backoff_initial_s: 0.1, backoff_max_s: 0.2}\n"
        f"timeouts: {{startup_s: 60, stop_grace_s: {grace}}}\nenv:\n" + lines)
    return path


def test_a_sigterm_from_outside_saves_every_task_at_one_step_and_resumes(tmp_path: Path) -> None:
    path = make(tmp_path, SAVES_ON_TERM, {"SELF_TERM": "1"})
    s = spec.load(path)
    store = Store()
    sup = Supervisor(s, LocalProvider(s, path), store, workdir=tmp_path,
                     backoff_sleep=lambda _: None, poll_s=0.05)
    run_id = store.new_run(s.name)
    result = sup.run(run_id)

    assert result.status == "succeeded"
    first, second = store.attempts(run_id)
    assert (first.cause, first.failed_task, first.exit_code) == ("preempted", "worker:1", 75)
    assert "worker:1 on local-1 got SIGTERM" in first.detail
    assert "every task saved a checkpoint at step 5 and exited" in first.detail
    # Both exited on their own with the saved-stop code (recorded by the launch wrapper, which
    # outlives the TERM): the survivor was given its grace, not killed.
    assert {t.task: t.exit_code for t in first.tasks} == {"worker:0": 75, "worker:1": 75}
    stops = {t.task: [e.get("signal") for e in map(parse_line, Path(t.log).read_text()
                                                      .splitlines()) if e and e.kind == "stopped"]
             for t in first.tasks}
    assert stops == {"worker:0": ["peer"], "worker:1": ["SIGTERM"]}
    assert second.status == "succeeded"


# worker:1 crashes at step 3; worker:0 notes any SIGTERM it gets and keeps running.
CRASH_AND_A_PATIENT_PEER = """
import os, signal, sys, time
task, attempt = os.environ["ORCHESTRATE_TASK"], os.environ["ORCHESTRATE_ATTEMPT"]
termed = os.path.join(os.environ["FLAGS"], "termed-" + task + "-" + attempt)
signal.signal(signal.SIGTERM, lambda *_: open(termed, "a").close())
if attempt == "1" and task == "worker:1":
    time.sleep(0.5)
    sys.exit(3)
if attempt == "1":
    time.sleep(120)
"""


def test_after_a_crash_the_survivors_are_killed_at_once_without_a_term(tmp_path: Path) -> None:
    path = make(tmp_path, CRASH_AND_A_PATIENT_PEER, {}, grace=60)
    s = spec.load(path)
    store = Store()
    sup = Supervisor(s, LocalProvider(s, path), store, workdir=tmp_path,
                     backoff_sleep=lambda _: None, poll_s=0.05)
    run_id = store.new_run(s.name)
    assert sup.run(run_id).status == "succeeded"
    first = store.attempts(run_id)[0]
    assert (first.cause, first.failed_task) == ("crashed", "worker:1")
    survivor = next(t for t in first.tasks if t.task == "worker:0")
    assert live_group_members(survivor.pgid) == []
    assert not (tmp_path / "flags" / "termed-worker:0-1").exists()  # KILL, no TERM, no grace


def test_down_mid_run_saves_at_one_step_and_train_resume_goes_on_from_there(
        tmp_path: Path, orchestrate_home: Path) -> None:
    path = make(tmp_path, SAVES_ON_TERM, {"FOREVER": "1"})
    training = {1: threading.Event(), 2: threading.Event()}
    # Both tasks must be past step 3, so both have their SIGTERM handler: 'down' while one of
    # them is still starting Python kills it with the default action (143), as CI once saw.
    at_step_3: dict[int, set[str]] = {1: set(), 2: set()}

    def listener(view: RunView, event: Event | None) -> None:
        if event is not None and event.kind == "progress" and event.get("step") >= 3:
            at_step_3[event.attempt].add(event.task)
            if len(at_step_3[event.attempt]) == 2:
                training[event.attempt].set()

    run = Cluster.from_spec(path).train(wait=False, doctor=False, listener=listener)
    assert training[1].wait(60)
    report = Cluster.from_spec(path).down()
    assert sorted(line.split()[-1] for line in report.stopped) == ["worker:0", "worker:1"]
    with pytest.raises(RunFailed, match="stopped by 'orchestrate down'"):
        run.wait(timeout=60)
    stopped = Store().get_run(run.id)
    assert stopped.status == "stopped" and stopped.attempts[0].status == "stopped"
    assert {t.exit_code for t in stopped.attempts[0].tasks} == {75}  # saved on TERM, not killed

    again = Cluster.from_spec(path).train(resume="last", doctor=False, wait=False,
                                          listener=listener)
    assert again.id == run.id
    assert training[2].wait(60)
    assert [a.number for a in again.status().attempts] == [1, 2]
    Cluster.from_spec(path).down()
    with pytest.raises(RunFailed):
        again.wait(timeout=60)
    assert Store().get_run(run.id).status == "stopped"


def test_resume_refuses_a_run_that_succeeded_or_does_not_exist(
        tmp_path: Path, orchestrate_home: Path) -> None:
    path = make(tmp_path, "print('done')\n", {})
    cluster = Cluster.from_spec(path)
    with pytest.raises(StateError, match="no stopped, cancelled or failed run"):
        cluster.train(resume="last", doctor=False)
    done = cluster.train(doctor=False).wait()
    with pytest.raises(StateError, match=f"run {done.run_id} is succeeded"):
        cluster.train(resume=done.run_id, doctor=False)
