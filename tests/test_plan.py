"""The planner is pure: tables of spec + hosts in, TF_CONFIG, ports and commands out."""

from __future__ import annotations

import json

import pytest

from orchestrator import plan, spec
from orchestrator.api import Scaling
from orchestrator.errors import PlanError, SpecError
from orchestrator.hosts import Host, SSHEndpoint
from orchestrator.runtimes import runtime_for
from worker.runtimes.managed import Job

SPEC = "name: demo\nworkers: {workers}\nseparate_chief: {chief}\njob: {{module: m}}\n"


def make_spec(workers: int = 2, chief: bool = False, extra: str = "") -> spec.ClusterSpec:
    return spec.parse(SPEC.format(workers=workers, chief=str(chief).lower()) + extra)


def local_hosts(n: int) -> list[Host]:
    return [Host(f"local-{i}", "127.0.0.1", "/home/u/.orchestrate/clusters/demo") for i in range(n)]


def remote(name: str, address: str, port: int | None = None, ssh_address: str | None = None
           ) -> Host:
    return Host(name, address, ".orchestrate/clusters/demo",
                ssh=SSHEndpoint(address=ssh_address or address, user="u"), task_port=port)


def build(s: spec.ClusterSpec, hosts: list[Host], **kw: object) -> plan.ClusterPlan:
    return plan.build(s, hosts, run_id="r1", python="/venv/bin/python", local_workdir="/proj",
                      **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("workers", "chief", "cluster", "tasks"),
    [
        (1, False, {"worker": ["127.0.0.1:23456"]}, [("worker", 0)]),
        (2, False, {"worker": ["127.0.0.1:23456", "127.0.0.1:23457"]},
         [("worker", 0), ("worker", 1)]),
        (2, True, {"chief": ["127.0.0.1:23456"], "worker": ["127.0.0.1:23457", "127.0.0.1:23458"]},
         [("chief", 0), ("worker", 0), ("worker", 1)]),
    ],
)
def test_tf_config_forms(workers: int, chief: bool, cluster: dict[str, list[str]],
                         tasks: list[tuple[str, int]]) -> None:
    p = build(make_spec(workers, chief), local_hosts(len(tasks)))
    assert [(t.role, t.index) for t in p.tasks] == tasks
    for t in p.tasks:
        config = json.loads(t.env["TF_CONFIG"])
        assert config == {"cluster": cluster, "task": {"type": t.role, "index": t.index}}
        assert config == t.tf_config
    assert p.chief_key == f"{tasks[0][0]}:0"


def test_remote_hosts_share_a_port_and_use_the_synced_code_dir() -> None:
    hosts = [remote("a", "198.18.0.2"), remote("b", "198.18.0.3")]
    p = build(make_spec(2), hosts)
    assert p.cluster_def == {"worker": ("198.18.0.2:23456", "198.18.0.3:23456")}
    assert p.tasks[0].cwd == ".orchestrate/clusters/demo/code"
    assert p.tasks[0].env["PYTHONPATH"] == (
        ".orchestrate/clusters/demo/code:.orchestrate/clusters/demo/lib"
    )


def test_busy_ports_are_skipped_per_address() -> None:
    p = build(make_spec(2), local_hosts(2),
              busy_ports={("127.0.0.1", 23456), ("127.0.0.1", 23458), ("10.0.0.9", 23457)})
    assert [t.port for t in p.tasks] == [23457, 23459]


def test_ipv6_endpoints_are_bracketed() -> None:
    p = build(make_spec(1), [remote("a", "fd00::2")])
    assert p.tasks[0].endpoint == "[fd00::2]:23456"


def test_env_carries_run_identity_paths_and_user_env() -> None:
    p = build(make_spec(1, extra="env: {NCCL_DEBUG: INFO}\n"), local_hosts(1))
    env = p.tasks[0].env
    assert env["NCCL_DEBUG"] == "INFO"
    assert env["TF_USE_LEGACY_KERAS"] == "1"
    assert env["ORCHESTRATE_TASK"] == "worker:0" and env["ORCHESTRATE_RUN_ID"] == "r1"
    assert env["ORCHESTRATE_CHECKPOINT_DIR"] == (
        "/home/u/.orchestrate/clusters/demo/runs/r1/checkpoints"
    )
    assert p.tasks[0].log_path.endswith("/runs/r1/logs/attempt-1/worker-0.log")
    assert p.tasks[0].cwd == "/proj"


