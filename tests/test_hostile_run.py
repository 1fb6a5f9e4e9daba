"""A run against what its tasks, its listeners and its user throw at it: bad event lines, a
listener that raises, rich markup in names, paths and output, a failing store, Ctrl-C in the
middle of a launch or of `up`. Nothing crashes the controller, and the run's record stays true.
Command-mode jobs on the local provider: real processes, no TensorFlow."""

from __future__ import annotations

import glob
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers import as_from_a_terminal
from rich.console import Console

from orchestrator import cli
from orchestrator.api import Cluster
from orchestrator.console import RunFrame, summary
from orchestrator.errors import ProviderError, RunFailed
from orchestrator.events import MAX_EVENT_CHARS, PREFIX, BadEvent, BadEventNotes, read_line
from orchestrator.providers.local import LocalProvider
from orchestrator.remote.base import LaunchSpec
from orchestrator.remote.local import LocalRunner, live_group_members
from orchestrator.state import Store, TaskRecord
from orchestrator.view import RunResult, RunView, TaskView

REPO = Path(__file__).resolve().parent.parent
MARKUP = "[/] [red]x[/red] [link=http://x]y[/link] [bold"


# -- helpers -----------------------------------------------------------------------------------
def write_spec(directory: Path, name: str, script: str, extra: str = "", workers: int = 1) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "job.py").write_text(textwrap.dedent(script))
    spec = directory / "c.yaml"
    spec.write_text(f"name: {name}\nworkers: {workers}\njob: {{command: python job.py}}\n"
                    "retry: {max_restarts: 0}\ntimeouts: {stop_grace_s: 1}\n" + extra)
    return spec


def main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``orchestrate ARGS`` in this process, as its entry point runs it: (exit code, out, err)."""
    capsys.readouterr()
    argv = sys.argv
    sys.argv = ["orchestrate", *args]
    try:
        cli.main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.argv = argv
    out, err = capsys.readouterr()
    return code, out, err


def task_groups(home: Path) -> set[int]:
    """Every task group the launch wrapper started under ``home`` (its pid file = its pgid)."""
    found = set()
    for path in glob.glob(f"{home}/clusters/*/runs/*/logs/*/*.pid"):
        text = Path(path).read_text().strip()
        if text.isdigit():
            found.add(int(text))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X", "x")


def kill_groups(groups: set[int]) -> None:
    """Clean up after a failed test: only the task groups this test's controller started."""
    for pgid in groups:
        if live_group_members(pgid):
            os.killpg(pgid, signal.SIGKILL)


def status_json(home: Path, name: str) -> dict:  # type: ignore[type-arg]
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", "status", name, "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "ORCHESTRATE_HOME": str(home)})
    assert proc.returncode == 0, proc.stderr
    cluster: dict = json.loads(proc.stdout)["clusters"][0]  # type: ignore[type-arg]
    return cluster


# -- 1. bad event lines: what the parser makes of them -------------------------------------------
def _generated() -> list[tuple[str, str, str]]:
    """(line, kind, topic): every typed field of the events the controller reads, given a value
    of a wrong type or out of range."""
    wrong = {"int": ['"abc"', "[1]", '{"a": 1}', "true", "2.5", "1e300", "-1"],
             "float": ['"x"', "[1]", '{"a": 1}', "false", "1e400"],
             "text": ["[1]", '{"a": 1}', "true"]}
    fields = [("progress", "step", "int"), ("progress", "total_steps", "int"),
              ("progress", "loss", "float-any"), ("progress", "steps_per_s", "float"),
              ("checkpoint", "step", "int"), ("stopped", "step", "int"),
              ("training", "step", "int"), ("started", "pid", "int"),
              ("connected", "replicas", "int"), ("connected", "local_replicas", "int"),
              ("built", "learning_rate", "float"), ("built", "global_batch_size", "int"),
              ("error", "message", "text"), ("error", "traceback", "text"),
              ("finished", "model_path", "text"), ("warm_unusable", "reason", "text")]
    cases = []
    for kind, name, of in fields:
        values = wrong["float"][:-1] if of == "float-any" else wrong[of]
        for value in values:
            step = "" if name == "step" or kind not in ("progress", "checkpoint", "stopped",
                                                         "training") else '"step": 1, '
            cases.append((f'{{"event": "{kind}", {step}"{name}": {value}}}', kind, name))
    return cases


