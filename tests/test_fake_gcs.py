"""The GCS and metadata-server fake (tests/fake_gcs.py): TensorFlow's own GCS file system in a
pod of the pod lab, with Workload Identity, and the fake's answers read with urllib."""

from __future__ import annotations

import json
import re
import socket
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from fake_gcs import FakeGCS, crc32c, parse_fields, select_fields
from podlab import PodLab, PodProcess, PodRun

PY = sys.executable
CRI_RECORD = re.compile(r"^(\S+) (stdout|stderr) ([FP]) (.*)$")
TRAINER = "trainer@fake-project.iam.gserviceaccount.com"
READER = "viewer@fake-project.iam.gserviceaccount.com"
BIG = (bytes(range(256)) * 12289)[:3 * 1024 * 1024 + 17]  # the script's big file (> 1 MiB)

# Exercises TF's GCS file system on gs://lab-bucket; exits 1 at the first mismatch, saying which.
TF_ON_GCS = """
import os, sys
import numpy as np
import tensorflow as tf

gfile = tf.io.gfile

def check(ok, what):
    if not ok:
        print("MISMATCH:", what, file=sys.stderr, flush=True)
        sys.exit(1)

root = "gs://lab-bucket/run"
gfile.makedirs(root + "/a/b")
check(gfile.exists(root + "/a/b") and gfile.isdir(root + "/a"), "makedirs")
check(not gfile.exists(root + "/nothing"), "exists of nothing")
big = (bytes(range(256)) * 12289)[:3 * 1024 * 1024 + 17]
with gfile.GFile(root + "/a/big.bin", "wb") as f:
    f.write(big)
with gfile.GFile(root + "/a/big.bin", "rb") as f:
    check(f.read() == big, "the big file reads back")
with gfile.GFile(root + "/a/big.bin", "rb") as f:
    f.seek(2 * 1024 * 1024 + 5)
    check(f.read(100) == big[2 * 1024 * 1024 + 5:2 * 1024 * 1024 + 105], "a partial read")
with gfile.GFile(root + "/a/big.bin", "rb") as f:
    f.seek(len(big))
    check(f.read(10) == b"", "a read at the end")  # GCS: 416, which TF reads as no bytes
with gfile.GFile(root + "/a/b/small.txt", "w") as f:
    f.write("hello")
with gfile.GFile(root + "/a/b/small.txt", "a") as f:
    f.write(", world")
with gfile.GFile(root + "/a/b/small.txt") as f:
    check(f.read() == "hello, world", "an append")
stat = gfile.stat(root + "/a/big.bin")
check(stat.length == len(big) and not stat.is_directory and stat.mtime_nsec > 0, f"stat {stat}")
check(gfile.stat(root + "/a").is_directory, "stat of a directory")
check(sorted(gfile.listdir(root + "/a")) == ["b/", "big.bin"],
      f"listdir {gfile.listdir(root + '/a')}")
for i in range(7):  # more than a page (the test sets the fake's page size to 3)
    with gfile.GFile(f"{root}/many/f{i}.txt", "w") as f:
        f.write(str(i))
check(sorted(gfile.glob(root + "/many/f*.txt")) == [f"{root}/many/f{i}.txt" for i in range(7)],
      f"glob {gfile.glob(root + '/many/f*.txt')}")
check(len(gfile.listdir(root + "/many")) == 7, f"listdir many {gfile.listdir(root + '/many')}")
gfile.rename(root + "/many/f0.txt", root + "/many/g0.txt")
check(not gfile.exists(root + "/many/f0.txt") and gfile.exists(root + "/many/g0.txt"), "rename")
gfile.rename(root + "/a/b", root + "/a/c")
with gfile.GFile(root + "/a/c/small.txt") as f:
    check(f.read() == "hello, world", "a renamed directory")
check(not gfile.exists(root + "/a/b/small.txt"), "a renamed directory's old path")
gfile.remove(root + "/many/g0.txt")
check(not gfile.exists(root + "/many/g0.txt"), "remove")
gfile.rmtree(root + "/many")
check("many/" not in gfile.listdir(root), "rmtree")  # not exists(): TF caches stats for 5 s

step, weights = tf.Variable(0), tf.Variable([1.0, 2.0])
checkpoint = tf.train.Checkpoint(step=step, weights=weights)
manager = tf.train.CheckpointManager(checkpoint, "gs://lab-bucket/ckpt", max_to_keep=2)
for number in (1, 2, 3):
    step.assign(number)
    weights.assign_add([1.0, 1.0])
    manager.save(checkpoint_number=number)
latest = tf.train.latest_checkpoint("gs://lab-bucket/ckpt")
check(latest == "gs://lab-bucket/ckpt/ckpt-3", f"latest_checkpoint {latest}")
step.assign(0)
weights.assign([0.0, 0.0])
checkpoint.restore(latest).assert_consumed()
check(int(step.numpy()) == 3 and weights.numpy().tolist() == [4.0, 5.0], "restore")

class Doubler(tf.Module):
    def __init__(self):
        self.factor = tf.Variable(2.0)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32)])
    def __call__(self, x):
        return x * self.factor

tf.saved_model.save(Doubler(), "gs://lab-bucket/saved")
restored = tf.saved_model.load("gs://lab-bucket/saved")
check(restored(tf.constant([1.0, 3.0])).numpy().tolist() == [2.0, 6.0], "a SavedModel")

import keras
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
model.save("gs://lab-bucket/m/model.keras")
loaded = keras.models.load_model("gs://lab-bucket/m/model.keras")
x = np.ones((1, 3), "float32")
check(np.allclose(model(x), loaded(x)), "the Keras model loaded back")
print("all checks passed", flush=True)
"""