@pytest.mark.parametrize("job", [
    "{module: m}", "{module: m, keras: '3'}", "{command: python train.py}",
    "{command: python train.py, keras: '3', gpu_memory_growth: false}",
])
def test_no_spec_env_value_is_silently_lost(job: str) -> None:
    """Every key of a task's environment is either refused in the spec's env (the plan sets
    it over the spec's value) or, given there, keeps the spec's value."""
    base = f"name: demo\njob: {job}\n"
    for key in build(spec.parse(base), local_hosts(2)).tasks[0].env:
        text = base + f"env: {{{key}: from-spec}}\n"
        if spec.is_reserved_env(key):
            with pytest.raises(SpecError, match=f"{key}: set by the orchestrator"):
                spec.parse(text)
        else:
            assert build(spec.parse(text), local_hosts(2)).tasks[0].env[key] == "from-spec"


def test_managed_argv_carries_the_job_as_json() -> None:
    p = build(make_spec(1, extra="checkpoint: {every_steps: 7}\n"), local_hosts(1))
    argv = p.tasks[0].argv
    assert argv[:4] == ("/venv/bin/python", "-m", "worker", "managed")
    job = json.loads(argv[5])
    assert job["module"] == "m" and job["checkpoint_every_steps"] == 7
    parsed = Job.from_json(argv[5])  # the worker's side of the contract takes every field
    assert (parsed.module, parsed.checkpoint_every_steps) == ("m", 7)


def test_command_argv_runs_the_users_python_through_the_worker_wrapper() -> None:
    s = spec.parse("name: c\njob: {command: python train.py --x 1}\n")
    p = build(s, local_hosts(2))
    assert p.tasks[0].argv == ("/venv/bin/python", "-m", "worker", "command", "--",
                               "/venv/bin/python", "train.py", "--x", "1")


@pytest.mark.parametrize(
    ("hosts", "message"),
    [
        ([], "3 tasks but 0 hosts"),
        (local_hosts(2), "3 tasks but 2 hosts"),
        ([remote("a", "127.0.0.1"), remote("b", "198.18.0.3"), remote("c", "198.18.0.4")],
         "loopback address 127.0.0.1"),
        ([remote("a", "localhost", ssh_address="198.18.0.2"), remote("b", "198.18.0.3"),
          remote("c", "198.18.0.4")], "loopback address localhost"),
        ([remote("a", "198.18.0.2", 5000), remote("b", "198.18.0.2", 5000),
          remote("c", "198.18.0.4")], "two tasks would listen on port 5000"),
    ],
)
def test_plans_that_cannot_work_are_refused(hosts: list[Host], message: str) -> None:
    with pytest.raises(PlanError, match=message) as info:
        build(make_spec(3), hosts)
    assert info.value.fix


def test_zero_tasks_is_refused() -> None:
    s = make_spec(1).model_copy(update={"workers": 0})
    with pytest.raises(PlanError, match="zero tasks"):
        build(s, [])


def test_exhausted_port_range_names_the_range() -> None:
    s = make_spec(2, extra="ports: {start: 30000, end: 30001}\n")
    with pytest.raises(PlanError, match="30000-30001"):
        build(s, local_hosts(2), busy_ports={("127.0.0.1", 30000)})


def test_loopback_hosts_on_one_machine_get_distinct_ports() -> None:
    hosts = [remote("a", "127.0.0.2"), remote("b", "127.0.0.3")]
    p = build(make_spec(2), hosts)
    assert [t.endpoint for t in p.tasks] == ["127.0.0.2:23456", "127.0.0.3:23457"]


def test_collective_timeout_reaches_the_worker_job() -> None:
    p = build(make_spec(1, extra="timeouts: {collective_s: 45}\n"), local_hosts(1))
    assert json.loads(p.tasks[0].argv[5])["collective_timeout_s"] == 45
    p = build(make_spec(1), local_hosts(1))
    assert json.loads(p.tasks[0].argv[5])["collective_timeout_s"] is None


def test_the_plan_carries_the_job_runtimes_batch_and_learning_rate() -> None:
    p = build(make_spec(2), local_hosts(2))
    assert (p.scaling.per_replica_batch_size, p.scaling.global_batch_size(2),
            p.scaling.scaled_learning_rate(2)) == (32, 64, 0.002)
    p = build(spec.parse("name: c\njob: {command: python train.py}\n"), local_hosts(2))
    assert p.scaling.global_batch_size(2) is None and p.scaling.learning_rate is None


def test_each_host_gets_the_run_paths_under_its_root() -> None:
    p = build(make_spec(1), [remote("a", "198.18.0.2")])
    paths = p.paths["a"]
    assert paths.checkpoint_dir == ".orchestrate/clusters/demo/runs/r1/checkpoints"
    assert paths.model_dir == ".orchestrate/clusters/demo/runs/r1/model"
    assert p.tasks[0].rc_path == ".orchestrate/clusters/demo/runs/r1/logs/attempt-1/worker-0.rc"


