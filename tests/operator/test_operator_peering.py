"""Two operator replicas with kopf peering: one reconciles, the other stands by."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.operator.emulator import EmulatorThread
from tests.operator.harness import OperatorProcess, kube_for, wait_for


def test_two_replicas_elect_one_active(tmp_path: Path, repo_root: Path) -> None:
    # The chart's CRDs: ours (files/crds/) plus kopf's peering resources (crds/).
    chart = repo_root / "charts/flowprefill"
    chart_crds = sorted([*chart.glob("crds/*.yaml"), *chart.glob("files/crds/*.yaml")])
    emulator = EmulatorThread(chart_crds).start()
    kubeconfig = emulator.write_kubeconfig(tmp_path / "kubeconfig")
    kube = kube_for(kubeconfig)
    kube.request(
        "POST",
        "/apis/kopf.dev/v1/clusterkopfpeerings",
        {
            "apiVersion": "kopf.dev/v1",
            "kind": "ClusterKopfPeering",
            "metadata": {"name": "flowprefill"},
        },
    )
    replicas = [
        OperatorProcess(
            kubeconfig,
            tmp_path / f"op-{i}.log",
            {
                "POD_NAME": f"flowprefill-operator-{i}",
                "FLOWPREFILL_OPERATOR_RECONCILE_INTERVAL_S": "1",
            },
            peering="flowprefill",
        )
        for i in range(2)
    ]

    def pool(name: str) -> None:
        kube.create(
            {
                "apiVersion": "flowprefill.io/v1alpha1",
                "kind": "ServingPool",
                "metadata": {"name": name, "namespace": "peers"},
                "spec": {"service": name, "role": "prefill", "model": {"path": "/m"}},
            }
        )

    try:
        for r in replicas:
            r.start()
        pool("a")
        wait_for(lambda: kube.get("Deployment", "peers", "a"), 30, "the active replica")
        time.sleep(2)  # a standby that wrongly ran would have acted by now
        active = [r for r in replicas if "created Deployment peers/a" in r.log()]
        assert len(active) == 1, "exactly one replica reconciles"
        standby = next(r for r in replicas if r is not active[0])
        assert "created Deployment" not in standby.log()
        # Fail-over: the active replica leaves (its peering entry goes with it).
        active[0].stop()
        pool("b")
        wait_for(lambda: kube.get("Deployment", "peers", "b"), 60, "the standby taking over")
        assert "created Deployment peers/b" in standby.log()
    except AssertionError:
        for r in replicas:
            print(r.log()[-3000:])
        raise
    finally:
        for r in replicas:
            r.stop()
        emulator.stop()


@pytest.mark.parametrize("name", ["flowprefill-operator-0", "flowprefill-operator-1"])
def test_priorities_differ_per_pod(name: str) -> None:
    from flowprefill_operator.handlers import peering_priority

    assert peering_priority(name) != peering_priority(name[:-1] + "x")
    assert 0 <= peering_priority(name) < 2**28
