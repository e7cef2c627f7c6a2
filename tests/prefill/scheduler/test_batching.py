"""The engine's batching policies on hand-built queues, by name, and inside the engine.

Predictions are 1 ms per token unless said otherwise, so a batch of ``n`` tokens takes
``n / 1000`` s and every admission below can be checked by hand.
"""

from __future__ import annotations

import time

import pytest

from flowprefill.contracts import EngineConfig
from flowprefill.contracts.names import Batching
from flowprefill.errors import UnknownNameError
from flowprefill.prefill.engine import PrefillEngine
from flowprefill.prefill.request import Request
from flowprefill.prefill.scheduler.batching import (
    BATCHING,
    MemberHeadroomBatching,
    NoBatching,
    SLOAwareBatching,
    get_batching,
)
from flowprefill.prefill.scheduler.core import Scheduler
from flowprefill.prefill.scheduler.policies import get_policy
from tests.prefill.test_engine import PREDICTOR as ENGINE_PREDICTOR
from tests.prefill.test_engine import SteppedBackend, prompt


def P(n: int) -> float:
    return n / 1000.0


def req(rid: str, tokens: int, slo_s: float, arrival_s: float = 0.0) -> Request:
    return Request.create(rid, arrival_s=arrival_s, ttft_slo_s=slo_s, num_tokens=tokens)


def ids(batch: list[Request]) -> list[str]:
    return [r.request_id for r in batch]


def form(policy, leader: Request, cands: list[Request], budget: int = 4096) -> list[str]:  # type: ignore[no-untyped-def]
    return ids(policy.form_batch(leader, cands, now_s=0.0, predict_s=P, token_budget=budget))


# ------------------------------------------------------------------ form_batch by hand


def test_member_headroom_refuses_a_member_that_would_miss_its_own_deadline() -> None:
    leader = req("L", 100, 1.0)  # 1.0 s left
    tight = req("t", 100, 0.15)  # alone 0.1 s < 0.15 s; in the 0.2 s batch it would miss
    cands = [tight]
    # Algorithm 1 only asks whether 0.2 s fits in the *leader's* 1.0 s: it admits t.
    assert form(SLOAwareBatching(), leader, cands) == ["L", "t"]
    assert form(MemberHeadroomBatching(), leader, cands) == ["L"]


def test_member_headroom_refuses_a_member_that_is_late_even_alone() -> None:
    leader = req("L", 100, 1.0)
    late = req("x", 500, 0.2)  # 0.5 s alone > 0.2 s: a miss whatever happens
    assert form(SLOAwareBatching(), leader, [late]) == ["L", "x"]  # 0.6 s < 1.0 s
    assert form(MemberHeadroomBatching(), leader, [late]) == ["L"]


def test_member_headroom_admits_members_that_fit_with_headroom() -> None:
    leader = req("L", 100, 1.0)
    a = req("a", 300, 0.9)  # batch 0.4 s < 0.5 × min(1.0, 0.9) = 0.45 s: in
    b = req("b", 20, 5.0)  # batch 0.42 s < 0.45 s: in (the tightest is now a's 0.9 s)
    c = req("c", 100, 5.0)  # batch 0.52 s ≥ 0.45 s: out, though 0.52 s < 0.9 s
    assert form(MemberHeadroomBatching(), leader, [a, b, c]) == ["L", "a", "b"]
    assert form(SLOAwareBatching(), leader, [a, b, c]) == ["L", "a", "b", "c"]


def test_member_headroom_keeps_the_token_budget_inclusive_and_skips_misfits() -> None:
    leader = req("L", 1000, 100.0)
    big = req("big", 3500, 100.0)  # 4500 > 4096: skipped, not a stop
    fits = req("f", 3096, 100.0)  # exactly 4096: in
    assert form(MemberHeadroomBatching(), leader, [big, fits]) == ["L", "f"]
    assert form(MemberHeadroomBatching(), leader, [big, fits], budget=4095) == ["L"]


def test_a_late_leader_is_batched_with_other_late_requests_only() -> None:
    leader = req("LL", 300, 0.1)  # 0.3 s alone > 0.1 s: already late
    cands = [req("x", 300, 0.1), req("ok", 10, 5.0)]
    assert form(SLOAwareBatching(), leader, cands) == ["LL"]  # nothing fits -0.2 s
    assert form(MemberHeadroomBatching(), leader, cands) == ["LL", "x"]


def test_no_batching_runs_the_leader_alone() -> None:
    leader = req("L", 1000, 1.0)
    assert form(NoBatching(), leader, [req("a", 10, 1.0)]) == ["L"]


# ------------------------------------------------------------------ names


def test_every_policy_is_found_by_its_name() -> None:
    assert set(BATCHING) == {"slo-aware", "none", "member-headroom"}
    for name, cls in BATCHING.items():
        assert isinstance(get_batching(name), cls)
    assert isinstance(get_batching("Member_Headroom"), MemberHeadroomBatching)
    assert isinstance(get_batching(Batching.NONE), NoBatching)
    with pytest.raises(UnknownNameError, match="member-headroom") as e:
        get_batching("fifo")
    assert set(e.value.known) == set(BATCHING)
    with pytest.raises(UnknownNameError):  # an ablation of the simulator's only
        get_batching("greedy")


