"""The worker image for container tests: built locally with podman from docker/Dockerfile.

Public registries cannot be reached on the CI machines, so the base is made here: a Debian
root file system from mmdebstrap (Debian's packages: python3, pip), ``podman import``-ed as
``localhost/orchestrate-test-base:bookworm``; the Dockerfile then pip-installs the worker's
requirements from PyPI through the host's network (``podman build --network host``). It is
the JAX variant (``--build-arg JAX=1``: the `jax` extra too), so the same image runs TensorFlow
jobs and ``job.backend: jax`` jobs.

The image is tagged ``localhost/orchestrate-worker:test-<hash>``, the hash covering
docker/Dockerfile, its two requirements files, .dockerignore, the worker/ sources (built
from a snapshot of them, so the tag names what was built), the build arguments and the base
image's id: a rerun with the same sources finds the image and builds nothing (under a second),
and a change to worker/ only rebuilds the last layers (about 10 s: podman's layer cache keeps
the pip layers).
A file lock keeps two pytest processes (or checkouts) from building at once; each build's
output goes to $ORCHESTRATE_TEST_IMAGES (default /tmp/orchestrate-test-images)/build-*.log.

Use::

    from containers import IMAGE_TIMEOUT_S, PODMAN, podman_usable, worker_image

    reason = podman_usable()      # None, or why podman cannot run containers here
    image = worker_image()        # waits for the build (started at collection, see conftest)

A cold build makes the base (mmdebstrap, about 30 s) and downloads TensorFlow (a 572 MB
wheel), jaxlib (85 MB) and the rest from PyPI: about 2 to 3 minutes in all on the CI machine,
for a 3 GB image (JAX adds about 20 to 50 s and 400 MB; docker/README.md has the figures).
Tests that wait for it need ``@pytest.mark.timeout(IMAGE_TIMEOUT_S)`` (pytest-timeout counts
fixture set-up).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "docker" / "Dockerfile"
REQUIREMENTS = REPO / "docker" / "requirements-worker.txt"
REQUIREMENTS_JAX = REPO / "docker" / "requirements-jax.txt"
IGNORE_FILE = REPO / ".dockerignore"

BASE_IMAGE = "localhost/orchestrate-test-base:bookworm"
BASE_PACKAGES = "python3,python3-pip,python3-venv,ca-certificates"
IMAGE_NAME = "localhost/orchestrate-worker"
BUILD_ARGS = {"JAX": "1"}  # the JAX variant: tests/test_container_e2e.py runs a JAX job in it
TEST_TAG_PREFIX = "test-"
# runc: crun fails on the CI machines (cgroups in hybrid mode). Their containers.conf also sets
# `default_ulimits = []` (.ci/run writes it when there is none).
PODMAN = ["podman", "--runtime", "runc"]

BUILD_TIMEOUT_S = 3600.0  # the longest a cold build (TensorFlow's wheels from PyPI) may take
IMAGE_TIMEOUT_S = int(BUILD_TIMEOUT_S) + 300  # for @pytest.mark.timeout on tests that wait
PRUNE_AFTER_S = 6 * 3600  # older test tags of other sources are removed after a build
STATE_DIR = Path(os.environ.get("ORCHESTRATE_TEST_IMAGES",
                                Path(tempfile.gettempdir()) / "orchestrate-test-images"))
LOG_TAIL_LINES = 60
HOST_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
RUNNING_FILE = STATE_DIR / "running.json"  # the step in progress, for a later session


class ImageBuildError(RuntimeError):
    """The base or the worker image could not be built; the text ends with the log's tail."""


# -- can podman run here? ------------------------------------------------------------------
_usable: list[str | None] = []


