"""An HTTPS fake of Google Cloud Storage and an HTTP fake of GKE's metadata server (Workload
Identity), for TensorFlow's own GCS file system: ``tf.io.gfile`` on ``gs://`` URLs,
``tf.train.Checkpoint``/``CheckpointManager``/``latest_checkpoint``, SavedModels and Keras
``model.save("gs://...")``, unmodified, in pods of the pod lab (tests/podlab.py)::

    principals: dict[str, str] = {}  # pod IP -> Google service account
    with FakeGCS.start(pods.bridge_address, principals.get) as gcs:
        gcs.create_bucket("ckpt", writers=["trainer@proj.iam.gserviceaccount.com"])
        pod = pods.create_pod(PodRun(..., hosts_entries=gcs.hosts_entries(),
                                     mounts=gcs.pod_mounts()))
        principals[pod.ip] = "trainer@proj.iam.gserviceaccount.com"
        pod.start()
        ...
        assert "ckpt/checkpoint" in gcs.objects("ckpt")

TensorFlow's endpoints are hard-coded (xla/tsl/platform/cloud/gcs_file_system.cc): the JSON
API at ``https://www.googleapis.com/storage/v1/`` and ``.../upload/storage/v1/``, reads from
``https://storage.googleapis.com/<bucket>/<object>`` with a ``Range`` header, and the token from
``http://metadata.google.internal/computeMetadata/v1/instance/service-accounts/default/token``
(google_auth_provider.cc: after ``GOOGLE_AUTH_TOKEN_FOR_TESTING`` and the credential files of
``GOOGLE_APPLICATION_CREDENTIALS`` and ``$HOME/.config/gcloud``, none of which a pod here has).
So the fake listens where a pod resolves those names (``hosts_entries()``: the lab's bridge
address): HTTPS on port 443 with a certificate for www.googleapis.com and
storage.googleapis.com from a CA made at start, and HTTP on port 80 for the metadata server.
TF's statically linked curl reads its CAs from ``/etc/ssl/certs/ca-certificates.crt`` (unless
``CURL_CA_BUNDLE`` is set): ``pod_mounts()`` binds there a bundle of this machine's CAs plus the
test CA, standing in for an image's CA store that trusts Google's. No environment variable.

What TF 2.21 sends (seen from a pod running gfile, checkpoints, a SavedModel and a Keras save):
the token (once; TF keeps it until a minute before ``expires_in``); ``GET b/B`` (bucket roots,
from ``makedirs``); ``GET b/B/o/O?fields=size,generation,updated`` (stat, 200 or 404); ``GET
b/B/o?fields=items/name,nextPageToken&prefix=P`` with ``maxResults=1``/``2`` (folder checks) or
``pageToken`` (recursive listing, glob, rmtree, directory rename), and with ``prefixes`` and
``delimiter=/`` (listdir); ``GET b/B/storageLayout`` (before renaming a directory: is the bucket
hierarchical?); ``POST upload/.../o?uploadType=media&name=D/&ifGenerationMatch=0`` (directory
markers); ``POST upload/...?uploadType=resumable&name=O`` with ``X-Upload-Content-Length``,
then one ``PUT`` of the whole file (every flush and close uploads the file again); ``POST
.../rewriteTo/...`` then ``DELETE`` (rename); ``DELETE``; and reads ``GET
storage.googleapis.com/B/O`` with ``Range: bytes=a-b`` (206; 416 at the end of a file). TF
caches stats and folder checks for 5 s (``GCS_STAT_CACHE_MAX_AGE``): ``exists()`` just after
``rmtree()`` may still say yes, here as on GCS. A pod the metadata server does not know goes on
without a token (TF's fallback), so GCS answers it as the anonymous caller.

Modelled, with the real shapes (JSON error bodies ``{"error": {"code", "message", "errors":
[{"message", "domain": "global", "reason", ...}]}}``, pretty-printed as GCS does; XML ``<Error>``
bodies on the XML API host):

- the metadata server: the caller is identified by its source IP, as GKE's metadata server
  identifies pods (``identity(ip)``: the Google service account it acts as, None for a caller
  it does not know: 404). ``Metadata-Flavor: Google`` is required (403 without). It answers
  ``.../service-accounts/default/token`` with ``{"access_token", "expires_in", "token_type":
  "Bearer"}`` (an opaque token bound to that principal for an hour), ``.../email``,
  ``.../scopes``, ``.../aliases``, the account's directory (``?recursive=true`` as JSON),
  ``instance/service-accounts/``, ``project/project-id``, ``project/numeric-project-id`` and
  ``instance/zone``; every answer carries ``Metadata-Flavor: Google``.
- authentication and authorisation: no ``Authorization`` is the anonymous caller (401
  ``required``, "Anonymous caller does not have storage.objects.get access to the Google Cloud
  Storage object. ..."; 403 ``AccessDenied`` on the XML API); an unknown or expired token 401
  ``authError`` "Invalid Credentials"; a principal without the permission 403 ``forbidden``
  "<principal> does not have storage.objects.create access to the Google Cloud Storage object.
  Permission 'storage.objects.create' denied on resource (or it may not exist)." Checked in the
  real order: token, bucket (404 "The specified bucket does not exist."), permission, object.
  Permissions are per bucket and principal: ``writers`` get ``WRITER`` (roles/storage.objectAdmin
  plus ``storage.buckets.get``, which TF needs: ``makedirs`` and ``exists`` on a bucket's root
  read the bucket, and objectAdmin alone lacks it), ``readers`` ``READER`` (objectViewer plus
  ``storage.buckets.get``); ``grant`` sets any set. Overwriting an object needs
  ``storage.objects.delete`` as well as ``create``, as on GCS; ``storageLayout`` needs
  ``storage.objects.list``.
- JSON API: buckets ``get`` and ``getStorageLayout`` (flat namespace: no
  ``hierarchicalNamespace``); objects ``get`` (metadata, or the data with ``alt=media``),
  ``list`` (``prefix``, ``delimiter`` with ``prefixes``, ``includeTrailingDelimiter``,
  ``startOffset``/``endOffset``, ``maxResults`` and ``pageToken``/``nextPageToken``; a page holds
  at most ``page_size`` items and prefixes, 1000 as on GCS, and a test may lower it), ``delete``
  (204), ``rewriteTo`` (one call, ``done: true`` with ``resource``), ``copyTo``, ``compose``
  (TF's ``GCS_APPEND_MODE=compose`` body is written with single quotes, which GCS accepts, and
  so does the fake); ``fields=`` partial responses (``a,b/c,d(e,f)``). Object resources have
  the real fields: ``generation`` (microseconds, as GCS) and ``size`` as strings, ``updated`` and
  ``timeCreated`` in RFC 3339 with milliseconds, ``md5Hash`` and ``crc32c`` in base64, ``etag``,
  ``selfLink``, ``mediaLink``. Preconditions ``ifGenerationMatch`` (0: must not exist),
  ``ifGenerationNotMatch``, ``ifMetagenerationMatch``, ``ifMetagenerationNotMatch`` (and
  ``ifSourceGeneration*`` on copies, ``objectPrecondition`` in compose) fail with 412
  ``conditionNotMet``; TF's ``CreateDir`` relies on it (``uploadType=media`` with
  ``ifGenerationMatch=0``).
- uploads: ``uploadType=media`` and resumable sessions: the ``POST`` answers 200 with a
  ``Location`` (the session URI, on the host asked) and ``X-GUploader-UploadID``; ``PUT``s with
  ``Content-Range: bytes a-b/total`` (or ``/*``) append, a ``bytes */total`` status query and an
  incomplete upload answer 308 with ``Range: bytes=0-n`` (none before the first byte), the last
  byte creates the object (200 with its resource, 412 if a precondition of the session fails,
  400 if the total differs from ``X-Upload-Content-Length``). As on GCS the session URI is the
  credential: its ``PUT``s need no token.
- reads (the XML API's ``GET``/``HEAD https://storage.googleapis.com/<bucket>/<object>``, and the
  JSON API's ``alt=media`` and ``/download/storage/v1/...``): ``Range: bytes=a-b``, ``a-`` and
  ``-n`` give 206 with ``Content-Range``, a start at or past the end 416 ``InvalidRange``;
  ``x-goog-generation``, ``x-goog-metageneration``, ``x-goog-stored-content-length``,
  ``x-goog-hash`` (crc32c and md5) and ``ETag`` headers; ``generation=`` of another generation
  404.
- the log of what was asked (``requests``: server, method, host, path with query, status,
  principal, client address), for tests to assert on; a failure of the fake itself is answered
  500 ``backendError`` and its traceback kept in ``errors``.

Not modelled: object versioning (only the live generation exists: no ``versions=true``, no
noncurrent generations, no soft delete), bucket creation, listing and deletion through the API
(``create_bucket`` is the test's), IAM policies and ACLs as objects (``getIamPolicy``,
``testIamPermissions``, ``acl``, ``predefinedAcl``, public ``allUsers`` access, uniform bucket
access), conditions in IAM, per-prefix permissions, managed folders, hierarchical namespace
buckets (TF's ``renameTo/folders`` and operations), multipart and XML API uploads, object
``patch``/``update`` and custom metadata, ``Content-Encoding: gzip`` transcoding,
customer-supplied and KMS keys, retention and holds, requester pays, signed URLs, CORS, the
XML API beyond single-object reads (no bucket listing there), multi-call rewrites (every
rewrite is ``done`` at once: buckets have one storage class), rate limits, 429/503 and
transient failures (TF's retries are not exercised), upload session expiry (a week on GCS),
GCS's 403 instead of 404 for a missing object to a caller without ``storage.objects.list`` (the
fake answers 404 to any caller holding the permission asked for), the metadata server's
other paths (``identity`` tokens, ``attributes/``, ``network-interfaces/``, ``?wait_for_change``),
its link-local address 169.254.169.254 (google-auth's default probe; a pod resolves only the
name), GCE's refusal of ``X-Forwarded-For``, federated tokens for Kubernetes service accounts
that are not bound to a Google one (``identity`` decides the principal string), OAuth token
endpoints (``oauth2.googleapis.com``, ``www.googleapis.com/oauth2/v4/token``: credential files
are not supported), token scopes, and HTTP/2. The XML API's 401 code for a bad token
(``AuthenticationRequired``) is a best guess.
"""

