"""Hostile spec files: `orchestrate validate` answers each with one error that names the file,
the field and line where there is one, and the fix; never a traceback, a hang or a memory blow-up."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from orchestrator import cli

REPO = Path(__file__).resolve().parent.parent

CMD = "name: demo\nworkers: 2\njob:\n  command: python train.py\n"  # what is added: line 5 on
STATIC = """\
name: demo
workers: 2
provider:
  kind: static
  hosts:
    - {address: 10.0.0.1, user: ml, key_file: id}
    - {address: 10.0.0.2, user: ml, key_file: id}
job: {command: python train.py}
"""
GCP = CMD + "provider:\n  kind: gcp\n  project: my-project-1\n  zones: [us-central1-a]\n"
LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{b}: &{b} [{', '.join([f'*{a}'] * 10)}]\n" for a, b in zip("abcdefgh", "bcdefghi", strict=True))


@dataclass(frozen=True)
class Result:
    code: int | str | None
    out: str
    err: str


@pytest.fixture
def orchestrate(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
                ) -> Callable[..., Result]:
    """The `orchestrate` entry point (cli.main) in this process, as a user runs it."""
    def run(*args: str) -> Result:
        monkeypatch.setattr(sys, "argv", ["orchestrate", *args])
        with pytest.raises(SystemExit) as exited:
            cli.main()
        out, err = capsys.readouterr()
        return Result(exited.value.code, out, err)
    return run


def assert_refused(result: Result, file: Path | str, *, line: int | None, field: str | None,
                   says: str, fix: str) -> None:
    """One error: 'error: FILE[:LINE]: [FIELD: ]MESSAGE' and '  fix: ...', exit 2, no traceback."""
    assert result.code == 2, result
    assert "Traceback" not in result.out + result.err
    assert result.out == ""
    first, *rest = result.err.splitlines()
    where = f"{file}:{line}: " if line is not None else f"{file}: "
    assert first.startswith(f"error: {where}" + (f"{field}: " if field else "")), first
    assert says in first, first
    assert len(rest) == 1 and rest[0].startswith("  fix: ") and fix in rest[0], rest


# (text, line, field, says, fix): each written to cluster.yaml and validated.
CONTENT = [
    pytest.param("- a\n- b\n", None, None, "expected a mapping at the top level, received a list",
                 "start the file with 'name: my-cluster'", id="a-list"),
    pytest.param("hello\n", None, None, "received a string", "'job:' section", id="a-scalar"),
    pytest.param("", None, None, "the file is empty", "start the file", id="empty"),
    pytest.param("# only\n# comments\n", None, None, "the file is empty", "start the file",
                 id="only-comments"),
    pytest.param("name: x\n\tjob: {}\n", 2, None, "not valid YAML", "indent with spaces",
                 id="tab-indent"),
    pytest.param(CMD + "---\n" + CMD, 5, None, "another document", "keep one document",
                 id="two-documents"),
    pytest.param(CMD + "x: *nope\n", 5, None, "undefined alias 'nope'", "define the anchor",
                 id="undefined-alias"),
    pytest.param(CMD + "workdir: [1, 2\n", 6, None, "not valid YAML", "fix the YAML at that line",
                 id="unclosed-bracket"),
    pytest.param(CMD + "1: x\n", 5, "(top level)", "the key '1' is a number, not a string",
                 "quote it", id="int-key"),
    pytest.param(CMD + "? [a]\n: x\n", 5, "(top level)", "a key must be a string, received a list",
                 "'key: value' lines", id="complex-key"),
    pytest.param(CMD + "env: {ON: x}\n", 5, "env", "the key 'ON' is a boolean", "quote it",
                 id="bool-key"),
    pytest.param(CMD + "env: {A: x\0y}\n", 5, None, "character U+0000 is not allowed",
                 "remove it", id="raw-nul-byte"),
    pytest.param(CMD + 'env: {A: "x\\0y"}\n', 5, "env.A", "contains a NUL character",
                 "remove it", id="escaped-nul-in-value"),
    pytest.param(CMD + "job: {command: python other.py}\n", 5, "job",
                 "'job' is given twice, at lines 3 and 5", "keep one of them", id="duplicate-job"),
    pytest.param(STATIC.replace("user: ml, key", "user: ml, user: root, key", 1), 6,
                 "provider.hosts.0.user", "'user' is given twice, on line 6", "keep one of them",
                 id="duplicate-nested-key"),
    pytest.param(CMD.replace("workers: 2", "workers: true"), 2, "workers",
                 "expected a number, not a boolean", "write a number", id="bool-for-int"),
    pytest.param(CMD + "timeouts: {hang_s: false}\n", 5, "timeouts.hang_s",
                 "expected a number, not a boolean", "write a number", id="bool-for-float"),
    pytest.param(CMD + "retry: {per_cause: {hung: true}}\n", 5, "retry.per_cause.hung",
                 "expected a number, not a boolean", "write a number", id="bool-in-a-mapping"),
    pytest.param(CMD + "separate_chief: 1\n", 5, "separate_chief", "expected true or false",
                 "write true or false", id="number-for-bool"),
    pytest.param(CMD + "retry: {warm_tasks: 'yes'}\n", 5, "retry.warm_tasks",
                 "expected true or false", "write true or false", id="word-for-bool"),
    pytest.param(CMD + "timeouts: {stop_grace_s: .inf}\n", 5, "timeouts.stop_grace_s",
                 "finite number", ".inf and .nan are not allowed", id="inf-grace"),
    pytest.param(CMD + "retry: {backoff_max_s: .inf}\n", 5, "retry.backoff_max_s",
                 "finite number", ".inf and .nan", id="inf-backoff"),
    pytest.param(CMD + "retry: {backoff_initial_s: 1.0e+9}\n", 5, "retry.backoff_initial_s",
                 "less than or equal to 86400", "use a smaller value", id="backoff-over-a-day"),
    pytest.param(CMD + "timeouts: {collective_s: .nan}\n", 5, "timeouts.collective_s",
                 "finite number", ".inf and .nan", id="nan-timeout"),
    pytest.param(CMD + "timeouts: {startup_s: 1.0e+12}\n", 5, "timeouts.startup_s",
                 "less than or equal to 604800", "use a smaller value", id="timeout-over-a-week"),
    pytest.param(CMD + "provider: {kind: static, connect_timeout_s: 1.0e+400, hosts: []}\n", 5,
                 "provider.connect_timeout_s", "finite number", ".inf", id="float-overflow-to-inf"),
    pytest.param(CMD.replace("workers: 2", "workers: 1" + "0" * 100), 2, "workers",
                 "less than or equal to 1024", "use a smaller value", id="googol-workers"),
    pytest.param(CMD.replace("workers: 2", "workers: " + "9" * 5000), 2, "workers",
                 "a number of 5000 digits", "write a smaller number", id="5000-digit-int"),
    pytest.param(CMD.replace("command: python train.py", "module: m\n  seed: 18446744073709551616"),
                 5, "job.seed", "less than or equal to 4294967295", "use a smaller value",
                 id="seed-over-uint32"),
    pytest.param(CMD.replace("command: python train.py", "module: m\n  learning_rate: 1e400"), 5,
                 "job.learning_rate", "finite number", ".inf", id="learning-rate-1e400"),
    pytest.param(CMD.replace("command: python train.py", "module: m\n  epochs: 1.0e+300"), 5,
                 "job.epochs", "exceeded maximum size", "write a smaller whole number",
                 id="epochs-huge"),
    pytest.param(CMD.replace("command: python train.py", "module: m\n  per_replica_batch_size: "
                             "99999999999"), 5, "job.per_replica_batch_size",
                 "less than or equal to 1048576", "use a smaller value", id="batch-huge"),
    pytest.param(CMD + "retry: {max_restarts: 99999999999}\n", 5, "retry.max_restarts",
                 "less than or equal to 1000", "use a smaller value", id="restarts-huge"),
    pytest.param(LAUGHS + CMD, 1, None, "more than 100000 values once its aliases are expanded",
                 "use fewer aliases", id="billion-laughs"),
    pytest.param("x: [" + ",".join(["0"] * 100_001) + "]\n" + CMD, 1, None,
                 "more than 100000 values", "check that this is the spec file",
                 id="a-hundred-thousand-values"),
    pytest.param("a: &a [*a]\n" + CMD, 1, "a.0", "an alias inside its own anchor",
                 "cannot be used inside the value its anchor", id="recursive-alias-list"),
    pytest.param("a: &a {b: *a}\n" + CMD, 1, "a.b", "an alias inside its own anchor",
                 "write the value out", id="recursive-alias-mapping"),
    pytest.param("x: &x [" + "[" * 40 + "]" * 40 + "]\ny: " + "[" * 40 + "*x" + "]" * 40 + "\n",
                 1, None, "nested more than 64 levels deep once its aliases are expanded",
                 "use fewer aliases", id="deep-through-aliases"),
    pytest.param("x: " + "[" * 10_000 + "]" * 10_000 + "\n", 1, None,
                 "nested more than 64 levels deep", "check the brackets", id="10000-brackets"),
    pytest.param("x: " + "{" * 10_000 + "\n", 1, None, "nested more than 64 levels deep",
                 "check the brackets", id="10000-braces-unclosed"),
    pytest.param("".join("  " * i + f"k{i}:\n" for i in range(100)), 64, None,
                 "nested more than 64 levels deep", "the indentation", id="100-indent-levels"),
    pytest.param(CMD + "x: !!binary aGVsbG8=\n", 5, "x", "the YAML tag 'tag:yaml.org,2002:binary'",
                 "remove the tag", id="binary-tag"),
    pytest.param(CMD + "env: !!set {a, b}\n", 5, "env", "tag:yaml.org,2002:set", "remove the tag",
                 id="set-tag"),
    pytest.param(CMD.replace("name: demo", "name: !shell demo"), 1, "name", "'!shell'",
                 "remove the tag", id="custom-tag"),
    pytest.param(CMD + "a: &x 1\nb: &x 2\n", 6, None, "duplicate anchor 'x'",
                 "its own name", id="duplicate-anchor"),
    # Patterns are matched whole: a trailing newline is not part of a valid value.
    pytest.param(CMD.replace("name: demo", 'name: "demo\\n"'), 1, "name", "not a valid name",
                 "lower-case letters", id="name-with-newline"),
    pytest.param(CMD + 'env: {"A\\n": x}\n', 5, "env", "not a valid environment variable name",
                 "letters, digits and '_'", id="env-key-with-newline"),
    pytest.param(CMD.replace("command: python train.py", 'module: "m\\n"'), 4, "job.module",
                 "should match pattern", "match the pattern", id="module-with-newline"),
    pytest.param(STATIC.replace("user: ml", 'user: "ml\\n"', 1), 6, "provider.hosts.0.user",
                 "should match pattern", "match the pattern", id="user-with-newline"),
    pytest.param(GCP.replace("us-central1-a", '"us-central1-a\\n"'), 8, "provider.zones",
                 "is not a zone name", "us-central1-a", id="zone-with-newline"),
    pytest.param(GCP.replace("us-central1-a", "us-central1"), 8, "provider.zones",
                 "'us-central1' is not a zone name", "REGION-LETTER", id="zone-without-letter"),
    pytest.param(GCP.replace("us-central1-a", "central-a"), 8, "provider.zones",
                 "is not a zone name", "REGION-LETTER", id="zone-without-digit"),
    pytest.param(GCP + '  labels: {team: "ml\\n"}\n', 9, "provider.labels",
                 "not a valid GCP label", "lower-case letters", id="label-with-newline"),
    pytest.param(GCP + '  tags: ["web\\n"]\n', 9, "provider.tags", "not a valid network tag",
                 "lower-case letters", id="tag-with-newline"),
    pytest.param(CMD + 'container: {image: "img:1\\n"}\n', 5, "container.image",
                 "not an image reference", "[REGISTRY/]PATH", id="image-with-newline"),
    pytest.param(GCP + "  metadata: {enable-oslogin: TRUE}\n", 9, "provider.metadata",
                 "OS Login replaces metadata SSH keys", "remove 'enable-oslogin'", id="os-login"),
    pytest.param(GCP + "  metadata: {Enable-OSLogin: 'true'}\n", 9, "provider.metadata",
                 "OS Login", "remove 'Enable-OSLogin'", id="os-login-any-case"),
    pytest.param(GCP + "  metadata: {enable-oslogin-2fa: 'TRUE'}\n", 9, "provider.metadata",
                 "OS Login", "remove 'enable-oslogin-2fa'", id="os-login-2fa"),
    pytest.param(GCP + "  metadata: {'a key': x}\n", 9, "provider.metadata",
                 "is not a metadata key", "1-128 letters", id="metadata-key"),
    # What the plan would refuse or lose, refused by validate.
    pytest.param(CMD + "env: {PYTHONPATH: /opt/lib, TF_USE_LEGACY_KERAS: '0'}\n", 5, "env",
                 "PYTHONPATH, TF_USE_LEGACY_KERAS: set by the orchestrator in every task",
                 "the orchestrator sets PYTHONPATH, PYTHONUNBUFFERED, TF_USE_LEGACY_KERAS",
                 id="env-the-plan-sets"),
    pytest.param(CMD + "env: {ORCHESTRATE_TASK: x}\n", 5, "env", "ORCHESTRATE_TASK: set by the "
                 "orchestrator", "remove ORCHESTRATE_TASK", id="env-orchestrate-prefix"),
    pytest.param(CMD + f"env: {{A: {'x' * 40_000}}}\n", 5, "env",
                 "A: the value is 40000 bytes (at most 32 KiB)", "pass large data in a file",
                 id="env-value-too-large"),
    pytest.param(CMD + "env: {" + ", ".join(f"V{i}: {'x' * 30_000}" for i in range(5)) + "}\n",
                 5, "env", "over the 128 KiB allowed", "pass large data in a file",
                 id="env-too-large"),
    pytest.param(CMD.replace("workers: 2", "workers: 3") + "ports: {start: 30000, end: 30001}\n",
                 5, "ports", "the range 30000-30001 has 2 port(s) for 3 task(s) on one machine",
                 "ports.end: 30002 or more", id="port-range-too-small-local"),
    pytest.param(STATIC.replace("10.0.0.2", "10.0.0.1") + "ports: {start: 30000, end: 30000}\n",
                 9, "ports", "has 1 port(s) for 2 task(s) on one machine", "ports.end: 30001",
                 id="port-range-too-small-static"),
    pytest.param(STATIC.replace("10.0.0.2,", "10.0.0.1, task_port: 30000,").replace(
        "key_file: id}", "key_file: id, task_port: 30000}", 1), 7, "provider.hosts.1.task_port",
                 "hosts 0 and 1 are one machine, and both pin port 30000",
                 "its own port", id="same-port-pinned-twice"),
    pytest.param(STATIC.replace("address: 10.0.0.1,", "address: 127.0.0.1, ssh_address: 10.0.0.1,"),
                 6, "provider.hosts.0.address", "the loopback address 127.0.0.1, but the tasks "
                 "run on 2 machines", "an address the other hosts can reach",
                 id="loopback-across-machines"),
    pytest.param(STATIC.replace("10.0.0.1", "'10.0.0.1; rm -rf ~'"), 6,
                 "provider.hosts.0.address", "is neither an IP address nor a valid host name",
                 "write an IP address", id="address-shell-metacharacters"),
    pytest.param(STATIC.replace("10.0.0.1", "'node 1'"), 6, "provider.hosts.0.address",
                 "neither an IP address nor a valid host name", "or a host name",
                 id="address-with-space"),
    pytest.param(STATIC.replace("10.0.0.1", "root@10.0.0.1"), 6, "provider.hosts.0.address",
                 "neither an IP address", "the user in 'user:'", id="address-with-user"),
    pytest.param(STATIC.replace("10.0.0.1", "node-1:2222"), 6, "provider.hosts.0.address",
                 "neither an IP address", "the port in 'ssh_port:'", id="address-with-port"),
    pytest.param(STATIC.replace("10.0.0.1", "10.0.0.300"), 6, "provider.hosts.0.address",
                 "neither an IP address", "write an IP address", id="address-not-an-ip"),
    pytest.param(STATIC.replace("10.0.0.1", "'[10.0.0.1]'"), 6, "provider.hosts.0.address",
                 "only an IPv6 address is written in brackets", "write 10.0.0.1",
                 id="ipv4-in-brackets"),
    pytest.param(STATIC.replace("address: 10.0.0.1,", "address: 10.0.0.1, ssh_address: 'a$(b)',"),
                 6, "provider.hosts.0.ssh_address", "neither an IP address", "or a host name",
                 id="ssh-address-bad"),
    # Paths named in the spec.
    pytest.param(CMD + 'workdir: "a\\0b"\n', 5, "workdir", "contains a NUL character",
                 "remove it", id="workdir-nul"),
    pytest.param(CMD + f"workdir: {'w' * 300}\n", 5, "workdir", "longer than the file system allows",
                 "give a shorter path", id="workdir-name-too-long"),
    pytest.param(STATIC.replace("key_file: id}", f"key_file: {'k' * 300}}}", 1), 6,
                 "provider.hosts.0.key_file", "longer than the file system allows",
                 "give a shorter path", id="key-file-name-too-long"),
    pytest.param(STATIC.replace("key_file: id}", 'key_file: "id\\0"}', 1), 6,
                 "provider.hosts.0.key_file", "contains a NUL character", "remove it",
                 id="key-file-nul"),
    pytest.param(STATIC.replace("  hosts:", "  known_hosts: /a/" + "b" * 300 + "\n  hosts:"), 5,
                 "provider.known_hosts", "longer than the file system allows", "shorter path",
                 id="known-hosts-name-too-long"),
    pytest.param(STATIC.replace("key_file: id}", "key_file: ~no-such-user-x/id}", 1), 6,
                 "provider.hosts.0.key_file", "'~USER' names no user of this machine",
                 "give a path that exists", id="key-file-unknown-user"),
    pytest.param(CMD.replace("command: python train.py", "module: " + "m" * 300), 4, "job.module",
                 "File name too long", "give a path", id="module-name-too-long"),
]


@pytest.mark.parametrize(("text", "line", "field", "says", "fix"), CONTENT)
def test_validate_refuses_a_hostile_spec_with_one_clear_error(
        orchestrate: Callable[..., Result], tmp_path: Path, orchestrate_home: Path, text: str,
        line: int | None, field: str | None, says: str, fix: str) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    assert_refused(orchestrate("validate", str(path)), path, line=line, field=field, says=says,
                   fix=fix)
    assert not orchestrate_home.exists()  # validate touches no state


@pytest.fixture
def links(tmp_path: Path) -> Path:
    """A directory that holds a loop of symbolic links: loop -> loop."""
    (tmp_path / "loop").symlink_to("loop")
    return tmp_path


PATH_FIX = "give a path that exists on this machine"


@pytest.mark.parametrize(("text", "line", "field", "says", "fix"), [
    pytest.param(CMD + "workdir: loop\n", 5, "workdir", "a loop of symbolic links", PATH_FIX,
                 id="workdir"),
    pytest.param(STATIC.replace("key_file: id}", "key_file: loop/id}", 1), 6,
                 "provider.hosts.0.key_file", "a loop of symbolic links", PATH_FIX,
                 id="key-file"),
    pytest.param(STATIC.replace("  hosts:", "  known_hosts: loop\n  hosts:"), 5,
                 "provider.known_hosts", "a loop of symbolic links", PATH_FIX, id="known-hosts"),
    pytest.param(CMD.replace("command: python train.py", "module: loop.train"), 4, "job.module",
                 "module 'loop.train' not found", "name a module of your project",
                 id="module-under-the-loop"),
])
def test_a_symlink_loop_in_a_spec_path_names_the_field(
        orchestrate: Callable[..., Result], links: Path, text: str, line: int, field: str,
        says: str, fix: str) -> None:
    path = links / "cluster.yaml"
    path.write_text(text)
    assert_refused(orchestrate("validate", str(path)), path, line=line, field=field, says=says,
                   fix=fix)


def _socket(tmp_path: Path) -> Iterator[Path]:
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(tmp_path / "spec.sock"))
        yield tmp_path / "spec.sock"


def _file(name: str, data: bytes) -> Callable[[Path], Iterator[Path]]:
    def make(tmp_path: Path) -> Iterator[Path]:
        (tmp_path / name).write_bytes(data)
        yield tmp_path / name
    return make


def _path(name: str, setup: Callable[[Path], object] = lambda _: None
          ) -> Callable[[Path], Iterator[Path]]:
    def make(tmp_path: Path) -> Iterator[Path]:
        setup(tmp_path)
        yield tmp_path / name
    return make


# (how to make the path, line, says, fix): files that are not a readable UTF-8 spec.
FILES = [
    pytest.param(_path("absent.yaml"), None, "no such file", "check the path", id="missing"),
    pytest.param(_path("dir", lambda d: (d / "dir").mkdir()), None,
                 "not a regular file: it is a directory", "a YAML spec file", id="directory"),
    pytest.param(_path("file/cluster.yaml", lambda d: (d / "file").write_text("")), None,
                 "a directory in the path is a file", "check the path", id="file-as-directory"),
    pytest.param(_path("loop", lambda d: (d / "loop").symlink_to("loop")), None,
                 "a loop of symbolic links", "point the links", id="symlink-loop"),
    pytest.param(_path("n" * 300 + ".yaml"), None, "longer than the file system allows",
                 "a shorter path", id="name-too-long"),
    pytest.param(_socket, None, "not a regular file: it is a socket", "a YAML spec file",
                 id="socket"),
    pytest.param(_file("big.yaml", b"# padding\n" * 200_000), None, "larger than 1 MiB",
                 "a few KiB", id="two-megabytes"),
    pytest.param(_file("latin1.yaml", "name: demo\nworkers: 2\n# café\n".encode("latin-1")), 3,
                 "not UTF-8 at line 3, byte 6 (0xe9", "save it as UTF-8", id="latin-1"),
    pytest.param(_file("utf16.yaml", CMD.encode("utf-16")), 1, "the file is UTF-16",
                 "save it as UTF-8", id="utf-16-bom"),
    pytest.param(_file("utf32.yaml", CMD.encode("utf-32")), 1, "the file is UTF-32",
                 "save it as UTF-8", id="utf-32-bom"),
]


@pytest.mark.parametrize(("make", "line", "says", "fix"), FILES)
def test_validate_refuses_what_is_not_a_readable_spec_file(
        orchestrate: Callable[..., Result], tmp_path: Path,
        make: Callable[[Path], Iterator[Path]], line: int | None, says: str, fix: str) -> None:
    for path in make(tmp_path):
        assert_refused(orchestrate("validate", str(path)), path, line=line, field=None,
                       says=says, fix=fix)


def test_a_path_with_a_nul_character_is_a_spec_error(tmp_path: Path) -> None:
    """No command line can hold a NUL (click refuses it first); the API is given one."""
    from orchestrator import spec
    from orchestrator.errors import SpecError

    with pytest.raises(SpecError) as info:
        spec.load(tmp_path / "bad\0name.yaml")
    assert info.value.file == f"{tmp_path}/bad\\0name.yaml"
    assert str(info.value) == (f"{tmp_path}/bad\\0name.yaml: the path contains a NUL character"
                               "\n  fix: give the path of the spec file")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_an_unreadable_file_is_a_permission_error(orchestrate: Callable[..., Result],
                                                  tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(CMD)
    path.chmod(0)
    assert_refused(orchestrate("validate", str(path)), path, line=None, field=None,
                   says="permission denied", fix="chmod u+r")


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    os.mkfifo(tmp_path / "spec.fifo")
    return tmp_path / "spec.fifo"


@pytest.mark.parametrize("which", ["fifo", "/dev/zero"])
def test_a_fifo_or_a_device_is_refused_without_blocking(fifo: Path, orchestrate_home: Path,
                                                         which: str) -> None:
    """Opening a FIFO that has no writer blocks, and /dev/zero never ends: a real process,
    with a bound, proves neither is read."""
    path = str(fifo) if which == "fifo" else which
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", "validate", path],
                          cwd=REPO, capture_output=True, text=True, timeout=20,
                          env={**os.environ, "ORCHESTRATE_HOME": str(orchestrate_home)})
    kind = "a FIFO (named pipe)" if which == "fifo" else "a character device"
    assert_refused(Result(proc.returncode, proc.stdout, proc.stderr), path, line=None,
                   field=None, says=f"not a regular file: it is {kind}",
                   fix="give the path of a YAML spec file")


HOSTS_BY_ANCHOR = """\
name: shared
workers: 3
provider:
  kind: static
  hosts:
    - &host {address: 10.0.0.1, user: ml, key_file: id, ssh_port: 2222}
    - {<<: *host, address: 10.0.0.2}
    - <<: *host
      address: 10.0.0.3
      user: other
  setup: &setup [pip install -r requirements.txt]