def podman_usable() -> str | None:
    """None when podman can build and run the test image here, else why not (one line)."""
    if not _usable:
        _usable.append(_why_not())
    return _usable[0]


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "container tests need root (podman runs rootful with runc on the CI machines)"
    for tool, package in (("podman", "podman"), ("runc", "runc")):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install {package}; .ci/run does it)"
    try:
        info = subprocess.run([*PODMAN, "info", "--format", "{{.Host.OCIRuntime.Name}}"],
                              capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"podman info failed: {exc}"
    if info.returncode != 0:
        lines = (info.stderr or info.stdout).strip().splitlines()
        return f"podman info failed: {lines[-1] if lines else f'exit {info.returncode}'}"
    if not _image_exists(BASE_IMAGE) and shutil.which("mmdebstrap") is None:
        return (f"{BASE_IMAGE} is missing and mmdebstrap (which makes it) is not installed "
                "(apt-get install mmdebstrap)")
    return None


# -- the image -----------------------------------------------------------------------------
def image_tag(root: Path = REPO) -> str:
    """The tag of the image the sources under ``root`` make (``…/orchestrate-worker:test-…``)."""
    digest = hashlib.sha256()
    for path in _context_files(root):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update("".join(f"{k}={v}\0" for k, v in sorted(BUILD_ARGS.items())).encode())
    digest.update(f"base={BASE_IMAGE}@{_image_id(BASE_IMAGE) or 'to-build'}".encode())
    return f"{IMAGE_NAME}:{TEST_TAG_PREFIX}{digest.hexdigest()[:16]}"


def _context_files(root: Path) -> list[Path]:
    """What the build reads: the Dockerfile, its requirements, .dockerignore and worker/."""
    files = [root / p.relative_to(REPO)
             for p in (DOCKERFILE, REQUIREMENTS, REQUIREMENTS_JAX, IGNORE_FILE)]
    return [*files, *sorted(p for p in (root / "worker").rglob("*") if p.is_file() and
                            "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo"))]


def _snapshot(into: Path) -> Path:
    """A copy of the build's inputs, so that the tag names exactly what was built even while
    worker/ is being edited (the build reads worker/ a minute or more after it starts)."""
    for path in _context_files(REPO):
        target = into / path.relative_to(REPO)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    return into


