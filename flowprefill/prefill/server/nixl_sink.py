"""Handing a finished prefill's KV to stock vLLM decode over NIXL.

:class:`NixlSink` is the prefill server's :data:`~flowprefill.prefill.server.kv_sink.KVSink`
for the ``nixl`` transport: it publishes the prompt's KV in the instance's
:class:`~flowprefill.kv.nixl.producer.NixlProducer` and answers with vLLM's producer
``kv_transfer_params``, which the gateway passes to decode unchanged.

Two callers, two decode prompts: our gateway sends decode the prompt *and* the first
token prefill produced (so decode continues from our token), vLLM-style P/D clients send
decode the prompt alone (decode then samples the first token itself). The blocks listed
must match the prompt decode will see, so :meth:`NixlSink.publish` takes its length.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

from flowprefill.contracts import NixlSettings
from flowprefill.contracts.names import DType
from flowprefill.contracts.nixl import SIDE_CHANNEL_HOST_ENV
from flowprefill.kv.format import DTYPES
from flowprefill.kv.nixl.layout import PageLayout, default_backend
from flowprefill.kv.nixl.pool import BlockPool
from flowprefill.kv.nixl.producer import NixlProducer, ServedModel

log = logging.getLogger(__name__)

CPU_BLOCK_SIZE = 128
"""vLLM's CPU default block size."""
GPU_BLOCK_SIZE = 16
"""vLLM's default block size with GPU attention backends."""


class NixlSink:
    """Publishes prompts' KV for stock vLLM decode; ``close`` stops the producer."""

    def __init__(self, producer: NixlProducer) -> None:
        self.producer = producer

    def __call__(self, request_id: str, token_ids: Sequence[int], output: Any) -> dict[str, Any]:
        """Our gateway's hand-off: decode is sent the prompt and our first token."""
        return self.publish(request_id, output.kv_cache, len(token_ids) + 1)

    def publish(self, request_id: str, layers: Any, decode_prompt_tokens: int) -> dict[str, Any]:
        return self.producer.publish(request_id, layers, decode_prompt_tokens).to_params()

    def discard(self, request_id: str) -> bool:
        return self.producer.discard(request_id)

    def close(self) -> None:
        self.producer.close()


def nixl_sink(
    settings: NixlSettings | None,
    *,
    model_path: str,
    model_config: Any,
    dtype: DType,
    device: str,
    host: str,
) -> NixlSink:
    """The producer ``settings`` describe, for a model of ``model_config`` on ``device``
    (rank 0's: under tensor parallelism rank 0 holds every head's KV)."""
    settings = settings or NixlSettings()
    torch_device = torch.device(device)
    heads = int(model_config.num_attention_heads)
    layout = PageLayout(
        backend=settings.attention_backend or default_backend(torch_device),
        num_kv_heads=int(getattr(model_config, "num_key_value_heads", None) or heads),
        head_dim=int(
            getattr(model_config, "head_dim", None) or int(model_config.hidden_size) // heads
        ),
        block_size=settings.block_size
        or (CPU_BLOCK_SIZE if torch_device.type == "cpu" else GPU_BLOCK_SIZE),
        dtype=DTYPES[dtype],
    )
    num_layers = int(model_config.num_hidden_layers)
    pool = BlockPool.sized(layout, num_layers, int(settings.buffer_mb * 2**20), torch_device)
    served = ServedModel.from_config(
        settings.served_model or model_path, model_config, layout.dtype
    )
    advertise = settings.advertise_host or os.environ.get(SIDE_CHANNEL_HOST_ENV)
    if advertise is None and host in ("", "0.0.0.0", "::"):
        import socket

        advertise = socket.gethostbyname(socket.gethostname())
    producer = NixlProducer(
        served,
        layout,
        pool,
        host=host,
        port=settings.side_channel_port,
        advertise_host=advertise,
        lease_s=settings.lease_s,
    )
    log.info(
        "KV over NIXL: %s pages of %d tokens for decode --model %s (hash %s…)",
        layout.backend,
        layout.block_size,
        served.name,
        producer.compatibility_hash()[:12],
    )
    return NixlSink(producer)
