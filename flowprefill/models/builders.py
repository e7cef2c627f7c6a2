"""Tiny random causal LMs built from configs (no downloads), deterministic by seed.

Names are ``<size>-<family>``: sizes ``tiny`` (fast CPU tests) and ``demo`` (the shape the
vLLM-on-CPU notes used: hidden 512, 6 layers, 8 heads / 2 KV heads, vocab 32000, ~46M
parameters); families ``llama``, ``qwen2`` and ``qwen3-moe``. The special-token ids in the
configs match :mod:`flowprefill.models.tokenizer`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3MoeConfig,
)

from flowprefill.errors import UnknownNameError
from flowprefill.models.tokenizer import ENDOFTEXT, IM_END, special_token_ids

FAMILIES = ("llama", "qwen2", "qwen3-moe")


@dataclass(frozen=True)
class ModelSize:
    """Shape of a tiny model; MoE fields are used by MoE families only."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int = 8192
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64


SIZES: dict[str, ModelSize] = {
    "tiny": ModelSize(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=2048,
        moe_intermediate_size=32,
    ),
    "demo": ModelSize(
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=32000,
        moe_intermediate_size=256,
    ),
}


def model_names() -> list[str]:
    return [f"{size}-{family}" for size in SIZES for family in FAMILIES]


def parse_name(name: str) -> tuple[str, str]:
    """``"tiny-qwen3-moe"`` → ``("tiny", "qwen3-moe")``; UnknownNameError otherwise."""
    size, _, family = name.partition("-")
    if size not in SIZES or family not in FAMILIES:
        raise UnknownNameError("model", name, model_names())
    return size, family


def build_config(family: str, size: str | ModelSize = "tiny", **overrides: Any) -> PretrainedConfig:
    """A config for ``family`` at ``size``; ``overrides`` replace any config field."""
    if family not in FAMILIES:
        raise UnknownNameError("model family", family, FAMILIES)
    shape = SIZES[size] if isinstance(size, str) else size
    ids = special_token_ids()
    common: dict[str, Any] = {
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "max_position_embeddings": shape.max_position_embeddings,
        "tie_word_embeddings": False,
        "bos_token_id": ids[ENDOFTEXT],
        "eos_token_id": ids[IM_END],
        "pad_token_id": ids[ENDOFTEXT],
        "dtype": "float32",
    }
    common.update(overrides)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "qwen2":
        return Qwen2Config(**common)
    moe: dict[str, Any] = {
        "num_experts": shape.num_experts,
        "num_experts_per_tok": shape.num_experts_per_tok,
        "moe_intermediate_size": shape.moe_intermediate_size,
        "norm_topk_prob": True,
    }
    moe.update(common)
    return Qwen3MoeConfig(**moe)


def build_model(
    family: str,
    size: str | ModelSize = "tiny",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> PreTrainedModel:
    """A randomly initialised model in eval mode; the same seed gives the same weights.

    The global RNG state is restored afterwards so building a model never perturbs a
    caller's random stream.
    """
    config = build_config(family, size, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    _silence_special_tokens(model)
    model.eval()
    return model


def _silence_special_tokens(model: PreTrainedModel) -> None:
    """Zero the LM head's rows of the special tokens (end of text, the chat markers,
    unknown), so that a greedy pick never chooses one: each has logit 0 while the largest
    of the other random logits is positive. A trained model does not emit padding or
    ``<unk>`` mid-answer; a random one would, and a special token is generated without
    text (``skip_special_tokens``), so a client that counts the tokens of the streamed
    text (aiperf, inference-perf) would count fewer than the server generated. With the
    greedy default of :func:`flowprefill.models.loader.save_model_dir` the built-in
    models' answers carry every generated token as text; it also means they never stop
    at end of text before ``max_tokens``."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):  # an invariant of the built-in families
        raise AssertionError(f"unexpected LM head {type(head).__name__}")
    with torch.no_grad():
        head.weight[list(special_token_ids().values())] = 0.0


def build_named(name: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    size, family = parse_name(name)
    return build_model(family, size, seed=seed, dtype=dtype)
