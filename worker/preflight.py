"""`python -m worker preflight`: what this host offers a task, printed as one JSON line.

Python and TensorFlow versions, JAX's, jaxlib's and Keras's, the GPUs (nvidia-smi where
present, and TensorFlow's or JAX's own view), free disk where checkpoints go, what this host's
name resolves to, whether the tasks' ports are free, and whether this host can open a TCP
connection to every other host's task port while it listens on its own.
With ``--write-check DIR`` it also creates DIR and writes (then deletes) a file there, or
for a gs:// URL does the same through TensorFlow's ``tf.io.gfile``, under a deadline; with
``--marker`` it leaves a file there that the controller then reads from the other hosts
(``--read-marker``, ``--remove-marker``: small modes of their own).
Only the standard library is needed; TensorFlow is imported when asked, while threads do the
network checks; JAX, when asked, in a child process under a deadline (a hung CUDA start is
killed there, and nothing of it stays in this process). The controller also runs this file
as ``python -c SOURCE``, so it imports nothing from the ``worker`` package.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import json
import os
import platform
import pwd
import re
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

BANNER = b"orchestrate-doctor\n"
# The name the controller's own probe sends: it is no peer (a listener does not count it), and
# a listener told it comes waits for it too, so a port closes only once its reach is known.
OUTSIDER = "orchestrate-controller"
SMI_QUERY = "--query-gpu=name,memory.total,driver_version"
MARKER_PREFIX = ".orchestrate-doctor-"
STORAGE_CHECK_ENV = "ORCHESTRATE_STORAGE_CHECK_S"
# TensorFlow's GCS errors quote the JSON API's answer, indented over lines: its first message.
GCS_CODE_RE = re.compile(r"HTTP response code (\d+)")
GCS_MESSAGE_RE = re.compile(r'"message":\s*("(?:[^"\\]|\\.)*")')
STORAGE_CHECK_S = 20.0  # a storage write that takes longer is reported as failed
IMPORT_LIMIT_S = 120.0  # the longest wait for TensorFlow's import before a gs:// check
JAX_DEVICES_LIMIT_S = 60.0  # the longest a child process may take to import JAX and list devices
# Run by a child process: the devices JAX would train on, as one JSON line.
JAX_DEVICES = """\
import json
import jax
devices = jax.devices()
print(json.dumps({"backend": jax.default_backend(), "count": len(devices),
                  "kinds": sorted({str(d.device_kind) for d in devices})}))
