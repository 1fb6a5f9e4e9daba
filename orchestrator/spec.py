"""Pydantic models of the cluster spec file, and `load()` that turns bad input into one SpecError."""

from __future__ import annotations

import difflib
import errno
import ipaddress
import os
import re
import shlex
import stat
import types
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails, InitErrorDetails, PydanticCustomError

from orchestrator import paths
from orchestrator.causes import BUDGETED
from orchestrator.errors import SpecError
from orchestrator.hosts import is_loopback, machine_id

# Patterns are matched whole: by pydantic's `pattern=` (Rust regex, where `$` is the end of the
# text) and here with re.fullmatch (re.match's `$` would accept a trailing newline).
NAME_RE = r"^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$"
ENV_NAME_RE = r"^[A-Za-z_][A-Za-z0-9_]*$"
MODULE_RE = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"
USER_RE = r"^[a-z_][a-z0-9_.-]*[$]?$"
RESERVED_ENV = ("TF_CONFIG", "ORCHESTRATE_")
# What the plan puts in every task's environment over the spec's env (plan.py, runtimes/):
# the spec's value would be silently lost. tests/test_plan.py keeps this list complete.
PLAN_ENV = {
    "PYTHONPATH": "the task's path is the code dir (workdir) and the worker package: put your "
                  "modules under workdir",
    "PYTHONUNBUFFERED": "the orchestrator reads the tasks' output as it is written",
    "TF_USE_LEGACY_KERAS": "set job.keras instead",
    "KERAS_BACKEND": "set job.backend instead (a Keras 3 job's tasks get its backend)",
}

# Bounds that every real job fits, and that keep later arithmetic, sleeps and launches sane
# (an .inf grace makes 'down' wait forever; a huge backoff overflows the sleep).
MAX_TIMEOUT_S = 7 * 24 * 3600.0
MAX_BACKOFF_S = 24 * 3600.0
MAX_STEPS = 10**9
MAX_EPOCHS = 10**6
MAX_BATCH = 1 << 20
MAX_LEARNING_RATE = 100.0
MAX_RESTARTS = 1000  # the backoff doubles per restart: 2.0 ** 1024 overflows a float
MAX_SEED = 2**32 - 1  # numpy's seed, which keras.utils.set_random_seed sets, is a uint32
# A launch fails with "Argument list too long" past the kernel's limits (128 KiB a string).
MAX_ENV_VALUE_BYTES = 32 << 10
MAX_ENV_BYTES = 128 << 10
MAX_PATH_BYTES = 4096  # PATH_MAX
MAX_NAME_BYTES = 255  # NAME_MAX: one path component


class Invalid(ValueError):
    """A validator's refusal with its fix, which the loader puts on the SpecError."""

    def __init__(self, message: str, *, fix: str) -> None:
        super().__init__(message)
        self.fix = fix


class Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _strict_scalars(cls, data: Any) -> Any:
        """Pydantic's lax mode reads true as 1, and 1 or "yes" as true: a typo that changes the
        job. A NUL character would fail the launch much later, far from the spec."""
        if isinstance(data, dict):
            for name, value in data.items():
                field = cls.model_fields.get(name) if isinstance(name, str) else None
                problem = field and _scalar_problem(field.annotation, value, (name,))
                if problem:
                    message, fix, loc, received = problem
                    raise ValidationError.from_exception_data(cls.__name__, [InitErrorDetails(
                        type=PydanticCustomError("scalar_type", message, {"fix": fix}),
                        loc=loc, input=received)])
        return data


def _scalar_problem(annotation: Any, value: Any, loc: tuple[str | int, ...]
                    ) -> tuple[str, str, tuple[str | int, ...], Any] | None:
    """(message, fix, location, value) of the first scalar in ``value`` of the wrong kind for
    ``annotation``: a boolean for a number, a number or a word for a boolean, a NUL character."""
    if isinstance(value, str) and "\0" in value:
        return "contains a NUL character", "remove it", loc, value
    origin = get_origin(annotation)
    if origin is dict and isinstance(value, dict):
        for key, item in value.items():
            problem = (_scalar_problem(str, key, loc)
                       or _scalar_problem(get_args(annotation)[1], item, (*loc, key)))
            if problem:
                return problem
        return None
    if origin is tuple and isinstance(value, list | tuple):
        for i, item in enumerate(value):
            problem = _scalar_problem(get_args(annotation)[0], item, (*loc, i))
            if problem:
                return problem
        return None
    kinds, literals = _scalar_kinds(annotation)
    if isinstance(value, bool):
        if bool not in kinds and kinds & {int, float}:
            return ("expected a number, not a boolean",
                    "write a number (true and false are not numbers)", loc, value)
    elif (bool in kinds and not kinds & {int, float} and isinstance(value, int | float | str)
          and value not in literals):
        return "expected true or false", "write true or false", loc, value
    return None


def _scalar_kinds(annotation: Any) -> tuple[set[type], set[Any]]:
    """The scalar types an annotation accepts, and its Literal values."""
    origin = get_origin(annotation)
    if origin is Literal:
        values = set(get_args(annotation))
        return {type(v) for v in values}, values
    if origin is Annotated:
        return _scalar_kinds(get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        kinds: set[type] = set()
        literals: set[Any] = set()
        for arg in get_args(annotation):
            more, values = _scalar_kinds(arg)
            kinds |= more
            literals |= values
        return kinds, literals
    return ({annotation} if annotation in (int, float, bool, str) else set()), set()


class LocalProvider(Model):
    """Every task is a process on this machine, on loopback ports. Needs no cloud and no SSH."""

    kind: Literal["local"] = "local"
    python: str | None = Field(
        default=None,
        description="Interpreter for the tasks; default: the one running the controller.",
    )
    private_network: bool | Literal["auto"] = Field(
        default="auto",
        description="Run the tasks in a network namespace of their own (loopback only), so "
        "no other machine reaches TensorFlow's unauthenticated gRPC ports. auto: where this "
        "machine allows unprivileged user namespaces, else its network, with a note; true: "
        "refuse to start without it.")


_HOSTNAME_LABEL = r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)"


def check_address(value: str) -> str:
    """An IP address or a DNS host name, as the tasks and SSH use it: an IPv6 address is
    stored bare (``::1``, also written ``[::1]``); endpoints put the brackets back."""
    bare = value[1:-1] if value.startswith("[") and value.endswith("]") else value
    try:
        ip = ipaddress.ip_address(bare)
    except ValueError:
        ip = None
    if ip is not None:
        if bare != value and ip.version != 6:
            raise Invalid(f"{value!r}: only an IPv6 address is written in brackets",
                          fix=f"write {bare}")
        return bare
    fix = "write an IP address (10.0.0.2, fd00::2 or [fd00::2]) or a host name (node-1.example.com)"
    if "@" in value:
        fix = "write only the host here, and the user in 'user:'"
    elif re.fullmatch(r"[^:]+:[0-9]+", value):
        fix = "write only the host here, and the port in 'ssh_port:' (or 'task_port:')"
    labels = value[:-1].split(".") if value.endswith(".") else value.split(".")
    if (len(value) > 253 or not all(re.fullmatch(_HOSTNAME_LABEL, label) for label in labels)
            or labels[-1].isdigit()):
        raise Invalid(f"{value!r} is neither an IP address nor a valid host name", fix=fix)
    return value


def check_local_path(value: str) -> str:
    """A path on this machine: refuses what the OS would refuse with an error far from here."""
    if any(c in value for c in "\0\n\r"):
        raise Invalid("the path contains a control character", fix="remove it")
    if len(value.encode()) > MAX_PATH_BYTES or any(
            len(part.encode()) > MAX_NAME_BYTES for part in value.split("/")):
        raise Invalid(f"the path is longer than the file system allows ({MAX_PATH_BYTES} bytes, "
                      f"{MAX_NAME_BYTES} per name)", fix="give a shorter path")
    return value


class StaticHost(Model):
    """A machine you already have, reached over SSH."""

    address: str = Field(min_length=1, description="Where the other tasks reach this host (internal "
                         "IP or host name; IPv6 as fd00::2 or [fd00::2]).")
    ssh_address: str | None = Field(
        default=None, description="Where the controller connects over SSH; default: address."
    )
    ssh_port: int = Field(default=22, ge=1, le=65535)
    user: str = Field(pattern=USER_RE, max_length=32)
    key_file: str = Field(min_length=1, description="Private key for this user (no agent is used).")
    host_key: str | None = Field(
        default=None, description="The host's public key line, e.g. 'ssh-ed25519 AAAA...'."
    )
    task_port: int | None = Field(default=None, ge=1024, le=65535)
    name: str | None = Field(default=None, pattern=NAME_RE)

    @field_validator("address", "ssh_address")
    @classmethod
    def _address(cls, value: str | None) -> str | None:
        return None if value is None else check_address(value)

    @field_validator("key_file")
    @classmethod
    def _key_file(cls, value: str) -> str:
        return check_local_path(value)

    @field_validator("host_key")
    @classmethod
    def _key_line(cls, value: str | None) -> str | None:
        if value is not None and len(value.split()) < 2:
            raise Invalid(
                "expected an OpenSSH public key line such as 'ssh-ed25519 AAAA...'",
                fix="copy it from 'ssh-keyscan HOST' or /etc/ssh/ssh_host_ed25519_key.pub on the host",
            )
        return value


class SSHHosts(Model):
    """What every provider whose hosts are reached over SSH shares: how tasks run there."""

    python: str = Field(default="python3", description="Interpreter with TensorFlow on the hosts.")
    root: str | None = Field(
        default=None,
        description="Absolute directory on every host for this cluster's files; "
        "default: ~/.orchestrate/clusters/NAME of the SSH user.",
    )
    setup: tuple[str, ...] = Field(
        default=(), description="Shell commands run in the synced code dir by 'up' (e.g. pip install)."
    )
    sync_excludes: tuple[str, ...] = Field(
        default=(".git", "__pycache__", "*.pyc", ".venv", "outputs"),
        description="Glob patterns left out when uploading workdir.",
    )
    sync_secrets: tuple[str, ...] = Field(
        default=(), description="Secret paths 'up' uploads anyway (glob patterns, as "
        "sync_excludes): by default keys, credentials and the orchestrator's own state are "
        "left out of the upload.")
    allow_home_workdir: bool = Field(
        default=False, description="Upload a workdir that is /, your home directory or one of "
        "its ancestors (secrets are still left out).")
    connect_timeout_s: float = Field(default=10.0, gt=0, le=MAX_TIMEOUT_S)

    @field_validator("root")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if not value.startswith("/"):
            raise Invalid(f"must be an absolute path, received {value!r}",
                          fix="write a path that starts with /, or leave root out")
        why = paths.unsafe_root(value)
        if why is not None:
            raise Invalid(f"{why}: 'down' deletes the cluster's root, so it must be a "
                          "directory of its own",
                          fix="name a directory of its own, e.g. /srv/orchestrate/CLUSTER or "
                          "/data/NAME (created by 'up'), or leave root out")
        return paths.normalise_root(value)


class StaticProvider(SSHHosts):
    """Attach to listed hosts over SSH. Nothing is created or deleted in any cloud."""

    kind: Literal["static"] = "static"
    hosts: tuple[StaticHost, ...] = Field(min_length=1)
    known_hosts: str | None = Field(
        default=None, description="known_hosts file consulted when a host has no host_key."
    )
    trust_on_first_use: bool = Field(
        default=False, description="Accept and record unknown host keys (in known_hosts). Unsafe."
    )
    wait_for_host_s: float = Field(
        default=60.0, ge=0, le=MAX_TIMEOUT_S,
        description="How long 'up' retries a host that does not answer.",
    )

    @field_validator("known_hosts")
    @classmethod
    def _known_hosts(cls, value: str | None) -> str | None:
        return None if value is None else check_local_path(value)