# A reader, not a writer: reads what is there, is refused a write (TF's error on stderr, exit
# 3); and the metadata server refuses a request without Metadata-Flavor.
TF_AS_READER = """
import sys, urllib.error, urllib.request
url = "http://metadata.google.internal/computeMetadata/v1/instance/service-accounts/default/email"
try:
    urllib.request.urlopen(url, timeout=10)
    sys.exit("the metadata server answered without Metadata-Flavor")
except urllib.error.HTTPError as e:
    print("without Metadata-Flavor:", e.code, flush=True)
request = urllib.request.Request(url, headers={"Metadata-Flavor": "Google"})
print("email:", urllib.request.urlopen(request, timeout=10).read().decode(), flush=True)
import tensorflow as tf
with tf.io.gfile.GFile("gs://lab-bucket/shared/data.txt") as f:
    print("read:", f.read(), flush=True)
try:
    with tf.io.gfile.GFile("gs://lab-bucket/shared/mine.txt", "w") as f:
        f.write("no")
except tf.errors.PermissionDeniedError as e:
    print("refused:", e.message, file=sys.stderr, flush=True)
    sys.exit(3)
sys.exit("the write was not refused")
"""


def records(pod: PodProcess) -> list[tuple[str, str]]:
    """The pod's CRI log as (stream, content)."""
    parsed = [CRI_RECORD.match(line) for line in pod.log_path.read_text().splitlines()]
    return [(m.group(2), m.group(4)) for m in parsed if m]


def tf_pod(pods: PodLab, gcs: FakeGCS, principals: dict[str, str], name: str, script: str,
           principal: str) -> PodProcess:
    """A pod running ``script`` with the venv's TensorFlow, acting as ``principal``."""
    pod = pods.create_pod(PodRun(name=name, namespace="default", node="node-1",
                                 command=(PY, "-c", script), env={"TF_CPP_MIN_LOG_LEVEL": "1"},
                                 hosts_entries=gcs.hosts_entries(), mounts=gcs.pod_mounts()))
    principals[pod.ip] = principal
    pod.start()
    return pod


@pytest.fixture
def lab_gcs(pods: PodLab) -> Iterator[tuple[FakeGCS, dict[str, str]]]:
    """The fake on the lab's bridge (ports 443 and 80), with the bucket ``lab-bucket`` that
    TRAINER writes and READER reads; pods are identified by the IP -> principal map."""
    principals: dict[str, str] = {}
    with FakeGCS.start(pods.bridge_address, principals.get) as gcs:
        gcs.create_bucket("lab-bucket", writers=[TRAINER], readers=[READER])
        yield gcs, principals


