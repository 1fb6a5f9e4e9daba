"""Secrets: names in the spec, values from the controller's environment at launch, and nowhere
else. Every command the controller sends to a host is recorded (what becomes a command line
there, which ps shows): no secret value is in any. The store, `status --json`, `plan --json`,
the run's messages and what the record keeps of a failure's output do not hold it either,
while every task got it. Local tasks (command mode, no TensorFlow), and one run on SSH hosts
as the lab's unprivileged user."""

from __future__ import annotations

import hashlib
import json
import secrets as pysecrets
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
from helpers import orchestrate, write_spec
from hostlab import HostLab

from orchestrator import paths
from orchestrator.remote.local import LocalRunner
from orchestrator.remote.ssh import SSHRunner
from orchestrator.state import Store

REPO = Path(__file__).resolve().parent.parent

# The job: attempt 1 prints the secret in its error and fails; attempt 2 checks it has the
# value and succeeds. Each task writes the digest of what it got.
JOB = """\
import hashlib, os, sys
value = os.environ["API_TOKEN"]
task = os.environ["ORCHESTRATE_TASK"].replace(":", "-")
attempt = os.environ["ORCHESTRATE_ATTEMPT"]
out = os.path.join(os.environ["DIGESTS"], f"{task}-{attempt}")
open(out, "w").write(hashlib.sha256(value.encode()).hexdigest())
if attempt == "1" and task == "worker-1":
    print(f"RuntimeError: login refused for token {value}", file=sys.stderr, flush=True)
    sys.exit(3)
"""


@pytest.fixture
def sent() -> Iterator[list[str]]:
    """Every script any runner of this process runs on a host (local or SSH)."""
    scripts: list[str] = []
    local, ssh = LocalRunner._exec, SSHRunner._exec_raw

    def local_exec(self: LocalRunner, script: str, *args: object, **kwargs: object) -> object:
        scripts.append(script)
        return local(self, script, *args, **kwargs)  # type: ignore[arg-type]

    def ssh_exec(self: SSHRunner, script: str, *args: object, **kwargs: object) -> object:
        scripts.append(script)
        return ssh(self, script, *args, **kwargs)  # type: ignore[arg-type]

    with mock.patch.object(LocalRunner, "_exec", local_exec), \
            mock.patch.object(SSHRunner, "_exec_raw", ssh_exec):
        yield scripts


def spec_text(name: str, digests: Path, extra: str = "") -> str:
    return (f"name: {name}\nworkers: 2\njob: {{command: python job.py}}\n"
            "retry: {max_restarts: 1, backoff_initial_s: 0.1}\ntimeouts: {stop_grace_s: 1}\n"
            f"env: {{DIGESTS: '{digests}'}}\nsecrets: [API_TOKEN]\n" + extra)


def assert_nowhere(value: str, *places: str | bytes) -> None:
    for place in places:
        text = place.decode(errors="replace") if isinstance(place, bytes) else place
        assert value not in text, text[:2000]


@pytest.mark.parametrize(("secrets", "says"), [
    ("[api_token, '1X']", "'1X' is not a valid environment variable name"),
    ("[TF_CONFIG]", "TF_CONFIG: set by the orchestrator"),
    ("[ORCHESTRATE_RUN_ID]", "ORCHESTRATE_RUN_ID: set by the orchestrator"),
    ("[PYTHONPATH]", "PYTHONPATH: set by the orchestrator"),
    ("[A, A]", "A listed twice"),
    ("[DIGESTS]", "DIGESTS also in env, with its value in the spec"),
    ("{A: b}", "secrets"),
])
def test_a_bad_secrets_list_is_refused_at_validate(
        tmp_path: Path, orchestrate_home: Path, capsys: pytest.CaptureFixture[str],
        secrets: str, says: str) -> None:
    spec = tmp_path / "c.yaml"
    spec.write_text(spec_text("sec", tmp_path).replace("secrets: [API_TOKEN]",
                                                       f"secrets: {secrets}"))
    code, out, err = orchestrate(capsys, "validate", str(spec))
    assert code == 2 and "Traceback" not in out + err, out + err
    assert f"{spec}:" in err and "secrets" in err and says in err, err
    assert "fix: " in err


