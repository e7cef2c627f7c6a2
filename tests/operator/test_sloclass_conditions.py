"""SLOClass status: Ready and Degraded conditions, and attainment written at a rate that
does not churn etcd (:mod:`flowprefill_operator.classstatus` states the rule)."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

from flowprefill_operator.classstatus import (
    REFRESH_S,
    attainment_patch,
    set_condition,
)
from flowprefill_operator.models import Condition

from tests.operator.cluster import Cluster, create, pool, slo
from tests.operator.fake_gateway import FakeGateway
from tests.operator.harness import wait_for

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def fields(attainment: float | None, requests: int) -> dict[str, Any]:
    return {
        "attainment": attainment,
        "requestCount": requests,
        "shedCount": 0,
        "windowSeconds": 300,
    }


def written(status: dict[str, Any], patch: dict[str, Any] | None) -> dict[str, Any]:
    assert patch is not None
    return {**status, **patch["status"]}


def degraded(status: dict[str, Any]) -> tuple[str, str]:
    c = next(c for c in status["conditions"] if c["type"] == "Degraded")
    return c["status"], c["reason"]


def test_first_window_is_written_with_its_condition() -> None:
    status = written({}, attainment_patch({}, fields(None, 0), 0.9, 1, T0))
    assert degraded(status) == ("False", "NoTraffic")
    assert status["attainmentTime"] == "2026-01-01T00:00:00Z"


def test_small_changes_wait_for_the_refresh_period() -> None:
    status = written({}, attainment_patch({}, fields(0.95, 400), 0.9, 1, T0))
    assert degraded(status) == ("False", "AttainmentMet")
    # More requests, attainment within a point: not written for 5 minutes.
    for seconds in (30, 60, 290):
        later = T0 + timedelta(seconds=seconds)
        assert attainment_patch(status, fields(0.955, 400 + seconds), 0.9, 1, later) is None
    later = T0 + timedelta(seconds=REFRESH_S)
    status = written(status, attainment_patch(status, fields(0.955, 700), 0.9, 1, later))
    assert status["requestCount"] == 700
    # Nothing changed at all: never written, however old.
    much_later = later + timedelta(hours=1)
    assert attainment_patch(status, fields(0.955, 700), 0.9, 1, much_later) is None


def test_a_point_of_attainment_or_a_condition_change_is_written_at_once() -> None:
    status = written({}, attainment_patch({}, fields(0.95, 400), 0.9, 1, T0))
    soon = T0 + timedelta(seconds=30)
    status = written(status, attainment_patch(status, fields(0.94, 430), 0.9, 1, soon))
    assert status["attainment"] == 0.94
    # Below the target: Degraded turns True with its reason, at once.
    status = written(status, attainment_patch(status, fields(0.899, 460), 0.9, 1, soon))
    assert degraded(status) == ("True", "AttainmentBelowTarget")
    cond = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert "0.8990 < target 0.9" in cond["message"]
    # Too few requests to judge: NoTraffic, not Degraded.
    quiet = written(status, attainment_patch(status, fields(0.5, 3), 0.9, 1, soon))
    assert degraded(quiet) == ("False", "NoTraffic")


def test_transition_time_moves_only_with_the_status() -> None:
    ready = Condition(type="Ready", status="True", reason="Accepted")
    first = set_condition([], ready, "t1")
    again = set_condition(first, ready.model_copy(update={"message": "m"}), "t2")
    assert again[0].last_transition_time == "t1"
    flipped = set_condition(again, ready.model_copy(update={"status": "False"}), "t3")
    assert flipped[0].last_transition_time == "t3"


def conditions(c: Cluster, ns: str, name: str) -> dict[str, tuple[str, str]]:
    status = c.get("SLOClass", ns, name).get("status") or {}
    return {x["type"]: (x["status"], x["reason"]) for x in status.get("conditions", [])}


def test_ready_condition_follows_the_verdict(cluster: Cluster) -> None:
    ns = "slo-ready"
    create(cluster, slo("chat", 250, default=True), ns)
    create(cluster, pool("m-prefill", "m"), ns)
    wait_for(lambda: conditions(cluster, ns, "chat").get("Ready") == ("True", "Accepted"))
    create(cluster, slo("second", 300, default=True), ns)
    wait_for(
        lambda: conditions(cluster, ns, "second").get("Ready") == ("False", "DuplicateDefault"),
        what="a second default is not Ready",
    )


def test_degraded_below_target_and_no_churn(cluster: Cluster) -> None:
    ns = "slo-degraded"
    gateway = FakeGateway()
    try:
        create(cluster, slo("chat", 250, default=True, attainmentTarget=0.9), ns)
        create(cluster, pool("m-prefill", "m"), ns)
        create(cluster, gateway.pod("m"), ns)
        wait_for(
            lambda: conditions(cluster, ns, "chat").get("Degraded") == ("False", "NoTraffic"),
            what="baseline window",
        )
        gateway.add("chat", met=50, missed=50)
        wait_for(
            lambda: (
                conditions(cluster, ns, "chat").get("Degraded") == ("True", "AttainmentBelowTarget")
            ),
            what="Degraded/AttainmentBelowTarget",
        )
        assert conditions(cluster, ns, "chat")["Ready"] == ("True", "Accepted")
        # Steady traffic at the same attainment: counts grow on every 1 s scrape, but the
        # status is not rewritten within the refresh period.
        before = cluster.emulator.write_count("sloclasses", ns, ("patch/status",))
        for _ in range(5):
            gateway.add("chat", met=10, missed=10)
            time.sleep(1.0)
        assert cluster.emulator.write_count("sloclasses", ns, ("patch/status",)) == before
    finally:
        gateway.server.shutdown()
