"""How commands reach a host: a local subprocess or SSH (paramiko), behind one Runner interface."""

from orchestrator.remote.base import (
    ExecResult,
    LaunchSpec,
    Runner,
    TaskHandle,
    TaskState,
    TaskStatus,
)

__all__ = ["ExecResult", "LaunchSpec", "Runner", "TaskHandle", "TaskState", "TaskStatus"]
