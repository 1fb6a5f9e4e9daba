"""JAX's coordination service in a process of its own, beside the chief's task.

JAX runs the service in process 0 (the chief): when the chief dies, every other process's
client finds the service gone and aborts within 0.1 s (measured, jax 0.10.2), before a
survivor could save the group's state. Run here, the service outlives the chief's process:
the others' steps fail on the lost peer, and the one the controller asks saves the state of
the last step it completed in the chief's place (``keras_jax``). JAX's own callback for the
service's errors cannot be replaced from Python (jaxlib 0.10.2 cannot hand a Python function
its ``absl::Status``: ``std::bad_cast``), hence the process.

    python -m worker.jax_service BIND_ADDRESS PROCESSES HEARTBEAT_S SHUTDOWN_S GRACE_S

It imports jaxlib alone (0.1 s, against about 0.5 s for JAX), says "serving" on its stdout
once it does (a port it cannot bind ends it at once, measured: a SIGSEGV in 0.2 s), and serves
while the chief holds its stdin open. The chief writes a line there to end it
(``keras_jax._Service``): once every process has left JAX's shutdown barrier (a clean end), or
as it exits at a planned stop (every process agreed the step and leaves). Its stdin closed
without one (the chief died), it serves ``GRACE_S`` more, for a survivor's snapshot: the
controller stops the task's process group, this process included, sooner. It ignores SIGTERM,
which a planned stop sends the whole group while the processes still agree their last step
through it.
"""

from __future__ import annotations

import os
import signal
import sys
import time


def main(argv: list[str]) -> int:
    bind, processes, heartbeat_s, shutdown_s, grace_s = argv
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from jaxlib import _jax

    service = _jax.get_distributed_runtime_service(
        bind, int(processes), heartbeat_timeout=int(heartbeat_s),
        shutdown_timeout=int(shutdown_s))
    print("serving", flush=True)  # the chief waits for this line (a bind that fails ends here)
    said = sys.stdin.readline().strip()  # "" at EOF: the chief is gone
    if not said:
        time.sleep(float(grace_s))
    del service
    sys.stdout.flush()
    os._exit(0)  # the service's own shutdown would wait for tasks that are gone


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