"""


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.read_marker or args.remove_marker:
        sys.stdout.write(json.dumps({"marker": marker_facts(args.read_marker,
                                                            args.remove_marker)}) + "\n")
        return 0
    started = time.monotonic()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    storage = None
    if args.write_check:
        storage = StorageCheck(args.write_check, args.storage_timeout, args.marker,
                               args.marker_content)
        threading.Thread(target=storage.run, daemon=True).start()
    listeners = [Listener(port, args.expect, args.outsider) for port in args.port]
    deadline = time.monotonic() + args.window
    probes = [Probe(endpoint, args.name, deadline) for endpoint in args.peer]
    jobs: list[Listener | Probe] = [*listeners, *probes]
    threads = [threading.Thread(target=job.run, daemon=True) for job in jobs]
    for thread in threads:
        thread.start()
    nvidia = nvidia_facts()
    has_gpus = bool(nvidia["gpus"])
    hostname = socket.gethostname()
    # The ports' check is let end before TensorFlow or JAX is imported: their import holds the
    # GIL for seconds at a time (their libraries' load), and a listener starved of it greets
    # no peer, whose probe then times out ("packets dropped: a firewall?"; seen on a loaded
    # machine, the Slurm lab's 3 nodes importing TensorFlow at once). A peer not heard by then
    # is still listened for during the import, as before.
    for thread in threads:
        thread.join(max(0.0, deadline + args.linger - time.monotonic()))
    report: dict[str, Any] = {
        "hostname": hostname,
        "hostname_lookup": hostname_facts(hostname),
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "tensorflow": tensorflow_facts(_asked(args.import_tensorflow, has_gpus)),
        "tf_keras": {"version": installed_version("tf_keras", "tf-keras")},
        "jax": jax_facts(_asked(args.import_jax, has_gpus)),
        "keras": {"version": installed_version("keras")},
        "nvidia": nvidia,
        "disk": disk_facts(args.dir),
    }
    for listener in listeners:
        listener.stop_at(deadline + args.linger)
    for thread in threads:
        thread.join()
    report["ports"] = [listener.result() for listener in listeners]
    report["peers"] = [probe.result() for probe in probes]
    if storage is not None:
        report["storage"] = storage.wait()
    report["seconds"] = round(time.monotonic() - started, 3)
    sys.stdout.write(json.dumps(report) + "\n")
    if storage is not None and not storage.finished:
        sys.stdout.flush()  # a storage client still stuck in its thread must not hold the exit
        os._exit(0)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m worker preflight")
    parser.add_argument("--name", default=socket.gethostname(), help="this host, as peers see it")
    parser.add_argument("--dir", default="~", help="where checkpoints go (~ is expanded)")
    parser.add_argument("--port", type=int, action="append", default=[],
                        help="a task port on this host: checked free, then listened on")
    parser.add_argument("--peer", action="append", default=[],
                        help="ADDRESS:PORT of another host's task to connect to")
    parser.add_argument("--expect", type=int, default=0,
                        help="how many peers will connect to each of our ports")
    parser.add_argument("--outsider", action="store_true",
                        help=f"the controller probes our ports too (as {OUTSIDER!r}): wait for "
                        "it as well")
    parser.add_argument("--window", type=float, default=5.0,
                        help="seconds to keep trying each peer")
    parser.add_argument("--linger", type=float, default=2.0,
                        help="seconds our ports keep listening after the window, for late peers")
    parser.add_argument("--import-tensorflow", choices=("auto", "always", "never"),
                        default="auto", help="import TensorFlow (seconds) to see the GPUs it "
                        "sees: auto = only where nvidia-smi lists GPUs")
    parser.add_argument("--import-jax", choices=("auto", "always", "never"), default="never",
                        help="import JAX in a child process (seconds) to list the devices it "
                        "sees: auto = only where nvidia-smi lists GPUs (the controller asks "
                        "for a job with job.backend: jax)")
    parser.add_argument("--write-check", metavar="DIR",
                        help="create DIR (a path, ~ expanded, or a gs:// URL) and write and "
                        "delete a file there")
    parser.add_argument("--storage-timeout", type=float, metavar="S",
                        default=_env_seconds(STORAGE_CHECK_ENV, STORAGE_CHECK_S),
                        help=f"seconds the write check may take (default ${STORAGE_CHECK_ENV} "
                        f"or {STORAGE_CHECK_S:g}); a gs:// check counts from TensorFlow's import")
    parser.add_argument("--marker", metavar="NAME",
                        help="after the write check, leave a file NAME in DIR for other hosts "
                        "to read")
    parser.add_argument("--marker-content", default="", help="what the --marker file holds")
    parser.add_argument("--read-marker", metavar="PATH",
                        help="only print what the file PATH holds (or why it cannot be read)")
    parser.add_argument("--remove-marker", metavar="PATH", help="only delete the file PATH")
    return parser


def _asked(mode: str, has_gpus: bool) -> bool:
    """Whether an ``--import-*`` mode imports here: "auto" only where nvidia-smi lists GPUs."""
    return mode == "always" or (mode == "auto" and has_gpus)


def _env_seconds(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


# -- software ------------------------------------------------------------------------------
def installed_version(module: str, *dists: str) -> str | None:
    """The version of the distribution that provides the ``module`` this Python would import.

    Its metadata directory is found by name first (``NAME-VERSION.dist-info``, or
    ``.egg-info``), and only its header read: going through ``importlib.metadata`` parses
    every distribution's metadata in the directory, which with a hundred installed (TensorFlow
    brings most of them) was 0.3 s of the preflight's 0.36 s. A distribution whose directory is
    named otherwise is still found by that full scan."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    entry = str(Path(next(iter(spec.submodule_search_locations))).parent)
    wanted = {_normal(name) for name in (*dists, module)}
    with contextlib.suppress(OSError):
        for name in sorted(os.listdir(entry)):
            stem, dot, kind = name.rpartition(".")
            if dot and kind in ("dist-info", "egg-info") and \
                    _normal(stem.split("-")[0]) in wanted:
                header = _metadata_header(Path(entry, name))
                if _normal(header.get("name", "")) in wanted and header.get("version"):
                    return header["version"]
    from importlib import metadata

    for dist in metadata.distributions(path=[entry]):
        if dist.metadata["Name"] and _normal(dist.metadata["Name"]) in wanted:
            return str(dist.version)
    return None


