"""What `down` deletes and what `up` uploads, with hostile inputs: a provider.root that is a
home, a system directory, a directory of the user's or of another cluster; a workdir that is a
home directory, holds keys and credentials, or is too big; and the modes of what is written here
and on the hosts, whatever the umask.

Most cases drive the CLI in this process with the hosts' SSH transport swapped for this
machine's shell (``LocalRunner``): the same scripts run, on directories of the test. One
end-to-end test runs `up` and `down` on a real sshd host as an unprivileged user."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tarfile
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import orchestrate, write_spec
from hostlab import HostLab

from orchestrator.paths import ROOT_MARKER, unsafe_root
from orchestrator.providers.ssh_hosts import SSHHostsProvider
from orchestrator.remote.local import LocalRunner
from orchestrator.remote.sync import SECRET_EXCLUDES, pack_dir, survey

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def hosts_here(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """SSH hosts reached through this machine's shell, whose SSH user's $HOME is the returned
    directory."""
    home = tmp_path / "home" / "ml"
    home.mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setattr(SSHHostsProvider, "runner_to",
                        lambda self, host: LocalRunner(host.name))
    return home


def static_spec(tmp_path: Path, *, root: str | None = None, workdir: str = "project",
                extra: str = "") -> Path:
    """A static cluster 'c' of one host, its code in ``tmp_path/project``."""
    project = tmp_path / "project"
    project.mkdir(exist_ok=True)
    (project / "train.py").write_text("print('train')\n")
    key = tmp_path / "key"
    key.write_text("not a key\n")
    path = tmp_path / "c.yaml"
    root_line = "" if root is None else f"  root: {json.dumps(root)}\n"
    path.write_text(f"name: c\nworkers: 1\nworkdir: {json.dumps(workdir)}\n"
                    "provider:\n  kind: static\n" + root_line + extra +
                    f"  hosts:\n    - {{address: 198.18.250.2, user: ml, key_file: {key}}}\n"
                    "job: {command: python train.py}\n")
    return path


# -- provider.root: the pure check -------------------------------------------------------------
UNSAFE = [  # (root, the SSH user's home, why it is refused; None: it is not)
    ("/", None, "the file system's root"),
    ("//", None, "the file system's root"),
    ("/tmp/..", None, "the file system's root"),
    ("/etc", None, "the system directory /etc"),
    ("/usr/", None, "the system directory /usr"),
    ("/usr//local", None, "the system directory /usr/local"),
    ("/lib64", None, "the system directory /lib64"),
    ("/libexec", None, "the system directory /libexec"),
    ("/var/lib/", None, "the system directory /var/lib"),
    ("/home", None, "the system directory /home"),
    ("/tmp", None, "the system directory /tmp"),
    ("/root", None, "the system directory /root"),
    ("/home/ml", None, "a home directory (/home/ml)"),
    ("/home/ml/", None, "a home directory (/home/ml)"),
    ("/home/ml/work/../", None, "a home directory (/home/ml)"),
    ("/Users/ml", None, "a home directory (/Users/ml)"),
    ("/data/ml", "/data/ml", "the SSH user's home directory (/data/ml)"),
    ("/data", "/data/ml", "an ancestor of the SSH user's home directory /data/ml"),
    ("/data/ml/../", "/data/ml/", "an ancestor of the SSH user's home directory /data/ml"),
    ("relative/dir", None, "not an absolute path"),
    ("/home/ml/.orchestrate/clusters/c", "/home/ml", None),
    ("/home/ml/work", "/home/ml", None),
    ("/data/ml2", "/data/ml", None),
    ("/srv/orchestrate/c", None, None),
    ("/var/lib/orchestrate", None, None),
    ("/tmp/orchestrate-c", "/", None),
]


@pytest.mark.parametrize(("root", "home", "why"), UNSAFE)
def test_unsafe_root_names_why_a_directory_cannot_be_a_cluster_root(
        root: str, home: str | None, why: str | None) -> None:
    assert unsafe_root(root, home) == why


# -- provider.root at the point of use: up makes and marks it, down deletes only that ----------
@dataclass(frozen=True)
class RootCase:
    make: Callable[[Path, Path], str]  # (tmp dir, SSH user's home) -> provider.root
    refused: bool  # whether `up` refuses it (exit 2)
    up: str  # what `up` says: the error, or a note
    down: str | None  # what `down` says; None: not run (the spec may refuse such a root)
    fix: str = "fix: set provider.root to a new directory for this cluster"  # when refused


SPEC_FIX = "fix: name a directory of its own, e.g. /srv/orchestrate/CLUSTER"


def fresh(tmp: Path, home: Path) -> str:
    return str(tmp / "fresh" / "root")


def users_own(tmp: Path, home: Path) -> str:
    mine = tmp / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me\n")
    return str(mine)


def other_clusters(tmp: Path, home: Path) -> str:
    theirs = tmp / "theirs"
    theirs.mkdir()
    (theirs / ROOT_MARKER).write_text("other\n")
    return str(theirs)


def a_link(tmp: Path, home: Path) -> str:
    users_own(tmp, home)
    (tmp / "link").symlink_to(tmp / "mine")
    return str(tmp / "link")


def a_file(tmp: Path, home: Path) -> str:
    (tmp / "plain").write_text("a file\n")
    return str(tmp / "plain")


def quoted(tmp: Path, home: Path) -> str:
    return str(tmp / "it's a \"dir\" [red]$(touch pwned)[/] ;rm -rf x")


def spelled_loosely(tmp: Path, home: Path) -> str:
    return f"{tmp}//fresh/../tidy/"


MADE = "up: 1 host(s)"
ROOTS = {
    "a new directory": RootCase(fresh, False, MADE, "removed c-0:{root}"),
    "one spelled with // and ..": RootCase(spelled_loosely, False, MADE, "removed c-0:{tmp}/tidy"),
    "quotes, spaces, $() and markup": RootCase(quoted, False, MADE, "removed c-0:{root}"),
    "the user's own directory": RootCase(
        users_own, False, "c-0: {root} existed before 'up', which did not make it: 'down' will "
        "leave it", f"c-0: {{root}} not removed: no {ROOT_MARKER} marker of cluster 'c' in it "
        "('up' did not make it); remove it by hand if it is yours"),
    "a link to the user's directory": RootCase(
        a_link, False, "c-0: {root} existed before 'up'",
        "c-0: {root} not removed: it is a symbolic link, which 'up' never makes"),
    "another cluster's root": RootCase(
        other_clusters, True, f"c-0: provider.root {{root}} belongs to cluster 'other' (its "
        f"{ROOT_MARKER} says so)", f"c-0: {{root}} not removed: its {ROOT_MARKER} names cluster "
        "'other', not 'c'", "fix: give each cluster a provider.root of its own"),
    "a file": RootCase(a_file, True, "c-0: provider.root {root} exists and is not a directory",
                       "c-0: {root} not removed: it is not a directory",
                       "fix: point provider.root at a directory"),
    "the SSH user's home": RootCase(
        lambda tmp, home: str(home), True,
        "c-0: provider.root {home} is the SSH user's home directory ({home}): 'down' deletes "
        "the root 'up' made, so it must be a directory of this cluster's own",
        "c-0: {home} not removed: provider.root is the SSH user's home directory ({home}); "
        "remove what is yours in it by hand"),
    "an ancestor of the home": RootCase(
        lambda tmp, home: str(home.parent) + "/", True,
        "c-0: provider.root {home_parent} is an ancestor of the SSH user's home directory {home}",
        "c-0: {home_parent} not removed: provider.root is an ancestor of the SSH user's home "
        "directory {home}; remove what is yours in it by hand"),
    # refused by the spec itself, before any host is asked: validate says so too
    "someone's home": RootCase(lambda tmp, home: "/home/ml", True,
                               "provider.root: a home directory (/home/ml): 'down' deletes the "
                               "cluster's root", None, SPEC_FIX),
    "the file system's root": RootCase(lambda tmp, home: "/tmp/../", True,
                                       "provider.root: the file system's root: 'down' deletes",
                                       None, SPEC_FIX),
    "a system directory": RootCase(lambda tmp, home: "/usr//local/", True,
                                   "provider.root: the system directory /usr/local: 'down' "
                                   "deletes", None, SPEC_FIX),
}


@pytest.mark.parametrize("case", list(ROOTS))
def test_down_deletes_only_the_root_up_made_for_this_cluster(
        case: str, hosts_here: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    home, root_case = hosts_here, ROOTS[case]
    tmp = tmp_path / "t"
    tmp.mkdir()
    root = root_case.make(tmp, home)
    names = {"root": root, "tmp": tmp, "home": home, "home_parent": home.parent}
    listing = sorted(tmp.rglob("*"))
    spec = static_spec(tmp_path, root=root)
    made = Path(os.path.normpath(root))
    was_there = made.exists()

    code, out, err = orchestrate(capsys, "up", str(spec))
    assert code == (2 if root_case.refused else 0), out + err
    assert "Traceback" not in out + err
    assert root_case.up.format(**names) in (err if root_case.refused else out), out + err
    if root_case.refused:
        assert root_case.fix in err, err
        assert sorted(tmp.rglob("*")) == listing  # refused before anything was made
    elif not was_there:
        assert stat.S_IMODE(made.stat().st_mode) == 0o700
        assert (made / ROOT_MARKER).read_text() == "c\n"
        assert (made / "code" / "train.py").is_file() and (made / "lib" / "worker").is_dir()
    if root_case.down is None:
        return

    code, out, err = orchestrate(capsys, "down", str(spec))
    assert code == 0 and "Traceback" not in out + err, out + err
    assert f"  {root_case.down.format(**names)}\n" in out
    assert made.exists() is was_there
    if (tmp / "mine").exists():
        assert (tmp / "mine" / "notes.txt").read_text() == "keep me\n"
    assert not list(tmp_path.rglob("pwned")) and not Path("pwned").exists()


# -- what up uploads ---------------------------------------------------------------------------
SECRETS = [  # (a secret file in the workdir, the path plan names as left out)
    (".ssh/id_ed25519", ".ssh"),
    (".aws/credentials", ".aws"),
    (".orchestrate/state.db", ".orchestrate"),
    (".gnupg/pubring.kbx", ".gnupg"),
    (".config/gcloud/credentials.db", ".config/gcloud"),
    ("sub/.config/gcloud/adc.json", "sub/.config/gcloud"),
    (".docker/config.json", ".docker/config.json"),
    (".kube/config", ".kube"),
    (".netrc", ".netrc"),
    (".env", ".env"),
    ("deploy/.env.production", "deploy/.env.production"),
    (".git-credentials", ".git-credentials"),
    (".pypirc", ".pypirc"),
    ("certs/server.pem", "certs/server.pem"),
    ("keys/id_rsa", "keys/id_rsa"),
    ("keys/id_ed25519.pub", "keys/id_ed25519.pub"),
]
NOT_SECRET = ("train.py", ".config/app.toml", "docker/config.json", "environment.yaml",
              "keys/README")


@pytest.mark.parametrize(("secret", "named"), SECRETS)
def test_up_leaves_keys_and_credentials_out_and_plan_says_so(
        secret: str, named: str, hosts_here: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    spec = static_spec(tmp_path, root=str(tmp_path / "root"))
    project = tmp_path / "project"
    for rel in (secret, *NOT_SECRET):
        (project / rel).parent.mkdir(parents=True, exist_ok=True)
        (project / rel).write_text(f"{rel}\n")

    code, out, err = orchestrate(capsys, "plan", "--json", str(spec))
    assert code == 0, err
    upload = json.loads(out)["upload"]
    assert upload["secrets_left_out"] == [named] and upload["secrets_left_out_count"] == 1
    assert upload["files"] == len(NOT_SECRET) and upload["refused"] is None
    code, out, err = orchestrate(capsys, "plan", str(spec))
    assert code == 0 and f"             left out as secrets: {named}\n" in out, out + err

    code, out, err = orchestrate(capsys, "up", str(spec))
    assert code == 0, out + err
    code_dir = tmp_path / "root" / "code"
    assert not (code_dir / secret).exists() and not (code_dir / named).exists()
    for rel in NOT_SECRET:
        assert (code_dir / rel).read_text() == f"{rel}\n"


@pytest.mark.parametrize("opted_in", [".env", "deploy/.env.*", "*.pem"])
def test_a_secret_is_uploaded_only_when_named_explicitly(opted_in: str, tmp_path: Path) -> None:
    project = tmp_path / "project"
    for rel in (".env", "deploy/.env.prod", "server.pem", ".ssh/id_rsa", "train.py"):
        (project / rel).parent.mkdir(parents=True, exist_ok=True)
        (project / rel).write_text("x\n")
    default = survey(str(project), ())
    chosen = survey(str(project), (), allowed_secrets=(opted_in,))
    assert default.secrets_left_out == (".env", ".ssh", "deploy/.env.prod", "server.pem")
    uploaded = set(default.secrets_left_out) - set(chosen.secrets_left_out)
    assert len(uploaded) == 1 and ".ssh" not in uploaded
    pack_dir(str(project), str(tmp_path / "a.tar.gz"), (), allowed_secrets=(opted_in,))
    with tarfile.open(tmp_path / "a.tar.gz") as tar:
        assert uploaded < set(tar.getnames()) and ".ssh" not in tar.getnames()


def test_every_secret_pattern_is_left_out_by_default(tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    for pattern in SECRET_EXCLUDES:
        path = project / pattern.replace("*", "x")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("secret\n")
    upload = survey(str(project), ())
    assert upload.files == 0 and upload.secrets_count > 0


BROAD = [  # (workdir, relative to the SSH user's $HOME (here: this user's), what is refused)
    (".", "your home directory {home}"),
    ("..", "an ancestor of your home directory {home}"),
    ("/", "the file system's root"),
]


@pytest.mark.parametrize(("workdir", "why"), BROAD)
def test_a_workdir_of_the_home_directory_or_root_is_refused(
        workdir: str, why: str, hosts_here: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    home = hosts_here
    (home / ".ssh").mkdir()
    (home / ".ssh" / "id_rsa").write_text("secret\n")
    where = workdir if workdir == "/" else str((home / workdir).resolve())
    spec = static_spec(tmp_path, root=str(tmp_path / "root"), workdir=where)
    reason = why.format(home=home)

    code, out, err = orchestrate(capsys, "plan", str(spec))
    assert code == 0, err
    assert f"  upload     {where}: 'up' refuses it: workdir is {reason}: point it at the " \
           "training code, or set provider.allow_home_workdir: true\n" in out

    code, out, err = orchestrate(capsys, "up", str(spec))
    assert code == 2 and "Traceback" not in out + err, out + err
    first, fix = err.splitlines()[:2]
    assert first == f"error: {spec}: workdir: {where} is {reason}: 'up' would copy all of it " \
                    "to every host"
    assert "provider.allow_home_workdir: true" in fix
    assert not (tmp_path / "root").exists()  # refused before any host was touched


def test_an_upload_over_the_limit_is_refused_with_its_size_and_the_fix(
        hosts_here: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = static_spec(tmp_path, root=str(tmp_path / "root"))
    with open(tmp_path / "project" / "weights.bin", "wb") as f:
        f.truncate(3 << 30)  # sparse: 3 GiB that take no disk

    code, out, err = orchestrate(capsys, "plan", "--json", str(spec))
    assert code == 0, err
    upload = json.loads(out)["upload"]
    assert upload["refused"] == "over the 2.0 GiB limit: leave data out with " \
                                "provider.sync_excludes"
    assert upload["largest"][0] == {"path": "weights.bin", "bytes": 3 << 30}

    code, out, err = orchestrate(capsys, "up", str(spec))
    assert code == 2 and "Traceback" not in out + err, out + err
    first, fix = err.splitlines()[:2]
    assert first.startswith(f"error: the upload of {tmp_path / 'project'} is over 3.0 GiB, more "
                            "than the 2.0 GiB 'up' sends to each host (largest: weights.bin "
                            "3.0 GiB, train.py 15 B)")
    assert fix.startswith("  fix: leave data, checkpoints and environments out with "
                          "provider.sync_excludes")
    assert not (tmp_path / "root").exists()

    spec = static_spec(tmp_path, root=str(tmp_path / "root"),
                       extra="  sync_excludes: ['*.bin']\n")
    code, out, err = orchestrate(capsys, "up", str(spec))
    assert code == 0, out + err


# -- modes, whatever the umask -----------------------------------------------------------------
WRITERS = textwrap.dedent("""\
    import json, subprocess, sys
    from pathlib import Path
    from orchestrator.files import private_dir, write_atomic
    from orchestrator.providers.keys import ensure_key_pair
    from orchestrator.providers.ssh_hosts import _claim_script
    from orchestrator.remote.base import ExecResult, Runner
    from orchestrator.remote.local import LocalRunner
    from orchestrator.remote.sync import sync_dir

    class Shell(Runner):  # a host's login shell: the umask is its own (here 000)
        def _exec(self, script, timeout_s=None, input=None):
            p = subprocess.run(["sh", "-c", script], capture_output=True, text=True)
            return ExecResult(p.returncode, p.stdout, p.stderr)
        def put_file(self, local_path, remote_path, mode=None):
            LocalRunner().put_file(local_path, remote_path, mode)
        def get_file(self, remote_path, local_path):
            raise NotImplementedError

    base = Path(sys.argv[1])
    write_atomic(base / "state.json", "{}")
    write_atomic(base / "public.txt", "shared", mode=0o644)
    private_dir(base / "made" / "deep")
    ensure_key_pair(base / "keys" / "ssh")
    LocalRunner().put_file(str(base / "state.json"), str(base / "put" / "copy.json"))
    (base / "project").mkdir()
    (base / "project" / "train.py").write_text("print(1)")
    subprocess.run(["sh", "-c", _claim_script(str(base / "remote" / "root"), "c", False)],
                   check=True, capture_output=True)
    sync_dir(Shell("h"), str(base / "project"), str(base / "remote" / "root" / "code"), ())
    sync_dir(Shell("h"), str(base / "project"), str(base / "remote" / "lib" / "worker"), ())
