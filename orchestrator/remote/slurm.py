"""A Slurm node's runner: commands run on the node as job steps of the allocation.

On Slurm the scheduler, not SSH, reaches a node: a command is a job step (``srun --jobid J
--nodelist NODE --overlap``) started from where Slurm is driven (this machine, or a login node
over SSH: the *submit* runner). A task is a job step too, whose ``srun`` client runs in the
usual launch wrapper on the submit side, so its output, exit code and process group are there
and the watch reads them without a step per poll (each step is a call to slurmctld). Files are
on a file system every node shares (the cluster's root), so they go through the submit side.
"""

from __future__ import annotations

import hashlib
import shlex
import time
from dataclasses import replace

from orchestrator.remote.base import (
    POLL_LOG_MAX,
    ExecResult,
    LaunchSpec,
    LogPoll,
    Runner,
    TaskHandle,
    TaskState,
    TaskStatus,
    quote_argv,
)

# How long a stop waits for srun to end once its step is cancelled, before it kills srun.
CANCEL_WAIT_S = 10.0
# The srun of a task, started by its launch wrapper: the step's name ends with the wrapper's
# pid ($PPID of this shell), which is the task's process-group id in its record.
SRUN_BY_WRAPPER = 'exec srun --job-name="$0-$PPID" "$@"'


def step_prefix(rc_path: str) -> str:
    """The start of the names of the steps of the task whose exit code goes to ``rc_path``."""
    return "orchestrate-" + hashlib.sha256(rc_path.encode()).hexdigest()[:12]


def step_name(handle: TaskHandle) -> str:
    """The job-step name of a started task: unique per launch (a warm task and the cold one
    that replaces it share an rc path, not a wrapper), and found again from the task's record
    alone (``down``, ``--attach``)."""
    return f"{step_prefix(handle.rc_path)}-{handle.pgid}"


def srun_options(job_id: str, node: str, *, gpus: int = 0) -> list[str]:
    """The ``srun`` options that run one task on ``node`` of allocation ``job_id``.

    ``--overlap``: a step shares the node's CPUs, memory and GPUs with the steps there (the
    task, a warm task waiting to take over, a doctor's probe), as it would as a process.
    """
    options = [f"--jobid={job_id}", f"--nodelist={node}", "--nodes=1", "--ntasks=1",
               "--overlap", "--kill-on-bad-exit=0"]
    if gpus:
        options.append(f"--gres=gpu:{gpus}")
    return options


