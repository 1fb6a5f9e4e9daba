"""The spec loader: good files load, bad ones give one line naming file, line, field and fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator import spec
from orchestrator.errors import SpecError

REPO = Path(__file__).resolve().parent.parent
GOOD = """\
name: demo
workers: 2
job:
  module: examples.digits
"""


def write(tmp_path: Path, text: str, name: str = "cluster.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_minimal_spec_gets_defaults_and_managed_mode() -> None:
    s = spec.parse(GOOD)
    assert s.name == "demo"
    assert s.workers == 2 and s.num_tasks == 2
    assert isinstance(s.job, spec.ManagedJob)
    assert s.job.module == "examples.digits"
    assert s.provider.kind == "local"
    assert s.retry.max_restarts == 3


def test_command_job_string_is_split_into_words() -> None:
    s = spec.parse("name: c\njob:\n  command: python train.py --flag 'a b'\n")
    assert isinstance(s.job, spec.CommandJob)
    assert s.job.command == ("python", "train.py", "--flag", "a b")


def test_separate_chief_adds_a_task() -> None:
    s = spec.parse(GOOD + "separate_chief: true\n")
    assert s.num_tasks == 3


@pytest.mark.parametrize(
    ("text", "field", "line", "says", "fix"),
    [
        (GOOD + "wrkers: 3\n", "wrkers", 5, "unknown key 'wrkers'", "did you mean 'workers'?"),
        (GOOD + "  epoch: 3\n", "job.epoch", 5, "unknown key 'epoch'", "did you mean 'epochs'?"),
        (GOOD.replace("workers: 2", "workers: two"), "workers", 2, "received 'two'",
         "write a whole number"),
        (GOOD.replace("workers: 2", "workers: -1"), "workers", 2, "greater than or equal to 1",
         "use a larger value"),
        (GOOD.replace("name: demo", "name: My_Cluster"), "name", 1, "not a valid name", None),
        (GOOD + "provider: {kind: gce}\n", "provider.kind", 5, "unknown value 'gce'", "'local'"),
        (GOOD + "env: {TF_CONFIG: x}\n", "env", 5, "set by the orchestrator", None),
        (GOOD + "ports: {start: 3000, end: 2000}\n", "ports", 5, "must be >= start", None),
        ("workers: 2\njob: {module: m}\n", "name", None, "required field is missing",
         "add 'name:' to the top level"),
        ("name: x\njob:\n  command: python 'unterminated\n", "job.command", 3,
         "cannot split into words", None),
    ],
)
def test_bad_spec_names_file_line_field_and_fix(
    text: str, field: str, line: int | None, says: str, fix: str | None
) -> None:
    with pytest.raises(SpecError) as info:
        spec.parse(text, file="cluster.yaml")
    err = info.value
    assert err.file == "cluster.yaml"
    assert err.field == field
    assert err.line == line
    assert says in str(err)
    if fix is not None:
        assert err.fix is not None and fix in err.fix
    where = f"cluster.yaml:{line}: " if line else "cluster.yaml: "
    assert str(err).startswith(where + field + ": ")


def test_invalid_yaml_reports_its_line() -> None:
    with pytest.raises(SpecError) as info:
        spec.parse("name: x\njob: a: b\n", file="c.yaml")
    assert info.value.line == 2 and "not valid YAML" in str(info.value)


def test_missing_entrypoint_module_is_named_with_where_it_was_looked_for(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD.replace("examples.digits", "models.mnist_cnn"))
    with pytest.raises(SpecError) as info:
        spec.load(path)
    err = info.value
    assert err.field == "job.module" and err.line == 4
    assert "models/mnist_cnn.py" in str(err) and str(tmp_path) in str(err)


def test_module_found_as_file_or_package(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "flat.py").write_text("")
    assert spec.load(write(tmp_path, GOOD.replace("examples.digits", "pkg"))).job
    assert spec.load(write(tmp_path, GOOD.replace("examples.digits", "flat"))).job


def test_missing_workdir_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="workdir"):
        spec.load(write(tmp_path, GOOD + "workdir: nowhere\n"))


def test_missing_file_is_a_spec_error(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="no such file"):
        spec.load(tmp_path / "absent.yaml")


def test_example_specs_validate() -> None:
    for path in sorted((REPO / "cluster_specs").glob("*.yaml")):
        assert spec.load(path).name


@pytest.mark.parametrize(
    "text",
    [GOOD + "wrkers: 3\n", GOOD.replace("workers: 2", "workers: -4"), "name: x\njob: {mode: x}\n"],
)
def test_validate_command_prints_one_error_without_traceback(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, text)
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "validate", str(path)],
        capture_output=True, text=True, cwd=REPO,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr + proc.stdout
    first = proc.stderr.splitlines()[0]
    assert first.startswith(f"error: {path}:") and "fix:" in proc.stderr


def test_validate_command_accepts_the_example() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "validate", "cluster_specs/local.yaml"],
        capture_output=True, text=True, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    assert "ok: cluster 'digits-local'" in proc.stdout
