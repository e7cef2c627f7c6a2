"""vLLM v1 KV connector that feeds FlowPrefill's prompt KV into vLLM decode.

Load it in a decode instance with::

    --kv-transfer-config '{"kv_connector": "FlowPrefillConnector",
        "kv_connector_module_path": "flowprefill.kv.connector", "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"shared_storage_path": "/path/to/handoffs"}}'

(without ``shared_storage_path``: ``$FLOWPREFILL_KV_DIR``, else /tmp/flowprefill-kv), or,
to pull each hand-off over HTTP from the prefill instance named in the request's
``kv_transfer_params.flowprefill.source``::

        "kv_connector_extra_config": {"transport": "http", "cache_dir": "/local/cache",
                                      "header_timeout_s": 1, "timeout_s": 5}

(see :class:`~flowprefill.kv.transport.HTTPPullTransport`).

Contract (vLLM 0.32 ``KVConnectorBase_V1``; one instance runs in the scheduler process,
one in each worker):

* **Which requests.** Only requests whose ``kv_transfer_params`` carry a FlowPrefill
  :class:`~flowprefill.kv.params.HandoffRef`; every other request is untouched (0 tokens).
* **How many tokens** (``get_num_new_matched_tokens``, scheduler). The hand-off header is
  read (no tensor data) and checked: same model architecture, and its token ids are a
  prefix of the request's prompt. The answer is ``min(kv_tokens, request_tokens - 1)``
  minus what vLLM's own prefix cache already holds. ``- 1`` because vLLM must compute at
  least one token of a new request to sample from; send ``prompt + [first_token]`` and that
  token is the one our prefill sampled, so no prompt token is recomputed. Loads are
  synchronous (``False``): the copy is a memcpy-speed local read, cheaper than the async
  state machine's extra scheduler round trip. The body is downloaded by the worker in
  ``start_load_kv`` (``http`` transport; blocking that step's forward pass for the
  download).
* **The header never stalls the scheduler.** Reading it (a file on a shared volume, or an
  HTTP range request to the prefill pod) runs on a small thread pool. The scheduler waits
  ``HEADER_INLINE_WAIT_S`` for it, which covers a local read or a same-zone round trip;
  a slower answer makes this method return ``None`` ("not known yet", vLLM's contract), so
  vLLM schedules everything else and asks again on its next step. The waits of one
  scheduling pass add up to at most ``STEP_INLINE_WAIT_S``. A source that never answers
  costs that one request ``header_timeout_s`` (``http``), a hung shared volume
  ``HEADER_DEADLINE_S``, then a recompute — not the whole engine.
* **Unusable KV never fails a request.** A missing, corrupted or mismatching hand-off is
  logged, reported in the response's ``kv_transfer_params`` (``status: "recomputed"``) and
  the prompt is recomputed. A failure *during* the worker copy (after the scheduler counted
  the tokens) is reported through ``get_block_ids_with_load_errors``; vLLM then fails the
  request or recomputes the blocks per ``kv_load_failure_policy`` (set ``"recompute"``).
* **Integrity.** The header check covers format, version, shapes and the token-id
  digest. Over ``http`` every download is verified in full (digest and CRC-32) before it
  is kept; on a ``shared_dir`` volume the CRC-32 is not recomputed on this hot path (it
  would read every byte twice) — partial files cannot occur (atomic rename), and
  ``read_handoff`` verifies it where a full check is wanted.
* **Tensor parallelism.** A hand-off holds *all* KV heads of the model, whatever the
  prefill's TP degree (its rank 0 gathers the ranks' heads and writes one file). A decode
  of TP degree M loads from that one file on every rank, each keeping the heads vLLM gave
  it (:func:`~flowprefill.kv.paged.head_range`): M must divide ``num_kv_heads`` (each rank
  takes ``num_kv_heads / M`` consecutive heads) or be a multiple of it (each head is
  replicated on ``M / num_kv_heads`` ranks, as vLLM's ``QKVParallelLinear`` does). Any
  other M is refused when the connector is built (KVMismatchError naming both numbers).
* **Copy** (``start_load_kv``, worker, before the forward pass). For each attention layer:
  read the token range, keep this tensor-parallel rank's KV heads, go [H,T,D] → [T,H,D] in
  the model dtype, and write it with the attention backend's own ``do_kv_cache_update`` —
  the routine vLLM stores computed KV with — so the paged layout (CPU's packed blocks,
  CUDA's NHD/HND, fp8 scaling) is the backend's concern, not ours. ``wait_for_layer_load``
  has nothing to wait for. Tested on CPU; on GPU the same path runs with a host→device
  copy and has not been run.
* **Clean-up** (``request_finished``). Reports ``loaded_tokens``; deletes the hand-off
  ``DELETE_GRACE_S`` later (``delete_after_load``, default true: ``shared_dir`` removes the
  file, ``http`` its local copy and sends the source a background ``DELETE``; the grace
  lets a step scheduled before an abort still load it). Once the request is finished nobody
  reads it again (a request preempted inside vLLM reloads it before it finishes), and a
  hand-off is large — ~0.5 GB for 4K tokens of Llama-3-8B in bf16 — so leaving it to
  prefill's age sweep (``SharedDirTransport.sweep``, for orphans) would fill the volume
  with minutes of traffic. ``delete_after_load: false`` keeps it; a transport's own copy
  is still dropped (``discard``).

This connector never produces KV (``save_kv_layer`` is a no-op): the producer is
FlowPrefill's own prefill engine, not a vLLM instance.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from flowprefill.contracts.kv import HandoffRef, result_params
from flowprefill.errors import KVHandoffError, KVMismatchError
from flowprefill.kv.cleanup import DelayedCleanup
from flowprefill.kv.format import KVHeader, ModelFingerprint, check_prompt
from flowprefill.kv.paged import check_tp_degree, head_range, slot_mapping, to_token_major
from flowprefill.kv.params import num_tokens_to_load
from flowprefill.kv.transport import default_storage_path, make_transport
from flowprefill.kv.vllm_idle import cap_idle_spin

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# A child of vLLM's "vllm" logger: it inherits vLLM's handler and format, so our lines
# appear in the decode server's log (a "flowprefill.*" logger has no handler there).
logger = logging.getLogger("vllm.flowprefill.kv.connector")

HEADER_INLINE_WAIT_S = 0.005
"""How long ``get_num_new_matched_tokens`` waits for a hand-off header before answering
"not known yet" (vLLM then asks again on its next step)..."""
STEP_INLINE_WAIT_S = 0.010
"""...and how long all such waits of one scheduling pass may add up to (a burst of new
hand-off requests with slow headers must not stall the pass)."""
HEADER_DEADLINE_S = 10.0
"""A header not read by then means recompute (a hung network volume has no timeout of its
own; the http transport gives up after its ``header_timeout_s`` first). Extra config
``header_deadline_s``."""
HEADER_THREADS = 16
DELETE_GRACE_S = 5.0
"""A finished request's hand-off is deleted this long after ``request_finished``: with
vLLM's batch queue a step that loads it may already be scheduled when an abort finishes
the request, and its worker must still find the file."""


@dataclass
class LoadSpec:
    """Copy hand-off tokens [start, end) into the request's blocks (worker side)."""

    req_id: str
    handoff_id: str
    start: int
    end: int
    block_ids: list[int]
    source: str | None = None  # where the http transport pulls the hand-off from

    @property
    def ref(self) -> HandoffRef:
        return HandoffRef(self.handoff_id, source=self.source)


