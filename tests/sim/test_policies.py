"""The simulator's own batching, admission and routing policies."""

from __future__ import annotations

import pytest

from flowprefill.errors import UnknownNameError
from flowprefill.request import RequestState
from flowprefill.scheduler.batching import SLOAwareBatching
from flowprefill.scheduler.core import Scheduler
from flowprefill.sim.batching import (
    GreedyBatching,
    HeadroomBatching,
    MemberAwareBatching,
    MemberHeadroomBatching,
    build_batching,
)
from flowprefill.sim.driver import Instance, Simulation
from flowprefill.sim.gateway import (
    ShedInfeasible,
    ShedQueue,
    SlackRouter,
    get_admission,
    get_router,
)
from flowprefill.sim.plan import Granularity
from flowprefill.sim.pool import SimulatedPool

from .conftest import PREDICTOR, ToyCost, req

P = PREDICTOR.predict_s  # 1 ms per token


def ids(batch: list) -> list[str]:  # type: ignore[type-arg]
    return [r.request_id for r in batch]


def test_greedy_fills_in_order_and_stops_at_the_first_misfit() -> None:
    leader = req("L", 0, 1000, 1.0)
    cands = [req("a", 0, 1000, 1.0), req("b", 0, 3000, 1.0), req("c", 0, 10, 1.0)]
    batch = GreedyBatching().form_batch(leader, cands, now_s=0.0, predict_s=P, token_budget=4096)
    assert ids(batch) == ["L", "a"]


def test_member_aware_checks_every_members_deadline() -> None:
    leader = req("L", 0, 100, 1.0)
    tight = req("t", 0, 100, 0.15)  # alone 0.1 s fits; in a 0.2 s batch it would miss
    late = req("x", 0, 500, 0.2)  # cannot make it even alone
    ok = req("o", 0, 100, 1.0)
    cands = [tight, late, ok]
    slo = SLOAwareBatching().form_batch(leader, cands, now_s=0.0, predict_s=P, token_budget=4096)
    member = MemberAwareBatching().form_batch(
        leader, cands, now_s=0.0, predict_s=P, token_budget=4096
    )
    assert ids(slo) == ["L", "t", "x", "o"]
    assert ids(member) == ["L", "o"]


def test_member_aware_batches_late_leaders_with_other_late_requests() -> None:
    leader = req("L", 0, 300, 0.1)
    cands = [req("x", 0, 300, 0.1), req("ok", 0, 10, 5.0)]
    assert ids(
        SLOAwareBatching().form_batch(leader, cands, now_s=0, predict_s=P, token_budget=4096)
    ) == ["L"]
    member = MemberAwareBatching().form_batch(
        leader, cands, now_s=0, predict_s=P, token_budget=4096
    )
    assert ids(member) == ["L", "x"]


def test_headroom_keeps_half_the_leaders_slack_free() -> None:
    leader = req("L", 0, 100, 1.0)
    cands = [req("a", 0, 300, 5.0), req("b", 0, 300, 5.0)]
    full = SLOAwareBatching().form_batch(leader, cands, now_s=0, predict_s=P, token_budget=4096)
    half = HeadroomBatching().form_batch(leader, cands, now_s=0, predict_s=P, token_budget=4096)
    assert ids(full) == ["L", "a", "b"]  # 0.7 s < 1.0 s
    assert ids(half) == ["L", "a"]  # 0.4 s < 0.5 s, 0.7 s is not


def test_member_headroom_combines_both_rules() -> None:
    leader = req("L", 0, 100, 1.0)
    cands = [req("a", 0, 300, 0.9), req("b", 0, 300, 5.0), req("late", 0, 500, 0.1)]
    batch = MemberHeadroomBatching().form_batch(
        leader, cands, now_s=0, predict_s=P, token_budget=4096
    )
    # a: 0.4 s < 0.5 × min(1.0, 0.9) = 0.45 → in; b: 0.7 s ≥ 0.45 → out; late never joins.
    assert ids(batch) == ["L", "a"]
    late_leader = req("LL", 0, 300, 0.1)
    batch = MemberHeadroomBatching().form_batch(
        late_leader, cands, now_s=0, predict_s=P, token_budget=4096
    )
    assert ids(batch) == ["LL", "late"]


def test_policy_names() -> None:
    assert build_batching("slo-aware").name == "slo-aware"
    assert build_batching("Greedy").name == "greedy"
    with pytest.raises(UnknownNameError, match="batching"):
        build_batching("fifo")
    with pytest.raises(UnknownNameError, match="admission"):
        get_admission("drop-all")
    with pytest.raises(UnknownNameError, match="router"):
        get_router("random")


def _instance(admission=None) -> Instance:  # type: ignore[no-untyped-def]
    sched = Scheduler(predict_s=P, batching=build_batching("none"))
    inst = Instance(sched, SimulatedPool(ToyCost(), Granularity.OPERATOR))
    if admission is not None:
        inst.admission = admission
    return inst


def test_shed_infeasible_rejects_only_requests_that_cannot_make_it_alone() -> None:
    inst = _instance(ShedInfeasible())
    doomed = req("d", 0.0, 500, 0.2)
    fine = req("f", 0.0, 100, 0.2)
    result = Simulation([inst]).run([doomed, fine])
    assert result.num_shed == 1 and doomed.state is RequestState.CANCELLED
    assert fine.ttft_s == pytest.approx(0.1)
    assert result.num_met == 1


def test_shed_queue_counts_the_work_ahead() -> None:
    inst = _instance(ShedQueue())
    first = req("a", 0.0, 400, 1.0)
    second = req("b", 0.0, 400, 0.7)  # earlier deadline: runs first, 0.4 s
    third = req("c", 0.01, 400, 0.75)  # 0.4 s ahead + 0.4 s own > 0.75 s
    result = Simulation([inst]).run([first, second, third])
    assert result.num_shed == 1 and third.state is RequestState.CANCELLED


def test_slack_router_sends_urgent_work_to_the_idle_instance() -> None:
    a, b = _instance(), _instance()
    long = req("long", 0.0, 2000, 10.0)
    urgent = req("urgent", 0.1, 100, 0.2)
    Simulation([a, b], router=SlackRouter()).run([long, urgent])
    assert urgent.ttft_s == pytest.approx(0.1)
    assert b.scheduler.stats.num_submits == 1
