"""`orchestrate plan` and `orchestrate schema`: what a dry run shows, and that it touches nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hostlab import HostLab
from snapshot import assert_matches, normalise

from orchestrator.api import Cluster
from orchestrator.spec import ClusterSpec

REPO = Path(__file__).resolve().parent.parent


def cli(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "ORCHESTRATE_HOME": str(home)})


def test_plan_json_of_the_local_example_matches_its_snapshot(orchestrate_home: Path) -> None:
    proc = cli("plan", "cluster_specs/local.yaml", "--json", home=orchestrate_home)
    assert proc.returncode == 0, proc.stderr
    document = json.loads(proc.stdout)
    assert_matches("plan_local.json", normalise(
        document, {str(orchestrate_home): "<home>", str(REPO): "<repo>",
                   sys.executable: "<python>"}))
    assert not (orchestrate_home / "clusters").exists()  # nothing was made


def test_plan_text_shows_batch_learning_rate_tf_config_and_commands(
        orchestrate_home: Path) -> None:
    proc = cli("plan", "cluster_specs/local.yaml", home=orchestrate_home)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith("plan for digits-local: 2 task(s), local provider; nothing was touched")
    assert "32 per replica x 2 replicas = global batch 64 (assuming 1 replica per task" in out
    assert "0.002 x 2 replicas = 0.004 (scale_learning_rate: true)" in out
    assert "4 epoch(s) x 40 steps = 160 steps" in out
    for i in range(2):
        assert f"worker:{i}{' (chief)' if i == 0 else ''}  local-{i}  127.0.0.1:{23456 + i}" in out
        config = {"cluster": {"worker": ["127.0.0.1:23456", "127.0.0.1:23457"]},
                  "task": {"type": "worker", "index": i}}
        assert f"  TF_CONFIG  {json.dumps(config)}" in out
    assert f"  command    {sys.executable} -m worker managed --job '{{" in out


def test_plan_of_ssh_hosts_contacts_none_of_them(hostlab: HostLab, tmp_path: Path,
                                                  orchestrate_home: Path) -> None:
    address, port = hostlab.unused_address()  # nothing answers there: a contact would hang
    hosts = "".join(f"    - {{address: {address}, ssh_port: {port}, user: ml, task_port: "
                    f"{24000 + i}, key_file: {tmp_path}/no-such-key}}\n" for i in range(2))
    spec = tmp_path / "c.yaml"
    spec.write_text(f"name: far\nworkers: 2\nworkdir: {REPO}\nprovider:\n  kind: static\n"
                    f"  python: /opt/venv/bin/python\n  hosts:\n{hosts}"
                    "job: {command: python train.py --epochs 3}\n")
    proc = cli("plan", str(spec), "--json", home=orchestrate_home)
    assert proc.returncode == 0, proc.stderr
    document = json.loads(proc.stdout)
    assert [t["endpoint"] for t in document["tasks"]] == [f"{address}:24000", f"{address}:24001"]
    assert document["tasks"][1]["cwd"] == "~/.orchestrate/clusters/far/code"
    assert document["tasks"][0]["argv"][-4:] == ["/opt/venv/bin/python", "train.py", "--epochs",
                                                  "3"]
    assert document["hosts"][0]["ssh"] == {"user": "ml", "address": address, "port": port}
    assert document["scaling"]["per_replica_batch_size"] is None  # command mode: the script's


def test_schema_validates_the_example_specs_an_editor_would_open(orchestrate_home: Path) -> None:
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema validates the schema")
    proc = cli("schema", home=orchestrate_home)
    assert proc.returncode == 0, proc.stderr
    schema = json.loads(proc.stdout)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert set(schema["properties"]) == set(ClusterSpec.model_fields)
    for path in sorted((REPO / "cluster_specs").glob("*.yaml")):
        jsonschema.validate(yaml.safe_load(path.read_text()), schema)
    with pytest.raises(jsonschema.ValidationError, match="wrokers"):
        jsonschema.validate({"name": "x", "wrokers": 2, "job": {"module": "m"}}, schema)
    with pytest.raises(jsonschema.ValidationError, match="'many'"):
        jsonschema.validate({"name": "x", "workers": "many", "job": {"module": "m"}}, schema)


def spec_file(tmp_path: Path, name: str, extra: str = "") -> Path:
    """A spec of two SSH hosts (never contacted by a plan)."""
    hosts = "".join(f"    - {{address: 198.18.250.{2 + i}, user: ml, key_file: {tmp_path}/no-key}}\n"
                    for i in range(2))
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"name: {name}\nworkers: 2\nworkdir: {REPO}\nprovider:\n  kind: static\n"
                    f"  python: /opt/venv/bin/python\n  hosts:\n{hosts}"
                    f"job: {{module: examples.digits}}\n{extra}")
    return path


def test_plan_shows_checkpoints_on_shared_storage(tmp_path: Path, orchestrate_home: Path) -> None:
    path = spec_file(tmp_path, "gs", "checkpoint: {dir: 'gs://bucket/ckpt'}\n")
    where = "gs://bucket/ckpt/gs/<next-run>"
    summary = f"{where} (shared by every task: nothing is copied)"
    document = Cluster.from_spec(path).plan_document()
    assert document["checkpoints"] == {"dir": where, "shared": True, "named_by": "checkpoint.dir",
                                       "mirror": "never", "summary": summary}
    for task in document["tasks"]:
        assert task["checkpoint_dir"] == task["env"]["ORCHESTRATE_CHECKPOINT_DIR"] == where
    proc = cli("plan", str(path), home=orchestrate_home)
    assert proc.returncode == 0, proc.stderr
    assert f"\n  checkpoint {summary}\n" in proc.stdout


def test_plan_shows_checkpoints_on_each_host_by_default(tmp_path: Path) -> None:
    document = Cluster.from_spec(spec_file(tmp_path, "own")).plan_document()
    where = "~/.orchestrate/clusters/own/runs/<next-run>/checkpoints"
    assert document["checkpoints"] == {
        "dir": where, "shared": False, "named_by": "", "mirror": "auto",
        "summary": f"{where} on each host (the chief's is copied host to host before a "
                   "relaunch; this machine keeps a copy up to 1 GiB)"}
    assert [t["checkpoint_dir"] for t in document["tasks"]] == [where, where]
