"""KV heads under tensor parallelism: gathered to rank 0 for the file hand-off
(:func:`gather_kv_heads`), or, with NIXL, every rank serving its own heads.

With the ``nixl`` transport no rank gathers KV heads to rank 0 (nothing on the TTFT path):
each rank keeps its heads of every finished prompt (:class:`FollowerKV`, keyed by the
prompt's token-id digest) until rank 0, having chosen the prompt's blocks, tells it to lay
them out there (``publish_kv``), and answers once they are written, before rank 0 hands
the blocks to decode. Each rank has its own NIXL agent and registered buffer of the same
block count; rank 0's side channel answers consumers for every rank with the agent
metadata the followers sent when they started. A consumer's "read done" notification
rides on its READ of one rank's blocks, so followers forward theirs to rank 0
(a queue), which ends a lease only when every rank's blocks were read.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from flowprefill.contracts import EngineConfig, KVTransport, NixlSettings
from flowprefill.errors import KVHandoffError
from flowprefill.kv.format import token_ids_digest

log = logging.getLogger(__name__)

KEPT_PROMPTS = 64
"""Finished prompts a follower keeps KV for until published (older ones are dropped:
their hand-off will be recomputed by decode)."""
PUBLISH_WAIT_S = 30.0
"""How long a publish waits for the follower's share of the task to finish (it finishes
with rank 0's, bar the last collective)."""
NOTIFY_POLL_S = 0.02


def gather_kv_heads(
    layers: list[tuple[torch.Tensor, torch.Tensor]],
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank 0 gets every rank's KV heads, concatenated in rank order (rank r holds heads
    ``r*H/N .. (r+1)*H/N - 1``), so its hand-off file holds all heads; others get their
    own back. One gather of all layers' keys and values per task."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 1:
        return layers
    flat = torch.stack([torch.stack([k, v]) for k, v in layers])  # [L, 2, B, h, T, d]
    if rank != 0:
        dist.gather(flat, None, dst=0)
        return layers
    parts = [torch.empty_like(flat) for _ in range(world)]
    dist.gather(flat, parts, dst=0)
    full = torch.cat(parts, dim=3)
    return [(full[i, 0], full[i, 1]) for i in range(full.shape[0])]


def nixl_enabled(config: EngineConfig) -> bool:
    return config.kv is not None and config.kv.transport is KVTransport.NIXL


class FollowerKV:
    """A follower rank's NIXL region and the KV of its recently finished prompts."""

    def __init__(self, config: EngineConfig, rank: int, model_config: Any, device: torch.device,
                 notifications: Any) -> None:  # fmt: skip
        from flowprefill.kv.nixl.producer import NixlRegion
        from flowprefill.kv.nixl.settings import progress_thread, rank_layout, rank_pool

        assert config.kv is not None
        settings = config.kv.nixl or NixlSettings()
        layout = rank_layout(settings, model_config, config.dtype, device, config.tp_size)
        pool = rank_pool(settings, layout, model_config, device, config.tp_size)
        self.rank = rank
        self.region = NixlRegion(
            layout,
            pool,
            name_prefix=f"flowprefill-rank{rank}",
            progress_thread=progress_thread(settings, device),
        )
        self._kv: OrderedDict[str, list[tuple[torch.Tensor, torch.Tensor]]] = OrderedDict()
        self._ready = threading.Condition()
        self._queue = notifications
        threading.Thread(target=self._forward, name="nixl-notifs", daemon=True).start()

    def metadata(self) -> dict[str, Any]:
        """This rank's agent metadata (rank 0 fills in the instance's engine id)."""
        return self.region.agent_metadata(engine_id="")

    def keep(self, prompts: Sequence[Sequence[int]], outputs: Sequence[Any]) -> None:
        with self._ready:
            for prompt, output in zip(prompts, outputs, strict=True):
                self._kv[token_ids_digest(prompt)] = output.kv_cache
            while len(self._kv) > KEPT_PROMPTS:
                self._kv.popitem(last=False)
            self._ready.notify_all()

    def publish(self, digest: str, block_ids: list[int]) -> None:
        deadline = time.monotonic() + PUBLISH_WAIT_S
        with self._ready:
            while digest not in self._kv:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise KVHandoffError(f"rank {self.rank} holds no KV of prompt {digest[:12]}")
                self._ready.wait(left)
            layers = self._kv.pop(digest)
        self.region.write(block_ids, layers)

    def _forward(self) -> None:
        while True:
            time.sleep(NOTIFY_POLL_S)
            try:
                for message in self.region.drain_notifications():
                    self._queue.put((self.rank, message))
            except Exception:  # keep forwarding; rank 0's lease expiry is the backstop
                log.exception("rank %d: forwarding NIXL notifications failed", self.rank)