@pytest.mark.pods
@pytest.mark.tf
def test_tensorflow_in_a_pod_uses_gcs_with_workload_identity(
        pods: PodLab, lab_gcs: tuple[FakeGCS, dict[str, str]]) -> None:
    gcs, principals = lab_gcs
    gcs.page_size = 3  # TF follows nextPageToken
    pod = tf_pod(pods, gcs, principals, "tf-gcs", TF_ON_GCS, TRAINER)
    state = pod.wait(240)
    assert state.exit_code == 0, pod.log_tail(6000)
    assert ("stdout", "all checks passed") in records(pod)
    objects = gcs.objects("lab-bucket")
    assert objects["run/a/big.bin"] == BIG
    assert objects["run/a/c/small.txt"] == b"hello, world"
    assert not [name for name in objects if name.startswith(("run/many", "run/a/b/"))]
    assert objects["ckpt/checkpoint"].startswith(b'model_checkpoint_path: "ckpt-3"')
    assert {name for name in objects if name.startswith("ckpt/")} == {
        "ckpt/", "ckpt/checkpoint", *(f"ckpt/ckpt-{n}.{kind}" for n in (2, 3)
                             for kind in ("index", "data-00000-of-00001"))}
    assert objects["m/model.keras"][:2] == b"PK"  # a zip
    assert {"saved/saved_model.pb", "saved/variables/variables.index"} <= set(objects)
    seen = {(r.server, r.method) for r in gcs.requests if r.client == pod.ip}
    assert {("metadata", "GET"), ("gcs", "GET"), ("gcs", "POST"), ("gcs", "PUT"),
            ("gcs", "DELETE")} <= seen
    assert {r.principal for r in gcs.requests if r.client == pod.ip} <= {TRAINER, None}
    assert any("pageToken=" in r.path for r in gcs.requests)
    assert any(r.host == "storage.googleapis.com" and r.status == 416 for r in gcs.requests)
    assert not [r for r in gcs.requests if r.status >= 500] and not gcs.errors, gcs.errors



@pytest.mark.pods
@pytest.mark.tf
def test_a_pod_that_is_not_a_writer_gets_the_403_from_tensorflow(
        pods: PodLab, lab_gcs: tuple[FakeGCS, dict[str, str]]) -> None:
    gcs, principals = lab_gcs
    gcs.put_object("lab-bucket", "shared/data.txt", b"for everyone")
    pod = tf_pod(pods, gcs, principals, "tf-reader", TF_AS_READER, READER)
    state = pod.wait(120)
    assert state.exit_code == 3, pod.log_tail(6000)
    log = records(pod)
    assert [c for s, c in log if s == "stdout"] == [
        "without Metadata-Flavor: 403", f"email: {READER}", "read: for everyone"]
    stderr = "\n".join(c for s, c in log if s == "stderr")  # GCS's error bodies are indented
    refusal = stderr[stderr.index("refused:"):]
    assert (f"{READER} does not have storage.objects.create access to the Google Cloud Storage "
            "object. Permission 'storage.objects.create' denied on resource (or it may not "
            "exist).") in refusal
    assert "HTTP response code 403" in refusal
    assert gcs.objects("lab-bucket") == {"shared/data.txt": b"for everyone"}


# -- the fake's answers, from this machine ---------------------------------------------------
class Client:
    """urllib against a fake on 127.0.0.1 that trusts its CA."""

    def __init__(self, gcs: FakeGCS) -> None:
        self.gcs = gcs
        self.context = gcs.client_context()

    def send(self, method: str, path: str, token: str | None = None, body: bytes | None = None,
             headers: Mapping[str, str] | None = None,
             base: str | None = None) -> tuple[int, dict[str, str], bytes]:
        all_headers = dict(headers or {})
        if token is not None:
            all_headers["Authorization"] = f"Bearer {token}"
        url = path if path.startswith("http") else (base or self.gcs.gcs_url) + path
        request = urllib.request.Request(url, data=body, method=method, headers=all_headers)
        try:
            with urllib.request.urlopen(request, context=self.context, timeout=10) as response:
                return response.status, dict(response.headers), response.read()
        except urllib.error.HTTPError as error:
            return error.code, dict(error.headers), error.read()

    def json(self, method: str, path: str, token: str | None = None, body: bytes | None = None,
             headers: Mapping[str, str] | None = None) -> tuple[int, Any]:
        status, _, data = self.send(method, path, token, body, headers)
        return status, json.loads(data) if data else None

    def metadata(self, path: str, flavor: bool = True) -> tuple[int, dict[str, str], bytes]:
        headers = {"Metadata-Flavor": "Google"} if flavor else {}
        return self.send("GET", self.gcs.metadata_url + path, headers=headers)


@pytest.fixture
def local() -> Iterator[tuple[FakeGCS, Client, dict[str, str]]]:
    principals: dict[str, str] = {"127.0.0.1": TRAINER}
    with FakeGCS.start("127.0.0.1", principals.get, gcs_port=0, metadata_port=0) as gcs:
        gcs.create_bucket("b", writers=[TRAINER], readers=[READER])
        yield gcs, Client(gcs), principals


def error(code: int, message: str, reason: str, **extra: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "errors": [
        {"message": message, "domain": "global", "reason": reason, **extra}]}}