def _normal(name: str) -> str:
    """A distribution's name as PEP 503 compares them (``tf-keras`` is ``tf_keras``)."""
    return re.sub(r"[-_.]+", "_", name).lower()


def _metadata_header(path: Path) -> dict[str, str]:
    """``Name`` and ``Version`` from the header of a distribution's metadata (a ``.dist-info``
    directory's METADATA, an ``.egg-info`` directory's PKG-INFO, or an ``.egg-info`` file)."""
    found: dict[str, str] = {}
    source = path / ("METADATA" if path.suffix == ".dist-info" else "PKG-INFO") \
        if path.is_dir() else path
    with contextlib.suppress(OSError, UnicodeDecodeError), source.open(encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                break  # the header ends at the first blank line
            key, sep, value = line.partition(":")
            if sep and key.strip().lower() in ("name", "version"):
                found.setdefault(key.strip().lower(), value.strip())
            if len(found) == 2:
                break
    return found


def tensorflow_facts(do_import: bool) -> dict[str, Any]:
    spec = importlib.util.find_spec("tensorflow")
    if spec is None or not spec.submodule_search_locations:
        return {"version": None, "location": None, "imported": False,
                "error": "No module named 'tensorflow'"}
    package = Path(next(iter(spec.submodule_search_locations)))
    facts: dict[str, Any] = {
        "version": installed_version("tensorflow", "tensorflow", "tensorflow-cpu",
                                     "tf-nightly", "tensorflow-gpu"),
        "location": str(package), "imported": False, "error": None, "gpus": None,
        **_build_info(package),
    }
    if do_import:
        facts.update(_imported(facts))
    return facts


def _build_info(package: Path) -> dict[str, Any]:
    """CUDA and cuDNN versions TensorFlow was built with, read from its build_info.py."""
    try:
        tree = ast.parse((package / "python" / "platform" / "build_info.py").read_text())
    except (OSError, SyntaxError):
        return {"cuda_build": None, "cuda": None, "cudnn": None}
    info: dict[str, Any] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Tuple) and len(node.elts) == 2 and \
                isinstance(node.elts[0], ast.Constant):
            try:
                info[str(node.elts[0].value)] = ast.literal_eval(node.elts[1])
            except ValueError:
                continue
    return {"cuda_build": info.get("is_cuda_build"), "cuda": info.get("cuda_version"),
            "cudnn": info.get("cudnn_version")}