class StepRunner(Runner):
    """Runs commands on one node of an allocation as job steps, through ``submit``."""

    def __init__(self, host_name: str, submit: Runner, job_id: str, node: str, *,
                 gpus: int = 0) -> None:
        super().__init__(host_name)
        self.submit = submit
        self.job_id = job_id
        self.node = node
        self.gpus = gpus

    # -- commands on the node ----------------------------------------------------------
    def _exec(self, script: str, timeout_s: float | None = None,
              input: str | None = None) -> ExecResult:
        argv = ["srun", *srun_options(self.job_id, self.node), "--quiet", "sh", "-c", script]
        return self.submit._exec(quote_argv(argv), timeout_s=timeout_s, input=input)

    # -- files: on the shared file system, through the submit side ----------------------
    def put_file(self, local_path: str, remote_path: str, mode: int | None = None) -> None:
        self.submit.put_file(local_path, remote_path, mode)

    def get_file(self, remote_path: str, local_path: str) -> None:
        self.submit.get_file(remote_path, local_path)

    # -- tasks: job steps whose srun client is in a launch wrapper on the submit side ----
    def start(self, spec: LaunchSpec) -> TaskHandle:
        argv = ("sh", "-c", SRUN_BY_WRAPPER, step_prefix(spec.rc_path),
                *srun_options(self.job_id, self.node, gpus=self.gpus), *spec.argv)
        handle = self.submit.start(replace(spec, argv=argv))
        return TaskHandle(self.host_name, handle.pgid, handle.log_path, handle.rc_path)

    def poll(self, handle: TaskHandle) -> TaskStatus:
        return self.submit.poll(handle)

    def poll_log(self, handle: TaskHandle, offset: int, *, status: bool = True,
                 limit: int = POLL_LOG_MAX) -> LogPoll:
        return self.submit.poll_log(handle, offset, status=status, limit=limit)

    def read_log(self, handle: TaskHandle, offset: int) -> tuple[bytes, int]:
        return self.submit.read_log(handle, offset)

    def end_polls(self) -> None:
        self.submit.end_polls()

    def signal(self, handle: TaskHandle, sig: str) -> None:
        """``sig`` to the task's step (``scancel --signal``), else to its srun client, which
        passes it on to the step."""
        if not self._cancel(handle, sig):
            self.submit.signal(handle, sig)

    def _group_alive(self, handle: TaskHandle) -> bool:
        return self.submit.poll(handle).state is TaskState.RUNNING

    def stop(self, handle: TaskHandle, grace_s: float = 5.0) -> TaskStatus:
        """TERM the step (every task saves at one step and exits), then cancel it with KILL
        after ``grace_s``; 0 cancels at once. The srun client ends with its step (and is
        killed if it has not within ``CANCEL_WAIT_S``)."""
        status = self.submit.poll(handle)
        if status.state is not TaskState.RUNNING:
            self._cancel(handle, "KILL")  # a client killed alone leaves its step running
            return status
        if grace_s > 0:
            self.signal(handle, "TERM")
            status = self._ended(handle, grace_s)
            if status.state is not TaskState.RUNNING:
                return status
        self._cancel(handle, "KILL")
        status = self._ended(handle, CANCEL_WAIT_S)
        if status.state is TaskState.RUNNING:
            self.submit.signal(handle, "KILL")
            status = self.submit.poll(handle)
        return status

    def _ended(self, handle: TaskHandle, within_s: float) -> TaskStatus:
        """The task's status once its srun client has ended, or after ``within_s``."""
        deadline = time.monotonic() + within_s
        while True:
            status = self.submit.poll(handle)
            if status.state is not TaskState.RUNNING or time.monotonic() >= deadline:
                return status
            time.sleep(0.2)

    def process_states(self, handle: TaskHandle, python: str, timeout_s: float = 15.0) -> str:
        """State letters of the step's processes on the node (``scontrol listpids``)."""
        steps = self.steps(handle)
        if not steps:
            return ""
        pids = " ".join(f"$(scontrol listpids {shlex.quote(s)} 2>/dev/null | "
                        "awk 'NR>1 && $1 ~ /^[0-9]+$/ {print $1}')" for s in steps)
        script = (f"for p in {pids}; do s=$(ps -o state= -p \"$p\" 2>/dev/null) && "
                  "printf %s \"$s\"; done; true")
        return self.run(script, timeout_s=timeout_s).stdout.strip()

    # -- the step, found by its name ----------------------------------------------------
    def steps(self, handle: TaskHandle) -> list[str]:
        """The ids (``JOB.STEP``) of the task's steps still known to Slurm, in any of the
        user's allocations (a warm task may wait in one that was since replaced)."""
        listing = self.submit.run(
            ["squeue", "--noheader", "--steps", "--me", "--format=%i %j"],
            check=False, timeout_s=30).stdout
        name = step_name(handle)
        return [words[0] for words in (line.split() for line in listing.splitlines())
                if len(words) == 2 and words[1] == name]

    def _cancel(self, handle: TaskHandle, sig: str) -> bool:
        """``sig`` to the task's steps; whether there were any."""
        steps = self.steps(handle)
        if steps:
            self.submit.run(["scancel", "--quiet", f"--signal={sig}", *steps],
                            check=False, timeout_s=30)
        return bool(steps)

    def close(self) -> None:
        """The submit runner is the provider's, shared by every node's runner."""