def test_the_metadata_server_wants_metadata_flavor_and_knows_callers_by_address(
        local: tuple[FakeGCS, Client, dict[str, str]]) -> None:
    _, client, principals = local
    status, _, body = client.metadata("instance/service-accounts/default/email", flavor=False)
    assert (status, body) == (403, b"Missing Metadata-Flavor:Google header.\n")
    status, headers, body = client.metadata("instance/service-accounts/default/email")
    assert (status, headers["Metadata-Flavor"], body) == (200, "Google", TRAINER.encode())
    status, _, body = client.metadata("instance/service-accounts/default/token")
    token = json.loads(body)
    assert status == 200 and set(token) == {"access_token", "expires_in", "token_type"}
    assert token["token_type"] == "Bearer" and token["expires_in"] == 3599
    assert client.json("GET", "/storage/v1/b/b/o", token["access_token"])[0] == 200
    assert client.metadata("project/project-id")[2] == b"fake-project"
    recursive = client.metadata("instance/service-accounts/default/?recursive=true")[2]
    assert json.loads(recursive)["email"] == TRAINER
    del principals["127.0.0.1"]  # a caller the server cannot tie to a pod
    assert client.metadata("instance/service-accounts/default/token")[0] == 404
    assert client.metadata("instance/nothing")[0] == 404


def test_gcs_refuses_as_the_real_one_does(local: tuple[FakeGCS, Client, dict[str, str]]) -> None:
    gcs, client, _ = local
    gcs.put_object("b", "x", b"data")
    assert client.json("GET", "/storage/v1/b/b/o/x") == (401, error(
        401, "Anonymous caller does not have storage.objects.get access to the Google Cloud "
        "Storage object. Permission 'storage.objects.get' denied on resource (or it may not "
        "exist).", "required", locationType="header", location="Authorization"))
    assert client.json("GET", "/storage/v1/b/b/o/x", "ya29.forged") == (401, error(
        401, "Invalid Credentials", "authError", locationType="header", location="Authorization"))
    reader = gcs.token_for(READER)
    assert client.json("GET", "/storage/v1/b/b/o/x?fields=size", reader) == (200, {"size": "4"})
    assert client.json("POST", "/upload/storage/v1/b/b/o?uploadType=media&name=y", reader,
                       b"new") == (403, error(
        403, f"{READER} does not have storage.objects.create access to the Google Cloud Storage "
        "object. Permission 'storage.objects.create' denied on resource (or it may not exist).",
        "forbidden"))
    stranger = gcs.token_for("stranger@elsewhere.iam.gserviceaccount.com")
    status, body = client.json("GET", "/storage/v1/b/b/o", stranger)
    assert status == 403 and body["error"]["message"].startswith(
        "stranger@elsewhere.iam.gserviceaccount.com does not have storage.objects.list access "
        "to the Google Cloud Storage bucket.")
    writer = gcs.token_for(TRAINER)
    assert client.json("GET", "/storage/v1/b/b/o/nope", writer) == (404, error(
        404, "No such object: b/nope", "notFound"))
    assert client.json("GET", "/storage/v1/b/nope/o/x", writer) == (404, error(
        404, "The specified bucket does not exist.", "notFound"))
    # TF's CreateDir: a marker only if none exists
    marker = "/upload/storage/v1/b/b/o?uploadType=media&name=d%2F&ifGenerationMatch=0"
    assert client.json("POST", marker, writer, b"")[0] == 200
    assert client.json("POST", marker, writer, b"") == (412, error(
        412, "At least one of the pre-conditions you specified did not hold.", "conditionNotMet",
        locationType="header", location="If-Match"))
    # the XML API's errors, and a range past the end (which TF reads as end of file)
    status, _, body = client.send("GET", "/b/nope", writer)
    assert status == 404 and b"<Code>NoSuchKey</Code>" in body and b"No such object: b/nope" in body
    status, _, body = client.send("GET", "/b/x", None)
    assert status == 403 and b"<Code>AccessDenied</Code>" in body
    status, _, body = client.send("GET", "/b/x", writer, headers={"Range": "bytes=4-9"})
    assert status == 416 and b"<Code>InvalidRange</Code>" in body


