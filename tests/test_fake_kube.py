"""The fake Kubernetes API server, driven only through the official ``kubernetes`` client."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import datetime, timezone
from itertools import islice
from pathlib import Path
from typing import Any, TypeAlias

import pytest
import urllib3
from fake_kube import FakeKube, KubeError, jobset_crd_object
from kubernetes import client, config, dynamic, watch
from kubernetes.client.exceptions import ApiException

Json = dict[str, Any]
# The generated client wants models and returns Optional fields throughout; these tests speak
# JSON dicts and read fields the fake always sets, so they hold the API objects as Any.
Core: TypeAlias = Any
Batch: TypeAlias = Any
Custom: TypeAlias = Any


def new_watch() -> Any:
    return watch.Watch()  # type: ignore[no-untyped-call]  # the client's watch module is untyped


def raw(api: client.ApiClient, method: str, path: str, query: list[tuple[str, str]] | None = None,
        body: Json | None = None) -> tuple[int, bytes]:
    """A request the typed API classes cannot make, through the client's own ApiClient."""
    request = api.param_serialize(method, path, query_params=query, body=body,
                                  auth_settings=["BearerToken"])
    response: Any = api.call_api(*request)
    data: bytes = response.read()
    return response.status, data


@pytest.fixture
def fake() -> Iterator[FakeKube]:
    with FakeKube(bookmark_interval_s=0.2, history=50) as server:
        yield server


@pytest.fixture
def api(fake: FakeKube) -> Iterator[client.ApiClient]:
    with client.ApiClient(fake.configuration()) as api_client:
        yield api_client


@pytest.fixture
def core(api: client.ApiClient) -> Core:
    return client.CoreV1Api(api)


@pytest.fixture
def batch(api: client.ApiClient) -> Batch:
    return client.BatchV1Api(api)


@pytest.fixture
def custom(api: client.ApiClient) -> Custom:
    return client.CustomObjectsApi(api)


def pod(name: str, node: str | None = None, labels: dict[str, str] | None = None,
        containers: tuple[str, ...] = ("worker",), **meta: Any) -> Json:
    spec: Json = {"containers": [{"name": c, "image": "busybox"} for c in containers]}
    if node:
        spec["nodeName"] = node
    return {"metadata": {"name": name, "labels": labels or {}, **meta}, "spec": spec}


def job(name: str) -> Json:
    return {"metadata": {"name": name}, "spec": {"template": {"spec": {
        "restartPolicy": "Never", "containers": [{"name": "worker", "image": "busybox"}]}}}}


def owned_by(owner: Json, block: bool = False) -> list[Json]:
    return [{"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": owner["metadata"]["name"],
             "uid": owner["metadata"]["uid"], "controller": True, "blockOwnerDeletion": block}]


def error_of(call: Any, *args: Any, **kwargs: Any) -> tuple[int, Json]:
    with pytest.raises(ApiException) as caught:
        call(*args, **kwargs)
    body = json.loads(caught.value.body) if caught.value.body else {}
    return caught.value.status, body


def names(items: list[Any]) -> list[str]:
    return [item.metadata.name for item in items]


def gone(core: Core, name: str) -> bool:
    try:
        core.read_namespaced_pod(name, "default")
    except ApiException as error:
        return bool(error.status == 404)
    return False


# --- CRUD and errors --------------------------------------------------------------------------


def test_create_sets_server_metadata_and_defaults(core: Core) -> None:
    created = core.create_namespaced_pod("default", pod("p1"))
    read = core.read_namespaced_pod("p1", "default")
    assert created.metadata.uid and created.metadata.namespace == "default"
    assert int(read.metadata.resource_version) > 0 and read.metadata.creation_timestamp is not None
    assert (read.status.phase, read.spec.restart_policy, read.spec.termination_grace_period_seconds) \
        == ("Pending", "Always", 30)
    assert read.metadata.uid == created.metadata.uid


def test_namespaces_default_and_kube_system_exist_at_start(core: Core) -> None:
    namespaces = core.list_namespace()
    assert names(namespaces.items) == ["default", "kube-system"]
    assert namespaces.items[0].status.phase == "Active"


def test_reading_a_missing_pod_is_404_not_found_with_details(core: Core) -> None:
    code, body = error_of(core.read_namespaced_pod, "x", "default")
    assert code == 404
    assert (body["kind"], body["status"], body["reason"], body["message"]) == \
        ("Status", "Failure", "NotFound", 'pods "x" not found')
    assert body["details"] == {"name": "x", "kind": "pods"}


def test_a_missing_job_is_named_with_its_group(batch: Batch) -> None:
    code, body = error_of(batch.read_namespaced_job, "j", "default")
    assert (code, body["message"]) == (404, 'jobs.batch "j" not found')
    assert body["details"] == {"name": "j", "group": "batch", "kind": "jobs"}


def test_creating_twice_is_409_already_exists(core: Core) -> None:
    core.create_namespaced_config_map("default", {"metadata": {"name": "c"}, "data": {"a": "1"}})
    code, body = error_of(core.create_namespaced_config_map, "default", {"metadata": {"name": "c"}})
    assert (code, body["reason"], body["message"]) == (409, "AlreadyExists", 'configmaps "c" already exists')


def test_generate_name_gives_each_object_its_own_name(core: Core) -> None:
    first = core.create_namespaced_pod("default", pod("", generateName="trial-"))
    second = core.create_namespaced_pod("default", pod("", generateName="trial-"))
    assert first.metadata.name.startswith("trial-") and len(first.metadata.name) == len("trial-") + 5
    assert first.metadata.name != second.metadata.name