BAD_LINES = [
    ('{"event": "progress", "step": "abc"}', "progress", "step"),
    ('{"event":"checkpoint","step":null}', "checkpoint", "step"),
    ('{"event":"progress"}', "progress", "step"),
    ('{"event": "started", "pid": [1]}', "started", "pid"),
    ('{"event":"progress","attempt":"x","step":1}', "progress", "attempt"),
    ('{"event":"progress","attempt":1e9,"step":1}', "progress", "attempt"),
    ('{"event": 5}', "", "event"),
    ('{"event": "a b"}', "", "event"),
    ('{"step": 1}', "", "event"),
    ('{"event":"progress","loss":{"a":1},"step":1}', "progress", "loss"),
    ('{"event":"progress","metrics":{"acc":"high"},"step":1}', "progress", "metrics.acc"),
    ('{"event":"progress","metrics":[1],"step":1}', "progress", "metrics"),
    ('{"event":"epoch","time":1e400}', "epoch", "time"),
    ('{"event":"epoch","time":NaN}', "epoch", "time"),
    ('{"event":"epoch","time":-5}', "epoch", "time"),
    ('{"event":"progress","step":' + "9" * 5000 + "}", "", "json"),
    ('{"event":"custom","a":' + "[" * 100_000 + "]" * 100_000 + "}", "", "json"),
    ('{"event":"custom","a":' + "[" * 40 + "]" * 40 + "}", "custom", "depth"),
    ('{"event":"progress","step":1,"pad":"' + "x" * (MAX_EVENT_CHARS + 1) + '"}', "", "length"),
    ("not json", "", "json"),
    ('{"event": "progress", "step": 1', "", "json"),
    ("[1, 2]", "", "json"),
    ('"text"', "", "json"),
    ('{"event":"go","cold":"yes"}', "go", "cold"),
    ('{"event":"connected","replicas":0}', "connected", "replicas"),
    *_generated(),
]


@pytest.mark.parametrize(("line", "kind", "topic"), BAD_LINES,
                         ids=[f"{i}-{k or 'unnamed'}-{t}" for i, (_, k, t) in enumerate(BAD_LINES)])
def test_a_malformed_event_line_is_a_bad_event_with_its_reason(line: str, kind: str,
                                                              topic: str) -> None:
    found = read_line("output before it " + PREFIX + line)
    assert isinstance(found, BadEvent), found
    assert (found.kind, found.topic) == (kind, topic)
    assert found.reason and len(found.note("worker:0")) < 400
    assert topic.split(".")[0] in found.reason or topic in ("json", "length", "depth")


GOOD_LINES = [
    ('{"event":"progress","step":3.0,"total_steps":10,"loss":NaN,"metrics":{"acc":Infinity}}',
     {"step": 3, "total_steps": 10, "metrics": {"acc": float("inf")}}),
    ('{"event":"checkpoint","step":7,"epoch":null,"path":"/x"}', {"step": 7, "path": "/x"}),
    ('{"event":"error","message":"bad \\ud800 char","type":5}',
     {"message": "bad ? char", "type": "5"}),
    ('{"event":"finished","metrics":{},"model_path":null}', {"metrics": {}}),
    ('{"event":"custom.kind","anything":[1,{"b":"c"}]}', {"anything": [1, {"b": "c"}]}),
    ('{"event":"started","pid":12,"argv":["python","x.py"]}', {"pid": 12, "argv": ["python", "x.py"]}),
]


@pytest.mark.parametrize(("line", "fields"), GOOD_LINES)
def test_a_well_formed_event_has_typed_fields(line: str, fields: dict[str, object]) -> None:
    event = read_line(PREFIX + line)
    assert not isinstance(event, BadEvent) and event is not None, event
    got = {k: v for k, v in event.fields.items() if k != "loss"}
    assert got == fields


