"""Operator behaviour end to end: ``kopf run`` against kmock's emulator (see emulator.py).

One emulator and one operator process per module; every test works in its own namespace.
The operator runs with 1 s timers so that periodic work shows up quickly.
"""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from tests.operator.cluster import GROUP, Cluster, create, pool, slo
from tests.operator.fake_gateway import FakeGateway
from tests.operator.harness import wait_for


def test_operator_serves_its_probe(cluster: Cluster) -> None:
    probe = cluster.operator.probe()
    assert probe is not None and "reconciler" in probe


def test_examples_make_the_expected_children(cluster: Cluster, repo_root: Path) -> None:
    ns = "e2e-examples"
    cluster.apply_file(repo_root / "examples" / "slo-classes.yaml", ns)
    # The example's first step: the Hub token's Secret (kubectl create secret generic).
    token = {"HF_TOKEN": base64.b64encode(b"hf_example").decode()}
    create(cluster, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf-token"},
                     "data": token}, ns)  # fmt: skip
    cluster.apply_file(repo_root / "examples" / "llama3-8b.yaml", ns)
    wait_for(
        lambda: (
            cluster.names("Deployment", ns)
            == {"llama3-8b-prefill", "llama3-8b-decode", "llama3-8b-gateway"}
        ),
        what="deployments",
    )
    wait_for(
        lambda: (
            cluster.names("Service", ns)
            == {"llama3-8b-prefill", "llama3-8b-decode", "llama3-8b-gateway"}
        ),
        what="services",
    )
    assert cluster.names("ConfigMap", ns) >= {
        "llama3-8b-prefill-engine",
        "llama3-8b-gateway",
        "llama3-8b-slo-table",
    }
    for kind in ("Deployment", "Service", "ConfigMap"):
        for obj in cluster.kube.list(kind, ns):
            kubernetes_validate.validate(obj, "1.33", strict=True)
    table = wait_for(
        lambda: (
            len(cluster.table(ns, "llama3-8b")["classes"]) == 4 and cluster.table(ns, "llama3-8b")
        ),
        what="SLO table",
    )
    assert table  # wait_for returns only truthy values; this narrows out the False
    assert table["default_class"] == "chat"
    assert [c["name"] for c in table["classes"]] == ["chat", "image", "search", "file"]
    prefill = cluster.get("Deployment", ns, "llama3-8b-prefill")
    assert prefill["spec"]["replicas"] == 2
    assert (
        prefill["metadata"]["ownerReferences"][0]["uid"]
        == (cluster.get("ServingPool", ns, "llama3-8b-prefill")["metadata"]["uid"])
    )
    status = wait_for(lambda: cluster.get("ServingPool", ns, "llama3-8b-prefill").get("status"))
    assert status is not None  # wait_for returns only truthy values
    assert status["observedGeneration"] == 1
    assert status["phase"] == "Progressing"  # no pods in an emulator
    assert status["gateway"].startswith("http://llama3-8b-gateway.e2e-examples.svc")
    assert (
        status["selector"]
        == "app.kubernetes.io/managed-by=flowprefill-operator,flowprefill.io/pool=llama3-8b-prefill"
    )
    wait_for(
        lambda: all(
            (o.get("status") or {}).get("accepted") for o in cluster.kube.list("SLOClass", ns)
        ),
        what="classes accepted",
    )


def test_scale_subresource_drives_the_deployment(cluster: Cluster) -> None:
    ns = "e2e-scale"
    create(cluster, pool("m-prefill", "m", replicas=1), ns)
    wait_for(lambda: cluster.kube.get("Deployment", ns, "m-prefill"), what="deployment")
    # kubectl scale servingpool m-prefill --replicas=4 (and an HPA) write /scale.
    cluster.kube.patch("ServingPool", ns, "m-prefill", {"spec": {"replicas": 4}}, sub="scale")
    wait_for(
        lambda: cluster.get("Deployment", ns, "m-prefill")["spec"]["replicas"] == 4,
        what="deployment replicas 4",
    )
    scale = cluster.kube.request(
        "GET", f"/apis/{GROUP}/namespaces/{ns}/servingpools/m-prefill/scale"
    )
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 4
    wait_for(
        lambda: cluster.kube.request(
            "GET", f"/apis/{GROUP}/namespaces/{ns}/servingpools/m-prefill/scale"
        )["status"]["selector"],
        what="scale selector for the HPA",
    )
    # Someone edits the Deployment directly: the pool owns replicas, the operator restores it.
    cluster.kube.patch("Deployment", ns, "m-prefill", {"spec": {"replicas": 9}})
    wait_for(
        lambda: cluster.get("Deployment", ns, "m-prefill")["spec"]["replicas"] == 4,
        what="drift repaired",
    )
    # ... and never writes the pool's replicas itself.
    time.sleep(1.5)
    assert cluster.get("ServingPool", ns, "m-prefill")["spec"]["replicas"] == 4


