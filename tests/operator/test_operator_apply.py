"""Apply compares as the API server stores things, and never adopts what is not ours.

Unit: the planner against objects the emulator's API-server model (:mod:`.apiserver`)
normalised. End to end (``kopf run`` against the emulator): an operator restart against
normalised objects sends no write at all (counted by the emulator, no-op PATCHes
included), and a same-named object someone else made is left alone and named in status.
"""

from __future__ import annotations

import time

import pytest
from flowprefill_operator.builders import PoolRef, build_pool_children
from flowprefill_operator.diff import last_applied, owned, plan_patch, with_last_applied
from flowprefill_operator.models import ServingPoolSpec
from flowprefill_operator.settings import OperatorSettings

from tests.operator.apiserver import canonical_quantity, normalise
from tests.operator.cluster import Cluster, create, pool
from tests.operator.harness import wait_for

RESOURCES = {"cpu": "1000m", "memory": "1.5Gi", "shmSize": "0.5Gi"}
"""Valid quantities the API server stores differently (1, 1536Mi, 512Mi)."""
CHILDREN = ("deployments", "services", "configmaps")


@pytest.mark.parametrize(
    ("sent", "stored"),
    [
        ("1.5Gi", "1536Mi"),
        ("1000m", "1"),
        ("0.5", "500m"),
        ("1.5", "1500m"),
        ("2000", "2k"),
        ("1500", "1500"),
        ("1.5Ki", "1536"),
        ("0.5Gi", "512Mi"),
        ("1Gi", "1Gi"),
        ("1e3", "1e3"),
        (2, "2"),
    ],
)
def test_emulator_stores_quantities_in_canonical_form(sent: str | int, stored: str) -> None:
    assert canonical_quantity(sent) == stored


def _children() -> list[dict[str, object]]:
    spec = ServingPoolSpec.model_validate(
        {"service": "m", "role": "prefill", "model": {"path": "/m"}, "resources": RESOURCES}
    )
    ref = PoolRef(name="m-prefill", namespace="ns", uid="u1", spec=spec)
    return build_pool_children(ref, OperatorSettings())


def test_objects_the_server_normalised_plan_no_patch() -> None:
    plural = {"Deployment": "deployments", "Service": "services", "ConfigMap": "configmaps"}
    for manifest in _children():
        desired = with_last_applied(manifest)
        stored = normalise(plural[str(manifest["kind"])], desired, None)
        if manifest["kind"] != "ConfigMap":
            assert stored != desired  # the server did change something (defaults at least)
        assert plan_patch(desired, stored, last_applied(stored)) == {}, manifest["kind"]


def test_quantities_compare_by_value() -> None:
    live = {"spec": {"resources": {"limits": {"memory": "1536Mi", "cpu": "1"}}}}
    same = {"spec": {"resources": {"limits": {"memory": "1.5Gi", "cpu": "1000m"}}}}
    assert plan_patch(same, live, {}) == {}
    more = {"spec": {"resources": {"limits": {"memory": "2Gi", "cpu": "1000m"}}}}
    assert plan_patch(more, live, {}) == {"spec": {"resources": {"limits": {"memory": "2Gi"}}}}
    # Only quantity fields compare as quantities: an env value "1000m" is not "1".
    env = {"spec": {"env": [{"name": "X", "value": "1000m"}]}}
    assert plan_patch(env, {"spec": {"env": [{"name": "X", "value": "1"}]}}, {}) == env


def test_ownership_needs_our_label_or_owner_reference() -> None:
    ours = {"metadata": {"labels": {"app.kubernetes.io/managed-by": "flowprefill-operator"}}}
    desired = {**ours, "metadata": {**ours["metadata"], "ownerReferences": [{"uid": "u1"}]}}
    assert owned(ours, desired)
    assert owned({"metadata": {"ownerReferences": [{"uid": "u1"}]}}, desired)
    assert not owned({"metadata": {"labels": {"app": "theirs"}}}, desired)
    assert not owned({"metadata": {}}, desired)


def test_restart_against_normalised_objects_writes_nothing(cluster: Cluster) -> None:
    ns = "apply-restart"
    create(cluster, pool("m-prefill", "m", resources=RESOURCES), ns)
    create(cluster, pool("m-decode", "m", role="decode", resources=RESOURCES), ns)
    wait_for(lambda: cluster.names("Deployment", ns) == {"m-prefill", "m-decode", "m-gateway"})
    container = cluster.get("Deployment", ns, "m-prefill")["spec"]["template"]["spec"][
        "containers"
    ][0]
    assert container["resources"]["limits"]["memory"] == "1536Mi"  # as a cluster stores it

    def writes() -> int:
        return sum(
            cluster.emulator.write_count(p, ns, ("create", "patch", "delete")) for p in CHILDREN
        )

    def settled() -> int | None:
        before = writes()
        time.sleep(2.5)  # two and a half timer periods
        return before if writes() == before else None

    before = wait_for(settled, 60, "no more child writes")
    cluster.operator.stop()
    cluster.operator.start()
    started = time.time()
    wait_for(
        lambda: (p := cluster.operator.probe()) and p.get("reconciler", "") > "", 30, "resumed"
    )
    while time.time() - started < 4:  # resume handlers and several timer runs
        time.sleep(0.5)
    assert writes() == before


def test_a_same_named_foreign_object_is_left_alone(cluster: Cluster) -> None:
    ns = "apply-foreign"
    theirs = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "m-prefill", "labels": {"app": "someone-else"}},
        "spec": {"selector": {"app": "someone-else"}, "ports": [{"port": 80}]},
    }
    create(cluster, theirs, ns)
    before = cluster.get("Service", ns, "m-prefill")
    create(cluster, pool("m-prefill", "m"), ns)
    wait_for(
        lambda: cluster.condition(ns, "m-prefill", "Degraded") == ("True", "NotOwned"),
        what="Degraded/NotOwned",
    )
    status = cluster.get("ServingPool", ns, "m-prefill")["status"]
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert f"Service {ns}/m-prefill" in degraded["message"]
    assert cluster.condition(ns, "m-prefill", "Ready")[0] != "True"
    assert status.get("observedGeneration") is None  # generation 1 was never applied in full
    time.sleep(2)  # a few timer periods: still untouched
    assert cluster.get("Service", ns, "m-prefill") == before
    assert cluster.kube.get("Deployment", ns, "m-prefill") is not None  # the rest is applied
    # The owner removes theirs: the operator creates its own and the condition clears.
    cluster.kube.delete("Service", ns, "m-prefill")
    wait_for(lambda: cluster.condition(ns, "m-prefill", "Degraded")[0] == "False", what="recovered")
    labels = cluster.get("Service", ns, "m-prefill")["metadata"]["labels"]
    assert labels["app.kubernetes.io/managed-by"] == "flowprefill-operator"
    assert cluster.get("ServingPool", ns, "m-prefill")["status"]["observedGeneration"] == 1