GCP_PROJECT_RE = r"^[a-z][-a-z0-9]{4,28}[a-z0-9]$"
GCP_ZONE_RE = r"^[a-z]+-[a-z]+[0-9]+-[a-z]$"  # REGION-LOCATIONDIGIT-LETTER: us-central1-a
GCP_NAME_RE = r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$"
GCP_LABEL_KEY_RE = r"^[a-z][-_a-z0-9]{0,62}$"
GCP_LABEL_VALUE_RE = r"^[-_a-z0-9]{0,63}$"
GCP_METADATA_KEY_RE = r"^[A-Za-z0-9_-]{1,128}$"
GCP_RESERVED_METADATA = ("ssh-keys", "enable-guest-attributes")
# OS Login replaces metadata SSH keys: the orchestrator's own key (in ssh-keys) would be refused.
GCP_OS_LOGIN_METADATA = "enable-oslogin"
GCP_RESERVED_LABEL = "orchestrate-cluster"
DLVM_IMAGE = "projects/deeplearning-platform-release/global/images/family/common-cu128-ubuntu-2204-nvidia-570"


class GcpAccelerator(Model):
    """GPUs attached to each VM. A2, A3 and G2 machine types come with theirs: leave this out."""

    type: str = Field(pattern=GCP_NAME_RE, description="Accelerator type, e.g. nvidia-tesla-t4, nvidia-l4.")
    count: int = Field(default=1, ge=1, le=16)


class GcpProvider(SSHHosts):
    """GPU VMs on Compute Engine: 'up' creates them, 'down' deletes everything labelled for the cluster."""

    kind: Literal["gcp"] = "gcp"
    project: str = Field(pattern=GCP_PROJECT_RE, description="Your Google Cloud project ID.")
    zones: tuple[str, ...] = Field(
        min_length=1, description="Zones to try in order; a zone out of capacity or quota falls through."
    )
    machine_type: str = Field(default="n1-standard-8", pattern=GCP_NAME_RE)
    accelerator: GcpAccelerator | None = None
    image: str = Field(
        default=DLVM_IMAGE, min_length=1,
        description="Boot image or image family (a Deep Learning VM family by default).",
    )
    disk_size_gb: int = Field(default=100, ge=10, le=65536)
    disk_type: str = Field(default="pd-balanced", pattern=GCP_NAME_RE)
    spot: bool = Field(default=False, description="Spot VMs: cheaper, and may be preempted.")
    network: str = Field(default="default", min_length=1)
    subnetwork: str | None = Field(default=None, description="Name of the subnetwork in each zone's region.")
    external_ip: bool = Field(default=False, description="Give every VM an ephemeral public IP.")
    ssh_via: Literal["internal", "external"] = Field(
        default="internal",
        description="Connect over SSH to the internal IP (controller in the VPC) or the external one.",
    )
    ssh_user: str = Field(default="orchestrate", pattern=USER_RE, max_length=32)
    service_account: str = Field(default="default", description="Email of the VMs' service account.")
    scopes: tuple[str, ...] = Field(
        default=(
            "https://www.googleapis.com/auth/devstorage.read_write",
            "https://www.googleapis.com/auth/logging.write",
        ),
        description="OAuth scopes of the service account (GCS for checkpoints).",
    )
    metadata: dict[str, str] = Field(default_factory=dict, description="Extra instance metadata.")
    labels: dict[str, str] = Field(default_factory=dict, description="Extra labels on every resource.")
    tags: tuple[str, ...] = Field(default=(), description="Extra network tags.")
    boot_timeout_s: float = Field(
        default=600.0, gt=0, le=MAX_TIMEOUT_S,
        description="How long 'up' waits for a VM to run and answer SSH.",
    )
    api_timeout_s: float = Field(
        default=600.0, gt=0, le=MAX_TIMEOUT_S,
        description="How long one Compute Engine call or operation may take, retries included.",
    )

    @field_validator("zones")
    @classmethod
    def _zones(cls, zones: tuple[str, ...]) -> tuple[str, ...]:
        for zone in zones:
            if not re.fullmatch(GCP_ZONE_RE, zone):
                raise Invalid(f"{zone!r} is not a zone name",
                              fix="write REGION-LETTER, e.g. us-central1-a ('gcloud compute zones "
                                  "list' shows them)")
        if len(set(zones)) != len(zones):
            raise Invalid(f"a zone is listed twice (received {list(zones)})",
                          fix="list each zone once")
        return zones

    @field_validator("metadata", mode="before")
    @classmethod
    def _metadata(cls, items: Any) -> Any:
        """Keys first, whatever their values: ``enable-oslogin: TRUE`` is refused for why."""
        for key in items if isinstance(items, dict) else ():
            if not isinstance(key, str) or not re.fullmatch(GCP_METADATA_KEY_RE, key):
                raise Invalid(f"{key!r} is not a metadata key",
                              fix="use 1-128 letters, digits, '-' and '_'")
            if key.lower().startswith(GCP_OS_LOGIN_METADATA):
                raise Invalid(
                    f"{key!r} cannot be given here: OS Login replaces metadata SSH keys, and the "
                    "orchestrator reaches the VMs with its own key in the 'ssh-keys' metadata "
                    "(it sets enable-oslogin to FALSE on its VMs)",
                    fix=f"remove {key!r}")
            if key.lower() in GCP_RESERVED_METADATA:
                raise Invalid(f"{key!r} is set by the orchestrator and cannot be given here",
                              fix=f"remove {key!r}")
        return items

    @field_validator("labels")
    @classmethod
    def _labels(cls, labels: dict[str, str]) -> dict[str, str]:
        for key, value in labels.items():
            if key == GCP_RESERVED_LABEL:
                raise Invalid(f"{key!r} is set by the orchestrator and cannot be given here",
                              fix=f"remove {key!r}")
            if not re.fullmatch(GCP_LABEL_KEY_RE, key) or not re.fullmatch(GCP_LABEL_VALUE_RE, value):
                raise Invalid(
                    f"label {key}={value!r} is not a valid GCP label",
                    fix="use lower-case letters, digits, '-' and '_', a key starting with a "
                        "letter, at most 63 characters each",
                )
        return labels

    @field_validator("tags")
    @classmethod
    def _tags(cls, tags: tuple[str, ...]) -> tuple[str, ...]:
        for tag in tags:
            if not re.fullmatch(GCP_NAME_RE, tag):
                raise Invalid(f"{tag!r} is not a valid network tag",
                              fix="use lower-case letters, digits and '-', starting with a letter")
        return tags

    @model_validator(mode="after")
    def _ssh_path(self) -> GcpProvider:
        if self.ssh_via == "external" and not self.external_ip:
            raise Invalid("ssh_via: external needs external_ip: true (the VMs have no public IP)",
                          fix="set external_ip: true, or ssh_via: internal")
        return self


SLURM_NAME_RE = r"^[A-Za-z0-9_][A-Za-z0-9_.+-]{0,127}$"
# Slurm's time formats (sbatch --time): M, M:S, H:M:S, D-H, D-H:M, D-H:M:S.
SLURM_TIME_RE = r"^(?:(\d+)-(\d+)(?::(\d+)(?::(\d+))?)?|(\d+)(?::(\d+)(?::(\d+))?)?)$"
# What the orchestrator sets on the holder job itself: the same option from the spec would
# contradict it (and the job would not be the cluster the plan describes).
SLURM_OWN_OPTIONS = {
    "-N": "workers (one task per node)", "--nodes": "workers (one task per node)",
    "-n": "workers", "--ntasks": "workers", "--ntasks-per-node": "one task per node",
    "-J": "the cluster's name", "--job-name": "the cluster's name",
    "-o": "the cluster's root", "--output": "the cluster's root",
    "-e": "the cluster's root", "--error": "the cluster's root",
    "--wrap": "the holder job", "--parsable": "the orchestrator reads the job id",
    "-p": "provider.partition", "--partition": "provider.partition",
    "-A": "provider.account", "--account": "provider.account", "-q": "provider.qos",
    "--qos": "provider.qos", "-t": "provider.time", "--time": "provider.time",
    "-C": "provider.constraint", "--constraint": "provider.constraint",
    "-G": "provider.gpus_per_node", "--gpus": "provider.gpus_per_node",
    "--gpus-per-node": "provider.gpus_per_node", "--gres": "provider.gpus_per_node",
    "--signal": "the orchestrator's warning before the time limit",
    "--no-kill": "the orchestrator keeps the allocation when a node fails",
    "-k": "the orchestrator keeps the allocation when a node fails",
    "-D": "the cluster's root", "--chdir": "the cluster's root",
}


def slurm_seconds(value: str) -> int:
    """Seconds of a Slurm time limit (``sbatch --time``'s formats)."""
    m = re.fullmatch(SLURM_TIME_RE, value)
    if m is None:
        raise ValueError(value)
    days, dh, dm, ds, mins, ms, hs = m.groups()
    if days is not None:
        return int(days) * 86400 + int(dh) * 3600 + int(dm or 0) * 60 + int(ds or 0)
    if hs is not None:  # H:M:S
        return int(mins) * 3600 + int(ms) * 60 + int(hs)
    return int(mins) * 60 + int(ms or 0)


class SlurmLogin(Model):
    """The login node the controller drives Slurm's commands on, over SSH."""

    address: str = Field(min_length=1, description="The login node's host name or address.")
    port: int = Field(default=22, ge=1, le=65535)
    user: str = Field(pattern=USER_RE, max_length=32, description="Your user on the cluster.")
    key_file: str = Field(min_length=1, description="Private key for this user (no agent is used).")
    host_key: str | None = Field(
        default=None, description="The login node's public key line ('ssh-ed25519 AAAA...'); "
        "default: known_hosts.")
    known_hosts: str | None = Field(
        default=None, description="known_hosts file consulted when host_key is not given.")

    @field_validator("address")
    @classmethod
    def _address(cls, value: str) -> str:
        return check_address(value)

    @field_validator("key_file", "known_hosts")
    @classmethod
    def _local_path(cls, value: str | None) -> str | None:
        return None if value is None else check_local_path(value)

    @field_validator("host_key")
    @classmethod
    def _key_line(cls, value: str | None) -> str | None:
        return StaticHost._key_line(value)


