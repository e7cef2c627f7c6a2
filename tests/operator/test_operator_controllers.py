"""Controller pieces that need no cluster: the index functions, the index snapshots, the
record of synced SLOClass inputs, KV hand-off agreement and status Events."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import kopf
from flowprefill_operator.builders import PoolRef
from flowprefill_operator.controllers.indexes import (
    ClassEntry,
    classes_by_namespace,
    classes_of,
    pools_by_service,
    pools_of,
    services_of,
)
from flowprefill_operator.controllers.servingpool import kv_mismatch, status_events
from flowprefill_operator.controllers.sloclass import ClassSync
from flowprefill_operator.models import Condition, ServingPoolSpec, ServingPoolStatus

# kopf.index wraps the functions in a type that hides their call signature.
_pools_by_service: Any = pools_by_service
_classes_by_namespace: Any = classes_by_namespace


def pool_body(name: str, service: str = "m", **extra: Any) -> dict[str, Any]:
    meta = {"name": name, "namespace": "ns", "uid": f"uid-{name}", **extra.pop("meta", {})}
    spec = {"service": service, "role": "prefill", "model": {"path": "/m"}, **extra}
    return {"metadata": meta, "spec": spec}


def index_pool(raw: dict[str, Any]) -> Any:
    meta = raw["metadata"]
    body = kopf.Body(cast(kopf.RawBody, raw))
    return _pools_by_service(body=body, name=meta["name"], namespace="ns", uid=meta["uid"])


def index_class(
    name: str, spec: dict[str, Any], status: dict[str, Any] | None = None, **meta: Any
) -> dict[str, ClassEntry]:
    raw = {
        "apiVersion": "flowprefill.io/v1alpha1",
        "kind": "SLOClass",
        "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}", **meta},
        "spec": spec,
        "status": status or {},
    }
    entries: dict[str, ClassEntry] = _classes_by_namespace(
        body=kopf.Body(cast(kopf.RawBody, raw)), name=name, namespace="ns"
    )
    return entries


def test_pools_are_indexed_by_service_unless_invalid_or_deleting() -> None:
    indexed = index_pool(pool_body("a", replicas=2))
    ref = indexed[("ns", "m")]
    assert (ref.name, ref.uid, ref.spec.replicas) == ("a", "uid-a", 2)
    # An empty mapping (not None) is what makes kopf drop the pool from every key.
    assert index_pool(pool_body("a", role="router")) == {}
    assert index_pool(pool_body("a", meta={"deletionTimestamp": "2026-01-01T00:00:00Z"})) == {}


def test_classes_are_indexed_with_invalid_specs_kept_for_judging() -> None:
    good = index_class("chat", {"taskType": "text", "ttftSloMs": 250}, labels={"tier": "gold"})
    entry = good["ns"]
    assert entry.view.spec is not None and entry.view.labels == {"tier": "gold"}
    assert entry.ref["metadata"] == {"name": "chat", "namespace": "ns", "uid": "uid-chat"}
    bad = index_class("broken", {"taskType": "text", "ttftSloMs": "soon"})["ns"]
    assert bad.view.spec is None and bad.view.error and "spec.ttftSloMs" in bad.view.error


class FlakyStore:
    """Fails like a dict the event loop resized mid-copy, then succeeds."""

    def __init__(self, items: list[Any]) -> None:
        self.items, self.failed = items, False

    def __bool__(self) -> bool:
        return True

    def __iter__(self) -> Iterator[Any]:
        if not self.failed:
            self.failed = True
            raise RuntimeError("dictionary changed size during iteration")
        return iter(self.items)


def test_snapshots_sort_and_survive_a_concurrent_resize() -> None:
    spec = ServingPoolSpec.model_validate(pool_body("x")["spec"])
    b, a = PoolRef("b", "ns", "u1", spec), PoolRef("a", "ns", "u2", spec)
    index: Any = {("ns", "m"): FlakyStore([b, a]), ("ns", "k"): [a], ("other", "z"): [b]}
    assert [p.name for p in pools_of(index, "ns", "m")] == ["a", "b"]
    assert pools_of(index, "ns", "none") == []
    assert services_of(index, "ns") == ["k", "m"]
    chat = index_class("chat", {"taskType": "text", "ttftSloMs": 250})["ns"]
    file = index_class("file", {"taskType": "file", "ttftSloMs": 6000})["ns"]
    assert [c.name for c in classes_of(cast(Any, {"ns": [file, chat]}), "ns")] == ["chat", "file"]


def test_class_sync_ignores_status_writes_but_not_spec_labels_or_deletions() -> None:
    spec = {"taskType": "text", "ttftSloMs": 250}
    chat = index_class("chat", spec)["ns"]
    synced = ClassSync()
    assert not synced.is_current("ns", [chat])
    synced.record("ns", [chat])
    written = index_class("chat", spec, status={"accepted": True, "requestCount": 3})["ns"]
    assert synced.is_current("ns", [written])  # our own status write: nothing to do
    assert not synced.is_current("ns", [index_class("chat", {**spec, "ttftSloMs": 300})["ns"]])
    assert not synced.is_current("ns", [index_class("chat", spec, labels={"a": "b"})["ns"]])
    assert not synced.is_current("ns", [])
    assert not synced.is_current("other", [chat])


def test_kv_mismatch_names_the_pools_of_the_other_role() -> None:
    prefill = ServingPoolSpec.model_validate(
        {**pool_body("p")["spec"], "kvHandoff": {"transport": "http"}}
    )
    decode = ServingPoolSpec.model_validate({**pool_body("d")["spec"], "role": "decode"})
    p, d = PoolRef("m-prefill", "ns", "u1", prefill), PoolRef("m-decode", "ns", "u2", decode)
    [problem] = kv_mismatch(d, [p, d])
    assert problem.reason == "KVHandoffMismatch"
    # The decode pool asks for GPUs: no kvHandoff there means nixl.
    assert problem.message == (
        "this pool has kvHandoff nixl (unset: the default on GPUs) but prefill pool "
        "'m-prefill' has kvHandoff http"
    )
    assert kv_mismatch(d, [d]) == []


def test_status_events_on_transitions_only() -> None:
    def status(ready: str, degraded: str, reason: str = "AsExpected") -> ServingPoolStatus:
        return ServingPoolStatus(
            conditions=[
                Condition(type="Ready", status=ready, reason="PodsReady", message="1/1"),
                Condition(type="Degraded", status=degraded, reason=reason, message="why"),
            ]
        )

    assert [e.reason for e in status_events(ServingPoolStatus(), status("True", "False"))] == [
        "Ready"
    ]
    assert status_events(status("True", "False"), status("True", "False")) == []
    went_bad = status_events(status("True", "False"), status("False", "True", "ImagePullFailed"))
    assert [(e.type, e.reason) for e in went_bad] == [("Warning", "ImagePullFailed")]
    assert status_events(status("False", "True", "X"), status("False", "True", "X")) == []
