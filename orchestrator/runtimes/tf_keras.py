"""The tf_keras fit runtime (``mode: managed``): the worker builds, compiles and fits the user's
tf_keras model under MultiWorkerMirroredStrategy, with BackupAndRestore checkpoints."""

from __future__ import annotations

import json

from orchestrator.runtimes.base import (
    LEGACY_KERAS_ENV,
    BatchScaling,
    DoctorRules,
    JobDescription,
    JobRuntime,
    MatchingPackage,
)
from orchestrator.spec import ClusterSpec, ManagedJob

TF_KERAS = MatchingPackage(
    "tf_keras", "tf-keras",
    "managed jobs train with tf_keras (Keras 3's fit fails under MultiWorkerMirroredStrategy)")


class TfKerasFit(JobRuntime[ManagedJob]):
    name = "tf_keras"
    mode = "managed"
    job_type = ManagedJob
    reports_steps = True
    doctor_rules = DoctorRules(needs_tensorflow=True, install_with=("tf-keras",),
                               matching=(TF_KERAS,))

    def argv(self, spec: ClusterSpec, python: str) -> tuple[str, ...]:
        payload = self.job_of(spec).model_dump(exclude={"mode"})
        payload["checkpoint_every_steps"] = spec.checkpoint.every_steps
        payload["collective_timeout_s"] = spec.timeouts.collective_s
        return (python, "-m", "worker", self.mode, "--job", json.dumps(payload, sort_keys=True))

    def env(self, spec: ClusterSpec) -> dict[str, str]:
        return dict(LEGACY_KERAS_ENV)

    def describe(self, job: ManagedJob) -> JobDescription:
        total = job.epochs * job.steps_per_epoch
        return JobDescription(
            runtime=self.name, settings=job.model_dump(mode="json"), total_steps=total,
            summary=f"managed: {job.module}, {job.epochs} epoch(s) x {job.steps_per_epoch} "
                    f"steps = {total} steps, optimizer {job.optimizer}")

    def scaling(self, job: ManagedJob) -> BatchScaling:
        return BatchScaling(per_replica_batch_size=job.per_replica_batch_size,
                            learning_rate=job.learning_rate,
                            scale_learning_rate=job.scale_learning_rate)
