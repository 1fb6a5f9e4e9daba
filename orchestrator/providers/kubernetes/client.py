"""The Kubernetes API as the provider uses it, at this I/O boundary only.

- Every call goes through the official client with ``_preload_content=False``: JSON objects in
  and out as plain dicts, the same across the client's versions (37 made its models pydantic).
- ``Kube.call`` retries what the API server asks to be retried (429 with its Retry-After, 500,
  502, 503, 504, a dropped connection) with jittered exponential backoff, and turns every
  other answer into a ``KubeError`` carrying the Status (code, reason, message, causes) with a
  fix for the user.
- ``PodWatch``: every pod of the cluster in memory, from one list and then one watch stream
  (bookmarks on; a 410 Gone relists): the watch loop's polls read it and cost the API server
  nothing.
- ``LogFollower``: one pod's log, followed into memory; a dropped stream reconnects from the
  last line's timestamp, so no line is lost or read twice.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from orchestrator.errors import ProviderError
from orchestrator.spec import KubernetesProvider

RETRYABLE = frozenset({429, 500, 502, 503, 504})
MAX_TRIES = 6
REQUEST_TIMEOUT_S = 30.0  # one request's connect and read; a watch's read is longer
WATCH_S = 240  # a watch stream's timeoutSeconds: the server ends it, the watch goes on
JOBSET_CRD = "jobsets.jobset.x-k8s.io"
JOBSET_GROUP, JOBSET_VERSION, JOBSETS = "jobset.x-k8s.io", "v1alpha2", "jobsets"


class KubeError(ProviderError):
    """The API server's refusal: its Status code, reason and message, with the fix."""

    def __init__(self, message: str, *, code: int | None, reason: str = "",
                 causes: tuple[str, ...] = (), fix: str | None = None) -> None:
        super().__init__(message, fix=fix)
        self.code = code
        self.reason = reason
        self.causes = causes


def kubeconfig_path(config: KubernetesProvider) -> Path:
    """The kubeconfig the provider reads: the spec's, else the first of $KUBECONFIG, else
    ~/.kube/config."""
    if config.kubeconfig:
        return Path(config.kubeconfig).expanduser()
    first = os.environ.get("KUBECONFIG", "").split(os.pathsep)[0]
    return Path(first).expanduser() if first else Path.home() / ".kube" / "config"