""")
WRITTEN = [  # (path under the base, its mode)
    ("state.json", 0o600),
    ("public.txt", 0o644),
    ("made", 0o700),
    ("made/deep", 0o700),
    ("keys", 0o700),
    ("keys/ssh", 0o700),
    ("keys/ssh/id_ed25519", 0o600),
    ("keys/ssh/id_ed25519.pub", 0o644),
    ("put", 0o700),
    ("put/copy.json", 0o600),
    ("remote", 0o700),
    ("remote/root", 0o700),
    (f"remote/root/{ROOT_MARKER}", 0o600),
    ("remote/root/code", 0o700),
    ("remote/lib", 0o700),
    ("remote/lib/worker", 0o700),
]


@pytest.fixture(scope="module")
def written_under_umask_000(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("umask")
    proc = subprocess.run([sys.executable, "-c", WRITERS, str(base)], cwd=REPO, text=True,
                          capture_output=True, timeout=60, preexec_fn=lambda: os.umask(0))
    assert proc.returncode == 0, proc.stderr
    return base


@pytest.mark.parametrize(("rel", "mode"), WRITTEN)
def test_files_and_directories_are_private_whatever_the_umask(
        written_under_umask_000: Path, rel: str, mode: int) -> None:
    path = written_under_umask_000 / rel
    assert stat.S_IMODE(path.stat().st_mode) == mode, oct(path.stat().st_mode)
    assert sorted(p.name for p in path.parent.iterdir() if p.name.startswith(".")) in (
        [], [ROOT_MARKER], [".orchestrate-sync"])  # no temporary file left behind


# -- end to end, on a real host ----------------------------------------------------------------
@pytest.mark.ssh
def test_down_on_a_real_host_keeps_a_root_it_did_not_make_and_removes_one_it_did(
        hostlab: HostLab, tmp_path: Path, orchestrate_home: Path) -> None:
    (host,) = hostlab.hosts(1)
    user = hostlab.plain_user()  # unprivileged, with a home of its own
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("print('train')\n")
    mine = Path(host.plain_home) / "my-data"
    made = Path(host.plain_home) / "made-root"
    try:
        mine.mkdir()
        (mine / "notes.txt").write_text("keep me\n")
        subprocess.run(["chown", "-R", f"{user}:{user}", str(mine)], check=True, timeout=30)
        for name, root in (("kept", mine), ("made", made)):
            spec = write_spec(tmp_path, hostlab, [host], f"name: {name}\n"
                              "job: {command: python train.py}\n",
                              provider_extra=f"  root: {root}\n", user=user)
            spec.write_text(spec.read_text().replace(f"workdir: {REPO}\n",
                                                     f"workdir: {project}\n", 1))
            up = cli_run("up", str(spec), home=orchestrate_home)
            assert up.returncode == 0, up.stdout + up.stderr
            assert (root / "code" / "train.py").is_file()
            if root == made:
                assert stat.S_IMODE(made.stat().st_mode) == 0o700
                assert (made / ROOT_MARKER).read_text() == "made\n"
            else:
                assert f"{name}-0: {root} existed before 'up', which did not make it" in up.stdout

            down = cli_run("down", str(spec), home=orchestrate_home)
            assert down.returncode == 0 and "Traceback" not in down.stderr, down.stderr
            if root == made:
                assert f"  removed {name}-0:{made}\n" in down.stdout
                assert not made.exists()
            else:
                assert f"  {name}-0: {mine} not removed: no {ROOT_MARKER} marker of cluster " \
                       "'kept' in it ('up' did not make it); remove it by hand if it is yours\n" \
                       in down.stdout
                assert (mine / "notes.txt").read_text() == "keep me\n"
    finally:
        for directory in (mine, made):
            subprocess.run(["rm", "-rf", "--", str(directory)], timeout=30, check=True)


def cli_run(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "ORCHESTRATE_HOME": str(home)})
