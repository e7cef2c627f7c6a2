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
from collections.abc import Callable, Sequence
from typing import Any

import torch

from flowprefill.contracts import NixlSettings
from flowprefill.contracts.names import DType
from flowprefill.contracts.nixl import SIDE_CHANNEL_HOST_ENV
from flowprefill.kv.nixl.producer import NixlProducer, PeerPublish, ServedModel
from flowprefill.kv.nixl.settings import progress_thread, rank_layout, rank_pool

log = logging.getLogger(__name__)


class NixlSink:
    """Publishes prompts' KV for stock vLLM decode; ``close`` stops the producer."""

    def __init__(self, producer: NixlProducer) -> None:
        self.producer = producer

    def __call__(self, request_id: str, token_ids: Sequence[int], output: Any) -> dict[str, Any]:
        """Our gateway's hand-off: decode is sent the prompt and our first token."""
        return self.publish(request_id, output.kv_cache, token_ids, len(token_ids) + 1)

    def publish(
        self, request_id: str, layers: Any, token_ids: Sequence[int], decode_prompt_tokens: int
    ) -> dict[str, Any]:
        producer = self.producer
        return producer.publish(request_id, layers, decode_prompt_tokens, token_ids).to_params()

    def discard(self, request_id: str) -> bool:
        return self.producer.discard(request_id)

    @property
    def budget_bytes(self) -> int:
        """The registered buffers of every rank: the KV budget of the ``nixl`` transport."""
        return self.producer.pool.nbytes * self.producer.tp_size

    def held_bytes(self) -> int:
        """Leased blocks, every rank (ranks hold the same blocks of their own heads)."""
        return self.producer.pool.held_bytes * self.producer.tp_size

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
    peers: dict[int, dict[str, Any]] | None = None,
    publish_peers: PeerPublish | None = None,
    peer_notifications: Callable[[], list[tuple[int, str]]] | None = None,
) -> NixlSink:
    """The producer ``settings`` describe, for a model of ``model_config`` on rank 0's
    ``device``; under tensor parallelism (``peers``: the other ranks' agent metadata)
    rank 0 serves its own heads and the side channel of all ranks."""
    settings = settings or NixlSettings()
    torch_device = torch.device(device)
    tp_size = 1 + len(peers or {})
    layout = rank_layout(settings, model_config, dtype, torch_device, tp_size)
    pool = rank_pool(settings, layout, model_config, torch_device, tp_size)
    name = settings.served_model or model_path
    served = ServedModel.from_config(name, model_config, layout.dtype)
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
        peers=peers,
        publish_peers=publish_peers,
        peer_notifications=peer_notifications,
        progress_thread=progress_thread(settings, torch_device),
    )
    log.info(
        "KV over NIXL: %s pages of %d tokens for decode --model %s (hash %s…), %d rank(s)",
        layout.backend,
        layout.block_size,
        served.name,
        producer.compatibility_hash()[:12],
        tp_size,
    )
    return NixlSink(producer)
