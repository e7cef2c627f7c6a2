"""A prefill instance as a vLLM NIXL producer: stock vLLM decode pulls our KV.

:class:`NixlProducer` owns one NIXL agent (a fresh name and engine id per start: a peer
that restarts under an old id makes consumers fail with ``NIXL_ERR_REMOTE_DISCONNECT``),
the registered :class:`~flowprefill.kv.nixl.pool.BlockPool`, the
:class:`~flowprefill.kv.nixl.side_channel.SideChannel` and the
:class:`~flowprefill.kv.nixl.leases.Leases` of published prompts. One thread polls the
agent's notifications (reads done, heartbeats) and ends expired leases.

:meth:`NixlProducer.publish` lays a finished prompt's KV out in free blocks and answers
with the :class:`~flowprefill.contracts.nixl.RemotePrefill` a decode request carries.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from flowprefill.contracts.nixl import (
    DEFAULT_LEASE_S,
    HEARTBEAT_PREFIX,
    RemotePrefill,
    compatibility_hash,
)
from flowprefill.errors import KVHandoffError
from flowprefill.kv.nixl.layout import PageLayout
from flowprefill.kv.nixl.leases import Leases
from flowprefill.kv.nixl.pool import BlockPool
from flowprefill.kv.nixl.side_channel import SideChannel

log = logging.getLogger(__name__)

NOTIFY_POLL_S = 0.02
"""How often notifications are read: they only free blocks, never gate a token."""
LAYOUT_NAME = "LBHNC"
"""vLLM's KV cache layout under NixlConnector (one contiguous block per layer)."""


