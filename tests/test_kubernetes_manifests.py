"""The Kubernetes objects a cluster's run applies, checked against the API's own schemas.

The JobSet's own fields against the JobSet v1alpha2 API types (the models generated from
JobSet's OpenAPI spec that the kubeflow-trainer-api package ships), made strict: a field the
CRD does not have fails here as the API server would refuse it. Its Job template, the Secret
and the ConfigMaps against Kubernetes' own OpenAPI schemas (kubernetes-validate, strict). The
TF_CONFIG each pod builds from its index is the one the plan gives the same task elsewhere.
"""

from __future__ import annotations

import base64
import copy
import functools
import json
import os
import subprocess
import sys
from typing import Any

import jsonschema
import kubernetes_validate
import pytest

from orchestrator import plan as planning
from orchestrator import spec as specs
from orchestrator.errors import PlanError, ProviderError, SpecError
from orchestrator.providers.kubernetes import manifests
from orchestrator.spec import ClusterSpec
from worker import indexed

K8S_VERSION = "1.33"  # GKE's regular channel, late 2026
BASE = """\
name: demo
workers: {workers}
separate_chief: {chief}
job: {{module: m}}
container: {{image: us-docker.pkg.dev/p/r/orchestrate-worker:0.1.0}}
provider:
  kind: kubernetes
  namespace: ml
  volume: {{claim: shared}}
"""


def make_spec(workers: int = 3, chief: bool = False, extra: str = "",
              provider: str = "") -> ClusterSpec:
    text = BASE.format(workers=workers, chief=str(chief).lower()) + provider + extra
    return specs.parse(text)


def make_plan(spec: ClusterSpec, attempt: int = 1) -> planning.ClusterPlan:
    return planning.build(spec, manifests.hosts(spec), run_id="20261125-101500-abc123",
                          attempt=attempt, python="python3", local_workdir="/proj")


CODE = manifests.Files("demo-code-0123456789", (("00000.train.py", "train.py", 0o644),))
LIB = manifests.Files("demo-lib-0123456789", (("00000.worker___init__.py", "worker/__init__.py",
                                                0o644),))


def jobset_of(spec: ClusterSpec, secrets: tuple[str, ...] = ()) -> dict[str, Any]:
    return manifests.jobset(spec, make_plan(spec), code=CODE, lib=LIB, secrets=secrets)


@functools.cache
def jobset_schema() -> dict[str, Any]:
    """JobSet's schema from its API types, strict, with the Job templates left to
    ``validate_job_template`` (Kubernetes' own schema, which knows quantities and the rest)."""
    from kubeflow_trainer_api.models.jobset_v1alpha2_job_set import JobsetV1alpha2JobSet

    schema: dict[str, Any] = JobsetV1alpha2JobSet.model_json_schema(by_alias=True)
    schema["$defs"]["JobsetV1alpha2ReplicatedJob"]["properties"]["template"] = {"type": "object"}
    schema["properties"]["metadata"] = {"type": "object"}
    for definition in [schema, *schema["$defs"].values()]:
        if "properties" in definition:
            definition["additionalProperties"] = False
    return schema


def validate_jobset(jobset: dict[str, Any]) -> None:
    jsonschema.validate(jobset, jobset_schema())
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "ConfigMap",
                                  "metadata": jobset["metadata"]}, K8S_VERSION, strict=True)
    for replicated in jobset["spec"]["replicatedJobs"]:
        validate_job_template(replicated["template"])


def validate_job_template(template: dict[str, Any]) -> None:
    job = {"apiVersion": "batch/v1", "kind": "Job", **copy.deepcopy(template)}
    job["metadata"] = {**template.get("metadata", {}), "name": "x"}
    kubernetes_validate.validate(job, K8S_VERSION, strict=True)


def pod_env(jobset: dict[str, Any], role: str, index: int) -> dict[str, str]:
    """The environment the kubelet gives the pod of ``role`` ``index``: the template's values,
    the Downward API's annotation, and the secrets (by name: their values are not here)."""
    replicated = next(r for r in jobset["spec"]["replicatedJobs"] if r["name"] == role)
    assert index < replicated["replicas"]
    container = replicated["template"]["spec"]["template"]["spec"]["containers"][0]
    annotations = {manifests.JOB_INDEX_KEY: str(index)}  # JobSet sets it on each pod
    env = {}
    for var in container["env"]:
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "fieldRef" in var["valueFrom"]:
            path = var["valueFrom"]["fieldRef"]["fieldPath"]
            key = path.removeprefix("metadata.annotations['").removesuffix("']")
            env[var["name"]] = annotations[key]
        else:
            env[var["name"]] = "<secret " + var["valueFrom"]["secretKeyRef"]["key"] + ">"
    return env


