"""Uninstall in both orders leaves nothing Terminating (``kopf run`` against the emulator,
which garbage-collects by ownerReferences as kube-controller-manager does).

kopf keeps its finalizer on every pool while it runs timers on it; the operator releases
it on a graceful exit, so pools deleted after the operator is gone (``helm uninstall``
first) disappear at once, and their children follow by garbage collection."""

from __future__ import annotations

from pathlib import Path

from tests.operator.cluster import Cluster, create, pool, running_cluster, slo
from tests.operator.harness import wait_for

FINALIZER = "flowprefill.io/finalizer"
KINDS = ("ServingPool", "Deployment", "Service", "ConfigMap")


def install(c: Cluster, ns: str) -> None:
    create(c, slo("chat", 250, default=True), ns)
    create(c, pool("m-prefill", "m"), ns)
    create(c, pool("m-decode", "m", role="decode"), ns)
    wait_for(lambda: c.names("Deployment", ns) == {"m-prefill", "m-decode", "m-gateway"})
    wait_for(
        lambda: all(
            FINALIZER in (p["metadata"].get("finalizers") or [])
            for p in c.kube.list("ServingPool", ns)
        ),
        what="kopf's finalizer on every pool while it runs",
    )


def terminating(c: Cluster, ns: str) -> list[str]:
    return [
        f"{kind}/{o['metadata']['name']}"
        for kind in KINDS
        for o in c.kube.list(kind, ns)
        if o["metadata"].get("deletionTimestamp")
    ]


def leftovers(c: Cluster, ns: str) -> dict[str, set[str]]:
    return {kind: names for kind in KINDS if (names := c.names(kind, ns))}


def test_delete_pools_then_the_operator(tmp_path: Path, repo_root: Path) -> None:
    ns = "uninstall-pools-first"
    with running_cluster(tmp_path, repo_root) as c:
        install(c, ns)
        for name in ("m-prefill", "m-decode"):
            c.kube.delete("ServingPool", ns, name)
        wait_for(lambda: not leftovers(c, ns), what="pools and children gone")
        c.operator.stop()
        assert not terminating(c, ns)
        assert c.names("SLOClass", ns) == {"chat"}  # the user's, not the operator's


def test_stop_the_operator_then_delete_pools(tmp_path: Path, repo_root: Path) -> None:
    ns = "uninstall-operator-first"
    with running_cluster(tmp_path, repo_root) as c:
        install(c, ns)
        c.operator.stop()  # helm uninstall: SIGTERM to the operator's pod
        for p in c.kube.list("ServingPool", ns):
            assert FINALIZER not in (p["metadata"].get("finalizers") or [])
        for name in ("m-prefill", "m-decode"):
            c.kube.delete("ServingPool", ns, name)
        # No operator: the pools go at once, the garbage collector takes their children.
        assert not terminating(c, ns)
        assert not leftovers(c, ns)
        c.operator.start()  # for the context manager's stop
