"""Job runtimes: what each kind of job runs on a task, what it reports and what it needs.

A new kind of job is its spec model (``orchestrator/spec.py``), one module here, registered
in ``RUNTIMES``, and one module in ``worker/runtimes/``; the event lines the worker prints
(``worker/events.py``) are the one contract between the two sides.
"""

from __future__ import annotations

from typing import Any

from orchestrator.runtimes.base import (
    COLLECTIVES_ENV,
    BatchScaling,
    DoctorRules,
    GpuDescription,
    JobDescription,
    JobRuntime,
    MatchingPackage,
    resolve_collectives,
    resolve_gpus,
)
from orchestrator.runtimes.command import CommandRuntime
from orchestrator.runtimes.tf_keras import TfKerasFit
from orchestrator.spec import Job

RUNTIMES: dict[str, JobRuntime[Any]] = {r.mode: r for r in (TfKerasFit(), CommandRuntime())}

__all__ = ["COLLECTIVES_ENV", "RUNTIMES", "BatchScaling", "DoctorRules", "GpuDescription",
           "JobDescription", "JobRuntime", "MatchingPackage", "resolve_collectives",
           "resolve_gpus", "runtime_for"]


def runtime_for(job: Job) -> JobRuntime[Any]:
    """The runtime that runs ``job``, chosen by its ``mode``."""
    return RUNTIMES[job.mode]
