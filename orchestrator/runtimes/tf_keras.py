"""The managed runtime (``mode: managed``): the worker builds and compiles the user's model under
MultiWorkerMirroredStrategy and trains it: a tf_keras model with ``fit`` and BackupAndRestore,
a Keras 3 model in the worker's own distributed loop (Keras 3's fit fails under MWMS). With
``backend: jax``, a Keras 3 model on JAX's distributed service with Keras's DataParallel, no
TensorFlow. On SIGTERM every task saves a checkpoint at the same step and exits."""

from __future__ import annotations

import json

from orchestrator.runtimes.base import (
    BatchScaling,
    DoctorRules,
    JobDescription,
    JobRuntime,
    MatchingPackage,
    backend_env,
    gpu_env,
    keras_env,
)
from orchestrator.spec import ClusterSpec, ManagedJob

TF_KERAS = MatchingPackage(
    "tf_keras", "tf-keras",
    "managed jobs train with tf_keras (Keras 3's fit fails under MultiWorkerMirroredStrategy)")


JAX_FIELDS = {"backend", "distribution", "mesh", "layout_map_fn"}
_KERAS = {"auto": "auto (by the model build_model() returns)", "3": "3 (distributed custom loop)",
          "2": "2 (tf_keras fit)"}


class TfKerasFit(JobRuntime[ManagedJob]):
    name = "tf_keras"
    mode = "managed"
    job_type = ManagedJob
    reports_steps = True
    doctor_rules = DoctorRules(needs_tensorflow=True, install_with=("tf-keras",),
                               matching=(TF_KERAS,))

    def argv(self, spec: ClusterSpec, python: str) -> tuple[str, ...]:
        job = self.job_of(spec)
        # JAX's fields only on JAX (on TensorFlow, the worker's defaults).
        payload = job.model_dump(exclude={"mode"} | (JAX_FIELDS if job.backend == "tensorflow"
                                                     else set()))
        payload["checkpoint_every_steps"] = spec.checkpoint.every_steps
        payload["collective_timeout_s"] = spec.timeouts.collective_s
        payload["snapshot_on_crash"] = spec.retry.snapshot_on_crash
        if job.backend == "jax":  # how long JAX's service spares a survivor that saves
            payload["snapshot_s"] = spec.timeouts.snapshot_s
        return (python, "-m", "worker", self.mode, "--job", json.dumps(payload, sort_keys=True))

    def env(self, spec: ClusterSpec) -> dict[str, str]:
        job = self.job_of(spec)
        return {**keras_env(job.keras), **gpu_env(job), **backend_env(job)}

    def rules(self, job: ManagedJob) -> DoctorRules:
        # On JAX the runtime needs neither TensorFlow nor tf_keras.
        return DoctorRules(needs_tensorflow=False) if job.backend == "jax" else self.doctor_rules

    def describe(self, job: ManagedJob) -> JobDescription:
        total = job.epochs * job.steps_per_epoch
        keras = _KERAS[job.keras]
        if job.backend == "jax" and job.mesh and job.distribution == "model_parallel":
            batch, model = job.mesh
            keras = (f"3 on JAX (ModelParallel: mesh {batch} x {model} = {batch * model} "
                     f"device(s), each batch split over {batch}, the variables of "
                     f"{job.module}.{job.layout_map_fn}(mesh) over {model})")
        elif job.backend == "jax":
            keras = "3 on JAX (DataParallel over every device of every task)"
        return JobDescription(
            runtime=self.name, settings=job.model_dump(mode="json"), total_steps=total,
            summary=f"managed: {job.module}, {job.epochs} epoch(s) x {job.steps_per_epoch} "
                    f"steps = {total} steps, optimizer {job.optimizer}, Keras {keras}")

    def scaling(self, job: ManagedJob) -> BatchScaling:
        # Model parallel: the batch is split over the mesh's batch axis only.
        mesh = job.mesh if job.backend == "jax" and job.distribution == "model_parallel" else None
        return BatchScaling(per_replica_batch_size=job.per_replica_batch_size,
                            learning_rate=job.learning_rate,
                            scale_learning_rate=job.scale_learning_rate,
                            replicas=mesh[0] if mesh else None)