def test_dry_run_create_validates_without_storing(core: Core) -> None:
    answered = core.create_namespaced_pod("default", pod("dry"), dry_run="All")
    assert answered.metadata.name == "dry"
    assert core.list_namespaced_pod("default").items == []
    code, _ = error_of(core.create_namespaced_pod, "default", pod("Dry"), dry_run="All")
    assert code == 422


def test_a_bad_pod_name_is_422_invalid_with_the_cause(core: Core) -> None:
    code, body = error_of(core.create_namespaced_pod, "default", pod("Bad_Name"))
    assert (code, body["reason"]) == (422, "Invalid")
    assert body["message"].startswith('Pod "Bad_Name" is invalid: metadata.name: Invalid value: '
                                      '"Bad_Name": a lowercase RFC 1123 subdomain must consist of')
    assert body["details"]["kind"] == "Pod"
    [cause] = body["details"]["causes"]
    assert (cause["reason"], cause["field"]) == ("FieldValueInvalid", "metadata.name")


def test_service_and_namespace_names_are_labels(core: Core) -> None:
    code, body = error_of(core.create_namespaced_service, "default",
                          {"metadata": {"name": "1svc"}, "spec": {"ports": [{"port": 80}]}})
    assert code == 422 and "a DNS-1035 label must consist of" in body["message"]
    code, body = error_of(core.create_namespace, {"metadata": {"name": "a" * 64}})
    causes = [c["message"] for c in body["details"]["causes"]]
    assert code == 422 and any("must be no more than 63 characters" in c for c in causes)
    core.create_namespace({"metadata": {"name": "a" * 63}})


def test_bad_labels_and_missing_fields_are_each_a_cause(core: Core,
                                                       batch: Batch) -> None:
    bad = pod("p", labels={"bad key!": "ok", "app": "not ok!"})
    bad["spec"]["containers"][0].pop("image")
    code, body = error_of(core.create_namespaced_pod, "default", bad)
    fields = sorted((c["field"], c["reason"]) for c in body["details"]["causes"])
    assert code == 422 and body["message"].startswith('Pod "p" is invalid: [')
    assert fields == [("metadata.labels", "FieldValueInvalid"), ("metadata.labels", "FieldValueInvalid"),
                      ("spec.containers[0].image", "FieldValueRequired")]
    no_policy = job("j")
    del no_policy["spec"]["template"]["spec"]["restartPolicy"]
    code, body = error_of(batch.create_namespaced_job, "default", no_policy)
    assert body["details"]["causes"] == [{
        "reason": "FieldValueRequired", "field": "spec.template.spec.restartPolicy",
        "message": 'Required value: valid values: "OnFailure", "Never"'}]


def test_creating_in_a_missing_namespace_is_404(core: Core) -> None:
    code, body = error_of(core.create_namespaced_secret, "nowhere", {"metadata": {"name": "s"}})
    assert (code, body["message"], body["details"]) == (
        404, 'namespaces "nowhere" not found', {"name": "nowhere", "kind": "namespaces"})


def test_secret_string_data_is_stored_base64_in_data(core: Core) -> None:
    core.create_namespaced_secret("default", {"metadata": {"name": "s"}, "stringData": {"token": "abc"}})
    secret = core.read_namespaced_secret("s", "default")
    assert (secret.data, secret.string_data, secret.type) == ({"token": "YWJj"}, None, "Opaque")


def test_replacing_with_a_stale_resource_version_is_409_conflict(core: Core) -> None:
    first = core.create_namespaced_config_map("default", {"metadata": {"name": "c"}, "data": {"a": "1"}})
    first.data = {"a": "2"}
    second = core.replace_namespaced_config_map("c", "default", first)
    assert int(second.metadata.resource_version) > int(first.metadata.resource_version)
    first.data = {"a": "3"}
    code, body = error_of(core.replace_namespaced_config_map, "c", "default", first)
    assert (code, body["reason"]) == (409, "Conflict")
    assert body["message"] == ('Operation cannot be fulfilled on configmaps "c": the object has been '
                               "modified; please apply your changes to the latest version and try again")
    assert core.read_namespaced_config_map("c", "default").data == {"a": "2"}


def test_the_status_subresource_is_the_only_way_to_change_status(core: Core) -> None:
    core.create_namespaced_pod("default", pod("p"))
    core.patch_namespaced_pod("p", "default", {"status": {"phase": "Running"},
                                               "metadata": {"labels": {"x": "y"}}})
    patched = core.read_namespaced_pod("p", "default")
    assert (patched.status.phase, patched.metadata.labels) == ("Pending", {"x": "y"})
    core.patch_namespaced_pod_status("p", "default", {"status": {"phase": "Running"},
                                                      "metadata": {"labels": {"x": "z"}}})
    after = core.read_namespaced_pod("p", "default")
    assert (after.status.phase, after.metadata.labels) == ("Running", {"x": "y"})


def test_generation_counts_spec_changes_only(batch: Batch) -> None:
    batch.create_namespaced_job("default", job("j"))
    batch.patch_namespaced_job_status("j", "default", {"status": {"active": 1}})
    assert batch.read_namespaced_job("j", "default").metadata.generation == 1
    batch.patch_namespaced_job("j", "default", {"spec": {"suspend": True}})
    read = batch.read_namespaced_job("j", "default")
    assert (read.metadata.generation, read.status.active, read.spec.suspend) == (2, 1, True)


def test_json_patch_and_merge_patch_remove_fields(core: Core) -> None:
    core.create_namespaced_config_map("default", {"metadata": {"name": "c"}, "data": {"a": "1", "b": "2"}})
    core.patch_namespaced_config_map("c", "default", [{"op": "replace", "path": "/data/a", "value": "9"}])
    core.patch_namespaced_config_map("c", "default", {"data": {"b": None}},
                                     _content_type="application/merge-patch+json")
    assert core.read_namespaced_config_map("c", "default").data == {"a": "9"}


