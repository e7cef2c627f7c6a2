"""Packing a batch of prompts into one sequence, and splitting it into chunks.

Several prompts run in one forward pass as one packed row: token ``i`` carries its own
request's position id, and a block-diagonal causal mask keeps requests from attending to
each other. transformers 5 returns a 4-D mask it is given unchanged (``masking_utils``), so
the mask built here is exactly what attention sees. With ``sdpa`` the mask is boolean (True =
attend); with ``eager`` it is additive. A single prompt takes the plain causal path instead
(no mask, ``is_causal``), which is what the model does on its own.

Mask memory is ``chunk_tokens × tokens_so_far`` per forward (16 MiB for 4K×4K booleans);
long packed batches should be chunked.
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
    sequence_ids: torch.Tensor  # [total] int64, request index of each token
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
    sequence_ids = torch.repeat_interleave(
        torch.arange(len(lengths), dtype=torch.long), torch.tensor(lengths, dtype=torch.long)
    )
    return PackedBatch(
        input_ids=input_ids.to(device),
        position_ids=position_ids.to(device),
        sequence_ids=sequence_ids.to(device),
        starts=starts,
        lengths=lengths,
    )


def chunk_spans(num_tokens: int, chunk_size: int | None) -> list[tuple[int, int]]:
    """``[start, end)`` token ranges of the chunks (one span when not chunking)."""
    if chunk_size is None or chunk_size >= num_tokens:
        return [(0, num_tokens)]
    return [(s, min(s + chunk_size, num_tokens)) for s in range(0, num_tokens, chunk_size)]


def block_causal_mask(
    sequence_ids: torch.Tensor, start: int, end: int, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Mask ``[1, 1, end-start, end]`` for queries ``start:end`` over keys ``0:end``.

    Query ``q`` may attend key ``k`` iff both belong to the same request and ``k <= q``
    (packed order equals position order within a request). ``dtype=None`` gives a boolean
    mask; a float dtype gives an additive one (0 or the dtype's minimum).
    """
    device = sequence_ids.device
    q_seq = sequence_ids[start:end, None]
    k_seq = sequence_ids[None, :end]
    q_idx = torch.arange(start, end, device=device)[:, None]
    k_idx = torch.arange(end, device=device)[None, :]
    allowed = (q_seq == k_seq) & (k_idx <= q_idx)
    allowed = allowed[None, None]
    if dtype is None:
        return allowed
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)
