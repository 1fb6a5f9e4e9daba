"""Move training state between hosts: the chief's checkpoint before a relaunch, the model after."""

from __future__ import annotations

import shlex
import tempfile
from collections.abc import Callable
from pathlib import Path

from orchestrator.hosts import Host
from orchestrator.plan import ClusterPlan
from orchestrator.remote.base import Runner
from orchestrator.remote.fanout import fan_out

RunnerFor = Callable[[Host], Runner]


def share_chief_checkpoint(plan: ClusterPlan, runner_for: RunnerFor) -> list[str]:
    """Copy the chief's ``checkpoints/chief`` to every other machine of the plan.

    Every task restores from ``checkpoints/chief`` on its own disk, so without the
    copy the others would start from step 0 and the group would disagree.
    Returns the names of the hosts that received it (none when there is no
    checkpoint yet, or all tasks share the chief's machine).
    """
    chief = plan.chief.host
    targets = list({t.host.machine: t.host for t in plan.tasks
                    if t.host.machine != chief.machine}.values())
    source = f"{plan.paths[chief.name].checkpoint_dir}/chief"
    runner = runner_for(chief)
    if not targets or not runner.run(["test", "-f", f"{source}/checkpoint"], check=False).ok:
        return []
    archive = f"{plan.paths[chief.name].run_dir}/chief-checkpoint.tar.gz"
    runner.run(["tar", "-C", source, "-czf", archive, "."])
    with tempfile.TemporaryDirectory(prefix="orchestrate-ckpt-") as scratch:
        local = str(Path(scratch) / "chief-checkpoint.tar.gz")
        runner.get_file(archive, local)

        def install(host: Host) -> None:
            dest = f"{plan.paths[host.name].checkpoint_dir}/chief"
            remote_archive = f"{plan.paths[host.name].run_dir}/chief-checkpoint.tar.gz"
            target = runner_for(host)
            target.put_file(local, remote_archive)
            q = shlex.quote
            target.run(f"rm -rf {q(dest)} && mkdir -p {q(dest)} && "
                       f"tar -C {q(dest)} -xzf {q(remote_archive)} && rm -f {q(remote_archive)}")

        fan_out(targets, install, name_of=lambda h: h.name).raise_if_failed(
            "copy the chief's checkpoint")
    return [h.name for h in targets]


def fetch_file(host: Host, runner: Runner, remote_path: str, local_dir: Path) -> str:
    """Download one file from ``host`` into ``local_dir``; returns the local path."""
    local = local_dir / Path(remote_path).name
    local_dir.mkdir(parents=True, exist_ok=True)
    runner.get_file(remote_path, str(local))
    return str(local)
