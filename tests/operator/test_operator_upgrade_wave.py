"""An operator upgrade rolls the pools a few at a time (issue 22 item 1): pod-template
changes of the operator's own wait their turn with condition UpdatePending; the user's
changes of a pool's spec apply at once (operator/flowprefill_operator/controllers/upgrades.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from flowprefill_operator.controllers.upgrades import (
    CAUSE,
    SPEC_DIGEST,
    rolling,
    spec_digest,
    template_differs,
)
from flowprefill_operator.diff import with_last_applied

from tests.operator.cluster import FAST, Cluster, create, pool, running_cluster
from tests.operator.harness import OperatorProcess, wait_for
from tests.operator.test_operator_status_honesty import pods_ready as settle

OLD, NEW = "reg/prefill:0.1.0", "reg/prefill:0.2.0"
POOLS = [("wave-a", "p1"), ("wave-a", "p2"), ("wave-b", "p3")]


def _deployment(
    image: str, replicas: int = 1, status: dict[str, int] | None = None
) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d", "namespace": "n", "generation": 2},
        "spec": {
            "replicas": replicas,
            "template": {"spec": {"containers": [{"name": "c", "image": image}]}},
        },
        "status": status or {},
    }


def test_only_the_template_and_the_spec_without_replicas_count() -> None:
    live = with_last_applied(_deployment(OLD))
    assert not template_differs(_deployment(OLD, replicas=3), live)
    assert template_differs(_deployment(NEW), live)
    spec = {"service": "m", "role": "prefill", "replicas": 1}
    assert spec_digest(spec) == spec_digest({**spec, "replicas": 7})
    assert spec_digest(spec) != spec_digest({**spec, "role": "decode"})


def test_a_deployment_rolls_until_every_replica_runs_the_new_template() -> None:
    done = {"observedGeneration": 2, "updatedReplicas": 2, "availableReplicas": 2, "replicas": 2}
    assert not rolling(_deployment(OLD, 2, done))
    assert rolling(_deployment(OLD, 2, {**done, "observedGeneration": 1}))
    assert rolling(_deployment(OLD, 2, {**done, "updatedReplicas": 1}))
    assert rolling(_deployment(OLD, 2, {**done, "availableReplicas": 1}))
    assert rolling(_deployment(OLD, 2, {**done, "replicas": 3}))  # an old pod still there


# ---- against the emulator: an upgrade of the operator's default image ------------------


def image(c: Cluster, ns: str, name: str) -> str:
    spec = c.get("Deployment", ns, name)["spec"]["template"]["spec"]
    return str(next(x for x in spec["containers"] if x["name"] == "prefill")["image"])


def pending(c: Cluster, ns: str, name: str, status: str) -> bool:
    return c.condition(ns, name, "UpdatePending")[0] == status


def upgraded(c: Cluster) -> list[str]:
    return [name for ns, name in POOLS if image(c, ns, name) == NEW]


@pytest.fixture
def upgrading(tmp_path: Path, repo_root: Path) -> Iterator[Cluster]:
    """Three settled pools in two namespaces under an operator with image 0.1.0, then the
    same cluster under an operator with image 0.2.0 (as after ``helm upgrade``)."""
    with running_cluster(tmp_path, repo_root, {"FLOWPREFILL_OPERATOR_PREFILL_IMAGE": OLD}) as c:
        for ns, name in POOLS:
            create(c, pool(name, name), ns)
        for ns, name in POOLS:
            wait_for(partial(c.kube.get, "Deployment", ns, name), what=name)
            settle(c, ns, name)
        c.operator.stop()
        upgraded = OperatorProcess(
            tmp_path / "kubeconfig",
            tmp_path / "operator-2.log",
            {**FAST, "FLOWPREFILL_OPERATOR_PREFILL_IMAGE": NEW},
        )
        c.operator = upgraded.start()
        try:
            yield c
        finally:
            upgraded.stop()  # running_cluster stops only the operator it started


def test_an_operator_upgrade_rolls_one_pool_at_a_time(upgrading: Cluster) -> None:
    c = upgrading
    first = wait_for(lambda: upgraded(c), what="the first pool's new template")
    assert len(first) == 1
    waiting = [(ns, name) for ns, name in POOLS if name not in first]
    for ns, name in waiting:
        wait_for(partial(pending, c, ns, name, "True"), what=f"{name} UpdatePending")
        assert c.condition(ns, name, "Ready") == ("True", "PodsReady")  # the old pods serve
    message = next(
        x["message"]
        for x in c.get("ServingPool", *waiting[0])["status"]["conditions"]
        if x["type"] == "UpdatePending"
    )
    assert "maxPoolsUpdating" in message and first[0] in message
    time.sleep(3)  # several reconciles (1 s timers): nobody else starts while it rolls
    assert upgraded(c) == first
    # Each pool that finishes hands the slot on; at no time do two roll.
    settled: set[str] = set()
    while len(settled) < len(POOLS):
        rolling_now = [name for name in upgraded(c) if name not in settled]
        assert len(rolling_now) == 1, rolling_now
        settle(c, next(ns for ns, name in POOLS if name == rolling_now[0]), rolling_now[0])
        settled.add(rolling_now[0])
        if len(settled) < len(POOLS):
            wait_for(lambda: len(upgraded(c)) == len(settled) + 1, what="the next pool's turn")
    for ns, name in POOLS:
        wait_for(partial(pending, c, ns, name, "False"), what=f"{name} up to date")
        notes = c.get("Deployment", ns, name)["metadata"]["annotations"]
        assert notes[CAUSE] == "operator" and SPEC_DIGEST in notes


def test_the_users_edit_applies_at_once_and_scaling_does_not(upgrading: Cluster) -> None:
    c = upgrading
    first = wait_for(lambda: upgraded(c), what="the first pool's new template")
    ns, held = next((ns, name) for ns, name in POOLS if name not in first)
    wait_for(lambda: c.condition(ns, held, "UpdatePending")[0] == "True", what="held")
    # kubectl scale (or the autoscaler) is no signal: the count moves, the template waits.
    c.kube.patch("ServingPool", ns, held, {"spec": {"replicas": 2}}, sub="scale")
    wait_for(lambda: c.get("Deployment", ns, held)["spec"]["replicas"] == 2, what="scaled")
    assert image(c, ns, held) == OLD
    # An edit of the spec is: applied now, whatever the wave.
    c.kube.patch("ServingPool", ns, held, {"spec": {"rollout": {"drainSeconds": 30}}})
    wait_for(lambda: image(c, ns, held) == NEW, what="the edited pool's new template")
    wait_for(lambda: c.condition(ns, held, "UpdatePending")[0] == "False", what="not pending")
    assert c.get("Deployment", ns, held)["metadata"]["annotations"][CAUSE] == "spec"
    assert len(upgraded(c)) == 2  # the third still waits for the first
