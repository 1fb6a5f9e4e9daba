"""A passing doctor report, kept so that the next ``train`` of the same cluster starts without
checking every host again (``train --recheck`` checks anyway).

``train`` runs the doctor before its first attempt. Where the report passed (no blocking
problem, every host checked), it is kept, with its warnings, in the cluster's directory on this
machine under a key of everything the checks depend on: the spec as loaded, every host the plan
places a task on (name, address, SSH endpoint, root, node, labels), the Python each runs, what
is installed for it and which GPUs its driver lists (``STAMP``: one short command per host over
the connection ``up`` already holds), and the doctor's own rules (its source and the
preflight's). The next ``train`` whose key is the same, within ``KEEP_S``, says so and starts
without the doctor, with the GPU counts the kept report found (``collectives: auto`` decides
from them, as after a doctor), and shows the kept warnings again, as found then (a warning the
user has accepted, such as task ports reachable from this machine on a network they trust,
would otherwise cost a doctor on every train). A different key checks again: a package
installed, upgraded or removed on any host, a GPU gone, another host or spec.

What the key does not see: a disk filled, a port or a firewall rule changed, an image rebuilt
under the same tag. So a run that fails drops the pass (the next ``train`` checks), ``down``
drops it, ``orchestrate doctor`` replaces it (or drops it, when it finds a blocking problem),
and none is trusted past ``KEEP_S``. A scheduler's hosts (Slurm, Kubernetes) are placed anew
for every run: no pass is kept for them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator import paths
from orchestrator.files import PRIVATE_DIR, write_atomic
from orchestrator.hosts import Host
from orchestrator.plan import ClusterPlan
from orchestrator.problems import Problem
from orchestrator.spec import ClusterSpec

KEEP_S = 12 * 3600.0  # how long a passing report is trusted at most
PROVIDERS = ("local", "static", "gcp")  # whose hosts stay the same from one run to the next
FILE = "doctor-pass.json"
RULES = ("doctor.py", "../worker/preflight.py")  # the checks' own source, beside this module
# A host's side of the key, run by the tasks' Python (-I: no user site, no cwd): its version
# and real path, the distributions on its path (their names carry their versions), and the GPUs
# the NVIDIA driver lists.
STAMP = """\
import hashlib, os, sys
h = hashlib.sha256((sys.version + "\\0" + os.path.realpath(sys.executable)).encode())
for d in sys.path:
    try:
        names = sorted(n for n in os.listdir(d) if n.endswith((".dist-info", ".egg-info", ".pth")))
    except OSError:
        continue
    h.update("\\0".join([d, *names]).encode())
try:
    h.update(" ".join(sorted(os.listdir("/proc/driver/nvidia/gpus"))).encode())
except OSError:
    pass
print(h.hexdigest())
"""


@dataclass(frozen=True)
class Kept:
    """A kept pass: when the doctor passed, in how long, the GPUs it found per task and the
    warnings it gave."""

    at: float  # time.time()
    seconds: float
    gpus_per_task: list[int] | None
    warnings: tuple[Problem, ...] = ()

    def line(self, now: float | None = None) -> str:
        """What ``train`` says when it starts on this pass."""
        age = max(0.0, (time.time() if now is None else now) - self.at)
        found = (f", with {len(self.warnings)} warning(s), shown again below as found then"
                 if self.warnings else "")
        return (f"doctor: passed {_age(age)} ago for this spec and these hosts (checked in "
                f"{self.seconds:.1f}s{found}): not run again ('train --recheck' runs it)")


def hosts_of(plan: ClusterPlan) -> list[Host]:
    """The plan's hosts, each once, by name."""
    return sorted({t.host for t in plan.tasks}, key=lambda h: h.name)


def stamp_argv(python: str) -> list[str]:
    """The command that prints a host's ``STAMP``."""
    return [python, "-I", "-c", STAMP]


def key_of(spec: ClusterSpec, plan: ClusterPlan, python: Callable[[Host], str],
           stamps: dict[str, str]) -> str:
    """What a kept pass holds for: a digest of the spec, the plan's hosts, their Pythons and
    ``stamps`` (each host's ``STAMP``, by name), and the doctor's rules."""
    hosts = hosts_of(plan)
    here = Path(__file__).resolve().parent
    rules = hashlib.sha256()
    for name in RULES:
        with contextlib.suppress(OSError):
            rules.update((here / name).read_bytes())
    document = {
        "spec": spec.model_dump(mode="json"),
        "hosts": [[repr(h), python(h), stamps.get(h.name, "")] for h in hosts],
        "rules": rules.hexdigest(),
    }
    return hashlib.sha256(json.dumps(document, sort_keys=True, default=str).encode()).hexdigest()


def load(cluster: str, key: str, *, now: float | None = None) -> Kept | None:
    """The pass kept for ``key``, or None (none kept, another key, expired, unreadable)."""
    try:
        data: dict[str, Any] = json.loads(_path(cluster).read_text(encoding="utf-8"))
        at, seconds = float(data["at"]), float(data["seconds"])
        gpus = data["gpus_per_task"]
        if data["key"] != key:
            return None
        if gpus is not None:
            gpus = [int(g) for g in gpus]
        warnings = tuple(Problem(str(w["check"]), str(w["message"]), str(w["fix"]),
                                 blocking=False, hosts=tuple(str(h) for h in w["hosts"]))
                         for w in data.get("warnings", []))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    age = (time.time() if now is None else now) - at
    if not 0 <= age <= KEEP_S:
        return None
    return Kept(at, seconds, gpus, warnings)


def keep(cluster: str, key: str, seconds: float, gpus_per_task: list[int] | None,
         warnings: tuple[Problem, ...] | list[Problem] = ()) -> None:
    """Keep a pass for ``key`` (replacing any other), with the report's ``warnings``."""
    path = _path(cluster)
    path.parent.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR)
    write_atomic(path, json.dumps({
        "key": key, "at": time.time(), "seconds": round(seconds, 3),
        "gpus_per_task": gpus_per_task,
        "warnings": [{"check": w.check, "message": w.message, "fix": w.fix,
                      "hosts": list(w.hosts)} for w in warnings]}))


def drop(cluster: str) -> None:
    """Forget the cluster's kept pass, if any: its next ``train`` runs the doctor."""
    with contextlib.suppress(FileNotFoundError):
        _path(cluster).unlink()


def _path(cluster: str) -> Path:
    return paths.cluster_home(cluster) / FILE


def _age(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f}s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
