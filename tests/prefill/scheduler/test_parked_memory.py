"""The parked-memory budget: a preemption that would park too many bytes is declined."""

from __future__ import annotations

import pytest

from flowprefill.prefill.request import Request, RequestState, Task
from flowprefill.prefill.scheduler.batching import get_batching
from flowprefill.prefill.scheduler.core import Scheduler, SchedulerOutput
from flowprefill.prefill.scheduler.memory import ParkedMemory
from flowprefill.prefill.scheduler.round import Arrival, Completion, run_round
from tests.prefill.scheduler.test_round import FakePool

BYTES_PER_TOKEN = 10


def req(rid: str, tokens: int, arrival: float, slo: float) -> Request:
    return Request.create(rid, arrival_s=arrival, ttft_slo_s=slo, num_tokens=tokens)


def scheduler(budget: int | None) -> Scheduler:
    return Scheduler(
        predict_s=lambda n: n / 1000.0,
        batching=get_batching("none"),
        parked_memory=ParkedMemory(budget, lambda tokens, _requests: tokens * BYTES_PER_TOKEN),
    )


def kinds(out: SchedulerOutput | None) -> list[tuple[str, str]]:
    assert out is not None
    return [(c.kind.value, c.task.leader.request_id) for c in out.commands]


def test_unbounded_preempts_as_before() -> None:
    s, pool = scheduler(None), FakePool()
    run_round(s, pool, [Arrival(req("A", 1000, 1.0, 10.0))], 1.0)
    out = run_round(s, pool, [Arrival(req("B", 100, 1.1, 0.5))], 1.1)
    assert kinds(out.scheduled) == [("preempt", "A"), ("submit", "B")]
    assert s.parked_memory.total_bytes == 1000 * BYTES_PER_TOKEN


def test_a_switch_over_the_budget_is_declined_and_the_urgent_request_waits() -> None:
    s, pool = scheduler(1000 * BYTES_PER_TOKEN - 1), FakePool()
    run_round(s, pool, [Arrival(req("A", 1000, 1.0, 10.0))], 1.0)
    out = run_round(s, pool, [Arrival(req("B", 100, 1.1, 0.5))], 1.1)
    assert out.scheduled is not None and out.commands == []
    assert out.scheduled.declined_preemption is s.running
    assert s.running is not None and s.running.leader.request_id == "A"
    assert list(s.waiting) == ["B"] and s.waiting["B"].state is RequestState.WAITING
    assert s.stats.num_preemptions_declined == 1 and s.stats.num_preemptions == 0
    assert s.parked_memory.total_bytes == 0
    # A finishes: B runs next, nothing parked.
    a = s.running
    out = run_round(s, pool, [Completion(a, None, None)], 1.5)
    assert kinds(out.scheduled) == [("submit", "B")]


def test_exactly_the_budget_fits() -> None:
    s, pool = scheduler(1000 * BYTES_PER_TOKEN), FakePool()
    run_round(s, pool, [Arrival(req("A", 1000, 1.0, 10.0))], 1.0)
    out = run_round(s, pool, [Arrival(req("B", 100, 1.1, 0.5))], 1.1)
    assert kinds(out.scheduled) == [("preempt", "A"), ("submit", "B")]


def test_parked_tasks_add_up_and_the_second_park_is_declined() -> None:
    s, pool = scheduler(1500 * BYTES_PER_TOKEN), FakePool()
    run_round(s, pool, [Arrival(req("A", 1000, 1.0, 10.0))], 1.0)
    run_round(s, pool, [Arrival(req("B", 800, 1.1, 2.0))], 1.1)  # parks A (10000 B)
    out = run_round(s, pool, [Arrival(req("C", 10, 1.2, 0.1))], 1.2)  # B would add 8000
    assert out.commands == [] and out.scheduled is not None
    assert out.scheduled.declined_preemption is s.running
    assert s.running is not None and s.running.leader.request_id == "B"
    assert s.parked_memory.total_bytes == 1000 * BYTES_PER_TOKEN


