"""Pydantic models of the cluster spec file, and `load()` that turns bad input into one SpecError."""

from __future__ import annotations

import difflib
import re
import shlex
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails

from orchestrator.causes import BUDGETED
from orchestrator.errors import SpecError

NAME_RE = r"^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$"
ENV_NAME_RE = r"^[A-Za-z_][A-Za-z0-9_]*$"
MODULE_RE = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"
RESERVED_ENV = ("TF_CONFIG", "ORCHESTRATE_")


class Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LocalProvider(Model):
    """Every task is a process on this machine, on loopback ports. Needs no cloud and no SSH."""

    kind: Literal["local"] = "local"
    python: str | None = Field(
        default=None,
        description="Interpreter for the tasks; default: the one running the controller.",
    )


class StaticHost(Model):
    """A machine you already have, reached over SSH."""

    address: str = Field(min_length=1, description="Where the other tasks reach this host (internal IP).")
    ssh_address: str | None = Field(
        default=None, description="Where the controller connects over SSH; default: address."
    )
    ssh_port: int = Field(default=22, ge=1, le=65535)
    user: str = Field(pattern=r"^[a-z_][a-z0-9_.-]*[$]?$", max_length=32)
    key_file: str = Field(min_length=1, description="Private key for this user (no agent is used).")
    host_key: str | None = Field(
        default=None, description="The host's public key line, e.g. 'ssh-ed25519 AAAA...'."
    )
    task_port: int | None = Field(default=None, ge=1024, le=65535)
    name: str | None = Field(default=None, pattern=NAME_RE)

    @field_validator("host_key")
    @classmethod
    def _key_line(cls, value: str | None) -> str | None:
        if value is not None and len(value.split()) < 2:
            raise ValueError(
                "expected an OpenSSH public key line such as 'ssh-ed25519 AAAA...' "
                "(from 'ssh-keyscan HOST' or /etc/ssh/ssh_host_ed25519_key.pub on the host)"
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
    connect_timeout_s: float = Field(default=10.0, gt=0)

    @field_validator("root")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("/"):
            raise ValueError(f"must be an absolute path, received {value!r}")
        return value


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
        default=60.0, ge=0, description="How long 'up' retries a host that does not answer."
    )


GCP_PROJECT_RE = r"^[a-z][-a-z0-9]{4,28}[a-z0-9]$"
GCP_ZONE_RE = r"^[a-z]+-[a-z]+[0-9]+-[a-z]$"
GCP_NAME_RE = r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$"
GCP_LABEL_KEY_RE = r"^[a-z][-_a-z0-9]{0,62}$"
GCP_LABEL_VALUE_RE = r"^[-_a-z0-9]{0,63}$"
GCP_RESERVED_METADATA = ("ssh-keys", "enable-guest-attributes", "enable-oslogin")
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
    ssh_user: str = Field(default="orchestrate", pattern=r"^[a-z_][a-z0-9_.-]*[$]?$", max_length=32)
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
        default=600.0, gt=0, description="How long 'up' waits for a VM to run and answer SSH."
    )
    api_timeout_s: float = Field(
        default=600.0, gt=0,
        description="How long one Compute Engine call or operation may take, retries included.",
    )

    @field_validator("zones")
    @classmethod
    def _zones(cls, zones: tuple[str, ...]) -> tuple[str, ...]:
        for zone in zones:
            if not re.match(GCP_ZONE_RE, zone):
                raise ValueError(f"{zone!r} is not a zone name such as 'us-central1-a'")
        if len(set(zones)) != len(zones):
            raise ValueError(f"a zone is listed twice (received {list(zones)})")
        return zones

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, items: dict[str, str]) -> dict[str, str]:
        for key in items:
            if key in GCP_RESERVED_METADATA:
                raise ValueError(f"{key!r} is set by the orchestrator and cannot be given here")
        return items

    @field_validator("labels")
    @classmethod
    def _labels(cls, labels: dict[str, str]) -> dict[str, str]:
        for key, value in labels.items():
            if key == GCP_RESERVED_LABEL:
                raise ValueError(f"{key!r} is set by the orchestrator and cannot be given here")
            if not re.match(GCP_LABEL_KEY_RE, key) or not re.match(GCP_LABEL_VALUE_RE, value):
                raise ValueError(
                    f"label {key}={value!r} is not a valid GCP label: lower-case letters, digits, "
                    "'-' and '_', a key starting with a letter, at most 63 characters each"
                )
        return labels

    @field_validator("tags")
    @classmethod
    def _tags(cls, tags: tuple[str, ...]) -> tuple[str, ...]:
        for tag in tags:
            if not re.match(GCP_NAME_RE, tag):
                raise ValueError(f"{tag!r} is not a valid network tag (lower-case, digits, '-')")
        return tags

    @model_validator(mode="after")
    def _ssh_path(self) -> GcpProvider:
        if self.ssh_via == "external" and not self.external_ip:
            raise ValueError("ssh_via: external needs external_ip: true (the VMs have no public IP)")
        return self