class SlurmProvider(SSHHosts):
    """An allocation on a Slurm cluster: 'up' submits one job that holds the nodes (or adopts
    one you hold), every task runs as a job step in it, 'down' cancels what 'up' submitted."""

    kind: Literal["slurm"] = "slurm"
    partition: str | None = Field(default=None, pattern=SLURM_NAME_RE,
                                  description="Default: the cluster's default partition.")
    account: str | None = Field(default=None, pattern=SLURM_NAME_RE)
    qos: str | None = Field(default=None, pattern=SLURM_NAME_RE)
    time: str | None = Field(
        default=None, description="The allocation's time limit in Slurm's format (30, 4:00:00, "
        "1-00:00:00); default: the partition's. A run that reaches it goes on in a new one.")
    gpus_per_node: int = Field(default=0, ge=0, le=64)
    constraint: str | None = Field(
        default=None, pattern=r"^[A-Za-z0-9_.:&|\[\]*,()!-]{1,256}$",
        description="Node features, as sbatch --constraint takes them (a100&ib).")
    sbatch: tuple[str, ...] = Field(
        default=(), description="Other sbatch options for the allocation, one per item "
        "('--exclusive', '--mem=0', '--reservation=r1').")
    login: SlurmLogin | None = Field(
        default=None, description="Drive Slurm over SSH on this login node; default: Slurm's "
        "commands on this machine.")
    queue_timeout_s: float = Field(
        default=3600.0, gt=0, le=MAX_TIMEOUT_S,
        description="How long 'up' waits for the allocation to start; then it is cancelled.")
    python: str = Field(default="python3", description="Interpreter with TensorFlow on the nodes.")

    @field_validator("time")
    @classmethod
    def _time(cls, value: str | None) -> str | None:
        if value is None:
            return value
        try:
            seconds = slurm_seconds(value)
        except ValueError:
            raise Invalid(f"{value!r} is not a Slurm time limit",
                          fix="write minutes (90), H:M:S (4:00:00) or D-H:M:S (1-00:00:00)") from None
        if seconds < 60:
            raise Invalid(f"{value!r} is under a minute, Slurm's smallest limit",
                          fix="give at least one minute (1 or 0:01:00)")
        return value

    @field_validator("sbatch")
    @classmethod
    def _sbatch(cls, options: tuple[str, ...]) -> tuple[str, ...]:
        for option in options:
            if not option.startswith("-") or any(c in option for c in "\0\n\r"):
                raise Invalid(f"{option!r} is not an sbatch option",
                              fix="write each option as one item starting with '-', its value "
                                  "after '=' (--mem=0, --reservation=r1)")
            name = option.split("=", 1)[0]
            if name in SLURM_OWN_OPTIONS:
                raise Invalid(f"{name} is set by the orchestrator ({SLURM_OWN_OPTIONS[name]})",
                              fix=f"remove {option!r}" + (
                                  "" if not SLURM_OWN_OPTIONS[name].startswith("provider.")
                                  else f"; set {SLURM_OWN_OPTIONS[name]} instead"))
        return options