def test_bad_event_notes_are_once_per_kind_and_bounded() -> None:
    notes = BadEventNotes(limit=3)
    bad = [read_line(PREFIX + line) for line, _, _ in BAD_LINES]
    shown = [n for b in bad + bad if isinstance(b, BadEvent) for n in [notes.note("worker:0", b)]
             if n is not None]
    assert len(shown) == 4 and shown[-1].startswith("more bad event lines (3 kinds shown)")


# -- 1 and 3, end to end: a task printing bad events and markup ---------------------------------
E2E_BAD = [
    ('{"event": "progress", "step": "abc"}', "'progress' event", "'step' must be an integer"),
    ('{"event":"checkpoint","step":null}', "'checkpoint' event", "'step' is missing or null"),
    ('{"event": "started", "pid": [1]}', "'started' event", "'pid' must be an integer"),
    ('{"event":"progress","attempt":"x","step":1}', "'progress' event",
     "'attempt' must be an integer"),
    ('{"event": 5}', "event line", "'event' must be a name"),
    ('{"event":"progress","loss":{"a":1},"step":2}', "'progress' event",
     "'loss' must be a number"),
    ('{"event":"epoch","time":1e400}', "'epoch' event", "'time' must be a finite number"),
    ('{"event":"custom","a":' + "[" * 100_000 + "]" * 100_000 + "}", "event line",
     "not JSON (nested too deep)"),
]
# Printed too, each a second case of a kind above (not noted again) or a good event.
E2E_MORE = [
    '{"event":"progress","step":1e300}',
    '{"event":"progress","step":"def"}',
    '{"event":"custom","x":' + "[" * 30_000 + "]" * 30_000 + "}",
    '{"event":"progress","step":4,"total_steps":8,"loss":NaN,"metrics":{"acc":0.5}}',
    '{"event":"error","task":"worker:0","message":"\\ud800 ' + MARKUP + '","phase":"train"}',
]
BAD_JOB = """
import os, sys
if os.environ["ORCHESTRATE_TASK"] == "worker:1":  # one line of 10 MB, then the rest
    sys.stdout.write("@orchestrate " + '{"event":"progress","step":1,"pad":"' + "x" * (10 << 20)
                     + '"}\\n')
    sys.stdout.flush()
    sys.exit(0)
out = sys.stdout.buffer
out.write(open(os.environ["LINES_FILE"], "rb").read())
out.write(b"@orchestrate {\\"event\\":\\"progress\\",\\"step\\":\\xff\\xfe}\\n")  # not UTF-8
out.write(b"plain output \\xff\\xfe " + os.environ["MARKUP"].encode() + b"\\n")
out.flush()
"""


@pytest.fixture(scope="module")
def bad_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, str]]:
    """One `orchestrate train` whose worker:0 prints every line above and worker:1 a 10 MB
    event line; then `orchestrate logs` and `status`: (train's output, logs', run status)."""
    base = tmp_path_factory.mktemp("bad-events")
    home = base / "home"
    lines = base / "lines.txt"
    lines.write_text("".join(f"{PREFIX}{line}\n" for line, _, _ in E2E_BAD)
                     + "".join(f"{PREFIX}{line}\n" for line in E2E_MORE))
    spec = write_spec(base / "job", "bad-events", BAD_JOB, workers=2,
                      extra=f"env: {json.dumps({'LINES_FILE': str(lines), 'MARKUP': MARKUP})}\n")
    env = {**os.environ, "ORCHESTRATE_HOME": str(home)}
    try:
        train = subprocess.run([sys.executable, "-m", "orchestrator.cli", "train", str(spec),
                                "--no-doctor"], cwd=REPO, env=env, capture_output=True,
                               text=True, timeout=120)
        assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
        logs = subprocess.run([sys.executable, "-m", "orchestrator.cli", "logs", "bad-events",
                               "--task", "worker:0"], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=60)
        assert logs.returncode == 0, logs.stderr
        status = status_json(home, "bad-events")["runs"][0]["status"]
        yield train.stdout + train.stderr, logs.stdout + logs.stderr, status
    finally:
        kill_groups(task_groups(home))


