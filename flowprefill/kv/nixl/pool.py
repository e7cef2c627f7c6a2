"""The producer's paged KV buffer: one region per layer, a block allocator over it.

The buffer is allocated once, at start, on the engine's device (host memory on CPU), and
registered with NIXL whole: registering per request would cost a memory-registration
round trip on the TTFT path, and a consumer's handshake advertises every region's base
address once. Pages are written in place by :meth:`BlockPool.write` and stay until the
lease that holds them is released (:mod:`flowprefill.kv.nixl.leases`).

The buffer is touched at allocation (zero-filled), so the first hand-offs do not pay
page faults (a cold 512 MiB destination cost ~1.2 s of faults here).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from flowprefill.errors import KVBudgetExceededError, KVHandoffError
from flowprefill.kv.nixl.layout import PageLayout


class PoolExhaustedError(KVBudgetExceededError):
    """Not enough free blocks for a prompt's KV: decode recomputes it instead."""


class BlockPool:
    """``num_layers`` regions of ``num_blocks`` pages each, on ``device``."""

    def __init__(
        self,
        layout: PageLayout,
        num_layers: int,
        num_blocks: int,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_blocks < 1 or num_layers < 1:
            raise KVHandoffError(f"a KV pool needs blocks and layers: {num_blocks}, {num_layers}")
        self.layout = layout
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        # [L, blocks, block elements]: layer l's region is one contiguous run.
        self.buffer = torch.zeros(
            (num_layers, num_blocks, layout.block_elements), dtype=layout.dtype, device=device
        )
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._lock = threading.Lock()

    @classmethod
    def sized(
        cls, layout: PageLayout, num_layers: int, capacity_bytes: int, device: torch.device | str
    ) -> BlockPool:
        """As many blocks as ``capacity_bytes`` holds across all layers."""
        blocks = capacity_bytes // (layout.block_bytes * num_layers)
        if blocks < 1:
            raise KVHandoffError(
                f"{capacity_bytes} bytes hold no KV block of {layout.block_bytes * num_layers} "
                "bytes (all layers): raise the NIXL KV buffer size"
            )
        return cls(layout, num_layers, blocks, device)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    @property
    def free_blocks(self) -> int:
        with self._lock:
            return len(self._free)

    @property
    def held_bytes(self) -> int:
        """Bytes of the blocks allocated now (every layer's page of each)."""
        return (self.num_blocks - self.free_blocks) * self.num_layers * self.layout.block_bytes

    def region_addresses(self) -> list[int]:
        """Base address of each layer's region, in layer order."""
        stride = self.num_blocks * self.layout.block_bytes
        base = self.buffer.data_ptr()
        return [base + layer * stride for layer in range(self.num_layers)]

    def allocate(self, count: int) -> list[int]:
        """``count`` free block ids, or :class:`PoolExhaustedError` (nothing taken)."""
        with self._lock:
            if count > len(self._free):
                raise PoolExhaustedError(
                    f"the NIXL KV buffer has {len(self._free)} free blocks, {count} needed"
                )
            return [self._free.pop() for _ in range(count)]

    def release(self, block_ids: Sequence[int]) -> None:
        with self._lock:
            self._free.extend(reversed(block_ids))

    def write(
        self, block_ids: Sequence[int], layers: Sequence[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """Lay out each layer's ``(key, value)`` (``[H, T, D]``, or ``[1, H, T, D]``) in
        ``block_ids`` (``layout.num_blocks(T)`` of them or more; extra blocks are left as
        they are). The last block's slots past ``T`` are zeroed."""
        if len(layers) != self.num_layers:
            raise KVHandoffError(f"KV of {len(layers)} layers for a pool of {self.num_layers}")
        index = torch.tensor(block_ids, dtype=torch.long, device=self.buffer.device)
        for layer, (key, value) in enumerate(layers):
            if key.dim() == 4:
                key, value = key[0], value[0]
            need = self.layout.num_blocks(key.shape[1])
            if need > len(block_ids):
                raise KVHandoffError(
                    f"{key.shape[1]} tokens need {need} blocks, got {len(block_ids)}"
                )
            # Pack contiguously, then scatter: the request's blocks need not be adjacent.
            # Zeros, not empty: the last block's slots past the prompt are copied too, and
            # vLLM's CPU kernel turns NaN there (uninitialised memory) into NaN output.
            staged = torch.zeros(
                (need, self.layout.block_elements),
                dtype=self.buffer.dtype,
                device=self.buffer.device,
            )
            self.layout.pack(key.to(self.buffer.device), value.to(self.buffer.device), staged)
            self.buffer[layer].index_copy_(0, index[:need], staged)
