"""Producer side: turn a Hugging Face prefill's KV cache into a hand-off.

The prefill executor already returns ``[(key, value)]`` per layer in hand-off layout
([num_kv_heads, num_tokens, head_dim], keys after RoPE) and calls
:func:`~flowprefill.kv.format.build_handoff` directly. :func:`layers_from_cache` accepts
what ``model(..., use_cache=True)`` returns, and :func:`reference_prefill` is a plain,
non-preemptible prefill used by tests and benchmarks as the producer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from flowprefill.kv.format import KVHandoff, ModelFingerprint, build_handoff


def layers_from_cache(cache: Any, batch_index: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (key, value) of one batch row, each [H, T, D].

    Accepts a transformers 5 ``DynamicCache`` (``.layers[i].keys``), the legacy tuple of
    (key, value) pairs, or a list of pairs already without a batch dim.
    """
    if hasattr(cache, "layers"):
        pairs = [(layer.keys, layer.values) for layer in cache.layers]
    else:
        pairs = [(pair[0], pair[1]) for pair in cache]
    out = []
    for key, value in pairs:
        if key.dim() == 4:
            key, value = key[batch_index], value[batch_index]
        out.append((key, value))
    return out


@dataclass
class ReferencePrefill:
    """What :func:`reference_prefill` returns: the hand-off, the greedy first token and the
    logits it was sampled from (the engine's own result is
    :class:`flowprefill.prefill.engine.PrefillResult`)."""

    handoff: KVHandoff
    first_token_id: int
    logits: torch.Tensor  # [vocab], last prompt position


def reference_prefill(
    model: Any, token_ids: Sequence[int], request_id: str = ""
) -> ReferencePrefill:
    """One un-batched HF forward over the prompt; greedy first token; the hand-off."""
    ids = torch.tensor([list(token_ids)], dtype=torch.int64, device=model.device)
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)
    logits = out.logits[0, -1].float()
    first = int(torch.argmax(logits).item())
    handoff = build_handoff(
        layers_from_cache(out.past_key_values),
        token_ids,
        ModelFingerprint.from_config(model.config),
        request_id=request_id,
        first_token_id=first,
    )
    return ReferencePrefill(handoff=handoff, first_token_id=first, logits=logits)
