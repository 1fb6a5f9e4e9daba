"""Shared fixtures: an isolated ORCHESTRATE_HOME, and no user SSH config leaking in."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import cpumeter
import pytest

from orchestrator import holder
from orchestrator.remote import netns

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

pytest_plugins = ["hostlab", "slurmlab", "podlab", "kubecluster"]


# The tests that train TensorFlow run in three lanes, each one test at a time on one xdist
# worker: their time in tests is the suite's wall time (`time in tests per xdist worker` and
# `time per file in the TensorFlow lanes`, at a run's end), so keep them even. Lane B: these
# files (the container tests among them: they share podman and its image, and run last), the
# Slurm tests (below) and the chaos soak (test_benchmarks.py[chaos]). Lane C: the fake clouds'
# end-to-end files, whose trainings wait on the fakes' operations, pods' starts and throttled
# links as much as they compute. Lane A: every other file with a `tf` test, new ones included.
# At ba41323 with two lanes (A and C's files as A, B and C's as B): A 34.8 min (30.1 CPU-min),
# B 35.1 (20.3 CPU-min), the two other workers 11.4 and 11.3 (7.5 CPU-min): lane B waited as
# long as it computed, and the cores were idle for it while the other workers were done.
TF_LANE_A, TF_LANE_B, TF_LANE_C = "tf-a", "tf-b", "tf-c"
TF_LANE_B_FILES = {"test_keras3_e2e.py", "test_container_e2e.py", "test_recovery_local.py",
                   "test_live_view.py"}
TF_LANE_C_FILES = {"test_kubernetes_e2e.py", "test_gcp_e2e.py", "test_bulk_transfer.py",
                   "test_checkpoint_storage.py"}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups (--dist loadgroup)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Container tests last (stable otherwise): the image they need builds meanwhile.

    Under pytest-xdist (the default: pyproject's addopts), the tests that train TensorFlow
    (marked ``tf``: each keeps the cores busy with its tasks) run in three lanes (``TF_LANE_B``,
    ``TF_LANE_C``), each lane one test after another on one worker, in this order, while the
    others, which mostly wait (SSH hosts, namespaces, the fake clouds), share the remaining
    workers. (xdist's loadgroup hands out the largest groups first, one to a worker, and no
    more work to a worker with more than 2 tests pending: each lane has a worker of its own.)"""
    items.sort(key=lambda item: item.get_closest_marker("container") is not None)
    for item in items:
        if item.get_closest_marker("slurm") is not None:
            # the one Slurm cluster: one worker; and its trainings are trainings, in a TF lane
            # (outside the lanes, it made a fourth training at once on 2 cores)
            item.add_marker(pytest.mark.xdist_group(TF_LANE_B), append=False)
        elif item.get_closest_marker("tf") is not None:
            lane = TF_LANE_B if item.path.name in TF_LANE_B_FILES \
                or item.name.endswith("[chaos]") else \
                TF_LANE_C if item.path.name in TF_LANE_C_FILES else TF_LANE_A
            item.add_marker(pytest.mark.xdist_group(lane))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start building the worker image (tests/containers.py) as soon as the selected tests are
    known, when any is a container test, so that the build overlaps the tests before them."""
    if not session.config.option.collectonly and any(
            item.get_closest_marker("container") for item in session.items):
        import containers

        containers.start_building_in_background()


def pytest_sessionfinish(session: pytest.Session) -> None:
    if "containers" in sys.modules:
        sys.modules["containers"].stop_background_build()


_METER = cpumeter.Meter()  # this pytest process's cgroup: the CPU each test costs
_CPU_AT_SETUP = pytest.StashKey[float]()
_BUSY: dict[str, list[float]] = {}  # per xdist worker: seconds in tests, tests (its lanes' load)
_LANES: dict[str, set[str]] = {}
_CPU: dict[str, float] = {}  # per xdist worker: CPU seconds in its tests
_TESTS: dict[str, list[float]] = {}  # per test: CPU seconds, seconds (setup, call, teardown)
_TF_LANES = (TF_LANE_A, TF_LANE_B, TF_LANE_C)
_NOT_MEASURED: list[str] = []  # why a worker could not count CPU


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", 0):
        _METER.start()  # a process that runs tests: an xdist worker, or the one under -n 0


def pytest_unconfigure(config: pytest.Config) -> None:
    warning = _METER.stop()
    if warning:
        print(f"warning: {warning}", file=sys.stderr)


@pytest.hookimpl(tryfirst=True)  # before pytest's own, which sets up the test's fixtures
def pytest_runtest_setup(item: pytest.Item) -> None:
    used = _METER.seconds()
    if used is not None:
        item.stash[_CPU_AT_SETUP] = used


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item,
                              call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    report = yield
    if call.when == "teardown":
        used = _METER.seconds()
        if used is not None and _CPU_AT_SETUP in item.stash:
            report.user_properties.append(("cpu_s", used - item.stash[_CPU_AT_SETUP]))
        elif _METER.why_not:
            report.user_properties.append(("cpu_not_measured", _METER.why_not))
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Add up each xdist worker's time in tests (setup, call and teardown), by lane: the suite's
    wall time is its busiest worker's, so this says which lane to lighten; and the CPU each test
    cost, its fixtures' set-up included (tests/cpumeter.py): where the cores are the bound, this
    says which tests to lighten."""
    node = getattr(report, "node", None)
    worker = getattr(getattr(node, "gateway", None), "id", None) or "main"
    busy = _BUSY.setdefault(worker, [0.0, 0])
    busy[0] += report.duration
    if report.when == "call":
        busy[1] += 1
    _, at, lane = report.nodeid.rpartition("@")
    _LANES.setdefault(worker, set()).add(lane if at and "/" not in lane else "shared")
    test = _TESTS.setdefault(report.nodeid, [0.0, 0.0])
    test[1] += report.duration
    for name, value in report.user_properties:
        if name == "cpu_s":
            test[0] += value
            _CPU[worker] = _CPU.get(worker, 0.0) + value
        elif name == "cpu_not_measured" and f"{worker}: {value}" not in _NOT_MEASURED:
            _NOT_MEASURED.append(f"{worker}: {value}")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _BUSY:
        return
    terminalreporter.section("time in tests per xdist worker (the suite waits for the busiest)")
    for worker, (seconds, tests) in sorted(_BUSY.items(), key=lambda kv: -kv[1][0]):
        lanes = ", ".join(sorted(_LANES.get(worker, ())))
        cpu = f", {_CPU[worker] / 60:5.1f} CPU-min" if worker in _CPU else ""
        terminalreporter.write_line(
            f"{worker}: {seconds / 60:5.1f} min{cpu}, {tests} tests ({lanes})")
    if _CPU:
        total = sum(_CPU.values())
        terminalreporter.write_line(
            f"CPU in tests: {total / 60:.1f} CPU-min in all; the 25 costliest tests "
            "(CPU s, s, test):")
        costliest = sorted(_TESTS.items(), key=lambda kv: -kv[1][0])[:25]
        for nodeid, (cpu_s, seconds) in costliest:
            terminalreporter.write_line(f"{cpu_s:7.1f} {seconds:7.1f}  {nodeid}")
    files: dict[tuple[str, str], list[float]] = {}  # (lane, file): CPU s, s, tests
    for nodeid, (cpu_s, seconds) in _TESTS.items():
        path, at, lane = nodeid.rpartition("@")
        if at and lane in _TF_LANES:
            row = files.setdefault((lane, path.split("::")[0]), [0.0, 0.0, 0])
            row[0] += cpu_s
            row[1] += seconds
            row[2] += 1
    if files:
        terminalreporter.write_line("time per file in the TensorFlow lanes (lane, CPU s, s, "
                                    "tests, file):")
        for (lane, path), (cpu_s, seconds, tests) in sorted(
                files.items(), key=lambda kv: (kv[0][0], -kv[1][1])):
            terminalreporter.write_line(f"{lane} {cpu_s:7.1f} {seconds:7.1f} {int(tests):4d}  "
                                        f"{path}")
    for why in _NOT_MEASURED:
        terminalreporter.write_line(f"CPU not measured on {why}")