def _imported(facts: dict[str, Any]) -> dict[str, Any]:
    try:
        import tensorflow as tf
    except Exception as exc:
        return {"imported": False, "error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
    found: dict[str, Any] = {"imported": True, "version": str(getattr(tf, "__version__", "")) or
                             facts["version"]}
    try:
        devices = tf.config.list_physical_devices("GPU")
        found["gpus"] = [_tf_gpu(tf, d) for d in devices]
    except Exception as exc:
        found["error"] = f"tf.config: {type(exc).__name__}: {exc}".splitlines()[0]
    return found


def _tf_gpu(tf: Any, device: Any) -> dict[str, Any]:
    details = tf.config.experimental.get_device_details(device)
    capability = details.get("compute_capability")
    return {"name": str(details.get("device_name", device.name)),
            "compute_capability": ".".join(map(str, capability)) if capability else None}


def jax_facts(list_devices: bool) -> dict[str, Any]:
    """JAX's and jaxlib's versions, the oldest jaxlib this JAX imports with, and the CUDA plugin
    that gives JAX the GPUs, from what is installed (nothing imported); with ``list_devices``,
    the devices JAX sees (``devices``: None where not listed)."""
    version = installed_version("jax")
    facts: dict[str, Any] = {
        "version": version, "jaxlib_version": installed_version("jaxlib"),
        "minimum_jaxlib": _minimum_jaxlib() if version else None,
        "cuda_plugin": _cuda_plugin(), "devices": None, "error": None,
    }
    if version and list_devices:
        facts.update(_jax_devices())
    return facts


def _minimum_jaxlib() -> str | None:
    """The oldest jaxlib this JAX imports with (``_minimum_jaxlib_version`` in jax/version.py)."""
    spec = importlib.util.find_spec("jax")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        tree = ast.parse((Path(next(iter(spec.submodule_search_locations))) / "version.py")
                         .read_text())
    except (OSError, SyntaxError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and any(
                isinstance(t, ast.Name) and t.id == "_minimum_jaxlib_version"
                for t in node.targets):
            return str(node.value.value)
    return None


def _cuda_plugin() -> dict[str, str] | None:
    """The CUDA plugin JAX would load, in JAX's own order of preference (None: CPU only)."""
    for module in ("jax_cuda13_plugin", "jax_cuda12_plugin"):
        version = installed_version(module, module.replace("_", "-"))
        if version is not None:
            return {"name": module.replace("_", "-"), "version": version}
    return None


def _jax_devices() -> dict[str, Any]:
    """The devices JAX sees, from a child process under ``JAX_DEVICES_LIMIT_S``."""
    try:
        done = subprocess.run([sys.executable, "-c", JAX_DEVICES], capture_output=True,
                              text=True, timeout=JAX_DEVICES_LIMIT_S,  # no GPU memory
                              env={**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    except subprocess.TimeoutExpired:
        return {"error": f"JAX did not list its devices within {JAX_DEVICES_LIMIT_S:g} s"}
    except OSError as exc:
        return {"error": f"JAX could not be started: {_os_error(exc)}"}
    last = (done.stdout.strip().splitlines() or [""])[-1]
    if done.returncode != 0 or not last.startswith("{"):
        said = [line for line in done.stderr.strip().splitlines() if line.strip()]
        return {"error": said[-1].strip() if said else f"exit {done.returncode}"}
    devices: dict[str, Any] = json.loads(last)
    return {"devices": devices}


# -- network identity ----------------------------------------------------------------------
def hostname_facts(name: str) -> dict[str, Any]:
    """What ``name`` (this host's name) resolves to: every address, in the resolver's order,
    and ``bindable``, the first one this host can bind. That one is the address JAX's CPU
    collectives (gloo) listen on and tell their peers, as gloo finds it without an interface."""
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        return {"addresses": [], "bindable": None, "error": _describe(exc)}
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    bindable = next((str(info[4][0]) for info in infos if _can_bind(info[0], info[4])), None)
    return {"addresses": addresses, "bindable": bindable, "error": None}


def _can_bind(family: int, address: Any) -> bool:
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind(address)
    except OSError:
        return False
    return True


# -- hardware ------------------------------------------------------------------------------
def nvidia_facts() -> dict[str, Any]:
    """GPUs, driver and the CUDA version the driver supports, from nvidia-smi if installed."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {"smi": None, "gpus": [], "driver": None, "cuda": None,
                "error": "nvidia-smi not found: no NVIDIA driver on this host"}
    try:
        table = _run([smi, SMI_QUERY, "--format=csv,noheader,nounits"])
        header = _run([smi])
    except (OSError, subprocess.SubprocessError) as exc:
        return {"smi": smi, "gpus": [], "driver": None, "cuda": None,
                "error": f"nvidia-smi failed: {exc}".splitlines()[0]}
    gpus = []
    for line in table.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3:
            memory = int(parts[1]) if parts[1].isdigit() else None
            gpus.append({"name": parts[0], "memory_mib": memory, "driver": parts[2]})
    cuda = header.split("CUDA Version:", 1)[1].split()[0] if "CUDA Version:" in header else None
    return {"smi": smi, "gpus": gpus, "driver": gpus[0]["driver"] if gpus else None,
            "cuda": cuda, "error": None}


def _run(argv: list[str]) -> str:
    return subprocess.run(argv, capture_output=True, text=True, timeout=20, check=True).stdout


def disk_facts(directory: str) -> dict[str, Any]:
    """Free space of the file system that holds ``directory`` (or its nearest existing parent)."""
    path = Path(directory).expanduser().absolute()
    existing = next((p for p in (path, *path.parents) if p.exists()), Path("/"))
    usage = shutil.disk_usage(existing)
    return {"path": str(path), "free_bytes": usage.free, "total_bytes": usage.total}


# -- checkpoint storage --------------------------------------------------------------------
class StorageError(Exception):
    """A step of the write check failed; the text says which and why, in one line."""


class StorageCheck:
    """Can this host write checkpoints to a directory (a path or a gs:// URL)?

    Runs in a daemon thread: a hung network mount, or a storage client retrying for minutes
    without credentials, cannot hold the report past ``timeout`` seconds (for a gs:// URL,
    counted from the end of TensorFlow's import).
    """

    def __init__(self, location: str, timeout: float, marker: str | None = None,
                 content: str = "") -> None:
        self.location = location
        self.timeout = timeout
        self.marker = marker
        self.content = content
        self.url = "://" in location
        self.ok: bool | None = None
        self.error: str | None = None
        self.skipped: str | None = None
        self.marker_written = False
        self._ready = threading.Event()  # set when the timed part starts (after any import)
        self._done = threading.Event()
        self._started = time.monotonic()

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def run(self) -> None:
        try:
            if self.url:
                self._write_url()
            else:
                self._ready.set()
                self._write_path()
            self.ok = None if self.skipped else True
        except StorageError as exc:
            self.ok, self.error = False, str(exc)
        except Exception as exc:
            self.ok, self.error = False, _first_line(exc)
        finally:
            self._ready.set()
            self._done.set()

    def wait(self) -> dict[str, Any]:
        """The check's result, once it ended or its time ran out."""
        imported = self._ready.wait(IMPORT_LIMIT_S)
        left = self.timeout - (time.monotonic() - self._started)
        done = imported and self._done.wait(max(0.0, left))
        facts: dict[str, Any] = {
            "path": self.location, "url": self.url, "user": login_user(),
            "timeout_s": self.timeout, "seconds": round(time.monotonic() - self._started, 3),
        }
        if not done:
            why = ("TensorFlow's GCS client got no answer" if self.url else
                   "the file system did not answer")
            error = (f"timed out after {self.timeout:g} s ({why})" if imported else
                     f"TensorFlow did not import within {IMPORT_LIMIT_S:g} s")
            return {**facts, "ok": False, "skipped": None, "marker": None, "error": error}
        marker = {"name": self.marker, "written": self.marker_written} if self.marker else None
        return {**facts, "ok": self.ok, "error": self.error, "skipped": self.skipped,
                "marker": marker}

    def _write_path(self) -> None:
        path = Path(self.location).expanduser()
        if path.exists() and not path.is_dir():
            raise StorageError("it is a file, not a directory")
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot create it: {_os_error(exc)}") from exc
        probe = path / f"{MARKER_PREFIX}{secrets.token_hex(6)}"
        try:
            with open(probe, "x", encoding="utf-8") as f:
                f.write("orchestrate doctor: write check\n")
        except OSError as exc:
            raise StorageError(f"cannot write a file in it: {_os_error(exc)}") from exc
        try:
            probe.unlink()
        except OSError as exc:
            raise StorageError(f"cannot delete a file in it: {_os_error(exc)}") from exc
        if self.marker:
            try:
                with open(path / self.marker, "x", encoding="utf-8") as f:
                    f.write(self.content)
            except OSError as exc:
                raise StorageError(f"cannot write a file in it: {_os_error(exc)}") from exc
            self.marker_written = True

    def _write_url(self) -> None:
        if importlib.util.find_spec("tensorflow") is None:
            self.skipped = "TensorFlow is not installed: gs:// cannot be checked"
            return
        try:
            import tensorflow as tf
        except Exception as exc:
            self.skipped = f"TensorFlow does not import ({_first_line(exc)})"
            return
        self._started = time.monotonic()
        self._ready.set()
        probe = f"{self.location}/{MARKER_PREFIX}{secrets.token_hex(6)}"
        try:
            with tf.io.gfile.GFile(probe, "w") as f:
                f.write("orchestrate doctor: write check\n")
        except Exception as exc:
            raise StorageError(f"cannot write an object there: {_first_line(exc)}") from exc
        try:
            tf.io.gfile.remove(probe)
        except Exception as exc:
            raise StorageError(f"cannot delete an object there: {_first_line(exc)}") from exc


def marker_facts(read: str | None, remove: str | None) -> dict[str, Any]:
    """What the file ``read`` holds (or why it cannot be read); ``remove`` deleted."""
    facts: dict[str, Any] = {"path": read or remove, "content": None, "error": None}
    try:
        if read:
            facts["content"] = Path(read).expanduser().read_text(encoding="utf-8",
                                                                 errors="replace")
        if remove:
            Path(remove).expanduser().unlink(missing_ok=True)
    except OSError as exc:
        facts["error"] = _os_error(exc)
    return facts


def login_user() -> str:
    """The name this host's login knows us by (whom a directory must be writable by)."""
    for name in ("LOGNAME", "USER"):
        if os.environ.get(name):
            return os.environ[name]
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return str(os.geteuid())


def _os_error(exc: OSError) -> str:
    return exc.strerror or f"{type(exc).__name__}: {exc}"


def _first_line(exc: BaseException) -> str:
    first = describe_error(str(exc))
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def describe_error(text: str) -> str:
    """One line of a file system's error: for a GCS answer, its status and Cloud Storage's own
    message (TensorFlow quotes the whole JSON body, over lines); else the first line."""
    code, message = GCS_CODE_RE.search(text), GCS_MESSAGE_RE.search(text)
    if code and message:
        try:
            said = json.loads(message.group(1))
        except ValueError:
            said = message.group(1).strip('"')
        return f"HTTP {code.group(1)} from Cloud Storage: {said}"
    return (text.strip().splitlines() or [""])[0]


# -- network -------------------------------------------------------------------------------
class Listener:
    """Holds one task port while peers connect to it; says whether it was free."""

    def __init__(self, port: int, expect: int, outsider: bool = False) -> None:
        self.port = port
        self.expect = expect
        self.outsider = outsider
        self.heard: list[str] = []
        self.error: str | None = None
        self._until = float("inf")
        self._sock = socket.socket()
        try:  # the wildcard address, as TensorFlow's gRPC server binds it
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind(("", port))
            self._sock.listen(64)
            self._sock.settimeout(0.1)
        except OSError as exc:
            self.error = f"{type(exc).__name__}: {exc.strerror or exc}"
            self._sock.close()

    def stop_at(self, when: float) -> None:
        self._until = when

    def run(self) -> None:
        if self.error is not None:
            return
        with self._sock:
            while time.monotonic() < self._until and self._waiting():
                try:
                    conn, _ = self._sock.accept()
                except TimeoutError:
                    continue
                with conn:
                    self._greet(conn)

    def _waiting(self) -> bool:
        heard = set(self.heard)
        return len(heard - {OUTSIDER}) < self.expect or (self.outsider and OUTSIDER not in heard)

    def _greet(self, conn: socket.socket) -> None:
        """Banner out, the peer's name in; then wait for the peer to close first, so that
        TIME_WAIT stays on its side and the port is free for the task right after."""
        try:
            conn.settimeout(2.0)
            conn.sendall(BANNER)
            name = conn.recv(256).decode(errors="replace").strip()
        except OSError:
            return
        if name:
            self.heard.append(name)
        with contextlib.suppress(OSError):
            while conn.recv(256):
                continue

    def result(self) -> dict[str, Any]:
        return {"port": self.port, "free": self.error is None, "error": self.error,
                "heard_from": sorted(set(self.heard) - {OUTSIDER})}


class Probe:
    """Connects to one peer's task port, retrying while it is not listening yet."""

    def __init__(self, endpoint: str, name: str, deadline: float) -> None:
        self.endpoint = endpoint
        self.name = name
        self.deadline = deadline
        self.ok = False
        self.error: str | None = None
        self.seconds = 0.0

    def run(self) -> None:
        started = time.monotonic()
        host, _, port = self.endpoint.rpartition(":")
        address = (host.strip("[]"), int(port))
        while True:
            remaining = self.deadline - time.monotonic()
            try:
                self._try(address, max(0.2, min(1.5, remaining)))
                self.ok, self.error = True, None
                break
            except (ConnectionRefusedError, TimeoutError) as exc:
                self.error = _describe(exc)  # not listening yet, or packets dropped: retry
            except OSError as exc:
                self.error = _describe(exc)
                break
            if remaining <= 0:
                break
            time.sleep(0.1)
        self.seconds = round(time.monotonic() - started, 3)

    def _try(self, address: tuple[str, int], timeout: float) -> None:
        with socket.create_connection(address, timeout=timeout) as conn:
            banner = conn.recv(len(BANNER))
            if banner != BANNER:
                raise ConnectionError(f"another program answers there (it sent {banner[:40]!r})")
            conn.sendall(self.name.encode() + b"\n")

    def result(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "ok": self.ok, "error": self.error,
                "seconds": self.seconds}


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out (packets dropped: a firewall?)"
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror} (errno {exc.errno})"
    return f"{type(exc).__name__}: {exc}"


if __name__ == "__main__":
    sys.exit(main())