@dataclass
class FlowPrefillConnectorMetadata(KVConnectorMetadata):
    """Scheduler → worker, once per step: the loads to do before this step's forward."""

    loads: list[LoadSpec] = field(default_factory=list)


@dataclass
class _Tracked:
    """Scheduler-side state of one request that carries a hand-off reference."""

    ref: HandoffRef
    header: KVHeader | None = None
    reason: str | None = None  # why the KV is unusable; None while usable
    pending: Future[KVHeader] | None = None  # header read still running
    since: float = 0.0  # when the header read started (time.monotonic)
    start: int = 0
    end: int = 0
    loaded: int = 0


class FlowPrefillConnector(KVConnectorBase_V1):
    """Consumer-only connector; see the module docstring for the full contract."""

    _cache_hit_source = CacheHitSource.DISK

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        # vLLM builds the connector in each process it configured with it (the scheduler
        # and every worker, whose queue reader spins): where $FLOWPREFILL_VLLM_IDLE_SPIN_S
        # applies (vllm_idle.py). Importing this module patches nothing.
        cap_idle_spin()
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra: dict[str, Any] = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        transport = str(extra.get("transport", "shared_dir"))
        path = extra.get("shared_storage_path") or default_storage_path()
        self._transport = make_transport(transport, **{**extra, "path": path})
        self._delete_after_load = bool(extra.get("delete_after_load", True))
        self._block_size = int(vllm_config.cache_config.block_size)
        model_config = vllm_config.model_config
        if getattr(model_config, "use_mla", False):
            raise KVHandoffError("FlowPrefillConnector does not support MLA models")
        self._expected = ModelFingerprint.from_config(model_config.hf_text_config)
        # Fail at start-up, not on every request, for a TP degree the heads cannot serve.
        check_tp_degree(
            self._expected.num_kv_heads, int(vllm_config.parallel_config.tensor_parallel_size)
        )
        # Resolved to a torch.dtype by the time connectors are built; the type says str too.
        dtype = model_config.dtype
        self._model_dtype = dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype)
        self._tracked: dict[str, _Tracked] = {}  # scheduler side
        self._header_pool: ThreadPoolExecutor | None = None  # scheduler side, made on use
        self._header_deadline_s = float(extra.get("header_deadline_s", HEADER_DEADLINE_S))
        self._inline_left_s = STEP_INLINE_WAIT_S  # scheduler side, reset every step
        self._cleanup = DelayedCleanup()  # scheduler side
        self._to_load: dict[str, _Tracked] = {}  # scheduler side, allocated, not yet sent
        self._failed_blocks: set[int] = set()  # worker side
        logger.info(
            "FlowPrefillConnector role=%s transport=%s storage=%s block_size=%d model=%s",
            role.name,
            transport,
            getattr(self._transport, "root", path),
            self._block_size,
            self._expected,
        )

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        tracked = self._track(request)
        if tracked is None:
            return 0, False
        if tracked.pending is not None:
            if not tracked.pending.done():
                if time.monotonic() - tracked.since < self._header_deadline_s:
                    return None, False  # not known yet: vLLM skips the request this step
                tracked.pending.cancel()  # the read may go on; its result is ignored
                tracked.pending = None
                tracked.reason = f"hand-off header not read within {self._header_deadline_s:g} s"
                logger.warning(
                    "request %s: %s, recomputing the prompt", request.request_id, tracked.reason
                )
                return 0, False
            self._settle(request, tracked)
        if tracked.header is None:
            return 0, False
        n = num_tokens_to_load(tracked.header.num_tokens, request.num_tokens, num_computed_tokens)
        # The scheduler calls this then update_state_after_alloc in the same pass; the
        # range is remembered here because the latter is not told where the load starts.
        tracked.start, tracked.end = num_computed_tokens, num_computed_tokens + n
        return n, False

    def _track(self, request: Request) -> _Tracked | None:
        """Start the header check of the request's hand-off once; None if it has none."""
        req_id = request.request_id
        if req_id in self._tracked:
            return self._tracked[req_id]
        try:
            ref = HandoffRef.from_params(request.kv_transfer_params)
        except KVHandoffError as exc:
            logger.warning("request %s: bad kv_transfer_params: %s", req_id, exc)
            return None
        if ref is None:
            return None
        tracked = _Tracked(ref=ref)
        self._tracked[req_id] = tracked
        if self._header_pool is None:
            self._header_pool = ThreadPoolExecutor(HEADER_THREADS, thread_name_prefix="kv-header")
        prompt = list(request.prompt_token_ids or [])
        tracked.since = time.monotonic()
        tracked.pending = self._header_pool.submit(self._checked_header, req_id, ref, prompt)
        if self._inline_left_s > 0:
            wait_futures([tracked.pending], timeout=min(HEADER_INLINE_WAIT_S, self._inline_left_s))
            self._inline_left_s -= time.monotonic() - tracked.since
        return tracked

    def _checked_header(self, req_id: str, ref: HandoffRef, prompt: list[int]) -> KVHeader:
        """Read and validate a hand-off header (header pool thread; no connector state)."""
        t0 = time.perf_counter()
        header = self._transport.header(ref)
        logger.debug(
            "request %s: header of hand-off %s in %.2f ms",
            req_id,
            ref.handoff_id,
            (time.perf_counter() - t0) * 1e3,
        )
        header.fingerprint.check_matches(self._expected)
        if ref.num_tokens is not None and ref.num_tokens != header.num_tokens:
            raise KVMismatchError("num_tokens", ref.num_tokens, header.num_tokens)
        check_prompt(header, prompt)
        return header

    def _settle(self, request: Request, tracked: _Tracked) -> None:
        """Fold a finished header check into the request's state (scheduler thread)."""
        assert tracked.pending is not None
        future, tracked.pending = tracked.pending, None
        try:
            tracked.header = future.result()
        except (KVHandoffError, OSError) as exc:  # OSError: unreadable mount, permissions
            tracked.reason = f"{type(exc).__name__}: {exc}"
            logger.warning(
                "request %s: hand-off %s unusable, recomputing the prompt: %s",
                request.request_id,
                tracked.ref.handoff_id,
                exc,
            )
        except Exception as exc:  # a bug here must cost a recompute, not the engine
            tracked.reason = f"{type(exc).__name__}: {exc}"
            logger.exception(
                "request %s: checking hand-off %s failed", request.request_id, tracked.ref
            )

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        tracked = self._tracked.get(request.request_id)
        if tracked is None or num_external_tokens == 0:
            return
        if tracked.end - tracked.start != num_external_tokens:
            logger.warning(
                "request %s: scheduler accepted %d external tokens, connector offered %d",
                request.request_id,
                num_external_tokens,
                tracked.end - tracked.start,
            )
            tracked.end = tracked.start + num_external_tokens
        self._to_load[request.request_id] = tracked

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        # Called once at the end of every scheduling pass.
        self._inline_left_s = STEP_INLINE_WAIT_S
        meta = FlowPrefillConnectorMetadata()
        for new_req in scheduler_output.scheduled_new_reqs:
            tracked = self._to_load.pop(new_req.req_id, None)
            if tracked is not None:
                meta.loads.append(self._spec(new_req.req_id, tracked, new_req.block_ids[0]))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            # A request resumed after preemption lists all its blocks in new_block_ids.
            tracked = self._to_load.get(req_id)
            block_ids = cached.new_block_ids[i]
            if tracked is not None and req_id in cached.resumed_req_ids and block_ids:
                del self._to_load[req_id]
                meta.loads.append(self._spec(req_id, tracked, block_ids[0]))
        if self._to_load:  # allocated but not scheduled: load when it is
            logger.debug("hand-offs waiting for scheduling: %s", sorted(self._to_load))
        return meta

    @staticmethod
    def _spec(req_id: str, tracked: _Tracked, block_ids: list[int]) -> LoadSpec:
        tracked.loaded = tracked.end - tracked.start
        ref = tracked.ref
        return LoadSpec(
            req_id, ref.handoff_id, tracked.start, tracked.end, list(block_ids), ref.source
        )

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._to_load.pop(request.request_id, None)
        tracked = self._tracked.pop(request.request_id, None)
        if tracked is None:
            return False, None
        if tracked.pending is not None:  # aborted (or finished) before its header arrived
            tracked.pending.cancel()
            tracked.pending = None
            tracked.reason = tracked.reason or "request finished before its hand-off was read"
        self._cleanup.after(DELETE_GRACE_S, self._clean_up, tracked.ref)
        return False, result_params(tracked.ref, tracked.loaded, tracked.reason)

    def _clean_up(self, ref: HandoffRef) -> None:
        """Delete the hand-off (or, with ``delete_after_load`` off, the transport's own copy)."""
        try:
            if self._delete_after_load:
                self._transport.delete(ref)
            else:
                self._transport.discard(ref)
        except Exception as exc:  # clean-up must never fail a request, nor shutdown
            logger.warning("clean-up of hand-off %s failed: %s", ref.handoff_id, exc)

    def shutdown(self) -> None:
        # No step runs after this: nothing can still be loading what awaits clean-up.
        self._cleanup.run_all_now()
        # Header reads in flight are bounded by the transport's timeouts; don't wait for them.
        if self._header_pool is not None:
            self._header_pool.shutdown(wait=False, cancel_futures=True)
        super().shutdown()

    # ------------------------------------------------------------------- worker side

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, FlowPrefillConnectorMetadata)
        if not meta.loads:
            return
        layers = _attention_layers(forward_context)
        for spec in meta.loads:
            try:
                self._load_one(spec, layers)
            except Exception:  # report, never crash the engine: vLLM applies its policy
                logger.exception("request %s: KV load from %s failed", spec.req_id, spec.handoff_id)
                first, last = spec.start // self._block_size, -(-spec.end // self._block_size)
                self._failed_blocks.update(spec.block_ids[first:last])

    def _load_one(self, spec: LoadSpec, layers: dict[int, Any]) -> None:
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        slots: torch.Tensor | None = None
        t0 = time.perf_counter()
        with self._transport.open(spec.ref) as reader:
            header = reader.header
            if max(layers, default=-1) >= header.num_layers:
                raise KVMismatchError("num_layers", max(layers) + 1, header.num_layers)
            total = header.fingerprint.num_kv_heads
            world, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
            heads = head_range(total, world, rank)
            for index, layer in sorted(layers.items()):
                cache = layer.kv_cache
                if heads[1] - heads[0] != layer.num_kv_heads:
                    raise KVMismatchError(
                        f"KV heads of tensor-parallel rank {rank} of {world}",
                        heads[1] - heads[0],
                        layer.num_kv_heads,
                        f"the hand-off's {total} heads give this rank heads "
                        f"[{heads[0]}, {heads[1]}); layer {index} holds {layer.num_kv_heads}",
                    )
                if slots is None:
                    slots = slot_mapping(spec.block_ids, self._block_size, spec.start, spec.end)
                    slots = slots.to(cache.device)
                key, value = reader.layer(index, spec.start, spec.end)
                key = to_token_major(key, heads, self._model_dtype, cache.device)
                value = to_token_major(value, heads, self._model_dtype, cache.device)
                layer.impl.do_kv_cache_update(layer, key, value, cache, slots)
        logger.info(
            "request %s: loaded %d prompt tokens [%d, %d) of hand-off %s into %d layers "
            "in %.1f ms%s",
            spec.req_id,
            spec.end - spec.start,
            spec.start,
            spec.end,
            spec.handoff_id,
            len(layers),
            (time.perf_counter() - t0) * 1e3,
            f" (pulled from {spec.source})" if spec.source else "",
        )

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv copies synchronously

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # consumer only

    def wait_for_save(self) -> None:
        return

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed


def _attention_layers(forward_context: ForwardContext) -> dict[int, Any]:
    """Decoder attention layers that own a KV cache, by model layer index."""
    from vllm.model_executor.models.utils import extract_layer_index

    out: dict[int, Any] = {}
    for name, layer in forward_context.no_compile_layers.items():
        cache = getattr(layer, "kv_cache", None)
        impl = getattr(layer, "impl", None)
        if not isinstance(cache, torch.Tensor) or cache.numel() == 0:
            continue
        if not hasattr(impl, "do_kv_cache_update"):
            raise KVHandoffError(
                f"attention backend of {name} ({type(impl).__name__}) writes KV inside its "
                "forward (no do_kv_cache_update); FlowPrefillConnector cannot load into it"
            )
        out[extract_layer_index(name)] = layer
    return out