@pytest.fixture(scope="session")
def image() -> str:
    """The worker image built from docker/Dockerfile (tests/containers.py); skips where podman
    cannot run containers, saying why."""
    import containers

    reason = containers.podman_usable()
    if reason is not None:
        pytest.skip(reason)
    return containers.worker_image()


@pytest.fixture(autouse=True, scope="session")
def _no_netns_holder_left(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """At the end, the holders of clusters made in directories of any scope (by their pid
    files; see orchestrate_home for a test's own)."""
    yield
    for pid_file in tmp_path_factory.getbasetemp().rglob("clusters/*/netns.pid"):
        netns.stop(pid_file)
    for pid_file in tmp_path_factory.getbasetemp().rglob("early/*.held"):
        holder.stop(pid_file.with_suffix(".json"))


@pytest.fixture(autouse=True)
def orchestrate_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    home = tmp_path / "orchestrate-home"
    monkeypatch.setenv("ORCHESTRATE_HOME", str(home))
    yield home
    # the local provider's network namespace holders (by the pid each file records): a test
    # that ends without 'down' leaves none behind (a holder also ends once its file is gone)
    for pid_file in tmp_path.rglob("clusters/*/netns.pid"):  # any home the test made here
        netns.stop(pid_file)
    for pid_file in tmp_path.rglob("early/*.held"):  # and the holders of SSH connections
        holder.stop(pid_file.with_suffix(".json"))


# What a developer's shell may set that would change what the tests see: the terminal's
# (rich's colour and width), the Keras backend, a container engine's remote, a kubeconfig.
# Each test runs as from a clean environment, however the suite was started.
USER_ENVIRONMENT = ("FORCE_COLOR", "NO_COLOR", "CLICOLOR_FORCE", "TTY_COMPATIBLE",
                    "TTY_INTERACTIVE", "COLUMNS", "LINES", "KERAS_BACKEND", "TF_USE_LEGACY_KERAS",
                    "CONTAINER_HOST", "CONTAINER_CONNECTION", "DOCKER_HOST", "CONTAINERS_CONF",
                    "KUBECONFIG")


@pytest.fixture(autouse=True)
def _no_user_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No SSH agent, no TF_CONFIG and nothing of ``USER_ENVIRONMENT`` from the developer's shell."""
    monkeypatch.setenv("SSH_AUTH_SOCK", "")
    monkeypatch.delenv("SSH_AGENT_PID", raising=False)
    for name in USER_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    os.environ.pop("TF_CONFIG", None)
