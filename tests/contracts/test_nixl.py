"""The NIXL contract with stock vLLM decode: versions, compatibility hash, the producer's
``kv_transfer_params``, TP pairings and decode's ``--kv-transfer-config``."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from flowprefill.contracts import nixl
from flowprefill.contracts.nixl import (
    NIXL_CONNECTOR_VERSION,
    VLLM_VERSION,
    RemotePrefill,
    check_decode_tp,
    compatibility_hash,
    consumer_kv_transfer_config,
    wants_remote_decode,
)
from flowprefill.errors import KVHandoffError

DEMO_MODEL = "/root/.cache/flowprefill/models/demo-llama-seed0"
DEMO_HASH = "e984e282b5a4da66cef330806fee78125485dc88063dd99b6416b4d687e3008e"
"""vLLM 0.32's hash for the demo model (float32, 2 KV heads of 64, 6 layers, CPU_ATTN)."""

HASH_INPUTS: list[dict[str, Any]] = [
    dict(
        model=DEMO_MODEL,
        dtype="torch.float32",
        num_kv_heads=2,
        head_size=64,
        num_layers=6,
        attn_backend="CPU_ATTN",
    ),
    dict(
        model="meta-llama/Llama-3.1-8B-Instruct",
        dtype="torch.bfloat16",
        num_kv_heads=8,
        head_size=128,
        num_layers=32,
        attn_backend="FLASH_ATTN",
    ),
    dict(
        model="m",
        dtype="torch.float16",
        num_kv_heads=1,
        head_size=64,
        num_layers=2,
        attn_backend="FLASH_ATTN",
        cache_dtype="fp8",
        hybrid_kv_cache_manager=False,
    ),
]


@pytest.fixture(scope="module")
def vllm_metadata() -> ModuleType:
    pytest.importorskip("vllm")
    import vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata as metadata

    return metadata


# ------------------------------------------------------------------ versions and hash


def test_versions_are_the_installed_vllms(vllm_metadata: ModuleType) -> None:
    import vllm

    assert vllm.__version__ == VLLM_VERSION
    assert vllm_metadata.NIXL_CONNECTOR_VERSION == NIXL_CONNECTOR_VERSION
    assert vllm_metadata.GET_META_MSG == nixl.GET_META_MSG


def test_demo_model_hash_is_the_reference_value() -> None:
    """A pure function of its inputs: these inputs give what vLLM 0.32 decode computed."""
    assert compatibility_hash(**HASH_INPUTS[0]) == DEMO_HASH


def _vllm_config(inputs: dict[str, Any]) -> SimpleNamespace:
    """What ``compute_nixl_compatibility_hash`` reads of a ``VllmConfig``."""
    model_config = SimpleNamespace(
        model=inputs["model"],
        dtype=inputs["dtype"],  # the recipe takes str() of it
        get_total_num_kv_heads=lambda: inputs["num_kv_heads"],
        get_head_size=lambda: inputs["head_size"],
        get_total_num_hidden_layers=lambda: inputs["num_layers"],
    )
    return SimpleNamespace(
        model_config=model_config,
        cache_config=SimpleNamespace(cache_dtype=inputs.get("cache_dtype", "auto")),
        scheduler_config=SimpleNamespace(
            disable_hybrid_kv_cache_manager=not inputs.get("hybrid_kv_cache_manager", True)
        ),
        speculative_config=None,
    )


@pytest.mark.parametrize("inputs", HASH_INPUTS, ids=["demo", "llama8b", "fp8-no-hma"])
def test_hash_is_vllms(vllm_metadata: ModuleType, inputs: dict[str, Any]) -> None:
    from vllm.config.utils import hash_factors

    ours = compatibility_hash(**inputs)
    # vLLM's own function, on a config carrying the same values
    theirs = vllm_metadata.compute_nixl_compatibility_hash(
        _vllm_config(inputs), inputs["attn_backend"]
    )
    assert ours == theirs
    # and the factor dict that function builds, spelled out
    factors = {
        "vllm_version": VLLM_VERSION,
        "nixl_connector_version": NIXL_CONNECTOR_VERSION,
        "model": inputs["model"],
        "dtype": inputs["dtype"],
        "num_kv_heads": inputs["num_kv_heads"],
        "head_size": inputs["head_size"],
        "num_hidden_layers": inputs["num_layers"],
        "attn_backend_name": inputs["attn_backend"],
        "cache_dtype": inputs.get("cache_dtype", "auto"),
        "is_hma_enabled": inputs.get("hybrid_kv_cache_manager", True),
        "speculative_config": None,
        "transfer_mode": "pull",
    }
    assert ours == hash_factors(factors)


def test_vllm_hashes_a_torch_dtype_as_our_string(vllm_metadata: ModuleType) -> None:
    import torch

    config = _vllm_config(HASH_INPUTS[0])
    config.model_config.dtype = torch.float32
    assert vllm_metadata.compute_nixl_compatibility_hash(config, "CPU_ATTN") == DEMO_HASH


@pytest.mark.parametrize(
    "change",
    [
        {"model": DEMO_MODEL + "/"},
        {"dtype": "torch.bfloat16"},
        {"num_kv_heads": 4},
        {"head_size": 128},
        {"num_layers": 7},
        {"attn_backend": "FLASH_ATTN"},
        {"cache_dtype": "fp8"},
        {"hybrid_kv_cache_manager": False},
    ],
)
def test_every_input_changes_the_hash(change: dict[str, Any]) -> None:
    assert compatibility_hash(**{**HASH_INPUTS[0], **change}) != DEMO_HASH


