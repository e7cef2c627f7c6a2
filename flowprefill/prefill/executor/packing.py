"""Packing a batch of prompts into one sequence, chunk spans, and attention segments.

Several prompts run in one forward pass as one packed row: token ``i`` carries its own
request's position id (restarting at 0 per request). Requests must not attend to each
other; rather than a block-diagonal mask over the whole row, the row is described by
:class:`Segment` s — per request, which query rows of this forward attend to which cached
keys — and :mod:`flowprefill.prefill.executor.attention` runs causal attention per segment.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedBatch:
    """Prompts laid end to end; ``starts[r]:starts[r]+lengths[r]`` is request ``r``."""

    input_ids: torch.Tensor  # [1, total] int64
    position_ids: torch.Tensor  # [1, total] int64, restarting at 0 for each request
    starts: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def num_requests(self) -> int:
        return len(self.lengths)

    @property
    def last_indices(self) -> tuple[int, ...]:
        return tuple(s + n - 1 for s, n in zip(self.starts, self.lengths, strict=True))


def pack(prompts: Sequence[torch.Tensor], device: torch.device) -> PackedBatch:
    """Pack 1-D int64 CPU tensors (already validated) and move them to ``device``."""
    lengths = tuple(int(p.numel()) for p in prompts)
    starts = tuple(sum(lengths[:i]) for i in range(len(lengths)))
    input_ids = torch.cat(list(prompts)).unsqueeze(0)
    position_ids = torch.cat([torch.arange(n, dtype=torch.long) for n in lengths]).unsqueeze(0)
    return PackedBatch(
        input_ids=input_ids.to(device),
        position_ids=position_ids.to(device),
        starts=starts,
        lengths=lengths,
    )


def chunk_spans(num_tokens: int, chunk_size: int | None) -> list[tuple[int, int]]:
    """``[start, end)`` token ranges of the chunks (one span when not chunking)."""
    if chunk_size is None or chunk_size >= num_tokens:
        return [(0, num_tokens)]
    return [(s, min(s + chunk_size, num_tokens)) for s in range(0, num_tokens, chunk_size)]


@dataclass(frozen=True, slots=True)
class Segment:
    """Queries ``q_start:q_end`` (indices within this forward's rows) attend to keys
    ``k_start:k_end`` (indices within the cache, which holds every earlier chunk too).

    The last query of a segment is the key at ``k_end - 1``: causality is aligned to the
    bottom right, as when a chunk continues a request begun in an earlier chunk.
    """

    q_start: int
    q_end: int
    k_start: int
    k_end: int


def chunk_segments(
    starts: Sequence[int], lengths: Sequence[int], chunk_start: int, chunk_end: int
) -> list[Segment]:
    """Segments of the chunk ``[chunk_start, chunk_end)`` of a packed row.

    Request ``r`` occupies ``[starts[r], starts[r] + lengths[r])``; its queries in the chunk
    attend to its keys from its first token up to the chunk's end.
    """
    segments = []
    for start, length in zip(starts, lengths, strict=True):
        end = start + length
        q_start, q_end = max(start, chunk_start), min(end, chunk_end)
        if q_start >= q_end:
            continue
        segments.append(Segment(q_start - chunk_start, q_end - chunk_start, start, q_end))
    return segments
