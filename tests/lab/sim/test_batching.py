"""The simulator's ablation batchings on hand-built queues, and the names it builds them by.

Predictions are 1 ms per token, so a batch of ``n`` tokens takes ``n / 1000`` s.
"""

from __future__ import annotations

import pytest

from flowprefill.errors import UnknownNameError
from flowprefill.lab.sim.batching import (
    SIM_BATCHING,
    AblationBatching,
    GreedyBatching,
    HeadroomBatching,
    MemberAwareBatching,
    get_batching,
)
from flowprefill.prefill.request import Request
from flowprefill.prefill.scheduler.batching import (
    BATCHING,
    MemberHeadroomBatching,
    NoBatching,
    SLOAwareBatching,
)


def P(n: int) -> float:
    return n / 1000.0


def req(rid: str, tokens: int, slo_s: float) -> Request:
    return Request.create(rid, arrival_s=0.0, ttft_slo_s=slo_s, num_tokens=tokens)


def form(policy, leader: Request, cands: list[Request], budget: int = 4096) -> list[str]:  # type: ignore[no-untyped-def]
    batch = policy.form_batch(leader, cands, now_s=0.0, predict_s=P, token_budget=budget)
    return [r.request_id for r in batch]


def test_member_aware_refuses_a_member_that_would_miss_its_own_deadline() -> None:
    leader = req("L", 100, 1.0)
    tight = req("t", 100, 0.15)  # alone 0.1 s < 0.15 s; in the 0.2 s batch it would miss
    assert form(SLOAwareBatching(), leader, [tight]) == ["L", "t"]
    assert form(MemberAwareBatching(), leader, [tight]) == ["L"]


def test_member_aware_lets_a_batch_take_all_of_the_tightest_slack() -> None:
    leader = req("L", 100, 1.0)
    cands = [req("a", 300, 5.0), req("b", 300, 5.0)]
    assert form(MemberAwareBatching(), leader, cands) == ["L", "a", "b"]  # 0.7 s < 1.0 s
    assert form(MemberHeadroomBatching(), leader, cands) == ["L", "a"]  # 0.4 < 0.5 ≤ 0.7


def test_headroom_keeps_half_the_leaders_slack_free() -> None:
    leader = req("L", 100, 1.0)
    cands = [req("a", 300, 5.0), req("b", 300, 5.0)]
    assert form(SLOAwareBatching(), leader, cands) == ["L", "a", "b"]  # 0.7 s < 1.0 s
    assert form(HeadroomBatching(), leader, cands) == ["L", "a"]  # 0.4 < 0.5 ≤ 0.7


def test_greedy_fills_in_order_and_stops_at_the_first_misfit() -> None:
    leader = req("L", 1000, 1.0)
    cands = [req("a", 1000, 1.0), req("b", 3000, 1.0), req("c", 10, 1.0)]
    assert form(GreedyBatching(), leader, cands) == ["L", "a"]
    assert form(NoBatching(), leader, cands) == ["L"]


def test_the_simulator_builds_the_engines_batchings_and_its_ablations_by_name() -> None:
    assert set(SIM_BATCHING) == set(BATCHING) | set(AblationBatching)
    assert not set(BATCHING) & set(AblationBatching)
    for name, cls in SIM_BATCHING.items():
        assert type(get_batching(name)) is cls
        assert get_batching(name).name == name
    assert type(get_batching("Member_Aware")) is MemberAwareBatching
    assert type(get_batching("member_headroom")) is MemberHeadroomBatching
    with pytest.raises(UnknownNameError, match="batching policy 'fifo'") as e:
        get_batching("fifo")
    assert set(e.value.known) == set(SIM_BATCHING)
