"""PageLayout against vLLM's own cache writer (CPU_ATTN) and cache view (FLASH_ATTN).

A stock vLLM consumer copies our blocks byte for byte into its cache; these tests fail
first if a vLLM upgrade moves a byte inside a block."""

from __future__ import annotations

import pytest
import torch

from flowprefill.errors import KVHandoffError
from flowprefill.kv.nixl.layout import PageLayout
from flowprefill.kv.nixl.pool import BlockPool

HEADS, DIM, BLOCK = 2, 64, 32
BLOCK_IDS = [2, 0, 3]
"""Non-contiguous, out-of-order destination blocks in a 4-block cache."""
NUM_CACHE_BLOCKS = 4


def _kv(tokens: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token-major key/value ``[T, H, D]`` (vLLM's layout of a forward's KV)."""
    gen = torch.Generator().manual_seed(seed)
    key = torch.randn(tokens, HEADS, DIM, generator=gen).to(dtype)
    value = torch.randn(tokens, HEADS, DIM, generator=gen).to(dtype)
    return key, value


def _slots(tokens: int, block_ids: list[int], block_size: int) -> torch.Tensor:
    return torch.tensor(
        [block_ids[t // block_size] * block_size + t % block_size for t in range(tokens)],
        dtype=torch.long,
    )


def _ours_in_pool(
    layout: PageLayout, key: torch.Tensor, value: torch.Tensor, block_ids: list[int]
) -> torch.Tensor:
    """Our pages for ``key``/``value`` (``[T, H, D]``), placed at ``block_ids`` of a
    zeroed one-layer pool: ``[num_blocks, block_elements]``."""
    pool = BlockPool(layout, num_layers=1, num_blocks=NUM_CACHE_BLOCKS)
    need = layout.num_blocks(key.shape[0])
    pool.write(block_ids[:need], [(key.transpose(0, 1), value.transpose(0, 1))])
    return pool.buffer[0]


@pytest.mark.parametrize("tokens", [BLOCK, 2 * BLOCK, BLOCK + 1, 5, 3 * BLOCK - 7, 3 * BLOCK])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_attn_matches_vllm_cache_kernel(tokens: int, dtype: torch.dtype) -> None:
    pytest.importorskip("vllm")
    import vllm._custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, BLOCK, DIM)
    if isa != "vec":
        pytest.skip(f"vLLM picks CPU attention ISA {isa!r} here; PageLayout writes 'vec' only")
    # vLLM's CPU cache: [B, H, N, 2D], viewed as cpu_attn.py does before writing.
    cache = torch.zeros(NUM_CACHE_BLOCKS, HEADS, BLOCK, 2 * DIM, dtype=dtype)
    key_cache, value_cache = cache.view(NUM_CACHE_BLOCKS, HEADS, 2 * BLOCK, DIM).chunk(2, dim=2)
    key, value = _kv(tokens, dtype)
    ops.cpu_attn_reshape_and_cache(
        key, value, key_cache, value_cache, _slots(tokens, BLOCK_IDS, BLOCK), isa
    )
    assert cache.abs().sum() > 0  # the kernel wrote something

    layout = PageLayout("CPU_ATTN", HEADS, DIM, BLOCK, dtype)
    ours = _ours_in_pool(layout, key, value, BLOCK_IDS)
    theirs = cache.reshape(NUM_CACHE_BLOCKS, -1)
    used = BLOCK_IDS[: layout.num_blocks(tokens)]
    for block in used:
        if block == used[-1] and tokens % BLOCK:
            # The tail of the last block: only the slots the prompt fills are compared
            # (vLLM recomputes from there; our staging leaves the rest undefined).
            count = tokens % BLOCK
            ours_k = ours[block].view(HEADS, 2 * BLOCK * DIM)[:, : BLOCK * DIM]
            theirs_k = theirs[block].view(HEADS, 2 * BLOCK * DIM)[:, : BLOCK * DIM]
            assert torch.equal(
                ours_k.view(HEADS, DIM, BLOCK)[:, :, :count],
                theirs_k.view(HEADS, DIM, BLOCK)[:, :, :count],
            )
            ours_v = ours[block].view(HEADS, 2 * BLOCK * DIM)[:, BLOCK * DIM :]
            theirs_v = theirs[block].view(HEADS, 2 * BLOCK * DIM)[:, BLOCK * DIM :]
            assert torch.equal(
                ours_v.view(HEADS, BLOCK, DIM)[:, :count],
                theirs_v.view(HEADS, BLOCK, DIM)[:, :count],
            )
        else:
            assert torch.equal(ours[block], theirs[block]), f"block {block} differs"
    for block in set(range(NUM_CACHE_BLOCKS)) - set(used):
        assert torch.equal(ours[block], theirs[block])  # both untouched (zero)


@pytest.mark.parametrize("tokens", [BLOCK, BLOCK + 1, 5, 3 * BLOCK - 7])
def test_cpu_attn_pack_is_exact_including_tail(tokens: int) -> None:
    """pack() into a zeroed ``out`` leaves the unused tail slots zero, so the whole
    block equals what vLLM's kernel writes into a zeroed cache."""
    pytest.importorskip("vllm")
    import vllm._custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(torch.float32, BLOCK, DIM)
    if isa != "vec":
        pytest.skip(f"vLLM picks CPU attention ISA {isa!r} here; PageLayout writes 'vec' only")
    layout = PageLayout("CPU_ATTN", HEADS, DIM, BLOCK, torch.float32)
    nb = layout.num_blocks(tokens)
    cache = torch.zeros(nb, HEADS, BLOCK, 2 * DIM)
    key_cache, value_cache = cache.view(nb, HEADS, 2 * BLOCK, DIM).chunk(2, dim=2)
    key, value = _kv(tokens, torch.float32, seed=1)
    ops.cpu_attn_reshape_and_cache(
        key, value, key_cache, value_cache, _slots(tokens, list(range(nb)), BLOCK), isa
    )
    out = torch.zeros(nb, layout.block_elements)
    layout.pack(key.transpose(0, 1), value.transpose(0, 1), out)
    assert torch.equal(out, cache.reshape(nb, -1))


@pytest.mark.parametrize("tokens", [16, 17, 5, 3 * 16 - 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_attn_matches_vllm_cache_view(tokens: int, dtype: torch.dtype) -> None:
    block, heads, dim = 16, 3, 8
    layout = PageLayout("FLASH_ATTN", heads, dim, block, dtype)
    gen = torch.Generator().manual_seed(2)
    key = torch.randn(heads, tokens, dim, generator=gen).to(dtype)
    value = torch.randn(heads, tokens, dim, generator=gen).to(dtype)
    nb = layout.num_blocks(tokens)
    pages = torch.zeros(nb, layout.block_elements, dtype=dtype)
    layout.pack(key, value, pages)
    kv_cache = pages.reshape(nb, heads, block, 2 * dim)  # [B, H, N, 2D]
    # vllm/v1/attention/backends/flash_attn.py: (B, H, N, 2D) -> ((B, N, H, D), (B, N, H, D))
    key_cache, value_cache = kv_cache.transpose(1, 2).split(dim, dim=-1)
    assert key_cache.shape == (nb, block, heads, dim)
    for t in range(tokens):
        b, n = divmod(t, block)
        assert torch.equal(key_cache[b, n], key[:, t]), t
        assert torch.equal(value_cache[b, n], value[:, t]), t
    # the unfilled tail of the last block is left as it was
    if tokens % block:
        assert not key_cache[-1, tokens % block :].any()
        assert not value_cache[-1, tokens % block :].any()


def test_flash_attn_view_line_is_vllms() -> None:
    """The view above is the one vLLM's FlashAttention backend applies (source check:
    the module needs CUDA to import, so its text is read instead)."""
    pytest.importorskip("vllm")
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("vllm.v1.attention.backends.flash_attn")
    assert spec is not None and spec.origin is not None
    source = Path(spec.origin).read_text()
    assert "kv_cache.transpose(1, 2).split(self.head_size, dim=-1)" in source


@pytest.mark.parametrize("backend", ["CPU_ATTN", "FLASH_ATTN"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 31, 32, 33, 64, 100])
def test_pack_unpack_round_trip(backend: str, dtype: torch.dtype, tokens: int) -> None:
    layout = PageLayout(backend, 2, 32, 32, dtype)
    gen = torch.Generator().manual_seed(tokens)
    key = torch.randn(2, tokens, 32, generator=gen).to(dtype)
    value = torch.randn(2, tokens, 32, generator=gen).to(dtype)
    pages = torch.full((layout.num_blocks(tokens), layout.block_elements), 7.0, dtype=dtype)
    layout.pack(key, value, pages)
    k, v = layout.unpack(pages, tokens)
    assert k.dtype == dtype and k.shape == key.shape
    assert torch.equal(k, key) and torch.equal(v, value)


def test_pack_converts_dtype_to_the_pages() -> None:
    layout = PageLayout("FLASH_ATTN", 1, 4, 4, torch.bfloat16)
    key = torch.randn(1, 6, 4)
    pages = torch.zeros(2, layout.block_elements, dtype=torch.bfloat16)
    layout.pack(key, -key, pages)
    k, v = layout.unpack(pages, 6)
    assert torch.equal(k, key.to(torch.bfloat16)) and torch.equal(v, (-key).to(torch.bfloat16))


def test_geometry_arithmetic() -> None:
    layout = PageLayout("CPU_ATTN", 2, 64, 32, torch.bfloat16)
    assert layout.block_elements == 2 * 32 * 2 * 64
    assert layout.block_bytes == layout.block_elements * 2
    assert [layout.num_blocks(t) for t in (0, 1, 32, 33, 64, 65)] == [0, 1, 1, 2, 2, 3]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("PAGED", 2, 64, 32), "no NIXL page layout for attention backend 'PAGED'"),
        (("cpu_attn", 2, 64, 32), "no NIXL page layout"),
        (("CPU_ATTN", 2, 64, 16), "multiple of 32, got 16"),
        (("CPU_ATTN", 2, 64, 48), "multiple of 32, got 48"),
        (("CPU_ATTN", 2, 80, 32), "head size 80"),
        (("CPU_ATTN", 2, 48, 32), "head size 48"),
        (("FLASH_ATTN", 0, 64, 16), "invalid page geometry"),
        (("FLASH_ATTN", 2, 0, 16), "invalid page geometry"),
        (("FLASH_ATTN", 2, 64, 0), "invalid page geometry"),
    ],
)
def test_refuses_layouts_it_cannot_write(args: tuple[str, int, int, int], match: str) -> None:
    with pytest.raises(KVHandoffError, match=match):
        PageLayout(*args, dtype=torch.float32)


