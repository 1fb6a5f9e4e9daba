"""The CPU each test costs, from a cgroup around each pytest process (Linux's cpuacct, cgroup v1).

On the 2-core CI machine the suite's two TensorFlow lanes are its wall time, and a sample of
/proc/stat beside a whole run read both cores 94-99% busy; yet time alone does not say which
tests cost the CPU and which wait (a test waiting on a Slurm time limit takes minutes and
little CPU), nor whether a lane is bound by the cores or by its waits. So each pytest process
(each xdist worker, or the one process under ``-n 0``) moves itself into a cgroup of its own
when it starts; everything it starts follows it there: the tasks, the controllers, the lab
hosts' sshd and what they run, the Slurm daemons and their steps (not podman's containers,
which podman places itself). A test's CPU is the cgroup's usage from the start of its set-up
(the fixtures it sets up included: a module's trained group counts for its first test) to the
end of its teardown, processes it left behind included; the terminal summary adds it up per
worker and names the most costly tests.

Only where that works (root, a cpuacct hierarchy at ``/sys/fs/cgroup/cpuacct``); elsewhere the
summary says why not. The cgroup is removed at the process's end; one still holding a process
then (a leak of the test run) is left and named, and removed by the next run once empty.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

ROOT = Path("/sys/fs/cgroup/cpuacct")
PREFIX = "orchestrate-tests-"


class Meter:
    """This process's cgroup: ``start``, ``seconds`` (CPU used in it so far), ``stop``."""

    def __init__(self) -> None:
        self.group: Path | None = None
        self.why_not = ""

    def start(self) -> None:
        if os.geteuid() != 0:
            self.why_not = "not root: no cgroup to count a test's CPU in"
            return
        if not (ROOT / "cgroup.procs").is_file():
            self.why_not = f"no cgroup v1 cpuacct hierarchy at {ROOT}"
            return
        for old in ROOT.glob(PREFIX + "*"):  # an earlier run's, once its processes are gone
            if not _alive(old.name.removeprefix(PREFIX)):
                with contextlib.suppress(OSError):  # still holds a process: left for later
                    old.rmdir()
        group = ROOT / f"{PREFIX}{os.getpid()}"
        try:
            group.mkdir(exist_ok=True)
            (group / "cgroup.procs").write_text(str(os.getpid()))
        except OSError as exc:
            self.why_not = f"cannot use a cgroup at {group}: {exc}"
            return
        self.group = group

    def seconds(self) -> float | None:
        if self.group is None:
            return None
        try:
            return int((self.group / "cpuacct.usage").read_text()) / 1e9
        except (OSError, ValueError):
            return None

    def stop(self) -> str | None:
        """Leave the cgroup and remove it; a warning when processes are still in it."""
        group, self.group = self.group, None
        if group is None:
            return None
        try:
            (ROOT / "cgroup.procs").write_text(str(os.getpid()))
            left = (group / "cgroup.procs").read_text().split()
            if not left:
                group.rmdir()
                return None
        except OSError as exc:
            return f"could not remove the cgroup {group}: {exc}"
        return f"processes still running after the tests, left in {group}: {', '.join(left)}"


def _alive(pid: str) -> bool:
    return pid.isdigit() and Path(f"/proc/{pid}").exists()
