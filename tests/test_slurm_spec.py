"""The slurm provider's section of the spec, and what `plan` shows of it (no Slurm needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator import plan as planning
from orchestrator import spec
from orchestrator.errors import SpecError
from orchestrator.providers import for_spec
from orchestrator.providers.slurm import NEVER, REASONS, SlurmProvider, explain
from orchestrator.remote.base import TaskHandle
from orchestrator.remote.slurm import srun_options, step_name, step_prefix

SLURM = """\
name: sl
workers: 3
job:
  module: examples.digits
provider:
  kind: slurm
"""
REPO = Path(__file__).resolve().parent.parent


def test_a_minimal_slurm_provider_loads_with_defaults() -> None:
    s = spec.parse(SLURM)
    assert isinstance(s.provider, spec.SlurmProvider)
    assert s.provider.login is None and s.provider.partition is None
    assert s.provider.gpus_per_node == 0 and s.provider.queue_timeout_s == 3600


@pytest.mark.parametrize(("value", "seconds"), [
    ("90", 5400), ("10:30", 630), ("4:00:00", 14400), ("1-0", 86400), ("2-12:30", 217800),
    ("1-00:00:05", 86405)])
def test_slurm_time_formats_are_read_as_sbatch_reads_them(value: str, seconds: int) -> None:
    assert spec.slurm_seconds(value) == seconds
    assert spec.parse(SLURM + f"  time: '{value}'\n").provider.time == value  # type: ignore[union-attr]


@pytest.mark.parametrize(("extra", "field", "says", "fix"), [
    ("  time: 1h\n", "provider.time", "not a Slurm time limit", "4:00:00"),
    ("  time: '0:30'\n", "provider.time", "under a minute", "at least one minute"),
    ("  partition: 'gpu main'\n", "provider.partition", "should match", None),
    ("  sbatch: [--nodes=4]\n", "provider.sbatch", "--nodes is set by the orchestrator",
     "remove '--nodes=4'"),
    ("  sbatch: [--time=10]\n", "provider.sbatch", "--time is set by the orchestrator",
     "set provider.time instead"),
    ("  sbatch: [exclusive]\n", "provider.sbatch", "not an sbatch option", "starting with '-'"),
    ("  gpus_per_node: -1\n", "provider.gpus_per_node", "greater than or equal to 0", None),
    ("  login: {address: 'login 1', user: me, key_file: k}\n", "provider.login.address",
     "neither an IP address nor a valid host name", None),
    ("  login: {address: login1, key_file: k}\n", "provider.login.user",
     "required field is missing", None),
    ("  login: {address: login1, user: me, key_file: k, host_key: AAAA}\n",
     "provider.login.host_key", "OpenSSH public key line", "ssh-keyscan"),
    ("  nodes: 3\n", "provider.nodes", "unknown key 'nodes'", None),
])
def test_bad_slurm_values_name_the_field_and_the_fix(extra: str, field: str, says: str,
                                                     fix: str | None) -> None:
    with pytest.raises(SpecError) as info:
        spec.parse(SLURM + extra, file="cluster.yaml")
    err = info.value
    assert err.field == field, str(err)
    assert says in str(err)
    if fix is not None:
        assert err.fix is not None and fix in err.fix


def test_plan_shows_the_sbatch_and_srun_lines_and_one_shared_checkpoint_dir(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(SLURM.replace("module: examples.digits", "module: examples.digits\n"
                                  f"workdir: {REPO}") + "  partition: main\n  time: '2:00:00'\n"
                    "  gpus_per_node: 2\n  sbatch: [--exclusive]\n")
    loaded = spec.load(path)
    provider = for_spec(loaded, path)
    creates = provider.describe()
    assert creates is not None
    sbatch = creates["slurm"]["sbatch"]
    for part in ("sbatch --parsable", "--nodes=3", "--ntasks-per-node=1", "--no-kill",
                 "--partition=main", "--time=2:00:00", "--gpus-per-node=2", "--exclusive"):
        assert part in sbatch
    assert "--overlap" in creates["slurm"]["srun"] and "--gres=gpu:2" in creates["slurm"]["srun"]
    # a replacement node's allocation: one node, not the group's, the user's own --exclude kept
    assert isinstance(provider, SlurmProvider)
    loaded_x = loaded.model_copy(update={"provider": loaded.provider.model_copy(
        update={"sbatch": ("--exclusive", "--exclude=bad1")})})
    one = SlurmProvider(loaded_x, path).sbatch_options("/r", nodes=1, exclude=("n1", "n2"))
    assert "--nodes=1" in one and "--exclude=bad1,n1,n2" in one
    assert sum(o.startswith("--exclude") for o in one) == 1 and "--exclusive" in one
    hosts = provider.planned_hosts()
    built = planning.build(loaded, hosts, run_id="r1", python="python3", local_workdir=str(REPO))
    assert built.checkpoints.shared and len(set(built.checkpoints.dirs.values())) == 1
    assert len({t.host.machine for t in built.tasks}) == 3  # a node each: one port each is fine
    assert all(t.cwd.endswith("/code") for t in built.tasks)  # the synced code, not this machine's
    assert json.loads(built.tasks[1].env["TF_CONFIG"])["task"] == {"type": "worker", "index": 1}
    shown = subprocess.run([sys.executable, "-m", "orchestrator.cli", "plan", str(path)],
                           capture_output=True, text=True, timeout=120, cwd=REPO,
                           env={**os.environ, "ORCHESTRATE_HOME": str(tmp_path / "home")})
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert "once, to the cluster's shared root" in shown.stdout  # not once per node
    assert "sbatch --parsable" in shown.stdout and "--no-kill" in shown.stdout


def test_a_task_step_is_named_from_its_record_alone() -> None:
    first = "/r/runs/1/logs/attempt-1/worker-0.rc"
    warm, cold = TaskHandle("h", 101, "log", first), TaskHandle("h", 202, "log", first)
    # a warm task and the cold one that replaces it share the rc path, not the name
    assert step_name(warm) != step_name(cold)
    assert step_name(warm) == step_name(TaskHandle("other", 101, "other.log", first))
    assert step_name(warm).startswith(step_prefix(first))
    assert step_prefix(first) != step_prefix(first.replace("attempt-1", "attempt-2"))
    assert srun_options("17", "n2")[:2] == ["--jobid=17", "--nodelist=n2"]


def test_every_pending_reason_has_words_and_the_hopeless_ones_a_fix() -> None:
    assert explain("Resources") == REASONS["Resources"]
    assert explain("SomethingNew") == "SomethingNew"
    assert all("provider." in fix or "admin" in fix for fix in NEVER.values())
