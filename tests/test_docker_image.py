"""docker/Dockerfile: its requirements match pyproject's `worker` and `jax` extras, and the image
it builds (from the local Debian base, with podman; the JAX variant, --build-arg JAX=1) runs
`python3 -m worker preflight` with TensorFlow 2.21, imports Keras 3 and tf-keras, runs Keras on
JAX 0.10, and holds none of the controller's dependencies."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from containers import IMAGE_TIMEOUT_S, PODMAN, REPO
from packaging.requirements import Requirement

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def _requirements(lines: list[str]) -> set[str]:
    found = set()
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            found.add(f"{req.name.lower().replace('_', '-')}{req.specifier}{req.marker or ''}")
    return found


# -- static checks (everywhere) ------------------------------------------------------------
def test_requirements_match_the_worker_extra() -> None:
    image = _requirements((REPO / "docker" / "requirements-worker.txt").read_text().splitlines())
    extra = _requirements(PYPROJECT["project"]["optional-dependencies"]["worker"])
    assert image == extra, ("docker/requirements-worker.txt and pyproject's `worker` extra "
                            f"differ: only in the file {sorted(image - extra)}, only in "
                            f"pyproject {sorted(extra - image)}")


def test_jax_requirements_match_the_jax_extra() -> None:
    image = _requirements((REPO / "docker" / "requirements-jax.txt").read_text().splitlines())
    extra = _requirements(PYPROJECT["project"]["optional-dependencies"]["jax"])
    assert image == extra, ("docker/requirements-jax.txt and pyproject's `jax` extra differ: "
                            f"only in the file {sorted(image - extra)}, only in pyproject "
                            f"{sorted(extra - image)}")


def test_dockerfile_version_label_is_the_project_version() -> None:
    text = (REPO / "docker" / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE=tensorflow/tensorflow:2\.21\.\d+-gpu$", text, re.M)
    version = re.search(r"^ARG VERSION=(\S+)$", text, re.M)
    assert version and version.group(1) == PYPROJECT["project"]["version"]


def test_build_context_sends_only_what_the_dockerfile_copies() -> None:
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert patterns[0] == "*", "the context starts empty: no .venv, .git, outputs"
    allowed = {p[1:] for p in patterns if p.startswith("!")}
    copied = re.findall(r"^COPY\s+(\S+)\s", (REPO / "docker" / "Dockerfile").read_text(), re.M)
    assert copied and set(copied) <= allowed


# -- the image (podman) --------------------------------------------------------------------


def _run(image: str, *argv: str, options: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    name = f"orchestrate-test-image-{uuid.uuid4().hex[:10]}"
    try:
        return subprocess.run([*PODMAN, "run", "--rm", "--name", name, "--network", "host",
                               *options, image, *argv],
                              capture_output=True, text=True, timeout=300)
    finally:
        subprocess.run(["podman", "rm", "--force", "--ignore", name], capture_output=True,
                       timeout=120)


@pytest.mark.container
@pytest.mark.timeout(IMAGE_TIMEOUT_S)
def test_image_runs_worker_preflight(image: str) -> None:
    # as the controller runs it: another directory, the SSH user's uid (not in the image)
    done = _run(image, "python3", "-m", "worker", "preflight", "--import-tensorflow", "always",
                options=("--workdir", "/tmp", "--user", "12345:12345"))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["tensorflow"]["version"].startswith("2.21."), report["tensorflow"]
    assert report["tensorflow"]["imported"] is True, report["tensorflow"]
    assert report["tensorflow"]["gpus"] == [], report["tensorflow"]
    assert report["tf_keras"]["version"].startswith("2.21."), report["tf_keras"]
    assert report["nvidia"]["gpus"] == []
    assert report["python"]["executable"].startswith("/usr/bin/python3")


@pytest.mark.container
@pytest.mark.timeout(IMAGE_TIMEOUT_S)
def test_image_has_keras_and_no_controller(image: str) -> None:
    probe = ("import importlib.util as u, keras, sklearn, tf_keras; "
             "print(keras.__version__, tf_keras.__version__); "
             "print([m for m in ('paramiko', 'google.cloud', 'pydantic', 'typer', 'rich', "
             "'orchestrator') if u.find_spec(m)])")
    done = _run(image, "python3", "-c", probe)
    assert done.returncode == 0, done.stderr[-3000:]
    versions, absent = done.stdout.strip().splitlines()[-2:]
    keras_version, tf_keras_version = versions.split()
    assert keras_version.startswith("3.") and tf_keras_version.startswith("2.21."), versions
    # keras 3 itself needs rich; everything else of the controller must not be there
    assert absent == "['rich']", f"controller packages in the worker image: {absent}"


@pytest.mark.container
@pytest.mark.timeout(IMAGE_TIMEOUT_S)
def test_image_runs_keras_on_jax_0_10_on_cpu(image: str) -> None:
    probe = ("import jax, keras, worker.runtimes.keras_jax; "
             "print(jax.__version__, keras.backend.backend(), "
             "[d.platform for d in jax.devices()], float(jax.numpy.arange(4.0).sum()))")
    done = _run(image, "python3", "-c", probe,
                options=("--workdir", "/tmp", "--user", "12345:12345",
                         "--env", "KERAS_BACKEND=jax", "--env", "HOME=/tmp"))
    assert done.returncode == 0, done.stderr[-3000:]
    version, backend, platforms, total = done.stdout.strip().splitlines()[-1].split(" ", 3)
    assert version.startswith("0.10."), version
    assert (backend, platforms, total) == ("jax", "['cpu']", "6.0"), done.stdout


@pytest.mark.container
@pytest.mark.timeout(IMAGE_TIMEOUT_S)
def test_synced_worker_on_pythonpath_shadows_the_image_copy(image: str,
                                                            tmp_path: Path) -> None:
    (tmp_path / "worker").mkdir()
    (tmp_path / "worker" / "__init__.py").write_text("SYNCED = True\n")
    probe = "import worker; print(worker.__file__, getattr(worker, 'SYNCED', False))"
    mounted = _run(image, "python3", "-c", probe,
                   options=("--volume", f"{tmp_path}:/code:ro", "--env", "PYTHONPATH=/code",
                            "--workdir", "/"))
    assert mounted.returncode == 0, mounted.stderr[-3000:]
    assert mounted.stdout.split() == ["/code/worker/__init__.py", "True"]
    plain = _run(image, "python3", "-c", probe, options=("--workdir", "/"))
    assert plain.returncode == 0, plain.stderr[-3000:]
    location, synced = plain.stdout.split()
    assert location.endswith("-packages/worker/__init__.py") and synced == "False", location


@pytest.mark.container
@pytest.mark.timeout(IMAGE_TIMEOUT_S)
def test_image_labels(image: str) -> None:
    done = subprocess.run(["podman", "image", "inspect", "--format",
                           "{{json .Labels}}", image], capture_output=True, text=True,
                          timeout=60)
    labels = json.loads(done.stdout)
    assert labels["org.opencontainers.image.title"] == "orchestrate-worker"
    assert labels["org.opencontainers.image.version"] == PYPROJECT["project"]["version"]
    assert labels["org.opencontainers.image.description"].endswith(", and JAX 0.10 (CPU)")
    assert "org.opencontainers.image.source" in labels
