"""An HTTP fake of the Kubernetes API server that the official ``kubernetes`` client talks to.

Drive it with the real client; controllers and a kubelet drive its ``store`` directly::

    with FakeKube() as fake:
        core = client.CoreV1Api(client.ApiClient(fake.configuration()))
        core.create_namespaced_secret("default", {"metadata": {"name": "s"}, "stringData": {...}})
        fake.store.patch("pods", "p", {"status": {"phase": "Running"}}, "default", subresource="status")

Modelled, with the real shapes and messages (api-conventions): core/v1 ``namespaces``, ``nodes``,
``pods`` (+ ``/status``, ``/log``, ``/binding``), ``services``, ``secrets``, ``configmaps``,
``events``, ``persistentvolumeclaims``, ``serviceaccounts``; ``batch/v1`` ``jobs``;
``jobset.x-k8s.io/v1alpha2`` ``jobsets`` (served only while the JobSet CRD object exists, through
the custom-objects paths); ``apiextensions.k8s.io/v1`` ``customresourcedefinitions``;
``authorization.k8s.io/v1`` ``selfsubjectaccessreviews``; discovery (``/version``, ``/api``,
``/apis``, each group version's APIResourceList). Verbs: create (``generateName``,
``dryRun=All``), get, list (label and field selectors, ``limit``/``continue``), watch (from a
resourceVersion, synthetic ADDED from "0", bookmarks, ``timeoutSeconds``, a window of history and
410 Expired as an ERROR event, objects entering and leaving a selector as ADDED/DELETED), replace
(resourceVersion preconditions), patch (merge; strategic merge treated as merge; JSON patch),
delete (graceful deletion of bound pods, finalizers, ownerReference garbage collection:
Background, Foreground and Orphan through their finalizers), deletecollection. The server sets
uid, resourceVersion (one counter), creationTimestamp, generation (on spec changes), status on
create (pods Pending with their QoS class, jobs ``{}``, ...); ``status`` changes only through
``/status``; pod specs are immutable but for images; immutable ConfigMaps and Secrets keep their
data; ConfigMaps and Secrets hold at most 1 MiB; Secret ``stringData`` becomes base64 ``data``;
Jobs get their selector and pod labels. Errors are ``Status`` bodies with the real reason,
message, details and causes (400, 401, 403, 404 (a plain-text ``404 page not found`` for a group
that is not served), 405, 409, 410, 415, 422, and injected 429/500/503/504). Bearer-token
authentication; RBAC rules that deny what a test names (``forbid``). Pod logs from CRI-format
files (``set_log_source``), with follow, timestamps, tail, since and limits.

Not modelled: controllers (no Job, JobSet, scheduler, kubelet, node lifecycle, namespace
lifecycle beyond deleting a namespace's objects at once, service-account tokens, admission
plugins such as ServiceAccount, LimitRanger or ResourceQuota); the garbage collector runs at once,
inside the delete call (the real one is asynchronous: dependents go a moment later); list
``resourceVersion`` semantics (every list reads the current state, and a ``continue`` page reads
the current state after its last key, not the first page's snapshot), ``resourceVersionMatch``,
``sendInitialEvents``; server-side apply, field managers and ``managedFields``; strategic merge
patch directives and merge keys (lists are replaced); protobuf, CBOR, YAML and table output;
validation beyond names, labels and the fields ``validate`` checks (no OpenAPI schema for custom
resources); custom resources other than JobSet; immutability of fields other than the ones above
(a Job's template, selectors); aggregated discovery; ``/watch/`` paths; exec, attach and
port-forward; the ``stream`` parameter of logs; Event aggregation beyond counting repeats; TLS and
any authentication but the one bearer token. SelfSubjectAccessReview gives a reason when it
denies (the real RBAC authorizer gives none).
"""

from __future__ import annotations

import base64
import contextlib
import copy
import functools
import json
import re
import secrets
import select
import socket
import string
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from queue import Empty, Queue
from typing import Any
from urllib.parse import parse_qs, urlsplit

import yaml
from kubernetes import client

Json = dict[str, Any]
Objects = list[Json]
Key = tuple[str, str]  # (namespace or "", name)
LogLines = list[tuple[str, str]]  # (CRI timestamp, text)
Events = list[tuple[str, Json]]  # (watch event type, object)
Owned = list[tuple["Kind", Json]]
Keyed = list[tuple[str, Json]]  # (etcd key "namespace/name", object)
JOBSET_CRD = "jobsets.jobset.x-k8s.io"
LOCALQUEUE_CRD = "localqueues.kueue.x-k8s.io"
WORKLOAD_CRD = "workloads.kueue.x-k8s.io"
GENERATE_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # what the apiserver's name generator draws from
DEFAULT_GRACE_S = 30
BASE64_CHARS = frozenset(string.ascii_letters + string.digits + "+/=")
POD_UPDATE_FORBIDDEN = (
    "Forbidden: pod updates may not change fields other than `spec.containers[*].image`,"
    "`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,`spec.tolerations` (only additions "
    "to existing tolerations),`spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it was "
    "previously negative)")
MAX_DATA_BYTES = 1 << 20
CLIENT_CHECK_S = 0.5  # how often an idle watch looks whether its client has gone
SUBDOMAIN_RE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
LABEL_1123_RE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
LABEL_1035_RE = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
QUALIFIED_NAME_RE = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
LABEL_VALUE_RE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
NAME_RULES = {
    "subdomain": (SUBDOMAIN_RE, 253, "a lowercase RFC 1123 subdomain must consist of lower case "
                  "alphanumeric characters, '-' or '.', and must start and end with an alphanumeric "
                  "character (e.g. 'example.com', regex used for validation is "
                  "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"),
    "label": (LABEL_1123_RE, 63, "a lowercase RFC 1123 label must consist of lower case alphanumeric "
              "characters or '-', and must start and end with an alphanumeric character (e.g. "
              "'my-name',  or '123-abc', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')"),
    "dns1035": (LABEL_1035_RE, 63, "a DNS-1035 label must consist of lower case alphanumeric "
                "characters or '-', start with an alphabetic character, and end with an alphanumeric "
                "character (e.g. 'my-name',  or 'abc-123', regex used for validation is "
                "'[a-z]([-a-z0-9]*[a-z0-9])?')"),
}
LABEL_VALUE_MESSAGE = ("a valid label must be an empty string or consist of alphanumeric characters, "
                       "'-', '_' or '.', and must start and end with an alphanumeric character (e.g. "
                       "'MyValue',  or 'my_value',  or '12345', regex used for validation is "
                       "'(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')")
LABEL_KEY_MESSAGE = ("name part must consist of alphanumeric characters, '-', '_' or '.', and must "
                     "start and end with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or "
                     "'123-abc', regex used for validation is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')")
VERBS_ALL = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]


@dataclass(frozen=True)
class Kind:
    """One served resource: its REST name, kind, group/version, scope and the rules that differ."""

    resource: str
    kind: str
    group: str
    version: str
    namespaced: bool = True
    status: bool = False  # has a /status subresource
    name_rule: str = "subdomain"
    fields: tuple[str, ...] = ()  # field selectors beyond metadata.name and metadata.namespace
    short_names: tuple[str, ...] = ()
    return_deleted: bool = False  # DELETE answers the object (pods, services), not a Status
    default_propagation: str = "Background"
    crd: str = ""  # served only while this CRD object exists

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def qualified(self) -> str:
        """How messages name the resource: ``pods``, ``jobs.batch``."""
        return f"{self.resource}.{self.group}" if self.group else self.resource


KINDS = {k.resource: k for k in [
    Kind("namespaces", "Namespace", "", "v1", namespaced=False, status=True, name_rule="label",
         fields=("status.phase",), short_names=("ns",), return_deleted=True),
    Kind("nodes", "Node", "", "v1", namespaced=False, status=True, fields=("spec.unschedulable",),
         short_names=("no",)),
    Kind("pods", "Pod", "", "v1", status=True, short_names=("po",), return_deleted=True,
         fields=("spec.nodeName", "spec.restartPolicy", "spec.schedulerName",
                 "spec.serviceAccountName", "status.phase", "status.podIP",
                 "status.nominatedNodeName")),
    Kind("services", "Service", "", "v1", status=True, name_rule="dns1035", short_names=("svc",),
         return_deleted=True),
    Kind("secrets", "Secret", "", "v1", fields=("type",)),
    Kind("configmaps", "ConfigMap", "", "v1", short_names=("cm",)),
    Kind("events", "Event", "", "v1", short_names=("ev",),
         fields=("involvedObject.kind", "involvedObject.namespace", "involvedObject.name",
                 "involvedObject.uid", "involvedObject.apiVersion", "involvedObject.resourceVersion",
                 "involvedObject.fieldPath", "reason", "reportingComponent", "source", "type")),
    Kind("persistentvolumeclaims", "PersistentVolumeClaim", "", "v1", status=True,
         short_names=("pvc",)),
    Kind("serviceaccounts", "ServiceAccount", "", "v1", short_names=("sa",)),
    # The real default for batch/v1 Jobs deleted through the API is Orphan (kept for
    # compatibility); kubectl asks for Background explicitly.
    Kind("jobs", "Job", "batch", "v1", status=True, fields=("status.successful",),
         default_propagation="Orphan"),
    Kind("jobsets", "JobSet", "jobset.x-k8s.io", "v1alpha2", status=True, crd=JOBSET_CRD),
    Kind("localqueues", "LocalQueue", "kueue.x-k8s.io", "v1beta1", status=True,
         crd=LOCALQUEUE_CRD),
    Kind("workloads", "Workload", "kueue.x-k8s.io", "v1beta1", status=True, crd=WORKLOAD_CRD),
    Kind("customresourcedefinitions", "CustomResourceDefinition", "apiextensions.k8s.io", "v1",
         namespaced=False, status=True, short_names=("crd", "crds")),
    Kind("selfsubjectaccessreviews", "SelfSubjectAccessReview", "authorization.k8s.io", "v1",
         namespaced=False),
]}
GROUP_VERSIONS = {"v1": "", "batch/v1": "batch", "jobset.x-k8s.io/v1alpha2": "jobset.x-k8s.io",
                  "kueue.x-k8s.io/v1beta1": "kueue.x-k8s.io",
                  "apiextensions.k8s.io/v1": "apiextensions.k8s.io",
                  "authorization.k8s.io/v1": "authorization.k8s.io"}


