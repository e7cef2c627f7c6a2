"""How one block of one layer is laid out in the consumer's paged KV cache.

A stock vLLM consumer READs our blocks byte for byte into its own cache, so every page we
publish must already be in the layout its attention backend reads. With
``NixlConnector`` vLLM fixes the cache layout to ``LBHNC`` (layer, block, head, token,
content): a layer's cache is ``[num_blocks, H, N, C]`` and one block is the contiguous
``[H, N, C]`` bytes; what ``C`` holds is the backend's:

* ``CPU_ATTN`` (vLLM's CPU backend, ``vec`` ISA: x86 without AMX, or float32): per head,
  the block's ``2·N·D`` elements are the keys transposed, ``[D, N]``, then the values,
  ``[N, D]`` (``cpu_attn.py`` views the cache as ``[B, H, 2N, D]`` and splits at ``N``;
  the ``vec`` kernels store keys column-major). Other CPU ISAs (``amx`` for bfloat16 on
  AMX hardware, ``vec16`` for head sizes not divisible by 32) use other layouts and are
  refused.
* ``FLASH_ATTN`` (GPU): ``C = 2·D``, each token's key then its value
  (``flash_attn.py``: ``kv_cache.transpose(1, 2).split(head_size, dim=-1)``).

``tests/kv/nixl/test_layout.py`` checks ``CPU_ATTN`` against vLLM's own cache-writing
kernel and ``FLASH_ATTN`` against vLLM's own view of the cache, so a vLLM upgrade that
moves a byte fails there first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowprefill.contracts.nixl import (
    ATTENTION_BACKENDS,
    CPU_ATTENTION,
    CPU_BLOCK_MULTIPLE,
    FLASH_ATTENTION,
)
from flowprefill.errors import KVHandoffError


@dataclass(frozen=True)
class PageLayout:
    """One backend's block layout for one model shard.

    ``num_kv_heads`` are the heads this producer rank holds (all of them without tensor
    parallelism)."""

    backend: str
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.backend not in ATTENTION_BACKENDS:
            raise KVHandoffError(
                f"no NIXL page layout for attention backend {self.backend!r}; "
                f"supported: {', '.join(ATTENTION_BACKENDS)}"
            )
        if self.block_size < 1 or self.num_kv_heads < 1 or self.head_dim < 1:
            raise KVHandoffError(f"invalid page geometry {self}")
        if self.backend == CPU_ATTENTION:
            if self.block_size % CPU_BLOCK_MULTIPLE:
                raise KVHandoffError(
                    f"vLLM's CPU attention needs a block size that is a multiple of "
                    f"{CPU_BLOCK_MULTIPLE}, got {self.block_size}"
                )
            if self.head_dim % 32:
                raise KVHandoffError(
                    f"head size {self.head_dim}: vLLM's CPU attention stores it in its "
                    "'vec16' layout, which FlowPrefill does not write"
                )

    @property
    def block_elements(self) -> int:
        """Elements of one block of one layer: ``H · N · 2D``."""
        return self.num_kv_heads * self.block_size * 2 * self.head_dim

    @property
    def block_bytes(self) -> int:
        return self.block_elements * self.dtype.itemsize

    def num_blocks(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens (the last one partly filled)."""
        return -(-num_tokens // self.block_size)

    def pack(self, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor) -> None:
        """Write one layer's ``key``/``value`` (``[H, T, D]``) into ``out``, the
        ``[num_blocks(T), block_elements]`` pages that will hold them (on their device).

        Token ``t`` goes to block ``t // N``, slot ``t % N``; the rest of the last block
        is left as it is (the consumer recomputes from the first token past the prompt
        and never reads those slots)."""
        heads, tokens, dim = key.shape
        n = self.block_size
        blocks = self.num_blocks(tokens)
        if (heads, dim) != (self.num_kv_heads, self.head_dim) or value.shape != key.shape:
            raise KVHandoffError(
                f"KV of shape {tuple(key.shape)}/{tuple(value.shape)} does not match pages "
                f"of {self.num_kv_heads} heads × head size {self.head_dim}"
            )
        if out.shape != (blocks, self.block_elements):
            raise KVHandoffError(f"pages {tuple(out.shape)} for {tokens} tokens: want {blocks}")
        full = (tokens // n) * n
        # Full blocks in one copy each for keys and values; the partial tail apart.
        for start, stop in ((0, full), (full, tokens)):
            if stop == start:
                continue
            first, count = start // n, stop - start
            k = key[:, start:stop].to(out.dtype)
            v = value[:, start:stop].to(out.dtype)
            nb = -(-count // n)
            pages = out[first : first + nb].view(nb, heads, 2 * n * dim)
            if count % n:  # the tail: one block, `count` of its `n` slots
                self._write_tail(pages[0], k, v, count)
                continue
            k = k.reshape(heads, nb, n, dim).transpose(0, 1)  # [B, H, N, D]
            v = v.reshape(heads, nb, n, dim).transpose(0, 1)
            if self.backend == CPU_ATTENTION:
                pages[:, :, : n * dim].view(nb, heads, dim, n).copy_(k.transpose(2, 3))
                pages[:, :, n * dim :].view(nb, heads, n, dim).copy_(v)
            else:
                token_major = pages.view(nb, heads, n, 2 * dim)
                token_major[..., :dim].copy_(k)
                token_major[..., dim:].copy_(v)

    def _write_tail(self, page: torch.Tensor, k: torch.Tensor, v: torch.Tensor, count: int) -> None:
        """``page``: ``[H, 2·N·D]`` of one block; ``k``/``v``: ``[H, count, D]``."""
        heads, n, dim = self.num_kv_heads, self.block_size, self.head_dim
        if self.backend == CPU_ATTENTION:
            page[:, : n * dim].view(heads, dim, n)[:, :, :count].copy_(k.transpose(1, 2))
            page[:, n * dim :].view(heads, n, dim)[:, :count].copy_(v)
        else:
            token_major = page.view(heads, n, 2 * dim)
            token_major[:, :count, :dim].copy_(k)
            token_major[:, :count, dim:].copy_(v)

    def unpack(self, pages: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The inverse of :meth:`pack`: ``[H, T, D]`` key and value from ``pages``."""
        heads, n, dim = self.num_kv_heads, self.block_size, self.head_dim
        nb = pages.shape[0]
        view = pages.reshape(nb, heads, 2 * n * dim)
        if self.backend == CPU_ATTENTION:
            k = view[:, :, : n * dim].reshape(nb, heads, dim, n).transpose(2, 3)
            v = view[:, :, n * dim :].reshape(nb, heads, n, dim)
        else:
            token_major = view.reshape(nb, heads, n, 2 * dim)
            k, v = token_major[..., :dim], token_major[..., dim:]
        k = k.transpose(0, 1).reshape(heads, nb * n, dim)[:, :num_tokens]
        v = v.transpose(0, 1).reshape(heads, nb * n, dim)[:, :num_tokens]
        return k, v


def default_backend(device: torch.device) -> str:
    """The attention backend a stock vLLM decode uses on ``device``'s kind."""
    return CPU_ATTENTION if device.type == "cpu" else FLASH_ATTENTION


__all__ = ["FLASH_ATTENTION", "PageLayout", "default_backend"]
