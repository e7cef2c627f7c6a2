"""Run-time operator splitting, as the simulator models it (docs/simulator.md, "Bounded
blocking").

The engine (``EngineConfig.max_blocking_ms``, flowprefill/prefill/executor/splitting.py) splits
any operator whose *predicted* time exceeds a bound ``b`` into pieces with a preemption
checkpoint between consecutive pieces, so an urgent arrival waits for at most about one
piece instead of one whole operator:

* GEMM-type segments (qkv_proj, o_proj, gate_up, down_proj) run in tiles of token rows.
  A tile's time is the cost model's time *at the tile's token count* (for the GPU model:
  the vidur profile interpolated there, so small-tile inefficiency is the measured one),
  not ``t / k``. Which tiles: ``tile_plan="profiled"`` (the GPU model's default) plans as
  the engine does on CUDA, where it measures each weight shape's GEMM time at a grid of
  row counts when it starts — :func:`flowprefill.prefill.executor.tiling.plan_tiles`, the same
  function, on the profile: the cheapest of a few plans whose every tile fits ``b``.
  ``"equal"``: ``ceil(t / b)`` equal tiles (sizes differing by at most one row), the
  engine's plan with FLOP-rate predictions only (on CPU, or without a profile).
* Attention runs in blocks of query rows: block ``[a, a + r)`` of a request with ``c``
  new tokens after ``p`` cached ones attends to every key up to its last row, i.e.
  ``r·(p + a) + r²/2`` query-key pairs. As in the engine's ``attention_plan``, each block
  takes the most rows whose predicted time fits ``b`` (the last block takes the rest);
  requests short enough stay whole, and consecutive pieces are grouped into stretches up
  to ``b``, with a checkpoint between stretches.
* Operators predicted within ``b`` run whole: a short prompt's plan is the unsplit one.

A split operator also *begins* with a checkpoint (the engine's ``Packer.split_start``:
what ran since the last checkpoint — norms, RoPE — must not share a stretch with a full
piece). Between two segments that checkpoint coincides with the operator-level one, but at
the start of a pass it is the first checkpoint after the embedding, so a signal during the
pass's prologue waits for the prologue only, not for a piece as well. A split segment is
therefore a zero-length stretch followed by its ``k`` pieces: ``k`` added checkpoints,
each paying ``overhead_s`` (its sync exposes the next kernel's launch; see
:data:`GPU_PIECE_OVERHEAD_S`). Splitting happens at operator granularity only (the
engine's rule); the plan (:mod:`.plan`) puts a checkpoint after every stretch.

Not modelled: the per-pass overhead and the embedding before the first layer are not
split (neither is in a decoder layer), and under tensor parallelism the all-reduce after
o_proj and down_proj runs once, after the last tile (the engine's all-reduce is a forward
hook of the whole linear), so it is added to the last piece.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

from flowprefill.prefill.executor.tiling import GPU_PIECE_OVERHEAD_S as GPU_PIECE_OVERHEAD_S
from flowprefill.prefill.executor.tiling import GRID_HEADROOM, MAX_PROFILED_ROWS, grid, plan_tiles

MIN_ROWS = 16
"""Smallest tile or attention block, as the engine's ``splitting.MIN_ROWS``."""

CPU_PIECE_OVERHEAD_S = 20e-6
"""The same for the profiled CPU engine (:class:`~flowprefill.lab.sim.profile.ProfileCostModel`):
one more torch operator dispatch (~10 µs) and checkpoint call (~3 µs per hook call,
docs/executor.md "Cost of the checkpoints"). Tiling itself costs nothing measurable on
CPU: tiles of 64–1024 rows of a 256→768 linear ran no slower than the whole 2048-row
call (1 thread, this box), and the profile's GEMM time is linear in rows."""


def num_pieces(time_s: float, bound_s: float) -> int:
    """``ceil(t / b)``: how many pieces an operator predicted at ``time_s`` becomes."""
    if time_s <= bound_s:
        return 1
    return math.ceil(time_s / bound_s)


def tile_sizes(num_rows: int, pieces: int) -> list[int]:
    """Rows of each tile when ``num_rows`` are cut into ``pieces`` tiles the engine's way
    (``row_tiles``): sizes differing by at most one row, at most ``ceil(n / MIN_ROWS)``
    tiles (the engine's tile is never planned under :data:`MIN_ROWS` rows)."""
    pieces = max(1, min(pieces, math.ceil(num_rows / MIN_ROWS)))
    size, extra = divmod(num_rows, pieces)
    return [size + 1] * extra + [size] * (pieces - extra)


