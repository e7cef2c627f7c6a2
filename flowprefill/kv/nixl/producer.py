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
from collections.abc import Callable, Sequence
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
from flowprefill.kv.format import token_ids_digest
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


class NixlRegion:
    """One rank's NIXL agent and its registered :class:`BlockPool` (every rank of an
    instance has one; only rank 0 also runs the side channel and the leases).

    ``name_prefix`` + a fresh uuid names the agent: a peer that restarts under an old name
    makes consumers fail with ``NIXL_ERR_REMOTE_DISCONNECT``. ``progress_thread``: NIXL's
    own progress thread (:func:`flowprefill.kv.nixl.settings.progress_thread` says when);
    without it the agent progresses when its notifications are read."""

    def __init__(
        self,
        layout: PageLayout,
        pool: BlockPool,
        name_prefix: str = "flowprefill",
        *,
        progress_thread: bool = True,
    ) -> None:
        api = _nixl()
        self.layout, self.pool = layout, pool
        self.agent_name = f"{name_prefix}-{uuid.uuid4()}"
        config = api.nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
        self.agent = api.nixl_agent(self.agent_name, config)
        device = pool.buffer.device
        self.mem_type = "DRAM" if device.type == "cpu" else "VRAM"
        self.device_id = 0 if device.type == "cpu" else int(device.index or 0)
        self._reg_descs = self.agent.get_reg_descs(
            [(pool.buffer.data_ptr(), pool.nbytes, self.device_id, "")], self.mem_type
        )
        self.agent.register_memory(self._reg_descs)

    def agent_metadata(self, engine_id: str) -> dict[str, Any]:
        """vLLM's ``NixlAgentMetadata`` fields for this rank, under ``engine_id`` (every
        rank of an instance answers with the instance's one engine id)."""
        layers, blocks = self.pool.num_layers, self.pool.num_blocks
        block_len = self.layout.block_bytes
        return {
            "engine_id": engine_id,
            "agent_metadata": self.agent.get_agent_metadata(),
            "kv_caches_base_addr": self.pool.region_addresses(),
            "device_id": self.device_id,
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
            "region_mem_types": [self.mem_type] * layers,
            "dcp_size": 1,
            "pcp_size": 1,
            "ple_block_len": None,
            "region_members": [],
            "packed_member_layouts": {},
        }

    def write(
        self, block_ids: Sequence[int], layers: Sequence[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """Lay ``layers`` out in ``block_ids``; on a GPU, finished when this returns (the
        consumer READs as soon as it has the answer)."""
        self.pool.write(block_ids, layers)
        if self.pool.buffer.device.type == "cuda":
            torch.cuda.current_stream(self.pool.buffer.device).synchronize()

    def drain_notifications(self) -> list[str]:
        return [
            raw.decode("utf-8", "replace")
            for messages in self.agent.get_new_notifs().values()
            for raw in messages
        ]

    def close(self) -> None:
        try:
            self.agent.deregister_memory(self._reg_descs)
        except Exception:  # the process is going away; nothing to keep consistent
            log.debug("NIXL: deregistering failed", exc_info=True)


PeerPublish = Callable[[str, list[int]], None]
"""(prompt digest, block ids) → every other rank has written its heads of that prompt's
KV into those blocks (tensor parallelism; :meth:`RankGroup.publish_kv`)."""


class NixlProducer:
    """Serve prompts' KV to stock vLLM consumers; ``close`` stops and deregisters.

    ``host``/``port``: where the side channel listens (port 0 picks one);
    ``advertise_host``: the address consumers reach it at (the pod IP), which the
    answers carry as ``remote_host``; ``progress_thread``: see :class:`NixlRegion`.

    Tensor parallelism: ``peers`` are the other ranks' :meth:`NixlRegion.agent_metadata`
    by rank (each rank's pool holds its own heads, the same block count), and
    ``publish_peers`` has them write their heads of a prompt into the blocks rank 0 chose;
    consumers handshake with every rank through this side channel (``tp_rank``) and read
    each rank's heads from its own agent."""

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
        peers: dict[int, dict[str, Any]] | None = None,
        publish_peers: PeerPublish | None = None,
        peer_notifications: Callable[[], list[tuple[int, str]]] | None = None,
        progress_thread: bool = True,
    ) -> None:
        peers = peers or {}
        if sorted(peers) != list(range(1, len(peers) + 1)):
            raise KVHandoffError(f"NIXL peers must be ranks 1..n, got {sorted(peers)}")
        if peers and publish_peers is None:
            raise KVHandoffError("NIXL peers need a way to publish their heads")
        self.model, self.layout, self.pool = model, layout, pool
        self.tp_size = 1 + len(peers)
        self._publish_peers = publish_peers
        self._peer_notifications = peer_notifications
        self.engine_id = str(uuid.uuid4())
        self.region = NixlRegion(
            layout,
            pool,
            name_prefix=f"flowprefill-{self.engine_id[:8]}",
            progress_thread=progress_thread,
        )
        self.agent_name = self.region.agent_name
        self.leases = Leases(pool.release, lease_s, ranks=self.tp_size)
        payloads = {(0, 0): self._handshake_payload(self.region.agent_metadata(self.engine_id))}
        for rank, metadata in peers.items():
            payloads[(0, rank)] = self._handshake_payload({**metadata, "engine_id": self.engine_id})
        try:
            self.side_channel = SideChannel(host, port, payloads)
        except BaseException:
            self.region.close()  # the port is taken: leave nothing registered behind
            raise
        self.host = advertise_host or (host if host not in ("", "0.0.0.0", "::") else "127.0.0.1")
        self.port = self.side_channel.port
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="nixl-notifs", daemon=True)
        self._thread.start()
        log.info(
            "NIXL producer %s: %d blocks × %d layers (%.1f MiB) on %s, %d rank(s), "
            "side channel %s:%d, progress thread %s",
            self.engine_id, pool.num_blocks, pool.num_layers, pool.nbytes / 2**20,
            pool.buffer.device, self.tp_size, self.host, self.port,
            "on" if progress_thread else "off",
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
        """vLLM's ``NixlAgentMetadata`` fields for rank 0."""
        return self.region.agent_metadata(self.engine_id)

    def _handshake_payload(self, metadata: dict[str, Any]) -> bytes:
        return msgspec.msgpack.encode(
            {
                "compatibility_hash": self.compatibility_hash(),
                "agent_metadata_bytes": msgspec.msgpack.encode(metadata),
            }
        )

    # ------------------------------------------------------------------ publishing

    def publish(
        self,
        request_id: str,
        layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
        consumer_tokens: int,
        token_ids: Sequence[int] | None = None,
    ) -> RemotePrefill:
        """Lay ``layers`` (rank 0's heads, each ``[H, T, D]`` or ``[1, H, T, D]``) out in
        free blocks, have the other ranks write theirs (``token_ids`` names the prompt to
        them), and hold the blocks for ``request_id`` until read or expired.

        ``consumer_tokens``: the length of the prompt decode will be sent (``T`` for a
        vLLM-style P/D request, ``T + 1`` when decode is sent the prompt and our first
        token). The answer lists exactly the blocks that prompt needs: vLLM reads the
        last ``n`` of the list for ``n`` blocks and dies on fewer."""
        key = layers[0][0]
        num_tokens = int(key.shape[-2])
        if consumer_tokens < num_tokens:
            raise KVHandoffError(f"decode prompt of {consumer_tokens} < {num_tokens} KV tokens")
        if self._publish_peers is not None and token_ids is None:
            raise KVHandoffError("tensor-parallel publishing needs the prompt's token ids")
        blocks = self.pool.allocate(self.layout.num_blocks(consumer_tokens))
        try:
            self.region.write(blocks, layers)
            if self._publish_peers is not None:
                assert token_ids is not None
                self._publish_peers(token_ids_digest(token_ids), blocks)
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
        """Handle the notifications that arrived and end expired leases. Under tensor
        parallelism each rank is notified when a read of *its* blocks finished (the
        notification rides on the READ), so a lease ends once every rank was: the other
        ranks' notifications arrive through ``peer_notifications``."""
        for message in self.region.drain_notifications():
            self._on_notification(message, 0)
        if self._peer_notifications is not None:
            for rank, message in self._peer_notifications():
                self._on_notification(message, rank)
        for request_id in self.leases.expire():
            log.warning("NIXL producer: KV of %s was never read; lease expired", request_id)

    def _on_notification(self, message: str, rank: int) -> None:
        if message.startswith(HEARTBEAT_PREFIX):
            self.leases.heartbeat([r for r in message[len(HEARTBEAT_PREFIX) :].split(",") if r])
            return
        request_id, _, consumers = message.rpartition(":")
        try:
            count = int(consumers)
        except ValueError:
            log.warning("NIXL producer: ignoring notification %r", message)
            return
        if not self.leases.read_done(request_id, count, rank) and request_id not in self.leases:
            log.warning("NIXL producer: %s was read after its lease ended", request_id)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)
        self.side_channel.close()
        self.region.close()