from __future__ import annotations

import ast
import base64
import contextlib
import datetime
import hashlib
import ipaddress
import json
import re
import secrets
import shutil
import socket
import ssl
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit
from xml.sax.saxutils import escape

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from podlab import HostPath

JSON_API_HOST = "www.googleapis.com"
STORAGE_HOST = "storage.googleapis.com"
METADATA_HOST = "metadata.google.internal"
# TF's curl (statically linked, BoringSSL) reads its CAs from here unless CURL_CA_BUNDLE is set
# (third_party/curl.BUILD); Debian's bundle is at the same path
CA_BUNDLE_PATH = "/etc/ssl/certs/ca-certificates.crt"
TOKEN_LIFETIME_S = 3599  # what the metadata server says of a fresh token
MAX_PAGE = 1000  # GCS's largest list page
SCOPES = ("https://www.googleapis.com/auth/cloud-platform",
          "https://www.googleapis.com/auth/userinfo.email")

READER = frozenset({"storage.buckets.get", "storage.objects.get", "storage.objects.list"})
WRITER = READER | {"storage.objects.create", "storage.objects.delete", "storage.objects.update"}

Identity = Callable[[str], "str | None"]  # a caller's IP -> its principal (None: unknown)
Json = dict[str, Any]


@dataclass(frozen=True)
class Seen:
    """One request either server answered."""

    server: str  # "gcs" or "metadata"
    method: str
    host: str  # the Host header, without a port
    path: str  # path and query, as sent
    status: int
    principal: str | None  # the token's (gcs) or the caller's (metadata); None: anonymous
    client: str  # the caller's address


@dataclass
class _Object:
    data: bytes
    generation: int
    content_type: str
    created: float
    metageneration: int = 1
    md5: str = ""
    _crc32c: str | None = None

    def __post_init__(self) -> None:
        self.md5 = base64.b64encode(hashlib.md5(self.data).digest()).decode()

    @property
    def crc32c(self) -> str:
        if self._crc32c is None:  # computed once per generation: pure Python is slow
            self._crc32c = base64.b64encode(crc32c(self.data).to_bytes(4, "big")).decode()
        return self._crc32c


@dataclass
class _Bucket:
    name: str
    location: str
    created: float
    grants: dict[str, frozenset[str]] = field(default_factory=dict)
    objects: dict[str, _Object] = field(default_factory=dict)


@dataclass
class _Upload:
    bucket: str
    name: str
    expected: int | None  # X-Upload-Content-Length
    content_type: str
    preconditions: dict[str, str]
    data: bytearray = field(default_factory=bytearray)
    result: _Object | None = None


@dataclass
class _Response:
    status: int
    body: bytes = b""
    content_type: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    reason: str | None = None  # the status line's phrase, when not the standard one


