"""TensorBoard logs: the chief's event files (worker/tensorboard.py) as TensorBoard itself loads
them, and where the spec sends them. (A real run's logs, a crash and its restart included, for
every managed runtime: tests/test_no_step_lost.py.)"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, scalar_steps, tensorboard_logs

from orchestrator import boards, plan, spec
from orchestrator.errors import SpecError
from orchestrator.hosts import Host
from orchestrator.remote.local import LocalRunner
from worker import tensorboard
from worker.tensorboard import Board, crc32c, learning_rate, record


def test_crc32c_is_castagnolis_and_records_are_framed_as_tfrecord() -> None:
    assert crc32c(b"123456789") == 0xE3069283  # the published check value
    assert crc32c(b"") == 0
    framed = record(b"abc")
    assert struct.unpack("<Q", framed[:8])[0] == 3 and framed[12:15] == b"abc"
    assert len(framed) == 8 + 4 + 3 + 4


def test_two_attempts_load_in_tensorboard_with_the_redone_steps_drawn_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = Board(str(tmp_path), every_steps=5, attempt=1)
    first.begin(0)
    for step in range(5, 31, 5):
        first.scalars(step, {"loss": 100.0 / step, "accuracy": step / 100}, 64, 0.01)
    first.close()
    # The crash after step 30; the relaunch resumes from the checkpoint at 20.
    monkeypatch.setenv(tensorboard.AFTER_ENV, "worker:1 crashed: exit 137 <b>**x**</b>")
    second = Board(str(tmp_path), every_steps=5, attempt=2)
    second.begin(20)
    for step in range(25, 41, 5):
        second.scalars(step, {"loss": 1.0 / step, "accuracy": step / 100}, 64, 0.01)
    second.close()

    logs = tensorboard_logs(tmp_path)
    # Steps 25 and 30 of attempt 1 were redone: TensorBoard keeps attempt 2's only.
    assert scalar_steps(logs, "train/loss") == [
        (5, 20.0), (10, 10.0), (15, pytest.approx(100 / 15)), (20, 5.0),
        (25, pytest.approx(1 / 25)), (30, pytest.approx(1 / 30)), (35, pytest.approx(1 / 35)),
        (40, pytest.approx(1 / 40))]
    assert [s for s, _ in scalar_steps(logs, "train/accuracy")] == [5, 10, 15, 20, 25, 30, 35, 40]
    assert [v for _, v in scalar_steps(logs, "train/learning_rate")] == [pytest.approx(0.01)] * 8
    steps_per_s = scalar_steps(logs, "speed/steps_per_s")
    examples_per_s = dict(scalar_steps(logs, "speed/examples_per_s"))
    assert steps_per_s and all(v > 0 for _, v in steps_per_s)
    assert all(examples_per_s[s] == pytest.approx(v * 64, rel=1e-5) for s, v in steps_per_s)
    assert scalar_steps(logs, "run/attempt") == [(0, 1.0), (20, 2.0)]
    marks = [(e.step, e.tensor_proto.string_val[0].decode()) for e in logs.Tensors("run/attempts")]
    # What a host said goes in a Markdown code block (the text plugin renders Markdown).
    assert marks == [(0, "attempt 1 began at step 0"), (20, "attempt 2 began at step 20, after:"
                      "\n\n    worker:1 crashed: exit 137 <b>**x**</b>")]


def test_a_board_that_cannot_write_turns_itself_off_with_one_warning(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    taken = tmp_path / "a-file"
    taken.write_text("")
    board = Board(str(taken / "tensorboard"), every_steps=1, attempt=1)
    assert not board.on
    board.begin(0)
    board.scalars(1, {"loss": 1.0}, 8)  # nothing raised: training goes on without its plots
    assert not board.due(1, 10)
    said = capsys.readouterr()
    assert said.err.count("TensorBoard log turned off") == 1 and str(taken) in said.err
    # and once as an event, which the controller shows
    (line,) = [line for line in said.out.splitlines() if '"event": "board"' in line]
    assert "TensorBoard log turned off: NotADirectoryError: " in line and str(taken) in line


# Steps 1..6 of a training under a Profile of steps 3-4 (JAX's profiler, in a process of its
# own: JAX's threads stay out of the test's), then one resumed inside the window, then one
# refused because a trace is already under way; what each said.
PROFILED = """
import sys, time
import jax, jax.numpy as jnp
from worker.tensorboard import Profile

def train(profile, first, last):
    for done in range(first, last):
        profile.before(done)
        (jnp.ones((64, 64)) @ jnp.ones((64, 64))).block_until_ready()
        profile.after(done + 1)
    profile.close()

