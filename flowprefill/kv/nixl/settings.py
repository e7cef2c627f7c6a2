"""From an instance's settings (engine.json's ``kv.nixl``) to one rank's page layout and
buffer: the same arithmetic on every rank, so that all ranks of an instance hold the same
block count (consumers address one block id on every rank)."""

from __future__ import annotations

from typing import Any

import torch

from flowprefill.contracts import NixlSettings
from flowprefill.contracts.names import DType
from flowprefill.contracts.nixl import CPU_BLOCK_SIZE, GPU_BLOCK_SIZE
from flowprefill.errors import KVHandoffError
from flowprefill.kv.format import DTYPES
from flowprefill.kv.nixl.layout import PageLayout, default_backend
from flowprefill.kv.nixl.pool import BlockPool


def model_heads(model_config: Any) -> tuple[int, int, int]:
    """(layers, KV heads in total, head size) of a Hugging Face config."""
    heads = int(model_config.num_attention_heads)
    kv_heads = int(getattr(model_config, "num_key_value_heads", None) or heads)
    head_dim = int(
        getattr(model_config, "head_dim", None) or int(model_config.hidden_size) // heads
    )
    return int(model_config.num_hidden_layers), kv_heads, head_dim


def rank_layout(
    settings: NixlSettings, model_config: Any, dtype: DType, device: torch.device, tp_size: int = 1
) -> PageLayout:
    """The pages one rank of ``tp_size`` writes: its ``1/tp_size`` of the KV heads."""
    _, kv_heads, head_dim = model_heads(model_config)
    if kv_heads % tp_size:
        raise KVHandoffError(f"{kv_heads} KV heads do not split over {tp_size} ranks")
    return PageLayout(
        backend=settings.attention_backend or default_backend(device),
        num_kv_heads=kv_heads // tp_size,
        head_dim=head_dim,
        block_size=settings.block_size
        or (CPU_BLOCK_SIZE if device.type == "cpu" else GPU_BLOCK_SIZE),
        dtype=DTYPES[dtype],
    )


def progress_thread(settings: NixlSettings, device: torch.device) -> bool:
    """Whether a rank's NIXL agent runs NIXL's progress thread.

    That thread polls its UCX workers without ever sleeping (the Python binding fixes its
    delay at 0), so it holds a core for the life of the process. On a GPU node that is the
    usual trade (vLLM's own agent does the same) for reads served and notifications
    delivered the moment they arrive. On a CPU host the core is the one prefill computes
    on: there the agent is progressed by the producer's notification poll instead
    (``NOTIFY_POLL_S``), and same-host reads go through UCX's shared-memory transports,
    which need no progress on our side."""
    if settings.progress_thread is not None:
        return settings.progress_thread
    return device.type != "cpu"


def rank_pool(
    settings: NixlSettings,
    layout: PageLayout,
    model_config: Any,
    device: torch.device,
    tp_size: int = 1,
) -> BlockPool:
    """``settings.buffer_mb`` for the whole instance, split evenly over its ranks: every
    rank gets the same block count."""
    layers = model_heads(model_config)[0]
    return BlockPool.sized(layout, layers, int(settings.buffer_mb * 2**20) // tp_size, device)