def test_engine_config_accepts_every_batching_name_and_names_them_on_error() -> None:
    assert EngineConfig(batching="member-headroom").batching == "member-headroom"
    assert EngineConfig(batching="member_headroom").batching == "member-headroom"
    assert "member-headroom" in (EngineConfig.model_fields["batching"].description or "")
    # (pydantic wraps the InvalidRequestError raised while validating: both are ValueErrors)
    with pytest.raises(ValueError, match="slo-aware, none, member-headroom"):
        EngineConfig(batching="fifo")
    with pytest.raises(ValueError, match="slo-aware, none, member-headroom"):
        EngineConfig(batching="headroom")


# ------------------------------------------------------------------ in the Scheduler


def test_scheduler_with_member_headroom_leaves_a_late_request_out_of_a_feasible_batch() -> None:
    def batch_of(batching: str) -> list[str]:
        s = Scheduler(predict_s=P, batching=get_batching(batching))
        s.add(req("L", 100, 1.0))  # feasible, leads under S-EDF
        s.add(req("x", 500, 0.2))  # infeasible: ranked after every feasible request
        s.add(req("o", 100, 2.0))
        out = s.schedule(0.0)
        return [r.request_id for r in out.commands[0].task.requests]

    assert batch_of("slo-aware") == ["L", "o", "x"]  # 0.7 s still fits L's 1.0 s
    assert batch_of("member-headroom") == ["L", "o"]  # 0.2 s < 0.5 × 1.0 s


def test_scheduler_with_member_headroom_keeps_a_tight_member_out_of_the_leaders_batch() -> None:
    def first_batches(batching: str) -> list[list[str]]:
        s = Scheduler(predict_s=P, policy=get_policy("fcfs"), batching=get_batching(batching))
        s.add(req("L", 400, 2.0, arrival_s=0.0))
        s.add(req("t", 50, 0.3, arrival_s=0.01))  # due at 0.31 s; alone it takes 0.05 s
        batches = []
        now = 0.01
        while (out := s.schedule(now)).commands:
            task = out.commands[0].task
            batches.append([r.request_id for r in task.requests])
            now += P(task.num_tokens)
            s.finish(task, now)
        return batches

    # Algorithm 1: 0.45 s fits L's 1.99 s, so t joins and finishes at 0.46 s, past 0.31 s.
    assert first_batches("slo-aware") == [["L", "t"]]
    # member-headroom: 0.45 s ≥ 0.5 × t's 0.30 s. (Under FCFS t still waits for L.)
    assert first_batches("member-headroom") == [["L"], ["t"]]


# ------------------------------------------------------------------ in the engine


def test_engine_runs_with_member_headroom_batching() -> None:
    backend = SteppedBackend()
    with PrefillEngine(
        backend, ENGINE_PREDICTOR, batching="member-headroom", token_budget=4096
    ) as eng:
        assert isinstance(eng.scheduler.batching, MemberHeadroomBatching)
        blocker = eng.submit(prompt(9, 3000), ttft_slo_s=30.0)
        time.sleep(0.02)
        futs = [eng.submit(prompt(i, 200), ttft_slo_s=5.0) for i in range(3)]
        results = [f.result(timeout=10) for f in futs]
        assert blocker.result(timeout=10).output == 90
    # 600 tokens predict 24 ms, far inside half of 5 s: the three run as one batch.
    assert {r.batch_size for r in results} == {3}
    assert [r.output for r in results] == [0, 10, 20]
    assert all(r.met_slo for r in results)


@pytest.mark.parametrize(
    ("batching", "leader_batch_size", "tight_batch_size"),
    [("slo-aware", 3, 3), ("member-headroom", 2, 1)],
)
def test_engine_member_headroom_keeps_a_tight_request_out_of_a_long_batch(
    batching: str, leader_batch_size: int, tight_batch_size: int
) -> None:
    """FCFS queues everything behind a blocker (>= 0.1 s), so the batch is formed with all
    three waiting: the leader L (3800 tokens), a tight t (due 0.3 s after submission, so at
    most 0.2 s left) and a relaxed r. L + t predict 0.156 s: Algorithm 1 admits t (it fits
    L's ~4.9 s); member-headroom does not, since that is more than half of t's time left."""
    backend = SteppedBackend()
    with PrefillEngine(backend, ENGINE_PREDICTOR, policy="fcfs", batching=batching) as eng:
        blocker = eng.submit(prompt(9, 2500), ttft_slo_s=30.0)  # >= 0.1 s, never preempted
        while ("start", (9,)) not in backend.order:  # the others queue while it runs
            time.sleep(0.001)
        leader = eng.submit(prompt(1, 3800), ttft_slo_s=5.0)
        tight = eng.submit(prompt(2, 100), ttft_slo_s=0.3)
        relaxed = eng.submit(prompt(3, 100), ttft_slo_s=10.0)
        got = [f.result(timeout=20) for f in (blocker, leader, tight, relaxed)]
    assert [r.output for r in got] == [90, 10, 20, 30]
    assert (got[1].batch_size, got[2].batch_size, got[3].batch_size) == (
        leader_batch_size,
        tight_batch_size,
        leader_batch_size,
    )
