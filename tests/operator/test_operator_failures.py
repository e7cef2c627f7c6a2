"""Operator failure handling end to end (``kopf run`` against kmock's emulator): invalid and
unsatisfiable specs become Degraded conditions with Events, transient API errors are
retried, API errors reach the caller as typed errors."""

from __future__ import annotations

import pytest
from flowprefill_operator.kube import ApiError

from tests.operator.cluster import Cluster, create, pool
from tests.operator.harness import wait_for


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
        pool("m-prefill", "m", model={"uri": "pvc://gone"}),
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
    # The decode pool asks for a GPU (the default): no kvHandoff there means nixl.
    assert message == (
        "this pool has kvHandoff nixl (unset: the default on GPUs) but prefill pool "
        "'m-prefill' has kvHandoff http"
    )
    wait_for(lambda: "KVHandoffMismatch" in cluster.event_reasons(ns, "m-decode"), what="event")
    # The children are still applied: the pods can run, only the hand-off would not work.
    assert cluster.kube.get("Deployment", ns, "m-decode") is not None
    agree = {"spec": {"kvHandoff": {"transport": "http"}}}
    cluster.kube.patch("ServingPool", ns, "m-decode", agree)
    for name in ("m-prefill", "m-decode"):  # the other pool clears on its next timer
        wait_for(lambda: degraded(name) == "False", what=f"{name} agrees")  # noqa: B023
    decode = cluster.get("Deployment", ns, "m-decode")["spec"]["template"]["spec"]
    assert {"name": "kv", "emptyDir": {"sizeLimit": "9012Mi"}} in decode["volumes"]  # 8Gi + 10 %


def test_transient_api_errors_are_retried(cluster: Cluster) -> None:
    ns = "e2e-transient"
    cluster.emulator.fail_next_writes("deployments", 503, 500, 429)
    create(cluster, pool("m-prefill", "m"), ns)
    wait_for(lambda: {"m-prefill", "m-gateway"} <= cluster.names("Deployment", ns), 30, "retried")
    assert "Injected" in cluster.operator.log()


def test_api_errors_surface_as_kube_errors(cluster: Cluster) -> None:
    with pytest.raises(ApiError) as err:
        cluster.kube.patch("ServingPool", "e2e-none", "missing", {"spec": {"replicas": 1}})
    assert err.value.status == 404 and not err.value.transient


def test_a_decode_tp_nixl_cannot_pull_from_is_refused_before_its_pods_start(
    cluster: Cluster,
) -> None:
    """GPU pools default to the nixl transport; vLLM's consumer reads a prefill of TP 4
    only with decode TP 1 or 4: TP 2 is a condition on both pools, and the decode pool
    created after the prefill pool gets no Deployment until it is fixed."""
    ns = "e2e-nixl-tp"
    create(cluster, pool("m-prefill", "m", engine={"tpSize": 4}, resources={"gpusPerPod": 4}), ns)
    wait_for(lambda: cluster.condition(ns, "m-prefill", "Degraded")[0] != "", what="prefill seen")
    decode = pool("m-decode", "m", role="decode", vllm={"tensorParallelSize": 2},
                  resources={"gpusPerPod": 2})  # fmt: skip
    create(cluster, decode, ns)

    def reason(name: str) -> str:
        return cluster.condition(ns, name, "Degraded")[1]

    for name in ("m-prefill", "m-decode"):
        wait_for(lambda: reason(name) == "NixlTensorParallelRefused", what=f"{name} refused")  # noqa: B023
    message = next(
        c["message"]
        for c in cluster.get("ServingPool", ns, "m-decode")["status"]["conditions"]
        if c["type"] == "Degraded"
    )
    assert "vllm.tensorParallelSize=2" in message and "engine.tpSize=4" in message
    assert cluster.kube.get("Deployment", ns, "m-decode") is None
    cluster.kube.patch("ServingPool", ns, "m-decode", {"spec": {"vllm": {"tensorParallelSize": 1}}})
    wait_for(lambda: cluster.kube.get("Deployment", ns, "m-decode") is not None, what="decode")
    for name in ("m-prefill", "m-decode"):
        wait_for(lambda: reason(name) != "NixlTensorParallelRefused", what=f"{name} clears")  # noqa: B023
