"""Hand-computed TTFTs: the driver + simulated pool reproduce what the engine would do.

ToyCost(): 1 ms per token, 2 layers × 5 equal segments, no overheads. A 1000-token task
runs 1.0 s with a checkpoint every 0.1 s (operator) or 0.5 s (layer).
"""

from __future__ import annotations

import pytest

from flowprefill.contracts.names import Granularity
from flowprefill.lab.sim.batching import GreedyBatching
from flowprefill.lab.sim.driver import Instance, Simulation
from flowprefill.lab.sim.plan import INSTANT, Preemption
from flowprefill.lab.sim.pool import SimulatedPool
from flowprefill.prefill.request import RequestState
from flowprefill.prefill.scheduler.batching import NoBatching
from flowprefill.prefill.scheduler.core import Scheduler
from flowprefill.prefill.scheduler.policies import get_policy

from .conftest import PREDICTOR, ToyCost, req


def instance(
    granularity: Preemption,
    *,
    policy: str = "s-edf",
    cost: ToyCost | None = None,
    chunk_size: int | None = None,
    greedy: bool = False,
    budget: int = 4096,
) -> Instance:
    sched = Scheduler(
        predict_s=PREDICTOR.predict_s,
        policy=get_policy(policy),
        batching=GreedyBatching() if greedy else NoBatching(),
        token_budget=budget,
    )
    return Instance(sched, SimulatedPool(cost or ToyCost(), granularity, chunk_size))


def figure8(granularity: Preemption) -> tuple[Instance, dict[str, float | None]]:
    """Paper Figure 8: long low-priority A, then urgent short B arrives at 0.25 s."""
    a = req("A", 0.0, 1000, 10.0)
    b = req("B", 0.25, 100, 0.5)
    inst = instance(granularity)
    result = Simulation([inst]).run([a, b])
    assert result.num_requests == 2
    return inst, {"A": a.ttft_s, "B": b.ttft_s}


def test_figure8_operator_preemption_blocks_for_the_rest_of_one_operator() -> None:
    inst, ttft = figure8(Granularity.OPERATOR)
    # B arrives 0.25 s into A's run; A's next checkpoint is at 0.3 s (blocking 0.05 s);
    # B runs 0.3–0.4 s; A resumes with 0.7 s left and ends at 1.1 s.
    assert ttft["B"] == pytest.approx(0.15, abs=1e-12)
    assert ttft["A"] == pytest.approx(1.1, abs=1e-12)
    assert inst.pool.blocking_s == [pytest.approx(0.05, abs=1e-12)]
    stats = inst.scheduler.stats
    # Rounds: A arrives, B arrives (preempt + submit), B completes (resume A), A completes.
    assert (stats.num_rounds, stats.num_submits, stats.num_preemptions, stats.num_resumes) == (
        4,
        2,
        1,
        1,
    )


def test_figure8_layer_preemption_waits_for_the_layer() -> None:
    inst, ttft = figure8(Granularity.LAYER)
    assert ttft["B"] == pytest.approx(0.35, abs=1e-12)  # waits until 0.5, runs 0.1
    assert ttft["A"] == pytest.approx(1.1, abs=1e-12)
    assert inst.pool.blocking_s == [pytest.approx(0.25, abs=1e-12)]


def test_figure8_without_checkpoints_the_preempt_waits_for_the_end() -> None:
    inst, ttft = figure8(Granularity.NONE)
    # The preempt races with A's end: A finishes at 1.0 (not parked), B runs 1.0–1.1.
    assert ttft["A"] == pytest.approx(1.0, abs=1e-12)
    assert ttft["B"] == pytest.approx(0.85, abs=1e-12)
    assert inst.pool.blocking_s == [pytest.approx(0.75, abs=1e-12)]
    assert inst.scheduler.stats.num_resumes == 0


def test_figure8_oracle_preempts_instantly() -> None:
    _, ttft = figure8(INSTANT)
    assert ttft["B"] == pytest.approx(0.1, abs=1e-12)
    assert ttft["A"] == pytest.approx(1.1, abs=1e-12)


def test_fcfs_head_of_line_blocking_and_greedy_batch_behind_it() -> None:
    a = req("A", 0.0, 1000, 10.0)
    b = req("B", 0.25, 100, 0.3)
    c = req("C", 0.5, 200, 0.3)
    inst = instance(Granularity.NONE, policy="fcfs", greedy=True)
    result = Simulation([inst]).run([a, b, c])
    # No preemption: B and C wait for A (1.0 s), then run as one 300-token batch (0.3 s).
    assert inst.scheduler.stats.num_preemptions == 0
    assert a.ttft_s == pytest.approx(1.0, abs=1e-12)
    assert b.ttft_s == pytest.approx(1.3 - 0.25, abs=1e-12)
    assert c.ttft_s == pytest.approx(1.3 - 0.5, abs=1e-12)
    assert result.num_met == 1  # only A
    assert result.per_class == {"x": (1, 3)}