def test_sloclass_edits_update_the_slo_table(cluster: Cluster) -> None:
    ns = "e2e-slo"
    create(cluster, slo("chat", 250, default=True), ns)
    create(cluster, pool("m-prefill", "m", sloClassSelector={"matchLabels": {"tier": "gold"}}), ns)
    create(cluster, pool("m-decode", "m", role="decode"), ns)  # no selector: every class
    wait_for(
        lambda: [c["name"] for c in cluster.table(ns, "m")["classes"]] == ["chat"], what="table"
    )
    cluster.kube.patch("SLOClass", ns, "chat", {"spec": {"ttftSloMs": 300}})
    wait_for(lambda: cluster.table(ns, "m")["classes"][0]["ttft_slo_ms"] == 300, what="edit")
    create(cluster, slo("search", 4000, taskType="search", priority=50), ns)
    wait_for(
        lambda: [c["name"] for c in cluster.table(ns, "m")["classes"]] == ["search", "chat"],
        what="new class, ordered by priority",
    )
    cluster.kube.delete("SLOClass", ns, "search")
    wait_for(
        lambda: [c["name"] for c in cluster.table(ns, "m")["classes"]] == ["chat"], what="delete"
    )
    # A second default is refused (the older one keeps the role) and reported.
    create(cluster, slo("other", 500, default=True), ns)
    wait_for(
        lambda: (
            (cluster.get("SLOClass", ns, "other").get("status") or {}).get("reason")
            == "DuplicateDefault"
        ),
        what="duplicate default",
    )
    assert cluster.table(ns, "m")["default_class"] == "chat"
    wait_for(lambda: "DuplicateDefault" in cluster.event_reasons(ns, "other"), what="event")


def test_deleting_pools_removes_their_children(cluster: Cluster) -> None:
    ns = "e2e-delete"
    create(cluster, slo("chat", 250, default=True), ns)
    create(cluster, pool("m-prefill", "m"), ns)
    create(cluster, pool("m-decode", "m", role="decode"), ns)
    wait_for(lambda: cluster.names("Deployment", ns) == {"m-prefill", "m-decode", "m-gateway"})
    wait_for(
        lambda: (
            len(
                json.loads(cluster.get("ConfigMap", ns, "m-gateway")["data"]["gateway.json"])[
                    "decode"
                ]
            )
            == 1
        )
    )
    cluster.kube.delete("ServingPool", ns, "m-decode")
    wait_for(
        lambda: cluster.names("Deployment", ns) == {"m-prefill", "m-gateway"}, what="decode gone"
    )
    assert "m-decode" not in cluster.names("Service", ns)
    wait_for(
        lambda: (
            json.loads(cluster.get("ConfigMap", ns, "m-gateway")["data"]["gateway.json"])["decode"]
            == []
        ),
        what="gateway forgets the decode pool",
    )
    cluster.kube.delete("ServingPool", ns, "m-prefill")
    wait_for(lambda: not cluster.names("Deployment", ns), what="all deployments gone")
    wait_for(lambda: not cluster.names("ServingPool", ns), what="finalizer released")
    assert not cluster.names("Service", ns)
    assert not cluster.names("ConfigMap", ns)
    assert cluster.names("SLOClass", ns) == {"chat"}  # classes are the user's, not children


def test_reconciles_read_pools_and_classes_from_indexes(cluster: Cluster) -> None:
    ns = "e2e-indexes"
    create(cluster, slo("chat", 250, default=True), ns)
    create(cluster, pool("m-prefill", "m"), ns)
    create(cluster, pool("m-decode", "m", role="decode"), ns)
    wait_for(lambda: cluster.kube.get("Deployment", ns, "m-gateway"), what="gateway")
    lists = {p: cluster.emulator.list_count(p) for p in ("servingpools", "sloclasses")}
    # Several timer periods of every pool of the module, an SLOClass edit and a new pool:
    # kopf's watches keep the indexes current, so nothing lists these resources again.
    cluster.kube.patch("SLOClass", ns, "chat", {"spec": {"ttftSloMs": 300}})
    create(cluster, pool("m-prefill-2", "m"), ns)
    wait_for(
        lambda: (
            len(
                json.loads(cluster.get("ConfigMap", ns, "m-gateway")["data"]["gateway.json"])[
                    "prefill"
                ]
            )
            == 2
            and cluster.table(ns, "m")["classes"][0]["ttft_slo_ms"] == 300
        ),
        what="gateway with both prefill pools and the edited class",
    )
    time.sleep(3)
    assert {p: cluster.emulator.list_count(p) for p in lists} == lists