def test_deletecollection_takes_a_label_selector(core: Core) -> None:
    for name, app in (("a", "x"), ("b", "x"), ("c", "y")):
        core.create_namespaced_pod("default", pod(name, labels={"app": app}))
    core.delete_collection_namespaced_pod("default", label_selector="app=x")
    assert names(core.list_namespaced_pod("default").items) == ["c"]


def test_unknown_verbs_are_405(api: client.ApiClient, core: Core) -> None:
    core.create_namespaced_pod("default", pod("p"))
    code, data = raw(api, "POST", "/api/v1/namespaces/default/pods/p", body={})
    assert (code, json.loads(data)["reason"]) == (405, "MethodNotAllowed")


# --- selectors and pagination -----------------------------------------------------------------


@pytest.mark.parametrize(("selector", "expected"), [
    ("app=web", ["a", "b"]),
    ("app==web,tier!=db", ["a"]),
    ("tier in (db, cache)", ["b", "c"]),
    ("tier notin (db)", ["a", "c"]),
    ("tier", ["b", "c"]),
    ("!tier", ["a"]),
])
def test_label_selectors(core: Core, selector: str, expected: list[str]) -> None:
    core.create_namespaced_pod("default", pod("a", labels={"app": "web"}))
    core.create_namespaced_pod("default", pod("b", labels={"app": "web", "tier": "db"}))
    core.create_namespaced_pod("default", pod("c", labels={"app": "batch", "tier": "cache"}))
    assert names(core.list_namespaced_pod("default", label_selector=selector).items) == expected


def test_field_selectors_on_pods_and_events(fake: FakeKube, core: Core) -> None:
    core.create_namespaced_pod("default", pod("a", node="n1"))
    core.create_namespaced_pod("default", pod("b"))
    fake.store.patch("pods", "b", {"status": {"phase": "Running"}}, "default", subresource="status")
    assert names(core.list_namespaced_pod("default", field_selector="spec.nodeName=n1").items) == ["a"]
    assert names(core.list_namespaced_pod("default", field_selector="status.phase!=Running").items) \
        == ["a"]
    fake.store.record_event(fake.store.get("pods", "b", "default"), "Scheduled", "assigned to n2")
    fake.store.record_event(fake.store.get("pods", "b", "default"), "Scheduled", "assigned to n2")
    events = core.list_namespaced_event("default", field_selector="involvedObject.name=b").items
    assert [(e.reason, e.count, e.involved_object.kind) for e in events] == [("Scheduled", 2, "Pod")]


def test_an_unsupported_field_selector_is_400(core: Core, custom: Custom
                                              ) -> None:
    code, body = error_of(core.list_namespaced_pod, "default", field_selector="spec.foo=x")
    assert (code, body["reason"], body["message"]) == (
        400, "BadRequest", "field label not supported: spec.foo")
    code, body = error_of(custom.list_namespaced_custom_object, "jobset.x-k8s.io", "v1alpha2", "default",
                          "jobsets", field_selector="spec.foo=x")
    assert (code, body["message"]) == (
        400, '"spec.foo" is not a known field selector: only "metadata.name", "metadata.namespace"')


def test_list_pages_with_limit_and_continue(core: Core) -> None:
    for i in range(5):
        core.create_namespaced_config_map("default", {"metadata": {"name": f"c{i}"}})
    first = core.list_namespaced_config_map("default", limit=2)
    second = core.list_namespaced_config_map("default", limit=2, _continue=first.metadata._continue)
    third = core.list_namespaced_config_map("default", limit=2, _continue=second.metadata._continue)
    assert [names(p.items) for p in (first, second, third)] == [["c0", "c1"], ["c2", "c3"], ["c4"]]
    assert (first.metadata.remaining_item_count, third.metadata._continue) == (3, None)
    assert first.metadata.resource_version == third.metadata.resource_version


def test_a_compacted_continue_token_is_410_expired(fake: FakeKube, core: Core) -> None:
    for i in range(3):
        core.create_namespaced_config_map("default", {"metadata": {"name": f"c{i}"}})
    first = core.list_namespaced_config_map("default", limit=1)
    core.create_namespaced_config_map("default", {"metadata": {"name": "later"}})
    fake.compact()
    code, body = error_of(core.list_namespaced_config_map, "default", limit=1,
                          _continue=first.metadata._continue)
    assert (code, body["reason"]) == (410, "Expired")
    assert body["message"].startswith("The provided continue parameter is too old")


# --- watch ------------------------------------------------------------------------------------


def test_watch_from_a_resource_version_sees_changes_in_order(core: Core) -> None:
    start = core.list_namespaced_pod("default").metadata.resource_version
    core.create_namespaced_pod("default", pod("p"))
    core.patch_namespaced_pod("p", "default", {"metadata": {"labels": {"a": "b"}}})
    core.delete_namespaced_pod("p", "default")
    stream = new_watch().stream(core.list_namespaced_pod, "default", resource_version=start,
                                timeout_seconds=10)
    seen = [(e["type"], e["object"].metadata.name, e["object"].metadata.resource_version)
            for e in islice(stream, 3)]
    assert [t for t, _, _ in seen] == ["ADDED", "MODIFIED", "DELETED"]
    versions = [int(rv) for _, _, rv in seen]
    assert versions == sorted(versions) and len(set(versions)) == 3


def test_watch_without_a_resource_version_starts_with_the_current_objects(core: Core
                                                                          ) -> None:
    core.create_namespaced_pod("default", pod("a"))
    stream = new_watch().stream(core.list_namespaced_pod, "default", timeout_seconds=5)
    first = next(stream)
    core.create_namespaced_pod("default", pod("b"))
    second = next(stream)
    stream.close()
    assert [(e["type"], e["object"].metadata.name) for e in (first, second)] == [("ADDED", "a"),
                                                                                ("ADDED", "b")]