@pytest.mark.parametrize(("workers", "chief"), [(1, False), (3, False), (2, True)])
def test_jobset_is_valid_and_each_pod_gets_the_plans_tf_config(workers: int, chief: bool) -> None:
    spec = make_spec(workers, chief)
    plan = make_plan(spec)
    jobset = jobset_of(spec)
    validate_jobset(jobset)
    names = [r["name"] for r in jobset["spec"]["replicatedJobs"]]
    assert names == (["chief", "worker"] if chief else ["worker"])
    for task in plan.tasks:
        env = pod_env(jobset, task.role, task.index)
        config, name = indexed.tf_config(env)
        assert json.loads(config) == task.tf_config
        assert name == task.key
        assert env == {k: v for k, v in task.env.items()
                       if k not in manifests.PER_TASK_ENV} | {
            k: env[k] for k in ("ORCHESTRATE_TF_CLUSTER", "ORCHESTRATE_TASK_TYPE",
                                "ORCHESTRATE_TASK_INDEX")}


def test_the_cluster_is_the_pods_jobset_dns_names() -> None:
    spec = make_spec(3)
    plan = make_plan(spec)
    port = spec.ports.start
    assert plan.cluster_def == {"worker": tuple(f"demo-worker-{i}-0.demo:{port}" for i in range(3))}
    assert plan.checkpoints.shared and plan.checkpoints.dirs["demo-worker-0-0"] == \
        "/orchestrate/runs/20261125-101500-abc123/checkpoints"
    jobset = jobset_of(spec)
    assert jobset["metadata"]["name"] == "demo"
    assert jobset["spec"]["network"] == {"enableDNSHostnames": True,
                                         "publishNotReadyAddresses": True}
    assert jobset["spec"]["failurePolicy"] == {"maxRestarts": 0}
    pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["containers"][0]["ports"] == [{"name": "tf-grpc", "containerPort": port,
                                              "protocol": "TCP"}]
    mounts = {m["mountPath"]: m for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["/orchestrate/runs"]["subPath"] == "orchestrate/demo"
    assert {"name": "runs", "persistentVolumeClaim": {"claimName": "shared"}} in pod["volumes"]
    assert pod["containers"][0]["workingDir"] == "/orchestrate/code"
    assert pod["containers"][0]["command"][:3] == ["python3", "-m", "worker.indexed"]


def test_labels_let_down_find_every_object_and_nothing_else() -> None:
    spec = make_spec(2)
    jobset = jobset_of(spec)
    wanted = {"app.kubernetes.io/managed-by": "orchestrate", "orchestrate/cluster": "demo"}
    template = jobset["spec"]["replicatedJobs"][0]["template"]
    for labels in (jobset["metadata"]["labels"], template["metadata"]["labels"],
                   template["spec"]["template"]["metadata"]["labels"]):
        assert wanted.items() <= labels.items()
        assert labels["orchestrate/run"] == "20261125-101500-abc123"
        assert labels["orchestrate/attempt"] == "1"
    assert manifests.selector("demo") == "app.kubernetes.io/managed-by=orchestrate,orchestrate/cluster=demo"


def test_secrets_come_from_a_secret_never_from_the_plain_env() -> None:
    spec = make_spec(2, extra="secrets: [WANDB_API_KEY]\nenv: {MODE: fast}\n")
    jobset = jobset_of(spec, secrets=("WANDB_API_KEY",))
    validate_jobset(jobset)
    env = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
        "containers"][0]["env"]
    by_name = {var["name"]: var for var in env}
    assert by_name["WANDB_API_KEY"] == {"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {
        "name": "demo-secrets", "key": "WANDB_API_KEY"}}}
    assert by_name["MODE"] == {"name": "MODE", "value": "fast"}
    secret = manifests.secret("demo", "ml", {"WANDB_API_KEY": "s3cr3t"}, run_id="r1", attempt=2)
    kubernetes_validate.validate(secret, K8S_VERSION, strict=True)
    assert base64.b64decode(secret["data"]["WANDB_API_KEY"]) == b"s3cr3t"
    assert "s3cr3t" not in json.dumps(jobset)