def test_a_jax_job_gives_every_task_what_keras_distribution_initialize_reads() -> None:
    """KERAS_DISTRIBUTION_*: every task's address (the chief's first: JAX's coordinator), how
    many, and the task's place in the plan's order; nothing of it on TensorFlow."""
    s = spec.parse("name: demo\nworkers: 2\nseparate_chief: true\n"
                   "job: {command: [python, t.py], backend: jax}\n")
    p = build(s, [remote("c", "10.0.0.1"), remote("w0", "10.0.0.2"), remote("w1", "10.0.0.3")])
    addresses = "10.0.0.1:23456,10.0.0.2:23456,10.0.0.3:23456"
    for position, task in enumerate(p.tasks):
        assert task.env["KERAS_BACKEND"] == "jax"
        assert task.env["KERAS_DISTRIBUTION_JOB_ADDRESSES"] == addresses
        assert task.env["KERAS_DISTRIBUTION_NUM_PROCESSES"] == "3"
        assert task.env["KERAS_DISTRIBUTION_PROCESS_ID"] == str(position)
        assert task.env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"  # memory growth, JAX's way
        assert "TF_FORCE_GPU_ALLOW_GROWTH" not in task.env
    assert [t.key for t in p.tasks] == ["chief:0", "worker:0", "worker:1"]
    tf = build(make_spec(2), local_hosts(2))
    assert not [k for k in tf.tasks[0].env if k.startswith(("KERAS_DISTRIBUTION", "KERAS_BACK"))]


@pytest.mark.parametrize(("job", "field", "says"), [
    ("{command: [python, t.py], backend: jax, keras: 2}", "job.keras",
     "runs only on TensorFlow"),
    ("{module: m, backend: jax, distribution: model_parallel}", "job.mesh",
     "job.mesh is not set"),
    ("{module: m, distribution: model_parallel, mesh: [1, 2]}", "job.distribution",
     "runs on JAX"),
    ("{command: [python, t.py], backend: pytorch}", "job.backend", ""),
])
def test_jax_jobs_that_cannot_run_are_refused_by_their_field(job: str, field: str,
                                                             says: str) -> None:
    with pytest.raises(SpecError) as err:
        spec.parse(f"name: demo\nworkers: 2\njob: {job}\n")
    assert err.value.field == field and says in err.value.message and err.value.fix


def test_a_managed_jax_job_may_checkpoint_to_a_bucket() -> None:
    s = spec.parse("name: demo\nworkers: 2\njob: {module: m, backend: jax}\n"
                   "checkpoint: {dir: 'gs://ckpt-bucket/runs'}\n")
    p = build(s, local_hosts(2))
    assert p.checkpoints.shared
    assert {t.env["ORCHESTRATE_CHECKPOINT_DIR"] for t in p.tasks} == {
        f"gs://ckpt-bucket/runs/demo/{p.run_id}"}


def test_a_managed_jax_job_runs_the_managed_worker_with_its_backend_and_jax_environment() -> None:
    s = spec.parse("name: demo\nworkers: 2\njob: {module: m, backend: jax}\n")
    p = build(s, local_hosts(2))
    job = json.loads(p.tasks[1].argv[p.tasks[1].argv.index("--job") + 1])
    assert job["backend"] == "jax" and job["module"] == "m" and job["keras"] == "3"
    assert p.tasks[1].env["KERAS_BACKEND"] == "jax"
    assert p.tasks[1].env["KERAS_DISTRIBUTION_PROCESS_ID"] == "1"
    assert "Keras 3 on JAX" in runtime_for(s.job).describe(s.job).summary
    # TensorFlow jobs send none of JAX's fields: the worker's defaults.
    tf = build(make_spec(2), local_hosts(2))
    assert not {"backend", "distribution", "mesh", "layout_map_fn"} & set(
        json.loads(tf.tasks[0].argv[-1]))


def test_a_model_parallel_job_shows_its_mesh_and_splits_the_batch_over_its_batch_axis() -> None:
    s = spec.parse("name: demo\nworkers: 4\njob: {module: m, backend: jax, "
                   "distribution: model_parallel, mesh: [2, 2], per_replica_batch_size: 16}\n")
    p = build(s, local_hosts(4))
    job = Job.from_json(p.tasks[0].argv[-1])
    assert (job.distribution, job.mesh, job.layout_map_fn) == ("model_parallel", (2, 2),
                                                               "layout_map")
    summary = runtime_for(s.job).describe(s.job).summary
    assert "mesh 2 x 2 = 4 device(s), each batch split over 2" in summary
    assert "m.layout_map(mesh)" in summary
    scaling = Scaling.of(p)
    assert (scaling.replicas, scaling.replicas_known, scaling.global_batch_size) == (2, True, 32)