def test_the_measurement_replaces_the_bound_and_admits_a_later_park() -> None:
    s, pool = scheduler(1500 * BYTES_PER_TOKEN), FakePool()
    run_round(s, pool, [Arrival(req("A", 1000, 1.0, 10.0))], 1.0)
    a = s.running
    assert a is not None
    pool.held_of[a.task_id] = 300 * BYTES_PER_TOKEN  # A parked early: it holds little
    run_round(s, pool, [Arrival(req("B", 800, 1.1, 2.0))], 1.1)
    assert s.parked_memory.held_bytes == {a.task_id: 300 * BYTES_PER_TOKEN}
    out = run_round(s, pool, [Arrival(req("C", 10, 1.2, 0.1))], 1.2)
    assert kinds(out.scheduled) == [("preempt", "B"), ("submit", "C")]
    assert s.parked_memory.total_bytes == 1100 * BYTES_PER_TOKEN


def test_resuming_a_parked_task_frees_its_bytes_for_the_victim() -> None:
    budget = 1000 * BYTES_PER_TOKEN
    s, pool = scheduler(budget), FakePool()
    run_round(s, pool, [Arrival(req("A", 1000, 1.0, 1.5))], 1.0)
    run_round(s, pool, [Arrival(req("B", 100, 1.1, 0.3))], 1.1)  # parks A: budget full
    assert s.parked_memory.total_bytes == budget
    # At 1.35 B can no longer make its deadline (1.4) and sinks below A, still feasible:
    # parking B (1000 B) fits only because resuming A frees its 10000.
    out = run_round(s, pool, [], 1.35)
    assert kinds(out.scheduled) == [("preempt", "B"), ("resume", "A")]
    assert s.parked_memory.total_bytes == 100 * BYTES_PER_TOKEN


def test_a_finished_task_frees_its_parked_bytes() -> None:
    s, pool = scheduler(None), FakePool()
    run_round(s, pool, [Arrival(req("A", 1000, 1.0, 10.0))], 1.0)
    a = s.running
    assert a is not None
    run_round(s, pool, [Arrival(req("B", 100, 1.1, 0.5))], 1.1)
    # The preempt raced with A's end: its completion arrives while it is parked.
    run_round(s, pool, [Completion(a, None, None)], 1.15)
    assert s.parked_memory.total_bytes == 0


def test_switch_accounting_frees_the_resumed_task() -> None:
    m = ParkedMemory(100, lambda tokens, _requests: tokens)
    a, b = Task([req("a", 60, 0.0, 1.0)]), Task([req("b", 70, 0.0, 1.0)])
    m.park(a)
    assert not m.fits_switch(b, None)  # 60 + 70 > 100
    assert m.fits_switch(b, a)  # resuming a frees its 60
    m.measured(a, 30)
    assert m.fits_switch(b, None)  # 30 + 70 <= 100
    m.unpark(a)
    assert m.total_bytes == 0


def test_a_budget_needs_an_estimate_and_is_not_negative() -> None:
    with pytest.raises(ValueError, match="estimate"):
        ParkedMemory(10, None)
    with pytest.raises(ValueError, match=">= 0"):
        ParkedMemory(-1, lambda tokens, _requests: tokens)
    task = Task([req("x", 5, 0.0, 1.0)])
    assert ParkedMemory(None, None).fits_switch(task, None)


def test_a_zero_budget_never_preempts() -> None:
    s, pool = scheduler(0), FakePool()
    run_round(s, pool, [Arrival(req("A", 1000, 1.0, 10.0))], 1.0)
    for i in range(5):
        now = 1.1 + i / 100
        out = run_round(s, pool, [Arrival(req(f"U{i}", 10, now, 0.05))], now)
        assert out.commands == []
    assert s.stats.num_preemptions_declined == 5 and len(s.waiting) == 5
    assert not any(call[0] == "preempt" for call in pool.calls)


def test_engine_config_budget_is_optional_and_not_negative() -> None:
    from pydantic import ValidationError

    from flowprefill.contracts import EngineConfig

    assert EngineConfig().parked_memory_bytes is None
    assert EngineConfig(parked_memory_bytes=0).parked_memory_bytes == 0
    with pytest.raises(ValidationError, match="parked_memory_bytes"):
        EngineConfig(parked_memory_bytes=-1)
