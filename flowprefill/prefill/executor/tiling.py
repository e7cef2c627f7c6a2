"""Which row tiles a split GEMM runs in: the cheapest plan whose every tile fits the bound.

Cutting a linear of ``n`` rows into ``ceil(t / b)`` equal tiles is the right plan when a
GEMM's time is linear in its rows (a CPU: tiles of 64-1024 rows ran no slower per row
than one 2048-row call). A GPU's is not: the thread blocks of a tile fill the SMs in
waves, so the time per row has a sawtooth in the row count (the vidur A100 profile's
gate_up costs 1.082 µs per token at 3,641 tokens, 1.013 at 3,072 and 1.043 at 32K). The
equal plan then lands wherever the division puts it, and pays up to ~10 % on the split
operator for nothing.

Given a measured time per row count (:class:`RowProfile`: the executor measures one per
weight shape on CUDA, ``flowprefill.prefill.executor.calibration.calibrate``; the simulator prices
tiles at its profile's times), :func:`plan_tiles` looks at a few plans and keeps the
cheapest whose every tile is predicted within the bound:

* ``k`` equal tiles for ``k`` from the fewest that fit to twice that;
* tiles of one profiled size ``s`` (a grid point) and one remainder tile.

The plans are compared by predicted total time; a plan replaces the fewest equal tiles
only when it is cheaper by more than :data:`MIN_GAIN`, so with a profile linear in rows
(or none) the plan is exactly the equal one. Pure and torch-free: the simulator
(:mod:`flowprefill.lab.sim.split`) plans with the same function as the engine.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

MIN_ROWS = 16
"""Smallest tile: below this, per-call overhead outweighs shorter blocking."""

GRID_STEP = 256
"""Row counts a profile is measured at are multiples of this (GPU GEMM kernels tile rows
by 64-256, so the sawtooth's teeth sit on multiples of it)."""

MAX_GRID_POINTS = 48
"""At most this many measured row counts per weight shape (the step grows past it)."""

GPU_PIECE_OVERHEAD_S = 10e-6
"""What one checkpoint added by splitting costs on a GPU beyond its compute: the
executor's default ``every_check`` sync (flowprefill/prefill/executor/device.py) waits for the
stream at every checkpoint, exposing the next kernel's launch (~5 µs on A100/H100) plus
the sync's round trip. An estimate, not measured here (no GPU on the build machine)."""

GRID_HEADROOM = 1.25
"""The grid reaches this many times the rows that fit the bound at the measured FLOP rate
(a sawtooth tooth can make a larger tile cheaper than the rate says)."""

MAX_PROFILED_ROWS = 32768
"""Largest row count profiled (bounds the calibration's time and memory)."""

MIN_GAIN = 0.005
"""A plan other than the equal one must be predicted this much cheaper (relative): a
smaller gain is within the profile's measurement noise."""


def grid(max_rows: int) -> list[int]:
    """Row counts to profile for tiles of up to ``max_rows`` rows: multiples of
    :data:`GRID_STEP` (coarser when there would be more than :data:`MAX_GRID_POINTS`)."""
    if max_rows < GRID_STEP:
        return []
    step = GRID_STEP * math.ceil(max_rows / (GRID_STEP * MAX_GRID_POINTS))
    return list(range(step, max_rows + 1, step))


@dataclass(frozen=True, slots=True)
class RowProfile:
    """Measured seconds of one weight shape's GEMM at ``rows[i]`` rows (ascending).

    Between points the time is interpolated linearly; past the last point it grows with
    the rows at the last point's time per row; below the first, at the first's."""

    rows: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.rows or len(self.rows) != len(self.seconds):
            raise ValueError("a row profile needs as many times as row counts, at least one")
        if any(b <= a for a, b in zip(self.rows, self.rows[1:], strict=False)):
            raise ValueError(f"row counts must ascend, got {self.rows}")
        if any(not (s > 0 and math.isfinite(s)) for s in self.seconds):
            raise ValueError(f"profiled times must be positive and finite, got {self.seconds}")

    def time_s(self, rows: int) -> float:
        xs, ys = self.rows, self.seconds
        if rows <= xs[0]:
            return ys[0] * rows / xs[0]
        if rows >= xs[-1]:
            return ys[-1] * rows / xs[-1]
        i = bisect.bisect_right(xs, rows)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (rows - x0) / (x1 - x0)


def equal_tiles(num_rows: int, pieces: int) -> list[int]:
    """Sizes of ``pieces`` tiles of ``num_rows`` rows differing by at most one row, the
    larger first (at most ``ceil(n / MIN_ROWS)`` tiles)."""
    pieces = max(1, min(pieces, math.ceil(num_rows / MIN_ROWS)))
    size, extra = divmod(num_rows, pieces)
    return [size + 1] * extra + [size] * (pieces - extra)


def plan_tiles(
    num_rows: int,
    time_at: Callable[[int], float],
    bound_s: float,
    sizes: Sequence[int] = (),
    piece_overhead_s: float = 0.0,
) -> list[int]:
    """Tile sizes (summing to ``num_rows``) for a row-wise operator whose time at ``m``
    rows is predicted as ``time_at(m)``: one tile when the whole fits ``bound_s``; else
    the cheapest plan of those in the module docstring, ``sizes`` being the profiled row
    counts (none: equal tiles only), each tile also paying ``piece_overhead_s`` (its
    checkpoint: :data:`GPU_PIECE_OVERHEAD_S` on CUDA). When no plan fits, more equal
    tiles until one does (at most ``ceil(n / MIN_ROWS)``)."""
    whole = time_at(num_rows)
    if whole <= bound_s or num_rows < 2 * MIN_ROWS:
        return [num_rows]
    best: tuple[float, list[int]] | None = None

    def fits(tiles: list[int]) -> bool:
        return all(time_at(m) <= bound_s for m in set(tiles))

    fewest = max(2, math.ceil(whole / bound_s))
    # whole / bound_s can round up past an exact multiple (tiles that take exactly the
    # bound): one tile fewer is then the fewest that fit.
    if fewest > 2 and fits(equal_tiles(num_rows, fewest - 1)):
        fewest -= 1

    def consider(tiles: list[int]) -> None:
        nonlocal best
        if not fits(tiles):
            return
        # A plan has at most two distinct sizes: time each once.
        total = sum(n * time_at(m) for m, n in Counter(tiles).items())
        total += len(tiles) * piece_overhead_s
        if best is None or total < best[0] * (1.0 - MIN_GAIN):
            best = (total, tiles)

    # Equal tiles first, fewest first, so a tie keeps the simplest plan.
    for k in range(fewest, 2 * fewest + 1):
        consider(equal_tiles(num_rows, k))
    for s in sizes:
        if s >= num_rows or s < MIN_ROWS:
            continue
        full, rest = divmod(num_rows, s)
        if 0 < rest < MIN_ROWS:
            continue
        consider([s] * full + ([rest] if rest else []))
    if best is None:
        # Predicted times are not monotone in the rows, so up to twice the fewest equal
        # tiles may all miss the bound although more would fit: go on adding tiles.
        most = math.ceil(num_rows / MIN_ROWS)
        k = min(2 * fewest + 1, most)
        while k < most and not fits(equal_tiles(num_rows, k)):
            k += 1
        return equal_tiles(num_rows, k)
    return best[1]
