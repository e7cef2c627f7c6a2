"""The patches the executor applies to a model, in the order its construction applies them
(:class:`~flowprefill.prefill.executor.runner.PreemptibleExecutor`): each changes the model
and returns how to undo it (a function, or a handle whose ``remove`` undoes it). Checkpoint
hooks come from :mod:`.checkpoints`."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from flowprefill.prefill.executor.attention import register as register_packed_attention
from flowprefill.prefill.executor.checkpoints import NoBoundariesError, find_decoder_layers
from flowprefill.prefill.executor.kernels import FastLinearHandle, install_fast_linears
from flowprefill.prefill.executor.splitting import SplitHandle, install_split_operators

Undo = Callable[[], None]


def packed_attention(model: PreTrainedModel) -> Undo:
    """Run attention per request segment; the undo restores the implementation the model
    had (unless someone has set another since)."""
    original = model.config._attn_implementation
    model.set_attn_implementation(register_packed_attention())

    def undo() -> None:
        if model.config._attn_implementation != original:
            model.set_attn_implementation(original)

    return undo


def fast_linears(model: PreTrainedModel) -> FastLinearHandle:
    """Prepacked oneDNN linears in the decoder stack (none when there is no stack to find:
    the model's own linears run)."""
    try:
        layers = find_decoder_layers(model)[1]
    except NoBoundariesError:
        return FastLinearHandle()
    return install_fast_linears(layers)


def split_operators(model: PreTrainedModel) -> SplitHandle:
    """Row-tiled linears and expert blocks in the decoder stack."""
    top_k = int(getattr(model.config, "num_experts_per_tok", 1) or 1)
    return install_split_operators(find_decoder_layers(model)[1], top_k=top_k)


def layer_entry_checkpoints(layers: torch.nn.ModuleList, boundary: Callable[[], None]) -> Undo:
    """A checkpoint at the entry of every decoder layer: the first layer's is the only one
    between the embedding and layer 0's first operators (so a pass's prologue gets a stretch
    of its own); the others fall right after down_proj's and cost a call."""

    def entry(_module: torch.nn.Module, _args: object) -> None:
        boundary()

    hooks = [layer.register_forward_pre_hook(entry) for layer in layers]

    def undo() -> None:
        for hook in hooks:
            hook.remove()

    return undo
