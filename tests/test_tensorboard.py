"""TensorBoard logs: the chief's event files (worker/tensorboard.py) as TensorBoard itself loads
them, and where the spec sends them. (A real run's logs, a crash and its restart included, for
every managed runtime: tests/test_no_step_lost.py.)"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
from helpers import scalar_steps, tensorboard_logs

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
    err = capsys.readouterr().err
    assert err.count("TensorBoard log turned off") == 1 and str(taken) in err


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


@pytest.mark.parametrize(("value", "said"), [
    ("gs://bucket/tb", "is a URL"), ("logs/tb", "is relative"), (0, "valid string")])
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
    for other in ("notes.txt", "events.out.tfevents.$(touch pwned)", ".hidden-events"):
        (host_dir / other).write_text("x")
    (host_dir / ".sneaky").mkdir()
    (host_dir / ".sneaky" / "events.out.tfevents.1.x").write_text("x")
    runner = LocalRunner("chief-host")
    assert boards._pull(runner, str(host_dir), here) == 2
    assert sorted(str(p.relative_to(here)) for p in here.rglob("*") if p.is_file()) == [
        ours.name, f"train/{keras.name}"]
    assert boards._pull(runner, str(host_dir), here) == 0  # nothing new, nothing copied
    with ours.open("ab") as grown:
        grown.write(b"a")
    assert boards._pull(runner, str(host_dir), here) == 1
    assert (here / ours.name).read_bytes() == b"a" * 11
    assert boards._pull(runner, str(tmp_path / "never-written"), here) == 0
    assert not (tmp_path / "pwned").exists() and not Path("pwned").exists()