def test_flash_attn_accepts_any_block_and_head_size() -> None:
    PageLayout("FLASH_ATTN", 1, 80, 16, torch.float16)  # no CPU restrictions


@pytest.mark.parametrize("backend", ["CPU_ATTN", "FLASH_ATTN"])
def test_pack_refuses_wrong_shapes(backend: str) -> None:
    layout = PageLayout(backend, 2, 32, 32, torch.float32)
    good_k = torch.zeros(2, 40, 32)
    pages = torch.zeros(2, layout.block_elements)
    with pytest.raises(KVHandoffError, match="does not match pages"):
        layout.pack(torch.zeros(3, 40, 32), torch.zeros(3, 40, 32), pages)  # heads
    with pytest.raises(KVHandoffError, match="does not match pages"):
        layout.pack(torch.zeros(2, 40, 16), torch.zeros(2, 40, 16), pages)  # head size
    with pytest.raises(KVHandoffError, match="does not match pages"):
        layout.pack(good_k, torch.zeros(2, 39, 32), pages)  # value differs
    with pytest.raises(KVHandoffError, match="want 2"):
        layout.pack(good_k, good_k, torch.zeros(1, layout.block_elements))  # too few pages
    with pytest.raises(KVHandoffError, match="want 2"):
        layout.pack(good_k, good_k, torch.zeros(3, layout.block_elements))  # too many
    with pytest.raises(KVHandoffError, match="want 2"):
        layout.pack(good_k, good_k, torch.zeros(2, layout.block_elements - 1))
