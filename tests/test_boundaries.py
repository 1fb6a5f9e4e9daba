"""The layering holds: the controller's modules import only downwards (cli -> api -> supervisor ->
providers/remote -> plan/spec/state), the controller never imports TensorFlow, the worker never
imports the controller's SSH or cloud packages, and ruff and mypy pass on both."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

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


# The controller's layers, top to bottom. A module imports (at run time; type-only imports are
# free) only from layers below its own, or from its own package (providers.*, remote.*, ...).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("__main__",),
    ("orchestrator", "cli"),
    ("api",),
    ("console",),
    ("supervisor", "doctor", "kept_pass"),
    ("watch", "checkpoints", "warm", "boards", "history", "metrics"),
    ("launchers",),
    ("containers",),
    ("cost",),
    ("providers",),
    ("early_claim",),
    ("holder",),
    ("remote", "plan", "elastic"),
    ("runtimes", "secrets"),
    ("view", "charts"),
    ("spec", "state", "events"),
    ("errors", "paths", "causes", "hosts", "files", "problems"),
)
# Narrower rules on top of the order: the program reaches a kept cluster's hosts (the early
# claim) and then runs the CLI, nothing else; the CLI reaches the store only through the API (and, before
# importing it, a kept cluster's hosts through the early claim), and the displays see nothing of
# a run but its view model.
ONLY: dict[str, set[str]] = {
    "__main__": {"cli", "early_claim"},
    "cli": {"api", "console", "errors", "spec", "early_claim"},
    "console": {"view", "charts"},
}


def runtime_imports(path: Path) -> set[str]:
    """Modules of the orchestrator that ``path`` imports when it runs (not under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    type_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                 and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
                 for n in ast.walk(node)}
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module == "orchestrator":
            names |= {f"orchestrator.{a.name}" for a in node.names}  # from orchestrator import plan
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return {n for n in names if n == "orchestrator" or n.startswith("orchestrator.")}


def unit(module: str) -> str:
    """The layer unit of a dotted module: its first name below ``orchestrator``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def layer_of(name: str) -> int:
    for depth, names in enumerate(LAYERS):
        if name in names:
            return depth
    raise AssertionError(f"orchestrator/{name} is in no layer: add it to LAYERS in {__file__}")


def violations(path: Path, module: str) -> list[str]:
    """The imports of ``path`` (the source of orchestrator ``module``) that break the layering."""
    found = []
    mine = unit(module)
    for imported in sorted(runtime_imports(path)):
        theirs = unit(imported)
        if theirs == mine or imported == "orchestrator" or (mine, theirs) == ("orchestrator", "cli"):
            continue
        if layer_of(theirs) <= layer_of(mine):
            found.append(f"{module} imports {imported}: not below it")
        if mine in ONLY and theirs not in ONLY[mine]:
            found.append(f"{module} may import only {sorted(ONLY[mine])}, not {imported}")
    return found


def test_controller_modules_import_only_from_the_layers_below() -> None:
    found = []
    for path in sorted((REPO / "orchestrator").rglob("*.py")):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        found += violations(path, module)
    assert found == []


@pytest.mark.parametrize(("module", "source", "problem"), [
    ("orchestrator.state", "from orchestrator.supervisor import Supervisor\n", "not below it"),
    ("orchestrator.providers.local", "import orchestrator.api\n", "not below it"),
    ("orchestrator.cli", "def f() -> None:\n    from orchestrator.state import Store\n",
     "may import only"),
    ("orchestrator.console", "from orchestrator.plan import build\n", "may import only"),
])
def test_the_layer_check_refuses_an_import_against_the_order(
        tmp_path: Path, module: str, source: str, problem: str) -> None:
    path = tmp_path / "module.py"
    path.write_text(f"from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                    f"    from orchestrator.api import Cluster\n{source}")
    (found,) = violations(path, module)
    assert problem in found


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


# What the CLI's start never imports: a command that needs one imports it where it does.
NOT_AT_THE_START = ("tensorflow", "paramiko", "google.cloud.compute_v1")


def test_cli_help_starts_without_tensorflow_ssh_or_cloud() -> None:
    code = (
        "import sys\nfrom orchestrator import cli\n"
        f"print(sorted(n for n in {NOT_AT_THE_START!r} if n in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.stdout.strip() == "[]", proc.stderr


def test_the_clis_start_imports_no_tensorflow_ssh_or_cloud_and_leaves_the_collector_on() -> None:
    """main() imports the controller with the collector off (its full passes cost every start
    0.04 to 0.09 s), then freezes what the imports made and turns the collector back on: the
    command (a training of days) runs with it."""
    code = (
        "import gc, sys\nfrom orchestrator import cli\ncli._import_the_controller()\n"
        f"print(sorted(n for n in {NOT_AT_THE_START!r} if n in sys.modules), "
        "'orchestrator.api' in sys.modules, gc.isenabled(), "
        "gc.get_freeze_count() > 10000)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.stdout.strip() == "[] True True True", proc.stdout + proc.stderr


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


# Import names whose distribution is not found by ``packages_distributions`` alone: the
# ``google`` namespace is shared by many distributions, so those go by their second name.
NAMESPACE_DISTRIBUTIONS = {"google.cloud": "google-cloud-compute", "google.auth": "google-auth",
                           "google.api_core": "google-api-core"}
# The orchestrator's optional extras (plot: matplotlib) are imported lazily, where used, with an
# error that names the extra when missing (tests/test_history.py).
# Imported only where the user already has them: the live view in a Jupyter kernel.
PROVIDED_BY_THE_USER = {"ipython"}


def third_party_imports(package: str) -> dict[str, str]:
    """Every non-stdlib import of ``package`` (including lazy and type-only ones): name -> file."""
    found: dict[str, str] = {}
    for path, names in imported_modules(package).items():
        for name in names:
            top = name.split(".")[0]
            if top in sys.stdlib_module_names or top in ("orchestrator", "worker", "__future__"):
                continue
            found[".".join(name.split(".")[:2]) if top == "google" else top] = path
    return found


def declared(*groups: str) -> set[str]:
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    specs = list(meta["dependencies"]) + [d for g in groups for d in meta["optional-dependencies"][g]]
    return {normalized(re.split(r"[<>=~!;\[ ]", d, maxsplit=1)[0]) for d in specs}


def normalized(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def distribution(name: str) -> str:
    if name in NAMESPACE_DISTRIBUTIONS:
        return NAMESPACE_DISTRIBUTIONS[name]
    dists = importlib.metadata.packages_distributions().get(name, [])
    assert dists, f"no installed distribution provides {name!r}"
    return normalized(dists[0])


@pytest.mark.parametrize(("package", "groups"),
                         [("orchestrator", ("plot",)), ("worker", ("worker", "jax"))])
def test_every_package_the_code_imports_is_declared(package: str, groups: tuple[str, ...]) -> None:
    wanted = {distribution(name): path for name, path in third_party_imports(package).items()}
    missing = {dist: path for dist, path in wanted.items()
               if dist not in declared(*groups) | PROVIDED_BY_THE_USER}
    assert missing == {}, "declare these in pyproject.toml"