class _Build:
    """One build in this process: run in a thread (started early) or in the caller."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self.tag: str | None = None
        self.error: ImageBuildError | None = None
        self.stopped = False
        self.lock = threading.Lock()

    def run(self) -> None:
        try:
            self.tag = _ensure_image(self)
        except ImageBuildError as exc:
            self.error = exc
        except Exception as exc:  # a bug here must fail the tests that wait, not vanish
            self.error = ImageBuildError(f"building the worker image failed: "
                                         f"{type(exc).__name__}: {exc}")


_build = _Build()


def start_building_in_background() -> None:
    """Start making the image in a thread, so that it overlaps the tests that run before the
    container tests (conftest calls this after collection when any are selected)."""
    with _build.lock:
        if _build.thread is not None or podman_usable() is not None:
            return
        _build.thread = threading.Thread(target=_build.run, name="worker-image-build",
                                         daemon=True)
        _build.thread.start()


def stop_background_build() -> None:
    """At the end of the session: start no further step. A step still running (a build that
    no test waited for: Ctrl-C, or the container tests deselected) is left to finish in its own
    session; the next session waits for it (``_wait_for_detached``) and finds the image.
    (Interrupting ``podman build`` 4.3 leaves its RUN step's process and working containers.)"""
    with _build.lock:
        _build.stopped = True
        process = _build.process
    if process is not None and process.poll() is None:
        sys.stderr.write(f"\nworker image: the build (pid {process.pid}) goes on after this "
                         f"session, log in {STATE_DIR}; the next session waits for it\n")


def worker_image() -> str:
    """The tag of the worker image built from the current sources; builds it (or waits for the
    background build) when it is not there. Raises ImageBuildError with the build log's tail."""
    reason = podman_usable()
    if reason is not None:
        raise ImageBuildError(f"podman cannot build images here: {reason}")
    with _build.lock:
        thread = _build.thread
    if thread is not None:
        thread.join()
        if _build.error is not None:
            raise _build.error
    return _ensure_image(_build)


def _ensure_image(build: _Build) -> str:
    with _file_lock():
        _wait_for_detached()
        for stale in STATE_DIR.glob("context-*"):
            shutil.rmtree(stale, ignore_errors=True)
        _ensure_base(build)
        # not a TemporaryDirectory: its finalizer would delete the context at interpreter exit
        # under a build that goes on (stop_background_build)
        context = _snapshot(Path(tempfile.mkdtemp(prefix="context-", dir=STATE_DIR)))
        tag = image_tag(context)
        if _image_exists(tag):
            shutil.rmtree(context, ignore_errors=True)
            return tag
        log = STATE_DIR / f"build-{tag.rpartition(':')[2]}.log"
        started = time.monotonic()
        _run_logged(build, [
            *PODMAN, "build", "--network", "host", "--pull=never",
            "--file", str(context / DOCKERFILE.relative_to(REPO)), "--tag", tag,
            "--build-arg", f"BASE={BASE_IMAGE}",
            *(word for k, v in BUILD_ARGS.items() for word in ("--build-arg", f"{k}={v}")),
            "--label", "org.orchestrate.test-image=1",
            *_host_ca_mount(),
            str(context),
        ], log, f"podman build of {tag}")
        shutil.rmtree(context, ignore_errors=True)
        if not _image_exists(tag):
            raise ImageBuildError(f"podman build of {tag} ended without the image; log {log}, "
                                  f"last lines:\n{_tail(log)}")
        _append(log, f"\n# built {tag} in {time.monotonic() - started:.1f} s\n")
        _prune_old_test_images(keep=tag)
        return tag


def _ensure_base(build: _Build) -> None:
    """``localhost/orchestrate-test-base:bookworm``: Debian bookworm (minbase) with python3 and
    pip, from Debian's archive, imported into podman. Called with the file lock held."""
    if _image_exists(BASE_IMAGE):
        return
    if shutil.which("mmdebstrap") is None:
        raise ImageBuildError(f"{BASE_IMAGE} is missing and mmdebstrap is not installed")
    log = STATE_DIR / "base.log"
    rootfs = STATE_DIR / "base-rootfs.tar"
    rootfs.unlink(missing_ok=True)
    started = time.monotonic()
    try:
        _run_logged(build, ["mmdebstrap", "--variant=minbase", f"--include={BASE_PACKAGES}",
                            "bookworm", str(rootfs)], log, "mmdebstrap of the base image")
        _run_logged(build, [
            "podman", "import",
            "--change", "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "--change", 'CMD ["/bin/bash"]',
            "--message", "orchestrate test base: Debian bookworm minbase with python3 and pip",
            str(rootfs), BASE_IMAGE,
        ], log, "podman import of the base image")
        _append(log, f"# made {BASE_IMAGE} in {time.monotonic() - started:.1f} s\n")
    finally:
        rootfs.unlink(missing_ok=True)


def _host_ca_mount() -> list[str]:
    """The host's CA bundle over the image's during the build's RUN steps (not kept in the
    image): where a TLS-inspecting proxy stands between this host and PyPI, its CA is in the
    host's bundle, and Debian's pip reads that file."""
    bundle = Path(HOST_CA_BUNDLE)
    return ["--volume", f"{bundle}:{bundle}:ro"] if bundle.is_file() else []


def _run_logged(build: _Build, argv: list[str], log: Path, what: str) -> None:
    """Run ``argv`` with its output appended to ``log``; on failure raise with the tail.
    Called with the file lock held; the step's pid is in RUNNING_FILE while it runs."""
    _append(log, f"# {datetime.now(timezone.utc):%Y-%m-%d %H:%M:%S}Z $ {' '.join(argv)}\n")
    with open(log, "ab") as out, build.lock:
        if build.stopped:
            raise ImageBuildError(f"{what}: not started, the test session ended")
        # a session of its own: Ctrl-C on pytest does not interrupt it (see stop_background_build)
        process = build.process = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
            start_new_session=True)
    RUNNING_FILE.write_text(json.dumps({"pid": process.pid, "argv": argv, "log": str(log)}))
    try:
        rc = process.wait(timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        rc = process.wait()
        _append(log, f"\n# killed after {BUILD_TIMEOUT_S:g} s\n")
    finally:
        with build.lock:
            build.process = None
        RUNNING_FILE.unlink(missing_ok=True)
    if rc != 0:
        raise ImageBuildError(f"{what} failed (exit {rc}); log {log}, last lines:\n{_tail(log)}")


def _wait_for_detached() -> None:
    """Wait for a step that an earlier session left running (stop_background_build)."""
    try:
        running = json.loads(RUNNING_FILE.read_text())
        pid, argv = int(running["pid"]), list(running["argv"])
    except (OSError, ValueError, KeyError, TypeError):
        RUNNING_FILE.unlink(missing_ok=True)
        return
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    while _still_running(pid, argv):
        if time.monotonic() > deadline:
            raise ImageBuildError(f"an earlier session's build step (pid {pid}) is still "
                                  f"running after {BUILD_TIMEOUT_S:g} s; log {running.get('log')}")
        time.sleep(1.0)
    RUNNING_FILE.unlink(missing_ok=True)


def _still_running(pid: int, argv: list[str]) -> bool:
    """Whether ``pid`` is still the process that ran ``argv`` (a script's cmdline starts with
    its interpreter, so only the arguments are compared)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    cmdline = raw.decode(errors="replace").rstrip("\0").split("\0")
    return bool(raw) and cmdline[len(cmdline) - len(argv) + 1:] == argv[1:]


def _prune_old_test_images(keep: str) -> None:
    """Remove this helper's test tags of other sources that are older than PRUNE_AFTER_S
    (only images this module built; an image a container still uses stays)."""
    listing = subprocess.run(["podman", "images", "--format", "json",
                              "--filter", f"reference={IMAGE_NAME}"],
                             capture_output=True, text=True, timeout=60)
    if listing.returncode != 0:
        return
    try:
        images = json.loads(listing.stdout or "[]")
    except ValueError:
        return
    now = time.time()
    for image in images:
        if (image.get("Labels") or {}).get("org.orchestrate.test-image") != "1":
            continue
        if now - float(image.get("Created") or now) < PRUNE_AFTER_S:
            continue
        for name in image.get("Names") or []:
            if name != keep and name.startswith(f"{IMAGE_NAME}:{TEST_TAG_PREFIX}"):
                subprocess.run(["podman", "rmi", name], capture_output=True, timeout=120)


# -- small helpers -------------------------------------------------------------------------
def _image_exists(name: str) -> bool:
    return subprocess.run(["podman", "image", "exists", name], capture_output=True,
                          timeout=60).returncode == 0


def _image_id(name: str) -> str | None:
    found = subprocess.run(["podman", "image", "inspect", "--format", "{{.Id}}", name],
                           capture_output=True, text=True, timeout=60)
    if found.returncode != 0:
        return None
    return found.stdout.strip() or None


def image_size_bytes(name: str) -> int | None:
    found = subprocess.run(["podman", "image", "inspect", "--format", "{{.Size}}", name],
                           capture_output=True, text=True, timeout=60)
    return int(found.stdout.strip()) if found.returncode == 0 and found.stdout.strip() else None


@contextlib.contextmanager
def _file_lock() -> Iterator[None]:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with open(STATE_DIR / "build.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _append(log: Path, text: str) -> None:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with open(log, "a", encoding="utf-8") as out:
        out.write(text)


def _tail(log: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = log.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        return f"(cannot read the log: {exc})"
    return "\n".join(text.rstrip().splitlines()[-lines:])