# Kubernetes names: a DNS-1123 label (namespaces, container ports' names), a subdomain
# (most objects), a label key's name part and a label value.
K8S_LABEL_RE = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
K8S_SUBDOMAIN_RE = r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"
K8S_LABEL_KEY_RE = (r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?"
                    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
K8S_LABEL_VALUE_RE = r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$"
# A resource quantity as the API server parses it: 500m, 2, 1.5, 16Gi, 1e3.
K8S_QUANTITY_RE = r"^[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([numkMGTPE]|[KMGTPE]i|[eE][+-]?[0-9]+)?$"
GKE_SPOT_LABEL = "cloud.google.com/gke-spot"


class KubernetesToleration(Model):
    """A taint the pods tolerate (Kubernetes' own field, in snake case)."""

    key: str | None = Field(default=None, pattern=K8S_LABEL_KEY_RE)
    operator: Literal["Equal", "Exists"] = "Equal"
    value: str | None = Field(default=None, pattern=K8S_LABEL_VALUE_RE)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = Field(default=None, ge=0, le=10**9)

    @model_validator(mode="after")
    def _consistent(self) -> KubernetesToleration:
        if self.operator == "Exists" and self.value:
            raise Invalid("a toleration with operator Exists has no value",
                          fix="remove value, or use operator: Equal")
        if self.key is None and self.operator == "Equal":
            raise Invalid("a toleration without a key must use operator: Exists (it then "
                          "tolerates every taint)", fix="add key, or set operator: Exists")
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise Invalid("toleration_seconds applies to effect NoExecute only",
                          fix="set effect: NoExecute, or remove toleration_seconds")
        return self


class KubernetesResources(Model):
    """What each pod asks for besides its GPUs: requested, and memory also its limit."""

    cpu: str | None = Field(default=None, pattern=K8S_QUANTITY_RE,
                            description="CPU request per pod (8, 7500m).")
    memory: str | None = Field(default=None, pattern=K8S_QUANTITY_RE,
                               description="Memory request and limit per pod (60Gi).")


class KubernetesVolume(Model):
    """A ReadWriteMany PersistentVolumeClaim (Filestore, NFS, gcsfuse CSI) every pod mounts:
    the cluster's run directories, checkpoints among them, live there."""

    claim: str = Field(pattern=K8S_SUBDOMAIN_RE, max_length=253,
                       description="The claim's name, in provider.namespace.")
    sub_path: str | None = Field(
        default=None, pattern=r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$", max_length=1024,
        description="The directory of the volume the cluster uses; default: "
        "orchestrate/CLUSTER.")

    @field_validator("sub_path")
    @classmethod
    def _relative(cls, value: str | None) -> str | None:
        if value is not None and ".." in value.split("/"):
            raise Invalid(f"{value!r} leaves the volume", fix="give a path inside it, without '..'")
        return value


class KubernetesProvider(Model):
    """A Kubernetes cluster with the JobSet API (GKE): every attempt is one JobSet, a pod per
    task, in container.image; 'down' deletes every object the tool made there."""

    kind: Literal["kubernetes"] = "kubernetes"
    kubeconfig: str | None = Field(
        default=None, description="The kubeconfig file; default: $KUBECONFIG, else ~/.kube/config.")
    context: str | None = Field(default=None, min_length=1, max_length=253,
                                description="Its context; default: its current context.")
    namespace: str = Field(default="default", pattern=K8S_LABEL_RE,
                           description="Where every object of the cluster is made.")
    service_account: str | None = Field(
        default=None, pattern=K8S_SUBDOMAIN_RE, max_length=253,
        description="The pods' service account (Workload Identity for gs:// checkpoints).")
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node labels the pods need "
        "(cloud.google.com/gke-accelerator: nvidia-h100-80gb).")
    tolerations: tuple[KubernetesToleration, ...] = ()
    gpus_per_pod: int = Field(default=0, ge=0, le=16)
    gpu_resource: str = Field(default="nvidia.com/gpu", pattern=K8S_LABEL_KEY_RE,
                              description="The extended resource the GPUs are counted in.")
    resources: KubernetesResources = Field(default_factory=KubernetesResources)
    spot: bool = Field(default=False, description=f"Run on spot nodes ({GKE_SPOT_LABEL}).")
    queue: str | None = Field(default=None, pattern=K8S_LABEL_RE,
                              description="A Kueue LocalQueue: the JobSet waits for its quota.")
    image_pull_secrets: tuple[str, ...] = Field(
        default=(), description="Secrets in the namespace that pull container.image.")
    volume: KubernetesVolume | None = Field(
        default=None, description="Shared storage for the runs: checkpoints and the final "
        "model (a pod's own disk is gone with the pod).")
    sync_excludes: tuple[str, ...] = Field(
        default=(".git", "__pycache__", "*.pyc", ".venv", "outputs"),
        description="Glob patterns left out of the code 'up' puts in a ConfigMap (1 MiB).")
    run_as_user: int | None = Field(
        default=None, ge=0, le=2**31 - 1,
        description="The uid the tasks run as (the pods' securityContext); default: the image's.")
    run_as_group: int | None = Field(default=None, ge=0, le=2**31 - 1)
    fs_group: int | None = Field(
        default=None, ge=0, le=2**31 - 1,
        description="The group that owns provider.volume in the pods (writable by the tasks).")

    @field_validator("kubeconfig")
    @classmethod
    def _local_path(cls, value: str | None) -> str | None:
        return None if value is None else check_local_path(value)

    @field_validator("node_selector")
    @classmethod
    def _labels(cls, labels: dict[str, str]) -> dict[str, str]:
        for key, value in labels.items():
            if not re.fullmatch(K8S_LABEL_KEY_RE, key) or len(key.rsplit("/", 1)[-1]) > 63:
                raise Invalid(f"{key!r} is not a label key",
                              fix="write [PREFIX/]NAME: NAME up to 63 letters, digits, '-', "
                                  "'_' or '.', PREFIX a DNS subdomain")
            if not re.fullmatch(K8S_LABEL_VALUE_RE, value):
                raise Invalid(f"{key}: {value!r} is not a label value",
                              fix="write up to 63 letters, digits, '-', '_' or '.', starting "
                                  "and ending with a letter or digit (quote it: 'true')")
        if GKE_SPOT_LABEL in labels:
            raise Invalid(f"{GKE_SPOT_LABEL} is set by provider.spot",
                          fix="remove it from node_selector and set spot: true")
        return labels

    @field_validator("image_pull_secrets")
    @classmethod
    def _secret_names(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        for name in names:
            if not re.fullmatch(K8S_SUBDOMAIN_RE, name) or len(name) > 253:
                raise Invalid(f"{name!r} is not a Secret's name",
                              fix="write the name of a Secret of type "
                                  "kubernetes.io/dockerconfigjson in provider.namespace")
        return names


Provider = Annotated[LocalProvider | StaticProvider | GcpProvider | SlurmProvider
                     | KubernetesProvider,
                     Field(discriminator="kind")]


def _members(union: Any, tag: str) -> dict[str, type[Model]]:
    """The models of an annotated discriminated union, by the value of their ``tag`` field."""
    return {model.model_fields[tag].default: model for model in get_args(get_args(union)[0])}


PROVIDER_MODELS: tuple[type[Model], ...] = tuple(_members(Provider, "kind").values())


class PortRange(Model):
    """Ports the tasks' gRPC servers may use, inclusive."""

    start: int = Field(default=23456, ge=1024, le=65535)
    end: int = Field(default=23655, ge=1024, le=65535)

    @model_validator(mode="after")
    def _ordered(self) -> PortRange:
        if self.end < self.start:
            raise ValueError(f"end ({self.end}) must be >= start ({self.start})")
        return self


# An image reference: [registry[:port]/]path[:tag][@digest], as docker and podman accept it.
IMAGE_RE = (r"^[a-z0-9][a-z0-9.-]*(:[0-9]+)?(/[a-z0-9]+([._-][a-z0-9]+)*)*"
            r"(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[0-9a-f]{64})?$")
# `run` options the launcher sets itself: a task's network, name, removal and user are not the
# spec's to change (TF's gRPC needs the host's address; stop and down find tasks by name).
RESERVED_RUN_OPTIONS = ("--network", "--net", "--name", "--rm", "-d", "--detach", "--user", "-u",
                        "--label", "-l", "--ipc", "--pid", "--userns", "-i", "-t", "--tty")


class Container(Model):
    """Run every task in this image: host network, the task's directories mounted at the same
    paths, TF_CONFIG and the task's environment passed in, GPUs passed through when present."""

    image: str = Field(max_length=512, description="The worker image (see docker/README.md).")
    runtime: Literal["docker", "podman"] = Field(
        default="docker", description="The container engine on every host.")
    options: tuple[str, ...] = Field(
        default=(), description="Extra `run` options, one word each (e.g. --shm-size=8g).")
    pull: Literal["missing", "always", "never"] = Field(
        default="missing", description="`up` pulls the image on every host: when absent, "
        "every time, or never (it must be there already).")
    gpus: Literal["auto", "all", "none"] = Field(
        default="auto", description="Pass the host's GPUs in: auto = where the host has them.")
    python: str = Field(default="python3", pattern=r"^[A-Za-z0-9_./+-]+$",
                        description="The interpreter in the image that runs the worker.")

    @field_validator("image")
    @classmethod
    def _image(cls, image: str) -> str:
        if not re.fullmatch(IMAGE_RE, image):
            raise Invalid(
                f"{image!r} is not an image reference",
                fix="write [REGISTRY/]PATH[:TAG][@sha256:DIGEST] in lower case, e.g. "
                    "us-docker.pkg.dev/PROJECT/REPO/orchestrate-worker:2.21")
        return image

    @field_validator("options")
    @classmethod
    def _options(cls, options: tuple[str, ...]) -> tuple[str, ...]:
        for option in options:
            if any(c in option for c in "\0\n\r"):
                raise Invalid(f"option {option!r} contains a control character", fix="remove it")
            name = option.split("=", 1)[0]
            if name in RESERVED_RUN_OPTIONS:
                raise Invalid(f"option {option!r} is set by the orchestrator (tasks use the "
                              "host network and their own name, user and labels)",
                              fix=f"remove {option!r}")
        return options


MAX_PROFILED_STEPS = 100  # tensorboard.profile_steps: the widest window traced


def check_storage_path(value: str, *, relative_ok: bool) -> str:
    """A checkpoint location: a ``gs://bucket/...`` URL or a path (absolute unless ``relative_ok``)."""
    if any(c in value for c in "\0\n\r"):
        raise Invalid("the path contains a control character", fix="remove it")
    if "://" in value:
        bucket = value[len("gs://"):].split("/", 1)[0] if value.startswith("gs://") else ""
        if not re.fullmatch(r"[a-z0-9][-a-z0-9_.]{1,220}[a-z0-9]", bucket):
            raise Invalid(
                f"{value!r} is not a gs://BUCKET/PATH URL",
                fix="TensorFlow reads and writes gs:// natively; mount other storage and name "
                    "it by its absolute path")
        return value.rstrip("/")
    if not value.startswith("/") and not relative_ok:
        raise Invalid(f"{value!r} is relative",
                      fix="give the absolute path that every host mounts (NFS, Filestore, "
                          "gcsfuse) or a gs:// URL")
    return value.rstrip("/") or "/"


def is_url(location: str) -> bool:
    return "://" in location


# Under checkpoint.mirror: auto, the controller keeps its own copy of checkpoints up to this
# size. 1 GiB is about 90 s on a 100 Mbit/s link (a laptop outside the cloud): a copy that
# still keeps up with checkpoints written every few minutes, and a disk cost nobody notices.
# Above it, the copy costs the chief's disk and network more than the rare case it saves (a
# chief whose disk is gone) is worth; shared storage or checkpoint.mirror: always cover that.
AUTO_MIRROR_MAX_BYTES = 1 << 30
# The mirror pulls at most this fraction of the time: after a pull of T seconds the next waits
# until T * (1 / MIRROR_BUSY_MAX - 1) more have passed. Its pulls cost the chief's host CPU
# (sshd's encryption) and disk reads while it trains; at 5% of the time that cost stays within
# a few percent of the steps/s (benchmarks/checkpoints.py), and the copy, a safety net for a
# chief whose disk is gone, is at most a few checkpoints behind.
MIRROR_BUSY_MAX = 0.05


def _keras_major(value: Any) -> Any:
    """``keras: 3`` in YAML is an int; the field's values are strings."""
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


class GpuJob(Model):
    """What every kind of job sets for the GPUs of its tasks."""

    collectives: Literal["ring", "nccl", "auto"] = Field(
        default="ring",
        description="How the tasks all-reduce: ring (gRPC, on any device), nccl (GPU to GPU; "
        "every task needs a GPU), or auto (nccl when every task has GPUs, else ring: decided at "
        "train from the GPUs the doctor finds, else by each task from the GPUs it sees).",
    )
    gpu_memory_growth: bool = Field(
        default=True,
        description="Let TensorFlow take GPU memory as it needs it instead of all of it at "
        "start (set_memory_growth; TF_FORCE_GPU_ALLOW_GROWTH=true for a command job; on JAX, "
        "XLA_PYTHON_CLIENT_PREALLOCATE=false).",
    )
    backend: Literal["tensorflow", "jax"] = Field(
        default="tensorflow",
        description="What Keras runs on: tensorflow, or jax (Keras 3 only: a managed job's model "
        "trains with JAX's distributed service and Keras's DataParallel; a command job gets "
        "KERAS_BACKEND=jax and the KERAS_DISTRIBUTION_* variables that "
        "keras.distribution.initialize() reads, the chief's address as the coordinator).",
    )

    @model_validator(mode="before")
    @classmethod
    def _jax_is_keras_3(cls, data: Any) -> Any:
        """On JAX, Keras is Keras 3: ``keras`` (unset or auto) is 3 there; a 2 is left for
        ``_check_backend`` to refuse by its field."""
        if isinstance(data, dict) and data.get("backend") == "jax" \
                and data.get("keras", "auto") == "auto":
            return {**data, "keras": "3"}
        return data


class ManagedJob(GpuJob):
    """The runtime builds and compiles the user module's model and trains it: a tf_keras model
    with ``fit``, a Keras 3 model in the runtime's own distributed loop."""

    mode: Literal["managed"] = "managed"
    keras: Literal["auto", "3", "2"] = Field(
        default="auto",
        description="Which Keras build_model() returns: 3 (import keras; trained in a distributed "
        "custom loop, since Keras 3's fit fails under MultiWorkerMirroredStrategy), 2 (tf_keras; "
        "fit), or auto (chosen by the model it returns; tf.keras is tf_keras then).",
    )
    module: str = Field(
        pattern=MODULE_RE, description="Dotted module under workdir, e.g. examples.digits."
    )
    model_fn: str = Field(default="build_model", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    dataset_fn: str = Field(default="make_dataset", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    epochs: int = Field(default=5, ge=1, le=MAX_EPOCHS)
    steps_per_epoch: int = Field(default=50, ge=1, le=MAX_STEPS)
    per_replica_batch_size: int = Field(default=32, ge=1, le=MAX_BATCH)
    optimizer: Literal["adam", "sgd", "rmsprop", "adamw"] = "adam"
    learning_rate: float = Field(default=1e-3, gt=0, le=MAX_LEARNING_RATE)
    scale_learning_rate: bool = Field(
        default=True, description="Multiply learning_rate by the number of replicas in sync."
    )
    loss: str = "sparse_categorical_crossentropy"
    metrics: tuple[str, ...] = ("accuracy",)
    seed: int | None = Field(default=1234, ge=0, le=MAX_SEED)
    deterministic: bool = Field(
        default=False, description="Op determinism + seeds: a resumed run matches an unbroken one."
    )
    progress_every_steps: int = Field(default=1, ge=1, le=MAX_STEPS)
    distribution: Literal["data_parallel", "model_parallel"] = Field(
        default="data_parallel",
        description="On JAX: data_parallel (every variable on every device, each batch split "
        "over them: Keras's DataParallel) or model_parallel (variables split over a device "
        "mesh by the module's layout map: Keras's ModelParallel; needs job.mesh).",
    )
    mesh: tuple[int, int] | None = Field(
        default=None,
        description="model_parallel's device mesh, [batch, model]: batch x model must be every "
        "device of every task; each batch is split over the batch axis, the variables the "
        "layout map names over the model axis.",
    )
    layout_map_fn: str = Field(
        default="layout_map", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="model_parallel: the module's function that takes the "
        "keras.distribution.DeviceMesh and returns a keras.distribution.LayoutMap.",
    )

    _keras = field_validator("keras", mode="before")(_keras_major)

    @field_validator("mesh")
    @classmethod
    def _mesh(cls, value: tuple[int, int] | None) -> tuple[int, int] | None:
        if value is not None and min(value) < 1:
            raise ValueError(f"each axis of the mesh is at least 1, received {list(value)}")
        return value


class CommandJob(GpuJob):
    """Run an unmodified script (written as in TF's multi-worker tutorial) on every task."""

    mode: Literal["command"] = "command"
    command: tuple[str, ...] = Field(min_length=1)
    keras: Literal["2", "3"] = Field(
        default="2",
        description="What tf.keras is in the script: 2 sets TF_USE_LEGACY_KERAS=1 (tf_keras, whose "
        "fit works under MultiWorkerMirroredStrategy, as TF's tutorial scripts need); 3 leaves "
        "it Keras 3 (for a script with its own training loop).",
    )
    checkpoint_dir: str | None = Field(
        default=None,
        description="The directory the script checkpoints to (BackupAndRestore's backup_dir, "
        "a CheckpointManager's directory): relative to the code dir, absolute, or a gs:// URL. "
        "The chief's copy is verified and given to every task before a relaunch. Default: "
        "the run's directory, exported as ORCHESTRATE_CHECKPOINT_DIR.",
    )

    _keras = field_validator("keras", mode="before")(_keras_major)

    @field_validator("checkpoint_dir")
    @classmethod
    def _location(cls, value: str | None) -> str | None:
        return None if value is None else check_storage_path(value, relative_ok=True)

    @field_validator("command", mode="before", json_schema_input_type=str | tuple[str, ...])
    @classmethod
    def _split(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                return tuple(shlex.split(value))
            except ValueError as exc:
                raise Invalid(f"cannot split into words ({exc})",
                              fix="close the quote, or write the command as a list of words") from exc
        return value


Job = Annotated[ManagedJob | CommandJob, Field(discriminator="mode")]


class Checkpoint(Model):
    """Where the run's checkpoints live, and whether this machine keeps its own copy."""

    every_steps: int = Field(
        default=20, ge=1, le=MAX_STEPS, description="The chief writes a backup every this many steps."
    )
    dir: str | None = Field(
        default=None,
        description="Shared storage every task sees the same: a gs://BUCKET/PATH URL or an "
        "absolute path on a shared file system (NFS, Filestore, gcsfuse). Each run checkpoints "
        "to DIR/CLUSTER/RUN_ID there and nothing is copied; default: each host's own disk, "
        "the chief's checkpoint copied to the others before a relaunch.",
    )
    mirror: Literal["auto", "always", "never"] = Field(
        default="auto",
        description="Keep a copy of the chief's checkpoints on this machine (for a chief whose "
        f"disk is lost): auto keeps it up to {AUTO_MIRROR_MAX_BYTES / (1 << 30):g} GiB and never "
        f"with shared storage. It pulls at most {MIRROR_BUSY_MAX:.0%} of the time, so it may be "
        "a few checkpoints behind.",
    )

    @field_validator("dir")
    @classmethod
    def _location(cls, value: str | None) -> str | None:
        return None if value is None else check_storage_path(value, relative_ok=False)


class TensorBoard(Model):
    """TensorBoard logs of the training, written by the chief (see worker/tensorboard.py)."""

    enabled: bool = Field(
        default=True,
        description="Managed jobs: the chief writes the loss, every metric, the learning rate "
        "and the speed, and where each attempt began and why the one before ended. Command "
        "jobs: ORCHESTRATE_TENSORBOARD_DIR is exported for the script to write there.",
    )
    dir: str | None = Field(
        default=None,
        description="A gs://BUCKET/PATH URL, or an absolute path on storage every host "
        "mounts; each run writes DIR/CLUSTER/RUN_ID there. Default: tensorboard/ in the run's "
        "directory on the chief's host.",
    )
    every_steps: int | None = Field(
        default=None, ge=1, le=MAX_STEPS,
        description="Steps between writes; default: job.progress_every_steps.",
    )
    profile_steps: tuple[int, int] | None = Field(
        default=None,
        description="Managed jobs: trace these steps (FIRST and LAST, counted from 1) with the "
        "framework's profiler on the chief, for TensorBoard's Profile tab; a number traces "
        "that one step.",
    )

    @field_validator("dir")
    @classmethod
    def _location(cls, value: str | None) -> str | None:
        return None if value is None else check_storage_path(value, relative_ok=False)

    @field_validator("profile_steps", mode="before")
    @classmethod
    def _one_step(cls, value: Any) -> Any:
        return (value, value) if isinstance(value, int) and not isinstance(value, bool) \
            else value

    @field_validator("profile_steps")
    @classmethod
    def _window(cls, value: tuple[int, int] | None) -> tuple[int, int] | None:
        if value is None:
            return None
        first, last = value
        if first < 1 or last < first:
            raise Invalid(f"[{first}, {last}] is not a window of steps",
                          fix="give [FIRST, LAST] with 1 <= FIRST <= LAST, e.g. [10, 15]")
        if last - first + 1 > MAX_PROFILED_STEPS:
            raise Invalid(f"[{first}, {last}] traces {last - first + 1} steps: a trace keeps "
                          "every op of every step, hundreds of MB for a few dozen",
                          fix=f"trace at most {MAX_PROFILED_STEPS} steps, e.g. "
                              f"[{first}, {first + 4}]")
        return value

    @model_validator(mode="after")
    def _profiled_when_written(self) -> TensorBoard:
        if self.profile_steps is not None and not self.enabled:
            raise Invalid("profile_steps is set and enabled is false: the trace goes into the "
                          "TensorBoard logs", fix="remove profile_steps, or enabled: false")
        return self


class CostSettings(Model):
    """What a GPU hour costs you, for the price of a cluster and the cost of its runs (see
    orchestrator/cost.py). On gcp the cluster is priced from Google's list prices."""

    gpu_hour_price: float | None = Field(
        default=None, ge=0, le=100_000.0,
        description="The price of one GPU for an hour, in cost.currency: slurm, static and "
        "kubernetes runs are then costed in money too (without it, in GPU hours only); on gcp "
        "it replaces the list price of the GPUs (a negotiated rate). Default: none.",
    )
    currency: str = Field(
        default="USD", pattern=r"^[A-Z]{3}$",
        description="ISO 4217 code of gpu_hour_price, and of the gcp prices read from the Cloud "
        "Billing Catalog (the shipped price table is in USD).",
    )

    @field_validator("currency", mode="before")
    @classmethod
    def _currency(cls, value: Any) -> Any:
        if isinstance(value, str) and not re.fullmatch(r"[A-Z]{3}", value):
            raise Invalid("not an ISO 4217 currency code",
                          fix="write its three-letter ISO 4217 code in capitals: USD, EUR, JPY")
        return value


class Elastic(Model):
    """Keep training on fewer machines when one cannot come back (see orchestrator/elastic.py),
    on every provider."""

    min_workers: int = Field(
        ge=1, le=1024,
        description="The fewest workers the run goes on with when a machine is lost for good "
        "(its provider cannot give it back within timeouts.repair_s); below it the run fails.",
    )
    max_workers: int | None = Field(
        default=None, ge=1, le=1024,
        description="The most workers the group grows to: above workers, the group starts "
        "with workers and grows onto the spares (static: the hosts listed past workers; gcp: "
        "VMs created once a zone has room; slurm: a one-node allocation each, once it runs; "
        "kubernetes: a pod more, once a node has room for it; local: more processes) as the "
        "grow check finds them, each growth a planned stop. Default: workers.",
    )
    batch: Literal["keep_per_replica", "keep_global"] = Field(
        default="keep_per_replica",
        description="keep_per_replica: each replica's batch stays, the global batch shrinks "
        "with the group (and the learning rate with it where job.scale_learning_rate). "
        "keep_global: the global batch and learning rate stay, each replica's batch grows "
        "(it must divide).",
    )
    grow_check_s: float = Field(
        default=60.0, ge=0, le=MAX_TIMEOUT_S,
        description="While the group is smaller, how often each machine it lost is asked for "
        "again (off the training's path); one that is back makes a planned stop (every task "
        "saves at one step) and the group grows back. 0: never.",
    )


class Metrics(Model):
    """Prometheus metrics of a run, from the controller while 'train' runs (see
    orchestrator/metrics.py): for a team's own dashboards and alerts."""

    prometheus_port: int | None = Field(
        default=None, ge=1, le=65535,
        description="Serve the run's metrics at http://BIND:PORT/metrics while 'train' runs. "
        "Default: no endpoint.",
    )
    bind: str = Field(
        default="127.0.0.1",
        description="The address the endpoint listens on: 127.0.0.1 (this machine only), or "
        "0.0.0.0 for a Prometheus elsewhere to scrape it.",
    )
    textfile: str | None = Field(
        default=None,
        description="Also write them to this file (NAME.prom, for node_exporter's textfile "
        "collector), every few seconds and at the run's end, whole or not at all.",
    )

    @field_validator("bind")
    @classmethod
    def _address(cls, value: str) -> str:
        try:
            return str(ipaddress.ip_address(value))
        except ValueError:
            raise Invalid(f"{value!r} is not an IP address",
                          fix="give 127.0.0.1 (this machine only) or 0.0.0.0 (every "
                          "interface)") from None

    @field_validator("textfile")
    @classmethod
    def _prom(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not value.endswith(".prom"):
            raise Invalid(f"{value!r} does not end in .prom",
                          fix="name it NAME.prom: node_exporter's textfile collector reads "
                          "only those")
        if "://" in value:
            raise Invalid(f"{value!r} is a URL", fix="give a path on this machine")
        return check_storage_path(value, relative_ok=False)


WARM_AFTER_S = 30.0  # retry.warm_tasks: auto starts them after this much training


class Retry(Model):
    max_restarts: int = Field(default=3, ge=0, le=MAX_RESTARTS,
                              description="Group restarts before giving up.")
    per_cause: dict[str, int] = Field(
        default_factory=dict,
        description="Restarts allowed for each failure cause, within max_restarts, e.g. "
        "{hung: 1, preempted: 10}; a cause not listed may use all of max_restarts.",
    )
    backoff_initial_s: float = Field(default=1.0, ge=0, le=MAX_BACKOFF_S)
    backoff_max_s: float = Field(default=30.0, ge=0, le=MAX_BACKOFF_S)
    snapshot_on_crash: bool = Field(
        default=True,
        description="When a task dies or its host is lost, the chief (if it lives) saves its "
        "state at the last step every task completed, before it is stopped: the relaunch "
        "resumes from there, so a crash redoes at most the step under way. Managed jobs (on "
        "JAX with data parallelism; there the step keeps its input state, one more copy of "
        "the state on each device while a step runs); "
        "false: back to the last periodic checkpoint.",
    )
    warm_tasks: bool | Literal["auto"] = Field(
        default="auto",
        description="Keep the next attempt's tasks started on every host, TensorFlow and the "
        "job's module imported, waiting: a relaunch then skips the cold start (managed jobs). "
        "Each is an idle Python process with TensorFlow loaded (about 0.6 GiB resident, under "
        f"0.5% of a core while it waits). auto starts them once an attempt has trained {WARM_AFTER_S:.0f}s "
        "(short runs do not pay for them); true at its first step; false never. Unless "
        "false, a new run's first attempt starts so too, while train's doctor checks the hosts.",
    )

    @field_validator("per_cause")
    @classmethod
    def _known_causes(cls, budgets: dict[str, int]) -> dict[str, int]:
        for cause, count in budgets.items():
            if cause not in BUDGETED:
                close = difflib.get_close_matches(cause, BUDGETED, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise Invalid(f"unknown cause {cause!r}",
                              fix=f"{hint}causes are {', '.join(BUDGETED)}")
            if not 0 <= count <= MAX_RESTARTS:
                raise Invalid(f"{cause}: a budget is 0 to {MAX_RESTARTS} (received {count})",
                              fix=f"give {cause} a budget from 0 to {MAX_RESTARTS}")
        return budgets


class Timeouts(Model):
    startup_s: float = Field(
        default=300.0, gt=0, le=MAX_TIMEOUT_S,
        description="Every task must report its first step within this.",
    )
    stop_grace_s: float = Field(
        default=60.0, ge=0, le=MAX_TIMEOUT_S,
        description="A planned stop ('down', Ctrl-C, a preemption or maintenance notice) sends "
        "SIGTERM: every task saves a checkpoint at the same step and exits; SIGKILL after this "
        "long. The survivors of a crash are killed at once (the group is broken).",
    )
    hang_s: float = Field(
        default=600.0, gt=0, le=MAX_TIMEOUT_S,
        description="Progress watchdog: no task reports anything for this long -> hung. Until "
        "every task has completed a step (the first compiles), startup_s from the attempt's "
        "start holds as well.",
    )
    collective_s: float | None = Field(
        default=None, gt=0, le=MAX_TIMEOUT_S,
        description="TF collective timeout: a collective waiting longer fails its task.",
    )
    snapshot_s: float = Field(
        default=60.0, ge=0, le=MAX_TIMEOUT_S,
        description="After a crash, how long the chief may take to save its snapshot "
        "(retry.snapshot_on_crash) and exit before it is killed; then the last periodic "
        "checkpoint is used. Raise it for a checkpoint that takes longer to write.",
    )
    repair_s: float = Field(
        default=600.0, ge=0, le=MAX_TIMEOUT_S,
        description="How long a lost host may take to come back.",
    )
    poll_s: float = Field(
        default=15.0, gt=0, le=MAX_TIMEOUT_S,
        description="A host that does not answer a status poll this fast is lost.",
    )


class ClusterSpec(Model):
    """A cluster and the training job it runs."""

    name: str = Field(description="Lower-case letters, digits and '-', starting with a letter.")
    provider: Provider = Field(default_factory=LocalProvider)
    workers: int = Field(default=2, ge=1, le=1024)
    separate_chief: bool = Field(
        default=False,
        description="Add a dedicated 'chief' task; otherwise worker 0 is the chief.",
    )
    workdir: str = Field(
        default=".", description="The user's project directory, relative to the spec file."
    )
    ports: PortRange = Field(default_factory=PortRange)
    job: Job
    checkpoint: Checkpoint = Field(default_factory=Checkpoint)
    retry: Retry = Field(default_factory=Retry)
    timeouts: Timeouts = Field(default_factory=Timeouts)
    env: dict[str, str] = Field(default_factory=dict)
    secrets: tuple[str, ...] = Field(
        default=(), description="Names of environment variables every task gets from this "
        "controller's environment at launch (API keys, tokens): never in the spec, the "
        "state store, a command line, plan or an error message.")
    container: Container | None = Field(
        default=None, description="Run every task in a container image (see docker/README.md).")
    tensorboard: TensorBoard = Field(default_factory=TensorBoard)
    cost: CostSettings = Field(default_factory=CostSettings)
    metrics: Metrics = Field(default_factory=Metrics)
    elastic: Elastic | None = Field(
        default=None, description="Go on with fewer workers when a machine is lost for good.")

    @model_validator(mode="before")
    @classmethod
    def _default_job_mode(cls, data: Any) -> Any:
        job = data.get("job") if isinstance(data, dict) else None
        if isinstance(job, dict) and "mode" not in job:
            data = {**data, "job": {**job, "mode": "command" if "command" in job else "managed"}}
        return data

    @field_validator("tensorboard")
    @classmethod
    def _profiled_steps(cls, board: TensorBoard, info: ValidationInfo) -> TensorBoard:
        job = info.data.get("job")
        if board.profile_steps is None or job is None:
            return board
        first, last = board.profile_steps
        if not isinstance(job, ManagedJob):
            raise Invalid(
                "profile_steps traces a managed job's steps; a command job's script profiles "
                "itself", fix="remove profile_steps, and profile in the script into "
                "$ORCHESTRATE_TENSORBOARD_DIR (Keras: TensorBoard(log_dir=..., "
                f"profile_batch=({first}, {last})))")
        total = job.epochs * job.steps_per_epoch
        if first > total:
            raise Invalid(f"profile_steps begins at step {first}, and the job trains {total} "
                          "steps (job.epochs x job.steps_per_epoch)",
                          fix=f"trace steps within 1..{total}")
        return board

    @field_validator("elastic")
    @classmethod
    def _elastic(cls, elastic: Elastic | None, info: ValidationInfo) -> Elastic | None:
        workers, job = info.data.get("workers"), info.data.get("job")
        if elastic is None or workers is None or job is None:
            return elastic
        if elastic.min_workers > workers:
            raise Invalid(f"min_workers is {elastic.min_workers}, over the {workers} workers",
                          fix=f"set elastic.min_workers to {workers} or fewer")
        most = elastic.max_workers if elastic.max_workers is not None else workers
        if most < workers:
            raise Invalid(f"max_workers is {most}, under the {workers} workers the group starts "
                          "with", fix=f"set elastic.max_workers to {workers} or more, or leave it "
                          "out (the group then grows back to workers, no further)")
        if info.data.get("separate_chief"):
            raise Invalid("elastic groups take the chief's role to another worker when its "
                          "machine is lost, and separate_chief gives it a task of its own",
                          fix="remove separate_chief (worker 0 is then the chief), or elastic")
        if isinstance(job, ManagedJob) and job.distribution == "model_parallel":
            raise Invalid("model_parallel's device mesh is fixed (job.mesh): it cannot lose a "
                          "machine's devices", fix="remove elastic, or use data_parallel")
        if elastic.batch == "keep_global":
            if not isinstance(job, ManagedJob):
                raise Invalid("keep_global sets each replica's batch, which a command job's "
                              "script sets itself",
                              fix="use batch: keep_per_replica (the script reads the group's "
                                  "size from TF_CONFIG)")
            total = job.per_replica_batch_size * workers
            uneven = [n for n in range(elastic.min_workers, most + 1) if total % n]
            if uneven:
                raise Invalid(
                    f"keep_global keeps the global batch of {total} ({workers} x "
                    f"{job.per_replica_batch_size}), which {', '.join(map(str, uneven))} "
                    "worker(s) cannot split evenly",
                    fix="raise elastic.min_workers (or lower elastic.max_workers), choose a "
                        "job.per_replica_batch_size that every size from min_workers to "
                        "max_workers divides, or use keep_per_replica")
        return elastic

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not re.fullmatch(NAME_RE, name):
            raise Invalid(
                f"{name!r} is not a valid name",
                fix="use 1-40 lower-case letters, digits and '-', starting with a letter "
                    "(it names files, VMs and labels)",
            )
        return name

    @field_validator("workdir")
    @classmethod
    def _workdir(cls, value: str) -> str:
        return check_local_path(value)

    @field_validator("env")
    @classmethod
    def _env(cls, env: dict[str, str]) -> dict[str, str]:
        for key in env:
            if not re.fullmatch(ENV_NAME_RE, key):
                raise Invalid(f"{key!r} is not a valid environment variable name",
                              fix="use letters, digits and '_', not starting with a digit")
        overridden = [key for key in env if is_reserved_env(key)]
        if overridden:
            raise Invalid(
                f"{', '.join(overridden)}: set by the orchestrator in every task, so this value "
                f"would be lost ({'; '.join(_why_reserved(key) for key in overridden)})",
                fix="remove " + ", ".join(overridden) + "; the orchestrator sets "
                    + ", ".join([*PLAN_ENV, "TF_CONFIG", "ORCHESTRATE_*"]))
        for key, value in env.items():
            if len(value.encode()) > MAX_ENV_VALUE_BYTES:
                raise Invalid(f"{key}: the value is {len(value.encode())} bytes (at most "
                              f"{MAX_ENV_VALUE_BYTES // 1024} KiB)",
                              fix="pass large data in a file under workdir, and its path here")
        total = sum(len(k.encode()) + len(v.encode()) + 2 for k, v in env.items())
        if total > MAX_ENV_BYTES:
            raise Invalid(f"the variables take {total} bytes, over the {MAX_ENV_BYTES // 1024} KiB "
                          "allowed (the launch would fail with 'Argument list too long')",
                          fix="pass large data in a file under workdir, and its path here")
        return env

    @field_validator("secrets")
    @classmethod
    def _secrets(cls, names: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        for key in names:
            if not re.fullmatch(ENV_NAME_RE, key):
                raise Invalid(f"{key!r} is not a valid environment variable name",
                              fix="list the names of variables set where you run orchestrate, "
                              "e.g. [WANDB_API_KEY]")
        reserved = [key for key in names if is_reserved_env(key)]
        if reserved:
            raise Invalid(f"{', '.join(reserved)}: set by the orchestrator in every task",
                          fix="remove " + ", ".join(reserved))
        twice = sorted({key for key in names if names.count(key) > 1})
        if twice:
            raise Invalid(f"{', '.join(twice)} listed twice", fix="list each name once")
        both = [key for key in names if key in (info.data.get("env") or {})]
        if both:
            raise Invalid(f"{', '.join(both)} also in env, with its value in the spec",
                          fix=f"remove {', '.join(both)} from env: a secret's value comes from "
                          "the environment of the controller at launch")
        return names

    @property
    def num_tasks(self) -> int:
        return self.workers + (1 if self.separate_chief else 0)

    @property
    def max_workers(self) -> int:
        """The most workers the group trains with: ``elastic.max_workers``, else ``workers``."""
        most = self.elastic.max_workers if self.elastic is not None else None
        return most if most is not None else self.workers

    @property
    def spares(self) -> int:
        """Machines past the tasks an elastic group may grow onto (``max_workers - workers``)."""
        return self.max_workers - self.workers

    @property
    def spare_indices(self) -> range:
        """The host indices of the spares: after the tasks' (a provider names them as it
        names the tasks' hosts)."""
        return range(self.num_tasks, self.num_tasks + self.spares)

    @property
    def engine_container(self) -> Container | None:
        """The image a host's container engine (docker, podman) runs the tasks in; None
        without ``container``, and on Kubernetes, where the pods are of the image."""
        return None if isinstance(self.provider, KubernetesProvider) else self.container


def is_reserved_env(key: str) -> bool:
    """True for an env key the orchestrator sets in every task over the spec's value."""
    return key.startswith(RESERVED_ENV) or key in PLAN_ENV


def _why_reserved(key: str) -> str:
    return f"{key}: {PLAN_ENV[key]}" if key in PLAN_ENV else f"{key}: the orchestrator's own"


UNION_MEMBERS: dict[str, type[BaseModel]] = {**_members(Provider, "kind"), **_members(Job, "mode")}

UNION_FIELDS = ("provider", "job")

# -- loading --------------------------------------------------------------------------------

# What a spec file may be. A real one is a few KiB, a few levels deep, a few hundred values
# (1024 static hosts are about 15 000): the bounds refuse what would take the loader's memory
# or time (an alias of an alias ... of a list: a "billion laughs"), or its stack (10 000 '[').
MAX_SPEC_BYTES = 1 << 20
MAX_DEPTH = 64
MAX_NODES = 100_000

FIXES: dict[str, str] = {
    "missing": "add the field",
    "int_parsing": "write a whole number",
    "int_type": "write a whole number",
    "int_from_float": "write a whole number",
    "int_parsing_size": "write a smaller whole number",
    "float_parsing": "write a number",
    "float_type": "write a number",
    "finite_number": "write a finite number (.inf and .nan are not allowed)",
    "bool_parsing": "write true or false",
    "bool_type": "write true or false",
    "string_type": "write a string (quote it if YAML reads it as something else)",
    "greater_than_equal": "use a larger value",
    "greater_than": "use a larger value",
    "less_than_equal": "use a smaller value",
    "less_than": "use a smaller value",
    "string_pattern_mismatch": "fix the spelling to match the pattern",
    "string_too_short": "give a non-empty value",
    "string_too_long": "shorten it",
    "literal_error": "use one of the allowed values",
    "union_tag_invalid": "use one of the allowed values",
    "union_tag_not_found": "add the discriminating field",
    "too_short": "give at least one item",
    "too_long": "give fewer items",
    "dict_type": "write a mapping (key: value lines)",
    "model_type": "write a mapping (key: value lines)",
    "model_attributes_type": "write a mapping (key: value lines)",
    "tuple_type": "write a list ([a, b] or '- item' lines)",
    "list_type": "write a list ([a, b] or '- item' lines)",
}
# Any other error: what the field accepts is in its JSON Schema.
GENERIC_FIX = "see 'orchestrate schema' for what this field accepts"


def load(path: str | Path) -> ClusterSpec:
    """Read and validate a cluster spec file.

    Raises:
        SpecError: naming the file, the line, the field path, what was received and the fix.
    """
    path = Path(path)
    text = _read(path)
    return parse(text, file=str(path), base_dir=path.resolve().parent)


def _read(path: Path) -> str:
    """The text of a regular file of at most MAX_SPEC_BYTES in UTF-8. The file is opened
    without blocking (a FIFO with no writer would wait forever) and checked by its descriptor,
    so a FIFO, a device such as /dev/zero, a socket or a directory is refused, never read."""
    file = str(path).replace("\0", "\\0")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except ValueError:  # an embedded NUL
        raise SpecError("the path contains a NUL character", file=file,
                        fix="give the path of the spec file") from None
    except OSError as exc:
        raise _unreadable(exc, file) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise SpecError(f"not a regular file: it is {_file_kind(mode)}", file=file,
                            fix="give the path of a YAML spec file")
        with open(fd, "rb", closefd=False) as stream:
            data = stream.read(MAX_SPEC_BYTES + 1)
    except OSError as exc:
        raise _unreadable(exc, file) from None
    finally:
        os.close(fd)
    if len(data) > MAX_SPEC_BYTES:
        raise _too_large(file)
    return _decode(data, file)


def _unreadable(exc: OSError, file: str) -> SpecError:
    problem, fix = {
        errno.ENOENT: ("no such file", "check the path"),
        errno.ENOTDIR: ("a directory in the path is a file", "check the path"),
        errno.EACCES: ("permission denied", "make the file readable to you (chmod u+r FILE)"),
        errno.EPERM: ("permission denied", "make the file readable to you (chmod u+r FILE)"),
        errno.ELOOP: ("the path is a loop of symbolic links", "point the links at the file"),
        errno.ENAMETOOLONG: ("the path is longer than the file system allows",
                             "give a shorter path"),
        errno.ENXIO: ("not a regular file: it is a socket or a device",
                      "give the path of a YAML spec file"),
    }.get(exc.errno or 0, (f"cannot read: {exc.strerror}", "check the path and the file"))
    return SpecError(problem, file=file, fix=fix)


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "not a plain file"


def _too_large(file: str) -> SpecError:
    return SpecError(f"the file is larger than {MAX_SPEC_BYTES >> 20} MiB", file=file,
                     fix="a cluster spec is a few KiB: check that this is the spec file")


_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"),
         (b"\xff\xfe", "UTF-16"), (b"\xfe\xff", "UTF-16"))


def _decode(data: bytes, file: str) -> str:
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            raise SpecError(f"the file is {encoding} (it starts with a {encoding} byte-order mark), "
                            "not UTF-8", file=file, line=1, fix="save it as UTF-8")
    data = data.removeprefix(b"\xef\xbb\xbf")  # UTF-8's own mark, which some editors write
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise SpecError(f"not UTF-8 at line {line}, byte {column} (0x{data[exc.start]:02x}; "
                        "Latin-1 or another legacy encoding?)", file=file, line=line,
                        fix="save it as UTF-8") from None


def parse(text: str, *, file: str = "<spec>", base_dir: Path | None = None) -> ClusterSpec:
    """Validate spec text; with ``base_dir``, also check that what it names exists there."""
    if len(text) > MAX_SPEC_BYTES:
        raise _too_large(file)
    data, lines = _compose(text, file)
    if not isinstance(data, dict):
        raise SpecError(
            f"expected a mapping at the top level, received {_yaml_kind(data)}",
            file=file,
            fix="start the file with 'name: my-cluster' and a 'job:' section",
        )
    try:
        spec = ClusterSpec.model_validate(data)
    except ValidationError as exc:
        raise _spec_error(exc.errors()[0], lines, file, len(exc.errors())) from None
    _check_host_count(spec, file, lines)
    _check_machines(spec, file, lines)
    _check_kubernetes(spec, file, lines)
    _check_backend(spec, file, lines)
    if base_dir is not None:
        _check_paths(spec, base_dir, file, lines)
    return spec


def _compose(text: str, file: str) -> tuple[Any, dict[str, int]]:
    """Parse once: the node tree, then the data and the line of every field path from it."""
    bad = yaml.reader.Reader.NON_PRINTABLE.search(text)
    if bad is not None:
        raise SpecError(f"character U+{ord(bad.group()):04X} is not allowed in YAML",
                        file=file, line=text.count("\n", 0, bad.start()) + 1,
                        fix="remove it (inside double quotes, write it as an escape: \\x00)")
    loader = _Loader(text, file)
    try:
        node = loader.get_single_node()
    except yaml.MarkedYAMLError as exc:
        mark, context = exc.problem_mark, exc.context_mark
        problem = exc.problem or str(exc)
        if exc.context:
            problem += f" ({exc.context}" + (f" at line {context.line + 1})" if context else ")")
        raise SpecError(f"not valid YAML: {problem}", file=file,
                        line=mark.line + 1 if mark is not None else None,
                        fix=_yaml_fix(problem)) from None
    except yaml.YAMLError as exc:
        raise SpecError(f"not valid YAML: {exc}", file=file, fix=_yaml_fix(str(exc))) from None
    finally:
        loader.dispose()
    if node is None:
        raise SpecError("the file is empty (or only comments)", file=file,
                        fix="start the file with 'name: my-cluster' and a 'job:' section")
    tree = _Tree(loader, file)
    return tree.build(node, ()), tree.lines


def _yaml_fix(problem: str) -> str:
    for says, fix in ((r"'\t'", "indent with spaces, not tabs"), ("tab", "indent with spaces, not tabs"),
                      ("another document", "keep one document: remove the second '---'"),
                      ("undefined alias", "define the anchor (&NAME) before its alias (*NAME)"),
                      ("anchor", "give each anchor (&NAME) its own name")):
        if says in problem:
            return fix
    return "fix the YAML at that line: indentation, quotes, brackets, ':' after each key"


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, whose composer (which recurses once per level) refuses more than
    MAX_DEPTH levels or MAX_NODES nodes before the stack or the memory runs out."""

    def __init__(self, text: str, file: str) -> None:
        super().__init__(text)
        self.file = file
        self.depth = 0
        self.nodes = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        self.depth += 1
        self.nodes += 1
        try:
            if self.depth > MAX_DEPTH or self.nodes > MAX_NODES:
                line = self.peek_event().start_mark.line + 1  # type: ignore[no-untyped-call]
                if self.depth > MAX_DEPTH:
                    raise SpecError(f"nested more than {MAX_DEPTH} levels deep", file=self.file,
                                    line=line, fix="a spec is a few levels deep: check the "
                                    "brackets and the indentation")
                raise SpecError(f"more than {MAX_NODES} values", file=self.file, line=line,
                                fix="a spec holds a few hundred values: check that this is "
                                "the spec file")
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


YAML_TAG = "tag:yaml.org,2002:"
SCALAR_TAGS = {YAML_TAG + kind for kind in ("str", "int", "float", "bool", "null")}


class _Tree:
    """Plain data from a node tree, and the line of every field path (a key's line, a list
    item's first line). An alias is expanded where it is used (each expanded node is visited
    once), within MAX_NODES and MAX_DEPTH; an alias inside its own anchor is refused. Keys
    must be strings, each given once; ``<<`` merges mappings, as in PyYAML."""

    def __init__(self, loader: _Loader, file: str) -> None:
        self.loader = loader
        self.file = file
        self.lines: dict[str, int] = {}
        self.size = 0
        self.open: set[int] = set()  # the collections being built: an alias to one is a loop

    def build(self, node: yaml.Node, path: tuple[str | int, ...]) -> Any:
        self.size += 1
        if self.size > MAX_NODES:
            self._fail(node, path, f"more than {MAX_NODES} values once its aliases are expanded",
                       "use fewer aliases (an alias of an alias of ... multiplies), or write "
                       "the values out")
        if len(path) >= MAX_DEPTH:
            self._fail(node, path, f"nested more than {MAX_DEPTH} levels deep once its aliases "
                       "are expanded", "use fewer aliases inside aliased values")
        if isinstance(node, yaml.ScalarNode):
            return self._scalar(node, path)
        if id(node) in self.open:
            self._fail(node, path, "an alias inside its own anchor: the value would contain "
                       "itself", "an alias (*NAME) cannot be used inside the value its anchor "
                       "(&NAME) names: write the value out")
        self.open.add(id(node))
        try:
            if isinstance(node, yaml.MappingNode) and node.tag == YAML_TAG + "map":
                return self._mapping(node, path)
            if isinstance(node, yaml.SequenceNode) and node.tag == YAML_TAG + "seq":
                items = []
                for i, item in enumerate(node.value):
                    self.lines.setdefault(_dotted((*path, i)), item.start_mark.line + 1)
                    items.append(self.build(item, (*path, i)))
                return items
            return self._unsupported(node, path)
        finally:
            self.open.discard(id(node))

    def _mapping(self, node: yaml.MappingNode, path: tuple[str | int, ...]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        lines: dict[str, int] = {}
        merges: list[yaml.Node] = []
        for key_node, value_node in node.value:
            if key_node.tag == YAML_TAG + "merge":
                merges.append(value_node)
                continue
            key, line = self._key(key_node, path), key_node.start_mark.line + 1
            if key in lines:
                where = (f"on line {line}" if lines[key] == line
                         else f"at lines {lines[key]} and {line}")
                self._fail(key_node, (*path, key), f"{key!r} is given twice, {where}",
                           "keep one of them (the second would silently replace the first)")
            lines[key] = line
            self.lines.setdefault(_dotted((*path, key)), line)
            out[key] = self.build(value_node, (*path, key))
        for merge in merges:  # explicit keys win, then the first mapping merged
            sources = merge.value if isinstance(merge, yaml.SequenceNode) else [merge]
            for source in sources:
                if not isinstance(source, yaml.MappingNode):
                    self._fail(source, path, "'<<' merges a mapping or a list of mappings",
                               "write '<<: *NAME' where &NAME names a mapping")
                for key, value in self.build(source, path).items():
                    out.setdefault(key, value)
        return out

    def _key(self, node: yaml.Node, path: tuple[str | int, ...]) -> str:
        if not isinstance(node, yaml.ScalarNode):
            self._fail(node, path, f"a key must be a string, received {_node_kind(node)}",
                       "write 'key: value' lines ('?' starts a complex key)")
        key = self._scalar(node, path)
        if not isinstance(key, str):
            self._fail(node, path, f"the key {node.value!r} is {_yaml_kind(key)}, not a string",
                       f"quote it: '{node.value}':")
        return key

    def _scalar(self, node: yaml.ScalarNode, path: tuple[str | int, ...]) -> Any:
        if node.tag == YAML_TAG + "timestamp":
            return node.value  # every field a date could be given to is text
        if node.tag not in SCALAR_TAGS:
            return self._unsupported(node, path)
        try:
            return self.loader.construct_object(node)
        except ValueError:  # more digits than int() converts
            self._fail(node, path, f"a number of {len(node.value)} digits",
                       "write a smaller number")

    def _unsupported(self, node: yaml.Node, path: tuple[str | int, ...]) -> NoReturn:
        self._fail(node, path, f"the YAML tag {node.tag!r} is not supported here",
                   "remove the tag: a spec holds mappings, lists, strings, numbers and booleans")

    def _fail(self, node: yaml.Node, path: tuple[str | int, ...], message: str,
              fix: str) -> NoReturn:
        raise SpecError(message, file=self.file, field=_dotted(path) or "(top level)",
                        line=node.start_mark.line + 1, fix=fix)


def _dotted(path: tuple[str | int, ...] | list[Any]) -> str:
    return ".".join(str(p) for p in path)


def _node_kind(node: yaml.Node) -> str:
    return "a mapping" if isinstance(node, yaml.MappingNode) else "a list"


def _yaml_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, list):
        return "a list"
    return "a string" if isinstance(value, str) else "a mapping"


def _check_host_count(spec: ClusterSpec, file: str, lines: dict[str, int]) -> None:
    if not isinstance(spec.provider, StaticProvider):
        return
    wanted = spec.num_tasks + spec.spares
    if len(spec.provider.hosts) == wanted:
        return
    if spec.spares:
        raise SpecError(
            f"{len(spec.provider.hosts)} host(s) listed for {spec.num_tasks} task(s) and "
            f"{spec.spares} spare(s) (workers: {spec.workers}, elastic.max_workers: "
            f"{spec.max_workers})", file=file, field="provider.hosts",
            line=lines.get("provider.hosts"),
            fix=f"list {wanted} hosts: one per worker, then the spares the group may grow "
                "onto; or change elastic.max_workers to match the hosts")
    raise SpecError(
        f"{len(spec.provider.hosts)} host(s) listed for {spec.num_tasks} task(s) "
        f"(workers: {spec.workers}, separate_chief: {str(spec.separate_chief).lower()})",
        file=file,
        field="provider.hosts",
        line=lines.get("provider.hosts"),
        fix="list one host per task, or change workers to match the hosts"
            + (" (or set elastic.max_workers: the hosts past workers are then spares)"
               if spec.elastic is not None and len(spec.provider.hosts) > spec.num_tasks
               else ""),
    )


def _check_machines(spec: ClusterSpec, file: str, lines: dict[str, int]) -> None:
    """What plan.build refuses that the spec alone decides, so that 'validate' refuses it too:
    loopback addresses across machines, two tasks pinning one port of a machine, and a port
    range too small for the tasks that share a machine (TF's gRPC binds every address)."""
    if isinstance(spec.provider, GcpProvider | SlurmProvider | KubernetesProvider):
        return  # a VM, a node or a pod per task: one port each
    if isinstance(spec.provider, LocalProvider):
        _check_port_range(spec, spec.num_tasks, 0, file, lines)
        return
    hosts = spec.provider.hosts
    machines: dict[str, list[int]] = {}
    for i, host in enumerate(hosts):
        machines.setdefault(machine_id(host.ssh_address or host.address, host.ssh_port), []).append(i)
    for i, host in enumerate(hosts):
        if len(machines) > 1 and is_loopback(host.address):
            field = f"provider.hosts.{i}.address"
            raise SpecError(
                f"the loopback address {host.address}, but the tasks run on {len(machines)} "
                "machines, which cannot reach each other's loopback", file=file, field=field,
                line=_nearest_line(lines, field.split(".")),
                fix="give every host an address the other hosts can reach (its internal IP)")
    for indices in machines.values():
        pinned: dict[int, int] = {}
        for i in indices:
            port = hosts[i].task_port
            if port is not None and port in pinned:
                field = f"provider.hosts.{i}.task_port"
                raise SpecError(
                    f"hosts {pinned[port]} and {i} are one machine, and both pin port {port}",
                    file=file, field=field, line=_nearest_line(lines, field.split(".")),
                    fix="give each task on the same machine its own port")
            if port is not None:
                pinned[port] = i
        in_range = sum(1 for p in pinned if spec.ports.start <= p <= spec.ports.end)
        _check_port_range(spec, len(indices) - len(pinned), in_range, file, lines)


def _check_backend(spec: ClusterSpec, file: str, lines: dict[str, int]) -> None:
    """``backend: jax`` is Keras 3; a managed job on JAX checkpoints to a path, not a bucket;
    model_parallel is JAX's, with a mesh."""
    job = spec.job

    def refuse(field: str, message: str, fix: str) -> NoReturn:
        raise SpecError(message, file=file, field=field,
                        line=_nearest_line(lines, field.split(".")), fix=fix)

    if job.backend != "jax":
        if isinstance(job, ManagedJob) and job.distribution == "model_parallel":
            refuse("job.distribution", "model_parallel is Keras's ModelParallel, which runs on "
                   "JAX, and job.backend is tensorflow",
                   "set job.backend: jax (the module's model in Keras 3), or job.distribution: "
                   "data_parallel")
        return
    if job.keras == "2":
        refuse("job.keras", "keras: 2 (tf_keras) runs only on TensorFlow, and job.backend is jax",
               "remove job.keras (on JAX it is 3), or set job.backend: tensorflow")
    if isinstance(job, ManagedJob) and job.distribution == "model_parallel" and not job.mesh:
        refuse("job.mesh", "job.distribution is model_parallel, which splits the variables over "
               "a device mesh, and job.mesh is not set",
               "set job.mesh: [BATCH, MODEL], e.g. [1, 2] to split the layout map's variables "
               "over 2 devices (BATCH x MODEL must be every device of every task)")


def _check_kubernetes(spec: ClusterSpec, file: str, lines: dict[str, int]) -> None:
    """On Kubernetes every task is a pod of ``container.image``, and what must outlive a pod
    (checkpoints, the final model) is on ``provider.volume`` or in a gs:// bucket."""
    if not isinstance(spec.provider, KubernetesProvider):
        return

    def refuse(field: str, message: str, fix: str) -> NoReturn:
        raise SpecError(message, file=file, field=field,
                        line=_nearest_line(lines, field.split(".")), fix=fix)

    if spec.container is None:
        refuse("container", "provider.kind kubernetes runs every task in a pod of an image, and "
               "there is no container.image", "add 'container: {image: REGISTRY/PATH:TAG}' "
               "(the image built from docker/, see docker/README.md)")
    if spec.container.options:
        refuse("container.options", "container.options are `docker run` options, which a pod "
               "does not take", "remove them; set what pods need in provider.resources, "
               "provider.node_selector or provider.tolerations")
    named = spec.job.checkpoint_dir if isinstance(spec.job, CommandJob) else None
    if spec.provider.volume is None and not is_url(named if named is not None
                                                   else spec.checkpoint.dir or ""):
        refuse("provider.volume", "nothing on Kubernetes keeps the checkpoints and the final "
               "model: a pod's own disk is gone with the pod", "add 'volume: {claim: NAME}' "
               "under provider: a ReadWriteMany PersistentVolumeClaim in provider.namespace "
               "(Filestore, NFS, or the gcsfuse CSI driver); or put them in a bucket: "
               "'checkpoint: {dir: gs://BUCKET/PATH}', which the pods write with Workload "
               "Identity (provider.service_account)")
    if spec.checkpoint.dir is not None and not is_url(spec.checkpoint.dir):
        refuse("checkpoint.dir", f"{spec.checkpoint.dir!r} is a path on the hosts, and pods "
               "see none of the hosts' files", "remove it (checkpoints go to provider.volume) "
               "or give a gs://BUCKET/PATH URL")
    if named is not None and not is_url(named):
        refuse("job.checkpoint_dir", f"{named!r} is in the pod's own files (its code directory "
               "is read-only and gone with the pod)", "remove it: the job checkpoints to "
               "$ORCHESTRATE_CHECKPOINT_DIR, on provider.volume; or give a gs:// URL")


def _check_port_range(spec: ClusterSpec, tasks: int, taken: int, file: str,
                      lines: dict[str, int]) -> None:
    """``tasks`` on one machine take a port each from the range, where ``taken`` are pinned."""
    start, end = spec.ports.start, spec.ports.end
    if tasks > end - start + 1 - taken:
        raise SpecError(
            f"the range {start}-{end} has {end - start + 1} port(s)"
            + (f", {taken} of them pinned by task_port," if taken else "")
            + f" for {tasks} task(s) on one machine",
            file=file, field="ports", line=lines.get("ports"),
            fix=f"widen it: ports.end: {start + tasks + taken - 1} or more")


def workdir_of(spec: ClusterSpec, spec_path: str | Path) -> Path:
    return (Path(spec_path).resolve().parent / spec.workdir).resolve()


def _check_paths(spec: ClusterSpec, base_dir: Path, file: str, lines: dict[str, int]) -> None:
    workdir = _local_path(base_dir, spec.workdir, "workdir", file, lines, expand_user=False)
    if not _probe(workdir.is_dir, "workdir", file, lines):
        raise SpecError(
            f"directory {workdir} does not exist (received {spec.workdir!r})",
            file=file,
            field="workdir",
            line=lines.get("workdir"),
            fix="point workdir at your project directory, relative to the spec file",
        )
    if isinstance(spec.job, ManagedJob):
        rel = spec.job.module.replace(".", "/")
        candidates = [workdir / f"{rel}.py", workdir / rel / "__init__.py"]
        if not any(_probe(c.is_file, "job.module", file, lines) for c in candidates):
            raise SpecError(
                f"module {spec.job.module!r} not found under {workdir} "
                f"(looked for {rel}.py and {rel}/__init__.py)",
                file=file,
                field="job.module",
                line=lines.get("job.module"),
                fix="name a module of your project as a dotted path relative to workdir",
            )
    if isinstance(spec.provider, StaticProvider):  # as the static provider resolves them
        for i, host in enumerate(spec.provider.hosts):
            _local_path(base_dir, host.key_file, f"provider.hosts.{i}.key_file", file, lines)
        if spec.provider.known_hosts is not None:
            _local_path(base_dir, spec.provider.known_hosts, "provider.known_hosts", file, lines)


def _local_path(base_dir: Path, value: str, field: str, file: str, lines: dict[str, int],
                *, expand_user: bool = True) -> Path:
    """``value`` made absolute from the spec's directory, or a SpecError that names the field:
    a loop of symbolic links, an unknown ~user, a name the file system refuses."""
    try:
        return (base_dir / (Path(value).expanduser() if expand_user else Path(value))).resolve()
    except RuntimeError as exc:  # Python 3.11: a symlink loop, or ~user with no home
        problem = ("a loop of symbolic links" if "loop" in str(exc).lower()
                   else "'~USER' names no user of this machine")
        raise _path_error(value, problem, field, file, lines) from None
    except (OSError, ValueError) as exc:
        raise _path_error(value, getattr(exc, "strerror", None) or str(exc), field, file,
                          lines) from None


def _probe(check: Any, field: str, file: str, lines: dict[str, int]) -> bool:
    """``check()`` (Path.is_dir or is_file), with what the OS refuses as a SpecError."""
    try:
        return bool(check())
    except (OSError, ValueError) as exc:
        path = str(getattr(check, "__self__", ""))
        raise _path_error(path, getattr(exc, "strerror", None) or str(exc), field, file,
                          lines) from None


def _path_error(value: str, problem: str, field: str, file: str,
                lines: dict[str, int]) -> SpecError:
    return SpecError(f"cannot use the path {_show(value)}: {problem}", file=file, field=field,
                     line=_nearest_line(lines, field.split(".")),
                     fix="give a path that exists on this machine, relative to the spec file "
                         "or absolute")


def _spec_error(err: ErrorDetails, lines: dict[str, int], file: str, count: int) -> SpecError:
    loc = _without_union_tag(list(err["loc"]))
    field = _dotted(loc) or "(top level)"
    line = _nearest_line(lines, loc)
    kind = err["type"]
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    ctx = err.get("ctx", {})
    fix = ctx.get("fix") or getattr(ctx.get("error"), "fix", None) or FIXES.get(kind, GENERIC_FIX)
    if kind == "extra_forbidden":
        allowed = _allowed_keys(list(err["loc"][:-1]))
        msg = f"unknown key {loc[-1]!r}"
        close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        fix = (f"did you mean {close[0]!r}? " if close else "remove it; ") + (
            "allowed keys here: " + ", ".join(allowed)
        )
    elif kind == "union_tag_invalid":
        field = f"{field}.{ctx.get('discriminator', 'kind')}".replace("'", "")
        msg = f"unknown value {ctx.get('tag')!r}"
        fix = f"use one of: {ctx.get('expected_tags')}"
    elif kind == "missing":
        msg = "required field is missing"
        fix = f"add '{loc[-1]}:' " + ("to the top level" if len(loc) == 1 else f"under {loc[-2]}")
    elif loc and not msg.endswith(")"):
        msg = f"{msg} (received {_show(err.get('input'))})"
    if count > 1:
        msg += f" [and {count - 1} more problem{'s' if count > 2 else ''}]"
    return SpecError(msg, file=file, field=field, line=line, fix=fix)


def _without_union_tag(loc: list[Any]) -> list[Any]:
    """Pydantic puts the union member's tag after a union field: ('job', 'managed', 'epochs')."""
    if len(loc) > 1 and loc[0] in UNION_FIELDS and loc[1] in UNION_MEMBERS:
        return [loc[0], *loc[2:]]
    return loc


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _allowed_keys(loc: list[Any]) -> list[str]:
    """The keys the model at ``loc`` (a pydantic error location) accepts."""
    model: type[BaseModel] = ClusterSpec
    for part in loc:
        if isinstance(part, int):
            continue
        if part in UNION_MEMBERS:
            model = UNION_MEMBERS[part]
            continue
        field = model.model_fields.get(str(part))
        models = _models_in(field.annotation) if field else []
        if not models:
            return []
        model = models[0]
    return sorted(model.model_fields)


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


def _nearest_line(lines: dict[str, int], loc: list[Any]) -> int | None:
    for end in range(len(loc), 0, -1):
        key = _dotted(loc[:end])
        if key in lines:
            return lines[key]
    return None