def test_timeout_seconds_ends_a_quiet_watch(fake: FakeKube, core: Core) -> None:
    rv = core.list_namespaced_pod("default").metadata.resource_version
    assert list(new_watch().stream(core.list_namespaced_pod, "default", resource_version=rv,
                                   timeout_seconds=1)) == []
    assert len(fake.calls("watch", "pods")) == 1


def test_a_watch_with_a_label_selector_sees_objects_leave_it(core: Core) -> None:
    start = core.list_namespaced_pod("default").metadata.resource_version
    core.create_namespaced_pod("default", pod("p", labels={"app": "x"}))
    core.patch_namespaced_pod("p", "default", {"metadata": {"labels": {"app": "y"}}})
    stream = new_watch().stream(core.list_namespaced_pod, "default", label_selector="app=x",
                                resource_version=start, timeout_seconds=10)
    seen = [e["type"] for e in islice(stream, 2)]
    assert seen == ["ADDED", "DELETED"]


def test_bookmarks_carry_only_the_resource_version(core: Core) -> None:
    core.create_namespaced_pod("default", pod("p"))
    rv = core.list_namespaced_pod("default").metadata.resource_version
    watcher = new_watch()
    stream = watcher.stream(core.list_namespaced_pod, "default", resource_version=rv,
                            allow_watch_bookmarks=True, timeout_seconds=10)
    event = next(stream)
    watcher.stop()
    assert (event["type"], event["raw_object"]) == (
        "BOOKMARK", {"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": rv}})
    assert watcher.resource_version == rv


def test_a_too_old_resource_version_raises_410_after_one_retry(fake: FakeKube,
                                                               core: Core) -> None:
    old = core.list_namespaced_pod("default").metadata.resource_version
    core.create_namespaced_pod("default", pod("p"))
    fake.compact()
    with pytest.raises(ApiException) as caught:
        list(new_watch().stream(core.list_namespaced_pod, "default", resource_version=old))
    assert caught.value.status == 410
    assert caught.value.reason == f"Expired: too old resource version: {old} ({fake.store.resource_version})"
    assert len(fake.calls("watch", "pods")) == 2  # the client retries once from the same version


def test_history_beyond_its_window_is_expired(fake: FakeKube, core: Core) -> None:
    old = core.list_namespaced_config_map("default").metadata.resource_version
    for i in range(60):
        core.create_namespaced_config_map("default", {"metadata": {"name": f"c{i}"}})
    with pytest.raises(ApiException) as caught:
        list(new_watch().stream(core.list_namespaced_config_map, "default", resource_version=old,
                                  timeout_seconds=5))
    assert caught.value.status == 410


def test_drop_watches_ends_the_stream(fake: FakeKube, core: Core) -> None:
    events: list[str] = []

    def consume() -> None:
        for event in new_watch().stream(core.list_namespaced_pod, "default", timeout_seconds=60):
            events.append(event["type"])

    core.create_namespaced_pod("default", pod("p"))
    consumer = threading.Thread(target=consume)
    consumer.start()
    while not events:
        threading.Event().wait(0.01)
    fake.drop_watches()
    consumer.join(timeout=10)
    assert not consumer.is_alive() and events == ["ADDED"]


def test_the_client_resumes_a_dropped_watch_from_its_last_version(fake: FakeKube,
                                                                  core: Core) -> None:
    created = core.create_namespaced_pod("default", pod("a"))
    stream = new_watch().stream(core.list_namespaced_pod, "default", resource_version="0")
    assert next(stream)["object"].metadata.name == "a"
    fake.drop_watches()
    core.create_namespaced_pod("default", pod("b"))
    assert next(stream)["object"].metadata.name == "b"
    stream.close()
    resumed = fake.calls("watch", "pods")[1]
    assert f"resourceVersion={created.metadata.resource_version}" in resumed.query


def test_an_abrupt_drop_surfaces_as_a_protocol_error(fake: FakeKube, core: Core) -> None:
    core.create_namespaced_pod("default", pod("a"))
    stream = new_watch().stream(core.list_namespaced_pod, "default", timeout_seconds=30)
    next(stream)
    fake.drop_watches(abrupt=True)
    with pytest.raises(urllib3.exceptions.ProtocolError):
        next(stream)


# --- deletion ---------------------------------------------------------------------------------


def test_a_bound_pod_goes_at_once_without_a_terminator(core: Core) -> None:
    core.create_namespaced_pod("default", pod("p", node="n1"))
    answered = core.delete_namespaced_pod("p", "default")
    assert answered.metadata.name == "p" and gone(core, "p")


def test_a_bound_pod_waits_for_its_terminator(fake: FakeKube, core: Core) -> None:
    asked: list[Json] = []
    fake.store.register_pod_terminator(asked.append)
    core.create_namespaced_pod("default", pod("p", node="n1"))
    core.create_namespaced_pod("default", pod("unbound"))
    answered = core.delete_namespaced_pod("p", "default")
    core.delete_namespaced_pod("unbound", "default")
    assert answered.metadata.deletion_timestamp is not None
    assert answered.metadata.deletion_grace_period_seconds == 30
    assert [p["metadata"]["name"] for p in asked] == ["p"] and gone(core, "unbound")
    assert core.read_namespaced_pod("p", "default").metadata.deletion_timestamp is not None
    fake.store.finish_pod_deletion("default", "p")
    assert gone(core, "p")


