"""BlockPool: the producer's registered paged buffer and its allocator."""

from __future__ import annotations

import itertools

import pytest
import torch

from flowprefill.errors import KVBudgetExceededError, KVHandoffError
from flowprefill.kv.nixl.layout import PageLayout
from flowprefill.kv.nixl.pool import BlockPool, PoolExhaustedError

LAYOUT = PageLayout("CPU_ATTN", 2, 32, 32, torch.float32)


def _layers(num_layers: int, tokens: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(2, tokens, 32, generator=gen), torch.randn(2, tokens, 32, generator=gen))
        for _ in range(num_layers)
    ]


def test_allocates_low_ids_first() -> None:
    pool = BlockPool(LAYOUT, num_layers=2, num_blocks=6)
    assert pool.free_blocks == 6
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    assert pool.free_blocks == 1
    assert pool.allocate(0) == []


def test_exhaustion_raises_and_takes_nothing() -> None:
    pool = BlockPool(LAYOUT, num_layers=1, num_blocks=4)
    taken = pool.allocate(3)
    with pytest.raises(PoolExhaustedError, match="1 free blocks, 2 needed"):
        pool.allocate(2)
    assert pool.free_blocks == 1
    assert pool.allocate(1) == [3]
    # the budget outcome of every transport: no hand-off, decode recomputes
    assert isinstance(PoolExhaustedError("x"), KVBudgetExceededError)
    assert sorted(taken) == [0, 1, 2]


def test_held_bytes_counts_allocated_blocks_of_every_layer() -> None:
    pool = BlockPool(LAYOUT, num_layers=3, num_blocks=4)
    assert pool.held_bytes == 0
    taken = pool.allocate(3)
    assert pool.held_bytes == 3 * 3 * LAYOUT.block_bytes == pool.nbytes * 3 // 4
    pool.release(taken[:1])
    assert pool.held_bytes == 2 * 3 * LAYOUT.block_bytes


def test_released_blocks_are_reused() -> None:
    pool = BlockPool(LAYOUT, num_layers=1, num_blocks=4)
    first = pool.allocate(2)
    second = pool.allocate(2)
    with pytest.raises(PoolExhaustedError):
        pool.allocate(1)
    pool.release(first)
    assert pool.free_blocks == 2
    again = pool.allocate(2)
    assert sorted(again) == sorted(first)
    assert not set(again) & set(second)
    # after releasing everything every id is available exactly once
    pool.release(again)
    pool.release(second)
    assert sorted(pool.allocate(4)) == [0, 1, 2, 3]


def test_sized_arithmetic() -> None:
    per_block_all_layers = LAYOUT.block_bytes * 3
    pool = BlockPool.sized(LAYOUT, 3, 5 * per_block_all_layers + per_block_all_layers - 1, "cpu")
    assert pool.num_blocks == 5 and pool.num_layers == 3
    assert pool.buffer.shape == (3, 5, LAYOUT.block_elements)
    assert pool.nbytes == 5 * per_block_all_layers
    assert BlockPool.sized(LAYOUT, 3, per_block_all_layers, "cpu").num_blocks == 1
    with pytest.raises(KVHandoffError, match="hold no KV block"):
        BlockPool.sized(LAYOUT, 3, per_block_all_layers - 1, "cpu")


def test_refuses_empty_pools() -> None:
    with pytest.raises(KVHandoffError):
        BlockPool(LAYOUT, num_layers=1, num_blocks=0)
    with pytest.raises(KVHandoffError):
        BlockPool(LAYOUT, num_layers=0, num_blocks=1)


def test_region_addresses_are_one_region_per_layer() -> None:
    pool = BlockPool(LAYOUT, num_layers=4, num_blocks=3)
    addresses = pool.region_addresses()
    stride = 3 * LAYOUT.block_bytes
    assert addresses[0] == pool.buffer.data_ptr()
    assert [b - a for a, b in itertools.pairwise(addresses)] == [stride] * 3
    for layer, address in enumerate(addresses):
        assert pool.buffer[layer].data_ptr() == address
    # block b of layer l starts at region_l + b * block_bytes
    assert pool.buffer[2][1].data_ptr() == addresses[2] + LAYOUT.block_bytes
    assert addresses[-1] + stride == pool.buffer.data_ptr() + pool.nbytes


def test_buffer_starts_zeroed() -> None:
    pool = BlockPool(LAYOUT, num_layers=2, num_blocks=3)
    assert not pool.buffer.any()


@pytest.mark.parametrize("backend", ["CPU_ATTN", "FLASH_ATTN"])
@pytest.mark.parametrize("tokens", [32, 33, 70, 96])
def test_write_to_scattered_blocks_reads_back(backend: str, tokens: int) -> None:
    layout = PageLayout(backend, 2, 32, 32, torch.float32)
    pool = BlockPool(layout, num_layers=2, num_blocks=8)
    ids = [6, 1, 4][: layout.num_blocks(tokens)]
    layers = _layers(2, tokens)
    pool.write(ids, layers)
    for layer, (key, value) in enumerate(layers):
        k, v = layout.unpack(pool.buffer[layer][ids], tokens)
        assert torch.equal(k, key) and torch.equal(v, value)
    untouched = [b for b in range(8) if b not in ids]
    assert not pool.buffer[:, untouched].any()


def test_write_accepts_batched_kv_and_extra_blocks() -> None:
    pool = BlockPool(LAYOUT, num_layers=1, num_blocks=4)
    pool.buffer[0][3].fill_(5.0)
    ((key, value),) = _layers(1, 20)
    pool.write([2, 3], [(key[None], value[None])])  # [1, H, T, D]; 3 is an extra block
    k, v = LAYOUT.unpack(pool.buffer[0][[2]], 20)
    assert torch.equal(k, key) and torch.equal(v, value)
    assert bool((pool.buffer[0][3] == 5.0).all())  # extra blocks are left as they are


def test_write_refuses_too_few_blocks_and_wrong_layer_count() -> None:
    pool = BlockPool(LAYOUT, num_layers=2, num_blocks=4)
    with pytest.raises(KVHandoffError, match="65 tokens need 3 blocks, got 2"):
        pool.write([0, 1], _layers(2, 65))
    with pytest.raises(KVHandoffError, match="KV of 1 layers for a pool of 2"):
        pool.write([0, 1], _layers(1, 10))
    assert not pool.buffer.any()


@pytest.mark.parametrize("backend", ["CPU_ATTN", "FLASH_ATTN"])
def test_write_zeroes_the_unfilled_tail(backend: str) -> None:
    """The last block's slots past the prompt are zero, whatever the pool held there:
    vLLM's CPU attention returns NaN when a block it reads holds NaN past seq_len."""
    layout = PageLayout(backend, 2, 32, 32, torch.float32)
    pool = BlockPool(layout, num_layers=1, num_blocks=3)
    pool.buffer.fill_(5.0)
    tokens = 40  # block 2 holds tokens 32..39 in 8 of its 32 slots
    ((key, value),) = _layers(1, tokens)
    pool.write([1, 2], [(key, value)])
    expected = torch.zeros((2, layout.block_elements))
    layout.pack(key, value, expected)
    assert torch.equal(pool.buffer[0][[1, 2]].view(torch.int32), expected.view(torch.int32))