TilePlan = Literal["profiled", "equal"]
"""How GEMM tiles are chosen (module docstring)."""


def gemm_pieces(
    time_at: Callable[[int], float],
    num_tokens: int,
    bound_s: float,
    overhead_s: float,
    *,
    tail_s: float = 0.0,
    tile_plan: TilePlan = "equal",
    per_row_s: float | None = None,
) -> tuple[float, ...]:
    """Stretches of a row-wise segment over ``num_tokens`` rows: ``time_at(m)`` is its
    time at ``m`` rows; ``tail_s`` (an all-reduce after the whole linear) joins the last
    tile. Within the bound: one, ``time_at(num_tokens) + tail_s``; split: the leading
    zero-length stretch, then each tile plus ``overhead_s``. ``per_row_s``: the
    segment's time per row at the rate the engine measures (a large GEMM), which sizes
    the profiled grid (default: the whole's)."""
    whole = time_at(num_tokens)
    k = num_pieces(whole, bound_s)
    if k == 1 or num_tokens < 2 * MIN_ROWS:
        return (whole + tail_s,)
    if tile_plan == "profiled":
        rate = per_row_s if per_row_s is not None else whole / num_tokens
        # The grid the engine's calibration profiles (flowprefill.prefill.executor.calibration).
        sizes = grid(min(MAX_PROFILED_ROWS, int(GRID_HEADROOM * bound_s / rate)))
        tiles = plan_tiles(num_tokens, time_at, bound_s, sizes, overhead_s)
    else:
        tiles = tile_sizes(num_tokens, k)
    out = [time_at(m) + overhead_s for m in tiles]
    out[-1] += tail_s
    return (0.0, *out)


def attention_blocks(new: int, prefix: int, pair_budget: float) -> list[float]:
    """Query-key pairs of each block of query rows of one request (``new`` rows after
    ``prefix`` cached keys; row ``x`` sees ``prefix + x`` keys, continuously): each block
    the most rows whose pairs fit ``pair_budget`` (at least :data:`MIN_ROWS`), the last
    the rest. They sum to ``new·prefix + new²/2``."""
    blocks: list[float] = []
    a = 0
    while a < new:
        base = prefix + a
        rows = int(-base + math.sqrt(base * base + 2 * pair_budget))
        rows = min(new - a, max(MIN_ROWS, rows))
        b = a + rows
        blocks.append(rows * prefix + (b * b - a * a) / 2)
        a = b
    return blocks


def attention_pieces(
    segments: Sequence[tuple[int, int]],
    segment_s: Callable[[int, int], tuple[float, float]],
    bound_s: float,
    overhead_s: float,
) -> tuple[float, ...]:
    """Stretches of one layer's attention over ``(new, prefix)`` segments;
    ``segment_s(new, prefix)`` is a whole request's (compute, KV re-read) seconds. A
    request over the bound is cut into blocks of query rows priced at its own time per
    query-key pair; the re-read is shared among its blocks in proportion to their pairs
    (FlashAttention streams the keys once per query tile anyway, so blocks of ≥ 128 rows
    add no HBM traffic). Whole requests and blocks are packed greedily into stretches
    within ``bound_s`` (the engine's ``Packer``); a checkpoint before each stretch after
    the first — and, when a request is cut into blocks, a leading one (zero-length
    stretch) — each adding ``overhead_s``."""
    pieces: list[float] = []
    split = False
    for c, p in segments:
        compute, reread = segment_s(c, p)
        if compute + reread <= bound_s or c < 2 * MIN_ROWS:
            pieces.append(compute + reread)
            continue
        split = True
        pairs = c * p + c * c / 2
        pair_s = (compute + reread) / pairs
        pieces.extend(q * pair_s for q in attention_blocks(c, p, bound_s * pairs / compute))
    stretches: list[float] = [0.0] if split else []
    used = math.inf
    for t in pieces:
        if used + t > bound_s:
            stretches.append(overhead_s if stretches else 0.0)
            used = 0.0
        stretches[-1] += t
        used += t
    return tuple(stretches)


def even_pieces(time_s: float, bound_s: float, overhead_s: float) -> tuple[float, ...]:
    """A segment with no finer cost model (the profiled CPU engine, test models): the
    leading zero-length stretch, then ``ceil(t / b)`` equal pieces, each paying
    ``overhead_s``."""
    k = num_pieces(time_s, bound_s)
    if k == 1:
        return (time_s,)
    return (0.0, *((time_s / k + overhead_s,) * k))
