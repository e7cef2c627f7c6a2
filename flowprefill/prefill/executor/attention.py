"""Variable-length attention for packed batches, registered as a transformers attention.

A batch runs as one packed row (see :mod:`flowprefill.prefill.executor.packing`). Attention over
that row with a block-diagonal mask would cost ``(Σ lengths)²`` and, with a mask, sdpa on
CPU falls back from its flash kernel to the math path (a 4 × 1024-token batch takes 5.7×
longer in masked attention than four causal 1024-token calls). So attention runs per
request *segment* instead: each request's queries attend to that request's keys with a
causal sdpa call, costing ``Σ lengths²`` on the fast kernel.

The executor publishes the segments of the forward pass it is about to run in the thread's
context (``segments``: :mod:`flowprefill.prefill.executor.context`); transformers passes
q/k/v for the whole row to :func:`packed_attention`, which splits them. Outside the executor
(no segments on the thread) the function is plain sdpa, so the model still works for
anything else. Projections, norms, RoPE and the KV cache are untouched: only the attention
kernel call changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from flowprefill.prefill.executor.context import thread_context
from flowprefill.prefill.executor.packing import Segment
from flowprefill.prefill.executor.splitting import (
    Packer,
    Piece,
    TraceRecorder,
    attention_pieces,
    block_attention,
)

PACKED_ATTENTION = "flowprefill_packed"


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention per segment; ``query`` ``[1, heads, q, d]``, ``key``/``value``
    ``[1, kv_heads, k, d]``; returns ``[1, q, heads, d]`` like the sdpa integration.

    The model's own ``attention_mask`` is ignored while segments are published: they encode
    the block-diagonal causal pattern exactly.
    """
    context = thread_context
    segments = context.segments
    kwargs.pop("is_causal", None)
    kwargs["dropout"] = dropout
    if segments is None:
        out, _ = sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, **kwargs
        )
        return out, None
    packer = context.packer
    if packer is None or kwargs.get("sliding_window") or kwargs.get("softcap"):
        outputs = [
            _segment_attention(module, query, key, value, seg, scaling, kwargs) for seg in segments
        ]
    else:
        width = 4.0 * query.shape[1] * query.shape[-1]
        if isinstance(packer, TraceRecorder):
            packer.events.append(("attention", width))
        pieces = attention_pieces(packer.policy, segments, width)
        if not all(piece.whole for piece, _ in pieces):
            out = _split_attention(
                module, query, key, value, segments, pieces, packer, scaling, kwargs
            )
            return out, None
        outputs = []
        for (_piece, seconds), seg in zip(pieces, segments, strict=True):
            packer.piece(seconds)  # whole segments, exactly as unsplit; maybe a checkpoint
            outputs.append(_segment_attention(module, query, key, value, seg, scaling, kwargs))
    return (outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)), None


def _segment_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    seg: Segment,
    scaling: float | None,
    kwargs: dict[str, Any],
) -> torch.Tensor:
    """One whole segment, exactly as :func:`packed_attention` runs it unsplit."""
    num_q, num_k = seg.q_end - seg.q_start, seg.k_end - seg.k_start
    mask = None
    if 1 < num_q < num_k:
        # Bottom-right causal: query i sees keys up to i + (num_k - num_q). sdpa's
        # is_causal would align to the top left, which is wrong here.
        rows = torch.arange(num_q, device=query.device)[:, None] + (num_k - num_q)
        mask = (torch.arange(num_k, device=query.device)[None, :] <= rows)[None, None]
    out, _ = sdpa_attention_forward(
        module,
        query[:, :, seg.q_start : seg.q_end],
        key[:, :, seg.k_start : seg.k_end],
        value[:, :, seg.k_start : seg.k_end],
        mask,
        scaling=scaling,
        is_causal=True,  # num_q == num_k: plain causal; num_q == 1: sees all keys
        **kwargs,
    )
    return out


def _split_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segments: Sequence[Segment],
    pieces: Sequence[tuple[Piece, float]],
    packer: Packer,
    scaling: float | None,
    kwargs: dict[str, Any] | None = None,
) -> torch.Tensor:
    """Attention in the planned pieces, each a piece of the stretch (see
    :mod:`flowprefill.prefill.executor.splitting`); ``[1, q, heads, d]`` like the unsplit path."""
    num_heads, head_dim = query.shape[1], query.shape[-1]
    out = query.new_empty((1, query.shape[2], num_heads, head_dim))
    groups = num_heads // key.shape[1]
    # The block kernels want as many key heads as query heads (GQA): expand each split
    # request's keys once, before the split's first checkpoint (it is not predicted).
    expanded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for piece, _ in pieces:
        seg = segments[piece.segment]
        if not piece.whole and piece.segment not in expanded:
            k = key[:, :, seg.k_start : seg.k_end]
            v = value[:, :, seg.k_start : seg.k_end]
            if groups > 1:
                k = k.repeat_interleave(groups, dim=1)
                v = v.repeat_interleave(groups, dim=1)
            expanded[piece.segment] = (k, v)
    packer.split_start()
    for piece, seconds in pieces:
        packer.piece(seconds)
        seg = segments[piece.segment]
        if piece.whole:
            result = _segment_attention(module, query, key, value, seg, scaling, kwargs or {})
            out[:, seg.q_start : seg.q_end] = result
            continue
        k, v = expanded[piece.segment]
        num_q = seg.q_end - seg.q_start
        block = block_attention(
            query[:, :, seg.q_start : seg.q_end],
            k,
            v,
            piece.q_start,
            piece.q_end,
            (seg.k_end - seg.k_start) - num_q,
            scaling,
        )
        start = seg.q_start + piece.q_start
        out[:, start : start + piece.q_end - piece.q_start] = block.transpose(1, 2)
    return out


def register() -> str:
    """Register the implementation (idempotent) and return its name.

    The mask interface is sdpa's, so outside the executor the model builds the masks it
    would build for sdpa.
    """
    AttentionInterface.register(PACKED_ATTENTION, packed_attention)
    AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)
    return PACKED_ATTENTION
