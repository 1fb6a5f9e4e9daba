"""The command runtime (``mode: command``): every task runs the user's unmodified script with
TF_CONFIG set; the worker reports only its start and its exit."""

from __future__ import annotations

import shlex

from orchestrator.runtimes.base import (
    MEMORY_GROWTH_ENV,
    DoctorRules,
    JobDescription,
    JobRuntime,
    backend_env,
    gpu_env,
    keras_env,
)
from orchestrator.spec import ClusterSpec, CommandJob

PYTHON_NAMES = ("python", "python3")  # a command starting with one runs the tasks' interpreter


class CommandRuntime(JobRuntime[CommandJob]):
    name = "command"
    mode = "command"
    job_type = CommandJob
    reports_steps = False
    doctor_rules = DoctorRules(needs_tensorflow=False, install_with=("tf-keras",))

    def argv(self, spec: ClusterSpec, python: str) -> tuple[str, ...]:
        command = list(self.job_of(spec).command)
        if command[0] in PYTHON_NAMES:
            command[0] = python
        return (python, "-m", "worker", self.mode, "--", *command)

    def env(self, spec: ClusterSpec) -> dict[str, str]:
        # By default the tutorial's tf.keras fit works under MWMS: as tf_keras. The script
        # reads the collectives from ORCHESTRATE_COLLECTIVES; memory growth is TensorFlow's
        # own variable (unless the spec's env sets it).
        # On JAX, KERAS_BACKEND and the KERAS_DISTRIBUTION_* variables (per task, from the
        # plan) are what an unmodified keras.distribution.initialize() reads.
        job = self.job_of(spec)
        growth = job.gpu_memory_growth and MEMORY_GROWTH_ENV not in spec.env
        return {**keras_env(job.keras), **gpu_env(job),
                **({MEMORY_GROWTH_ENV: "true"} if growth and job.backend == "tensorflow"
                   else {}), **backend_env(job)}

    def describe(self, job: CommandJob) -> JobDescription:
        given = ("KERAS_BACKEND=jax and KERAS_DISTRIBUTION_* set for keras.distribution."
                 "initialize(), the chief the coordinator" if job.backend == "jax"
                 else "TF_CONFIG set for it")
        return JobDescription(runtime=self.name, settings=job.model_dump(mode="json"),
                              total_steps=None,
                              summary=f"command: {shlex.join(job.command)} ({given})")