class ApiError(Exception):
    """An error answer, rendered as the JSON API or the XML API does."""

    def __init__(self, status: int, message: str, reason: str, *, xml_code: str,
                 xml_message: str, xml_status: int | None = None,
                 extra: Mapping[str, str] | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status, self.message, self.reason = status, message, reason
        self.xml_code, self.xml_message = xml_code, xml_message
        self.xml_status = xml_status or status
        self.extra = dict(extra or {})
        self.headers = dict(headers or {})

    def render(self, xml: bool) -> _Response:
        if xml:
            body = ("<?xml version='1.0' encoding='UTF-8'?><Error>"
                    f"<Code>{escape(self.xml_code)}</Code><Message>{escape(self.xml_message)}"
                    f"</Message><Details>{escape(self.message)}</Details></Error>")
            return _Response(self.xml_status, body.encode(), "application/xml; charset=UTF-8",
                             dict(self.headers))
        error = {"message": self.message, "domain": "global", "reason": self.reason, **self.extra}
        document = {"error": {"code": self.status, "message": self.message, "errors": [error]}}
        return _Response(self.status, _json_bytes(document), "application/json; charset=UTF-8",
                         dict(self.headers))


# -- the errors GCS gives ------------------------------------------------------------------
def _no_object(bucket: str, name: str) -> ApiError:
    return ApiError(404, f"No such object: {bucket}/{name}", "notFound", xml_code="NoSuchKey",
                    xml_message="The specified key does not exist.")


def _no_bucket() -> ApiError:
    return ApiError(404, "The specified bucket does not exist.", "notFound",
                    xml_code="NoSuchBucket", xml_message="The specified bucket does not exist.")


def _denied(principal: str | None, permission: str) -> ApiError:
    what = "bucket" if permission.startswith("storage.buckets.") or permission in (
        "storage.objects.list",) else "object"
    who = principal if principal is not None else "Anonymous caller"
    message = (f"{who} does not have {permission} access to the Google Cloud Storage {what}. "
               f"Permission '{permission}' denied on resource (or it may not exist).")
    if principal is None:
        return ApiError(401, message, "required", xml_code="AccessDenied",
                        xml_message="Access denied.", xml_status=403,
                        extra={"locationType": "header", "location": "Authorization"},
                        headers={"WWW-Authenticate": 'Bearer realm="https://accounts.google.com/"'})
    return ApiError(403, message, "forbidden", xml_code="AccessDenied", xml_message="Access denied.")


def _invalid_credentials() -> ApiError:
    return ApiError(401, "Invalid Credentials", "authError", xml_code="AuthenticationRequired",
                    xml_message="Authentication required.",
                    extra={"locationType": "header", "location": "Authorization"},
                    headers={"WWW-Authenticate": 'Bearer realm="https://accounts.google.com/"'})


def _precondition_failed(location: str = "If-Match") -> ApiError:
    message = "At least one of the pre-conditions you specified did not hold."
    return ApiError(412, message, "conditionNotMet", xml_code="PreconditionFailed",
                    xml_message=message, extra={"locationType": "header", "location": location})


def _bad_request(message: str, reason: str = "invalid") -> ApiError:
    return ApiError(400, message, reason, xml_code="InvalidArgument", xml_message=message)


def _not_found_path() -> ApiError:
    return ApiError(404, "Not Found", "notFound", xml_code="NotFound", xml_message="Not Found")


def _unsatisfiable_range() -> ApiError:
    message = "The requested range cannot be satisfied."
    return ApiError(416, message, "requestedRangeNotSatisfiable", xml_code="InvalidRange",
                    xml_message=message)


# -- helpers ---------------------------------------------------------------------------------
def _json_bytes(document: Any) -> bytes:
    return (json.dumps(document, indent=2) + "\n").encode()


def rfc3339(t: float) -> str:
    """``2024-05-01T12:00:00.123Z``: GCS's timestamps (milliseconds, UTC)."""
    moment = datetime.datetime.fromtimestamp(t, datetime.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        crc = i
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_CRC32C_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), as GCS's ``crc32c`` field (big-endian, base64) holds it."""
    crc, table = 0xFFFFFFFF, _CRC32C_TABLE
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def parse_fields(spec: str) -> dict[str, Any]:
    """A ``fields=`` selector as a tree: name -> subtree, None for the whole value.
    ``items(name,size),nextPageToken`` and ``items/name,nextPageToken`` both work."""
    text = spec.replace(" ", "")
    pos = 0

    def merge(tree: dict[str, Any], name: str, sub: dict[str, Any] | None) -> None:
        if sub is None or (name in tree and tree[name] is None):
            tree[name] = None
        else:
            node = tree.setdefault(name, {})
            for key, value in sub.items():
                merge(node, key, value)

    def parse_list() -> dict[str, Any]:
        nonlocal pos
        tree: dict[str, Any] = {}
        while True:
            name, sub = parse_item()
            merge(tree, name, sub)
            if pos < len(text) and text[pos] == ",":
                pos += 1
                continue
            return tree

    def parse_item() -> tuple[str, dict[str, Any] | None]:
        nonlocal pos
        match = re.compile(r"[^,/()]+").match(text, pos)
        if match is None:
            raise _bad_request(f"Invalid field selection {spec}", "invalidParameter")
        pos = match.end()
        if pos < len(text) and text[pos] == "/":
            pos += 1
            name, sub = parse_item()
            return match.group(), {name: sub}
        if pos < len(text) and text[pos] == "(":
            pos += 1
            inner = parse_list()
            if pos >= len(text) or text[pos] != ")":
                raise _bad_request(f"Invalid field selection {spec}", "invalidParameter")
            pos += 1
            return match.group(), inner
        return match.group(), None

    tree = parse_list()
    if pos != len(text):
        raise _bad_request(f"Invalid field selection {spec}", "invalidParameter")
    return tree


def select_fields(value: Any, tree: dict[str, Any] | None) -> Any:
    """``value`` with only what the ``fields`` tree names (lists: each element)."""
    if tree is None:
        return value
    if isinstance(value, list):
        return [select_fields(item, tree) for item in value]
    if isinstance(value, dict):
        return {key: select_fields(value[key], sub) for key, sub in tree.items() if key in value}
    return value


def _lenient_json(body: bytes) -> Any:
    """JSON, or the single-quoted JSON that GCS's parser also accepts (TF's compose body)."""
    text = body.decode("utf-8", errors="replace")
    try:
        return json.loads(text)
    except ValueError:
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError) as exc:
            raise _bad_request("Parse Error", "parseError") from exc