@pytest.mark.parametrize(("line", "what", "reason"), E2E_BAD, ids=[r for _, _, r in E2E_BAD])
def test_a_task_printing_a_bad_event_line_gets_one_note_and_the_run_goes_on(
        bad_run: tuple[str, str, str], line: str, what: str, reason: str) -> None:
    output, _, status = bad_run
    notes = [n for n in output.splitlines() if f"worker:0 printed a bad {what}, ignored:" in n
             and reason in n]
    assert len(notes) == 1, output[-4000:]
    assert "Traceback" not in output
    assert status == "succeeded"


def test_every_kind_of_bad_line_is_noted_once_and_the_10_mb_line_too(
        bad_run: tuple[str, str, str]) -> None:
    output, _, _ = bad_run
    notes = [n for n in output.splitlines() if " printed a bad " in n]
    assert len(notes) == len(E2E_BAD) + 1, "\n".join(notes)  # + worker:1's 10 MB line
    assert any(n.startswith("[bad-events] worker:1 printed a bad event line, ignored: the "
                            "line is ") for n in notes)
    assert all(len(n) < 500 for n in notes)


def test_bad_lines_and_markup_in_a_tasks_output_print_as_they_are(
        bad_run: tuple[str, str, str]) -> None:
    output, logs, _ = bad_run
    assert f"[worker:0] error: : ? {MARKUP}" in output.splitlines()
    assert f"[worker:0] plain output \ufffd\ufffd {MARKUP}" in logs.splitlines()
    assert f'[worker:0] {PREFIX}{{"event": 5}}' in logs.splitlines()
    assert "Traceback" not in logs


# -- 2. a listener's error never ends a run; a Ctrl-C in it does, recorded ----------------------
def boom_always(view: RunView, event: object) -> None:
    raise ValueError("boom")


def boom_on_started(view: RunView, event: object) -> None:
    if getattr(event, "kind", "") == "started":
        raise RuntimeError("bad listener")


def ctrl_c_on_started(view: RunView, event: object) -> None:
    if getattr(event, "kind", "") == "started":
        raise KeyboardInterrupt


def exit_on_started(view: RunView, event: object) -> None:
    if getattr(event, "kind", "") == "started":
        sys.exit(3)


LISTENERS = [  # (listener, what train raises, the run's end, the one report on stderr)
    (boom_always, None, "succeeded", "ValueError: boom"),
    (boom_on_started, None, "succeeded", "RuntimeError: bad listener"),
    (ctrl_c_on_started, KeyboardInterrupt, "cancelled", ""),
    (exit_on_started, SystemExit, "cancelled", ""),
]


@pytest.mark.parametrize(("listener", "raised", "status", "report"), LISTENERS,
                         ids=[f.__name__ for f, *_ in LISTENERS])
def test_a_listeners_error_is_reported_once_and_only_an_interrupt_ends_the_run(
        tmp_path: Path, orchestrate_home: Path, capsys: pytest.CaptureFixture[str],
        listener: Callable[[RunView, object], None], raised: type[BaseException] | None,
        status: str, report: str) -> None:
    nap = 0.3 if raised is None else 30  # an interrupted run's tasks are still running
    spec = write_spec(tmp_path, "listener", f"import time\ntime.sleep({nap})\n", workers=2)
    cluster = Cluster.from_spec(spec)
    try:
        if raised is None:
            cluster.train(listener=listener, doctor=False)
        else:
            with pytest.raises(raised):
                cluster.train(listener=listener, doctor=False)
    finally:
        kill_groups(groups := task_groups(orchestrate_home))
    err = capsys.readouterr().err
    reports = [line for line in err.splitlines() if "the listener" in line]
    if report:
        assert reports == [f"orchestrate: the listener {listener.__module__}."
                           f"{listener.__qualname__} raised {report}; the run goes on (its later "
                           "errors are not reported)"]
    else:
        assert reports == []
    run = cluster.store.runs("listener")[0]
    assert run.status == status and [a.status for a in run.attempts] == [status]
    assert groups and not any(live_group_members(g) for g in groups)


