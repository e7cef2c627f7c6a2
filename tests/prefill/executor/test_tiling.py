"""Tile plans for split GEMMs (flowprefill/prefill/executor/tiling.py): every tile within the bound
where any plan fits, the cheapest of the plans looked at, and exactly the equal plan when
the time is linear in the rows (a CPU, or no profile)."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from flowprefill.prefill.executor.splitting import SplitRates
from flowprefill.prefill.executor.tiling import (
    GRID_STEP,
    MAX_GRID_POINTS,
    MIN_GAIN,
    MIN_ROWS,
    RowProfile,
    equal_tiles,
    grid,
    plan_tiles,
)


def linear(per_row_s: float) -> Callable[[int], float]:
    return lambda m: m * per_row_s


def sawtooth(per_row_s: float, tooth: int, penalty: float) -> Callable[[int], float]:
    """A GPU-like GEMM: rows past a multiple of ``tooth`` pay a whole extra wave."""
    return lambda m: per_row_s * tooth * math.ceil(m / tooth) * (1 + penalty * (m % tooth > 0))


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 200_000), per_row_us=st.floats(0.01, 10), bound_ms=st.floats(0.05, 50))
# Tiles that take exactly the bound, where whole / bound rounds up past 5 (found by this test).
@example(rows=5000, per_row_us=7.787323563754752, bound_ms=7.787323563754752)
def test_a_linear_time_gives_the_fewest_equal_tiles(
    rows: int, per_row_us: float, bound_ms: float
) -> None:
    time_at = linear(per_row_us * 1e-6)
    bound = bound_ms * 1e-3
    sizes = grid(int(1.25 * bound / (per_row_us * 1e-6)))
    tiles = plan_tiles(rows, time_at, bound, sizes)
    assert sum(tiles) == rows
    whole = time_at(rows)
    if whole <= bound or rows < 2 * MIN_ROWS:
        assert tiles == [rows]
        return
    # Equal tiles, the fewest whose largest fits the bound (the engine's plan without a
    # profile: row_tiles of the most rows that fit), unless even MIN_ROWS rows do not.
    assert tiles == equal_tiles(rows, len(tiles))
    if time_at(MIN_ROWS) <= bound:
        assert time_at(tiles[0]) <= bound
        assert len(tiles) == 2 or time_at(equal_tiles(rows, len(tiles) - 1)[0]) > bound


@settings(max_examples=200, deadline=None)
@given(
    rows=st.integers(32, 100_000),
    tooth=st.sampled_from([64, 128, 256]),
    penalty=st.floats(0.0, 0.5),
    bound_ms=st.floats(0.2, 20),
)
def test_every_tile_fits_the_bound_and_the_plan_is_no_dearer_than_equal_tiles(
    rows: int, tooth: int, penalty: float, bound_ms: float
) -> None:
    time_at = sawtooth(1e-6, tooth, penalty)
    bound = bound_ms * 1e-3
    sizes = grid(int(1.25 * bound / 1e-6))
    tiles = plan_tiles(rows, time_at, bound, sizes)
    assert sum(tiles) == rows and min(tiles) >= 1
    if time_at(rows) <= bound:
        assert tiles == [rows]
        return
    if time_at(MIN_ROWS) > bound:
        return  # not even the smallest tile fits: nothing to hold
    assert max(time_at(m) for m in tiles) <= bound
    fewest = math.ceil(time_at(rows) / bound)
    for k in range(fewest, 2 * fewest + 1):
        equal = equal_tiles(rows, k)
        if max(time_at(m) for m in equal) <= bound:
            # Cheaper plans are only taken when cheaper by more than MIN_GAIN.
            cost = sum(map(time_at, tiles))
            assert cost <= sum(map(time_at, equal)) / (1 - MIN_GAIN) + 1e-15


def test_a_sawtooth_picks_tiles_on_the_teeth() -> None:
    """10,000 rows, 3 ms at 1 µs/row: 4 equal tiles of 2,500 rows each run a partial
    wave (+30 %); tiles of 2,304 = 9 × 256 rows do not, and only the remainder does."""
    time_at = sawtooth(1e-6, 256, 0.3)
    bound = 3e-3
    tiles = plan_tiles(10_000, time_at, bound, grid(int(1.25 * bound / 1e-6)))
    assert max(time_at(m) for m in tiles) <= bound
    assert sum(m % 256 > 0 for m in tiles) <= 1
    assert sum(map(time_at, tiles)) < sum(map(time_at, equal_tiles(10_000, 4))) * 0.8


def test_per_tile_overhead_prefers_fewer_tiles() -> None:
    """Two plans equal in compute: the overhead per tile decides for the fewer tiles."""
    time_at = linear(1e-6)
    many = plan_tiles(8192, time_at, 3e-3, [512, 1024, 2048], piece_overhead_s=0.0)
    assert len(many) == 3  # ceil(8.192 / 3): the equal plan
    assert plan_tiles(8192, time_at, 3e-3, [512, 1024, 2048], piece_overhead_s=1e-4) == many


def test_grid_is_bounded_and_on_the_step() -> None:
    assert grid(GRID_STEP - 1) == []
    assert grid(1000) == [256, 512, 768]
    big = grid(10**6)
    assert len(big) <= MAX_GRID_POINTS and all(s % GRID_STEP == 0 for s in big)


def test_a_row_profile_interpolates_and_extrapolates_per_row() -> None:
    p = RowProfile((256, 512), (1.0, 3.0))
    assert p.time_s(128) == pytest.approx(0.5)
    assert p.time_s(384) == pytest.approx(2.0)
    assert p.time_s(1024) == pytest.approx(6.0)
    with pytest.raises(ValueError, match="ascend"):
        RowProfile((512, 256), (1.0, 2.0))
    with pytest.raises(ValueError, match="positive"):
        RowProfile((256,), (0.0,))
    with pytest.raises(ValueError, match="as many"):
        RowProfile((256, 512), (1.0,))


def test_split_rates_travel_as_a_vector() -> None:
    """Tensor-parallel ranks receive rank 0's rates and profiles as one float vector."""
    rates = SplitRates(
        1e12,
        2e12,
        {8192.0: RowProfile((256, 512), (1e-4, 2.5e-4)), 3.5e7: RowProfile((256,), (3e-3,))},
        1e-5,
    )
    assert SplitRates.from_vector(rates.to_vector()) == rates
    assert SplitRates.from_vector(SplitRates(1.0, 2.0).to_vector()) == SplitRates(1.0, 2.0)
