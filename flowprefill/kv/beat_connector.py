"""A vLLM v1 KV connector that moves no KV: it only sends decode *beats*
(:mod:`flowprefill.kv.beats`) so a prefill engine on the same device learns when decode
steps run.

Loaded by stock vLLM through its documented extension point, alone or beside the real
KV connector under vLLM's ``MultiConnector`` (:func:`flowprefill.contracts.beats.with_beats`)::

    --kv-transfer-config '{"kv_connector": "FlowPrefillBeatConnector",
        "kv_connector_module_path": "flowprefill.kv.beat_connector", "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"beat_socket": "/run/flowprefill/beats.sock"}}'

(``beat_socket`` may also be a list: beats go to every prefill instance on the device.)

Contract (vLLM 0.32 ``KVConnectorBase_V1``):

* Scheduler side, ``build_connector_meta`` (once per scheduling pass): the step's
  decoding requests — those scheduled for exactly one token (a prompt chunk has more) —
  go to the worker in this connector's metadata. It never claims tokens
  (``get_num_new_matched_tokens`` answers 0), so beside another connector it changes
  nothing of what is loaded.
* Worker side (rank 0 of tensor and pipeline parallelism only, so one decode instance is
  one sender): ``bind_connector_metadata`` — which vLLM calls right before the step's
  forward pass, loads or not — sends ``START``; ``wait_for_save`` — called once the
  forward has returned, every step — sends ``END``. Both are non-blocking datagrams
  (a few µs), dropped when no prefill listens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from flowprefill.contracts.beats import SOCKET_KEY, socket_paths
from flowprefill.kv.beats import END, START, BeatSender
from flowprefill.kv.vllm_idle import cap_idle_spin

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


@dataclass
class BeatMetadata(KVConnectorMetadata):
    """Scheduler → worker, once per step: the ids of the step's decoding requests."""

    decoding: list[str] = field(default_factory=list)


class FlowPrefillBeatConnector(KVConnectorBase_V1):
    """Beats only; see the module docstring."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        cap_idle_spin()  # as our other connector: inert unless the environment asks
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra: dict[str, Any] = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        try:
            self.socket_paths = socket_paths(extra.get(SOCKET_KEY))
        except ValueError as e:
            raise ValueError(
                f"{type(self).__name__} needs kv_connector_extra_config.{SOCKET_KEY}, the "
                f"prefill engines' beat socket path(s): {e}"
            ) from None
        self._sender: BeatSender | None = None  # worker side, made on first beat
        self._step = 0
        self._decoding: list[str] = []

    # ------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        return

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return BeatMetadata(
            [rid for rid, n in scheduler_output.num_scheduled_tokens.items() if n == 1]
        )

    # --------------------------------------------------------------- worker side

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        sender = self._worker_sender()
        if sender is None:
            return
        decoding = getattr(connector_metadata, "decoding", None)
        self._decoding = list(decoding) if isinstance(decoding, list) else []
        self._step += 1
        sender.send(START, self._step, self._decoding)

    def wait_for_save(self) -> None:
        sender = self._worker_sender()
        if sender is not None:
            sender.send(END, self._step, self._decoding)

    def _worker_sender(self) -> BeatSender | None:
        """The sender on the first rank of the instance; None on every other rank."""
        if self._sender is None:
            if not _first_rank():
                return None
            self._sender = BeatSender(self.socket_paths)
        return self._sender

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return  # called after the forward when no load is synchronous: not a start

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return

    def shutdown(self) -> None:
        if self._sender is not None:
            self._sender.close()
        super().shutdown()


def _first_rank() -> bool:
    """Tensor- and pipeline-parallel rank 0 (True where no group is initialised)."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        return bool(get_tp_group().is_first_rank and get_pp_group().is_first_rank)
    except (AssertionError, ImportError):  # groups not initialised: a single process
        return True
