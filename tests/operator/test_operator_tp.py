"""A tensor-parallel prefill pool (``engine.tpSize > 1``) never reaches a pod while the
engine cannot serve it: the CRD refuses it (tests/operator/test_operator_models.py), and an
object admitted anyway (an old CRD; the emulator does not run CEL) is refused by the
operator's parse with a message naming the field."""

from __future__ import annotations

from typing import Any

from tests.operator.cluster import Cluster, create, pool
from tests.operator.harness import wait_for


def test_tp_pool_is_refused_naming_the_field_and_makes_no_pods(cluster: Cluster) -> None:
    ns = "e2e-tp"
    spec: dict[str, Any] = {
        "engine": {"tpSize": 2, "device": "cpu"},
        "resources": {"gpusPerPod": 2},
    }
    create(cluster, pool("tp", "m", **spec), ns)
    wait_for(
        lambda: cluster.condition(ns, "tp", "Degraded") == ("True", "InvalidSpec"),
        what="Degraded/InvalidSpec",
    )
    status = cluster.get("ServingPool", ns, "tp")["status"]
    assert status["phase"] == "Invalid"
    message = next(c for c in status["conditions"] if c["type"] == "Degraded")["message"]
    assert "engine.tpSize must be at most 1" in message
    assert cluster.kube.get("Deployment", ns, "tp") is None
    assert cluster.kube.get("ConfigMap", ns, "tp-engine") is None
    # Back to one rank: the pool is served.
    cluster.kube.patch("ServingPool", ns, "tp", {"spec": {"engine": {"tpSize": 1}}})
    wait_for(lambda: cluster.kube.get("Deployment", ns, "tp") is not None, what="Deployment")
