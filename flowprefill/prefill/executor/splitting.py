"""Run-time operator splitting: no stretch between two checkpoints longer than a bound.

Operator-level checkpoints bound an urgent arrival's wait by one operator, but one operator
of a long prompt is itself long: attention grows with the square of the prompt (about
47 ms per layer at 32K tokens for Llama-3-8B on an A100, 450 ms for demo-llama at 8K on
this CPU), and a GEMM with the prompt's length. With a bound ``max_blocking_s``, an
operator whose *predicted* time exceeds it runs in pieces with a checkpoint between
consecutive pieces:

* linears (``nn.Linear`` in the decoder layers) and MoE expert blocks in **tiles of token
  rows**: rows are independent, so each tile is the same computation on fewer rows;
* attention in **blocks of query rows**: block ``[a, b)`` of a request attends to every key
  up to its last row — the keys before ``a`` without a mask, the ``b - a`` keys of the
  block's own square causally — and the two halves are merged with their log-sum-exps
  (exact up to float rounding). Requests short enough to stay whole run as before.

Only operators predicted over the bound are split, so short prompts run exactly as without
splitting (same kernels, same results, no extra checkpoint).

Predictions use two rates measured once on the executor's device
(:func:`flowprefill.prefill.executor.calibration.calibrate`):
GEMM FLOP/s on the model's widest decoder linear and attention FLOP/s on a block of the
model's head shape. On CUDA it also measures each decoder weight shape's GEMM time at a
grid of row counts (a :class:`~flowprefill.prefill.executor.tiling.RowProfile`): a GPU GEMM's time
per row has a wave-quantisation sawtooth that one FLOP rate cannot see, and
:func:`~flowprefill.prefill.executor.tiling.plan_tiles` uses the profile to pick tiles that avoid
its expensive sizes. Tensor-parallel ranks must split identically (they park at the same
checkpoint *number*), so rank 0's rates and profiles are broadcast to all ranks
(flowprefill/prefill/tp/ranks.py) and every rank plans from its own, equal, shard shapes.

The split checkpoints are the executor's ordinary checkpoints (same ``on_boundary``), so
parking, resuming, cancelling and TP agreement work unchanged. :func:`count_checkpoints`
predicts how many a forward adds, for the task's progress.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional

from flowprefill.prefill.executor.context import thread_context
from flowprefill.prefill.executor.packer import Packer, SplitPolicy, SplitRates
from flowprefill.prefill.executor.packing import Segment
from flowprefill.prefill.executor.tiling import (
    MIN_ROWS,
    plan_tiles,
)


def row_tiles(num_rows: int, tile_rows: int) -> list[tuple[int, int]]:
    """``[start, end)`` spans of ``ceil(num_rows / tile_rows)`` tiles whose sizes differ by
    at most one row."""
    pieces = max(1, math.ceil(num_rows / tile_rows))
    size, extra = divmod(num_rows, pieces)
    bounds = [i * size + min(i, extra) for i in range(pieces + 1)]
    return list(itertools.pairwise(bounds))


# --------------------------------------------------------------------------- attention


@dataclass(frozen=True, slots=True)
class Piece:
    """Query rows ``[q_start, q_end)`` of segment ``segment`` (relative to the segment)."""

    segment: int
    q_start: int
    q_end: int
    whole: bool


def _pairs(key_offset: int, a: int, b: int) -> int:
    """Cost of query rows ``[a, b)`` in query-key pairs, when row ``i`` sees keys up to
    ``key_offset + i``: the rectangle of keys before the block, plus the block's own causal
    square counted whole — a causal kernel on a square runs 1.3-2x slower per useful pair
    than on a rectangle (measured on CPU's flash kernel; diagonal tiles do full work)."""
    rows = b - a
    return rows * (key_offset + a) + rows * rows


def attention_plan(segments: Sequence[Segment], pair_budget: float) -> list[tuple[Piece, int]]:
    """Pieces of one attention call with their query-key pair counts: a segment within
    the budget is one whole piece; a longer one is cut into blocks of query rows, each
    within the budget (a block has at least ``MIN_ROWS`` rows, which may exceed it)."""
    pieces: list[tuple[Piece, int]] = []
    for index, seg in enumerate(segments):
        num_q = seg.q_end - seg.q_start
        offset = (seg.k_end - seg.k_start) - num_q
        total = _pairs(offset, 0, num_q)
        if total <= pair_budget:
            pieces.append((Piece(index, 0, num_q, whole=True), total))
            continue
        a = 0
        while a < num_q:
            # Largest r with r·c + r² <= budget, c = offset + a.
            c = offset + a
            r = int((-c + math.sqrt(c * c + 4 * pair_budget)) / 2)
            while r > 1 and _pairs(offset, a, a + r) > pair_budget:
                r -= 1
            b = min(num_q, a + max(MIN_ROWS, r))
            pieces.append((Piece(index, a, b, whole=False), _pairs(offset, a, b)))
            a = b
    return pieces


def _flash_cpu() -> Any:
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def block_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    a: int,
    b: int,
    key_offset: int,
    scale: float | None,
) -> torch.Tensor:
    """Query rows ``[a, b)`` of one request, ``[1, heads, b - a, d]``; row ``i`` attends
    keys ``[0, key_offset + i]``. ``key``/``value`` have as many heads as ``query``."""
    lo, hi = key_offset + a, key_offset + b
    q = query[:, :, a:b]
    flash = _flash_cpu() if query.device.type == "cpu" else None
    if flash is None:
        # CUDA: bottom-right causal alignment runs on the flash / efficient kernels.
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(b - a, hi)
        return functional.scaled_dot_product_attention(
            q, key[:, :, :hi], value[:, :, :hi], attn_mask=mask, scale=scale
        )
    # CPU: sdpa with a mask leaves the flash kernel's fast path (~28 % slower measured);
    # instead the block's own square runs causal, the keys before it unmasked, and the two
    # are merged by their log-sum-exps.
    own, own_lse = flash(q, key[:, :, lo:hi], value[:, :, lo:hi], 0.0, True, scale=scale)[:2]
    if lo == 0:
        return own
    past, past_lse = flash(q, key[:, :, :lo], value[:, :, :lo], 0.0, False, scale=scale)[:2]
    lse = torch.logaddexp(past_lse, own_lse)
    merged = past.float() * torch.exp(past_lse - lse).unsqueeze(-1) + own.float() * torch.exp(
        own_lse - lse
    ).unsqueeze(-1)
    return merged.to(query.dtype)