def snapshot(c: Cluster, ns: str) -> dict[tuple[str, str], str]:
    """resourceVersion of every object; a pool's content instead: the operator releases
    kopf's finalizer from the pools on exit and kopf puts it back on resume (two writes
    that leave the pool as it was, docs/operations.md#uninstall)."""

    def version(kind: str, o: dict[str, Any]) -> str:
        if kind != "ServingPool":
            return str(o["metadata"]["resourceVersion"])
        meta = {k: v for k, v in o["metadata"].items() if k != "resourceVersion"}
        return json.dumps({**o, "metadata": meta}, sort_keys=True)

    return {
        (kind, o["metadata"]["name"]): version(kind, o)
        for kind in ("ServingPool", "SLOClass", "Deployment", "Service", "ConfigMap", "Event")
        for o in c.kube.list(kind, ns)
    }


def test_operator_restart_changes_nothing(cluster: Cluster) -> None:
    ns = "e2e-restart"
    create(cluster, slo("chat", 250, default=True), ns)
    # The prefill pool's replicas are the autoscaler's: its cool-down memory and last
    # decision live in status, so a new process decides the same and writes nothing.
    autoscaling = {"maxReplicas": 3, "shortWindowSeconds": 30, "longWindowSeconds": 60}
    create(cluster, pool("m-prefill", "m", replicasOwner="operator", autoscaling=autoscaling), ns)
    create(cluster, pool("m-decode", "m", role="decode"), ns)
    wait_for(lambda: cluster.names("Deployment", ns) == {"m-prefill", "m-decode", "m-gateway"})
    wait_for(
        lambda: (cluster.get("ServingPool", ns, "m-prefill").get("status") or {}).get("autoscaler"),
        60,
        "the autoscaler's first decision",
    )

    # Settled: every periodic job has written once (the attainment job writes the class's
    # window even with no gateway traffic; on a loaded machine its first write can come
    # late), then two snapshots a few timer periods apart are equal.
    wait_for(
        lambda: "requestCount" in (cluster.get("SLOClass", ns, "chat").get("status") or {}),
        60,
        "the attainment job's first write",
    )

    def settled() -> dict[tuple[str, str], str] | None:
        before = snapshot(cluster, ns)
        time.sleep(3.0)
        return before if snapshot(cluster, ns) == before else None

    before = wait_for(settled, 60, "a settled namespace")
    cluster.operator.stop()
    cluster.operator.start()
    started = time.time()
    # Wait for the new process to resume every pool and run its timers a few times.
    wait_for(
        lambda: (
            (p := cluster.operator.probe())
            and p.get("reconciler", "") > ""
            and time.time() - started > 4
        ),
        30,
        "resumed",
    )
    assert snapshot(cluster, ns) == before


def test_attainment_comes_from_gateway_metrics(cluster: Cluster) -> None:
    ns = "e2e-attainment"
    gateway = FakeGateway()
    gateway.add("chat", met=100, missed=100)  # history before the operator
    try:
        create(cluster, slo("chat", 250, default=True), ns)
        create(cluster, slo("file", 6000, taskType="file"), ns)
        create(cluster, pool("m-prefill", "m"), ns)
        create(cluster, gateway.pod("m"), ns)
        # The first scrape is a baseline (history before the operator counts for nothing).
        wait_for(
            lambda: (
                (cluster.get("SLOClass", ns, "chat").get("status") or {}).get("requestCount") == 0
            ),
            what="baseline",
        )
        gateway.add("chat", met=9, missed=1)
        status = wait_for(
            lambda: (
                (s := cluster.get("SLOClass", ns, "chat").get("status") or {}).get("requestCount")
                == 10
                and s
            ),
            what="attainment",
        )
        assert status  # wait_for returns only truthy values; this narrows out the False
        assert status["attainment"] == pytest.approx(0.9)
        assert status["windowSeconds"] == 300
        assert (cluster.get("SLOClass", ns, "file").get("status") or {}).get("requestCount") == 0
    finally:
        gateway.server.shutdown()
