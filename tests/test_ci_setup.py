""".ci/run installs every Debian package the suite uses, by name: the programs the tests run
are each named here with their package, every such package is in .ci/run's list, and on a
Debian machine dpkg agrees on which package each program comes from.

A machine where the suite passed can hide a missing step: a package that came in with an
earlier install, or as a Recommends (catatonit, which podman's --init runs, is only that; .ci/run
installs with --no-install-recommends). These tests make a new program in a test fail here
until it is named with its package, and that package in .ci/run.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CI_RUN = REPO / ".ci" / "run"

# What the tests (and their fixtures: tests/hostlab.py, tests/containers.py) run, or what a
# program they run needs, with the Debian package that provides it. A path for a file that is
# not a program on PATH.
TOOLS = {
    "/usr/sbin/sshd": "openssh-server",
    "ssh-keygen": "openssh-client",
    "ip": "iproute2",
    "tc": "iproute2",
    "nsenter": "util-linux",
    "setsid": "util-linux",
    "unshare": "util-linux",
    "runuser": "util-linux",
    "setfacl": "acl",
    "getfacl": "acl",
    "useradd": "passwd",
    "userdel": "passwd",
    "chattr": "e2fsprogs",
    "iptables": "iptables",
    "podman": "podman",
    "runc": "runc",
    "conmon": "conmon",
    "/usr/libexec/podman/catatonit": "catatonit",  # podman's --init: a Recommends only
    "mmdebstrap": "mmdebstrap",
    "srun": "slurm-client", "sbatch": "slurm-client", "squeue": "slurm-client",
    "scontrol": "slurm-client", "sinfo": "slurm-client", "scancel": "slurm-client",
    "/usr/sbin/slurmctld": "slurmctld", "/usr/sbin/slurmd": "slurmd", "/usr/sbin/munged": "munge",
}
# Programs of Debian's Essential packages (coreutils, dash, findutils, ...), on every machine,
# and apt-get and dpkg-query (the package tools).
ESSENTIAL = {"sh", "true", "test", "echo", "cat", "sleep", "kill", "touch", "mkdir", "chown",
             "ls", "rm", "printf", "stat", "id", "head", "apt-get", "dpkg-query"}
# Calls whose first argument is an argv (a list, or a string that is the program itself).
RUNS = {"run", "Popen", "check_output", "check_call", "call", "_cmd", "_with_retries", "which"}


def ci_packages() -> list[str]:
    match = re.search(r"^packages=\(([^)]*)\)", CI_RUN.read_text(), re.M)
    assert match, f"{CI_RUN} has no packages=(...) list"
    return match.group(1).split()


def programs_the_tests_run() -> dict[str, str]:
    """Each program named first in an argv the tests and their fixtures pass to subprocess
    (or to the lab's helpers), with one place it is named."""
    found: dict[str, str] = {}
    for path in sorted((REPO / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            word = _program(node)
            if word:
                found.setdefault(word, f"{path.name}:{node.lineno}")  # type: ignore[attr-defined]
    return found


def _program(node: ast.AST) -> str | None:
    first: ast.AST | None = None
    if isinstance(node, ast.Call) and node.args:
        fn = node.func
        name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
        arg = node.args[0]
        if name in RUNS:
            first = arg.elts[0] if isinstance(arg, ast.List | ast.Tuple) and arg.elts else arg
    elif isinstance(node, ast.Assign) and isinstance(node.value, ast.List) and node.value.elts \
            and any(isinstance(t, ast.Name) and t.id == "argv" for t in node.targets):
        first = node.value.elts[0]  # argv = ["nsenter", ...]: a list built to run
    if isinstance(first, ast.Constant) and isinstance(first.value, str) and first.value:
        return first.value.split()[0]
    return None


def test_every_program_the_tests_run_is_named_with_its_package() -> None:
    unnamed = {word: where for word, where in programs_the_tests_run().items()
               if word not in TOOLS and word not in ESSENTIAL}
    assert not unnamed, (
        f"tests run programs that tests/test_ci_setup.py does not name: {unnamed}; add each "
        "to TOOLS with its Debian package (and the package to .ci/run's list)")


def test_every_package_the_tests_need_is_installed_by_ci_run_by_name() -> None:
    listed = set(ci_packages())
    missing = sorted({package for package in TOOLS.values()} - listed)
    assert not missing, f"{CI_RUN} does not install {missing}: add them to its packages=(...)"
    assert "--no-install-recommends" in CI_RUN.read_text()  # so nothing comes in unnamed


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_dpkg_says_each_program_comes_from_the_package_named_for_it(tool: str) -> None:
    if shutil.which("dpkg-query") is None:
        pytest.skip("not a Debian machine: dpkg-query is missing")
    where = tool if tool.startswith("/") else shutil.which(tool, path=os.pathsep.join(
        [os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))
    if where is None or not os.path.exists(where):
        pytest.skip(f"{tool} is not installed here (.ci/run installs {TOOLS[tool]})")
    real = os.path.realpath(where)  # through Debian's alternatives (iptables) and links
    # with /bin a link to /usr/bin (merged /usr), dpkg may know the file by either path
    twin = real.removeprefix("/usr") if real.startswith("/usr/") else "/usr" + real
    owners = [subprocess.run(["dpkg-query", "-S", path], capture_output=True, text=True)
              for path in (real, twin)]
    found = [o.stdout for o in owners if o.returncode == 0]
    assert found, f"no package owns {real} or {twin}"
    packages = {p.strip().split(":")[0] for p in found[0].split(": ", 1)[0].split(",")}
    assert TOOLS[tool] in packages, f"{real} comes from {packages}, not {TOOLS[tool]}"