# ------------------------------------------------------------------------ forward state


def hooked(on_boundary: Callable[[], None]) -> Callable[[], None]:
    """``on_boundary`` for the operator-boundary hooks: it also starts a new stretch of the
    packer bound on this thread (if any)."""
    context = thread_context

    def boundary() -> None:
        packer = context.packer
        if packer is not None:
            packer.hook()
        on_boundary()

    return boundary


def gemm_pieces(policy: SplitPolicy, rows: int, flop_per_row: float) -> list[tuple[int, int]]:
    """Row tiles of an operator: one when it is predicted within the bound; with a
    profile of its weight shape the cheapest plan (:func:`plan_tiles`), else equal tiles
    of the most rows the FLOP rate says fit."""
    profile = policy.rates.gemm_profiles.get(flop_per_row)
    if profile is None:
        return row_tiles(rows, policy.tile_rows(flop_per_row))
    sizes = plan_tiles(
        rows, profile.time_s, policy.max_blocking_s, profile.rows, policy.rates.piece_overhead_s
    )
    bounds = [0, *itertools.accumulate(sizes)]
    return list(itertools.pairwise(bounds))


def gemm_seconds(policy: SplitPolicy, rows: int, flop_per_row: float) -> float:
    profile = policy.rates.gemm_profiles.get(flop_per_row)
    if profile is not None:
        return profile.time_s(rows)
    return rows * flop_per_row / policy.rates.gemm_flop_per_s


def attention_pieces(
    policy: SplitPolicy, segments: Sequence[Segment], flop_per_pair: float
) -> list[tuple[Piece, float]]:
    """Pieces of one attention call with their predicted seconds."""
    budget = policy.attention_pair_budget(flop_per_pair)
    per_pair = flop_per_pair / policy.rates.attention_flop_per_s
    return [(piece, pairs * per_pair) for piece, pairs in attention_plan(segments, budget)]


# ----------------------------------------------------------------- row-wise operators


def _tiled(
    inner: Callable[..., torch.Tensor], flop_per_row: float, x: torch.Tensor, *rest: torch.Tensor
) -> torch.Tensor:
    """Run ``inner`` over tiles of the rows of ``x`` (and of ``rest``), each tile a piece
    of the stretch, into one preallocated output (a ``cat`` would copy it twice)."""
    packer = thread_context.packer
    if packer is None:
        return inner(x, *rest)
    width = x.shape[-1]
    rows = x.numel() // width
    if isinstance(packer, TraceRecorder):
        packer.events.append(("rows", flop_per_row))
        return inner(x, *rest)
    tiles = gemm_pieces(packer.policy, rows, flop_per_row)
    if len(tiles) == 1:
        packer.piece(gemm_seconds(packer.policy, rows, flop_per_row))
        return inner(x, *rest)
    flat = x.reshape(rows, width)
    flat_rest = [t.reshape(rows, -1) for t in rest]
    out: torch.Tensor | None = None
    packer.split_start()
    for a, b in tiles:
        packer.piece(gemm_seconds(packer.policy, b - a, flop_per_row))
        y = inner(flat[a:b], *(t[a:b] for t in flat_rest))
        if out is None:
            out = y.new_empty((rows, *y.shape[1:]))
        out[a:b].copy_(y)
    assert out is not None
    return out.reshape(*x.shape[:-1], *out.shape[1:])