# ------------------------------------------------------------------ kv_transfer_params

ANSWER = RemotePrefill(
    request_id="cmpl-1-0",
    engine_id="e-1",
    host="10.0.0.5",
    port=5600,
    block_ids=(4, 0, 9),
    num_tokens=70,
    tp_size=2,
)


def test_remote_prefill_round_trip() -> None:
    params = ANSWER.to_params()
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_block_ids"] == [[4, 0, 9]]
    assert params["remote_request_id"] == "cmpl-1-0" and params["remote_engine_id"] == "e-1"
    assert (params["remote_host"], params["remote_port"]) == ("10.0.0.5", 5600)
    assert params["remote_num_tokens"] == 70 and params["tp_size"] == 2
    assert params["transfer_mode"] == "pull"
    assert RemotePrefill.from_params(params) == ANSWER
    assert ANSWER.handoff_id == "cmpl-1-0"


def test_from_params_takes_json_shaped_values() -> None:
    params = {**ANSWER.to_params(), "remote_port": "5600", "remote_block_ids": [["4", 0, 9.0]]}
    assert RemotePrefill.from_params(params) == ANSWER
    minimal = {
        k: v for k, v in ANSWER.to_params().items() if k not in ("tp_size", "remote_num_tokens")
    }
    got = RemotePrefill.from_params(minimal)
    assert got is not None and got.tp_size == 1 and got.num_tokens == 0


def test_params_keys_are_vllms_producer_answer(vllm_metadata: ModuleType) -> None:
    """The keys vLLM's own producer answers with (``pull_scheduler.py``'s ``dict(...)``)."""
    spec = importlib.util.find_spec(
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler"
    )
    assert spec is not None and spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text())
    answers = [
        {kw.arg for kw in node.keywords}
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "dict"
        and any(kw.arg == "do_remote_prefill" for kw in node.keywords)
    ]
    assert answers, "vLLM's producer answer not found"
    assert set(ANSWER.to_params()) in answers


@pytest.mark.parametrize("params", [None, {}, {"do_remote_prefill": False}, {"x": 1}])
def test_from_params_none_for_non_answers(params: dict[str, Any] | None) -> None:
    assert RemotePrefill.from_params(params) is None


@pytest.mark.parametrize(
    "key",
    ["remote_block_ids", "remote_request_id", "remote_engine_id", "remote_host", "remote_port"],
)
def test_from_params_refuses_missing_keys(key: str) -> None:
    params = ANSWER.to_params()
    del params[key]
    with pytest.raises(KVHandoffError, match="not a NIXL producer answer"):
        RemotePrefill.from_params(params)


@pytest.mark.parametrize(
    "change",
    [
        {"remote_block_ids": []},
        {"remote_block_ids": None},
        {"remote_block_ids": [["x"]]},
        {"remote_port": "http"},
        {"remote_port": None},
        {"tp_size": "two"},
    ],
)
def test_from_params_refuses_malformed_values(change: dict[str, Any]) -> None:
    with pytest.raises(KVHandoffError, match="not a NIXL producer answer"):
        RemotePrefill.from_params({**ANSWER.to_params(), **change})


def test_wants_remote_decode() -> None:
    assert wants_remote_decode({"do_remote_decode": True}) is True
    assert wants_remote_decode({"do_remote_decode": True, "do_remote_prefill": False}) is True
    assert wants_remote_decode({"do_remote_decode": False}) is False
    assert wants_remote_decode({"do_remote_prefill": True}) is False
    assert wants_remote_decode({}) is False
    assert wants_remote_decode(None) is False


# ------------------------------------------------------------------ TP and decode config


@pytest.mark.parametrize(("prefill", "decode"), [(1, 1), (2, 1), (2, 2), (4, 4), (4, 1)])
def test_decode_tp_accepted(prefill: int, decode: int) -> None:
    check_decode_tp(prefill, decode)


@pytest.mark.parametrize(("prefill", "decode"), [(2, 4), (4, 2), (1, 2)])
def test_decode_tp_refused(prefill: int, decode: int) -> None:
    with pytest.raises(KVHandoffError, match=f"decode tensor parallelism {decode} cannot"):
        check_decode_tp(prefill, decode)


@pytest.mark.parametrize(("prefill", "decode"), [(0, 1), (1, 0), (0, 0), (-1, 1)])
def test_decode_tp_refuses_degrees_below_one(prefill: int, decode: int) -> None:
    with pytest.raises(KVHandoffError, match=">= 1"):
        check_decode_tp(prefill, decode)


def test_consumer_kv_transfer_config() -> None:
    assert consumer_kv_transfer_config() == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_consumer",
        "kv_buffer_device": "cuda",
        "kv_load_failure_policy": "recompute",
    }
    cpu = consumer_kv_transfer_config(device="cpu", backends=["UCX"])
    assert cpu["kv_buffer_device"] == "cpu"
    assert cpu["kv_connector_extra_config"] == {"backends": ["UCX"]}


def test_consumer_kv_transfer_config_is_valid_for_vllm(vllm_metadata: ModuleType) -> None:
    from vllm.config import KVTransferConfig

    config = KVTransferConfig(**consumer_kv_transfer_config(device="cpu"))  # type: ignore[arg-type]
    assert config.kv_connector == "NixlConnector"
    assert config.is_kv_consumer and not config.is_kv_producer
    assert config.kv_buffer_device == "cpu"