def test_grace_period_zero_removes_a_bound_pod_at_once(fake: FakeKube, core: Core) -> None:
    asked: list[Json] = []
    fake.store.register_pod_terminator(asked.append)
    core.create_namespaced_pod("default", pod("p", node="n1"))
    core.delete_namespaced_pod("p", "default", grace_period_seconds=0)
    assert gone(core, "p") and asked == []


def test_finalizers_hold_an_object_until_removed(core: Core) -> None:
    core.create_namespaced_config_map("default", {"metadata": {"name": "c", "finalizers": ["x/y"]}})
    core.delete_namespaced_config_map("c", "default")
    held = core.read_namespaced_config_map("c", "default")
    assert held.metadata.deletion_timestamp is not None
    core.patch_namespaced_config_map("c", "default", {"metadata": {"finalizers": None}},
                                     _content_type="application/merge-patch+json")
    code, _ = error_of(core.read_namespaced_config_map, "c", "default")
    assert code == 404


def test_background_deletion_removes_dependents(core: Core, batch: Batch,
                                                fake: FakeKube) -> None:
    owner = fake.store.create("jobs", job("j"), "default")
    core.create_namespaced_pod("default", pod("p", ownerReferences=owned_by(owner)))
    answered = batch.delete_namespaced_job("j", "default", propagation_policy="Background")
    assert answered["status"] == "Success" and answered["details"]["uid"] == owner["metadata"]["uid"]
    assert gone(core, "p")


def test_foreground_deletion_waits_for_blocking_dependents(fake: FakeKube, core: Core,
                                                           batch: Batch) -> None:
    fake.store.register_pod_terminator(lambda pod: None)
    owner = fake.store.create("jobs", job("j"), "default")
    core.create_namespaced_pod("default", pod("p", node="n1", ownerReferences=owned_by(owner, True)))
    batch.delete_namespaced_job("j", "default", propagation_policy="Foreground")
    waiting = batch.read_namespaced_job("j", "default")
    assert waiting.metadata.finalizers == ["foregroundDeletion"]
    assert waiting.metadata.deletion_timestamp is not None
    assert core.read_namespaced_pod("p", "default").metadata.deletion_timestamp is not None
    fake.store.finish_pod_deletion("default", "p")
    code, _ = error_of(batch.read_namespaced_job, "j", "default")
    assert code == 404


def test_jobs_orphan_their_pods_by_default(fake: FakeKube, core: Core,
                                           batch: Batch) -> None:
    owner = fake.store.create("jobs", job("j"), "default")
    core.create_namespaced_pod("default", pod("p", ownerReferences=owned_by(owner)))
    answered = batch.delete_namespaced_job("j", "default")  # typed "object": a dict
    orphan = core.read_namespaced_pod("p", "default")
    assert answered["metadata"]["finalizers"] == ["orphan"] and answered["metadata"]["deletionTimestamp"]
    assert orphan.metadata.owner_references is None
    code, _ = error_of(batch.read_namespaced_job, "j", "default")
    assert code == 404


def test_deleting_a_namespace_deletes_its_objects(core: Core) -> None:
    core.create_namespace({"metadata": {"name": "team"}})
    core.create_namespaced_secret("team", {"metadata": {"name": "s"}})
    core.delete_namespace("team")
    code, _ = error_of(core.read_namespaced_secret, "s", "team")
    assert code == 404 and "team" not in names(core.list_namespace().items)


# --- custom resources, discovery, authorization -----------------------------------------------


def jobset(name: str) -> Json:
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": {"name": name},
            "spec": {"replicatedJobs": [{"name": "workers", "replicas": 1, "template": job("t")}]}}


def test_jobsets_are_served_through_the_custom_objects_api(custom: Custom) -> None:
    args = ("jobset.x-k8s.io", "v1alpha2", "default", "jobsets")
    created = custom.create_namespaced_custom_object(*args, jobset("js"))
    custom.patch_namespaced_custom_object_status(*args, "js", {"status": {"restarts": 1}})
    custom.patch_namespaced_custom_object(*args, "js", {"spec": {"suspend": True}})
    read = custom.get_namespaced_custom_object(*args, "js")
    assert (read["status"], read["spec"]["suspend"]) == ({"restarts": 1}, True)
    assert read["metadata"]["generation"] == 2 and read["metadata"]["uid"] == created["metadata"]["uid"]
    listed = custom.list_namespaced_custom_object(*args)
    assert (listed["kind"], [i["metadata"]["name"] for i in listed["items"]]) == ("JobSetList", ["js"])


def test_the_jobset_crd_is_installed_by_default(api: client.ApiClient) -> None:
    crd = client.ApiextensionsV1Api(api).read_custom_resource_definition("jobsets.jobset.x-k8s.io")
    assert (crd.spec.group, crd.spec.scope, crd.spec.names.kind) == (
        "jobset.x-k8s.io", "Namespaced", "JobSet")
    assert [(v.name, v.served, v.storage) for v in crd.spec.versions] == [("v1alpha2", True, True)]


def test_without_the_crd_jobsets_are_not_served_until_it_is_created() -> None:
    with FakeKube(jobset_crd=False) as fake, client.ApiClient(fake.configuration()) as api:
        custom: Custom = client.CustomObjectsApi(api)
        extensions: Any = client.ApiextensionsV1Api(api)
        code, _ = error_of(extensions.read_custom_resource_definition, "jobsets.jobset.x-k8s.io")
        with pytest.raises(ApiException) as caught:
            custom.list_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", "default", "jobsets")
        assert (code, caught.value.status, caught.value.body) == (404, 404, "404 page not found\n")
        extensions.create_custom_resource_definition(jobset_crd_object())
        listed = custom.list_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", "default", "jobsets")
        assert listed["items"] == []


