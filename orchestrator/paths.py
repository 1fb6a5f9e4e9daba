"""Where everything lives: the one home of every path formula of a cluster and its runs, on this
machine (state, mirrors, fetched models, provider files) and on the hosts (code, lib, run dirs)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

CLUSTERS = "clusters"
HOME_SUBDIR = ".orchestrate"


# -- this machine ------------------------------------------------------------------------------
def home() -> Path:
    """The per-user directory for state and local runs: $ORCHESTRATE_HOME or ~/.orchestrate."""
    env = os.environ.get("ORCHESTRATE_HOME")
    return Path(env).expanduser() if env else Path.home() / HOME_SUBDIR


def state_db() -> Path:
    return home() / "state.db"


def cluster_home(cluster: str) -> Path:
    """This machine's directory of one cluster (local tasks' root, provider files, runs)."""
    return home() / CLUSTERS / cluster


def run_home(cluster: str, run_id: str) -> Path:
    """This machine's directory of one run: the checkpoint mirror and the fetched model."""
    return cluster_home(cluster) / "runs" / run_id


def mirror_dir(cluster: str, run_id: str) -> Path:
    return run_home(cluster, run_id) / "mirror"


def fetched_model_dir(cluster: str, run_id: str) -> Path:
    return run_home(cluster, run_id) / "model"


def key_dir(cluster: str) -> Path:
    """The cluster's own SSH key pair, for providers that put its public half on their machines."""
    return cluster_home(cluster) / "ssh"


def hosts_cache(cluster: str, kind: str) -> Path:
    """The hosts as the last ``up`` reached them, so later commands need not ask again."""
    return cluster_home(cluster) / f"{kind}.json"


def operations_journal(cluster: str, kind: str) -> Path:
    """Cloud operations in flight, so that a ``down`` after an interrupted ``up`` waits for them."""
    return cluster_home(cluster) / f"{kind}-operations.json"


# -- on a host ---------------------------------------------------------------------------------
def host_root(home_dir: str, cluster: str) -> str:
    """A host's directory of one cluster, under its SSH user's home directory."""
    return f"{home_dir}/{HOME_SUBDIR}/{CLUSTERS}/{cluster}"


def code_dir(root: str) -> str:
    """Where ``up`` syncs the user's workdir on an SSH host."""
    return f"{root}/code"


def lib_dir(root: str) -> str:
    """Where ``up`` syncs the ``worker`` package on an SSH host (on the tasks' PYTHONPATH)."""
    return f"{root}/lib"


@dataclass(frozen=True)
class RunPaths:
    """Where one run keeps its files on a host."""

    run_dir: str
    checkpoint_dir: str
    model_dir: str
    logs_dir: str

    @classmethod
    def of(cls, root: str, run_id: str) -> RunPaths:
        run_dir = f"{root}/runs/{run_id}"
        return cls(run_dir=run_dir, checkpoint_dir=f"{run_dir}/checkpoints",
                   model_dir=f"{run_dir}/model", logs_dir=f"{run_dir}/logs")

    @property
    def chief_checkpoint_dir(self) -> str:
        """What the chief writes and every task restores from."""
        return f"{self.checkpoint_dir}/chief"

    def task_stem(self, attempt: int, role: str, index: int) -> str:
        """The log (``.log``), exit code (``.rc``) and pid (``.pid``) of one task, less suffix."""
        return f"{self.logs_dir}/attempt-{attempt}/{role}-{index}"