job: {command: python train.py}
"""
LARGE_BUT_LEGAL = f"""\
name: large
workers: 1024
ports: {{start: 20000, end: 21100}}
job:
  module: m
  epochs: 1000000
  steps_per_epoch: 1000000000
  per_replica_batch_size: 1048576
  learning_rate: 100
  seed: 4294967295
retry: {{max_restarts: 1000, backoff_initial_s: 86400, backoff_max_s: 86400}}
timeouts: {{startup_s: 604800, stop_grace_s: 604800, hang_s: 604800, repair_s: 604800}}
env: {{BIG: {"x" * (32 << 10)}, "ON": "quoted key"}}
"""


@pytest.mark.parametrize(("text", "check"), [
    pytest.param(HOSTS_BY_ANCHOR, lambda s: (
        [(h.address, h.user, h.ssh_port) for h in s.provider.hosts]
        == [("10.0.0.1", "ml", 2222), ("10.0.0.2", "ml", 2222), ("10.0.0.3", "other", 2222)]),
        id="anchors-and-merge-keys"),
    pytest.param(LARGE_BUT_LEGAL, lambda s: (
        s.workers == 1024 and s.job.seed == 2**32 - 1 and len(s.env["BIG"]) == 32 << 10
        and s.env["ON"] == "quoted key"), id="large-but-legal-values"),
    pytest.param("\ufeff" + CMD, lambda s: s.name == "demo", id="utf-8-bom"),
])
def test_legitimate_specs_still_load(orchestrate: Callable[..., Result], tmp_path: Path,
                                     text: str, check: Callable[..., bool]) -> None:
    from orchestrator import spec

    (tmp_path / "m.py").write_text("")
    path = tmp_path / "cluster.yaml"
    path.write_text(text, encoding="utf-8")
    result = orchestrate("validate", str(path))
    assert result.code == 0, result.err
    assert result.out.startswith(f"{path}: ok: cluster ")
    assert check(spec.load(path))


IPV6 = """\
name: six
workers: 2
provider:
  kind: static
  hosts:
    - {address: '[fd00::1]', user: ml, key_file: id}
    - {address: 'fd00::2', ssh_address: '[fd00::22]', user: ml, key_file: id}
job: {command: python train.py}
"""


def test_ipv6_addresses_load_bare_and_plan_endpoints_in_brackets(
        orchestrate: Callable[..., Result], tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(IPV6)
    result = orchestrate("plan", str(path), "--json")
    assert result.code == 0, result.err
    document = json.loads(result.out)
    assert [t["endpoint"] for t in document["tasks"]] == ["[fd00::1]:23456", "[fd00::2]:23456"]
    assert document["cluster_def"] == {"worker": ["[fd00::1]:23456", "[fd00::2]:23456"]}
    assert [h["ssh"]["address"] for h in document["hosts"]] == ["fd00::1", "fd00::22"]