def test_discovery_finds_every_served_kind(api: client.ApiClient) -> None:
    resources = dynamic.DynamicClient(api).resources  # type: ignore[no-untyped-call]
    found = resources.get(api_version="jobset.x-k8s.io/v1alpha2", kind="JobSet")
    assert (found.name, found.namespaced) == ("jobsets", True)
    assert resources.get(api_version="batch/v1", kind="Job").name == "jobs"
    assert client.VersionApi(api).get_code().major == "1"


def test_forbid_denies_with_the_real_message_and_access_reviews_agree(fake: FakeKube,
                                                                      api: client.ApiClient) -> None:
    core: Core = client.CoreV1Api(api)
    reviews: Any = client.AuthorizationV1Api(api)
    fake.forbid("list", "pods", "default")
    code, body = error_of(core.list_namespaced_pod, "default")
    assert (code, body["reason"]) == (403, "Forbidden")
    assert body["message"] == ('pods is forbidden: User "alice" cannot list resource "pods" in API group '
                               '"" in the namespace "default"')
    review = reviews.create_self_subject_access_review(
        {"spec": {"resourceAttributes": {"namespace": "default", "verb": "list", "resource": "pods"}}})
    assert review.status.allowed is False and review.status.reason
    core.list_namespaced_pod("kube-system")
    fake.allow("list", "pods", "default")
    assert core.list_namespaced_pod("default").items == []
    review = reviews.create_self_subject_access_review(
        {"spec": {"resourceAttributes": {"namespace": "default", "verb": "list", "resource": "pods"}}})
    assert review.status.allowed is True


def test_a_request_without_the_token_is_401(fake: FakeKube) -> None:
    with client.ApiClient(client.Configuration(host=fake.url)) as anonymous:
        code, body = error_of(client.CoreV1Api(anonymous).list_namespaced_pod, "default")
    assert (code, body["reason"], body["message"]) == (401, "Unauthorized", "Unauthorized")


def test_a_kubeconfig_with_a_named_context_loads(fake: FakeKube, tmp_path: Path) -> None:
    path = fake.write_kubeconfig(tmp_path / "config", context="lab", namespace="team")
    loaded: client.ApiClient = config.new_client_from_config(  # type: ignore[no-untyped-call]
        config_file=str(path), context="lab")
    with loaded as api:
        assert names(client.CoreV1Api(api).list_namespace().items) == ["default", "kube-system"]
    _, active = config.list_kube_config_contexts(config_file=str(path))  # type: ignore[no-untyped-call]
    assert (active["name"], active["context"]["namespace"]) == ("lab", "team")


# --- injected failures and the request log ----------------------------------------------------


def test_fail_next_answers_503_then_recovers(fake: FakeKube, core: Core) -> None:
    fake.fail_next("create", "secrets", 503)
    code, body = error_of(core.create_namespaced_secret, "default", {"metadata": {"name": "s"}})
    assert (code, body["reason"]) == (503, "ServiceUnavailable")
    core.create_namespaced_secret("default", {"metadata": {"name": "s"}})
    assert len(fake.calls("create", "secrets")) == 2


def test_a_429_carries_retry_after(fake: FakeKube, core: Core) -> None:
    fake.fail_next("create", "pods", 429)
    with pytest.raises(ApiException) as caught:
        core.create_namespaced_pod("default", pod("p"))
    error: Any = caught.value
    assert (error.status, error.headers["Retry-After"]) == (429, "1")
    assert json.loads(error.body)["details"] == {"retryAfterSeconds": 1}


def test_urllib3_retries_a_read_answered_429_with_retry_after(fake: FakeKube,
                                                              core: Core) -> None:
    fake.fail_next("list", "pods", 429, retry_after=0)
    assert core.list_namespaced_pod("default").items == []
    assert len(fake.calls("list", "pods")) == 2


def test_subscribers_hear_every_change_in_order(fake: FakeKube, core: Core) -> None:
    heard: list[tuple[str, str, str]] = []
    fake.store.subscribe(lambda kind, resource, obj: heard.append((kind, resource, obj["metadata"]["name"])))
    core.create_namespaced_pod("default", pod("p"))
    core.delete_namespaced_pod("p", "default")
    assert heard == [("ADDED", "pods", "p"), ("DELETED", "pods", "p")]


# --- pod logs ---------------------------------------------------------------------------------


def cri(path: Path, *lines: str) -> None:
    with path.open("a") as handle:
        for line in lines:
            handle.write(line + "\n")