class Kube:
    """One cluster's API, in the spec's namespace; see the module docstring."""

    def __init__(self, config: KubernetesProvider, *,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        from kubernetes import client
        from kubernetes import config as kubeconfig

        path = kubeconfig_path(config)
        if not path.is_file():
            raise ProviderError(
                f"no kubeconfig at {path}",
                fix="get one for your cluster (gcloud container clusters get-credentials "
                    "CLUSTER --location LOCATION), or set provider.kubeconfig")
        settings = client.Configuration()
        try:
            kubeconfig.load_kube_config(config_file=str(path), context=config.context,
                                        client_configuration=settings, persist_config=False)
        except kubeconfig.ConfigException as exc:
            contexts = _contexts(path)
            raise ProviderError(
                f"the kubeconfig {path} cannot be used"
                + (f" with context {config.context!r}" if config.context else "") + f": {exc}",
                fix=(f"set provider.context to one of {', '.join(contexts)}" if contexts
                     else "get a kubeconfig for your cluster")) from None
        except (OSError, ValueError) as exc:  # unreadable, or YAML that is not a kubeconfig
            raise ProviderError(f"the kubeconfig {path} cannot be read: {exc}",
                                fix="get a kubeconfig for your cluster") from None
        # urllib3 would retry a 429 or 503 itself, silently, sleeping for its Retry-After:
        # ``call`` retries (and counts) instead, and a watch's or a log's stream never is
        settings.retries = False
        self.api_client = client.ApiClient(settings)
        self.namespace = config.namespace
        self.context = config.context or _current_context(path)
        self.server = str(self.api_client.configuration.host)
        self.core = client.CoreV1Api(self.api_client)
        self.custom = client.CustomObjectsApi(self.api_client)
        self.extensions = client.ApiextensionsV1Api(self.api_client)
        self.authorization = client.AuthorizationV1Api(self.api_client)
        self.sleep = sleep
        self.calls = 0  # requests sent (retries included), for the benchmark
        self._lock = threading.Lock()

    @property
    def where(self) -> str:
        return f"on {self.server} (context {self.context}, namespace {self.namespace})"

    def close(self) -> None:
        self.api_client.close()

    # -- calls -------------------------------------------------------------------------------
    def call(self, what: str, fn: Callable[..., Any], *args: Any, missing_ok: bool = False,
             timeout_s: float = REQUEST_TIMEOUT_S, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``'s JSON answer (None: 404 with ``missing_ok``), retried on
        what the server asks to retry.

        Raises:
            KubeError: any other answer, or retries spent; ``what`` says what was being done.
        """
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        delay = 0.5
        for attempt in range(1, MAX_TRIES + 1):
            with self._lock:
                self.calls += 1
            try:
                response = fn(*args, _preload_content=False, _request_timeout=timeout_s,
                              **kwargs)
                data = response.data
                return json.loads(data) if data else {}
            except ApiException as exc:
                if exc.status == 404 and missing_ok:
                    return None
                if exc.status in RETRYABLE and attempt < MAX_TRIES:
                    self.sleep(_retry_after(exc) or delay * random.uniform(0.8, 1.2))
                    delay = min(delay * 2, 8.0)
                    continue
                raise _explain(what, exc, self) from None
            except (HTTPError, OSError) as exc:
                if attempt < MAX_TRIES:
                    self.sleep(delay * random.uniform(0.8, 1.2))
                    delay = min(delay * 2, 8.0)
                    continue
                raise KubeError(f"{what}: the API server {self.server} did not answer ({exc})",
                                code=None, fix="check that the cluster is up and that this "
                                "machine reaches it (kubectl cluster-info)") from None
        raise AssertionError("not reached")

    def stream(self, fn: Callable[..., Any], *args: Any, timeout_s: float,
               **kwargs: Any) -> Any:
        """``fn``'s HTTP response, unread (a watch or a followed log), or the ApiException."""
        with self._lock:
            self.calls += 1
        return fn(*args, _preload_content=False, _request_timeout=(REQUEST_TIMEOUT_S, timeout_s),
                  **kwargs)

    # -- what up and the doctor ask ------------------------------------------------------------
    def jobset_versions(self) -> list[str] | None:
        """The served versions of the JobSet CRD, None when it is not installed."""
        return self.crd_versions(JOBSET_CRD)

    def crd_versions(self, name: str) -> list[str] | None:
        """The served versions of CustomResourceDefinition ``name``, None when it is not
        installed."""
        crd = self.call(f"read the CustomResourceDefinition {name}",
                        self.extensions.read_custom_resource_definition, name, missing_ok=True)
        if crd is None:
            return None
        return [v["name"] for v in crd.get("spec", {}).get("versions", []) if v.get("served")]

    def allowed(self, verb: str, resource: str, group: str = "", *,
                namespaced: bool = True) -> tuple[bool, str]:
        """Whether these credentials may ``verb`` ``resource`` in the namespace (or, not
        ``namespaced``, the cluster-scoped one), and why not."""
        attributes = {"verb": verb, "group": group, "resource": resource}
        if namespaced:
            attributes["namespace"] = self.namespace
        body = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
                "spec": {"resourceAttributes": attributes}}
        review = self.call(f"ask whether you may {verb} {resource}",
                           self.authorization.create_self_subject_access_review, body)
        status = review.get("status", {})
        return bool(status.get("allowed")), str(status.get("reason") or "")

    # -- pods ----------------------------------------------------------------------------------
    def list_pods(self, selector: str) -> dict[str, Any]:
        return dict(self.call("list the cluster's pods", self.core.list_namespaced_pod,
                              self.namespace, label_selector=selector))


def _explain(what: str, exc: Any, kube: Kube) -> KubeError:
    """The ApiException ``exc`` as the user reads it: the server's own message, and a fix."""
    status: dict[str, Any] = {}
    with contextlib.suppress(ValueError, TypeError):
        status = json.loads(exc.body or "{}")
    message = str(status.get("message") or exc.reason or "no message")
    reason = str(status.get("reason") or "")
    causes = tuple(f"{c.get('field', '')}: {c.get('message', '')}".strip(": ")
                   for c in (status.get("details") or {}).get("causes") or [])
    code = exc.status
    fixes = {
        401: f"your credentials for context {kube.context} are not accepted: get new ones "
             "(gcloud container clusters get-credentials CLUSTER --location LOCATION)",
        403: f"ask the cluster's admin for a Role in namespace {kube.namespace} that allows "
             "this (README: Kubernetes, permissions)",
        404: f"check provider.namespace ({kube.namespace}) and that the object exists",
        409: "another client changed the object meanwhile: try again",
        422: "the API server refused the object: report this as a bug with the message",
    }
    fix = fixes.get(code, "try again; if it persists, check the cluster's health")
    detail = f" ({'; '.join(causes)})" if causes else ""
    return KubeError(f"{what}: {code} {reason}: {message}{detail} {kube.where}".replace(
        ":  ", ": "), code=code, reason=reason, causes=causes, fix=fix)


def _retry_after(exc: Any) -> float | None:
    headers = getattr(exc, "headers", None) or {}
    value = headers.get("Retry-After") if hasattr(headers, "get") else None
    try:
        return min(30.0, float(value)) if value is not None else None
    except ValueError:
        return None


def _contexts(path: Path) -> list[str]:
    from kubernetes import config as kubeconfig

    try:
        contexts, _ = kubeconfig.list_kube_config_contexts(config_file=str(path))
    except Exception:  # only for the fix's hint
        return []
    return [str(c.get("name")) for c in contexts or []]


def _current_context(path: Path) -> str:
    from kubernetes import config as kubeconfig

    try:
        _, active = kubeconfig.list_kube_config_contexts(config_file=str(path))
    except Exception:  # only for messages
        return "?"
    return str((active or {}).get("name") or "?")


# -- the pod watch ------------------------------------------------------------------------------
@dataclass
class PodState:
    """A pod as the watch last saw it; ``deleted`` once the API server removed it."""

    pod: dict[str, Any]
    deleted: bool = False

    @property
    def name(self) -> str:
        return str(self.pod["metadata"]["name"])

    @property
    def labels(self) -> dict[str, str]:
        return dict(self.pod["metadata"].get("labels") or {})


class PodWatch:
    """Every pod that ``selector`` matches, kept current by one list and one watch stream.

    A pod's last state stays after it is deleted (``PodState.deleted``), so an exit code seen
    just before the deletion is kept. ``version`` counts the changes; ``wait`` blocks until
    the next one.
    """

    def __init__(self, kube: Kube, selector: str) -> None:
        self.kube = kube
        self.selector = selector
        self.pods: dict[str, PodState] = {}
        self.version = 0
        self.synced = threading.Event()  # the first list is in
        self.error: str | None = None  # why the watch cannot go on, for the user
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._response: Any = None
        self._thread = threading.Thread(target=self._run, name="pod-watch", daemon=True)

    def start(self) -> PodWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        _interrupt(self._response)
        self._thread.join(timeout=10)

    def snapshot(self) -> list[PodState]:
        with self._changed:
            return list(self.pods.values())

    def find(self, labels: dict[str, str]) -> PodState | None:
        """The newest pod whose labels include ``labels``."""
        matching = [p for p in self.snapshot() if labels.items() <= p.labels.items()]
        if not matching:
            return None
        return max(matching, key=lambda p: (not p.deleted, p.pod["metadata"].get(
            "creationTimestamp") or "", p.pod["metadata"].get("resourceVersion") or ""))

    def wait(self, version: int, timeout_s: float) -> int:
        """Block until the pods changed after ``version`` (or ``timeout_s``); the version now."""
        with self._changed:
            self._changed.wait_for(lambda: self.version != version or self._stop.is_set(),
                                   timeout=timeout_s)
            return self.version

    def _apply(self, kind: str, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        with self._changed:
            self.pods[name] = PodState(pod, deleted=kind == "DELETED")
            self.version += 1
            self._changed.notify_all()

    def _run(self) -> None:
        version: str | None = None
        delay = 0.5
        while not self._stop.is_set():
            try:
                if version is None:
                    version = self._relist()
                version = self._watch(version)
                delay = 0.5
            except _Gone:
                version = None  # too old: list again
            except Exception as exc:  # the watch outlives any one failure
                self.error = f"{type(exc).__name__}: {exc}"
                self._stop.wait(delay)
                delay = min(delay * 2, 10.0)

    def _relist(self) -> str:
        listing = self.kube.list_pods(self.selector)
        seen = set()
        for pod in listing.get("items", []):
            seen.add(pod["metadata"]["name"])
            self._apply("ADDED", pod)
        with self._changed:  # pods gone while the watch was down
            for name, state in self.pods.items():
                if name not in seen and not state.deleted:
                    state.deleted = True
                    self.version += 1
            self._changed.notify_all()
        self.error = None
        self.synced.set()
        return str(listing.get("metadata", {}).get("resourceVersion") or "")

    def _watch(self, version: str) -> str:
        from kubernetes.client.exceptions import ApiException

        try:
            response = self.kube.stream(
                self.kube.core.list_namespaced_pod, self.kube.namespace,
                label_selector=self.selector, watch=True, resource_version=version,
                allow_watch_bookmarks=True, timeout_seconds=WATCH_S, timeout_s=WATCH_S + 30)
        except ApiException as exc:
            if exc.status == 410:
                raise _Gone from None
            raise
        self._response = response
        try:
            for line in _lines(response):
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise _Gone
                    raise ProviderError(f"the pod watch failed: {obj.get('message')}")
                version = str(obj.get("metadata", {}).get("resourceVersion") or version)
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    self._apply(kind, obj)
                if self._stop.is_set():
                    break
        finally:
            self._response = None
            with contextlib.suppress(Exception):
                response.release_conn()
        return version


class _Gone(Exception):
    """The watch's resourceVersion is older than the server keeps: list again."""


def _interrupt(response: Any) -> None:
    """End a stream another thread is reading: its socket is shut down, so the read returns
    (closing the response instead would wait for the reader's lock)."""
    connection = getattr(response, "connection", None) if response is not None else None
    sock = getattr(connection, "sock", None)
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def _lines(response: Any) -> Iterator[bytes]:
    """The lines of a streamed HTTP response, as they arrive."""
    pending = b""
    for chunk in response.stream(amt=64 << 10, decode_content=True):
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line.strip():
                yield line
    if pending.strip():
        yield pending


# -- pod logs ---------------------------------------------------------------------------------
class LogFollower:
    """One pod's log (its container ``container``), followed into memory.

    The stream asks for timestamps; each line's is kept (the last one and how many lines had
    it), so a stream that drops is followed again from a few seconds before it, and the lines
    already had are skipped. ``ended`` once the stream ended by itself while the container had
    terminated (``terminated()``): every line it wrote is then in ``data``.
    """

    def __init__(self, kube: Kube, pod: str, container: str,
                 terminated: Callable[[], bool]) -> None:
        self.kube = kube
        self.pod = pod
        self.container = container
        self.terminated = terminated
        self.data = bytearray()
        self.ended = threading.Event()
        self.error: str | None = None
        self.streams = 0  # streams opened: one, and one more per reconnect
        self._last: tuple[int, int] = (0, 0)  # (the last line's time in ns, lines at it)
        self._replayed = 0  # lines at that time in the current stream
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._response: Any = None
        self._thread = threading.Thread(target=self._run, name=f"log-{pod}", daemon=True)

    def start(self) -> LogFollower:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.drop_stream()

    def drop_stream(self) -> None:
        """End the stream being read (it is followed again unless stopped)."""
        _interrupt(self._response)

    def read(self, offset: int, limit: int) -> tuple[bytes, int, bool]:
        """Bytes from ``offset`` (at most ``limit``), the next offset, and whether more wait."""
        with self._lock:
            chunk = bytes(self.data[offset:offset + limit])
            return chunk, offset + len(chunk), offset + len(chunk) < len(self.data)

    def _run(self) -> None:
        from kubernetes.client.exceptions import ApiException

        delay = 0.5
        while not self._stop.is_set():
            since = None
            if self._last[0]:  # from a little before the last line: its clock may differ
                since = max(1, math.ceil(time.time() - self._last[0] / 1e9) + 5)
            self._replayed = 0
            try:
                response = self.kube.stream(
                    self.kube.core.read_namespaced_pod_log, self.pod, self.kube.namespace,
                    container=self.container, follow=True, timestamps=True,
                    since_seconds=since, timeout_s=3600)
            except ApiException as exc:
                if exc.status == 404:  # the pod is gone: what was read is all there is
                    self.ended.set()
                    return
                self.error = f"{exc.status} {exc.reason}"  # waiting to start, mostly
                self._stop.wait(delay)
                delay = min(delay * 2, 5.0)
                continue
            except Exception as exc:  # reconnect on anything the link does
                self.error = f"{type(exc).__name__}: {exc}"
                self._stop.wait(delay)
                delay = min(delay * 2, 5.0)
                continue
            self._response = response
            self.streams += 1
            try:
                for line in _lines(response):
                    self._take(line)
                delay = 0.5
            except Exception as exc:  # the stream dropped: follow again
                self.error = f"{type(exc).__name__}: {exc}"
            finally:
                self._response = None
                with contextlib.suppress(Exception):
                    response.release_conn()
            if self.terminated():
                self.ended.set()
                return
            self._stop.wait(delay)

    def _take(self, line: bytes) -> None:
        stamp, _, text = line.partition(b" ")
        try:
            at = _nanos(stamp.decode())
        except ValueError:  # not a timestamp: keep the line as it is
            at, text = self._last[0], line
        last, count = self._last
        if at < last:
            return  # had it before the stream dropped
        if at == last:
            self._replayed += 1
            if self._replayed <= count:
                return  # one of the lines at that instant had before the stream dropped
            self._last = (at, count + 1)
        else:
            self._last, self._replayed = (at, 1), 1
        with self._lock:
            self.data += text + b"\n"


def _nanos(stamp: str) -> int:
    """Nanoseconds since the epoch of an RFC 3339 timestamp as the API server writes them
    (``2026-11-25T10:00:00.123456789Z``; Go drops the fraction's trailing zeros, so two stamps
    do not compare as strings)."""
    head, _, frac = stamp.rstrip("Z").partition(".")
    moment = datetime.strptime(head, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=timezone.utc)
    if frac and not frac.isdigit():
        raise ValueError(stamp)
    return int(moment.timestamp()) * 10**9 + int((frac + "000000000")[:9])
