"""The layering holds: the controller never imports TensorFlow, the worker never imports the
controller's SSH or cloud packages, and ruff and mypy pass on both."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def imported_modules(package: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in sorted((REPO / package).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
        found[str(path.relative_to(REPO))] = names
    return found


def offenders(package: str, forbidden: tuple[str, ...]) -> list[str]:
    return [
        f"{path}: {name}"
        for path, names in imported_modules(package).items()
        for name in names
        if name.split(".")[0] in forbidden or name.startswith(forbidden)
    ]


def test_orchestrator_source_never_imports_tensorflow_or_keras() -> None:
    assert offenders("orchestrator", ("tensorflow", "keras", "tf_keras")) == []


def test_worker_source_never_imports_ssh_cloud_or_controller_packages() -> None:
    assert offenders("worker", ("paramiko", "google.cloud", "orchestrator")) == []


def test_importing_every_controller_module_loads_no_tensorflow() -> None:
    code = (
        "import pkgutil, sys, orchestrator\n"
        "for m in pkgutil.walk_packages(orchestrator.__path__, 'orchestrator.'):\n"
        "    __import__(m.name)\n"
        "bad = sorted(n for n in sys.modules if n.split('.')[0] in ('tensorflow', 'keras', 'tf_keras'))\n"
        "print(bad)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_cli_help_starts_without_tensorflow_ssh_or_cloud() -> None:
    code = (
        "import sys\nfrom orchestrator import cli\n"
        "print(sorted(n for n in ('tensorflow', 'paramiko', 'google.cloud.compute_v1') "
        "if n in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.stdout.strip() == "[]", proc.stderr


@pytest.mark.parametrize(
    "command",
    [
        ["ruff", "check", "orchestrator", "worker", "examples", "tests"],
        ["mypy"],
    ],
    ids=["ruff", "mypy"],
)
def test_static_checks_pass(command: list[str]) -> None:
    tool = shutil.which(command[0], path=str(Path(sys.executable).parent)) or shutil.which(
        command[0])
    assert tool, f"{command[0]} is not installed: pip install -e '.[dev]'"
    proc = subprocess.run([tool, *command[1:]], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
