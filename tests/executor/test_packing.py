"""Packing, chunk spans and the block-diagonal causal mask, against brute force."""

from __future__ import annotations

import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flowprefill.executor.packing import block_causal_mask, chunk_spans, pack

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
        assert set(batch.sequence_ids[start : start + n].tolist()) == {r}
        assert batch.last_indices[r] == start + n - 1


@given(lengths=lengths_st, chunk=st.integers(min_value=1, max_value=20))
@settings(max_examples=50, deadline=None)
def test_mask_matches_brute_force(lengths: list[int], chunk: int) -> None:
    seq = [r for r, n in enumerate(lengths) for _ in range(n)]
    batch = pack([torch.zeros(n, dtype=torch.long) for n in lengths], torch.device("cpu"))
    spans = chunk_spans(batch.num_tokens, chunk)
    assert spans[0][0] == 0 and spans[-1][1] == batch.num_tokens
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    assert all(end - start <= chunk for start, end in spans)
    for start, end in spans:
        mask = block_causal_mask(batch.sequence_ids, start, end)
        assert mask.shape == (1, 1, end - start, end)
        for q in range(start, end):
            want = [seq[k] == seq[q] and k <= q for k in range(end)]
            assert mask[0, 0, q - start].tolist() == want


def test_additive_mask_for_eager_attention() -> None:
    batch = pack(
        [torch.zeros(2, dtype=torch.long), torch.zeros(1, dtype=torch.long)], torch.device("cpu")
    )
    mask = block_causal_mask(batch.sequence_ids, 0, 3, torch.float32)
    low = torch.finfo(torch.float32).min
    assert mask[0, 0].tolist() == [[0.0, low, low], [0.0, 0.0, low], [low, low, 0.0]]


def test_chunk_spans_without_chunking() -> None:
    assert chunk_spans(10, None) == [(0, 10)]
    assert chunk_spans(10, 10) == [(0, 10)]
    assert chunk_spans(10, 4) == [(0, 4), (4, 8), (8, 10)]
