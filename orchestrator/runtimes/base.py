"""The job-runtime interface: what a task of one kind of job runs, reports and needs, as the
controller sees it. The worker's side of a runtime is its module in ``worker/runtimes/``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pydantic import BaseModel

from orchestrator.spec import ClusterSpec, GpuJob
from worker.indexed import process_id

J = TypeVar("J", bound=BaseModel)

# tf.keras is tf_keras (Keras 2) under this: the Keras whose fit() works under
# MultiWorkerMirroredStrategy in TF 2.21.
LEGACY_KERAS_ENV: Mapping[str, str] = {"TF_USE_LEGACY_KERAS": "1"}


def keras_env(keras: str) -> dict[str, str]:
    """What ``tf.keras`` is in a task, by the job's ``keras``: Keras 3 for "3", else tf_keras
    (for "auto" too: a module that writes tf.keras means the Keras whose fit() works)."""
    return {"TF_USE_LEGACY_KERAS": "0"} if keras == "3" else dict(LEGACY_KERAS_ENV)


# The collectives every task's MultiWorkerMirroredStrategy uses: "ring", "nccl", or "auto"
# where train had no GPU count (each task then picks by the GPUs it sees).
COLLECTIVES_ENV = "ORCHESTRATE_COLLECTIVES"
# TensorFlow's own switch: memory growth on every GPU of the process (for a command job's
# script, which the runtime cannot configure; set only to turn growth on, since "false"
# would override a script's own set_memory_growth).
MEMORY_GROWTH_ENV = "TF_FORCE_GPU_ALLOW_GROWTH"
_COLLECTIVES = {"ring": "RING (gRPC)", "nccl": "NCCL (GPU to GPU)"}


def resolve_collectives(choice: str, gpus_per_task: Sequence[int] | None) -> str:
    """``job.collectives`` made concrete where it can be: "auto" is "nccl" when every task
    sees a GPU and "ring" when one sees none; it stays "auto" when the counts are unknown
    (None: the doctor did not run or did not reach every host)."""
    if choice != "auto" or not gpus_per_task:
        return choice
    return "nccl" if all(gpus_per_task) else "ring"


def resolve_gpus(spec: ClusterSpec, gpus_per_task: Sequence[int] | None) -> ClusterSpec:
    """``spec`` with its job's ``collectives: auto`` resolved from the GPUs of every task (in
    the plan's order; None where unknown), so that every task of every attempt agrees."""
    job = spec.job
    choice = resolve_collectives(job.collectives, gpus_per_task)
    if choice == job.collectives:
        return spec
    return spec.model_copy(update={"job": job.model_copy(update={"collectives": choice})})


# What keras.distribution.initialize() reads on every task of a Keras 3 job on JAX: every
# task's address (the first, the chief's, is where JAX's distributed service coordinates),
# how many processes there are, and which one this is (the tasks' order in the plan).
JAX_ADDRESSES_ENV = "KERAS_DISTRIBUTION_JOB_ADDRESSES"
JAX_PROCESSES_ENV = "KERAS_DISTRIBUTION_NUM_PROCESSES"
JAX_PROCESS_ID_ENV = "KERAS_DISTRIBUTION_PROCESS_ID"
# JAX's own switch for taking GPU memory as needed rather than 75% of it at start.
JAX_PREALLOCATE_ENV = "XLA_PYTHON_CLIENT_PREALLOCATE"


def backend_env(job: GpuJob) -> dict[str, str]:
    """The backend Keras 3 loads, said (a ``~/.keras/keras.json`` on a host could say another);
    on JAX, JAX's memory growth too. On TensorFlow it also lets the worker import TensorFlow
    without JAX (worker/tfimport.py)."""
    if job.backend != "jax":
        return {"KERAS_BACKEND": "tensorflow"} if getattr(job, "keras", None) == "3" else {}
    return {"KERAS_BACKEND": "jax",
            **({JAX_PREALLOCATE_ENV: "false"} if job.gpu_memory_growth else {})}


def process_env(job: GpuJob, cluster_def: Mapping[str, Sequence[str]], role: str,
                index: int) -> dict[str, str]:
    """What one task of a JAX job is among the processes of JAX's distributed service (none on
    TensorFlow, where TF_CONFIG says it)."""
    if job.backend != "jax":
        return {}
    endpoints = [endpoint for each in cluster_def.values() for endpoint in each]
    return {JAX_ADDRESSES_ENV: ",".join(endpoints), JAX_PROCESSES_ENV: str(len(endpoints)),
            JAX_PROCESS_ID_ENV: str(process_id(cluster_def, role, index))}


def gpu_env(job: GpuJob) -> dict[str, str]:
    """What every task's environment says of its GPUs: the collectives to use."""
    return {COLLECTIVES_ENV: job.collectives}