Provider = Annotated[LocalProvider | StaticProvider | GcpProvider, Field(discriminator="kind")]


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
        if not re.match(IMAGE_RE, image):
            raise ValueError(
                f"{image!r} is not an image reference: write [REGISTRY/]PATH[:TAG][@sha256:DIGEST] "
                "in lower case, e.g. us-docker.pkg.dev/PROJECT/REPO/orchestrate-worker:2.21")
        return image

    @field_validator("options")
    @classmethod
    def _options(cls, options: tuple[str, ...]) -> tuple[str, ...]:
        for option in options:
            if any(c in option for c in "\0\n\r"):
                raise ValueError(f"option {option!r} contains a control character")
            name = option.split("=", 1)[0]
            if name in RESERVED_RUN_OPTIONS:
                raise ValueError(f"option {option!r} is set by the orchestrator (tasks use the "
                                 "host network and their own name, user and labels): remove it")
        return options


def check_storage_path(value: str, *, relative_ok: bool) -> str:
    """A checkpoint location: a ``gs://bucket/...`` URL or a path (absolute unless ``relative_ok``)."""
    if any(c in value for c in "\0\n\r"):
        raise ValueError("the path contains a control character")
    if "://" in value:
        bucket = value[len("gs://"):].split("/", 1)[0] if value.startswith("gs://") else ""
        if not re.fullmatch(r"[a-z0-9][-a-z0-9_.]{1,220}[a-z0-9]", bucket):
            raise ValueError(
                f"{value!r} is not a gs://BUCKET/PATH URL: TensorFlow reads and writes gs:// "
                "natively; other storage must be mounted and named by its absolute path")
        return value.rstrip("/")
    if not value.startswith("/") and not relative_ok:
        raise ValueError(f"{value!r} is relative: give the absolute path that every host "
                         "mounts (NFS, Filestore, gcsfuse) or a gs:// URL")
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
        "start (set_memory_growth; TF_FORCE_GPU_ALLOW_GROWTH=true for a command job).",
    )


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
    epochs: int = Field(default=5, ge=1)
    steps_per_epoch: int = Field(default=50, ge=1)
    per_replica_batch_size: int = Field(default=32, ge=1)
    optimizer: Literal["adam", "sgd", "rmsprop", "adamw"] = "adam"
    learning_rate: float = Field(default=1e-3, gt=0)
    scale_learning_rate: bool = Field(
        default=True, description="Multiply learning_rate by the number of replicas in sync."
    )
    loss: str = "sparse_categorical_crossentropy"
    metrics: tuple[str, ...] = ("accuracy",)
    seed: int | None = 1234
    deterministic: bool = Field(
        default=False, description="Op determinism + seeds: a resumed run matches an unbroken one."
    )
    progress_every_steps: int = Field(default=1, ge=1)

    _keras = field_validator("keras", mode="before")(_keras_major)


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
                raise ValueError(f"cannot split into words ({exc})") from exc
        return value


Job = Annotated[ManagedJob | CommandJob, Field(discriminator="mode")]