def test_chunk_overhead_is_pass_overhead_plus_kv_reread() -> None:
    cost = ToyCost(overhead_s=0.01, reread_s=1e-4)
    whole = req("W", 0.0, 1000, 10.0)
    Simulation([instance(Granularity.NONE, cost=cost)]).run([whole])
    chunked = req("C", 0.0, 1000, 10.0)
    Simulation([instance(Granularity.NONE, cost=cost, chunk_size=250)]).run([chunked])
    assert whole.ttft_s == pytest.approx(0.01 + 1.0, abs=1e-12)
    # 4 chunks: 4 × 0.01 overhead + 1.0 s of tokens + (250+500+750) prefix tokens × 1e-4.
    assert chunked.ttft_s == pytest.approx(0.04 + 1.0 + 0.15, abs=1e-12)


def test_chunked_prefill_preempts_only_at_chunk_boundaries() -> None:
    cost = ToyCost(overhead_s=0.01, reread_s=1e-4)
    a = req("A", 0.0, 1000, 10.0)
    b = req("B", 0.3, 100, 1.0)
    inst = instance(Granularity.NONE, policy="edf", cost=cost, chunk_size=250)
    Simulation([inst]).run([a, b])
    chunk1 = 0.01 + 0.25
    chunk2 = 0.01 + 0.25 + 250e-4
    # B arrives inside chunk 2 and starts when it ends; B itself pays one pass overhead.
    start_b = chunk1 + chunk2
    assert b.ttft_s == pytest.approx(start_b + 0.01 + 0.1 - 0.3, abs=1e-12)
    assert inst.pool.blocking_s == [pytest.approx(start_b - 0.3, abs=1e-12)]
    assert a.ttft_s == pytest.approx(0.04 + 1.0 + 0.15 + 0.11, abs=1e-12)


def test_preempted_task_keeps_its_progress_across_two_preemptions() -> None:
    a = req("A", 0.0, 1000, 10.0)
    b = req("B", 0.25, 100, 0.5)
    c = req("C", 0.65, 100, 0.5)
    inst = instance(Granularity.OPERATOR)
    Simulation([inst]).run([a, b, c])
    # A: 0–0.3 (parked at 0.3), B 0.3–0.4, A 0.4–0.7 (C arrives at 0.65 → checkpoint at
    # A's elapsed 0.6 = 0.7), C 0.7–0.8, A 0.8–1.2 with its last 0.4 s.
    assert b.ttft_s == pytest.approx(0.15, abs=1e-12)
    assert c.ttft_s == pytest.approx(0.8 - 0.65, abs=1e-12)
    assert a.ttft_s == pytest.approx(1.2, abs=1e-12)
    assert a.num_preemptions == 2


def test_simultaneous_events_are_handled_in_one_round() -> None:
    a = req("A", 0.0, 100, 1.0)
    b = req("B", 0.1, 100, 1.0)  # arrives exactly when A completes
    inst = instance(Granularity.OPERATOR)
    Simulation([inst]).run([a, b])
    assert inst.scheduler.stats.num_rounds == 3  # A arrives; A done + B arrives; B done
    assert b.ttft_s == pytest.approx(0.1, abs=1e-12)


def test_s_edf_sinks_a_request_that_cannot_make_it() -> None:
    # B cannot finish 500 tokens in 0.2 s: S-EDF runs the feasible C first, D-EDF does not.
    def run(policy: str) -> tuple[float | None, float | None]:
        b = req("B", 0.0, 500, 0.2)
        c = req("C", 0.0, 100, 0.3)
        inst = instance(Granularity.OPERATOR, policy=policy)
        Simulation([inst]).run([b, c])
        return b.ttft_s, c.ttft_s

    assert run("s-edf") == (pytest.approx(0.6), pytest.approx(0.1))
    assert run("d-edf") == (pytest.approx(0.5), pytest.approx(0.6))


def test_miss_budget_stops_the_run_early() -> None:
    reqs = [req(f"r{i}", 0.01 * i, 1000, 0.05) for i in range(50)]
    inst = instance(Granularity.OPERATOR, policy="fcfs")
    result = Simulation([inst], miss_budget=5).run(reqs)
    assert result.stopped_early
    assert result.num_missed_seen == 6
    assert any(r.state is not RequestState.FINISHED for r in reqs)


@pytest.mark.parametrize(("live", "expected"), [(True, 0.4), (False, 0.0)])
def test_running_progress_is_refreshed_only_in_live_mode(live: bool, expected: float) -> None:
    seen: list[float] = []
    inst = instance(Granularity.OPERATOR)
    inst.live_progress = live
    original = inst.scheduler.schedule

    def spy(now_s: float):  # type: ignore[no-untyped-def]
        if inst.scheduler.running is not None:
            seen.append(inst.scheduler.running.progress)
        return original(now_s)

    inst.scheduler.schedule = spy  # type: ignore[method-assign]
    Simulation([inst]).run([req("A", 0.0, 1000, 10.0), req("B", 0.4, 10, 10.0)])
    # B's arrival: A is 0.4 s into its 1.0 s; the engine still reports its start value.
    assert seen[0] == pytest.approx(expected)
