from __future__ import annotations

import pytest

from flowprefill.contracts.names import Granularity
from flowprefill.errors import InvalidRequestError
from flowprefill.lab.sim.plan import INSTANT, ExecutionPlan, Preemption, chunk_segments
from flowprefill.lab.sim.pool import SimulatedPool
from flowprefill.prefill.request import Request, Task

from .conftest import ToyCost


def plan(granularity: Preemption, n: int = 1000, chunk: int | None = None) -> ExecutionPlan:
    return ExecutionPlan.build(
        ToyCost(overhead_s=0.01), [n], granularity=granularity, chunk_size=chunk
    )


def test_chunk_segments_split_a_batch_end_to_end() -> None:
    assert chunk_segments([300, 500], None) == [[(300, 0), (500, 0)]]
    assert chunk_segments([300, 500], 400) == [[(300, 0), (100, 0)], [(400, 100)]]
    assert chunk_segments([1000], 400) == [[(400, 0)], [(400, 400)], [(200, 800)]]
    with pytest.raises(InvalidRequestError):
        chunk_segments([10], 0)


def test_operator_checkpoints_follow_every_segment() -> None:
    p = plan(Granularity.OPERATOR)  # pre 0.01, then 10 segments of 0.1 s
    assert p.total_s == pytest.approx(1.01)
    assert p.next_checkpoint_s(0.0) == pytest.approx(0.11)
    assert p.next_checkpoint_s(0.25) == pytest.approx(0.31)
    assert p.next_checkpoint_s(0.31) == pytest.approx(0.31)  # exactly at one: no wait
    assert p.next_checkpoint_s(0.95) == pytest.approx(1.01)  # the last op's end parks too
    layer_end = 0.01 + 5 * p.passes[0].op_s[0]
    assert p.next_checkpoint_s(layer_end) == layer_end  # a layer boundary is a checkpoint


def test_layer_checkpoints_follow_every_layer() -> None:
    p = plan(Granularity.LAYER)
    assert p.next_checkpoint_s(0.005) == pytest.approx(0.51)
    assert p.next_checkpoint_s(0.6) == pytest.approx(1.01)


def test_without_checkpoints_only_chunk_boundaries_count() -> None:
    assert plan(Granularity.NONE).next_checkpoint_s(0.3) is None
    chunked = plan(Granularity.NONE, chunk=250)  # 4 passes of 0.26 s (no re-read cost)
    assert chunked.next_checkpoint_s(0.3) == pytest.approx(0.52)
    assert chunked.next_checkpoint_s(0.52) == pytest.approx(0.52)
    assert chunked.next_checkpoint_s(0.9) is None  # in the last chunk: runs to the end


def test_operator_checkpoints_inside_chunks() -> None:
    p = plan(Granularity.OPERATOR, chunk=500)  # 2 passes: 0.01 + 10 × 0.05 s
    assert p.next_checkpoint_s(0.52) == pytest.approx(0.51 + 0.01 + 0.05)


def test_instant_is_anywhere_and_progress_is_time_fraction() -> None:
    p = plan(INSTANT)
    assert p.next_checkpoint_s(0.123) == 0.123
    assert p.progress(0.505) == pytest.approx(0.5)


def test_tp_rank_agreement_is_paid_at_every_checkpoint_of_the_granularity() -> None:
    """Pre 0.01 s, 2 layers × 5 segments of 0.1 s; each checkpoint adds 0.01 s."""
    cost = ToyCost(overhead_s=0.01, checkpoint_s=0.01)

    def tp_plan(g: Preemption, chunk: int | None = None) -> ExecutionPlan:
        return ExecutionPlan.build(cost, [1000], granularity=g, chunk_size=chunk)

    op = tp_plan(Granularity.OPERATOR)
    assert op.total_s == pytest.approx(1.01 + 10 * 0.01)
    assert op.next_checkpoint_s(0.0) == pytest.approx(0.01 + 0.1 + 0.01)
    assert op.next_checkpoint_s(0.13) == pytest.approx(0.01 + 2 * 0.11)
    layer = tp_plan(Granularity.LAYER)
    assert layer.total_s == pytest.approx(1.01 + 2 * 0.01)
    assert layer.next_checkpoint_s(0.005) == pytest.approx(0.01 + 0.5 + 0.01)
    # No checkpoints inside a pass: nothing to agree on (chunk boundaries are passes).
    assert tp_plan(Granularity.NONE).total_s == pytest.approx(1.01)
    assert tp_plan(Granularity.NONE, chunk=500).total_s == pytest.approx(2 * 0.51)
    assert tp_plan(INSTANT).total_s == pytest.approx(1.01)
    # Inside chunks every pass's checkpoints pay: 2 passes × 10 checks.
    chunked = tp_plan(Granularity.OPERATOR, chunk=500)
    assert chunked.total_s == pytest.approx(2 * (0.01 + 0.5 + 10 * 0.01))


def test_tp_checkpoints_reach_the_pool_blocking_and_progress() -> None:
    """A preempt during a segment parks after that segment *and* its rank agreement."""
    pool = SimulatedPool(ToyCost(checkpoint_s=0.02), Granularity.OPERATOR)
    task = Task([Request.create("a", arrival_s=0.0, ttft_slo_s=9.0, num_tokens=1000)])
    pool.submit(task)
    pool.advance_to(0.05)  # inside the first segment (0.1 s of work, then 0.02 s of sync)
    outcome = pool.preempt(task)
    assert outcome.parked and outcome.blocking_s == pytest.approx(0.12 - 0.05)
    assert task.progress == pytest.approx(0.12 / (1.0 + 10 * 0.02))
