"""Why an attempt ended: the failure causes, defined once for the spec, the watch and the supervisor."""

from __future__ import annotations

import enum


class Cause(str, enum.Enum):
    CRASHED = "crashed"  # a task exited non-zero or was killed
    HOST_LOST = "host_lost"  # a host stopped answering (killed, cut off, shut down)
    PREEMPTED = "preempted"  # the cloud took a spot VM back
    HUNG = "hung"  # alive but no progress for timeouts.hang_s
    STARTUP_TIMEOUT = "startup_timeout"  # not every task reached its first step in time
    PORT_CONFLICT = "port_conflict"  # a task's gRPC port was taken
    USER_ERROR = "user_error"  # the user's code fails before training: not retried
    ENGINE_ERROR = "engine_error"  # the host's container engine could not start the task
    CHECKPOINT_MISMATCH = "checkpoint_mismatch"  # tasks restored different checkpoints
    CANCELLED = "cancelled"  # Ctrl-C
    STOPPED = "stopped"  # 'orchestrate down' (maybe from another process) stopped the run
    RESIZED = "resized"  # an elastic group stopped (every task saved) to train at another size


RETRYABLE = frozenset({Cause.CRASHED, Cause.HOST_LOST, Cause.PREEMPTED, Cause.HUNG,
                       Cause.STARTUP_TIMEOUT, Cause.PORT_CONFLICT, Cause.RESIZED})
# Stops of a whole group: SIGTERM, and a grace for every task to save at the same step. (So is
# a preemption that every task saved for; one seen as a lost host left a broken group.)
PLANNED = frozenset({Cause.STOPPED, Cause.CANCELLED, Cause.RESIZED})
# Failures that say what happened and leave nothing to wait for: the first restart after one
# starts at once (a crash is a process gone, a preemption a machine the repair replaces).
# Whatever may clear up with time (a hang, a port, a host, a slow start) waits its backoff.
IMMEDIATE = frozenset({Cause.CRASHED, Cause.PREEMPTED})
# The causes a spec may give a restart budget (retry.per_cause), in the order messages list them:
# a resize is the group growing back, planned, and costs no restart.
BUDGETED = tuple(c.value for c in Cause if c in RETRYABLE and c is not Cause.RESIZED)
