"""Stdlib-only: a task whose TF_CONFIG comes from its index in the group.

A scheduler that starts every task of a group from one template (a Kubernetes JobSet: one pod
template for all the workers) cannot give each task its own TF_CONFIG. It gives each its index
instead (JobSet's ``jobset.sigs.k8s.io/job-index`` annotation, through the Downward API), and
the pod's command is ``python -m worker.indexed ARGV...``, which reads

- ``ORCHESTRATE_TF_CLUSTER``: the cluster as TF_CONFIG names it (JSON, the same for all),
- ``ORCHESTRATE_TASK_TYPE``: ``chief`` or ``worker`` (one per replicated job),
- ``ORCHESTRATE_TASK_INDEX``: this task's index among its type,

sets ``TF_CONFIG`` and ``ORCHESTRATE_TASK`` (and, for a JAX job, whose template has
``KERAS_DISTRIBUTION_NUM_PROCESSES``, ``KERAS_DISTRIBUTION_PROCESS_ID``: the task's place in the
cluster, chief first) as the plan sets them for that task elsewhere, and
execs ARGV in its place (the same process: a SIGTERM to the pod reaches the task). A missing
or inconsistent value is an ``error`` event (phase ``launch``) and exit 2, never a guess.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence

CLUSTER_ENV = "ORCHESTRATE_TF_CLUSTER"
TYPE_ENV = "ORCHESTRATE_TASK_TYPE"
INDEX_ENV = "ORCHESTRATE_TASK_INDEX"
USAGE_EXIT = 2
PROCESSES_ENV = "KERAS_DISTRIBUTION_NUM_PROCESSES"
PROCESS_ID_ENV = "KERAS_DISTRIBUTION_PROCESS_ID"


class Refused(Exception):
    """The environment does not name one task of the cluster; the message says which value."""


def tf_config(environ: dict[str, str] | os._Environ[str]) -> tuple[str, str]:
    """(TF_CONFIG, ORCHESTRATE_TASK) of the task ``environ`` names.

    Raises:
        Refused: a value is missing, not what it should be, or names no task of the cluster.
    """
    missing = [name for name in (CLUSTER_ENV, TYPE_ENV, INDEX_ENV) if not environ.get(name)]
    if missing:
        raise Refused(f"{', '.join(missing)} not set: the pod template sets them")
    try:
        cluster = json.loads(environ[CLUSTER_ENV])
    except ValueError as exc:
        raise Refused(f"{CLUSTER_ENV} is not JSON ({exc})") from None
    if not isinstance(cluster, dict) or not all(
            isinstance(tasks, list) and all(isinstance(t, str) for t in tasks)
            for tasks in cluster.values()):
        raise Refused(f"{CLUSTER_ENV} is not a cluster ({{type: [host:port, ...]}})")
    kind, index = environ[TYPE_ENV], environ[INDEX_ENV]
    if kind not in cluster:
        raise Refused(f"{TYPE_ENV}={kind!r} is none of the cluster's task types "
                      f"({', '.join(sorted(cluster))})")
    if not index.isdigit() or int(index) >= len(cluster[kind]):
        raise Refused(f"{INDEX_ENV}={index!r} is not an index of the {len(cluster[kind])} "
                      f"{kind} task(s)")
    config = {"cluster": cluster, "task": {"type": kind, "index": int(index)}}
    return json.dumps(config, separators=(",", ":")), f"{kind}:{int(index)}"


def process_id(cluster: Mapping[str, Sequence[str]], kind: str, index: int) -> int:
    """The task's place among every task of ``cluster``, in its order (the chief first): its
    KERAS_DISTRIBUTION_PROCESS_ID, here from its index and in the controller's plan alike."""
    before = 0
    for each, endpoints in cluster.items():
        if each == kind:
            return before + index
        before += len(endpoints)
    raise Refused(f"{kind} is none of the cluster's task types")


def main(argv: list[str]) -> int:
    if not argv:
        sys.stderr.write("usage: python -m worker.indexed ARGV...\n")
        return USAGE_EXIT
    try:
        config, task = tf_config(os.environ)
    except Refused as exc:
        from worker.events import emit

        emit("error", phase="launch", type="Refused", message=str(exc), traceback="")
        return USAGE_EXIT
    os.environ["TF_CONFIG"] = config
    os.environ["ORCHESTRATE_TASK"] = task
    if os.environ.get(PROCESSES_ENV):  # a JAX job: which process of JAX's service this is
        parsed = json.loads(config)
        os.environ[PROCESS_ID_ENV] = str(process_id(parsed["cluster"], parsed["task"]["type"],
                                                    parsed["task"]["index"]))
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        from worker.events import emit

        emit("error", phase="launch", type=type(exc).__name__,
             message=f"cannot run {argv[0]!r}: {exc.strerror}", traceback="")
        return 127
    return 0  # not reached: exec replaced this process


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