def running(fake: FakeKube, name: str, *containers: str) -> None:
    statuses = [{"name": c, "ready": True, "restartCount": 0, "image": "busybox", "imageID": "",
                 "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}} for c in containers]
    fake.store.patch("pods", name, {"status": {"phase": "Running", "containerStatuses": statuses}},
                     "default", subresource="status")


def terminated(fake: FakeKube, name: str, container: str) -> None:
    fake.store.patch("pods", name, {"status": {"phase": "Succeeded", "containerStatuses": [{
        "name": container, "ready": False, "restartCount": 0, "image": "busybox", "imageID": "",
        "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}]}}, "default",
        subresource="status")


@pytest.fixture
def log_pod(fake: FakeKube, core: Core, tmp_path: Path) -> Path:
    core.create_namespaced_pod("default", pod("p", node="n1"))
    running(fake, "p", "worker")
    path = tmp_path / "worker.log"
    cri(path, "2026-01-01T00:00:01.000000001Z stdout F one",
        "2026-01-01T00:00:02.5Z stderr P tw",
        "2026-01-01T00:00:02.6Z stderr F o",
        "2026-01-01T00:00:03Z stdout F three")
    fake.store.set_log_source("default", "p", "worker", path)
    return path


def test_logs_join_partial_lines(core: Core, log_pod: Path) -> None:
    assert core.read_namespaced_pod_log("p", "default") == "one\ntwo\nthree\n"


def test_logs_with_timestamps_tail_since_and_limit(core: Core, log_pod: Path) -> None:
    assert core.read_namespaced_pod_log("p", "default", timestamps=True, tail_lines=1) == \
        "2026-01-01T00:00:03Z three\n"
    assert core.read_namespaced_pod_log("p", "default", limit_bytes=6) == "one\ntw"


def test_logs_since_a_time_or_some_seconds_ago(fake: FakeKube, api: client.ApiClient,
                                               core: Core, log_pod: Path) -> None:
    # CoreV1Api.read_namespaced_pod_log has no since_time (the OpenAPI document leaves it out)
    assert raw(api, "GET", "/api/v1/namespaces/default/pods/p/log",
               [("sinceTime", "2026-01-01T00:00:02Z")]) == (200, b"two\nthree\n")
    now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    cri(log_pod, f"{now} stdout F recent")
    assert core.read_namespaced_pod_log("p", "default", since_seconds=60) == "recent\n"


def test_following_a_log_ends_when_the_container_terminates(fake: FakeKube, core: Core,
                                                            log_pod: Path) -> None:
    lines = new_watch().stream(core.read_namespaced_pod_log, "p", "default", tail_lines=1)
    assert next(lines) == "three"
    cri(log_pod, "2026-01-01T00:00:04Z stdout F four")
    assert next(lines) == "four"
    cri(log_pod, "2026-01-01T00:00:05Z stdout F five")
    terminated(fake, "p", "worker")
    assert list(lines) == ["five"]


def test_following_the_log_of_a_pod_that_goes_sends_its_last_lines(
        fake: FakeKube, core: Core, log_pod: Path) -> None:
    """A pod deleted once its container ended (a graceful deletion's end): the kubelet sends
    the log file to its end all the same, so a follower misses no last line."""
    lines = new_watch().stream(core.read_namespaced_pod_log, "p", "default", tail_lines=1)
    assert next(lines) == "three"
    cri(log_pod, "2026-01-01T00:00:04Z stdout F the last words")
    fake.store.delete("pods", "p", "default", grace_period_seconds=0)
    with pytest.raises(KubeError):
        fake.store.get("pods", "p", "default")
    assert list(lines) == ["the last words"]


def test_log_errors_are_400_with_the_real_messages(fake: FakeKube, core: Core) -> None:
    core.create_namespaced_pod("default", pod("w", node="n1"))
    fake.store.patch("pods", "w", {"status": {"containerStatuses": [{
        "name": "worker", "ready": False, "restartCount": 0, "image": "busybox", "imageID": "",
        "state": {"waiting": {"reason": "ContainerCreating"}}}]}}, "default", subresource="status")
    core.create_namespaced_pod("default", pod("two", node="n1", containers=("worker", "sidecar")))
    _, waiting = error_of(core.read_namespaced_pod_log, "w", "default")
    _, ambiguous = error_of(core.read_namespaced_pod_log, "two", "default")
    _, previous = error_of(core.read_namespaced_pod_log, "w", "default", previous=True)
    assert waiting["message"] == 'container "worker" in pod "w" is waiting to start: ContainerCreating'
    assert ambiguous["message"] == ("a container name must be specified for pod two, choose one of: "
                                    "[worker sidecar]")
    assert previous["message"] == 'previous terminated container "worker" in pod "w" not found'
    assert {waiting["code"], ambiguous["code"], previous["code"]} == {400}


def test_a_running_pod_without_a_log_has_an_empty_one(fake: FakeKube, core: Core,
                                                      tmp_path: Path) -> None:
    core.create_namespaced_pod("default", pod("p", node="n1"))
    running(fake, "p", "worker")
    assert core.read_namespaced_pod_log("p", "default") == ""
    old = tmp_path / "old.log"
    cri(old, "2026-01-01T00:00:01Z stdout F before the restart")
    fake.store.set_log_source("default", "p", "worker", old, previous=True)
    assert core.read_namespaced_pod_log("p", "default", previous=True) == "before the restart\n"


def test_a_body_named_unlike_its_url_is_400(core: Core) -> None:
    core.create_namespaced_config_map("default", {"metadata": {"name": "a"}})
    code, body = error_of(core.replace_namespaced_config_map, "a", "default", {"metadata": {"name": "b"}})
    assert (code, body["reason"], body["message"]) == (
        400, "BadRequest", "the name of the object (b) does not match the name on the URL (a)")


def test_secret_data_that_is_not_base64_is_400(core: Core) -> None:
    code, body = error_of(core.create_namespaced_secret, "default",
                          {"metadata": {"name": "s"}, "data": {"k": "not base64!"}})
    assert (code, body["message"]) == (
        400, 'Secret in version "v1" cannot be handled as a Secret: illegal base64 data at input byte 3')


def test_nodes_are_cluster_scoped_with_a_status_subresource(core: Core) -> None:
    core.create_node({"metadata": {"name": "n1", "labels": {"pool": "gpu"}},
                      "status": {"capacity": {"nvidia.com/gpu": "8"}}})
    core.patch_node_status("n1", {"status": {"conditions": [{"type": "Ready", "status": "True"}]}})
    core.patch_node("n1", {"spec": {"unschedulable": True}, "status": {"capacity": {}}})
    node = core.read_node("n1")
    assert (node.metadata.namespace, node.status.capacity, node.spec.unschedulable) == (
        None, {"nvidia.com/gpu": "8"}, True)
    assert names(core.list_node(field_selector="spec.unschedulable=true").items) == ["n1"]


def test_pods_are_listed_across_namespaces(core: Core) -> None:
    core.create_namespace({"metadata": {"name": "team"}})
    core.create_namespaced_pod("team", pod("a"))
    core.create_namespaced_pod("default", pod("b"))
    listed = core.list_pod_for_all_namespaces()
    assert [(p.metadata.namespace, p.metadata.name) for p in listed.items] == [("default", "b"),
                                                                             ("team", "a")]


def test_delete_options_may_come_in_the_body(fake: FakeKube, core: Core) -> None:
    fake.store.register_pod_terminator(lambda pod: None)
    core.create_namespaced_pod("default", pod("p", node="n1"))
    core.delete_namespaced_pod("p", "default", body=client.V1DeleteOptions(grace_period_seconds=0))
    assert gone(core, "p")


def test_a_terminal_pod_goes_at_once(fake: FakeKube, core: Core) -> None:
    asked: list[Json] = []
    fake.store.register_pod_terminator(asked.append)
    core.create_namespaced_pod("default", pod("p", node="n1"))
    core.patch_namespaced_pod_status("p", "default", {"status": {"phase": "Succeeded"}})
    core.delete_namespaced_pod("p", "default")
    assert gone(core, "p") and asked == []


def test_a_pod_spec_is_immutable_but_its_images_may_change(core: Core) -> None:
    core.create_namespaced_pod("default", pod("p"))
    core.patch_namespaced_pod("p", "default", {"spec": {"containers": [{"name": "worker",
                                                                        "image": "busybox:2"}]}})
    code, body = error_of(core.patch_namespaced_pod, "p", "default", {"spec": {"hostname": "x"}})
    [cause] = body["details"]["causes"]
    assert (code, cause["reason"], cause["field"]) == (422, "FieldValueForbidden", "spec")
    assert cause["message"].startswith("Forbidden: pod updates may not change fields other than")
    assert core.read_namespaced_pod("p", "default").spec.containers[0].image == "busybox:2"


def test_a_binding_assigns_a_pod_to_a_node_once(core: Core) -> None:
    core.create_namespaced_pod("default", pod("p"))
    binding = {"metadata": {"name": "p"}, "target": {"kind": "Node", "name": "n1"}}
    # the server answers a Status, which the client cannot read as the V1Binding it declares
    answered = core.create_namespaced_pod_binding("p", "default", binding, _preload_content=False)
    assert answered.status == 201
    bound = core.read_namespaced_pod("p", "default")
    assert bound.spec.node_name == "n1"
    assert [(c.type, c.status) for c in bound.status.conditions] == [("PodScheduled", "True")]
    code, body = error_of(core.create_namespaced_pod_binding, "p", "default", binding)
    assert (code, body["message"]) == (
        409, 'Operation cannot be fulfilled on pods/binding "p": pod p is already assigned to node "n1"')


def test_qos_class_follows_the_resources(core: Core) -> None:
    guaranteed = pod("g")
    guaranteed["spec"]["containers"][0]["resources"] = {"limits": {"cpu": "1", "memory": "1Gi"}}
    burstable = pod("b")
    burstable["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "1"}}
    assert [core.create_namespaced_pod("default", p).status.qos_class
            for p in (guaranteed, burstable, pod("e"))] == ["Guaranteed", "Burstable", "BestEffort"]


def test_jobsets_are_watched_through_the_custom_objects_api(custom: Custom) -> None:
    args = ("jobset.x-k8s.io", "v1alpha2", "default", "jobsets")
    start = custom.list_namespaced_custom_object(*args)["metadata"]["resourceVersion"]
    custom.create_namespaced_custom_object(*args, jobset("js"))
    custom.delete_namespaced_custom_object(*args, "js")
    stream = new_watch().stream(custom.list_namespaced_custom_object, *args, resource_version=start,
                                timeout_seconds=10)
    assert [(e["type"], e["object"]["kind"]) for e in islice(stream, 2)] == [("ADDED", "JobSet"),
                                                                           ("DELETED", "JobSet")]


def test_forbidding_a_subresource_leaves_the_resource_alone(fake: FakeKube, core: Core,
                                                            log_pod: Path) -> None:
    fake.forbid("get", "pods/log")
    code, body = error_of(core.read_namespaced_pod_log, "p", "default")
    assert (code, body["message"]) == (403, 'pods "p" is forbidden: User "alice" cannot get resource '
                                            '"pods/log" in API group "" in the namespace "default"')
    assert core.read_namespaced_pod("p", "default").metadata.name == "p"
    fake.forbid("*", "nodes")
    code, body = error_of(core.list_node)
    assert (code, body["message"]) == (403, 'nodes is forbidden: User "alice" cannot list resource '
                                            '"nodes" in API group "" at the cluster scope')


def test_an_immutable_config_map_keeps_its_data(core: Core) -> None:
    core.create_namespaced_config_map("default", {"metadata": {"name": "c"}, "data": {"a": "1"},
                                                  "immutable": True})
    core.patch_namespaced_config_map("c", "default", {"metadata": {"labels": {"seen": "yes"}}})
    code, body = error_of(core.patch_namespaced_config_map, "c", "default", {"data": {"a": "2"}})
    assert (code, body["message"]) == (
        422, 'ConfigMap "c" is invalid: data: Forbidden: field is immutable when `immutable` is set')
    assert core.read_namespaced_config_map("c", "default").data == {"a": "1"}


def test_a_config_map_over_one_mebibyte_is_invalid(core: Core) -> None:
    code, body = error_of(core.create_namespaced_config_map, "default",
                          {"metadata": {"name": "big"}, "data": {"blob": "x" * (1 << 20)}})
    assert (code, body["message"]) == (
        422, 'ConfigMap "big" is invalid: []: Too long: must have at most 1048576 bytes')
