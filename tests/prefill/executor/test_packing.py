"""Packing, chunk spans and attention segments, against a brute-force block-causal mask."""

from __future__ import annotations

import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flowprefill.prefill.executor.packing import Segment, chunk_segments, chunk_spans, pack

lengths_st = st.lists(st.integers(min_value=1, max_value=12), min_size=1, max_size=5)


@given(lengths=lengths_st)
@settings(max_examples=50, deadline=None)
def test_pack_lays_prompts_end_to_end(lengths: list[int]) -> None:
    prompts = [torch.arange(100 * r, 100 * r + n) for r, n in enumerate(lengths)]
    batch = pack(prompts, torch.device("cpu"))
    assert batch.num_tokens == sum(lengths)
    for r, (start, n) in enumerate(zip(batch.starts, batch.lengths, strict=True)):
        assert torch.equal(batch.input_ids[0, start : start + n], prompts[r])
        assert batch.position_ids[0, start : start + n].tolist() == list(range(n))
        assert batch.last_indices[r] == start + n - 1


def segments_to_mask(segments: list[Segment], num_q: int, num_k: int) -> list[list[bool]]:
    """What packed attention lets each query row see: bottom-right causal per segment."""
    mask = [[False] * num_k for _ in range(num_q)]
    for seg in segments:
        offset = (seg.k_end - seg.k_start) - (seg.q_end - seg.q_start)
        for i in range(seg.q_end - seg.q_start):
            for j in range(seg.k_end - seg.k_start):
                mask[seg.q_start + i][seg.k_start + j] = j <= i + offset
    return mask


@given(lengths=lengths_st, chunk=st.integers(min_value=1, max_value=20))
@settings(max_examples=60, deadline=None)
def test_segments_encode_the_block_diagonal_causal_mask(lengths: list[int], chunk: int) -> None:
    seq = [r for r, n in enumerate(lengths) for _ in range(n)]
    batch = pack([torch.zeros(n, dtype=torch.long) for n in lengths], torch.device("cpu"))
    spans = chunk_spans(batch.num_tokens, chunk)
    assert spans[0][0] == 0 and spans[-1][1] == batch.num_tokens
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    assert all(end - start <= chunk for start, end in spans)
    for start, end in spans:
        segments = chunk_segments(batch.starts, batch.lengths, start, end)
        # Query rows are covered once, in order (outputs are concatenated in this order).
        rows = [i for seg in segments for i in range(seg.q_start, seg.q_end)]
        assert rows == list(range(end - start))
        want = [[seq[k] == seq[q] and k <= q for k in range(end)] for q in range(start, end)]
        assert segments_to_mask(segments, end - start, end) == want


def test_chunk_spans_without_chunking() -> None:
    assert chunk_spans(10, None) == [(0, 10)]
    assert chunk_spans(10, 10) == [(0, 10)]
    assert chunk_spans(10, 4) == [(0, 4), (4, 8), (8, 10)]