def now_rfc3339() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def status_body(code: int, reason: str, message: str, details: Json | None = None) -> Json:
    body: Json = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                  "message": message, "reason": reason, "code": code}
    if not reason:
        del body["reason"]  # StatusReasonUnknown is "" and omitted, as the real server does
    if details is not None:
        body["details"] = details
    return body


class KubeError(Exception):
    """An API error: ``status`` is the Status body the server answers with."""

    def __init__(self, code: int, reason: str, message: str, details: Json | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.status = status_body(code, reason, message, details)
        self.headers = headers or {}

    @classmethod
    def not_found(cls, kind: Kind, name: str) -> KubeError:
        return cls(404, "NotFound", f'{kind.qualified} "{name}" not found', _details(kind, name))

    @classmethod
    def already_exists(cls, kind: Kind, name: str) -> KubeError:
        return cls(409, "AlreadyExists", f'{kind.qualified} "{name}" already exists',
                   _details(kind, name))

    @classmethod
    def conflict(cls, kind: Kind, name: str) -> KubeError:
        return cls(409, "Conflict", f'Operation cannot be fulfilled on {kind.qualified} "{name}": the '
                   "object has been modified; please apply your changes to the latest version and "
                   "try again", _details(kind, name))

    @classmethod
    def bad_request(cls, message: str) -> KubeError:
        return cls(400, "BadRequest", message)

    @classmethod
    def invalid(cls, kind: Kind, name: str, causes: list[Json]) -> KubeError:
        parts = [f"{c['field']}: {c['message']}" for c in causes]
        listed = parts[0] if len(parts) == 1 else "[" + ", ".join(parts) + "]"
        details = {"name": name, "kind": kind.kind, "causes": causes}
        if kind.group:
            details["group"] = kind.group
        return cls(422, "Invalid", f'{kind.kind} "{name}" is invalid: {listed}', details)

    @classmethod
    def expired(cls, message: str) -> KubeError:
        return cls(410, "Expired", message)


def _details(kind: Kind, name: str) -> Json:
    details: Json = {"name": name}
    if kind.group:
        details["group"] = kind.group
    details["kind"] = kind.resource
    return details


def _invalid_value(field_path: str, value: Any, detail: str) -> Json:
    return {"reason": "FieldValueInvalid", "message": f"Invalid value: {json.dumps(value)}: {detail}",
            "field": field_path}


def _required(field_path: str, detail: str = "") -> Json:
    message = f"Required value: {detail}" if detail else "Required value"
    return {"reason": "FieldValueRequired", "message": message, "field": field_path}


# --- validation -------------------------------------------------------------------------------


def _name_causes(name: str, rule: str, field_path: str = "metadata.name") -> list[Json]:
    pattern, limit, message = NAME_RULES[rule]
    causes = []
    if len(name) > limit:
        causes.append(_invalid_value(field_path, name, f"must be no more than {limit} characters"))
    if not pattern.fullmatch(name):
        causes.append(_invalid_value(field_path, name, message))
    return causes


def _label_causes(labels: Json) -> list[Json]:
    causes = []
    for key, value in labels.items():
        prefix, _, name = key.rpartition("/")
        if (prefix and _name_causes(prefix, "subdomain")) or len(name) > 63 \
                or not QUALIFIED_NAME_RE.fullmatch(name):
            causes.append(_invalid_value("metadata.labels", key, LABEL_KEY_MESSAGE))
        if not isinstance(value, str) or len(value) > 63 or not LABEL_VALUE_RE.fullmatch(value):
            causes.append(_invalid_value("metadata.labels", value, LABEL_VALUE_MESSAGE))
    return causes


def _container_causes(spec: Json, path: str) -> list[Json]:
    containers = spec.get("containers") or []
    if not containers:
        return [_required(f"{path}.containers")]
    causes = []
    for i, container in enumerate(containers):
        if not container.get("name"):
            causes.append(_required(f"{path}.containers[{i}].name"))
        else:
            causes += _name_causes(container["name"], "label", f"{path}.containers[{i}].name")
        if not container.get("image"):
            causes.append(_required(f"{path}.containers[{i}].image"))
    return causes


def _spec_causes(kind: Kind, obj: Json) -> list[Json]:
    spec = obj.get("spec") or {}
    if kind.resource == "pods":
        return _container_causes(spec, "spec")
    if kind.resource == "jobs":
        pod_spec = (spec.get("template") or {}).get("spec") or {}
        causes = _container_causes(pod_spec, "spec.template.spec")
        policy = pod_spec.get("restartPolicy")
        if policy is None:
            causes.append(_required("spec.template.spec.restartPolicy",
                                    'valid values: "OnFailure", "Never"'))
        elif policy not in ("OnFailure", "Never"):
            causes.append({"reason": "FieldValueNotSupported", "field": "spec.template.spec.restartPolicy",
                           "message": f'Unsupported value: "{policy}": supported values: "OnFailure", '
                                      '"Never"'})
        return causes
    if kind.resource == "jobsets" and not spec.get("replicatedJobs"):
        return [_required("spec.replicatedJobs")]
    return []


BYTES_FIELD = {"secrets": "data", "configmaps": "binaryData"}  # []byte in the API types: base64


def check_decodable(kind: Kind, obj: Json) -> None:
    """Bytes fields that are not base64 fail decoding (400), before any validation."""
    for value in (obj.get(BYTES_FIELD.get(kind.resource, "")) or {}).values():
        text = str(value)
        bad = next((i for i, c in enumerate(text) if c not in BASE64_CHARS), None)
        if bad is None and len(text) % 4:
            bad = len(text) - len(text) % 4
        if bad is not None:
            raise KubeError.bad_request(f'{kind.kind} in version "v1" cannot be handled as a {kind.kind}: '
                                        f"illegal base64 data at input byte {bad}")


def _data_size(kind: Kind, obj: Json) -> int:
    if kind.resource == "secrets":
        return sum(len(base64.b64decode(v)) for v in (obj.get("data") or {}).values())
    return sum(len(k) + len(str(v).encode()) for k, v in (obj.get("data") or {}).items()) + sum(
        len(k) + len(base64.b64decode(v)) for k, v in (obj.get("binaryData") or {}).items())


def _size_causes(kind: Kind, obj: Json) -> list[Json]:
    """ConfigMaps and Secrets hold at most 1 MiB (the real messages name the field oddly)."""
    if kind.resource not in BYTES_FIELD or _data_size(kind, obj) <= MAX_DATA_BYTES:
        return []
    return [{"reason": "FieldValueTooLong", "field": "data" if kind.resource == "secrets" else "[]",
             "message": f"Too long: must have at most {MAX_DATA_BYTES} bytes"}]


def immutability_causes(kind: Kind, current: Json, new: Json) -> list[Json]:
    """What an update may not change: an immutable ConfigMap's or Secret's data, a pod's spec."""
    if kind.resource == "pods" and _mutable_pod_spec(new) != _mutable_pod_spec(current):
        return [{"reason": "FieldValueForbidden", "field": "spec", "message": POD_UPDATE_FORBIDDEN}]
    if kind.resource not in BYTES_FIELD or not current.get("immutable"):
        return []
    forbidden = "Forbidden: field is immutable when `immutable` is set"
    return [{"reason": "FieldValueForbidden", "field": name, "message": forbidden}
            for name in ("immutable", "data", "binaryData")
            if name in current or name in new
            if (new.get(name) if name != "immutable" else bool(new.get(name))) != current.get(name)]


def validate(kind: Kind, obj: Json) -> None:
    """Raise 422 Invalid with every cause the real validation would report for these fields."""
    meta = obj["metadata"]
    name = meta.get("name", "")
    causes = _name_causes(name, kind.name_rule) if name else [
        _required("metadata.name", "name or generateName is required")]
    causes += _label_causes(meta.get("labels") or {})
    causes += _spec_causes(kind, obj)
    causes += _size_causes(kind, obj)
    if causes:
        raise KubeError.invalid(kind, name, causes)


# --- selectors --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!"
    values: frozenset[str] = frozenset()

    def matches(self, labels: dict[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        if self.op == "exists":
            return present
        if self.op == "!":
            return not present
        if self.op in ("=", "in"):
            return present and value in self.values
        return not present or value not in self.values  # "!=", "notin"


def _split_terms(selector: str) -> list[str]:
    terms, depth, current = [], 0, ""
    for char in selector:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            terms.append(current.strip())
            current = ""
        else:
            current += char
    if current.strip():
        terms.append(current.strip())
    return terms


SET_TERM = re.compile(r"^(\S+)\s+(in|notin)\s+\((.*)\)$")
EQ_TERM = re.compile(r"^([^=!\s]+)\s*(==|=|!=)\s*(\S*)$")


def parse_label_selector(selector: str | None) -> list[Requirement]:
    """Parse ``a=b,c!=d,e in (x,y),f notin (z),g,!h``; 400 as the real parser words it."""
    requirements = []
    for term in _split_terms(selector or ""):
        if match := SET_TERM.match(term):
            values = frozenset(v.strip() for v in match.group(3).split(",") if v.strip())
            requirements.append(Requirement(match.group(1), match.group(2), values))
        elif match := EQ_TERM.match(term):
            op = "!=" if match.group(2) == "!=" else "="
            requirements.append(Requirement(match.group(1), op, frozenset([match.group(3)])))
        elif term.startswith("!") and QUALIFIED_NAME_RE.fullmatch(term[1:].rpartition("/")[2]):
            requirements.append(Requirement(term[1:], "!"))
        elif QUALIFIED_NAME_RE.fullmatch(term.rpartition("/")[2]):
            requirements.append(Requirement(term, "exists"))
        else:
            raise KubeError.bad_request(f"unable to parse requirement: {term!r}")
    return requirements


def parse_field_selector(kind: Kind, selector: str | None) -> list[tuple[str, str, str]]:
    terms = []
    for term in _split_terms(selector or ""):
        match = re.match(r"^([^=!]+)(==|=|!=)(.*)$", term)
        if not match:
            raise KubeError.bad_request(f"invalid selector: '{selector}'; can't understand '{term}'")
        path, op, value = match.group(1), match.group(2), match.group(3)
        if path not in ("metadata.name", "metadata.namespace", *kind.fields):
            if kind.crd:
                raise KubeError.bad_request(f'"{path}" is not a known field selector: only '
                                            '"metadata.name", "metadata.namespace"')
            raise KubeError.bad_request(f"field label not supported: {path}")
        terms.append((path, "!=" if op == "!=" else "=", value))
    return terms


def _field_value(obj: Json, path: str) -> str:
    if path == "source":
        return str((obj.get("source") or {}).get("component", ""))
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if isinstance(value, bool):
        return "true" if value else "false"
    return "" if value is None else str(value)


@dataclass(frozen=True)
class Filter:
    """What a list or watch selects: a namespace (or all), labels and fields."""

    namespace: str | None = None
    labels: tuple[Requirement, ...] = ()
    fields: tuple[tuple[str, str, str], ...] = ()

    def matches(self, obj: Json) -> bool:
        meta = obj.get("metadata", {})
        if self.namespace is not None and meta.get("namespace", "") != self.namespace:
            return False
        labels = meta.get("labels") or {}
        if not all(r.matches(labels) for r in self.labels):
            return False
        return all((_field_value(obj, path) == value) == (op == "=") for path, op, value in self.fields)


# --- patches ----------------------------------------------------------------------------------


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (strategic merge patch is treated the same: lists are replaced)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _pointer(path: str) -> list[str]:
    return [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]]


def json_patch(target: Json, operations: list[Json]) -> Json:
    """RFC 6902 JSON patch: add, remove, replace, test (move and copy are rare in clients)."""
    doc = copy.deepcopy(target)
    for op in operations:
        parts = _pointer(op.get("path", ""))
        parent: Any = doc
        try:
            for part in parts[:-1]:
                parent = parent[int(part)] if isinstance(parent, list) else parent[part]
            last = parts[-1]
            kind = op.get("op")
            if isinstance(parent, list):
                index = len(parent) if last == "-" else int(last)
                if kind == "add":
                    parent.insert(index, op["value"])
                elif kind == "remove":
                    parent.pop(index)
                elif kind == "replace":
                    parent[index] = op["value"]
                elif kind == "test" and parent[index] != op["value"]:
                    raise KubeError(422, "Invalid", "the server rejected our request due to an error "
                                    "in our request")
            elif kind in ("add", "replace"):
                if kind == "replace" and last not in parent:
                    raise KeyError(last)
                parent[last] = op["value"]
            elif kind == "remove":
                del parent[last]
            elif kind == "test" and parent.get(last) != op["value"]:
                raise KubeError(422, "Invalid", "the server rejected our request due to an error in "
                                "our request")
        except (KeyError, IndexError, ValueError) as error:
            raise KubeError(422, "Invalid", f"the server rejected our request due to an error in our "
                            f"request: {op.get('op')} {op.get('path')}: {error}") from error
    return doc


# --- the store --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Change:
    """One write, as the watch history keeps it: ``prev`` is the object before a MODIFIED."""

    rv: int
    type: str
    resource: str
    obj: Json
    prev: Json | None = None


class Watcher:
    """One open watch: the store puts matching changes (or ``None`` to end it) on ``queue``."""

    def __init__(self, resource: str, selection: Filter) -> None:
        self.resource = resource
        self.selection = selection
        self.queue: Queue[tuple[str, Json] | str] = Queue()

    def offer(self, change: Change) -> None:
        if change.resource != self.resource:
            return
        now = self.selection.matches(change.obj)
        before = change.prev is not None and self.selection.matches(change.prev)
        if change.type == "MODIFIED":
            kind = {(True, True): "MODIFIED", (True, False): "ADDED",
                    (False, True): "DELETED"}.get((now, before))
            if kind:
                self.queue.put((kind, change.obj))
        elif now:
            self.queue.put((change.type, change.obj))


class Store:
    """Every object of the fake cluster, one lock, one resourceVersion counter, a watch history.

    Methods take and return plain JSON dicts (deep copies) and raise ``KubeError`` (whose
    ``status`` is the Status body the HTTP API answers with). ``resource`` is the plural name
    ("pods", "jobs", "jobsets"); ``namespace`` defaults to "default" for namespaced kinds. For the
    controllers and the kubelet to come: ``subscribe`` (called after each change, outside the
    lock, in the writing thread, with ``(type, resource, object)``), ``bind`` (the scheduler),
    ``register_pod_terminator``/``finish_pod_deletion`` and ``set_log_source`` (the kubelet),
    ``record_event``, and ``update_status``/``patch(..., subresource="status")``.
    """

    def __init__(self, history: int = 1000, jobset_crd: bool = True) -> None:
        self._lock = threading.RLock()
        self._objects: dict[str, dict[Key, Json]] = {r: {} for r in KINDS}
        self._rv = 0
        self._history: deque[Change] = deque()
        self._history_size = history
        self._floor = 0  # a watch can resume from any resourceVersion >= this
        self._watchers: set[Watcher] = set()
        self._subscribers: list[Callable[[str, str, Json], None]] = []
        self._terminator: Callable[[Json], None] | None = None
        self._logs: dict[tuple[str, str, str, bool], Path] = {}
        self._depth = 0
        self._after: list[Callable[[], None]] = []
        for name in ("default", "kube-system"):
            self.create("namespaces", {"metadata": {"name": name}})
        if jobset_crd:
            self.create("customresourcedefinitions", jobset_crd_object())

    # -- plumbing --

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the lock; run the callbacks queued meanwhile once the outermost holder leaves."""
        with self._lock:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                after, self._after = (self._after, []) if self._depth == 0 else ([], self._after)
        for callback in after:
            callback()

    def _emit(self, type_: str, resource: str, obj: Json, prev: Json | None = None) -> None:
        change = Change(int(obj["metadata"]["resourceVersion"]), type_, resource,
                        copy.deepcopy(obj), copy.deepcopy(prev) if prev else None)
        self._history.append(change)
        while len(self._history) > self._history_size:
            self._floor = self._history.popleft().rv
        for watcher in self._watchers:
            watcher.offer(change)
        for subscriber in self._subscribers:
            self._after.append(functools.partial(subscriber, type_, resource, copy.deepcopy(change.obj)))

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def kind(self, resource: str) -> Kind:
        """The served kind named ``resource``; 404 when unknown or its CRD is not installed."""
        kind = KINDS.get(resource)
        if kind is None or (kind.crd and (("", kind.crd) not in
                                          self._objects["customresourcedefinitions"])):
            raise KubeError(404, "NotFound", "the server could not find the requested resource", {})
        return kind

    def _key(self, kind: Kind, name: str, namespace: str | None) -> Key:
        return (namespace or "default", name) if kind.namespaced else ("", name)

    def _existing(self, kind: Kind, name: str, namespace: str | None) -> Json:
        obj = self._objects[kind.resource].get(self._key(kind, name, namespace))
        if obj is None:
            raise KubeError.not_found(kind, name)
        return obj

    @property
    def resource_version(self) -> int:
        with self._lock:
            return self._rv

    # -- reads --

    def get(self, resource: str, name: str, namespace: str | None = None) -> Json:
        with self._locked():
            return copy.deepcopy(self._existing(self.kind(resource), name, namespace))

    def list(self, resource: str, namespace: str | None = None, label_selector: str | None = None,
             field_selector: str | None = None) -> Objects:
        """Objects of ``namespace`` (every namespace when None) in etcd's key order."""
        with self._locked():
            kind = self.kind(resource)
            selection = Filter(namespace if kind.namespaced else None,
                               tuple(parse_label_selector(label_selector)),
                               tuple(parse_field_selector(kind, field_selector)))
            return [copy.deepcopy(obj) for _, obj in self._sorted(resource) if selection.matches(obj)]

    def _sorted(self, resource: str) -> Keyed:
        """(etcd key, object) in the order etcd lists them: by the key's string."""
        return sorted((("/".join(key), obj) for key, obj in self._objects[resource].items()),
                      key=lambda pair: pair[0])

    def list_page(self, resource: str, selection: Filter, limit: int, token: str | None
                  ) -> tuple[Objects, int, str | None, int]:
        """A page of a list: (items, resourceVersion, continue token, remaining item count)."""
        with self._locked():
            self.kind(resource)
            rv, start = self._rv, ""
            if token:
                rv, start = decode_continue(token)
                if rv < self._floor:
                    raise KubeError(410, "Expired", CONTINUE_EXPIRED)
            matching = [(key, obj) for key, obj in self._sorted(resource)
                        if key > start and selection.matches(obj)]
            page = matching[:limit] if limit else matching
            rest = len(matching) - len(page)
            next_token = encode_continue(rv, page[-1][0]) if rest else None
            return [copy.deepcopy(o) for _, o in page], rv, next_token, rest

    def watch(self, resource: str, selection: Filter, since: str | None
              ) -> tuple[Events, Watcher]:
        """Open a watch: the events to send first and the watcher that queues the rest."""
        with self._locked():
            self.kind(resource)
            watcher = Watcher(resource, selection)
            if not since or since == "0":
                first = [("ADDED", copy.deepcopy(o)) for _, o in self._sorted(resource)
                         if selection.matches(o)]
            else:
                rv = int(since) if since.isdigit() else -1
                if rv < 0:
                    raise KubeError.bad_request(f'invalid resource version "{since}"')
                if rv < self._floor:
                    raise KubeError.expired(f"too old resource version: {rv} ({self._floor})")
                for change in self._history:
                    if change.rv > rv:
                        watcher.offer(change)
                first = []
            self._watchers.add(watcher)
            return first, watcher

    def unwatch(self, watcher: Watcher) -> None:
        with self._lock:
            self._watchers.discard(watcher)

    def end_watches(self, how: str = "end") -> None:
        with self._lock:
            for watcher in self._watchers:
                watcher.queue.put(how)

    def bookmark_rv(self, watcher: Watcher) -> str | None:
        """The resourceVersion a bookmark may carry now: None while the watcher has events to send."""
        with self._lock:
            return None if not watcher.queue.empty() else str(self._rv)

    def compact(self) -> None:
        """Forget the watch history now: older resourceVersions and continue tokens get 410."""
        with self._lock:
            self._history.clear()
            self._floor = self._rv

    # -- writes --

    def create(self, resource: str, obj: Json, namespace: str | None = None,
               dry_run: bool = False) -> Json:
        with self._locked():
            kind = self.kind(resource)
            new = copy.deepcopy(obj)
            meta = new.setdefault("metadata", {})
            if kind.namespaced:
                if namespace and meta.get("namespace") not in (None, "", namespace):
                    raise KubeError.bad_request("the namespace of the provided object does not match "
                                                "the namespace sent on the request")
                meta["namespace"] = namespace or meta.get("namespace") or "default"
            else:
                meta.pop("namespace", None)
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + "".join(
                    secrets.choice(GENERATE_ALPHABET) for _ in range(5))
            new["apiVersion"], new["kind"] = kind.api_version, kind.kind
            check_decodable(kind, new)
            validate(kind, new)
            if kind.status and kind.resource != "nodes":
                new.pop("status", None)  # set by the server and controllers (the kubelet posts nodes')
            if kind.namespaced and ("", meta["namespace"]) not in self._objects["namespaces"]:
                raise KubeError.not_found(KINDS["namespaces"], meta["namespace"])
            key = self._key(kind, meta["name"], meta.get("namespace"))
            if key in self._objects[resource]:
                raise KubeError.already_exists(kind, meta["name"])
            for stale in ("deletionTimestamp", "deletionGracePeriodSeconds", "resourceVersion"):
                meta.pop(stale, None)
            meta.update(uid=str(uuid.uuid4()), creationTimestamp=now_rfc3339(), generation=1)
            apply_defaults(kind, new)
            if dry_run:
                return new
            meta["resourceVersion"] = self._next_rv()
            self._objects[resource][key] = new
            self._emit("ADDED", resource, new)
            return copy.deepcopy(new)

    def update(self, resource: str, obj: Json, namespace: str | None = None,
               subresource: str | None = None, dry_run: bool = False) -> Json:
        """Replace an object (PUT): ``status`` is kept unless ``subresource`` is "status"."""
        with self._locked():
            kind = self.kind(resource)
            meta = obj.get("metadata") or {}
            current = self._existing(kind, meta.get("name", ""), namespace or meta.get("namespace"))
            if meta.get("resourceVersion") and meta["resourceVersion"] != \
                    current["metadata"]["resourceVersion"]:
                raise KubeError.conflict(kind, current["metadata"]["name"])
            if subresource == "status":
                new = copy.deepcopy(current)
                new["status"] = copy.deepcopy(obj.get("status"))
                if new["status"] is None:
                    new.pop("status")
            else:
                new = copy.deepcopy(obj)
                new["metadata"] = {**copy.deepcopy(meta), **{
                    k: current["metadata"][k] for k in ("uid", "creationTimestamp", "namespace",
                                                        "deletionTimestamp", "generation",
                                                        "deletionGracePeriodSeconds")
                    if k in current["metadata"]}}
                new.pop("status", None)
                if kind.status and "status" in current:
                    new["status"] = copy.deepcopy(current["status"])
                elif not kind.status and "status" in obj:
                    new["status"] = copy.deepcopy(obj["status"])
            new["apiVersion"], new["kind"] = kind.api_version, kind.kind
            new["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
            check_decodable(kind, new)
            validate(kind, new)
            apply_defaults(kind, new)
            causes = immutability_causes(kind, current, new)
            if causes:
                raise KubeError.invalid(kind, new["metadata"]["name"], causes)
            if _spec_of(new) != _spec_of(current):
                new["metadata"]["generation"] = current["metadata"].get("generation", 1) + 1
            if new == current or dry_run:
                return copy.deepcopy(new)
            return self._write(kind, current, new)

    def update_status(self, resource: str, obj: Json, namespace: str | None = None) -> Json:
        return self.update(resource, obj, namespace, subresource="status")

    def patch(self, resource: str, name: str, patch: Any, namespace: str | None = None,
              patch_type: str = "merge", subresource: str | None = None, dry_run: bool = False) -> Json:
        """Patch an object: ``patch_type`` "merge" (also strategic) or "json" (a list of ops)."""
        with self._locked():
            kind = self.kind(resource)
            current = copy.deepcopy(self._existing(kind, name, namespace))
            if patch_type == "json":
                if not isinstance(patch, list):
                    raise KubeError.bad_request("json: cannot unmarshal object into Go value of type "
                                                "jsonpatch.Patch")
                new = json_patch(current, patch)
            else:
                if not isinstance(patch, dict):
                    raise KubeError.bad_request("json: cannot unmarshal array into Go value of type "
                                                "map[string]interface {}")
                new = merge_patch(current, patch)
            if new.get("metadata", {}).get("resourceVersion") is None:
                new.setdefault("metadata", {})["resourceVersion"] = \
                    current["metadata"]["resourceVersion"]
            new.setdefault("metadata", {})["name"] = name
            return self.update(resource, new, namespace, subresource, dry_run)

    def _write(self, kind: Kind, current: Json, new: Json) -> Json:
        """Store a modified object (MODIFIED), or remove it when its deletion is now complete."""
        new["metadata"]["resourceVersion"] = self._next_rv()
        key = self._key(kind, new["metadata"]["name"], new["metadata"].get("namespace"))
        self._objects[kind.resource][key] = new
        self._emit("MODIFIED", kind.resource, new, current)
        if _deletion_complete(new):
            self._remove(kind, key)
        return copy.deepcopy(new)

    # -- deletion --

    def delete(self, resource: str, name: str, namespace: str | None = None,
               grace_period_seconds: int | None = None, propagation_policy: str | None = None,
               dry_run: bool = False) -> Json:
        """Delete an object; returns its last state (with a deletionTimestamp if it stays)."""
        with self._locked():
            return self._delete(self.kind(resource), name, namespace, grace_period_seconds,
                                propagation_policy, dry_run)[0]

    def delete_with_outcome(self, resource: str, name: str, namespace: str | None,
                            grace_period_seconds: int | None, propagation_policy: str | None,
                            dry_run: bool) -> tuple[Json, bool]:
        """``delete``, and whether the object is gone already."""
        with self._locked():
            return self._delete(self.kind(resource), name, namespace, grace_period_seconds,
                                propagation_policy, dry_run)

    def _delete(self, kind: Kind, name: str, namespace: str | None, grace: int | None,
                policy: str | None, dry_run: bool) -> tuple[Json, bool]:
        current = self._existing(kind, name, namespace)
        key = self._key(kind, name, namespace)
        policy = policy or kind.default_propagation
        if policy not in ("Orphan", "Background", "Foreground"):
            raise KubeError.invalid(kind, name, [{
                "reason": "FieldValueNotSupported", "field": "propagationPolicy",
                "message": f'Unsupported value: "{policy}": supported values: "Foreground", '
                           '"Background", "Orphan", "nil"'}])
        if dry_run:
            return copy.deepcopy(current), False
        meta = current["metadata"]
        if meta.get("deletionTimestamp"):
            if kind.resource == "pods" and grace == 0 and meta.get("deletionGracePeriodSeconds"):
                return self._finish(kind, key)
            return copy.deepcopy(current), False
        grace = self._grace(kind, current, grace)
        new = copy.deepcopy(current)
        new_meta = new["metadata"]
        # Orphan and Foreground go through a finalizer that the garbage collector removes once it
        # has orphaned or deleted the dependents; here it does so at once, in this call.
        gc_finalizer = {"Orphan": "orphan", "Foreground": "foregroundDeletion"}.get(policy)
        if gc_finalizer and gc_finalizer not in new_meta.get("finalizers", []):
            new_meta["finalizers"] = [*new_meta.get("finalizers", []), gc_finalizer]
        if not new_meta.get("finalizers") and grace == 0:
            self._remove(kind, key)
            return copy.deepcopy(current), True
        stamp = datetime.now(timezone.utc) + timedelta(seconds=grace)
        new_meta.update(deletionTimestamp=stamp.strftime("%Y-%m-%dT%H:%M:%SZ"),
                        deletionGracePeriodSeconds=grace)
        if kind.resource == "namespaces":
            new.setdefault("status", {})["phase"] = "Terminating"
        out = self._write(kind, current, new)
        if gc_finalizer == "orphan":
            self._orphan(meta["uid"])
            self._drop_finalizer(kind, key, "orphan")
        elif gc_finalizer:
            for dep_kind, dep in self._dependents(meta["uid"]):
                self._delete(dep_kind, dep["metadata"]["name"], dep["metadata"].get("namespace"),
                             None, "Foreground", False)
            self._release_foreground(meta["uid"])
        if grace > 0 and key in self._objects[kind.resource]:
            if self._terminator is None:
                return self._finish(kind, key)
            terminator = self._terminator
            self._after.append(lambda: terminator(copy.deepcopy(out)))
        return out, False  # the answer shows the object as it was when deletion began

    def _grace(self, kind: Kind, obj: Json, grace: int | None) -> int:
        """Only pods bound to a node and not yet terminal terminate gracefully."""
        if kind.resource != "pods":
            return 0
        spec, phase = obj.get("spec") or {}, (obj.get("status") or {}).get("phase")
        if not spec.get("nodeName") or phase in ("Succeeded", "Failed"):
            return 0
        if grace is None:
            grace = spec.get("terminationGracePeriodSeconds", DEFAULT_GRACE_S)
        return max(int(grace), 0)

    def _finish(self, kind: Kind, key: Key) -> tuple[Json, bool]:
        current = self._objects[kind.resource][key]
        new = copy.deepcopy(current)
        new["metadata"]["deletionGracePeriodSeconds"] = 0
        out = self._write(kind, current, new)
        return out, key not in self._objects[kind.resource]

    def bind(self, namespace: str, name: str, node: str) -> Json:
        """Assign a pod to a node, as the scheduler's Binding does (spec.nodeName, PodScheduled)."""
        with self._locked():
            kind = KINDS["pods"]
            current = self._existing(kind, name, namespace)
            if current["spec"].get("nodeName"):
                raise KubeError(409, "Conflict", f'Operation cannot be fulfilled on pods/binding "{name}": '
                                f'pod {name} is already assigned to node "{current["spec"]["nodeName"]}"',
                                {"name": name, "kind": "pods/binding"})
            new = copy.deepcopy(current)
            new["spec"]["nodeName"] = node
            conditions = [c for c in new["status"].get("conditions", []) if c["type"] != "PodScheduled"]
            new["status"]["conditions"] = [*conditions, {
                "type": "PodScheduled", "status": "True", "lastProbeTime": None,
                "lastTransitionTime": now_rfc3339()}]
            return self._write(kind, current, new)

    def finish_pod_deletion(self, namespace: str, name: str) -> None:
        """The kubelet's confirmation that a deleted pod's containers are gone: the pod goes
        (once its finalizers are gone too)."""
        with self._locked():
            kind = KINDS["pods"]
            key = self._key(kind, name, namespace)
            pod = self._existing(kind, name, namespace)
            if not pod["metadata"].get("deletionTimestamp"):
                raise KubeError.bad_request(f'pod "{name}" is not being deleted')
            self._finish(kind, key)

    def _remove(self, kind: Kind, key: Key) -> None:
        obj = self._objects[kind.resource].pop(key)
        obj["metadata"]["resourceVersion"] = self._next_rv()
        self._emit("DELETED", kind.resource, obj)
        uid = obj["metadata"]["uid"]
        if kind.resource == "namespaces":
            self._empty_namespace(key[1])
        if kind.resource == "customresourcedefinitions":
            for other in KINDS.values():
                if other.crd == key[1]:
                    for dep_key in list(self._objects[other.resource]):
                        self._remove(other, dep_key)
        for dep_kind, dep in self._dependents(uid):
            if not self._has_live_owner(dep, uid) and not dep["metadata"].get("deletionTimestamp"):
                self._delete(dep_kind, dep["metadata"]["name"], dep["metadata"].get("namespace"),
                             None, "Background", False)
        for ref in obj["metadata"].get("ownerReferences") or []:
            self._release_foreground(ref.get("uid", ""))

    def _empty_namespace(self, namespace: str) -> None:
        for kind in KINDS.values():
            for key in [k for k in self._objects[kind.resource] if k[0] == namespace]:
                if key in self._objects[kind.resource]:
                    self._remove(kind, key)

    def _all(self) -> Iterator[tuple[Kind, Json]]:
        for resource, objects in self._objects.items():
            for obj in list(objects.values()):
                yield KINDS[resource], obj

    def _dependents(self, uid: str) -> Owned:
        return [(kind, obj) for kind, obj in self._all()
                if any(ref.get("uid") == uid for ref in obj["metadata"].get("ownerReferences") or [])]

    def _has_live_owner(self, obj: Json, gone_uid: str) -> bool:
        uids = {o["metadata"]["uid"] for _, o in self._all()}
        return any(ref.get("uid") in uids for ref in obj["metadata"].get("ownerReferences") or []
                   if ref.get("uid") != gone_uid)

    def _orphan(self, uid: str) -> None:
        for kind, dep in self._dependents(uid):
            new = copy.deepcopy(dep)
            refs = [r for r in new["metadata"]["ownerReferences"] if r.get("uid") != uid]
            if refs:
                new["metadata"]["ownerReferences"] = refs
            else:
                del new["metadata"]["ownerReferences"]
            self._write(kind, dep, new)

    def _release_foreground(self, uid: str) -> None:
        """Drop an owner's foregroundDeletion finalizer once no blocking dependent is left."""
        owner = next(((k, o) for k, o in self._all() if o["metadata"]["uid"] == uid), None)
        if owner is None or "foregroundDeletion" not in owner[1]["metadata"].get("finalizers", []):
            return
        blocking = [d for _, d in self._dependents(uid) if any(
            r.get("uid") == uid and r.get("blockOwnerDeletion") for r in d["metadata"]["ownerReferences"])]
        if not blocking:
            kind, obj = owner
            self._drop_finalizer(kind, self._key(kind, obj["metadata"]["name"],
                                                 obj["metadata"].get("namespace")), "foregroundDeletion")

    def _drop_finalizer(self, kind: Kind, key: Key, finalizer: str) -> None:
        current = self._objects[kind.resource].get(key)
        if current is None or finalizer not in current["metadata"].get("finalizers", []):
            return
        new = copy.deepcopy(current)
        new["metadata"]["finalizers"] = [f for f in current["metadata"]["finalizers"] if f != finalizer]
        if not new["metadata"]["finalizers"]:
            del new["metadata"]["finalizers"]
        self._write(kind, current, new)

    # -- hooks for controllers and the kubelet --

    def subscribe(self, callback: Callable[[str, str, Json], None]) -> None:
        """Call ``callback(type, resource, object)`` after each change, outside the lock."""
        with self._lock:
            self._subscribers.append(callback)

    def register_pod_terminator(self, terminator: Callable[[Json], None]) -> None:
        """The kubelet's hook: called with a bound pod whose deletionTimestamp was just set."""
        with self._lock:
            self._terminator = terminator

    def record_event(self, involved_object: Json, reason: str, message: str, type: str = "Normal",
                     component: str = "fake-controller") -> Json:
        """A core/v1 Event about an object, as client-go's recorder writes it (repeats count up)."""
        meta = involved_object["metadata"]
        namespace = meta.get("namespace") or "default"
        with self._locked():
            for event in self._objects["events"].values():
                involved = event["involvedObject"]
                if (involved.get("uid"), event["reason"], event["message"], event["type"]) == \
                        (meta.get("uid"), reason, message, type):
                    bumped = copy.deepcopy(event)
                    bumped.update(count=event.get("count", 1) + 1, lastTimestamp=now_rfc3339())
                    return self._write(KINDS["events"], event, bumped)
            stamp = now_rfc3339()
            return self.create("events", {
                "metadata": {"name": f"{meta['name']}.{secrets.token_hex(8)}", "namespace": namespace},
                "involvedObject": {"kind": involved_object.get("kind"), "namespace": namespace,
                                   "name": meta["name"], "uid": meta.get("uid"),
                                   "apiVersion": involved_object.get("apiVersion"),
                                   "resourceVersion": meta.get("resourceVersion")},
                "reason": reason, "message": message, "type": type, "source": {"component": component},
                "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
                "reportingComponent": component, "reportingInstance": ""})

    def set_log_source(self, namespace: str, pod: str, container: str, path: Path | str,
                       previous: bool = False) -> None:
        """Serve ``path`` (a CRI-format log file) as this container's log (or its previous one)."""
        with self._lock:
            self._logs[(namespace, pod, container, previous)] = Path(path)

    def log_source(self, namespace: str, pod: str, container: str, previous: bool) -> Path | None:
        with self._lock:
            return self._logs.get((namespace, pod, container, previous))


def _mutable_pod_spec(pod: Json) -> Json:
    """A pod's spec without the fields an update may change (images, deadline, tolerations)."""
    spec = copy.deepcopy(pod.get("spec") or {})
    for key in ("activeDeadlineSeconds", "tolerations"):
        spec.pop(key, None)
    for container in spec.get("containers", []) + spec.get("initContainers", []):
        container.pop("image", None)
    return spec


def qos_class(pod: Json) -> str:
    """Guaranteed when every container's requests equal its cpu and memory limits, BestEffort
    when no container asks for anything, Burstable otherwise."""
    resources = [c.get("resources") or {} for c in pod["spec"].get("containers", [])]
    if not any(r.get("requests") or r.get("limits") for r in resources):
        return "BestEffort"
    for r in resources:
        limits = r.get("limits") or {}
        if not {"cpu", "memory"} <= limits.keys() or any(
                limits.get(k) != v for k, v in (r.get("requests") or {}).items()):
            return "Burstable"
    return "Guaranteed"


def _spec_of(obj: Json) -> Json:
    return {k: v for k, v in obj.items() if k not in ("metadata", "status", "apiVersion", "kind")}


def _deletion_complete(obj: Json) -> bool:
    meta = obj["metadata"]
    return bool(meta.get("deletionTimestamp")) and not meta.get("finalizers") \
        and not meta.get("deletionGracePeriodSeconds")


CONTINUE_EXPIRED = ("The provided continue parameter is too old to display a consistent list result. "
                    "You can start a new list without the continue parameter, or use the continue "
                    "token in this response to retrieve the remainder of the results. Continuing with "
                    "the provided token results in an inconsistent list - objects that were created, "
                    "modified, or deleted between the time the first chunk was returned and now may "
                    "show up in the list.")


def encode_continue(rv: int, start: str) -> str:
    raw = json.dumps({"v": "meta.k8s.io/v1", "rv": rv, "start": start})
    return base64.urlsafe_b64encode(raw.encode()).decode()


def decode_continue(token: str) -> tuple[int, str]:
    try:
        data = json.loads(base64.urlsafe_b64decode(token.encode()))
        return int(data["rv"]), str(data["start"])
    except (ValueError, KeyError, TypeError) as error:
        raise KubeError.bad_request(f"continue key is not valid: {error}") from error


def apply_defaults(kind: Kind, obj: Json) -> None:
    """The defaults the real API server fills in that clients read back."""
    meta = obj["metadata"]
    if kind.resource == "namespaces":
        meta.setdefault("labels", {})["kubernetes.io/metadata.name"] = meta["name"]
        obj.setdefault("spec", {"finalizers": ["kubernetes"]})
        obj.setdefault("status", {"phase": "Active"})
    elif kind.resource == "pods":
        spec = obj["spec"]
        for key, value in (("restartPolicy", "Always"), ("terminationGracePeriodSeconds", 30),
                           ("dnsPolicy", "ClusterFirst"), ("schedulerName", "default-scheduler"),
                           ("serviceAccountName", "default"), ("enableServiceLinks", True)):
            spec.setdefault(key, value)
        obj.setdefault("status", {"phase": "Pending", "qosClass": qos_class(obj)})
    elif kind.resource == "secrets":
        obj.setdefault("type", "Opaque")
        for key, value in (obj.pop("stringData", None) or {}).items():
            obj.setdefault("data", {})[key] = base64.b64encode(value.encode()).decode()
    elif kind.resource == "jobs":
        _default_job(obj)
        obj.setdefault("status", {})
    elif kind.resource == "services":
        obj.setdefault("spec", {}).setdefault("type", "ClusterIP")
        obj["spec"].setdefault("sessionAffinity", "None")
        obj.setdefault("status", {"loadBalancer": {}})
    elif kind.resource == "persistentvolumeclaims":
        obj.setdefault("status", {"phase": "Pending"})
    elif kind.resource == "customresourcedefinitions":
        # what the apiextensions controllers report once they accept a CRD
        storage = [v["name"] for v in obj["spec"].get("versions", []) if v.get("storage")]
        obj.setdefault("status", {"acceptedNames": obj["spec"].get("names", {}), "storedVersions": storage,
                                  "conditions": [{"type": "NamesAccepted", "status": "True"},
                                                 {"type": "Established", "status": "True"}]})


def _default_job(job: Json) -> None:
    spec, uid = job["spec"], job["metadata"]["uid"]
    for key, value in (("parallelism", 1), ("completions", 1), ("backoffLimit", 6),
                       ("completionMode", "NonIndexed"), ("suspend", False),
                       ("podReplacementPolicy", "TerminatingOrFailed"), ("manualSelector", None)):
        if value is not None:
            spec.setdefault(key, value)
    labels = {"batch.kubernetes.io/controller-uid": uid, "batch.kubernetes.io/job-name":
              job["metadata"]["name"], "controller-uid": uid, "job-name": job["metadata"]["name"]}
    spec.setdefault("selector", {"matchLabels": {"batch.kubernetes.io/controller-uid": uid}})
    template_meta = spec["template"].setdefault("metadata", {})
    template_meta["labels"] = {**(template_meta.get("labels") or {}), **labels}


def kueue_crd_objects() -> list[Json]:
    """Minimal CRD objects for Kueue's LocalQueue and Workload (kueue.x-k8s.io/v1beta1)."""
    return [{"metadata": {"name": f"{plural}.kueue.x-k8s.io"},
             "spec": {"group": "kueue.x-k8s.io", "scope": "Namespaced",
                      "names": {"plural": plural, "singular": plural[:-1], "kind": kind,
                                "listKind": f"{kind}List"},
                      "versions": [{"name": "v1beta1", "served": True, "storage": True,
                                    "schema": {"openAPIV3Schema": {
                                        "type": "object",
                                        "x-kubernetes-preserve-unknown-fields": True}},
                                    "subresources": {"status": {}}}]}}
            for plural, kind in (("localqueues", "LocalQueue"), ("workloads", "Workload"))]


def jobset_crd_object() -> Json:
    """A minimal CRD object for JobSet, enough for a client that checks that it is installed."""
    return {"metadata": {"name": JOBSET_CRD},
            "spec": {"group": "jobset.x-k8s.io", "scope": "Namespaced",
                     "names": {"plural": "jobsets", "singular": "jobset", "kind": "JobSet",
                               "listKind": "JobSetList"},
                     "versions": [{"name": "v1alpha2", "served": True, "storage": True,
                                   "schema": {"openAPIV3Schema": {
                                       "type": "object", "x-kubernetes-preserve-unknown-fields": True}},
                                   "subresources": {"status": {}}}]}}


# --- pod logs ---------------------------------------------------------------------------------


CRI_LINE = re.compile(r"^(\S+) (stdout|stderr) ([FP]) ?(.*)$")


def parse_timestamp(value: str) -> datetime:
    """RFC 3339 with up to nanoseconds (Python keeps microseconds)."""
    match = re.match(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)$", value)
    if not match:
        raise ValueError(f"not an RFC 3339 time: {value!r}")
    fraction = (match.group(2) or ".0")[:7]
    zone = "+00:00" if match.group(3) == "Z" else match.group(3)
    return datetime.fromisoformat(match.group(1) + fraction + zone)


def read_log_lines(path: Path, offset: int) -> tuple[LogLines, int]:
    """Whole log lines (timestamp, text with its newline) from byte ``offset``, and the offset
    after the last whole line: P (partial) chunks join the next chunks up to an F one."""
    try:
        with path.open("rb") as handle:
            handle.seek(offset)
            data = handle.read()
    except FileNotFoundError:
        return [], offset
    lines: LogLines = []
    pending, stamp, position, consumed = "", "", 0, 0
    for raw in data.split(b"\n")[:-1]:
        position += len(raw) + 1
        match = CRI_LINE.match(raw.decode("utf-8", errors="replace"))
        if match is None:
            continue
        stamp = stamp or match.group(1)
        pending += match.group(4)
        if match.group(3) == "F":
            lines.append((stamp, pending + "\n"))
            pending, stamp, consumed = "", "", position
    return lines, offset + consumed


# --- HTTP -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    """One API call, as the request log keeps it."""

    method: str
    path: str
    query: str
    time: float
    verb: str = ""
    resource: str = ""


@dataclass
class _Failure:
    verb: str
    resource: str
    code: int
    remaining: int
    retry_after: int | None


FAILURES = {
    500: ("InternalError", "Internal error occurred: injected failure"),
    503: ("ServiceUnavailable", "the server is currently unable to handle the request"),
    429: ("TooManyRequests", "too many requests, please try again later"),
    504: ("Timeout", "the server was unable to return a response in the time allotted, but may still "
                     "be processing the request"),
}


@dataclass
class Route:
    """A parsed API path."""

    kind: Kind
    namespace: str | None
    name: str | None
    subresource: str | None


class FakeKube:
    """The fake API server: a ``Store`` behind an HTTP server, with failure switches."""

    def __init__(self, address: tuple[str, int] = ("127.0.0.1", 0), *, jobset_crd: bool = True,
                 history: int = 1000, bookmark_interval_s: float = 1.0, user: str = "alice",
                 log_poll_s: float = 0.05, kubelet_dial_s: float = 1.0) -> None:
        self.store = Store(history=history, jobset_crd=jobset_crd)
        self.token = secrets.token_urlsafe(24)
        self.user = user
        # The real server sends a bookmark about once a minute; tests want them sooner.
        self.bookmark_interval_s = bookmark_interval_s
        self.log_poll_s = log_poll_s
        # How long the server tries to reach a dead node's kubelet before it answers 500 (the
        # real kubelet client's dial timeout is 30 s; "no route to host" comes sooner).
        self.kubelet_dial_s = kubelet_dial_s
        self._dead_kubelets: dict[str, str] = {}  # node -> the address the server dials
        self.requests: list[Request] = []
        self._address = address
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._failures: list[_Failure] = []
        self._forbidden: set[tuple[str, str, str | None]] = set()
        self._closing = threading.Event()

    # -- kubelets --

    def kubelet_down(self, node: str, address: str) -> None:
        """The node's kubelet stops answering: a pod log request for a pod bound to it waits
        ``kubelet_dial_s`` and fails with 500, as the real server's proxy to the kubelet does."""
        with self._lock:
            self._dead_kubelets[node] = address

    def kubelet_up(self, node: str) -> None:
        with self._lock:
            self._dead_kubelets.pop(node, None)

    def dial_kubelet(self, node: str, path: str) -> None:
        """Raises what the server answers when it cannot reach ``node``'s kubelet for
        ``path`` (e.g. ``/containerLogs/NS/POD/C``): an error that is not an API status, so
        500 with no reason and the Go error as the message."""
        with self._lock:
            address = self._dead_kubelets.get(node)
        if address is None:
            return
        time.sleep(self.kubelet_dial_s)
        raise KubeError(500, "", f'Get "https://{address}:10250{path}": dial tcp {address}:10250: '
                                 "i/o timeout")

    # -- lifecycle --

    def start(self) -> FakeKube:
        handler = type("Handler", (_Handler,), {"fake": self})
        self._server = ThreadingHTTPServer(self._address, handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),
                                        daemon=True, name="fake-kube")
        self._thread.start()
        return self

    def close(self) -> None:
        self._closing.set()
        self.store.end_watches()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FakeKube:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def url(self) -> str:
        assert self._server is not None, "start() the fake first"
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def configuration(self) -> client.Configuration:
        config = client.Configuration(host=self.url)
        config.api_key = {"BearerToken": self.token}
        config.api_key_prefix = {"BearerToken": "Bearer"}
        return config

    def write_kubeconfig(self, path: Path | str, context: str = "fake", namespace: str = "default"
                         ) -> Path:
        config = {"apiVersion": "v1", "kind": "Config", "current-context": context,
                  "clusters": [{"name": f"{context}-cluster", "cluster": {"server": self.url}}],
                  "users": [{"name": f"{context}-user", "user": {"token": self.token}}],
                  "contexts": [{"name": context, "context": {
                      "cluster": f"{context}-cluster", "user": f"{context}-user",
                      "namespace": namespace}}]}
        Path(path).write_text(yaml.safe_dump(config))
        return Path(path)

    # -- switches --

    def fail_next(self, verb: str, resource: str, code: int, times: int = 1,
                  retry_after: int | None = None) -> None:
        """The next ``times`` requests ``verb`` on ``resource`` ("pods", "pods/log") fail with
        ``code``; 429 carries ``Retry-After`` (1 s unless ``retry_after`` says otherwise)."""
        if retry_after is None and code == 429:
            retry_after = 1
        with self._lock:
            self._failures.append(_Failure(verb, resource, code, times, retry_after))

    def drop_watches(self, abrupt: bool = False) -> None:
        """End every open watch: cleanly (the last chunk, as a server ending a watch does), or
        ``abrupt``ly (the connection is cut mid-stream)."""
        self.store.end_watches("abrupt" if abrupt else "end")

    def compact(self) -> None:
        self.store.compact()

    def forbid(self, verb: str, resource: str, namespace: str | None = None) -> None:
        """Deny ``verb`` on ``resource`` (in ``namespace``, or everywhere) to the fake's user."""
        with self._lock:
            self._forbidden.add((verb, resource, namespace))

    def allow(self, verb: str, resource: str, namespace: str | None = None) -> None:
        with self._lock:
            self._forbidden.discard((verb, resource, namespace))

    def allowed(self, verb: str, resource: str, namespace: str | None) -> bool:
        """Whether the fake's RBAC lets its user do this ("*" in a rule matches any verb or resource)."""
        asked = {(v, r, n) for v in (verb, "*") for r in (resource, "*") for n in (namespace or None, None)}
        with self._lock:
            return not (asked & self._forbidden)

    def calls(self, verb: str | None = None, resource: str | None = None) -> list[Request]:
        with self._lock:
            return [r for r in self.requests if (verb is None or r.verb == verb)
                    and (resource is None or r.resource == resource)]

    def _log(self, entry: Request) -> None:
        with self._lock:
            self.requests.append(entry)

    def _take_failure(self, verb: str, resource: str) -> KubeError | None:
        with self._lock:
            for failure in self._failures:
                if failure.verb == verb and failure.resource == resource and failure.remaining > 0:
                    failure.remaining -= 1
                    reason, message = FAILURES.get(failure.code, ("InternalError", "injected failure"))
                    details: Json = {}
                    headers = {}
                    if failure.retry_after is not None:
                        details["retryAfterSeconds"] = failure.retry_after
                        headers["Retry-After"] = str(failure.retry_after)
                    if failure.code == 500:
                        details["causes"] = [{"message": "injected failure"}]
                    return KubeError(failure.code, reason, message, details, headers)
        return None

    def forbidden(self, verb: str, kind: Kind, resource: str, namespace: str | None,
                  name: str | None) -> KubeError:
        subject = f'{kind.qualified} "{name}"' if name else kind.qualified
        scope = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
        details: Json = {"name": name} if name else {}
        if kind.group:
            details["group"] = kind.group
        details["kind"] = resource
        return KubeError(403, "Forbidden", f'{subject} is forbidden: User "{self.user}" cannot {verb} '
                         f'resource "{resource}" in API group "{kind.group}" {scope}', details)


class PageNotFound(Exception):
    """A path no API group serves: the real server answers a plain-text 404."""


def parse_path(store: Store, path: str) -> Route | None:
    """Route an API path; None for the discovery documents of a group version."""
    parts = [p for p in path.split("/") if p]
    if parts[:2] == ["api", "v1"]:
        group_version, rest = "v1", parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 3:
        group_version, rest = f"{parts[1]}/{parts[2]}", parts[3:]
    else:
        raise PageNotFound(path)
    if group_version not in GROUP_VERSIONS or not _crd_installed(
            store, GROUP_VERSIONS[group_version]):
        raise PageNotFound(path)
    if not rest:
        return None
    namespace = None
    if rest[0] == "namespaces" and len(rest) >= 3 and rest[2] not in ("status", "finalize"):
        namespace, rest = rest[1], rest[2:]
    kind = KINDS.get(rest[0])
    if kind is None or kind.api_version != group_version or len(rest) > 3 or (
            namespace is not None and not kind.namespaced):
        raise KubeError(404, "NotFound", "the server could not find the requested resource", {})
    name = rest[1] if len(rest) > 1 else None
    sub = rest[2] if len(rest) > 2 else None
    if sub and not ((sub == "status" and kind.status) or (
            sub in ("log", "binding") and kind.resource == "pods")):
        raise KubeError(404, "NotFound", "the server could not find the requested resource", {})
    if kind.namespaced and name is not None and namespace is None:
        raise KubeError(404, "NotFound", "the server could not find the requested resource", {})
    return Route(kind, namespace, name, sub)


def _crd_installed(store: Store, group: str = "jobset.x-k8s.io") -> bool:
    """Whether a CRD of ``group`` is installed (a custom group is served only then)."""
    crds = [k.crd for k in KINDS.values() if k.crd and k.group == group]
    for crd in crds:
        try:
            store.get("customresourcedefinitions", crd)
        except KubeError:
            continue
        return True
    return not crds


def _flag(query: dict[str, str], name: str) -> bool:
    return query.get(name, "").lower() in ("true", "1")


class _Handler(BaseHTTPRequestHandler):
    fake: FakeKube
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in two writes: without this, Nagle's algorithm holds the body
        # until the client's delayed ACK (40 ms a request). Go's server sets it too.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def handle(self) -> None:
        with contextlib.suppress(ConnectionError):  # a pooled connection dropped between requests
            super().handle()

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: the request log is ``FakeKube.requests``."""

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_PUT(self) -> None:
        self._serve("PUT")

    def do_PATCH(self) -> None:
        self._serve("PATCH")

    def do_DELETE(self) -> None:
        self._serve("DELETE")

    def do_OPTIONS(self) -> None:
        self._serve("OPTIONS")

    # -- plumbing --

    def _serve(self, method: str) -> None:
        split = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(split.query, keep_blank_values=True).items()}
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        entry = Request(method, split.path, split.query, time.time())
        try:
            if self.headers.get("Authorization") != f"Bearer {self.fake.token}":
                self.fake._log(entry)
                raise KubeError(401, "Unauthorized", "Unauthorized")
            self._dispatch(method, split.path, query, raw, entry)
        except KubeError as error:
            self._json(error.code, error.status, error.headers)
        except PageNotFound:
            self._text(404, "404 page not found\n")
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as error:  # a bug here or in a subscriber: the client sees a 500
            body = status_body(500, "InternalError", f"Internal error occurred: {error!r}")
            self._json(500, body)
            raise

    def _json(self, code: int, body: Json, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def _text(self, code: int, text: str) -> None:
        data = text.encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _start_chunked(self, content_type: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.close_connection = True

    def _chunk(self, data: bytes) -> None:
        if data:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

    def _end_chunked(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _body(self, raw: bytes) -> Any:
        try:
            return json.loads(raw or b"{}")
        except json.JSONDecodeError as error:
            raise KubeError.bad_request(f"json: {error}") from error

    # -- dispatch --

    def _dispatch(self, method: str, path: str, query: dict[str, str], raw: bytes,
                  entry: Request) -> None:
        store = self.fake.store
        discovery = self._discovery(path)
        if discovery is not None:
            self.fake._log(entry)
            self._json(200, discovery)
            return
        try:
            route = parse_path(store, path)
        except (KubeError, PageNotFound):
            self.fake._log(entry)
            raise
        if route is None:
            self.fake._log(entry)
            self._json(200, self._resource_list(path))
            return
        verb = self._verb(method, route, query)
        resource = route.kind.resource + (f"/{route.subresource}" if route.subresource else "")
        self.fake._log(Request(method, path, entry.query, entry.time, verb, resource))
        if verb == "":
            raise KubeError(405, "MethodNotAllowed",
                            "the server does not allow this method on the requested resource")
        if not self.fake.allowed(verb, resource, route.namespace):
            raise self.fake.forbidden(verb, route.kind, resource, route.namespace, route.name)
        failure = self.fake._take_failure(verb, resource)
        if failure is not None:
            raise failure
        getattr(self, f"_do_{verb}")(route, query, raw)

    @staticmethod
    def _verb(method: str, route: Route, query: dict[str, str]) -> str:
        if route.kind.resource == "selfsubjectaccessreviews":
            return "create" if method == "POST" and route.name is None else ""
        collection = route.name is None
        if method == "GET":
            if collection:
                return "watch" if _flag(query, "watch") else "list"
            return "get"
        if route.subresource == "log":
            return ""
        if route.subresource == "binding":
            return "create" if method == "POST" else ""
        verbs = {("POST", True): "create", ("PUT", False): "update", ("PATCH", False): "patch",
                 ("DELETE", False): "delete", ("DELETE", True): "deletecollection"}
        verb = verbs.get((method, collection), "")
        return "" if verb in ("create", "deletecollection") and route.namespace is None \
            and route.kind.namespaced else verb

    def _discovery(self, path: str) -> Json | None:
        path = path.rstrip("/")
        if path == "/version":
            return {"major": "1", "minor": "33", "gitVersion": "v1.33.0-fake", "gitCommit": "fake",
                    "gitTreeState": "clean", "buildDate": "2026-01-01T00:00:00Z",
                    "goVersion": "go1.24", "compiler": "gc", "platform": "linux/amd64"}
        if path == "/api":
            return {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": [
                {"clientCIDR": "0.0.0.0/0", "serverAddress": self.fake.url.split("//")[1]}]}
        if path == "/apis":
            groups = []
            for group_version, group in GROUP_VERSIONS.items():
                if group and _crd_installed(self.fake.store, group):
                    version = {"groupVersion": group_version, "version": group_version.split("/")[1]}
                    groups.append({"name": group, "versions": [version], "preferredVersion": version})
            return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}
        return None

    @staticmethod
    def _resource_list(path: str) -> Json:
        parts = [p for p in path.split("/") if p]
        group_version = "v1" if parts[0] == "api" else f"{parts[1]}/{parts[2]}"
        resources: list[Json] = []
        for kind in KINDS.values():
            if kind.api_version != group_version:
                continue
            verbs = ["create"] if kind.resource == "selfsubjectaccessreviews" else VERBS_ALL
            entry = {"name": kind.resource, "singularName": kind.kind.lower(), "namespaced":
                     kind.namespaced, "kind": kind.kind, "verbs": verbs}
            if kind.short_names:
                entry["shortNames"] = list(kind.short_names)
            resources.append(entry)
            if kind.status:
                resources.append({"name": f"{kind.resource}/status", "singularName": "",
                                  "namespaced": kind.namespaced, "kind": kind.kind,
                                  "verbs": ["get", "patch", "update"]})
            if kind.resource == "pods":
                resources.append({"name": "pods/log", "singularName": "", "namespaced": True,
                                  "kind": "Pod", "verbs": ["get"]})
                resources.append({"name": "pods/binding", "singularName": "", "namespaced": True,
                                  "kind": "Binding", "verbs": ["create"]})
        return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version,
                "resources": resources}

    # -- verbs --

    def _do_create(self, route: Route, query: dict[str, str], raw: bytes) -> None:
        body = self._body(raw)
        if not isinstance(body, dict):
            raise KubeError.bad_request("the object provided is unrecognized (must be of type "
                                        f"{route.kind.kind})")
        if body.get("kind") not in (None, route.kind.kind) and route.subresource is None:
            raise KubeError.bad_request(f"the object provided is unrecognized (must be of type "
                                        f"{route.kind.kind}): {body.get('kind')}")
        if route.kind.resource == "selfsubjectaccessreviews":
            self._json(201, self._review(body))
            return
        if route.subresource == "binding":
            assert route.name is not None and route.namespace is not None
            target = body.get("target") or {}
            if not target.get("name"):
                raise KubeError.invalid(KINDS["pods"], route.name, [_required("target.name")])
            self.fake.store.bind(route.namespace, route.name, target["name"])
            self._json(201, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                             "code": 201})
            return
        dry_run = query.get("dryRun") == "All"
        self._json(201, self.fake.store.create(route.kind.resource, body, route.namespace, dry_run))

    def _review(self, body: Json) -> Json:
        attributes = (body.get("spec") or {}).get("resourceAttributes") or {}
        resource = attributes.get("resource", "")
        if attributes.get("subresource"):
            resource += "/" + attributes["subresource"]
        allowed = self.fake.allowed(attributes.get("verb", ""), resource,
                                    attributes.get("namespace") or None)
        status: Json = {"allowed": allowed}
        # The real RBAC authorizer gives a reason when it allows and none when it denies; the fake
        # says which of its rules denied, to help whoever reads a failing test.
        status["reason"] = (f'RBAC: allowed by ClusterRoleBinding "fake-admin" of ClusterRole '
                            f'"cluster-admin" to User "{self.fake.user}"' if allowed else
                            "denied by the fake's forbid() rules")
        return {**body, "apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
                "metadata": {"creationTimestamp": None}, "status": status}

    def _do_get(self, route: Route, query: dict[str, str], raw: bytes) -> None:
        assert route.name is not None
        if route.subresource == "log":
            self._log_response(route, query)
            return
        self._json(200, self.fake.store.get(route.kind.resource, route.name, route.namespace))

    def _selection(self, route: Route, query: dict[str, str]) -> Filter:
        return Filter(route.namespace,
                      tuple(parse_label_selector(query.get("labelSelector"))),
                      tuple(parse_field_selector(route.kind, query.get("fieldSelector"))))

    def _do_list(self, route: Route, query: dict[str, str], raw: bytes) -> None:
        selection = self._selection(route, query)
        limit = int(query.get("limit") or 0)
        items, rv, token, rest = self.fake.store.list_page(
            route.kind.resource, selection, limit, query.get("continue"))
        meta: Json = {"resourceVersion": str(rv)}
        if token:
            meta.update({"continue": token, "remainingItemCount": rest})
        self._json(200, {"kind": f"{route.kind.kind}List", "apiVersion": route.kind.api_version,
                         "metadata": meta, "items": items})

    def _do_watch(self, route: Route, query: dict[str, str], raw: bytes) -> None:
        selection = self._selection(route, query)
        try:
            first, watcher = self.fake.store.watch(route.kind.resource, selection,
                                                   query.get("resourceVersion"))
        except KubeError as error:
            if error.code != 410:
                raise
            self._start_chunked("application/json")
            self._chunk(json.dumps({"type": "ERROR", "object": error.status}).encode() + b"\n")
            self._end_chunked()
            return
        try:
            self._stream_watch(route, query, first, watcher)
        finally:
            self.fake.store.unwatch(watcher)

    def _stream_watch(self, route: Route, query: dict[str, str], first: Events,
                      watcher: Watcher) -> None:
        timeout = float(query.get("timeoutSeconds") or 1800)
        deadline = time.monotonic() + timeout
        bookmarks = _flag(query, "allowWatchBookmarks")
        self._start_chunked("application/json")
        for type_, obj in first:
            self._event(type_, obj)
        next_bookmark = time.monotonic() + self.fake.bookmark_interval_s
        while True:
            now = time.monotonic()
            if now >= deadline:
                break
            wait = min(deadline, next_bookmark, now + CLIENT_CHECK_S) - now
            try:
                item = watcher.queue.get(timeout=max(wait, 0.001))
            except Empty:
                if self._client_gone():
                    return
                if bookmarks and time.monotonic() >= next_bookmark:
                    self._bookmark(route, watcher)
                    next_bookmark = time.monotonic() + self.fake.bookmark_interval_s
                continue
            if item == "abrupt":
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            if isinstance(item, str):
                break
            self._event(*item)
        self._end_chunked()

    def _client_gone(self) -> bool:
        """Whether the client closed the connection (it sends nothing else during a watch)."""
        readable, _, _ = select.select([self.connection], [], [], 0)
        if not readable:
            return False
        try:
            peeked: bytes = self.connection.recv(1, socket.MSG_PEEK)
        except OSError:
            return True
        return peeked == b""

    def _event(self, type_: str, obj: Json) -> None:
        self._chunk(json.dumps({"type": type_, "object": obj}).encode() + b"\n")

    def _bookmark(self, route: Route, watcher: Watcher) -> None:
        rv = self.fake.store.bookmark_rv(watcher)
        if rv is None:
            return
        self._event("BOOKMARK", {"kind": route.kind.kind, "apiVersion": route.kind.api_version,
                                 "metadata": {"resourceVersion": rv}})

    def _do_update(self, route: Route, query: dict[str, str], raw: bytes) -> None:
        assert route.name is not None
        body = self._body(raw)
        name = (body.get("metadata") or {}).get("name")
        if name != route.name:
            raise KubeError.bad_request(f"the name of the object ({name}) does not match the name on "
                                        f"the URL ({route.name})")
        self._json(200, self.fake.store.update(route.kind.resource, body, route.namespace,
                                               route.subresource, query.get("dryRun") == "All"))

    def _do_patch(self, route: Route, query: dict[str, str], raw: bytes) -> None:
        assert route.name is not None
        content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip()
        types = {"application/merge-patch+json": "merge", "application/strategic-merge-patch+json":
                 "merge", "application/json-patch+json": "json"}
        if content_type not in types:
            raise KubeError(415, "UnsupportedMediaType", f"the body of the request was in an unknown "
                            f"format - accepted media types include: {', '.join(types)}")
        self._json(200, self.fake.store.patch(
            route.kind.resource, route.name, self._body(raw), route.namespace, types[content_type],
            route.subresource, query.get("dryRun") == "All"))

    def _delete_options(self, query: dict[str, str], raw: bytes) -> tuple[int | None, str | None]:
        body = self._body(raw) if raw else {}
        grace = body.get("gracePeriodSeconds", query.get("gracePeriodSeconds"))
        policy = body.get("propagationPolicy", query.get("propagationPolicy"))
        orphan = body.get("orphanDependents", query.get("orphanDependents"))
        if policy is None and orphan is not None:
            policy = "Orphan" if str(orphan).lower() == "true" else "Background"
        return (None if grace is None else int(grace)), policy

    def _do_delete(self, route: Route, query: dict[str, str], raw: bytes) -> None:
        assert route.name is not None
        grace, policy = self._delete_options(query, raw)
        kind = route.kind
        obj, gone = self.fake.store.delete_with_outcome(
            kind.resource, route.name, route.namespace, grace, policy, query.get("dryRun") == "All")
        if not gone or kind.return_deleted:
            self._json(200, obj)
            return
        details = _details(kind, route.name)
        details["uid"] = obj["metadata"]["uid"]
        self._json(200, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                         "details": details})

    def _do_deletecollection(self, route: Route, query: dict[str, str], raw: bytes) -> None:
        grace, policy = self._delete_options(query, raw)
        store = self.fake.store
        items, rv, _, _ = store.list_page(route.kind.resource, self._selection(route, query), 0, None)
        for item in items:
            meta = item["metadata"]
            try:
                store.delete(route.kind.resource, meta["name"], meta.get("namespace"), grace, policy)
            except KubeError as error:
                if error.code != 404:
                    raise
        self._json(200, {"kind": f"{route.kind.kind}List", "apiVersion": route.kind.api_version,
                         "metadata": {"resourceVersion": str(rv)}, "items": items})

    # -- logs --

    def _log_response(self, route: Route, query: dict[str, str]) -> None:
        assert route.name is not None and route.namespace is not None
        store = self.fake.store
        pod = store.get("pods", route.name, route.namespace)
        container = self._log_container(pod, query.get("container"))
        previous = _flag(query, "previous")
        if not pod["spec"].get("nodeName"):
            self._text(200, "")  # the real server answers an unscheduled pod with an empty log
            return
        self.fake.dial_kubelet(pod["spec"]["nodeName"],
                               f"/containerLogs/{route.namespace}/{route.name}/{container}")
        if not previous:
            waiting = _container_state(pod, container).get("waiting")
            if waiting is not None:
                raise KubeError.bad_request(f'container "{container}" in pod "{route.name}" is waiting '
                                            f'to start: {waiting.get("reason", "ContainerCreating")}')
        source = store.log_source(route.namespace, route.name, container, previous)
        if previous and source is None:
            raise KubeError.bad_request(f'previous terminated container "{container}" in pod '
                                        f'"{route.name}" not found')
        options = LogOptions.from_query(query)
        if not _flag(query, "follow") or previous:
            lines, _ = read_log_lines(source, 0) if source else ([], 0)
            text = options.render(options.select(lines)).encode()
            self._text(200, text[:options.limit_bytes].decode(errors="ignore"))
            return
        self._follow_log(route, container, options)

    @staticmethod
    def _log_container(pod: Json, container: str | None) -> str:
        names: list[str] = [c["name"] for c in pod["spec"]["containers"]]
        name = pod["metadata"]["name"]
        if container is None:
            if len(names) == 1:
                return names[0]
            raise KubeError.bad_request(f"a container name must be specified for pod {name}, choose "
                                        f"one of: [{' '.join(names)}]")
        if container not in names:
            raise KubeError.bad_request(f"container {container} is not valid for pod {name}")
        return container

    def _follow_log(self, route: Route, container: str, options: LogOptions) -> None:
        assert route.name is not None and route.namespace is not None
        store = self.fake.store
        self._start_chunked("text/plain")
        offset, first, budget = 0, True, options.limit_bytes
        source: Path | None = None
        while not self.fake._closing.is_set():
            try:
                pod = store.get("pods", route.name, route.namespace)
                done = "terminated" in _container_state(pod, container)
                source = store.log_source(route.namespace, route.name, container, False)
            except KubeError:  # the pod went (a graceful deletion ends once its container has):
                done = True  # the kubelet still sends the file to its end, as for any exit
            lines, offset = read_log_lines(source, offset) if source else ([], offset)
            text = options.render(options.select(lines) if first else lines)
            first = first and not lines
            if budget is not None:
                text = text.encode()[:budget].decode(errors="ignore")
                budget -= len(text.encode())
            self._chunk(text.encode())
            if done or budget == 0:
                break
            time.sleep(self.fake.log_poll_s)
        self._end_chunked()


def _container_state(pod: Json, container: str) -> Json:
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") == container:
            return dict(status.get("state") or {})
    return {"waiting": {"reason": "ContainerCreating"}}


@dataclass
class LogOptions:
    """The query parameters of a log request that shape its body."""

    timestamps: bool = False
    since: datetime | None = None
    tail: int | None = None
    limit_bytes: int | None = None

    @classmethod
    def from_query(cls, query: dict[str, str]) -> LogOptions:
        since = None
        if query.get("sinceTime"):
            try:
                since = parse_timestamp(query["sinceTime"])
            except ValueError as error:
                raise KubeError.bad_request(str(error)) from error
        elif query.get("sinceSeconds"):
            since = datetime.now(timezone.utc) - timedelta(seconds=int(query["sinceSeconds"]))
        tail = int(query["tailLines"]) if query.get("tailLines") else None
        limit = int(query["limitBytes"]) if query.get("limitBytes") else None
        return cls(_flag(query, "timestamps"), since, tail, limit)

    def select(self, lines: LogLines) -> LogLines:
        if self.since is not None:
            since = self.since
            lines = [line for line in lines if parse_timestamp(line[0]) >= since]
        if self.tail is not None:
            lines = lines[-self.tail:] if self.tail else []
        return lines

    def render(self, lines: LogLines) -> str:
        return "".join(f"{stamp} {line}" if self.timestamps else line for stamp, line in lines)