def test_uploads_reads_lists_and_copies_have_the_real_shapes(
        local: tuple[FakeGCS, Client, dict[str, str]]) -> None:
    gcs, client, _ = local
    token = gcs.token_for(TRAINER)
    status, headers, _ = client.send("POST", "/upload/storage/v1/b/b/o?uploadType=resumable"
                                     "&name=dir%2Ffile", token, b"",
                                     {"X-Upload-Content-Length": "10"})
    session = headers["Location"]
    assert status == 200 and session.startswith(f"{gcs.gcs_url}/upload/storage/v1/b/b/o?")
    status, headers, _ = client.send("PUT", session, None, b"", {"Content-Range": "bytes */10"})
    assert status == 308 and "Range" not in headers
    status, headers, _ = client.send("PUT", session, None, b"01234",
                                     {"Content-Range": "bytes 0-4/*"})
    assert (status, headers["Range"]) == (308, "bytes=0-4")
    status, _, body = client.send("PUT", session, None, b"56789", {"Content-Range": "bytes 5-9/10"})
    resource = json.loads(body)
    assert status == 200 and resource["size"] == "10" and resource["name"] == "dir/file"
    assert resource["crc32c"] and resource["md5Hash"] == "eB5eJF1ptWaXm4bijSPyxw=="
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", resource["updated"])
    assert int(resource["generation"]) > 0
    assert client.send("PUT", session, None, b"", {"Content-Range": "bytes */10"})[0] == 200
    status, headers, body = client.send("GET", "/b/dir%2Ffile", token,
                                        headers={"Range": "bytes=3-5"})
    assert (status, body, headers["Content-Range"]) == (206, b"345", "bytes 3-5/10")
    assert headers["x-goog-generation"] == resource["generation"]
    assert client.send("GET", "/storage/v1/b/b/o/dir%2Ffile?alt=media", token)[2] == b"0123456789"
    for name in ("dir/a", "dir/sub/b", "dir/sub/c", "dir/z", "top"):
        gcs.put_object("b", name, name.encode())
    gcs.page_size = 2
    names, prefixes, page = [], [], ""
    while True:
        status, listing = client.json("GET", "/storage/v1/b/b/o?prefix=dir%2F&delimiter=%2F"
                                      "&fields=items%2Fname%2Cprefixes%2CnextPageToken" + page,
                                      token)
        assert status == 200 and set(listing) <= {"items", "prefixes", "nextPageToken"}
        names += [item["name"] for item in listing.get("items", [])]
        prefixes += listing.get("prefixes", [])
        if "nextPageToken" not in listing:
            break
        page = "&pageToken=" + listing["nextPageToken"]
    assert (names, prefixes) == (["dir/a", "dir/file", "dir/z"], ["dir/sub/"])
    status, rewrite = client.json("POST", "/storage/v1/b/b/o/top/rewriteTo/b/b/o/moved", token)
    assert status == 200 and rewrite["done"] is True and rewrite["resource"]["name"] == "moved"
    assert rewrite["kind"] == "storage#rewriteResponse" and rewrite["objectSize"] == "3"
    assert client.send("DELETE", "/storage/v1/b/b/o/top", token)[0] == 204
    generation = client.json("GET", "/storage/v1/b/b/o/dir%2Fa?fields=generation", token)[1]
    compose = (f"{{'sourceObjects': [{{'name': 'dir/a','objectPrecondition':{{'ifGenerationMatch':"
               f"{generation['generation']}}}}},{{'name': 'moved'}}]}}").encode()  # TF's quotes
    status, composed = client.json("POST", "/storage/v1/b/b/o/dir%2Fa/compose", token, compose,
                                   {"Content-Type": "application/json"})
    assert status == 200 and composed["size"] == "8"
    assert client.json("POST", "/storage/v1/b/b/o/dir%2Fa/compose", token, compose)[0] == 412
    assert gcs.objects("b")["dir/a"] == b"dir/atop"
    assert "top" not in gcs.objects("b")


def test_field_selectors_and_the_crc() -> None:
    tree = parse_fields("items(name,size),nextPageToken,kind/x")
    assert tree == {"items": {"name": None, "size": None}, "nextPageToken": None,
                    "kind": {"x": None}}
    assert select_fields({"items": [{"name": "a", "size": "1", "md5Hash": "h"}], "kind": "k",
                          "other": 1}, parse_fields("items/name,kind")) == {
        "items": [{"name": "a"}], "kind": "k"}
    assert crc32c(b"123456789") == 0xE3069283


def test_close_stops_the_servers_and_removes_the_files() -> None:
    threads = set(threading.enumerate())
    gcs = FakeGCS.start("127.0.0.1", lambda ip: None, gcs_port=0, metadata_port=0)
    directory, url = gcs.dir, gcs.gcs_url
    assert gcs.ca_bundle.read_bytes().endswith(gcs.ca_pem)
    idle = socket.create_connection(("127.0.0.1", gcs.gcs_port))  # its thread waits on it
    gcs.close()
    idle.close()
    assert set(threading.enumerate()) <= threads
    gcs.close()
    assert not directory.exists()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url + "/b/x", timeout=5)