class Checkpoint(Model):
    """Where the run's checkpoints live, and whether this machine keeps its own copy."""

    every_steps: int = Field(
        default=20, ge=1, description="The chief writes a backup every this many steps."
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


WARM_AFTER_S = 30.0  # retry.warm_tasks: auto starts them after this much training


class Retry(Model):
    max_restarts: int = Field(default=3, ge=0, description="Group restarts before giving up.")
    per_cause: dict[str, int] = Field(
        default_factory=dict,
        description="Restarts allowed for each failure cause, within max_restarts, e.g. "
        "{hung: 1, preempted: 10}; a cause not listed may use all of max_restarts.",
    )
    backoff_initial_s: float = Field(default=1.0, ge=0)
    backoff_max_s: float = Field(default=30.0, ge=0)
    warm_tasks: bool | Literal["auto"] = Field(
        default="auto",
        description="Keep the next attempt's tasks started on every host, TensorFlow and the "
        "job's module imported, waiting: a relaunch then skips the cold start (managed jobs). "
        "Each is an idle Python process with TensorFlow loaded (about 0.6 GiB resident, under "
        f"0.5% of a core while it waits). auto starts them once an attempt has trained {WARM_AFTER_S:.0f}s "
        "(short runs do not pay for them); true at its first step; false never.",
    )

    @field_validator("per_cause")
    @classmethod
    def _known_causes(cls, budgets: dict[str, int]) -> dict[str, int]:
        for cause, count in budgets.items():
            if cause not in BUDGETED:
                close = difflib.get_close_matches(cause, BUDGETED, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise ValueError(f"unknown cause {cause!r}: {hint}causes are {', '.join(BUDGETED)}")
            if count < 0:
                raise ValueError(f"{cause}: a budget cannot be negative (received {count})")
        return budgets


class Timeouts(Model):
    startup_s: float = Field(
        default=300.0, gt=0, description="Every task must report its first step within this."
    )
    stop_grace_s: float = Field(
        default=60.0, ge=0,
        description="A planned stop ('down', Ctrl-C, a preemption or maintenance notice) sends "
        "SIGTERM: every task saves a checkpoint at the same step and exits; SIGKILL after this "
        "long. The survivors of a crash are killed at once (the group is broken).",
    )
    hang_s: float = Field(
        default=600.0, gt=0,
        description="Progress watchdog: no task reports anything for this long -> hung.",
    )
    collective_s: float | None = Field(
        default=None, gt=0,
        description="TF collective timeout: a collective waiting longer fails its task.",
    )
    repair_s: float = Field(
        default=600.0, ge=0, description="How long a lost host may take to come back."
    )
    poll_s: float = Field(
        default=15.0, gt=0, description="A host that does not answer a status poll this fast is lost."
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
    container: Container | None = Field(
        default=None, description="Run every task in a container image (see docker/README.md).")

    @model_validator(mode="before")
    @classmethod
    def _default_job_mode(cls, data: Any) -> Any:
        job = data.get("job") if isinstance(data, dict) else None
        if isinstance(job, dict) and "mode" not in job:
            data = {**data, "job": {**job, "mode": "command" if "command" in job else "managed"}}
        return data

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not re.match(NAME_RE, name):
            raise ValueError(
                f"{name!r} is not a valid name: use 1-40 lower-case letters, digits and '-', "
                "starting with a letter (it names files, VMs and labels)"
            )
        return name

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        for key in env:
            if not re.match(ENV_NAME_RE, key):
                raise ValueError(f"{key!r} is not a valid environment variable name")
            if key.startswith(RESERVED_ENV):
                raise ValueError(f"{key!r} is set by the orchestrator and cannot be overridden")
        return env

    @property
    def num_tasks(self) -> int:
        return self.workers + (1 if self.separate_chief else 0)


UNION_MEMBERS: dict[str, type[BaseModel]] = {**_members(Provider, "kind"), **_members(Job, "mode")}

UNION_FIELDS = ("provider", "job")

# -- loading --------------------------------------------------------------------------------

FIXES: dict[str, str] = {
    "missing": "add the field",
    "int_parsing": "write a whole number",
    "int_type": "write a whole number",
    "int_from_float": "write a whole number",
    "float_parsing": "write a number",
    "float_type": "write a number",
    "bool_parsing": "write true or false",
    "bool_type": "write true or false",
    "string_type": "write a string (quote it if YAML reads it as something else)",
    "greater_than_equal": "use a larger value",
    "greater_than": "use a larger value",
    "less_than_equal": "use a smaller value",
    "string_pattern_mismatch": "fix the spelling to match the pattern",
    "literal_error": "use one of the allowed values",
    "union_tag_invalid": "use one of the allowed values",
    "union_tag_not_found": "add the discriminating field",
    "too_short": "give at least one item",
    "dict_type": "write a mapping (key: value lines)",
    "model_type": "write a mapping (key: value lines)",
}


def load(path: str | Path) -> ClusterSpec:
    """Read and validate a cluster spec file.

    Raises:
        SpecError: naming the file, the line, the field path, what was received and the fix.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise SpecError("no such file", file=str(path), fix="check the path") from None
    except OSError as exc:
        raise SpecError(f"cannot read: {exc.strerror}", file=str(path)) from None
    return parse(text, file=str(path), base_dir=path.resolve().parent)


def parse(text: str, *, file: str = "<spec>", base_dir: Path | None = None) -> ClusterSpec:
    """Validate spec text; with ``base_dir``, also check that what it names exists there."""
    try:
        data = yaml.safe_load(text)
        lines = _line_index(yaml.compose(text))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        problem = getattr(exc, "problem", None) or str(exc)
        raise SpecError(f"not valid YAML: {problem}", file=file, line=line) from None
    if not isinstance(data, dict):
        raise SpecError(
            f"expected a mapping at the top level, received {type(data).__name__}",
            file=file,
            fix="start the file with 'name: my-cluster' and a 'job:' section",
        )
    try:
        spec = ClusterSpec.model_validate(data)
    except ValidationError as exc:
        raise _spec_error(exc.errors()[0], lines, file, len(exc.errors())) from None
    _check_host_count(spec, file, lines)
    if base_dir is not None:
        _check_paths(spec, base_dir, file, lines)
    return spec


def _check_host_count(spec: ClusterSpec, file: str, lines: dict[str, int]) -> None:
    if isinstance(spec.provider, StaticProvider) and len(spec.provider.hosts) != spec.num_tasks:
        raise SpecError(
            f"{len(spec.provider.hosts)} host(s) listed for {spec.num_tasks} task(s) "
            f"(workers: {spec.workers}, separate_chief: {str(spec.separate_chief).lower()})",
            file=file,
            field="provider.hosts",
            line=lines.get("provider.hosts"),
            fix="list one host per task, or change workers to match the hosts",
        )


def workdir_of(spec: ClusterSpec, spec_path: str | Path) -> Path:
    return (Path(spec_path).resolve().parent / spec.workdir).resolve()


def _check_paths(spec: ClusterSpec, base_dir: Path, file: str, lines: dict[str, int]) -> None:
    workdir = (base_dir / spec.workdir).resolve()
    if not workdir.is_dir():
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
        if not any(c.is_file() for c in candidates):
            raise SpecError(
                f"module {spec.job.module!r} not found under {workdir} "
                f"(looked for {rel}.py and {rel}/__init__.py)",
                file=file,
                field="job.module",
                line=lines.get("job.module"),
                fix="name a module of your project as a dotted path relative to workdir",
            )


def _spec_error(err: ErrorDetails, lines: dict[str, int], file: str, count: int) -> SpecError:
    loc = _without_union_tag(list(err["loc"]))
    field = ".".join(str(p) for p in loc) or "(top level)"
    line = _nearest_line(lines, loc)
    kind = err["type"]
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    fix = FIXES.get(kind)
    if kind == "extra_forbidden":
        allowed = _allowed_keys(list(err["loc"][:-1]))
        msg = f"unknown key {loc[-1]!r}"
        close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        fix = (f"did you mean {close[0]!r}? " if close else "remove it; ") + (
            "allowed keys here: " + ", ".join(allowed)
        )
    elif kind == "union_tag_invalid":
        ctx = err.get("ctx", {})
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


def _line_index(node: yaml.Node | None, prefix: str = "") -> dict[str, int]:
    """Map dotted field paths to 1-based line numbers in the YAML source."""
    out: dict[str, int] = {}
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            path = f"{prefix}.{key.value}" if prefix else str(key.value)
            out[path] = key.start_mark.line + 1
            out.update(_line_index(value, path))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            path = f"{prefix}.{i}"
            out[path] = item.start_mark.line + 1
            out.update(_line_index(item, path))
    return out


def _nearest_line(lines: dict[str, int], loc: list[Any]) -> int | None:
    for end in range(len(loc), 0, -1):
        key = ".".join(str(p) for p in loc[:end])
        if key in lines:
            return lines[key]
    return None