def test_a_secret_not_set_here_stops_train_before_anything_starts(
        tmp_path: Path, orchestrate_home: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("API_TOKEN", raising=False)
    (tmp_path / "job.py").write_text(JOB)
    spec = tmp_path / "c.yaml"
    spec.write_text(spec_text("sec-missing", tmp_path / "digests"))
    code, out, err = orchestrate(capsys, "plan", str(spec))
    assert code == 0 and "secrets    API_TOKEN (NOT set here: train refuses)" in out, out + err
    code, out, err = orchestrate(capsys, "train", str(spec))
    assert code == 2 and "Traceback" not in out + err, out + err
    assert f"{spec}: secrets: API_TOKEN not set in the environment of this controller" in err
    assert "fix: export API_TOKEN=... in the shell that runs orchestrate" in err
    assert not (tmp_path / "digests").exists()
    assert Store().runs("sec-missing") == []


def test_every_task_gets_the_secret_and_no_command_record_or_report_holds_it(
        tmp_path: Path, orchestrate_home: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch, sent: list[str]) -> None:
    value = "tok-" + pysecrets.token_hex(16)
    monkeypatch.setenv("API_TOKEN", value)
    (tmp_path / "job.py").write_text(JOB)
    digests = tmp_path / "digests"
    digests.mkdir()
    spec = tmp_path / "c.yaml"
    spec.write_text(spec_text("sec-local", digests))

    code, plan_out, err = orchestrate(capsys, "plan", str(spec), "--json")
    assert code == 0, err
    assert json.loads(plan_out)["secrets"] == [{"name": "API_TOKEN", "set": True}]
    code, train_out, train_err = orchestrate(capsys, "train", str(spec))
    assert code == 0, train_out + train_err
    code, status_out, err = orchestrate(capsys, "status", "sec-local", "--json")
    assert code == 0, err

    want = hashlib.sha256(value.encode()).hexdigest()
    got = {p.name: p.read_text() for p in digests.iterdir()}
    assert got == {f"worker-{i}-{a}": want for i in (0, 1) for a in (1, 2)}
    (run,) = Store().runs("sec-local")
    failed = run.attempts[0]
    assert failed.cause == "crashed" and "login refused for token <secret API_TOKEN>" in \
        failed.evidence, failed.evidence
    assert any(s.startswith("sh -s") or "sh -s" in s for s in sent)  # launches went on stdin
    db = b"".join(p.read_bytes() for p in orchestrate_home.glob("state.db*"))
    assert_nowhere(value, *sent, db, plan_out, train_out, train_err, status_out, failed.detail,
                   *Store().get_run(run.id).attempts[0].evidence.splitlines())


@pytest.mark.ssh
def test_on_ssh_hosts_the_secret_reaches_the_tasks_and_no_command_line(
        hostlab: HostLab, tmp_path: Path, orchestrate_home: Path,
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        sent: list[str]) -> None:
    """Two sshd hosts, logged into as an unprivileged user; each task writes its digest into
    its host's code directory."""
    value = "tok-" + pysecrets.token_hex(16)
    monkeypatch.setenv("API_TOKEN", value)
    hosts = hostlab.hosts(2)
    work = tmp_path / "work"
    work.mkdir()
    (work / "job.py").write_text(JOB)
    body = spec_text("sec-ssh", Path("digests")).replace("workers: 2\n", "")
    path = write_spec(tmp_path, hostlab, hosts, body, user=hostlab.plain_user())
    path.write_text(path.read_text().replace(f"workdir: {REPO}", f"workdir: {work}"))
    (work / "digests").mkdir()  # uploaded with the code: each task writes into its copy
    got: dict[str, str] = {}
    try:
        code, out, err = orchestrate(capsys, "train", str(path), "--no-doctor")
        assert code == 0, out + err
        for h in hosts:
            code_dir = Path(paths.code_dir(paths.host_root(h.plain_home, "sec-ssh")))
            got.update({p.name: p.read_text() for p in (code_dir / "digests").iterdir()})
    finally:
        orchestrate(capsys, "down", str(path))
    want = hashlib.sha256(value.encode()).hexdigest()
    assert got == {f"worker-{i}-{a}": want for i in (0, 1) for a in (1, 2)}
    assert any("sh -s" in s for s in sent)
    assert_nowhere(value, *sent, out, err,
                   b"".join(p.read_bytes() for p in orchestrate_home.glob("state.db*")))
