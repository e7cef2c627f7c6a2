"""Layout arithmetic between the hand-off ([H, T, D] per layer) and vLLM's paged cache.

Pure torch, no vLLM import, so it is unit-tested anywhere. The connector does not write
vLLM's cache tensors by indexing them itself: it hands [T, H, D] key/value tensors and a
slot mapping to the attention backend's own ``do_kv_cache_update`` (the routine vLLM uses
to store KV for tokens it computes). The in-block layout is thereby the backend's business:
the CPU backend stores [num_blocks, H, block_size, 2·D] with ISA-specific packing, CUDA
flash-attention stores [2, num_blocks, block_size, H, D] (NHD or HND), fp8 caches scale on
write — none of which this module needs to know.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flowprefill.errors import KVMismatchError


def slot_mapping(block_ids: Sequence[int], block_size: int, start: int, end: int) -> torch.Tensor:
    """Cache slots of tokens [start, end) of a request whose blocks are ``block_ids``.

    Token ``t`` lives in block ``block_ids[t // block_size]`` at offset ``t % block_size``;
    its slot is ``block_id * block_size + offset`` — the same number vLLM's model runner
    computes, also when the backend's kernel block size divides the manager's block size
    (the kernel blocks of one manager block are consecutive, so the product is unchanged).
    """
    if not 0 <= start <= end:
        raise ValueError(f"bad token range [{start}, {end})")
    needed = -(-end // block_size)
    if needed > len(block_ids):
        raise KVMismatchError("allocated blocks", f">= {needed} for {end} tokens", len(block_ids))
    tokens = torch.arange(start, end, dtype=torch.int64)
    blocks = torch.as_tensor(list(block_ids), dtype=torch.int64)[tokens // block_size]
    return blocks * block_size + tokens % block_size


def head_range(total_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """The KV heads [first, last) that tensor-parallel rank ``tp_rank`` of ``tp_size`` holds.

    The hand-off holds every KV head of the model (a TP prefill gathers its ranks' heads
    into one file); each decode rank keeps the heads vLLM's ``QKVParallelLinear``
    (vllm/model_executor/layers/linear.py) gave it:

    * ``tp_size`` divides ``total_kv_heads``: rank ``r`` holds the ``total // tp_size``
      consecutive heads starting at ``r * total // tp_size``;
    * ``total_kv_heads`` divides ``tp_size`` (more ranks than heads): every head is
      replicated on ``tp_size // total`` consecutive ranks, rank ``r`` holds head
      ``r // (tp_size // total)`` (vLLM's ``tp_rank // num_kv_head_replicas``).

    Any other degree is refused with a KVMismatchError naming both numbers (vLLM cannot
    shard such a model either). tests/kv/test_connector_tp.py checks these ranges against
    vLLM's own weight sharding for every rank of several degrees.
    """
    if total_kv_heads < 1:
        raise KVMismatchError("num_kv_heads", ">= 1", total_kv_heads)
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"bad tensor-parallel rank {tp_rank} of {tp_size}")
    if total_kv_heads >= tp_size:
        if total_kv_heads % tp_size:
            raise _unsupported_degree(total_kv_heads, tp_size)
        per_rank = total_kv_heads // tp_size
        return tp_rank * per_rank, (tp_rank + 1) * per_rank
    if tp_size % total_kv_heads:
        raise _unsupported_degree(total_kv_heads, tp_size)
    head = tp_rank // (tp_size // total_kv_heads)
    return head, head + 1


def check_tp_degree(total_kv_heads: int, tp_size: int) -> None:
    """Refuse (KVMismatchError) a decode TP degree the hand-off's heads cannot serve."""
    head_range(total_kv_heads, tp_size, 0)


def _unsupported_degree(total_kv_heads: int, tp_size: int) -> KVMismatchError:
    return KVMismatchError(
        "decode tensor-parallel degree",
        f"a divisor or a multiple of the model's {total_kv_heads} KV heads",
        tp_size,
        f"{total_kv_heads} KV heads can neither be split evenly over {tp_size} ranks nor "
        f"each be replicated on a whole number of them",
    )


def to_token_major(
    tensor: torch.Tensor, heads: tuple[int, int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """[H, T, D] (hand-off) → contiguous [T, h, D] of this rank's heads, in cache dtype.

    The dtype cast happens here (not at write time) so a bfloat16 decode can consume a
    float32 hand-off; values then match what vLLM would have computed only up to rounding.
    """
    first, last = heads
    part = tensor[first:last].to(device=device, dtype=dtype, non_blocking=True)
    # stack over heads == permute(1, 0, 2).contiguous(), but several times faster on CPU
    # for bfloat16: it copies whole rows per head.
    return torch.stack(part.unbind(0), dim=1)