# -- 3. markup in what the user or a host wrote prints literally ---------------------------------
def test_markup_in_paths_commands_and_home_prints_literally(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    home = tmp_path / "home [/] [red]"
    monkeypatch.setenv("ORCHESTRATE_HOME", str(home))
    directory = tmp_path / "[red]dir[/]" / "[link=http://x]y[/link]"
    directory.mkdir(parents=True)
    spec = directory / "c.yaml"
    spec.write_text(f"name: markup\nworkers: 1\njob:\n  command: \"python job.py --tag '{MARKUP}'\"\n")
    bad_host = tmp_path / "[bold" / "static.yaml"
    bad_host.parent.mkdir()
    bad_host.write_text(f"name: markup\nprovider: {{kind: static, hosts: [{{address: '{MARKUP}', "
                        "user: u, key_file: /k}]}\njob: {command: x}\n")
    commands = [
        (("validate", str(spec)), 0, f"{spec}: ok: cluster 'markup', provider local, 1 task(s), "
                                     f"command job (python job.py --tag {MARKUP})"),
        (("plan", str(spec)), 0, f"  command    {sys.executable} -m worker command -- "),
        (("up", str(spec)), 0, "up: 1 host(s)"),
        (("status",), 0, f"markup (local) up, spec {spec.resolve()}"),
        (("status", MARKUP), 2, f"error: no cluster named '{MARKUP}'"),
        (("logs", MARKUP), 2, f"error: no cluster named '{MARKUP}'"),
        (("validate", str(bad_host)), 2, f"'{MARKUP}' is neither an IP address nor a valid "
                                         "host name"),
        (("down", str(spec)), 0, f"  run files are kept under {home}/clusters/markup"),
    ]
    for args, code, expected in commands:
        got, out, err = main(capsys, *args)
        assert (got, "Traceback" in out + err) == (code, False), (args, out, err)
        assert expected in out + err, (args, out, err)


def test_the_live_frame_and_summary_show_markup_literally() -> None:
    view = RunView(run_id="r1", cluster="c", attempt=2, total_steps=10,
                   messages=[f"a message {MARKUP}"])
    view.tasks = {"worker:0": TaskView("worker:0", f"host {MARKUP}", "e", state=MARKUP,
                                       last_event=MARKUP, loss=float("nan"))}
    result = RunResult(run_id="r1", status="succeeded", metrics={MARKUP: 0.5}, model_path=MARKUP,
                       digests={}, attempts=[], seconds=1.0)
    console = Console(record=True, width=200, color_system=None)
    console.print(RunFrame().render(view))
    summary(console, result)
    text = console.export_text()
    for expected in (f"host {MARKUP}", f"a message {MARKUP}", f"final {MARKUP}: 0.5000",
                     f"model saved by the chief: {MARKUP}", "nan"):
        assert expected in text, text


# -- 4. however the supervisor ends, the run's record says so -----------------------------------
class FailingStore(Store):
    """The state store failing under a running attempt (a full disk, an I/O error)."""

    def heartbeat(self, run_id: str) -> None:
        raise sqlite3.OperationalError("disk I/O error")


def test_a_store_error_mid_run_stops_the_tasks_and_records_the_run_failed(
        tmp_path: Path, orchestrate_home: Path) -> None:
    spec = write_spec(tmp_path, "store", "import time\ntime.sleep(30)\n", workers=2)
    try:
        with pytest.raises(RunFailed) as info:
            Cluster.from_spec(spec, store=FailingStore()).train(doctor=False)
    finally:
        kill_groups(groups := task_groups(orchestrate_home))
    assert "the controller stopped on an unexpected error: OperationalError: disk I/O error" in \
        info.value.message and "--debug" in (info.value.fix or "")
    run = Store().runs("store")[0]
    assert run.status == "failed" and "disk I/O error" in run.message
    assert [(a.status, len(a.tasks)) for a in run.attempts] == [("failed", 2)]
    assert "the controller failed: OperationalError" in run.attempts[0].detail
    assert groups and not any(live_group_members(g) for g in groups)


def _no_attempt(spec: Path) -> str:
    """A run whose controller died before it launched anything."""
    Cluster.from_spec(spec).up()
    return Store().new_run("orphan")


def _half_launched(spec: Path) -> str:
    """A run whose controller died launching attempt 1: worker:0 runs, worker:1 never started."""
    run_id = _no_attempt(spec)
    base = f"{spec.parent}/left/worker-0"
    handle = LocalRunner().start(LaunchSpec(("sleep", "60"), str(spec.parent), f"{base}.log",
                                            f"{base}.rc"))
    Store().start_attempt(run_id, 1, [TaskRecord("worker:0", "local-0", "127.0.0.1:1",
                                                 handle.pgid, f"{base}.log", f"{base}.rc")])
    return run_id


ORPHANS = [
    ("status", ("status", "orphan"), 0, "0 attempt(s), 0 restart(s), controller pid", None),
    ("logs", ("logs", "orphan"), 2, "has no attempt: none of its tasks was started", None),
    ("logs-attempt", ("logs", "orphan", "--attempt", "3"), 2, "has no attempt 3 (it has 0)",
     None),
    ("attach", ("train", "SPEC", "--attach"), 0, "has no attempt running to take over",
     ["succeeded"]),
    ("attach-half", ("train", "SPEC", "--attach"), 0, "has 1 of 2 tasks: its controller ended "
     "while launching it", ["cancelled", "succeeded"]),
]


@pytest.mark.parametrize(("case", "args", "code", "expected", "attempts"), ORPHANS,
                         ids=[c[0] for c in ORPHANS])
def test_commands_on_a_run_its_controller_left_without_attempts(
        tmp_path: Path, orchestrate_home: Path, capsys: pytest.CaptureFixture[str], case: str,
        args: tuple[str, ...], code: int, expected: str, attempts: list[str] | None) -> None:
    spec = write_spec(tmp_path, "orphan", "print('done')\n", workers=2)
    run_id = (_half_launched if case == "attach-half" else _no_attempt)(spec)
    left = task_groups(orchestrate_home) | {r.pgid for a in Store().attempts(run_id)
                                            for r in a.tasks}
    try:
        got, out, err = main(capsys, *[str(spec) if a == "SPEC" else a for a in args])
    finally:
        kill_groups(left | task_groups(orchestrate_home))
    assert (got, "Traceback" in out + err) == (code, False), out + err
    assert expected in out + err, out + err
    run = Store().get_run(run_id)
    if attempts is not None:
        assert run.status == "succeeded" and [a.status for a in run.attempts] == attempts
        assert not any(live_group_members(g) for g in left)
    else:
        assert run.status == "running" and run.attempts == []


def test_down_stops_the_tasks_of_an_attempt_a_second_ctrl_c_left_running(
        tmp_path: Path, orchestrate_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = write_spec(tmp_path, "orphan", "print('done')\n", workers=2)
    run_id = _half_launched(spec)
    Store().finish_run(run_id, status="cancelled", message="interrupted by the user (Ctrl-C)")
    (left,) = {r.pgid for a in Store().attempts(run_id) for r in a.tasks}
    try:
        got, out, err = main(capsys, "down", str(spec))
    finally:
        kill_groups({left})
    assert (got, "Traceback" in out + err) == (0, False), out + err
    assert f"  stopped {run_id} worker:0" in out.splitlines() and not live_group_members(left)
    run = Store().get_run(run_id)
    assert run.status == "cancelled" and [a.status for a in run.attempts] == ["stopped"]


# -- 5. Ctrl-C at any moment of a launch ---------------------------------------------------------
SLOW_START = """
import os, pathlib, time
time.sleep(0.3)
pathlib.Path(os.environ["PIDS"], os.environ["ORCHESTRATE_TASK"]).write_text(str(os.getpid()))
time.sleep(60)
"""
MOMENTS = [  # (what happened when the Ctrl-C comes, how many files of that kind exist)
    ("the first task's log file", "logs/*/*.log", 1),
    ("half the tasks' log files", "logs/*/*.log", 3),
    ("every task's own process", "pids/*", 6),
]


@pytest.mark.parametrize(("moment", "pattern", "count"), MOMENTS, ids=[m for m, _, _ in MOMENTS])
def test_ctrl_c_during_the_launch_stops_every_task_started_and_records_them(
        tmp_path: Path, orchestrate_home: Path, moment: str, pattern: str, count: int) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    spec = write_spec(tmp_path / "job", "hostile", SLOW_START, workers=6,
                      extra=f"env: {{PIDS: '{pids}'}}\n")
    runs = orchestrate_home / "clusters" / "hostile" / "runs" / "*"
    where = f"{runs}/{pattern}" if pattern.startswith("logs") else f"{pids}/*"
    # A terminal's Ctrl-C: SIGINT to the controller's whole process group (its launch scripts too).
    train = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "train", str(spec),
                              "--no-doctor"], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True,
                             preexec_fn=as_from_a_terminal,
                             env={**os.environ, "ORCHESTRATE_HOME": str(orchestrate_home)})
    try:
        deadline = time.monotonic() + 60
        while len(glob.glob(where)) < count:
            assert train.poll() is None and time.monotonic() < deadline, train.communicate()
            time.sleep(0.002)
        os.killpg(train.pid, signal.SIGINT)
        out, err = train.communicate(timeout=60)
    finally:
        if train.poll() is None:
            train.kill()
            train.wait()
        groups = task_groups(orchestrate_home)
        kill_groups(groups)
    assert train.returncode == 130, out + err
    assert "interrupted: every task of this run was stopped" in err.splitlines()
    assert "Traceback" not in out + err
    own = [int(p.read_text()) for p in pids.iterdir() if p.read_text().isdigit()]
    assert not any(live_group_members(g) for g in groups) and not any(map(alive, own))
    (run,) = status_json(orchestrate_home, "hostile")["runs"]
    assert run["status"] == "cancelled" and run["message"] == "interrupted by the user (Ctrl-C)"
    recorded = {t["log"] for a in run["attempts"] for t in a["tasks"]}
    started = {p[: -len(".pid")] + ".log" for p in glob.glob(f"{runs}/logs/*/*.pid")}
    assert [a["status"] for a in run["attempts"]] == ["cancelled"] and started <= recorded