def _make_tls(directory: Path, address: str) -> tuple[ssl.SSLContext, bytes]:
    """A CA made now and a server certificate from it for GCS's host names (and
    ``address``); returns the server's context and the CA's PEM."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "orchestrate tests"),
                         x509.NameAttribute(NameOID.COMMON_NAME, "fake_gcs test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(hours=1))
          .not_valid_after(now + datetime.timedelta(days=7))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, key_cert_sign=True, crl_sign=True,
                                       encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                         critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.DNSName(JSON_API_HOST), x509.DNSName(STORAGE_HOST)]
    with contextlib.suppress(ValueError):
        names.append(x509.IPAddress(ipaddress.ip_address(address)))
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, JSON_API_HOST)]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=7))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    ca_pem = ca.public_bytes(serialization.Encoding.PEM)
    chain = directory / "server.pem"
    chain.write_bytes(cert.public_bytes(serialization.Encoding.PEM) + ca_pem)
    key_file = directory / "server.key"
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(chain, key_file)
    return context, ca_pem


# -- the servers ---------------------------------------------------------------------------
class _Server(ThreadingHTTPServer):
    """One thread per connection, joined by ``server_close``; TLS when given a context (the
    handshake runs in the connection's thread)."""

    daemon_threads = False
    block_on_close = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 fake: FakeGCS, tls: ssl.SSLContext | None) -> None:
        self.fake = fake
        self.tls = tls
        self.connections: set[socket.socket] = set()
        self.connections_lock = threading.Lock()
        super().__init__(address, handler)

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, client = super().get_request()
        if self.tls is not None:
            sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, client

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Quiet: a client that hangs up or refuses the certificate is not the fake's error."""

    def close_connections(self) -> None:
        with self.connections_lock:
            connections = list(self.connections)
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 60
    server: _Server
    server_name = "gcs"

    def setup(self) -> None:
        with self.server.connections_lock:
            self.server.connections.add(self.request)
        try:
            self.request.settimeout(self.timeout)
            if isinstance(self.request, ssl.SSLSocket):
                self.request.do_handshake()
            super().setup()
        except BaseException:
            with self.server.connections_lock:
                self.server.connections.discard(self.request)
            raise

    def finish(self) -> None:
        with contextlib.suppress(OSError):
            super().finish()
        with self.server.connections_lock:
            self.server.connections.discard(self.request)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: ``FakeGCS.requests`` is the log."""

    def version_string(self) -> str:
        return self.server_version

    def do_GET(self) -> None:
        self._serve("GET")

    def do_HEAD(self) -> None:
        self._serve("HEAD")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_PUT(self) -> None:
        self._serve("PUT")

    def do_DELETE(self) -> None:
        self._serve("DELETE")

    def do_PATCH(self) -> None:
        self._serve("PATCH")

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(self.rfile.readline(65537).split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline(65537)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def _serve(self, method: str) -> None:
        body = self._body()
        host = (self.headers.get("Host") or "").rsplit(":", 1)[0].strip("[]").lower()
        principal: list[str | None] = [None]
        try:
            response = self._answer(method, host, body, principal)
        except Exception:  # a bug of the fake: say so, to the client and in ``errors``
            trace = traceback.format_exc()
            self.server.fake._record_error(trace)
            response = ApiError(500, f"Internal Error (the fake's): {trace}", "backendError",
                                xml_code="InternalError",
                                xml_message="We encountered an internal error.").render(False)
        self.send_response(response.status, response.reason)
        for name, value in response.headers.items():
            self.send_header(name, value)
        if response.content_type:
            self.send_header("Content-Type", response.content_type)
        self.send_header("Content-Length", str(len(response.body)))
        self.end_headers()
        if method != "HEAD" and response.body:
            self.wfile.write(response.body)
        self.server.fake._record(Seen(self.server_name, method, host, self.path, response.status,
                                      principal[0], self.client_address[0]))

    def _answer(self, method: str, host: str, body: bytes,
                principal: list[str | None]) -> _Response:
        raise NotImplementedError


class _GcsHandler(_Handler):
    server_name = "gcs"
    server_version = "UploadServer"

    def _answer(self, method: str, host: str, body: bytes,
                principal: list[str | None]) -> _Response:
        split = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(split.query, keep_blank_values=True).items()}
        xml = not split.path.startswith(("/storage/v1/", "/upload/storage/v1/",
                                         "/download/storage/v1/"))
        try:
            if xml and host == JSON_API_HOST:
                raise _not_found_path()
            return self.server.fake._gcs(method, host, split.path, query, self.headers, body,
                                         principal)
        except ApiError as error:
            return error.render(xml)


class _MetadataHandler(_Handler):
    server_name = "metadata"
    server_version = "GKE Metadata Server"

    def _answer(self, method: str, host: str, body: bytes,
                principal: list[str | None]) -> _Response:
        return self.server.fake._metadata(method, self.path, self.headers,
                                          self.client_address[0], principal)


# -- the fake --------------------------------------------------------------------------------
class FakeGCS:
    """GCS and GKE's metadata server for pods; see the module docstring."""

    def __init__(self, address: str, identity: Identity, *, gcs_port: int = 443,
                 metadata_port: int = 80, project_id: str = "fake-project",
                 project_number: int = 123456789012, zone: str = "us-central1-a") -> None:
        self.address = address
        self.identity = identity
        self.project_id, self.project_number, self.zone = project_id, project_number, zone
        self.page_size = MAX_PAGE
        self.requests: list[Seen] = []
        self.errors: list[str] = []  # tracebacks of the fake's own failures (answered 500)
        self._lock = threading.RLock()
        self._buckets: dict[str, _Bucket] = {}
        self._tokens: dict[str, tuple[str, float]] = {}  # token -> (principal, expiry)
        self._uploads: dict[str, _Upload] = {}
        self._last_generation = 0
        self._closed = False
        self._threads: list[threading.Thread] = []
        self._servers: list[_Server] = []
        self._serving: list[_Server] = []
        self.dir = Path(tempfile.mkdtemp(prefix="fake-gcs-"))
        try:
            tls, self.ca_pem = _make_tls(self.dir, address)
            self.ca_bundle = self.dir / "ca-certificates.crt"
            system = Path(CA_BUNDLE_PATH)
            system_pem = system.read_bytes() if system.is_file() else b""
            self.ca_bundle.write_bytes(system_pem.rstrip(b"\n") + b"\n" + self.ca_pem)
            self.ca_bundle.chmod(0o644)  # a pod's plain user reads it (the shim binds it as root)
            self._gcs_server = _Server((address, gcs_port), _GcsHandler, self, tls)
            self._servers.append(self._gcs_server)
            self._metadata_server = _Server((address, metadata_port), _MetadataHandler, self, None)
            self._servers.append(self._metadata_server)
        except BaseException:
            self.close()
            raise
        for server in self._servers:
            thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1},
                                      name=f"fake-gcs {server.server_address}", daemon=True)
            thread.start()
            self._serving.append(server)
            self._threads.append(thread)

    @classmethod
    def start(cls, address: str, identity: Identity, *, gcs_port: int = 443,
              metadata_port: int = 80, project_id: str = "fake-project",
              project_number: int = 123456789012, zone: str = "us-central1-a") -> FakeGCS:
        """Serve GCS on ``address``:443 (HTTPS) and the metadata server on ``address``:80
        (``gcs_port``/``metadata_port`` change them: 0 picks free ones); ``identity(ip)``
        is the principal of a caller of the metadata server."""
        return cls(address, identity, gcs_port=gcs_port, metadata_port=metadata_port,
                   project_id=project_id, project_number=project_number, zone=zone)

    def __enter__(self) -> FakeGCS:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what a pod needs ----------------------------------------------------------------
    def hosts_entries(self) -> dict[str, str]:
        """The names a pod must resolve to the fake (its ``hosts_entries``)."""
        return {JSON_API_HOST: self.address, STORAGE_HOST: self.address,
                METADATA_HOST: self.address}

    def pod_mounts(self) -> dict[str, HostPath]:
        """The CA bundle (this machine's CAs and the test CA) over the one TF's curl reads."""
        return {CA_BUNDLE_PATH: HostPath(str(self.ca_bundle), read_only=True)}

    @property
    def gcs_port(self) -> int:
        return int(self._gcs_server.server_address[1])

    @property
    def metadata_port(self) -> int:
        return int(self._metadata_server.server_address[1])

    @property
    def gcs_url(self) -> str:
        """The GCS server by address (its certificate names the address too)."""
        return f"https://{self.address}:{self.gcs_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://{self.address}:{self.metadata_port}/computeMetadata/v1/"

    def client_context(self) -> ssl.SSLContext:
        """An SSL context that trusts the fake (for clients on this machine)."""
        return ssl.create_default_context(cadata=self.ca_pem.decode())

    # -- the test's side -------------------------------------------------------------------
    def create_bucket(self, name: str, *, writers: Iterable[str] = (), readers: Iterable[str] = (),
                      location: str = "US-CENTRAL1") -> None:
        """A bucket, empty; ``writers`` get ``WRITER``, ``readers`` ``READER``."""
        with self._lock:
            if name in self._buckets:
                raise ValueError(f"bucket {name!r} exists already")
            bucket = _Bucket(name, location, time.time())
            self._buckets[name] = bucket
            for principal in readers:
                bucket.grants[principal] = READER
            for principal in writers:
                bucket.grants[principal] = WRITER

    def grant(self, bucket: str, principal: str, permissions: Iterable[str]) -> None:
        """Set exactly ``permissions`` (``storage.objects.create``, ...) for ``principal`` on
        ``bucket`` (none: revoked)."""
        with self._lock:
            self._buckets[bucket].grants[principal] = frozenset(permissions)

    def objects(self, bucket: str) -> dict[str, bytes]:
        """The bucket's live objects, name -> data."""
        with self._lock:
            return {name: obj.data for name, obj in sorted(self._buckets[bucket].objects.items())}

    def put_object(self, bucket: str, name: str, data: bytes,
                   content_type: str = "application/octet-stream") -> int:
        """Create or replace an object as its owner would; returns its generation."""
        with self._lock:
            return self._store(bucket, name, data, content_type).generation

    def token_for(self, principal: str) -> str:
        """A fresh access token for ``principal`` (what the metadata server hands out)."""
        token = "ya29.c." + secrets.token_urlsafe(96)
        with self._lock:
            self._tokens[token] = (principal, time.time() + TOKEN_LIFETIME_S + 1)
        return token

    def close(self) -> None:
        """Stop both servers (their connections and threads) and remove the temporary files;
        idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for server in self._serving:
            server.shutdown()  # waits for serve_forever to return: only for those serving
        for server in self._servers:
            server.close_connections()
            server.server_close()  # joins the connections' threads
        for thread in self._threads:
            thread.join(10)
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- internals: state --------------------------------------------------------------------
    def _record(self, seen: Seen) -> None:
        with self._lock:
            self.requests.append(seen)

    def _record_error(self, trace: str) -> None:
        with self._lock:
            self.errors.append(trace)

    def _generation(self) -> int:
        self._last_generation = max(time.time_ns() // 1000, self._last_generation + 1)
        return self._last_generation

    def _store(self, bucket: str, name: str, data: bytes, content_type: str) -> _Object:
        obj = _Object(bytes(data), self._generation(), content_type, time.time())
        self._buckets[bucket].objects[name] = obj
        return obj

    def _principal(self, headers: Any) -> str | None:
        """The token's principal; None: anonymous; ApiError 401 for a bad token."""
        value = headers.get("Authorization")
        if value is None:
            return None
        match = re.fullmatch(r"Bearer\s+(\S+)\s*", value)
        if match is None:
            raise _invalid_credentials()
        with self._lock:
            entry = self._tokens.get(match.group(1))
        if entry is None or entry[1] < time.time():
            raise _invalid_credentials()
        return entry[0]

    def _bucket(self, name: str, principal: str | None, *permissions: str) -> _Bucket:
        """The bucket, once the caller holds ``permissions`` there (404 first, then 403)."""
        bucket = self._buckets.get(name)
        if bucket is None:
            raise _no_bucket()
        held = bucket.grants.get(principal, frozenset()) if principal is not None else frozenset()
        for permission in permissions:
            if permission not in held:
                raise _denied(principal, permission)
        return bucket

    def _may_write(self, bucket_name: str, name: str, principal: str | None) -> _Bucket:
        bucket = self._bucket(bucket_name, principal, "storage.objects.create")
        if name in bucket.objects:  # replacing an object deletes the old generation
            self._bucket(bucket_name, principal, "storage.objects.delete")
        return bucket

    @staticmethod
    def _check_preconditions(obj: _Object | None, query: Mapping[str, str],
                             prefix: str = "if") -> None:
        def number(key: str) -> int | None:
            value = query.get(prefix + key)
            if value is None:
                return None
            try:
                return int(value)
            except ValueError:
                raise _bad_request(f"Invalid value for {prefix + key}: {value}",
                                   "invalidParameter") from None

        generation = obj.generation if obj is not None else 0
        if (want := number("GenerationMatch")) is not None and want != generation:
            raise _precondition_failed()
        if (want := number("GenerationNotMatch")) is not None and want == generation:
            raise _precondition_failed("If-None-Match")
        if (want := number("MetagenerationMatch")) is not None and (
                obj is None or want != obj.metageneration):
            raise _precondition_failed()
        if (want := number("MetagenerationNotMatch")) is not None and (
                obj is not None and want == obj.metageneration):
            raise _precondition_failed("If-None-Match")

    def _resource(self, bucket: str, name: str, obj: _Object,
                  fields: dict[str, Any] | None = None) -> Json:
        """The object's resource; its CRC is computed only when ``fields`` wants it."""
        escaped = quote(name, safe="")
        etag = base64.b64encode(f"{obj.generation}/{obj.metageneration}".encode()).decode()
        resource = {
            "kind": "storage#object",
            "id": f"{bucket}/{name}/{obj.generation}",
            "selfLink": f"https://{JSON_API_HOST}/storage/v1/b/{bucket}/o/{escaped}",
            "mediaLink": (f"https://{STORAGE_HOST}/download/storage/v1/b/{bucket}/o/{escaped}"
                          f"?generation={obj.generation}&alt=media"),
            "name": name,
            "bucket": bucket,
            "generation": str(obj.generation),
            "metageneration": str(obj.metageneration),
            "contentType": obj.content_type,
            "storageClass": "STANDARD",
            "size": str(len(obj.data)),
            "md5Hash": obj.md5,
            "crc32c": "",
            "etag": etag,
            "timeCreated": rfc3339(obj.created),
            "updated": rfc3339(obj.created),
            "timeStorageClassUpdated": rfc3339(obj.created),
            "timeFinalized": rfc3339(obj.created),
        }
        if fields is None or "crc32c" in fields:
            resource["crc32c"] = obj.crc32c
        else:
            del resource["crc32c"]
        return resource

    # -- internals: GCS --------------------------------------------------------------------
    def _gcs(self, method: str, host: str, path: str, query: dict[str, str], headers: Any,
             body: bytes, principal_out: list[str | None]) -> _Response:
        fields = parse_fields(query["fields"]) if query.get("fields") else None
        if path.startswith("/upload/storage/v1/"):
            parts = [unquote(p) for p in path[len("/upload/storage/v1/"):].split("/")]
            if len(parts) != 3 or parts[0] != "b" or parts[2] != "o":
                raise _not_found_path()
            if method == "PUT" and "upload_id" in query:  # the session URI is the credential
                return self._resumable_put(query["upload_id"], headers, body, fields)
            principal_out[0] = principal = self._principal(headers)
            if method != "POST":
                raise _not_found_path()
            return self._upload(host, parts[1], query, headers, body, principal, fields)
        principal_out[0] = principal = self._principal(headers)
        if path.startswith(("/storage/v1/", "/download/storage/v1/")):
            media = path.startswith("/download/") or query.get("alt") == "media"
            rest = path.split("/storage/v1/", 1)[1]
            parts = [unquote(p) for p in rest.split("/")]
            with self._lock:
                return self._json_api(method, parts, query, headers, body, principal, fields,
                                      media)
        # the XML API: /<bucket>/<object>, the object's name escaped or not
        bucket_name, _, escaped = path.lstrip("/").partition("/")
        if method not in ("GET", "HEAD"):
            raise ApiError(501, "Not Implemented", "notImplemented", xml_code="NotImplemented",
                           xml_message="A header or query you provided requested a function "
                           "that is not implemented.")
        if not escaped:
            raise ApiError(501, "Not Implemented", "notImplemented", xml_code="NotImplemented",
                           xml_message="Listing buckets through the XML API is not modelled.")
        with self._lock:
            return self._read(unquote(bucket_name), unquote(escaped), query, headers, principal)

    def _read(self, bucket_name: str, name: str, query: Mapping[str, str], headers: Any,
              principal: str | None) -> _Response:
        bucket = self._bucket(bucket_name, principal, "storage.objects.get")
        obj = bucket.objects.get(name)
        if obj is None or query.get("generation", str(obj.generation)) != str(obj.generation):
            raise _no_object(bucket_name, name)
        self._check_preconditions(obj, query)
        size = len(obj.data)
        out = {"Accept-Ranges": "bytes",
               "ETag": f'"{base64.b64decode(obj.md5).hex()}"',
               "Last-Modified": formatdate(obj.created, usegmt=True),
               "x-goog-generation": str(obj.generation),
               "x-goog-metageneration": str(obj.metageneration),
               "x-goog-stored-content-encoding": "identity",
               "x-goog-stored-content-length": str(size),
               "x-goog-hash": f"crc32c={obj.crc32c},md5={obj.md5}",
               "x-goog-storage-class": "STANDARD"}
        wanted = (headers.get("Range") or "").strip()
        match = re.fullmatch(r"bytes=(\d*)-(\d*)", wanted)
        if match is None or match.groups() == ("", ""):  # no range, or one to ignore (RFC 9110)
            return _Response(200, obj.data, obj.content_type, out)
        first, last = match.groups()
        if first == "":
            start, end = max(0, size - int(last)), size - 1
            if int(last) == 0:
                raise _unsatisfiable_range()
        else:
            start = int(first)
            end = min(int(last), size - 1) if last else size - 1
            if last and int(last) < start:
                return _Response(200, obj.data, obj.content_type, out)  # invalid: ignored
        if start >= size:
            raise _unsatisfiable_range()
        out["Content-Range"] = f"bytes {start}-{end}/{size}"
        return _Response(206, obj.data[start:end + 1], obj.content_type, out)

    def _json_api(self, method: str, parts: list[str], query: dict[str, str], headers: Any,
                  body: bytes, principal: str | None, fields: dict[str, Any] | None,
                  media: bool) -> _Response:
        if len(parts) < 2 or parts[0] != "b":
            raise _not_found_path()
        bucket_name = parts[1]
        route = parts[2:]
        if route == [] and method == "GET":
            bucket = self._bucket(bucket_name, principal, "storage.buckets.get")
            return self._ok(self._bucket_resource(bucket), fields)
        if route == ["storageLayout"] and method == "GET":
            bucket = self._bucket(bucket_name, principal, "storage.objects.list")
            return self._ok({"kind": "storage#storageLayout", "bucket": bucket.name,
                             "location": bucket.location, "locationType": "region"}, fields)
        if route == ["o"] and method == "GET":
            bucket = self._bucket(bucket_name, principal, "storage.objects.list")
            return self._ok(self._list(bucket, query, fields), None)
        if len(route) == 2 and route[0] == "o":
            name = route[1]
            if method in ("GET", "HEAD") and media:
                return self._read(bucket_name, name, query, headers, principal)
            if method == "GET":
                bucket = self._bucket(bucket_name, principal, "storage.objects.get")
                obj = bucket.objects.get(name)
                if obj is None or query.get("generation", str(obj.generation)) != str(
                        obj.generation):
                    raise _no_object(bucket_name, name)
                self._check_preconditions(obj, query)
                return self._ok(self._resource(bucket_name, name, obj, fields), fields)
            if method == "DELETE":
                bucket = self._bucket(bucket_name, principal, "storage.objects.delete")
                obj = bucket.objects.get(name)
                if obj is None or query.get("generation", str(obj.generation)) != str(
                        obj.generation):
                    raise _no_object(bucket_name, name)
                self._check_preconditions(obj, query)
                del bucket.objects[name]
                return _Response(204)
        if len(route) == 3 and route[0] == "o" and route[2] == "compose" and method == "POST":
            return self._compose(bucket_name, route[1], query, body, principal, fields)
        if (len(route) == 7 and route[0] == "o" and route[2] in ("rewriteTo", "copyTo")
                and route[3] == "b" and route[5] == "o" and method == "POST"):
            return self._copy(bucket_name, route[1], route[4], route[6], query, body, principal,
                              fields, rewrite=route[2] == "rewriteTo")
        raise _not_found_path()

    @staticmethod
    def _ok(document: Json, fields: dict[str, Any] | None) -> _Response:
        return _Response(200, _json_bytes(select_fields(document, fields)),
                         "application/json; charset=UTF-8")

    def _bucket_resource(self, bucket: _Bucket) -> Json:
        return {"kind": "storage#bucket",
                "selfLink": f"https://{JSON_API_HOST}/storage/v1/b/{bucket.name}",
                "id": bucket.name, "name": bucket.name,
                "projectNumber": str(self.project_number), "metageneration": "1",
                "location": bucket.location, "storageClass": "STANDARD", "etag": "CAE=",
                "timeCreated": rfc3339(bucket.created), "updated": rfc3339(bucket.created),
                "iamConfiguration": {"bucketPolicyOnly": {"enabled": True},
                                     "uniformBucketLevelAccess": {"enabled": True},
                                     "publicAccessPrevention": "enforced"},
                "locationType": "region", "rpo": "DEFAULT"}

    def _list(self, bucket: _Bucket, query: Mapping[str, str],
              fields: dict[str, Any] | None) -> Json:
        prefix, delimiter = query.get("prefix", ""), query.get("delimiter", "")
        try:
            limit = int(query.get("maxResults") or self.page_size)
        except ValueError:
            raise _bad_request(f"Invalid unsigned integer value: '{query['maxResults']}'.",
                               "invalidParameter") from None
        limit = max(1, min(limit, self.page_size))
        start, end = query.get("startOffset", ""), query.get("endOffset")
        trailing = query.get("includeTrailingDelimiter", "").lower() == "true"
        entries: set[tuple[str, int]] = set()  # (name, 0: a prefix, 1: an object)
        for name in bucket.objects:
            if not name.startswith(prefix) or name < start or (end is not None and name >= end):
                continue
            rest = name[len(prefix):]
            cut = rest.find(delimiter) if delimiter else -1
            if cut < 0:
                entries.add((name, 1))
                continue
            rolled = prefix + rest[:cut + len(delimiter)]
            entries.add((rolled, 0))
            if trailing and rolled == name:
                entries.add((name, 1))
        ordered = sorted(entries)
        token = query.get("pageToken")
        if token:
            try:
                after_name, after_kind = base64.urlsafe_b64decode(token.encode()).decode().split(
                    "\0")
                after = (after_name, int(after_kind))
            except ValueError:
                raise _bad_request("Invalid pageToken", "invalidParameter") from None
            ordered = [entry for entry in ordered if entry > after]
        page, more = ordered[:limit], len(ordered) > limit
        document: Json = {"kind": "storage#objects"}
        if more:
            last_name, last_kind = page[-1]
            document["nextPageToken"] = base64.urlsafe_b64encode(
                f"{last_name}\0{last_kind}".encode()).decode()
        prefixes = [name for name, kind in page if kind == 0]
        if prefixes:
            document["prefixes"] = prefixes
        item_tree = fields.get("items") if fields is not None else None
        items = [self._resource(bucket.name, name, bucket.objects[name], item_tree)
                 for name, kind in page if kind == 1]
        if items:
            document["items"] = items
        return select_fields(document, fields)  # type: ignore[no-any-return]

    def _upload(self, host: str, bucket_name: str, query: dict[str, str], headers: Any,
                body: bytes, principal: str | None, fields: dict[str, Any] | None) -> _Response:
        kind = query.get("uploadType", "")
        if kind not in ("media", "resumable"):
            raise _bad_request(f"Upload type {kind!r} is not modelled by the fake"
                               if kind == "multipart" else "Invalid upload type", "invalid")
        metadata: Json = {}
        if kind == "resumable" and body.strip():
            metadata = _lenient_json(body)
        name = query.get("name") or metadata.get("name")
        if not name:
            raise _bad_request("Required", "required")
        content_type = (metadata.get("contentType") or headers.get("X-Upload-Content-Type")
                        or (headers.get("Content-Type") if kind == "media" else None)
                        or "application/octet-stream")
        preconditions = {k: v for k, v in query.items() if k.startswith("if")}
        with self._lock:
            self._may_write(bucket_name, name, principal)
            if kind == "media":
                obj = self._finish(bucket_name, name, body, content_type, preconditions)
                return self._ok(self._resource(bucket_name, name, obj, fields), fields)
            expected = headers.get("X-Upload-Content-Length")
            upload_id = "ADPycdt" + secrets.token_urlsafe(48)
            self._uploads[upload_id] = _Upload(bucket_name, name,
                                               int(expected) if expected else None,
                                               content_type, preconditions)
        authority = (headers.get("Host") or "").strip() or JSON_API_HOST  # the host asked
        location = (f"https://{authority}/upload/storage/v1/b/{bucket_name}/o"
                    f"?uploadType=resumable&name={quote(name, safe='')}&upload_id={upload_id}")
        return _Response(200, b"", "text/plain; charset=utf-8",
                         {"Location": location, "X-GUploader-UploadID": upload_id})

    def _finish(self, bucket_name: str, name: str, data: bytes, content_type: str,
                preconditions: Mapping[str, str]) -> _Object:
        bucket = self._buckets.get(bucket_name)
        if bucket is None:
            raise _no_bucket()
        self._check_preconditions(bucket.objects.get(name), preconditions)
        return self._store(bucket_name, name, data, content_type)

    def _resumable_put(self, upload_id: str, headers: Any, body: bytes,
                       fields: dict[str, Any] | None) -> _Response:
        with self._lock:
            upload = self._uploads.get(upload_id)
            if upload is None:
                raise ApiError(404, "No such upload session.", "notFound", xml_code="NoSuchUpload",
                               xml_message="The requested upload was not found.")
            if upload.result is not None:  # done: every later PUT gets the object again
                return self._ok(self._resource(upload.bucket, upload.name, upload.result,
                                                    fields), fields)
            content_range = (headers.get("Content-Range") or "").strip()
            total: int | None
            if not content_range:  # all of it in one request
                upload.data[:] = body
                total = len(body)
            elif match := re.fullmatch(r"bytes \*/(\d+|\*)", content_range):
                total = None if match.group(1) == "*" else int(match.group(1))
            elif match := re.fullmatch(r"bytes (\d+)-(\d+)/(\d+|\*)", content_range):
                first, last = int(match.group(1)), int(match.group(2))
                total = None if match.group(3) == "*" else int(match.group(3))
                if last - first + 1 != len(body) or first > len(upload.data):
                    raise _bad_request("Invalid request. The Content-Range header is not "
                                       "consistent with the data sent.", "invalid")
                upload.data[first:] = body  # bytes GCS already has are sent again: kept once
            else:
                raise _bad_request(f"Failed to parse Content-Range header: {content_range}.",
                                   "invalid")
            if total is None or len(upload.data) < total:
                received = len(upload.data)
                out = {"Range": f"bytes=0-{received - 1}"} if received else {}
                out["X-GUploader-UploadID"] = upload_id
                return _Response(308, b"", "text/plain; charset=utf-8", out, "Resume Incomplete")
            if len(upload.data) > total or (upload.expected is not None
                                            and upload.expected != total):
                raise _bad_request("The uploaded data did not match the data from the "
                                   "X-Upload-Content-Length header.", "invalid")
            try:
                upload.result = self._finish(upload.bucket, upload.name, bytes(upload.data),
                                             upload.content_type, upload.preconditions)
            except ApiError:
                del self._uploads[upload_id]
                raise
            upload.data = bytearray()
            return self._ok(self._resource(upload.bucket, upload.name, upload.result,
                                                fields), fields)

    def _copy(self, source_bucket: str, source: str, target_bucket: str, target: str,
              query: dict[str, str], body: bytes, principal: str | None,
              fields: dict[str, Any] | None, rewrite: bool) -> _Response:
        bucket = self._bucket(source_bucket, principal, "storage.objects.get")
        obj = bucket.objects.get(source)
        if obj is None or query.get("sourceGeneration", str(obj.generation)) != str(
                obj.generation):
            raise _no_object(source_bucket, source)
        self._may_write(target_bucket, target, principal)
        self._check_preconditions(obj, query, prefix="ifSource")
        metadata: Json = _lenient_json(body) if body.strip() else {}
        content_type = metadata.get("contentType") or obj.content_type
        copied = self._finish(target_bucket, target, obj.data, content_type,
                              {k: v for k, v in query.items()
                               if k.startswith("if") and not k.startswith("ifSource")})
        if not rewrite:
            return self._ok(self._resource(target_bucket, target, copied, fields), fields)
        resource_tree = fields.get("resource") if fields is not None else None
        size = str(len(copied.data))
        return self._ok({"kind": "storage#rewriteResponse", "totalBytesRewritten": size,
                         "objectSize": size, "done": True,
                         "resource": self._resource(target_bucket, target, copied,
                                                         resource_tree)}, fields)

    def _compose(self, bucket_name: str, target: str, query: dict[str, str], body: bytes,
                 principal: str | None, fields: dict[str, Any] | None) -> _Response:
        request = _lenient_json(body)
        sources = request.get("sourceObjects") if isinstance(request, dict) else None
        if not isinstance(sources, list) or not sources:
            raise _bad_request("Required", "required")
        if len(sources) > 32:
            raise _bad_request(f"The number of source components provided ({len(sources)}) "
                               "exceeds the maximum (32)", "invalid")
        bucket = self._bucket(bucket_name, principal, "storage.objects.get")
        data = bytearray()
        for source in sources:
            name = source.get("name", "")
            obj = bucket.objects.get(name)
            if obj is None or str(source.get("generation", obj.generation)) != str(
                    obj.generation):
                raise _no_object(bucket_name, name)
            want = (source.get("objectPrecondition") or {}).get("ifGenerationMatch")
            if want is not None and int(want) != obj.generation:
                raise _precondition_failed()
            data += obj.data
        self._may_write(bucket_name, target, principal)
        destination = request.get("destination") or {}
        old = bucket.objects.get(target)
        content_type = (destination.get("contentType") or (old.content_type if old else None)
                        or "application/octet-stream")
        composed = self._finish(bucket_name, target, bytes(data), content_type,
                                {k: v for k, v in query.items() if k.startswith("if")})
        return self._ok(self._resource(bucket_name, target, composed, fields), fields)

    # -- internals: the metadata server --------------------------------------------------------
    def _metadata(self, method: str, raw_path: str, headers: Any, client: str,
                  principal_out: list[str | None]) -> _Response:
        server = {"Metadata-Flavor": "Google"}

        def text(status: int, value: str) -> _Response:
            return _Response(status, value.encode(), "application/text", dict(server))

        def document(value: Any) -> _Response:
            return _Response(200, json.dumps(value).encode(), "application/json", dict(server))

        if headers.get("Metadata-Flavor") != "Google":
            return _Response(403, b"Missing Metadata-Flavor:Google header.\n",
                             "text/plain; charset=utf-8")
        split = urlsplit(raw_path)
        query = {k: v[0] for k, v in parse_qs(split.query, keep_blank_values=True).items()}
        base = "/computeMetadata/v1/"
        if method not in ("GET", "HEAD") or not split.path.startswith(base):
            return text(404, "Not Found\n")
        path = split.path[len(base):]
        if path == "project/project-id":
            return text(200, self.project_id)
        if path == "project/numeric-project-id":
            return text(200, str(self.project_number))
        if path == "instance/zone":
            return text(200, f"projects/{self.project_number}/zones/{self.zone}")
        if not path.startswith("instance/service-accounts/"):
            return text(404, "Not Found\n")
        principal = self.identity(client)
        principal_out[0] = principal
        if principal is None:
            return text(404, "Not Found\n")
        rest = path[len("instance/service-accounts/"):]
        if rest == "":
            return text(200, f"default/\n{principal}/\n")
        account, _, leaf = rest.partition("/")
        if account not in ("default", principal):
            return text(404, "Not Found\n")
        if leaf == "":
            if query.get("recursive", "").lower() == "true":
                return document({"aliases": ["default"], "email": principal,
                                 "scopes": list(SCOPES)})
            return text(200, "aliases\nemail\nidentity\nscopes\ntoken\n")
        if leaf == "email":
            return text(200, principal)
        if leaf == "aliases":
            return text(200, "default\n")
        if leaf == "scopes":
            return text(200, "".join(f"{scope}\n" for scope in SCOPES))
        if leaf == "token":
            return document({"access_token": self.token_for(principal),
                             "expires_in": TOKEN_LIFETIME_S, "token_type": "Bearer"})
        return text(404, "Not Found\n")