@dataclass(frozen=True)
class ServedModel:
    """What the consumer's compatibility hash is computed from.

    ``name`` is decode's ``--model`` argument exactly (its path inside the decode pod, or
    its Hub id); ``dtype`` the KV dtype both sides use."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def from_config(cls, name: str, config: Any, dtype: torch.dtype) -> ServedModel:
        heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(name, int(config.num_hidden_layers), int(kv_heads), int(head_dim), dtype)


def _nixl() -> Any:
    try:
        import nixl._api as api
    except ImportError as e:  # pragma: no cover - the prefill extra installs it
        raise KVHandoffError(
            "the NIXL KV transport needs the nixl package (pip install 'nixl==1.5.1')"
        ) from e
    return api


class NixlProducer:
    """Serve prompts' KV to stock vLLM consumers; ``close`` stops and deregisters.

    ``host``/``port``: where the side channel listens (port 0 picks one);
    ``advertise_host``: the address consumers reach it at (the pod IP), which the
    answers carry as ``remote_host``. ``tp_rank``/``tp_size``: this producer's place
    among an instance's ranks (each serves its own heads)."""

    def __init__(
        self,
        model: ServedModel,
        layout: PageLayout,
        pool: BlockPool,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        lease_s: float = DEFAULT_LEASE_S,
        tp_size: int = 1,
    ) -> None:
        api = _nixl()
        self.model, self.layout, self.pool = model, layout, pool
        self.tp_size = tp_size
        self.engine_id = str(uuid.uuid4())
        self.agent_name = f"flowprefill-{self.engine_id}"
        self._agent = api.nixl_agent(self.agent_name, api.nixl_agent_config(backends=["UCX"]))
        device = pool.buffer.device
        self._mem_type = "DRAM" if device.type == "cpu" else "VRAM"
        self._device_id = 0 if device.type == "cpu" else int(device.index or 0)
        descs = self._agent.get_reg_descs(
            [(pool.buffer.data_ptr(), pool.nbytes, self._device_id, "")], self._mem_type
        )
        self._agent.register_memory(descs)
        self._reg_descs = descs
        self.leases = Leases(pool.release, lease_s)
        self.side_channel = SideChannel(host, port, {(0, 0): self._handshake_payload()})
        self.host = advertise_host or (host if host not in ("", "0.0.0.0", "::") else "127.0.0.1")
        self.port = self.side_channel.port
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="nixl-notifs", daemon=True)
        self._thread.start()
        log.info(
            "NIXL producer %s: %d blocks × %d layers (%.1f MiB) on %s, side channel %s:%d",
            self.engine_id, pool.num_blocks, pool.num_layers, pool.nbytes / 2**20, device,
            self.host, self.port,
        )  # fmt: skip

    # ------------------------------------------------------------------ handshake

    def compatibility_hash(self) -> str:
        return compatibility_hash(
            model=self.model.name,
            dtype=str(self.model.dtype),
            num_kv_heads=self.model.num_kv_heads,
            head_size=self.model.head_dim,
            num_layers=self.model.num_layers,
            attn_backend=self.layout.backend,
        )

    def agent_metadata(self) -> dict[str, Any]:
        """vLLM's ``NixlAgentMetadata`` fields for this producer's one rank."""
        layers, blocks = self.pool.num_layers, self.pool.num_blocks
        block_len = self.layout.block_bytes
        return {
            "engine_id": self.engine_id,
            "agent_metadata": self._agent.get_agent_metadata(),
            "kv_caches_base_addr": self.pool.region_addresses(),
            "device_id": self._device_id,
            "num_blocks": blocks,
            "block_lens": [block_len] * layers,
            "block_strides": [block_len] * layers,
            "kv_cache_layout": LAYOUT_NAME,
            "block_size": self.layout.block_size,
            "ssm_sizes": (0, 0),
            "attn_backend_name": self.layout.backend,
            "physical_blocks_per_logical_kv_block": 1,
            "region_num_blocks": [blocks] * layers,
            "region_group_ids": [0] * layers,
            # vLLM names regions after its own modules; None skips that comparison
            # (the layer count, block lengths and hash are still checked).
            "region_names": None,
            "region_mem_types": [self._mem_type] * layers,
            "dcp_size": 1,
            "pcp_size": 1,
            "ple_block_len": None,
            "region_members": [],
            "packed_member_layouts": {},
        }

    def _handshake_payload(self) -> bytes:
        return msgspec.msgpack.encode(
            {
                "compatibility_hash": self.compatibility_hash(),
                "agent_metadata_bytes": msgspec.msgpack.encode(self.agent_metadata()),
            }
        )

    # ------------------------------------------------------------------ publishing

    def publish(
        self,
        request_id: str,
        layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
        consumer_tokens: int,
    ) -> RemotePrefill:
        """Lay ``layers`` (each ``[H, T, D]``, or ``[1, H, T, D]``) out in free blocks and
        hold them for ``request_id`` until read or expired.

        ``consumer_tokens``: the length of the prompt decode will be sent (``T`` for a
        vLLM-style P/D request, ``T + 1`` when decode is sent the prompt and our first
        token). The answer lists exactly the blocks that prompt needs: vLLM reads the
        last ``n`` of the list for ``n`` blocks and dies on fewer."""
        key = layers[0][0]
        num_tokens = int(key.shape[-2])
        if consumer_tokens < num_tokens:
            raise KVHandoffError(f"decode prompt of {consumer_tokens} < {num_tokens} KV tokens")
        blocks = self.pool.allocate(self.layout.num_blocks(consumer_tokens))
        try:
            self.pool.write(blocks, layers)
            if self.pool.buffer.device.type == "cuda":
                # The consumer READs as soon as it has the answer.
                torch.cuda.current_stream(self.pool.buffer.device).synchronize()
        except BaseException:
            self.pool.release(blocks)
            raise
        self.leases.start(request_id, blocks)
        return RemotePrefill(
            request_id=request_id,
            engine_id=self.engine_id,
            host=self.host,
            port=self.port,
            block_ids=tuple(blocks),
            num_tokens=num_tokens,
            tp_size=self.tp_size,
        )

    def discard(self, request_id: str) -> bool:
        """Free a published prompt nobody will read."""
        return self.leases.drop(request_id)

    # ------------------------------------------------------------------ notifications

    def _watch(self) -> None:
        while not self._stop.wait(NOTIFY_POLL_S):
            try:
                self.poll()
            except Exception:  # keep serving; a bad message must not stop freeing blocks
                log.exception("NIXL producer: reading notifications failed")

    def poll(self) -> None:
        """Handle the notifications that arrived and end expired leases."""
        for messages in self._agent.get_new_notifs().values():
            for raw in messages:
                self._on_notification(raw.decode("utf-8", "replace"))
        for request_id in self.leases.expire():
            log.warning("NIXL producer: KV of %s was never read; lease expired", request_id)

    def _on_notification(self, message: str) -> None:
        if message.startswith(HEARTBEAT_PREFIX):
            self.leases.heartbeat([r for r in message[len(HEARTBEAT_PREFIX) :].split(",") if r])
            return
        request_id, _, consumers = message.rpartition(":")
        try:
            count = int(consumers)
        except ValueError:
            log.warning("NIXL producer: ignoring notification %r", message)
            return
        if not self.leases.read_done(request_id, count) and request_id not in self.leases:
            log.warning("NIXL producer: %s was read after its lease ended", request_id)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)
        self.side_channel.close()
        try:
            self._agent.deregister_memory(self._reg_descs)
        except Exception:  # the process is going away; nothing to keep consistent
            log.debug("NIXL producer: deregistering failed", exc_info=True)
