from __future__ import annotations

import pytest

from flowprefill.errors import InvalidRequestError, UnknownNameError
from flowprefill.sim.plan import ExecutionPlan, Granularity, chunk_segments, get_granularity

from .conftest import ToyCost


def plan(granularity: Granularity, n: int = 1000, chunk: int | None = None) -> ExecutionPlan:
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
    p = plan(Granularity.INSTANT)
    assert p.next_checkpoint_s(0.123) == 0.123
    assert p.progress(0.505) == pytest.approx(0.5)


def test_unknown_granularity_is_named() -> None:
    assert get_granularity("Operator") is Granularity.OPERATOR
    with pytest.raises(UnknownNameError, match="block"):
        get_granularity("block")