@dataclass(frozen=True)
class GpuDescription:
    """How ``orchestrate plan`` shows a job's GPU settings: the collectives, memory growth."""

    collectives: str
    memory_growth: bool
    summary: str

    @classmethod
    def of(cls, job: GpuJob) -> GpuDescription:
        if job.backend == "jax":
            growth = ("on (XLA_PYTHON_CLIENT_PREALLOCATE=false)" if job.gpu_memory_growth else
                      "off (JAX takes 75% of each GPU's memory at start)")
            return cls(job.collectives, job.gpu_memory_growth,
                       f"collectives JAX's own (gloo on CPU, NCCL between GPUs); memory growth "
                       f"{growth}")
        if job.collectives == "auto":
            how = ("auto: NCCL if every task sees a GPU, else RING (decided at train from the "
                   "doctor's GPU count; without it, by each task from the GPUs it sees)")
        else:
            how = f"{_COLLECTIVES[job.collectives]}, job.collectives: {job.collectives}"
        growth = "on" if job.gpu_memory_growth else "off (each task takes all GPU memory)"
        return cls(job.collectives, job.gpu_memory_growth,
                   f"collectives {how}; memory growth {growth}")


@dataclass(frozen=True)
class BatchScaling:
    """A job's batch size and learning rate, and how they follow the replicas in sync.

    None where the runtime does not set them (a command job's script chooses its own).
    """

    per_replica_batch_size: int | None = None
    learning_rate: float | None = None
    scale_learning_rate: bool = False
    replicas: int | None = None  # fixed by the job itself: a model-parallel mesh's batch axis

    def global_batch_size(self, replicas: int) -> int | None:
        per = self.per_replica_batch_size
        return None if per is None else per * replicas

    def scaled_learning_rate(self, replicas: int) -> float | None:
        """Linear scaling: the learning rate times the replicas, when ``scale_learning_rate``."""
        if self.learning_rate is None or not self.scale_learning_rate:
            return self.learning_rate
        return self.learning_rate * replicas


@dataclass(frozen=True)
class MatchingPackage:
    """A package every host needs in TensorFlow's minor version (tf-keras 2.21.x for TF 2.21)."""

    module: str  # its import name, under which the worker's preflight reports its version
    pip: str  # its distribution name, for the fix
    why: str  # said when it is missing


@dataclass(frozen=True)
class DoctorRules:
    """What the doctor checks on every host for one runtime, beside the rules for every job.

    ``needs_tensorflow``: a host without TensorFlow is a blocking problem (otherwise a
    warning: a command job's script may not need it). ``install_with``: distributions the
    fix installs beside TensorFlow.
    """

    needs_tensorflow: bool
    install_with: tuple[str, ...] = ()
    matching: tuple[MatchingPackage, ...] = ()


@dataclass(frozen=True)
class JobDescription:
    """How ``orchestrate plan`` shows a job: its settings (spec defaults filled in, JSON types),
    its length in steps where the runtime knows it, and one line for people."""

    runtime: str
    settings: Mapping[str, Any]
    total_steps: int | None
    summary: str


class JobRuntime(ABC, Generic[J]):
    """One kind of job, as the controller sees it; one instance per kind, in ``RUNTIMES``.

    ``mode`` is the spec's ``job.mode`` it runs, and also the worker's subcommand
    (``python -m worker MODE``). ``reports_steps`` is False where the worker reports only a
    start and an exit (then ``started`` counts as reaching the first step).
    """

    name: str
    mode: str
    job_type: type[J]
    reports_steps: bool
    doctor_rules: DoctorRules

    @abstractmethod
    def argv(self, spec: ClusterSpec, python: str) -> tuple[str, ...]:
        """The command line of every task, run with ``python`` on its host."""

    @abstractmethod
    def env(self, spec: ClusterSpec) -> dict[str, str]:
        """Environment the runtime adds to every task (beside TF_CONFIG and ORCHESTRATE_*)."""

    @abstractmethod
    def describe(self, job: J) -> JobDescription:
        """The job part of ``orchestrate plan``."""

    def rules(self, job: J) -> DoctorRules:
        """What the doctor checks for ``job``: ``doctor_rules`` unless the job's backend
        changes them."""
        return self.doctor_rules

    def scaling(self, job: J) -> BatchScaling:
        """The job's batch size and learning rate; none by default (the job sets its own)."""
        return BatchScaling()

    def job_of(self, spec: ClusterSpec) -> J:
        """The spec's job, which must be this runtime's kind.

        Raises:
            TypeError: ``spec.job`` is another kind of job.
        """
        job = spec.job
        if not isinstance(job, self.job_type):
            raise TypeError(f"the {self.name} runtime runs {self.job_type.__name__} jobs, "
                            f"received {type(job).__name__}")
        return job
