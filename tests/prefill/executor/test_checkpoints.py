"""Checkpoint placement: which boundaries, how many per forward, and clear errors."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from transformers import PreTrainedModel

from flowprefill.errors import UnknownNameError
from flowprefill.models import build_model
from flowprefill.prefill.executor.checkpoints import (
    NoBoundariesError,
    install_checkpoints,
    plan_checkpoints,
)
from flowprefill.prefill.executor.context import activate
from flowprefill.prefill.executor.preemption import TaskControl

# Per decoder layer at operator granularity: qkv, attn, o_proj, gate_up|router,
# down_proj|experts. The tiny models have 2 layers.
EXPECTED_PER_FORWARD = {"operator": 10, "layer": 2, "none": 0}


def _count_forward(model: nn.Module, granularity: str, num_tokens: int = 7) -> int:
    calls = 0

    def on_boundary() -> None:
        nonlocal calls
        calls += 1

    with install_checkpoints(model, granularity, on_boundary=on_boundary) as handle:
        with torch.inference_mode():
            model(torch.arange(num_tokens).unsqueeze(0))
        assert handle.num_checkpoints_per_forward == calls
    fired = calls
    with torch.inference_mode():
        model(torch.arange(num_tokens).unsqueeze(0))
    assert calls == fired  # removed hooks no longer fire
    return fired


@pytest.mark.parametrize("granularity", ["operator", "layer", "none"])
def test_hooks_fire_the_expected_number_of_times(
    tiny_model: PreTrainedModel, granularity: str
) -> None:
    assert _count_forward(tiny_model, granularity) == EXPECTED_PER_FORWARD[granularity]
    # A second forward fires them again; after removal, nothing fires.
    assert (
        _count_forward(tiny_model, granularity, num_tokens=3) == EXPECTED_PER_FORWARD[granularity]
    )


def test_operator_boundaries_per_family(tiny_models: dict[str, PreTrainedModel]) -> None:
    dense = ["qkv_proj", "attn", "o_proj", "gate_up_proj", "down_proj"]
    moe = ["qkv_proj", "attn", "o_proj", "router", "experts"]
    for family, names in [("llama", dense), ("qwen2", dense), ("qwen3-moe", moe)]:
        placed = plan_checkpoints(tiny_models[family], "operator")
        assert [p.boundary for p in placed] == names * 2
        assert [p.layer_index for p in placed] == [0] * 5 + [1] * 5
        first = {p.boundary: (p.module_path, p.pre) for p in placed[:5]}
        assert first["qkv_proj"] == ("model.layers.0.self_attn.v_proj", False)
        assert first["attn"] == ("model.layers.0.self_attn.o_proj", True)
        assert first["o_proj"] == ("model.layers.0.self_attn.o_proj", False)


def test_moe_with_a_dense_layer_uses_dense_boundaries_there() -> None:
    model = build_model("qwen3-moe", "tiny", mlp_only_layers=[1])
    placed = plan_checkpoints(model, "operator")
    assert [p.boundary for p in placed[3:5]] == ["router", "experts"]
    assert [p.boundary for p in placed[8:10]] == ["gate_up_proj", "down_proj"]
    assert _count_forward(model, "operator") == 10


def test_active_control_counts_checkpoints(tiny_models: dict[str, PreTrainedModel]) -> None:
    model = tiny_models["qwen2"]
    control = TaskControl()
    with install_checkpoints(model, "operator"), activate(control), torch.inference_mode():
        model(torch.arange(5).unsqueeze(0))
    assert control.num_checkpoints == 10
    # Outside activate(), the same hooks are no-ops for this control.
    with install_checkpoints(model, "operator"), torch.inference_mode():
        model(torch.arange(5).unsqueeze(0))
    assert control.num_checkpoints == 10


def test_unknown_granularity_is_rejected(tiny_models: dict[str, PreTrainedModel]) -> None:
    with pytest.raises(UnknownNameError, match="granularity 'kernel'"):
        install_checkpoints(tiny_models["llama"], "kernel")


def test_installing_twice_is_refused_and_remove_restores(
    tiny_models: dict[str, PreTrainedModel],
) -> None:
    model = tiny_models["llama"]
    handle = install_checkpoints(model, "layer")
    try:
        with pytest.raises(RuntimeError, match="already installed"):
            install_checkpoints(model, "operator")
    finally:
        handle.remove()
    install_checkpoints(model, "operator").remove()  # allowed again after removal


# --- models outside the family table -----------------------------------------------


class _FusedAttention(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.qkv_proj = nn.Linear(hidden, 3 * hidden)
        self.o_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        weights = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
        return self.o_proj(weights @ v)


class _FusedMLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 4 * hidden)
        self.down_proj = nn.Linear(2 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(torch.nn.functional.silu(gate) * up)


class _Layer(nn.Module):
    def __init__(self, hidden: int, attention: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = attention
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(x)
        return x + self.mlp(x)


class _Toy(nn.Module):
    """A vLLM-style layout (fused qkv_proj / gate_up_proj) under an unknown model_type."""

    def __init__(self, num_layers: int = 3, hidden: int = 8, fused: bool = True) -> None:
        super().__init__()
        self.config = SimpleNamespace(model_type="toy", num_hidden_layers=num_layers)
        mlp: type[nn.Module] = _FusedMLP if fused else nn.Identity
        self.layers = nn.ModuleList(
            [_Layer(hidden, _FusedAttention(hidden), mlp(hidden)) for _ in range(num_layers)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _fire(model: nn.Module, granularity: str) -> int:
    calls = 0

    def on_boundary() -> None:
        nonlocal calls
        calls += 1

    with install_checkpoints(model, granularity, on_boundary=on_boundary):
        model(torch.randn(1, 4, 8))
    return calls


def test_name_based_fallback_finds_fused_projections() -> None:
    model = _Toy()
    placed = plan_checkpoints(model, "operator")
    assert [p.module_path for p in placed[:5]] == [
        "layers.0.self_attn.qkv_proj",
        "layers.0.self_attn.o_proj",
        "layers.0.self_attn.o_proj",
        "layers.0.mlp.gate_up_proj",
        "layers.0.mlp.down_proj",
    ]
    assert _fire(model, "operator") == 15
    assert _fire(model, "layer") == 3


def test_unrecognisable_model_gets_a_clear_error() -> None:
    model = _Toy(fused=False)  # no MLP projections to hook
    with pytest.raises(NoBoundariesError, match=r"no recognisable MLP operator boundaries"):
        install_checkpoints(model, "operator")
    assert _fire(model, "layer") == 3  # layer granularity still works


def test_expected_per_forward_table_matches_tiny_shape(
    tiny_models: dict[str, PreTrainedModel],
) -> None:
    for model in tiny_models.values():
        assert model.config.num_hidden_layers == 2


def _other_family(name: str) -> nn.Module:
    from transformers import AutoModelForCausalLM, GPT2Config, GPTNeoXConfig, MixtralConfig

    small: dict[str, Any] = {"hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64}
    configs = {
        "gpt2": GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0
        ),
        "gpt_neox": GPTNeoXConfig(num_hidden_layers=2, vocab_size=64, **small),
        "mixtral": MixtralConfig(
            num_hidden_layers=2, num_key_value_heads=1, vocab_size=64, num_local_experts=4, **small
        ),
    }
    return AutoModelForCausalLM.from_config(configs[name]).eval()


@pytest.mark.parametrize(
    ("family", "first_five"),
    [
        (
            "gpt2",
            [
                "h.0.attn.c_attn",
                "h.0.attn.c_proj",
                "h.0.attn.c_proj",
                "h.0.mlp.c_fc",
                "h.0.mlp.c_proj",
            ],
        ),
        (
            "gpt_neox",
            [
                "layers.0.attention.query_key_value",
                "layers.0.attention.dense",
                "layers.0.attention.dense",
                "layers.0.mlp.dense_h_to_4h",
                "layers.0.mlp.dense_4h_to_h",
            ],
        ),
        (
            "mixtral",
            [
                "layers.0.self_attn.v_proj",
                "layers.0.self_attn.o_proj",
                "layers.0.self_attn.o_proj",
                "layers.0.mlp.gate",
                "layers.0.mlp.experts",
            ],
        ),
    ],
)
def test_other_hf_families(family: str, first_five: list[str]) -> None:
    """Mixtral is in the family table; GPT-2 and GPT-NeoX go through the name fallback."""
    model = _other_family(family)
    placed = plan_checkpoints(model, "operator")
    assert [p.module_path.split(".", 1)[1] for p in placed[:5]] == first_five
    assert _count_forward(model, "operator") == 10
    assert _count_forward(model, "layer") == 2
