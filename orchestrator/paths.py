"""Where everything lives: the one home of every path formula of a cluster and its runs, on this
machine (state, mirrors, fetched models, provider files) and on the hosts (code, lib, run dirs)."""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass
from pathlib import Path

CLUSTERS = "clusters"
HOME_SUBDIR = ".orchestrate"
# Written by ``up`` in a host root it creates, holding the cluster's name: ``down`` deletes a
# root only when this names its cluster, so it never deletes a directory it did not make.
ROOT_MARKER = ".orchestrate-cluster"
# Directories a cluster's root must never be: ``down`` deletes the root it made. Any top-level
# ``lib*`` too, and every ``/home/NAME`` and ``/Users/NAME`` (someone's home).
SYSTEM_DIRS = frozenset({
    "/bin", "/boot", "/dev", "/etc", "/home", "/lost+found", "/media", "/mnt", "/nix", "/opt",
    "/proc", "/root", "/run", "/sbin", "/snap", "/srv", "/sys", "/tmp", "/usr", "/var",
    "/usr/bin", "/usr/include", "/usr/lib", "/usr/lib64", "/usr/libexec", "/usr/local",
    "/usr/local/bin", "/usr/local/lib", "/usr/local/share", "/usr/sbin", "/usr/share", "/usr/src",
    "/var/backups", "/var/cache", "/var/lib", "/var/log", "/var/mail", "/var/opt", "/var/run",
    "/var/spool", "/var/tmp", "/var/www",
    "/Applications", "/Library", "/System", "/Users", "/Volumes", "/private",
})
HOME_PARENTS = ("/home", "/Users")


# -- this machine ------------------------------------------------------------------------------
def home() -> Path:
    """The per-user directory for state and local runs: $ORCHESTRATE_HOME or ~/.orchestrate."""
    env = os.environ.get("ORCHESTRATE_HOME")
    return Path(env).expanduser() if env else Path.home() / HOME_SUBDIR


def state_db() -> Path:
    return home() / "state.db"


def price_cache(source: str) -> Path:
    """Prices read from a cloud's catalog (``source``: e.g. gcp-billing-catalog), shared by
    every cluster of this machine (orchestrator/cost.py)."""
    return home() / "prices" / f"{source}.json"


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
def normalise_root(root: str) -> str:
    """``root`` without ``.``, ``..``, repeated or trailing slashes: ``/a//b/../c/`` -> ``/a/c``."""
    if not root.startswith("/"):
        return root
    return "/" + posixpath.normpath(root).lstrip("/")


def unsafe_root(root: str, home: str | None = None) -> str | None:
    """Why ``root`` cannot be a cluster's directory on a host, or None when it can.

    ``down`` deletes the root that ``up`` made, so it must be a directory of its own: not ``/``,
    a system directory, someone's home directory (``/home/NAME``; ``home``, the SSH user's
    home on the host, when known) or an ancestor of ``home``. Pure: the spec's validator can
    call it with the root alone, a provider at the point of use with the home it found.
    """
    if not root.startswith("/"):
        return "not an absolute path"
    norm = normalise_root(root)
    parent = posixpath.dirname(norm)
    if norm == "/":
        return "the file system's root"
    if norm in SYSTEM_DIRS or (parent == "/" and norm.startswith("/lib")):
        return f"the system directory {norm}"
    if parent in HOME_PARENTS:
        return f"a home directory ({norm})"
    if home and home.startswith("/"):
        home = normalise_root(home)
        if norm == home:
            return f"the SSH user's home directory ({home})"
        if home.startswith(norm + "/"):
            return f"an ancestor of the SSH user's home directory {home}"
    return None


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
    def tensorboard_dir(self) -> str:
        """Where the chief writes TensorBoard logs unless ``tensorboard.dir`` names a place."""
        return f"{self.run_dir}/tensorboard"

    @property
    def chief_checkpoint_dir(self) -> str:
        """What the chief writes and every task restores from."""
        return f"{self.checkpoint_dir}/chief"

    def task_stem(self, attempt: int, role: str, index: int) -> str:
        """The log (``.log``), exit code (``.rc``) and pid (``.pid``) of one task, less suffix."""
        return f"{self.logs_dir}/attempt-{attempt}/{role}-{index}"