# -- 6. Ctrl-C (or an error) inside `up` -------------------------------------------------------
UP_FAULTS = [
    (KeyboardInterrupt(), 130, "interrupted: 'orchestrate down FILE' removes whatever was "
     "already made", "interrupted"),
    (ProviderError("the cloud said no", fix="try later"), 2, "error: the cloud said no",
     "failed"),
]


@pytest.mark.parametrize(("fault", "code", "message", "status"), UP_FAULTS,
                         ids=["ctrl-c", "error"])
def test_an_interrupted_up_leaves_the_cluster_recorded_as_it_is(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        fault: BaseException, code: int, message: str, status: str) -> None:
    spec = write_spec(tmp_path, "upping", "print('ok')\n", workers=2)
    assert main(capsys, "up", str(spec))[0] == 0
    before = Store().get_cluster("upping")

    def interrupted(self: LocalProvider) -> list[object]:
        raise fault

    monkeypatch.setattr(LocalProvider, "up", interrupted)
    got, out, err = main(capsys, "up", str(spec))
    assert (got, "Traceback" in out + err) == (code, False) and message in err.splitlines()
    after = Store().get_cluster("upping")
    assert before is not None and after is not None
    assert (after.status, after.hosts) == (status, before.hosts)
    assert Store().runs("upping") == []
    assert main(capsys, "down", str(spec))[0] == 0
