"""Packed (per-segment) attention equals masked attention over the whole packed row."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from flowprefill.prefill.executor.attention import packed_attention, register
from flowprefill.prefill.executor.context import thread_context
from flowprefill.prefill.executor.packing import chunk_segments, chunk_spans, pack


class _Module(nn.Module):
    """The attributes the sdpa integration reads from an attention module (GQA 4:2)."""

    num_key_value_groups = 2
    is_causal = True


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor
) -> torch.Tensor:
    k = k.repeat_interleave(2, dim=1)
    v = v.repeat_interleave(2, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed[None, None])
    return out.transpose(1, 2)


@given(
    lengths=st.lists(st.integers(min_value=1, max_value=9), min_size=1, max_size=4),
    chunk=st.integers(min_value=1, max_value=16),
)
@settings(max_examples=40, deadline=None)
def test_packed_attention_matches_block_diagonal_mask(lengths: list[int], chunk: int) -> None:
    gen = torch.Generator().manual_seed(sum(lengths) * 31 + chunk)
    total = sum(lengths)
    q_all = torch.randn(1, 4, total, 8, generator=gen)
    k_all = torch.randn(1, 2, total, 8, generator=gen)
    v_all = torch.randn(1, 2, total, 8, generator=gen)
    seq = torch.tensor([r for r, n in enumerate(lengths) for _ in range(n)])
    batch = pack([torch.zeros(n, dtype=torch.long) for n in lengths], torch.device("cpu"))
    for start, end in chunk_spans(total, chunk):
        # As in a chunked forward: this chunk's queries, every key cached so far.
        q, k, v = q_all[:, :, start:end], k_all[:, :, :end], v_all[:, :, :end]
        allowed = (seq[start:end, None] == seq[None, :end]) & (
            torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]
        )
        with thread_context.forward(chunk_segments(batch.starts, batch.lengths, start, end)):
            got, _ = packed_attention(_Module(), q, k, v, None, scaling=8**-0.5)
        torch.testing.assert_close(got, _reference(q, k, v, allowed), atol=1e-5, rtol=1e-5)


def test_without_segments_it_is_plain_sdpa() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 6, 8, generator=gen) for h in (4, 2, 2))
    got, _ = packed_attention(_Module(), q, k, v, None, scaling=0.3)
    want, _ = sdpa_attention_forward(_Module(), q, k, v, None, scaling=0.3)
    assert torch.equal(got, want)


def test_register_is_idempotent() -> None:
    assert register() == register() == "flowprefill_packed"