def test_gpus_spot_queue_and_placement() -> None:
    spec = make_spec(2, provider="""\
  gpus_per_pod: 8
  spot: true
  queue: team-a
  service_account: trainer
  image_pull_secrets: [registry]
  resources: {cpu: 7500m, memory: 60Gi}
  node_selector: {cloud.google.com/gke-accelerator: nvidia-h100-80gb}
  tolerations:
    - {key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}
    - {key: maintenance, value: soon, effect: NoExecute, toleration_seconds: 600}
""")
    jobset = jobset_of(spec)
    validate_jobset(jobset)
    assert jobset["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert jobset["spec"]["suspend"] is True  # no pod before Kueue admits it
    assert "suspend" not in jobset_of(make_spec(2))["spec"]  # no queue: it starts at once
    pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"] == {
        "requests": {"cpu": "7500m", "memory": "60Gi", "nvidia.com/gpu": "8"},
        "limits": {"memory": "60Gi", "nvidia.com/gpu": "8"}}
    assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb",
                                   "cloud.google.com/gke-spot": "true"}
    assert {"key": "maintenance", "operator": "Equal", "value": "soon", "effect": "NoExecute",
            "tolerationSeconds": 600} in pod["tolerations"]
    assert {"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true",
            "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["serviceAccountName"] == "trainer"
    assert pod["imagePullSecrets"] == [{"name": "registry"}]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
    assert pod["terminationGracePeriodSeconds"] == 60  # timeouts.stop_grace_s


def test_a_reservation_pod_is_placed_as_a_task_pod_and_holds_nothing_else() -> None:
    """An elastic group's reservation (the room of a pod it goes on without, or a spare's):
    valid, the task pod's requests, node selector, tolerations and identity, the lost nodes
    avoided, the tasks' image; no volume, no code, no grace; labelled for 'down', never as a
    task of an attempt."""
    spec = make_spec(2, extra="elastic: {min_workers: 1, max_workers: 3}\n", provider="""\
  gpus_per_pod: 8
  spot: true
  service_account: trainer
  resources: {cpu: 7500m, memory: 60Gi}
  run_as_user: 1000
""")
    task = jobset_of(spec)["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    spare = manifests.hosts(spec, spares=True)[2]
    assert spare.name == "demo-worker-2-0" and len(manifests.hosts(spec)) == 2
    pod = manifests.reservation(spec, spare, 2, avoid_nodes=["node-b", "node-a"])
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    assert pod["metadata"]["name"] == "demo-worker-2-0-r"
    assert pod["metadata"]["labels"] == {**manifests.labels("demo"), manifests.ROLE_LABEL:
                                         "reserve", manifests.SLOT_LABEL: "2"}
    (container,) = pod["spec"]["containers"]
    assert container["resources"] == task["containers"][0]["resources"]
    assert container["image"] == task["containers"][0]["image"]
    for field in ("nodeSelector", "tolerations", "serviceAccountName", "securityContext"):
        assert pod["spec"][field] == task[field], field
    assert manifests.avoided(pod) == ["node-a", "node-b"]
    assert "volumes" not in pod["spec"] and "env" not in container
    assert pod["spec"]["terminationGracePeriodSeconds"] == 0
    assert manifests.avoided(manifests.reservation(spec, spare, 2)) == []


@pytest.mark.parametrize(("change", "checkpoints"), [
    ("checkpoint: {dir: 'gs://ckpt-bucket/runs'}\n",
     "gs://ckpt-bucket/runs/demo/20261125-101500-abc123"),
    ("job: {command: [python, t.py], checkpoint_dir: 'gs://team-bucket/mine'}\n",
     "gs://team-bucket/mine"),
], ids=["managed", "command"])
def test_without_a_volume_checkpoints_and_the_model_go_to_the_bucket(change: str,
                                                                    checkpoints: str) -> None:
    """A pod's own runs/ is gone with it: the bucket keeps the checkpoints and the model."""
    text = BASE.format(workers=2, chief="false").replace("  volume: {claim: shared}\n", "")
    if "command" in change:
        text = text.replace("job: {module: m}\n", "")
    spec = specs.parse(text + change)
    plan = make_plan(spec)
    assert all(h.ephemeral and not h.shared_fs for h in manifests.hosts(spec))
    assert plan.checkpoints.shared
    for task in plan.tasks:
        assert task.env["ORCHESTRATE_CHECKPOINT_DIR"] == checkpoints
        assert task.env["ORCHESTRATE_MODEL_DIR"] == f"{checkpoints}/model"
    jobset = jobset_of(spec)
    validate_jobset(jobset)
    pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert {"name": "runs", "emptyDir": {}} in pod["volumes"]
    with_volume = make_plan(make_spec(2, extra="checkpoint: {dir: 'gs://ckpt-bucket/runs'}\n"))
    assert not with_volume.tasks[0].env["ORCHESTRATE_MODEL_DIR"].startswith("gs://")


def test_a_field_the_api_does_not_have_is_refused_here() -> None:
    """The schemas are strict: a misspelt field fails here, as the API server would refuse it."""
    jobset = jobset_of(make_spec(2))
    wrong = copy.deepcopy(jobset)
    wrong["spec"]["network"]["enableDnsHostnames"] = True
    with pytest.raises(jsonschema.ValidationError, match="enableDnsHostnames"):
        validate_jobset(wrong)
    wrong = copy.deepcopy(jobset)
    wrong["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
        "containers"][0]["workdir"] = "/x"
    with pytest.raises(jsonschema.ValidationError, match="workdir"):
        validate_jobset(wrong)


def test_configmaps_carry_text_binary_and_modes_and_refuse_over_a_mebibyte() -> None:
    files = {"train.py": (b"print('hi')\n", 0o644), "run.sh": (b"#!/bin/sh\n", 0o755),
             "data/blob.bin": (bytes(range(256)), 0o644)}
    manifest, mounted = manifests.configmap("demo", "code", "ml", files)
    kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)
    assert manifest["immutable"] is True
    by_path = {path: (key, mode) for key, path, mode in mounted.items}
    assert manifest["data"][by_path["train.py"][0]] == "print('hi')\n"
    assert base64.b64decode(manifest["binaryData"][by_path["data/blob.bin"][0]]) == bytes(range(256))
    assert by_path["run.sh"][1] == 0o755
    again, _ = manifests.configmap("demo", "code", "ml", files)
    changed, _ = manifests.configmap("demo", "code", "ml", {**files, "train.py": (b"x\n", 0o644)})
    assert again["metadata"]["name"] == manifest["metadata"]["name"] != changed["metadata"]["name"]
    volume = mounted.volume("code")
    assert {"key": by_path["run.sh"][0], "path": "run.sh", "mode": 0o755} in volume["configMap"]["items"]
    with pytest.raises(ProviderError, match="over the 1 MiB a ConfigMap holds") as err:
        manifests.configmap("demo", "code", "ml", {"big.npy": (b"\0" * (1 << 20), 0o644)})
    assert "container.image" in (err.value.fix or "")


def test_one_template_cannot_start_tasks_that_differ() -> None:
    spec = make_spec(2)
    plan = make_plan(spec)
    second = plan.tasks[1]
    odd = planning.ClusterPlan(**{**plan.__dict__, "tasks": (
        plan.tasks[0], type(second)(**{**second.__dict__, "env": {**second.env, "X": "1"}}))})
    with pytest.raises(PlanError, match="differs from worker:0 in X"):
        manifests.jobset(spec, odd, code=CODE, lib=LIB)


TWO = BASE.format(workers=2, chief="false")


@pytest.mark.parametrize(("text", "field", "says"), [
    (TWO.replace("container: {image: us-docker.pkg.dev/p/r/orchestrate-worker:0.1.0}\n", ""),
     "container", "there is no container.image"),
    (TWO.replace("  volume: {claim: shared}\n", ""), "provider.volume", "a pod's own disk"),
    (TWO.replace("orchestrate-worker:0.1.0}", "orchestrate-worker:0.1.0, options: [--shm-size=8g]}"),
     "container.options", "which a pod does not take"),
    (TWO + "checkpoint: {dir: /mnt/nfs/ckpt}\n", "checkpoint.dir", "pods see none"),
    (TWO.replace("job: {module: m}", "job: {command: [python, t.py], checkpoint_dir: ckpt}"),
     "job.checkpoint_dir", "read-only"),
    (TWO + "  tolerations: [{operator: Exists, value: x}]\n", "provider.tolerations.0",
     "operator Exists has no value"),
    (TWO + "  tolerations: [{value: x}]\n", "provider.tolerations.0", "without a key"),
    (TWO + "  node_selector: {cloud.google.com/gke-spot: 'true'}\n", "provider.node_selector",
     "set by provider.spot"),
    (TWO + "  node_selector: {pool: 'has space'}\n", "provider.node_selector",
     "is not a label value"),
    (TWO + "  namespace: ML\n", "provider.namespace", ""),
    (TWO + "  resources: {memory: 60 GB}\n", "provider.resources.memory", ""),
    (TWO.replace("{claim: shared}", "{claim: shared, sub_path: ../other}"),
     "provider.volume.sub_path", "leaves the volume"),
], ids=lambda v: v if isinstance(v, str) and "\n" not in v else "")
def test_specs_that_cannot_run_on_kubernetes_are_refused_with_the_field(
        text: str, field: str, says: str) -> None:
    with pytest.raises(SpecError) as err:
        specs.parse(text, file="spec.yaml")
    assert err.value.field == field
    assert says in err.value.message
    assert err.value.fix


def test_indexed_execs_the_task_with_its_tf_config() -> None:
    spec = make_spec(2)
    env = {**pod_env(jobset_of(spec), "worker", 1), "PATH": os.environ["PATH"]}
    env["PYTHONPATH"] = os.getcwd()
    out = subprocess.run([sys.executable, "-m", "worker.indexed", sys.executable, "-c",
                          "import os; print(os.environ['TF_CONFIG']); "
                          "print(os.environ['ORCHESTRATE_TASK'])"],
                         env=env, capture_output=True, text=True, timeout=60, check=True)
    config, task = out.stdout.splitlines()
    assert json.loads(config)["task"] == {"type": "worker", "index": 1}
    assert task == "worker:1"


def test_a_jax_pod_learns_its_process_id_from_its_index() -> None:
    """One template for every pod: KERAS_DISTRIBUTION_PROCESS_ID is built in the pod, as
    TF_CONFIG is, and equals what the plan gives the same task elsewhere."""
    spec = make_spec(2, chief=True).model_copy(update={"job": specs.parse(
        "name: d\njob: {command: [python, t.py], backend: jax}\n").job})
    jobset = jobset_of(spec)
    validate_jobset(jobset)
    plan = make_plan(spec)
    for role, index in (("chief", 0), ("worker", 0), ("worker", 1)):
        env = {**pod_env(jobset, role, index), "PATH": os.environ["PATH"],
               "PYTHONPATH": os.getcwd()}
        assert "KERAS_DISTRIBUTION_PROCESS_ID" not in env  # not in the shared template
        out = subprocess.run([sys.executable, "-m", "worker.indexed", sys.executable, "-c",
                              "import os; print(os.environ['KERAS_DISTRIBUTION_PROCESS_ID'])"],
                             env=env, capture_output=True, text=True, timeout=60, check=True)
        planned = plan.task(f"{role}:{index}").env["KERAS_DISTRIBUTION_PROCESS_ID"]
        assert out.stdout.strip() == planned
        assert env["KERAS_DISTRIBUTION_JOB_ADDRESSES"].split(",")[0] == plan.chief.endpoint


@pytest.mark.parametrize(("change", "says"), [
    ({"ORCHESTRATE_TASK_INDEX": "2"}, "not an index of the 2 worker task(s)"),
    ({"ORCHESTRATE_TASK_TYPE": "ps"}, "none of the cluster's task types"),
    ({"ORCHESTRATE_TF_CLUSTER": "{"}, "is not JSON"),
    ({"ORCHESTRATE_TASK_INDEX": ""}, "ORCHESTRATE_TASK_INDEX not set"),
])
def test_indexed_refuses_an_environment_that_names_no_task(change: dict[str, str],
                                                           says: str) -> None:
    env = {**pod_env(jobset_of(make_spec(2)), "worker", 0), **change,
           "PATH": os.environ["PATH"], "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-m", "worker.indexed", "true"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == indexed.USAGE_EXIT
    event = json.loads(out.stdout.removeprefix("@orchestrate "))
    assert event["event"] == "error" and event["phase"] == "launch"
    assert says in event["message"]
