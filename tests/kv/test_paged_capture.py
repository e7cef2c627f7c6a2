"""Layout arithmetic and the HF producer side, without vLLM."""

from __future__ import annotations

import pytest
import torch

from flowprefill.errors import KVMismatchError
from flowprefill.kv import ModelFingerprint, layers_from_cache, reference_prefill
from flowprefill.kv.paged import head_range, slot_mapping, to_token_major


def test_slot_mapping_follows_block_table() -> None:
    slots = slot_mapping([7, 2, 9], block_size=4, start=3, end=9)
    assert slots.tolist() == [7 * 4 + 3, 2 * 4, 2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 9 * 4]
    assert slot_mapping([5], 128, 0, 0).numel() == 0
    with pytest.raises(KVMismatchError, match="allocated blocks"):
        slot_mapping([1], block_size=4, start=0, end=5)


@pytest.mark.parametrize(
    ("total", "tp", "rank", "want"),
    [(8, 1, 0, (0, 8)), (8, 2, 1, (4, 8)), (8, 4, 2, (4, 6)), (2, 4, 3, (1, 2)), (2, 4, 1, (0, 1))],
)
def test_head_range(total: int, tp: int, rank: int, want: tuple[int, int]) -> None:
    assert head_range(total, tp, rank) == want


@pytest.mark.parametrize(("total", "tp"), [(6, 4), (4, 3), (4, 6), (2, 3)])
def test_head_range_refuses_degrees_that_neither_split_nor_replicate(total: int, tp: int) -> None:
    with pytest.raises(KVMismatchError, match=f"{total} KV heads .* over {tp} ranks") as err:
        head_range(total, tp, 0)
    assert err.value.found == tp


def test_to_token_major() -> None:
    x = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)
    out = to_token_major(x, (1, 2), torch.bfloat16, torch.device("cpu"))
    assert out.shape == (3, 1, 4) and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert torch.equal(out[:, 0].float(), x[1])


def test_reference_prefill_matches_hf_cache() -> None:
    from flowprefill.models import build_model

    model = build_model("llama", "tiny", seed=0)
    ids = [5, 9, 33, 7, 100, 11]
    result = reference_prefill(model, ids, request_id="r")
    header = result.handoff.header
    assert header.fingerprint == ModelFingerprint.from_config(model.config)
    assert header.num_tokens == len(ids) and header.first_token_id == result.first_token_id
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), use_cache=True)
    layers = layers_from_cache(out.past_key_values)
    assert len(layers) == model.config.num_hidden_layers
    for (k0, v0), (k1, v1) in zip(layers, result.handoff.layers, strict=True):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    assert result.first_token_id == int(out.logits[0, -1].argmax())
    # legacy tuple form gives the same tensors
    legacy = [(k[None], v[None]) for k, v in layers]
    assert torch.equal(layers_from_cache(legacy)[1][0], layers[1][0])