assert Profile.from_env(chief=False, backend="jax") is None
train(Profile.from_env(chief=True, backend="jax"), 0, 6)
time.sleep(1.1)  # (a trace's directory is named by the second it began)
train(Profile.from_env(chief=True, backend="jax"), 3, 6)  # resumed after step 3
jax.profiler.start_trace(sys.argv[1])
train(Profile.from_env(chief=True, backend="jax"), 0, 6)
jax.profiler.stop_trace()
"""


def test_a_profile_traces_its_window_the_rest_of_it_once_resumed_and_says_when_refused(
        tmp_path: Path) -> None:
    board = tmp_path / "tb"
    env = {**os.environ, tensorboard.DIR_ENV: str(board), tensorboard.PROFILE_ENV: "3-4",
           "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", PROFILED, str(tmp_path / "other")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    said = [json.loads(line.split(" ", 1)[1])["message"] for line in done.stdout.splitlines()
            if line.startswith("@orchestrate ")]
    assert said[:2] == [
        f"steps 3-4 profiled into {board}/plugins/profile (TensorBoard's Profile tab)",
        f"steps 4-4 profiled into {board}/plugins/profile (TensorBoard's Profile tab)"]
    assert len(said) == 3 and said[2].startswith("steps 3-4 not profiled: "), said
    assert len(list(board.glob("plugins/profile/*/*.xplane.pb"))) == 2


def test_only_the_chief_writes_and_only_where_the_controller_said(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(tensorboard.DIR_ENV, raising=False)
    assert Board.from_env(chief=True) is None
    monkeypatch.setenv(tensorboard.DIR_ENV, str(tmp_path / "tb"))
    monkeypatch.setenv(tensorboard.EVERY_ENV, "4")
    monkeypatch.setenv("ORCHESTRATE_ATTEMPT", "3")
    assert Board.from_env(chief=False) is None
    board = Board.from_env(chief=True)
    assert board is not None and board.on and board.every_steps == 4 and board.attempt == 3
    assert [board.due(s, 10) for s in (3, 4, 8, 9, 10)] == [False, True, True, False, True]
    board.close()
    (name,) = os.listdir(tmp_path / "tb")
    assert name.startswith("events.out.tfevents.") and name.endswith(".a3")


class _Schedule:
    def __call__(self, step: int) -> float:
        return 0.1 / (1 + step)


class _Variable:
    def numpy(self) -> float:
        return 0.25


class _Optimizer:
    def __init__(self, rate: object) -> None:
        self.learning_rate, self.iterations = rate, 9


@pytest.mark.parametrize(("rate", "expected"), [
    (0.5, 0.5), (_Schedule(), 0.01), (_Variable(), 0.25), ("not a number", None), (None, None)])
def test_the_learning_rate_is_read_as_the_optimizer_says_it_or_left_out(
        rate: object, expected: float | None) -> None:
    assert learning_rate(_Optimizer(rate)) == (None if expected is None
                                               else pytest.approx(expected))


SPEC = "name: demo\nworkers: 2\njob: {job}\n"
HOSTS = [Host(f"local-{i}", "127.0.0.1", "/home/u/.orchestrate/clusters/demo") for i in range(2)]


def env_of(text: str) -> dict[str, str]:
    built = plan.build(spec.parse(text), HOSTS, run_id="r1", python="/venv/bin/python",
                       local_workdir="/proj")
    envs = [t.env for t in built.tasks]
    assert all({k: v for k, v in e.items() if "TENSORBOARD" in k} ==
               {k: v for k, v in envs[0].items() if "TENSORBOARD" in k} for e in envs)
    return envs[0]


def test_the_logs_go_to_the_runs_directory_or_under_tensorboard_dir() -> None:
    env = env_of(SPEC.format(job="{module: m, progress_every_steps: 5}"))
    assert env["ORCHESTRATE_TENSORBOARD_DIR"] == \
        "/home/u/.orchestrate/clusters/demo/runs/r1/tensorboard"
    assert env["ORCHESTRATE_TENSORBOARD_EVERY"] == "5"
    env = env_of(SPEC.format(job="{module: m}") +
                 "tensorboard: {dir: /mnt/shared/tb/, every_steps: 50}\n")
    assert env["ORCHESTRATE_TENSORBOARD_DIR"] == "/mnt/shared/tb/demo/r1"
    assert env["ORCHESTRATE_TENSORBOARD_EVERY"] == "50"
    env = env_of(SPEC.format(job="{command: python train.py}"))  # the script decides
    assert env["ORCHESTRATE_TENSORBOARD_DIR"].endswith("/runs/r1/tensorboard")
    assert "ORCHESTRATE_TENSORBOARD_EVERY" not in env
    env = env_of(SPEC.format(job="{module: m}") + "tensorboard: {enabled: false}\n")
    assert not any("TENSORBOARD" in k for k in env)
    env = env_of(SPEC.format(job="{module: m}") +
                 "tensorboard: {dir: 'gs://tb-bucket/logs/', profile_steps: [3, 5]}\n")
    assert env["ORCHESTRATE_TENSORBOARD_DIR"] == "gs://tb-bucket/logs/demo/r1"
    assert env["ORCHESTRATE_TENSORBOARD_PROFILE"] == "3-5"
    assert env_of(SPEC.format(job="{module: m}") + "tensorboard: {profile_steps: 7}\n")[
        "ORCHESTRATE_TENSORBOARD_PROFILE"] == "7-7"


@pytest.mark.parametrize(("job", "board", "said"), [
    ("{module: m}", "{profile_steps: [5, 3]}", "tensorboard.profile_steps: [5, 3] is not a window"),
    ("{module: m}", "{profile_steps: [0, 3]}", "tensorboard.profile_steps: [0, 3] is not a window"),
    ("{module: m}", "{profile_steps: [1, 101]}", "traces 101 steps"),
    ("{module: m}", "{profile_steps: 3, enabled: false}", "enabled is false"),
    ("{module: m, epochs: 1, steps_per_epoch: 20}", "{profile_steps: [21, 22]}",
     "profile_steps begins at step 21, and the job trains 20 steps"),
    ("{command: python train.py}", "{profile_steps: [2, 3]}",
     "a command job's script profiles itself"),
])
def test_a_profile_window_that_cannot_be_traced_is_refused_with_its_fix(
        job: str, board: str, said: str) -> None:
    with pytest.raises(SpecError) as caught:
        spec.parse(SPEC.format(job=job) + f"tensorboard: {board}\n")
    assert said in str(caught.value) and "fix: " in str(caught.value), str(caught.value)


@pytest.mark.parametrize(("value", "said"), [
    ("s3://bucket/tb", "is not a gs://BUCKET/PATH URL"), ("logs/tb", "is relative"),
    (0, "valid string")])
def test_a_tensorboard_dir_that_cannot_work_is_refused_naming_the_field(
        value: object, said: str) -> None:
    with pytest.raises(SpecError) as caught:
        spec.parse(SPEC.format(job="{module: m}") + f"tensorboard: {{dir: {value}}}\n")
    assert "tensorboard.dir" in str(caught.value) and said in str(caught.value)


def test_the_copy_takes_event_files_at_any_depth_new_or_grown_and_nothing_else(
        tmp_path: Path) -> None:
    """What a host lists is the host's to say: only event files' paths are followed."""
    host_dir, here = tmp_path / "on-host", tmp_path / "here"
    (host_dir / "train").mkdir(parents=True)
    ours = host_dir / "events.out.tfevents.1795.host.12.a1"
    keras = host_dir / "train" / "events.out.tfevents.1795.host.12.0.v2"
    ours.write_bytes(b"a" * 10)
    keras.write_bytes(b"b" * 20)
    trace = host_dir / "plugins" / "profile" / "2026_11_29_06_22_16" / "vm.xplane.pb"
    trace.parent.mkdir(parents=True)
    trace.write_bytes(b"c" * 30)
    (trace.parent / "vm.trace.json.gz").write_bytes(b"d")  # JAX's second copy: not needed
    for other in ("notes.txt", "events.out.tfevents.$(touch pwned)", ".hidden-events"):
        (host_dir / other).write_text("x")
    (host_dir / ".sneaky").mkdir()
    (host_dir / ".sneaky" / "events.out.tfevents.1.x").write_text("x")
    runner = LocalRunner("chief-host")
    assert boards._pull(runner, str(host_dir), here) == 3
    assert sorted(str(p.relative_to(here)) for p in here.rglob("*") if p.is_file()) == [
        ours.name, "plugins/profile/2026_11_29_06_22_16/vm.xplane.pb", f"train/{keras.name}"]
    assert boards._pull(runner, str(host_dir), here) == 0  # nothing new, nothing copied
    with ours.open("ab") as grown:
        grown.write(b"a")
    assert boards._pull(runner, str(host_dir), here) == 1
    assert (here / ours.name).read_bytes() == b"a" * 11
    assert boards._pull(runner, str(tmp_path / "never-written"), here) == 0
    assert not (tmp_path / "pwned").exists() and not Path("pwned").exists()
