"""Elastic groups: the spec of a group that goes on with fewer workers after a machine is lost
for good (``elastic:`` in the spec).

MultiWorkerMirroredStrategy (and JAX's data-parallel group) cannot change its size while it
runs, but a group is restarted from the chief's checkpoint anyway when a task fails: a restart
on the machines that are left is the same restart, planned for fewer tasks. The variables are
the same on every replica, so the checkpoint restores whatever the group's size; each task's
input shard follows its index and the group's size in TF_CONFIG.

A step means the same before and after: one update of the model, ``job.steps_per_epoch`` of
them an epoch. What changes is the batch a step takes (``elastic.batch``):

- ``keep_per_replica`` (default): each replica's batch stays; the global batch shrinks with the
  group, and the learning rate with it where ``job.scale_learning_rate`` (the rule ``plan``
  shows: the per-replica rate times the replicas);
- ``keep_global``: the global batch and the learning rate stay; each replica's batch grows to
  the global batch over the workers left (``validate`` refuses a size it would not divide).

Replicas are counted as workers here: every task has the same GPUs (or one replica on CPU).
"""

from __future__ import annotations

from typing import Any

from orchestrator.errors import PlanError
from orchestrator.spec import ClusterSpec, ManagedJob


def resized(spec: ClusterSpec, workers: int) -> ClusterSpec:
    """``spec`` for a group of ``workers`` workers (``elastic.min_workers`` to ``max_workers``),
    its job's batch and learning rate by ``elastic.batch``.

    Raises:
        PlanError: ``keep_global``'s batch does not divide over ``workers`` (``validate``
            refuses such a spec; a spec built in Python may not have been).
    """
    if workers == spec.workers or spec.elastic is None:
        return spec
    update: dict[str, Any] = {"workers": workers}
    job = spec.job
    if isinstance(job, ManagedJob) and spec.elastic.batch == "keep_global":
        total = job.per_replica_batch_size * spec.workers
        per_replica, rest = divmod(total, workers)
        if rest:
            raise PlanError(f"the global batch of {total} does not split over {workers} workers",
                            fix="use elastic.batch: keep_per_replica, or a per-replica batch "
                                "every size divides")
        changes: dict[str, Any] = {"per_replica_batch_size": per_replica}
        if job.scale_learning_rate:  # the rate the full group had: base rate x replicas
            changes["learning_rate"] = job.learning_rate * spec.workers / workers
        update["job"] = job.model_copy(update=changes)
    return spec.model_copy(update=update)


def describe(spec: ClusterSpec, workers: int) -> str:
    """How a group of ``workers`` trains, for people: the batch and learning rate."""
    sized = resized(spec, workers)
    job = sized.job
    if not isinstance(job, ManagedJob):
        return f"{workers} worker(s)"
    rate = job.learning_rate * workers if job.scale_learning_rate else job.learning_rate
    return (f"{workers} worker(s): global batch {job.per_replica_batch_size * workers} "
            f"({job.per_replica_batch_size} per replica), learning rate {rate:g}")
