"""Operator behaviour end to end: ``kopf run`` against kmock's emulator (see emulator.py).

One emulator and one operator process per module; every test works in its own namespace.
The operator runs with 1 s timers so that periodic work shows up quickly.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from flowprefill_operator.kube import ApiError, Kube

from tests.operator.conftest import load_docs
from tests.operator.emulator import EmulatorThread
from tests.operator.harness import OperatorProcess, kube_for, wait_for
from tests.operator.test_operator_attainment import gateway_metrics

FAST = {
    "FLOWPREFILL_OPERATOR_RECONCILE_INTERVAL_S": "1",
    "FLOWPREFILL_OPERATOR_ATTAINMENT_INTERVAL_S": "1",
    "FLOWPREFILL_OPERATOR_SCRAPE_TIMEOUT_S": "1",
}
GROUP = "flowprefill.io/v1alpha1"


class Cluster:
    def __init__(self, emulator: EmulatorThread, kube: Kube, operator: OperatorProcess) -> None:
        self.emulator = emulator
        self.kube = kube
        self.operator = operator

    def apply_file(self, path: Path, namespace: str) -> None:
        for doc in load_docs(path):
            doc = copy.deepcopy(doc)
            doc["metadata"]["namespace"] = namespace
            self.kube.create(doc)

    def names(self, kind: str, namespace: str) -> set[str]:
        return {o["metadata"]["name"] for o in self.kube.list(kind, namespace)}

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any]:
        obj = self.kube.get(kind, namespace, name)
        assert obj is not None, f"{kind} {namespace}/{name} not found"
        return obj

    def table(self, namespace: str, service: str) -> dict[str, Any]:
        cm = self.get("ConfigMap", namespace, f"{service}-slo-table")
        table: dict[str, Any] = json.loads(cm["data"]["slo-table.json"])
        return table

    def condition(self, namespace: str, pool: str, type_: str) -> tuple[str, str]:
        status = self.get("ServingPool", namespace, pool).get("status") or {}
        for c in status.get("conditions", []):
            if c["type"] == type_:
                return c["status"], c["reason"]
        return ("", "")

    def event_reasons(self, namespace: str, name: str) -> set[str]:
        return {
            e.get("reason", "")
            for e in self.kube.list("Event", namespace)
            if e.get("involvedObject", {}).get("name") == name
        }


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, repo_root: Path) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("kmock")
    emulator = EmulatorThread(sorted((repo_root / "crds").glob("*.yaml"))).start()
    kubeconfig = emulator.write_kubeconfig(tmp / "kubeconfig")
    operator = OperatorProcess(kubeconfig, tmp / "operator.log", FAST).start()
    try:
        yield Cluster(emulator, kube_for(kubeconfig), operator)
    finally:
        operator.stop()
        emulator.stop()


def pool(name: str, service: str, role: str = "prefill", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": GROUP,
        "kind": "ServingPool",
        "metadata": {"name": name},
        "spec": {"service": service, "role": role, "model": {"path": "/models/m"}, **spec},
    }


def slo(name: str, ttft_ms: int, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": GROUP,
        "kind": "SLOClass",
        "metadata": {"name": name},
        "spec": {"taskType": "text", "ttftSloMs": ttft_ms, **spec},
    }


def create(c: Cluster, obj: dict[str, Any], namespace: str) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    obj["metadata"]["namespace"] = namespace
    return c.kube.create(obj)


def test_operator_serves_its_probe(cluster: Cluster) -> None:
    probe = cluster.operator.probe()
    assert probe is not None and "reconciler" in probe


def test_examples_make_the_expected_children(cluster: Cluster, repo_root: Path) -> None:
    ns = "e2e-examples"
    cluster.apply_file(repo_root / "examples" / "slo-classes.yaml", ns)
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
    assert table["default_class"] == "chat"
    assert [c["name"] for c in table["classes"]] == ["chat", "image", "search", "file"]
    prefill = cluster.get("Deployment", ns, "llama3-8b-prefill")
    assert prefill["spec"]["replicas"] == 2
    assert (
        prefill["metadata"]["ownerReferences"][0]["uid"]
        == (cluster.get("ServingPool", ns, "llama3-8b-prefill")["metadata"]["uid"])
    )
    status = wait_for(lambda: cluster.get("ServingPool", ns, "llama3-8b-prefill").get("status"))
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


def test_invalid_spec_sets_degraded_and_posts_an_event(cluster: Cluster) -> None:
    ns = "e2e-invalid"
    # The emulator admits what the CRD schema would refuse: the operator must still say no.
    create(cluster, pool("bad", "m", role="router"), ns)
    wait_for(
        lambda: cluster.condition(ns, "bad", "Degraded") == ("True", "InvalidSpec"),
        what="Degraded/InvalidSpec",
    )
    assert cluster.get("ServingPool", ns, "bad")["status"]["phase"] == "Invalid"
    assert (
        "spec.role"
        in next(
            c
            for c in cluster.get("ServingPool", ns, "bad")["status"]["conditions"]
            if c["type"] == "Degraded"
        )["message"]
    )
    wait_for(lambda: "InvalidSpec" in cluster.event_reasons(ns, "bad"), what="Warning event")
    assert cluster.kube.get("Deployment", ns, "bad") is None
    # Fixing the spec recovers.
    cluster.kube.patch("ServingPool", ns, "bad", {"spec": {"role": "prefill"}})
    wait_for(
        lambda: cluster.condition(ns, "bad", "Degraded") == ("False", "AsExpected"), what="fixed"
    )
    assert cluster.kube.get("Deployment", ns, "bad") is not None


def test_unsatisfiable_specs_are_reported(cluster: Cluster) -> None:
    ns = "e2e-unsat"
    create(
        cluster,
        pool("m-prefill", "m", model={"path": "/models/m", "pvc": {"claimName": "gone"}}),
        ns,
    )
    wait_for(
        lambda: cluster.condition(ns, "m-prefill", "Degraded") == ("True", "ModelVolumeNotFound"),
        what="ModelVolumeNotFound",
    )
    wait_for(lambda: "ModelVolumeNotFound" in cluster.event_reasons(ns, "m-prefill"), what="event")
    create(
        cluster,
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "gone"},
            "spec": {
                "accessModes": ["ReadOnlyMany"],
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
        ns,
    )
    wait_for(lambda: cluster.condition(ns, "m-prefill", "Degraded")[0] == "False", what="PVC found")
    # A pod the scheduler cannot place (no GPU left): InsufficientCapacity.
    selector = {
        "app.kubernetes.io/managed-by": "flowprefill-operator",
        "flowprefill.io/pool": "m-prefill",
    }
    create(
        cluster,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "m-prefill-x", "labels": selector},
            "spec": {"containers": [{"name": "prefill", "image": "i"}]},
            "status": {
                "phase": "Pending",
                "conditions": [
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu.",
                    }
                ],
            },
        },
        ns,
    )
    wait_for(
        lambda: cluster.condition(ns, "m-prefill", "Degraded") == ("True", "InsufficientCapacity"),
        what="InsufficientCapacity",
    )
    wait_for(lambda: "InsufficientCapacity" in cluster.event_reasons(ns, "m-prefill"), what="event")


def test_kv_handoff_the_pools_disagree_on_is_reported_on_both(cluster: Cluster) -> None:
    ns = "e2e-kv"
    create(cluster, pool("m-prefill", "m", kvHandoff={"transport": "http"}), ns)
    create(cluster, pool("m-decode", "m", role="decode"), ns)

    def degraded(name: str) -> str:
        return cluster.condition(ns, name, "Degraded")[0]

    def reason(name: str) -> str:
        return cluster.condition(ns, name, "Degraded")[1]

    for name in ("m-prefill", "m-decode"):
        wait_for(lambda: reason(name) == "KVHandoffMismatch", what=f"{name} KVHandoffMismatch")  # noqa: B023
    message = next(
        c["message"]
        for c in cluster.get("ServingPool", ns, "m-decode")["status"]["conditions"]
        if c["type"] == "Degraded"
    )
    assert message == "this pool has no kvHandoff but prefill pool 'm-prefill' has kvHandoff http"
    wait_for(lambda: "KVHandoffMismatch" in cluster.event_reasons(ns, "m-decode"), what="event")
    # The children are still applied: the pods can run, only the hand-off would not work.
    assert cluster.kube.get("Deployment", ns, "m-decode") is not None
    agree = {"spec": {"kvHandoff": {"transport": "http"}}}
    cluster.kube.patch("ServingPool", ns, "m-decode", agree)
    for name in ("m-prefill", "m-decode"):  # the other pool clears on its next timer
        wait_for(lambda: degraded(name) == "False", what=f"{name} agrees")  # noqa: B023
    decode = cluster.get("Deployment", ns, "m-decode")["spec"]["template"]["spec"]
    assert {"name": "kv", "emptyDir": {}} in decode["volumes"]


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


def test_transient_api_errors_are_retried(cluster: Cluster) -> None:
    ns = "e2e-transient"
    cluster.emulator.fail_next_writes("deployments", 503, 500, 429)
    create(cluster, pool("m-prefill", "m"), ns)
    wait_for(lambda: {"m-prefill", "m-gateway"} <= cluster.names("Deployment", ns), 30, "retried")
    assert "Injected" in cluster.operator.log()


def snapshot(c: Cluster, ns: str) -> dict[tuple[str, str], str]:
    return {
        (kind, o["metadata"]["name"]): o["metadata"]["resourceVersion"]
        for kind in ("ServingPool", "SLOClass", "Deployment", "Service", "ConfigMap", "Event")
        for o in c.kube.list(kind, ns)
    }


def test_operator_restart_changes_nothing(cluster: Cluster) -> None:
    ns = "e2e-restart"
    create(cluster, slo("chat", 250, default=True), ns)
    create(cluster, pool("m-prefill", "m"), ns)
    create(cluster, pool("m-decode", "m", role="decode"), ns)
    wait_for(lambda: cluster.names("Deployment", ns) == {"m-prefill", "m-decode", "m-gateway"})

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
    counts: dict[tuple[str, str], int] = {("chat", "met"): 100, ("chat", "missed"): 100}

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = gateway_metrics(counts).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        create(cluster, slo("chat", 250, default=True), ns)
        create(cluster, slo("file", 6000, taskType="file"), ns)
        create(cluster, pool("m-prefill", "m"), ns)
        labels = {
            "app.kubernetes.io/managed-by": "flowprefill-operator",
            "flowprefill.io/role": "gateway",
        }
        create(
            cluster,
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "m-gateway-abc", "labels": labels},
                "spec": {
                    "containers": [
                        {
                            "name": "gateway",
                            "image": "g",
                            "ports": [{"name": "http", "containerPort": server.server_address[1]}],
                        }
                    ]
                },
                "status": {"phase": "Running", "podIP": "127.0.0.1"},
            },
            ns,
        )
        # The first scrape is a baseline (history before the operator counts for nothing).
        wait_for(
            lambda: (
                (cluster.get("SLOClass", ns, "chat").get("status") or {}).get("requestCount") == 0
            ),
            what="baseline",
        )
        counts[("chat", "met")] += 9
        counts[("chat", "missed")] += 1
        status = wait_for(
            lambda: (
                (s := cluster.get("SLOClass", ns, "chat").get("status") or {}).get("requestCount")
                == 10
                and s
            ),
            what="attainment",
        )
        assert status["attainment"] == pytest.approx(0.9)
        assert status["windowSeconds"] == 300
        assert (cluster.get("SLOClass", ns, "file").get("status") or {}).get("requestCount") == 0
    finally:
        server.shutdown()


def test_api_errors_surface_as_kube_errors(cluster: Cluster) -> None:
    with pytest.raises(ApiError) as err:
        cluster.kube.patch("ServingPool", "e2e-none", "missing", {"spec": {"replicas": 1}})
    assert err.value.status == 404 and not err.value.transient