def is_expert_block(module: nn.Module) -> bool:
    """A fused MoE experts module (transformers 5: ``gate_up_proj``/``down_proj`` 3-D
    parameters, ``forward(hidden [n, h], top_k_index [n, k], top_k_weights [n, k])``)."""
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    return (
        isinstance(gate_up, torch.Tensor)
        and isinstance(down, torch.Tensor)
        and gate_up.ndim == 3
        and down.ndim == 3
    )


@dataclass
class SplitHandle:
    """Modules whose ``forward`` was wrapped, with their per-row cost; :meth:`remove`
    restores the forward each had before."""

    linears: list[tuple[nn.Module, float]] = field(default_factory=list)
    experts: list[tuple[nn.Module, float]] = field(default_factory=list)
    _previous: list[tuple[nn.Module, Any]] = field(default_factory=list)

    def remove(self) -> None:
        for module, previous in reversed(self._previous):
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous
        self._previous.clear()
        self.linears.clear()
        self.experts.clear()


def install_split_operators(layers: nn.Module, top_k: int = 1) -> SplitHandle:
    """Wrap every ``nn.Linear`` and fused experts block under ``layers`` (the decoder
    stack) so it splits into row tiles while a packer is bound on the calling thread
    (:meth:`~flowprefill.prefill.executor.context.ThreadContext.forward`). Composes with
    :mod:`flowprefill.prefill.executor.kernels`: the wrapper calls whatever forward was there.
    ``top_k``: experts per token (MoE cost per row)."""
    handle = SplitHandle()
    for module in layers.modules():
        if isinstance(module, nn.Linear):
            # The weight's shape, not in/out_features: a tensor-parallel shard keeps the
            # full model's attributes (flowprefill/prefill/tp/shard.py) with a slice of the weight.
            out_features, in_features = module.weight.shape
            handle.linears.append((module, 2.0 * out_features * in_features))
        elif is_expert_block(module):
            gate_up, down = module.gate_up_proj, module.down_proj
            assert isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
            per_expert = (
                2.0 * gate_up.shape[1] * gate_up.shape[2] + 2.0 * down.shape[1] * (down.shape[2])
            )
            handle.experts.append((module, per_expert * top_k))
    for module, cost in handle.linears + handle.experts:
        previous = module.__dict__.get("forward")
        inner = module.forward

        def forward(*args: torch.Tensor, _inner: Any = inner, _cost: float = cost) -> Any:
            return _tiled(_inner, _cost, *args)

        module.forward = forward
        handle._previous.append((module, previous))
    return handle


# ------------------------------------------------------------------ prediction/counts


Event = tuple[str, float]
"""One step of a forward as splitting sees it: ``("rows", flop_per_row)`` a row-wise
operator, ``("attention", flop_per_pair)``, ``("hook", 0)`` an operator-boundary
checkpoint."""


class TraceRecorder(Packer):
    """Records the order of a forward's operators and hook checkpoints (no splitting), so
    that :func:`count_checkpoints` can replay the packing for any prompt lengths."""

    __slots__ = ("events",)

    def __init__(self) -> None:
        super().__init__(SplitPolicy(math.inf, SplitRates(math.inf, math.inf)), lambda: None)
        self.events: list[Event] = []

    def hook(self) -> None:
        self.events.append(("hook", 0.0))


def count_checkpoints(
    policy: SplitPolicy, trace: Sequence[Event], num_rows: int, segments: Sequence[Segment]
) -> int:
    """Checkpoints splitting adds to one forward of ``num_rows`` rows with these attention
    segments: the packing of :class:`Packer` replayed over the recorded ``trace``."""
    packer = Packer(policy, lambda: None)
    added = 0
    for kind, cost in trace:
        if kind == "hook":
            packer.hook()
        elif kind == "rows":
            tiles = gemm_pieces(policy, num_rows, cost)
            seconds = [gemm_seconds(policy, b - a, cost) for a, b in tiles]
            added += packer.count(seconds, split=len(tiles) > 1)
        else:
            pieces = attention_pieces(policy, segments, cost)
            split = not all(piece.whole for piece, _ in pieces)
            added += packer.count([t for _, t in pieces], split)
    return added
