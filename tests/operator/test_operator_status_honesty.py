"""Status tells the truth about applying (``kopf run`` against the emulator): a child the
API server refuses (403 Forbidden, 422 Invalid: forced by the emulator on one object) is
a Degraded condition naming the object and the error, Ready is never True on a failed
apply, and ``observedGeneration`` only moves once a generation was applied in full."""

from __future__ import annotations

from typing import Any

import pytest
from flowprefill_operator.controllers.common import Context, KeyedLocks, apply_children
from flowprefill_operator.controllers.servingpool import release_finalizer
from flowprefill_operator.kube import ApiError, NotOwned
from flowprefill_operator.settings import OperatorSettings

from tests.operator.cluster import Cluster, create, pool
from tests.operator.harness import wait_for

FINALIZER = "flowprefill.io/finalizer"


def conditions(c: Cluster, ns: str, name: str) -> dict[str, dict[str, Any]]:
    status = c.get("ServingPool", ns, name).get("status") or {}
    return {cond["type"]: cond for cond in status.get("conditions", [])}


def pods_ready(c: Cluster, ns: str, name: str) -> None:
    """Play the Deployment controller: every replica of the current template ready."""
    dep = c.get("Deployment", ns, name)
    n = dep["spec"].get("replicas", 1)
    status = {
        "observedGeneration": dep["metadata"]["generation"],
        "replicas": n,
        "readyReplicas": n,
        "updatedReplicas": n,
        "availableReplicas": n,
    }
    c.kube.patch("Deployment", ns, name, {"status": status}, sub="status")


def test_forbidden_create_shows_in_status(cluster: Cluster) -> None:
    ns = "honest-403"
    cluster.emulator.refuse_writes("deployments", "m-prefill", 403)
    try:
        create(cluster, pool("m-prefill", "m"), ns)
        wait_for(
            lambda: cluster.condition(ns, "m-prefill", "Degraded") == ("True", "Forbidden"),
            what="Degraded/Forbidden",
        )
        conds = conditions(cluster, ns, "m-prefill")
        assert f"Deployment {ns}/m-prefill" in conds["Degraded"]["message"]
        assert "403" in conds["Degraded"]["message"]
        assert "forbidden" in conds["Degraded"]["message"]
        assert (conds["Ready"]["status"], conds["Ready"]["reason"]) == ("False", "Forbidden")
        status = cluster.get("ServingPool", ns, "m-prefill")["status"]
        assert status.get("observedGeneration") is None
        assert status["phase"] == "Degraded"
        # The rest of the pool's children were applied all the same.
        assert cluster.kube.get("Service", ns, "m-prefill") is not None
        wait_for(lambda: "Forbidden" in cluster.event_reasons(ns, "m-prefill"), what="event")
    finally:
        cluster.emulator.refuse_writes("deployments", "m-prefill", None)
    wait_for(
        lambda: cluster.condition(ns, "m-prefill", "Degraded") == ("False", "AsExpected"),
        what="recovered once allowed",
    )
    assert cluster.get("ServingPool", ns, "m-prefill")["status"]["observedGeneration"] == 1


def test_invalid_update_keeps_ready_false_and_the_old_generation(cluster: Cluster) -> None:
    ns = "honest-422"
    create(cluster, pool("m-prefill", "m"), ns)
    wait_for(lambda: cluster.kube.get("Deployment", ns, "m-prefill"), what="deployment")
    pods_ready(cluster, ns, "m-prefill")
    wait_for(lambda: cluster.condition(ns, "m-prefill", "Ready")[0] == "True", what="Ready")
    assert cluster.get("ServingPool", ns, "m-prefill")["status"]["observedGeneration"] == 1

    cluster.emulator.refuse_writes("deployments", "m-prefill", 422)
    try:
        cluster.kube.patch("ServingPool", ns, "m-prefill", {"spec": {"image": "other:2"}})
        wait_for(
            lambda: cluster.condition(ns, "m-prefill", "Degraded") == ("True", "Invalid"),
            what="Degraded/Invalid",
        )
        conds = conditions(cluster, ns, "m-prefill")
        assert conds["Ready"]["status"] == "False"  # the old pods run, ready, but stale
        assert "422" in conds["Degraded"]["message"]
        assert f"Deployment {ns}/m-prefill" in conds["Degraded"]["message"]
        assert "is invalid" in conds["Degraded"]["message"]
        pool_obj = cluster.get("ServingPool", ns, "m-prefill")
        assert pool_obj["metadata"]["generation"] == 2
        assert pool_obj["status"]["observedGeneration"] == 1
    finally:
        cluster.emulator.refuse_writes("deployments", "m-prefill", None)
    wait_for(
        lambda: cluster.get("ServingPool", ns, "m-prefill")["status"]["observedGeneration"] == 2,
        what="generation 2 applied",
    )
    image = cluster.get("Deployment", ns, "m-prefill")["spec"]["template"]["spec"]["containers"][0]
    assert image["image"] == "other:2"


class FakeKube:
    """apply() raises what it is told per object name; patch() records."""

    def __init__(self, errors: dict[str, Exception], live: dict[str, Any] | None = None) -> None:
        self.errors = errors
        self.live = live
        self.applied: list[str] = []
        self.patches: list[dict[str, Any]] = []

    def apply(self, manifest: dict[str, Any]) -> str:
        name = manifest["metadata"]["name"]
        if name in self.errors:
            raise self.errors[name]
        self.applied.append(name)
        return "created"

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.live

    def patch(self, kind: str, namespace: str, name: str, patch: dict[str, Any]) -> None:
        self.patches.append(patch)


def manifest(name: str) -> dict[str, Any]:
    return {"kind": "ConfigMap", "metadata": {"name": name, "namespace": "ns"}}


def test_refusals_become_problems_naming_the_object() -> None:
    kube = FakeKube(
        {
            "a": ApiError(403, "Forbidden", "no"),
            "b": ApiError(422, "Invalid", "bad"),
            "c": ApiError(400, "BadRequest", "odd"),
            "d": NotOwned("ConfigMap", "ns", "d"),
        }
    )
    names = ["a", "b", "ok", "c", "d"]
    problems = apply_children(kube, [manifest(n) for n in names])  # type: ignore[arg-type]
    assert kube.applied == ["ok"]  # the others are still applied
    assert [(p.reason, p.not_applied) for p in problems] == [
        ("Forbidden", True),
        ("Invalid", True),
        ("ApplyFailed", True),
        ("NotOwned", True),
    ]
    assert problems[0].message == "ConfigMap ns/a: 403 Forbidden: no"
    assert "ConfigMap ns/d exists and is not managed by the operator" in problems[3].message


def test_transient_errors_still_retry_the_reconcile() -> None:
    kube = FakeKube({"a": ApiError(503, "ServiceUnavailable", "later")})
    with pytest.raises(ApiError):
        apply_children(kube, [manifest("a")])  # type: ignore[arg-type]


def test_release_keeps_other_finalizers() -> None:
    live = {"metadata": {"finalizers": ["x.io/keep", FINALIZER], "resourceVersion": "7"}}
    kube = FakeKube({}, live)
    ctx = Context(kube, OperatorSettings(), KeyedLocks())  # type: ignore[arg-type]
    assert release_finalizer(ctx, "ns", "p", FINALIZER)
    assert kube.patches == [{"metadata": {"finalizers": ["x.io/keep"], "resourceVersion": "7"}}]
    kube.live = {"metadata": {"finalizers": ["x.io/keep"], "resourceVersion": "8"}}
    assert not release_finalizer(ctx, "ns", "p", FINALIZER)  # nothing to do
