"""The preemptible prefill executor: a batch of prompts in, first tokens and KV caches out.

One forward pass (or one per chunk) runs the whole batch; preemption checkpoints fire from
hooks inside it. A task that is preempted parks its thread *inside* the forward pass, so
resuming continues the same Python frame with every tensor untouched: the result of a
preempted-and-resumed prefill is bit-identical to an uninterrupted one.

Typical use by the execution pool, one thread per task::

    executor = PreemptibleExecutor(model, granularity="operator", chunk_size=None)
    control = TaskControl(name="batch-7")
    outputs = executor.run(prompts, control)     # on the task's thread
    # meanwhile the scheduler thread: control.request_preempt(); ...; control.resume()
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from flowprefill.contracts.names import DeviceSync, Granularity, Kernels
from flowprefill.errors import InvalidRequestError
from flowprefill.prefill.executor import patches
from flowprefill.prefill.executor.calibration import calibrate
from flowprefill.prefill.executor.checkpoints import (
    check_granularity,
    describe,
    find_decoder_layers,
    install_checkpoints,
)
from flowprefill.prefill.executor.context import thread_context
from flowprefill.prefill.executor.device import (
    DeviceStreams,
    boundary_fn,
    check_run_ahead,
    check_sync_mode,
    per_check_sync,
    streams_for,
)
from flowprefill.prefill.executor.kernels import (
    FastLinearHandle,
    resolve_kernels,
)
from flowprefill.prefill.executor.memory import (
    ParkedFootprint,
    measure_current_thread,
    weight_storages,
)
from flowprefill.prefill.executor.packing import PackedBatch, chunk_segments, chunk_spans, pack
from flowprefill.prefill.executor.preemption import TaskControl
from flowprefill.prefill.executor.splitting import (
    Event,
    Packer,
    SplitHandle,
    SplitPolicy,
    SplitRates,
    TraceRecorder,
    count_checkpoints,
    hooked,
)

PromptLike = Sequence[int] | torch.Tensor
KVGather = Callable[
    [list[tuple[torch.Tensor, torch.Tensor]]], list[tuple[torch.Tensor, torch.Tensor]]
]


@dataclass(frozen=True)
class PrefillOutput:
    """Result of one request's prefill.

    ``kv_cache[layer] = (key, value)``, each ``[num_kv_heads, num_tokens, head_dim]`` with
    RoPE applied (as the model stores them). For a batch they are *views* into the batch's
    cache tensors (no copy on the critical path); ``.contiguous()`` or ``.clone()`` them
    to get independent storage.
    """

    first_token_id: int
    logits: torch.Tensor  # [vocab_size] float32, last prompt position
    kv_cache: list[tuple[torch.Tensor, torch.Tensor]]
    num_prompt_tokens: int


class PreemptibleExecutor:
    """Runs batched prefills of one model with preemption checkpoints installed.

    Thread-safe in the sense the pool needs: several task threads may each be inside
    :meth:`run` (all but one parked); they share the weights and hooks, and each has its
    own cache, control and stream.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        granularity: str | Granularity = Granularity.OPERATOR,
        chunk_size: int | None = None,
        device: str | torch.device | None = None,
        sync: str | DeviceSync = DeviceSync.EVERY_CHECK,
        run_ahead: int = 1,
        streams: DeviceStreams | None = None,
        kernels: str | Kernels | None = None,
        kv_gather: KVGather | None = None,
        max_blocking_ms: float | None = None,
        split_rates: SplitRates | None = None,
    ) -> None:
        """Check the options, move ``model`` to ``device`` (default: where it is) and patch
        it; :meth:`close` undoes the patches.

        ``granularity``: where checkpoints go (:mod:`flowprefill.prefill.executor.checkpoints`).
        ``chunk_size``: tokens per forward pass (None: the whole batch in one); the boundary
        between two chunks is a checkpoint.

        ``sync`` (``every_check`` | ``run_ahead`` | ``on_preempt``) only matters on CUDA;
        ``run_ahead``: how many operators the host may queue ahead of the device in the
        ``run_ahead`` mode. See :mod:`flowprefill.prefill.executor.device` for the
        trade-off. ``streams`` overrides the streams chosen from ``device`` (tests use a
        fake one).

        ``kernels``: ``"fast"`` (the default, also for None) runs the decoder's float32 CPU
        linears through oneDNN on prepacked weights (see
        :mod:`flowprefill.prefill.executor.kernels`);
        ``"reference"`` runs the model's own modules, so a single prompt's KV cache is
        bit-identical to calling the model directly. The executor reads no environment:
        :meth:`~flowprefill.contracts.EngineConfig.resolved_kernels` applies
        ``$FLOWPREFILL_KERNELS``.
        Either way a resumed prefill is bit-identical to an uninterrupted one.

        ``kv_gather`` (tensor parallelism) maps the batch's per-layer ``(key, value)``,
        each ``[1, kv_heads_here, tokens, head_dim]``, to the ones the outputs carry: rank 0
        gathers every rank's heads (:func:`flowprefill.prefill.tp.ranks.gather_kv_heads`).

        ``max_blocking_ms`` (operator granularity only; None: never split): operators
        predicted to run longer between two checkpoints are split at run time
        (:mod:`flowprefill.prefill.executor.splitting`); the prediction's rates are
        ``split_rates``, measured here when None (:meth:`set_split_rates` replaces them,
        e.g. with rank 0's under tensor parallelism).

        The patches, in order (each undone by :meth:`close`, in reverse; a construction
        that fails undoes those already applied):

        1. attention runs per request segment (:mod:`~flowprefill.prefill.executor.attention`);
        2. checkpoint hooks at ``granularity``;
        3. with fast kernels, the decoder's linears on prepacked weights;
        4. with splitting, the decoder's linears and expert blocks split into tiles, and a
           checkpoint at the entry of every decoder layer; then the rates are measured
           (unless given) and one forward is traced for :meth:`expected_checkpoints`.
        """
        # Every option is checked before the model is touched.
        self.granularity = check_granularity(granularity)
        self.kernels = resolve_kernels(kernels)
        self.sync_mode = check_sync_mode(sync)
        self.run_ahead = check_run_ahead(run_ahead)
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive number of tokens, got {chunk_size}")
        self.chunk_size = chunk_size
        max_blocking_s = _split_bound(max_blocking_ms, self.granularity)

        self.device = torch.device(device) if device is not None else model.device
        # nn.Module.to directly: transformers' typing of PreTrainedModel.to confuses mypy.
        torch.nn.Module.to(model, self.device)
        self.model = model.eval()
        self.streams = streams if streams is not None else streams_for(self.device)
        self.streams.prepare()
        self._on_boundary = boundary_fn(self.streams, self.sync_mode)
        self._kv_gather = kv_gather
        config = model.config
        self.vocab_size = int(config.vocab_size)
        self.max_prompt_tokens = int(config.max_position_embeddings)
        self.num_layers = int(config.num_hidden_layers)

        self._linears = FastLinearHandle()
        self._split = SplitHandle()
        self._split_policy: SplitPolicy | None = None
        self._num_entry_checkpoints = 0
        self._trace: list[Event] = []
        # What the hooks call: a checkpoint that also starts a new stretch for operator
        # splitting (a no-op without it).
        boundary = hooked(self._on_boundary)
        with ExitStack() as undo:
            undo.callback(patches.packed_attention(model))
            self._checkpoints = install_checkpoints(model, self.granularity, boundary)
            undo.callback(self._checkpoints.remove)
            # After the checkpoints: installing those refuses a model another executor holds.
            if self.kernels is Kernels.FAST:
                self._linears = patches.fast_linears(model)
                undo.callback(self._linears.remove)
            if max_blocking_s is not None:
                # Wraps the fast linears' forward, so it is undone before them.
                self._split = patches.split_operators(model)
                undo.callback(self._split.remove)
                rates = split_rates if split_rates is not None else self._calibrate(max_blocking_s)
                layers = find_decoder_layers(model)[1]
                undo.callback(patches.layer_entry_checkpoints(layers, boundary))
                self._num_entry_checkpoints = len(layers)
                self._trace = self._trace_forward()
                self._split_policy = SplitPolicy(max_blocking_s, rates)
            self._undo = undo.pop_all()
        # After every patch: prepacked weights are module attributes, not a task's.
        self._weights = weight_storages(model)
        self.footprint = ParkedFootprint.of_model(config, next(model.parameters()).dtype)
        """Bounds what a parked task holds (the scheduler's parked-memory budget)."""

    def _calibrate(self, max_blocking_s: float) -> SplitRates:
        """Measure the split operators' rates on this device (0.1-0.3 s on CPU)."""
        heads, head_dim = _attention_shape(self.model)
        return calibrate(
            self._split,
            heads,
            head_dim,
            self.device,
            next(self.model.parameters()).dtype,
            lambda: self.streams.synchronize(None),
            max_blocking_s=max_blocking_s,
        )

    def _trace_forward(self) -> list[Event]:
        """The order of operators and hook checkpoints in one forward (nothing split), which
        :meth:`expected_checkpoints` replays for any prompt lengths."""
        recorder = TraceRecorder()
        self._prefill(self.validate([[0] * 4]), trace=recorder)
        return recorder.events

    # ------------------------------------------------------------------ facts

    @property
    def num_checkpoints_per_forward(self) -> int:
        return self._checkpoints.num_checkpoints_per_forward

    @property
    def placed_checkpoints(self) -> list[str]:
        """Labels of the installed checkpoints in firing order (one forward)."""
        return describe(self._checkpoints.placed)

    @property
    def split_policy(self) -> SplitPolicy | None:
        """The bound and rates operators are split by; None when nothing is split."""
        return self._split_policy

    def set_split_rates(self, rates: SplitRates) -> None:
        """Predict with ``rates`` from now on (tensor parallelism: rank 0's, on every rank,
        so all ranks split alike). Call before any task runs."""
        if self._split_policy is None:
            raise RuntimeError("this executor does not split operators (max_blocking_ms unset)")
        self._split_policy = SplitPolicy(self._split_policy.max_blocking_s, rates)

    def estimate_parked_bytes(self, num_tokens: int, num_requests: int = 1) -> int:
        """Most bytes a task of ``num_tokens`` prompt tokens holds while parked."""
        return self.footprint.bytes_for(num_tokens, num_requests)

    def expected_checkpoints(self, prompt_lengths: Sequence[int]) -> int:
        """Checkpoints one prefill of these prompts passes: hooks per chunk, those split
        operators add, and one between consecutive chunks."""
        spans = chunk_spans(sum(prompt_lengths), self.chunk_size)
        total = len(spans) * self.num_checkpoints_per_forward + (len(spans) - 1)
        if self._split_policy is not None:
            total += len(spans) * self._num_entry_checkpoints
            starts = [sum(prompt_lengths[:i]) for i in range(len(prompt_lengths))]
            for start, end in spans:
                segments = chunk_segments(starts, prompt_lengths, start, end)
                total += count_checkpoints(self._split_policy, self._trace, end - start, segments)
        return total

    # ------------------------------------------------------------- validation

    def validate(self, prompts: Sequence[PromptLike]) -> list[torch.Tensor]:
        """Check every prompt; return them as 1-D int64 CPU tensors.

        Raises InvalidRequestError for an empty batch, an empty prompt, a non-integer or
        non-1-D prompt, a token id outside ``[0, vocab_size)`` or a prompt longer than the
        model's ``max_position_embeddings``. Runs before any device work, so a bad request
        never reaches the forward pass (and never leaves a task hanging).
        """
        if len(prompts) == 0:
            raise InvalidRequestError("empty batch: no prompts to prefill")
        tensors: list[torch.Tensor] = []
        for index, prompt in enumerate(prompts):
            try:
                tokens = torch.as_tensor(prompt).to("cpu")
            except (TypeError, ValueError, RuntimeError) as err:
                raise InvalidRequestError(
                    f"prompt {index} is not a list of token ids: {err}"
                ) from err
            if tokens.numel() == 0:
                raise InvalidRequestError(f"prompt {index} is empty")
            if tokens.ndim != 1 or tokens.dtype.is_floating_point or tokens.dtype.is_complex:
                raise InvalidRequestError(
                    f"prompt {index} must be a flat sequence of integer token ids "
                    f"(got shape {tuple(tokens.shape)}, dtype {tokens.dtype})"
                )
            if tokens.numel() > self.max_prompt_tokens:
                raise InvalidRequestError(
                    f"prompt {index} has {tokens.numel()} tokens; the model supports at most "
                    f"{self.max_prompt_tokens}"
                )
            low, high = int(tokens.min()), int(tokens.max())
            if low < 0 or high >= self.vocab_size:
                bad = low if low < 0 else high
                raise InvalidRequestError(
                    f"prompt {index} has token id {bad} outside the vocabulary "
                    f"[0, {self.vocab_size})"
                )
            tensors.append(tokens.to(torch.long))
        return tensors

    # -------------------------------------------------------------- execution

    def run(
        self, prompts: Sequence[PromptLike], control: TaskControl | None = None
    ) -> list[PrefillOutput]:
        """Run one task on the calling thread: activate ``control``, open the task's stream,
        prefill, and wait for the device before returning.

        ``control.device_sync`` is set to drain this task's stream, so a preempted task
        leaves no queued kernels behind when it ACKs. Raises TaskCancelledError if the
        control is cancelled at a checkpoint.
        """
        tokens = self.validate(prompts)
        stream = self.streams.new_stream()
        check_sync = None
        if control is not None and self.streams.asynchronous:

            def drain() -> None:
                self.streams.synchronize(stream)

            control.device_sync = drain
            check_sync = per_check_sync(self.streams, stream, self.sync_mode, self.run_ahead)
        if control is not None:
            control.held_bytes = measure_current_thread(self._weights)
        with thread_context.task(control, check_sync), self.streams.stream_context(stream):
            outputs = self._prefill(tokens)
        # Results leave the task only once the device has produced them.
        self.streams.synchronize(stream)
        return outputs

    def prefill(self, prompts: Sequence[PromptLike]) -> list[PrefillOutput]:
        """Prefill on the calling thread's current stream and active control (if any)."""
        return self._prefill(self.validate(prompts))

    def _prefill(
        self, tokens: list[torch.Tensor], trace: TraceRecorder | None = None
    ) -> list[PrefillOutput]:
        """``trace``: record the forward instead of splitting its operators."""
        lengths = [int(t.numel()) for t in tokens]
        control = thread_context.control
        if control is not None:
            control.num_checkpoints_expected = control.num_checkpoints + self.expected_checkpoints(
                lengths
            )
        with torch.inference_mode():
            batch = pack(tokens, self.device)
            cache = DynamicCache(config=self.model.config)
            logits = self._forward_chunks(batch, cache, trace)
            return self._collect(batch, cache, logits)

    def _forward_chunks(
        self, batch: PackedBatch, cache: DynamicCache, trace: TraceRecorder | None
    ) -> list[torch.Tensor]:
        """Run the forward pass(es); return each request's last-position logits."""
        fast = self.kernels is Kernels.FAST
        last_indices = batch.last_indices
        logits: list[torch.Tensor | None] = [None] * batch.num_requests
        for chunk_index, (start, end) in enumerate(chunk_spans(batch.num_tokens, self.chunk_size)):
            if chunk_index > 0:
                self._on_boundary()  # chunk boundaries are checkpoints at every granularity
            # Requests whose last token falls in this chunk: only those rows reach lm_head.
            finishing = [r for r, i in enumerate(last_indices) if start <= i < end]
            keep = torch.tensor(
                [last_indices[r] - start for r in finishing], dtype=torch.long, device=self.device
            )
            segments = chunk_segments(batch.starts, batch.lengths, start, end)
            packer = trace if trace is not None else self._packer()
            with thread_context.forward(segments, packer, fast):
                out = self.model(
                    input_ids=batch.input_ids[:, start:end],
                    position_ids=batch.position_ids[:, start:end],
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=keep,
                )
            for row, request in enumerate(finishing):
                logits[request] = out.logits[0, row].float()
        assert all(item is not None for item in logits)
        return [item for item in logits if item is not None]

    def _packer(self) -> Packer | None:
        """A fresh packer for one forward pass; None when nothing is split."""
        if self._split_policy is None:
            return None
        return Packer(self._split_policy, self._on_boundary)

    def _collect(
        self, batch: PackedBatch, cache: DynamicCache, logits: list[torch.Tensor]
    ) -> list[PrefillOutput]:
        layer_kv = [_full_kv(layer, batch.num_tokens) for layer in cache.layers]
        if self._kv_gather is not None:
            layer_kv = self._kv_gather(layer_kv)
        # One device→host transfer for all first tokens (each .item() would be a sync).
        first_tokens = torch.stack(logits).argmax(dim=-1).tolist()
        outputs = []
        for request, (start, length) in enumerate(zip(batch.starts, batch.lengths, strict=True)):
            end = start + length
            kv = [(k[0, :, start:end, :], v[0, :, start:end, :]) for k, v in layer_kv]
            outputs.append(
                PrefillOutput(
                    first_token_id=int(first_tokens[request]),
                    logits=logits[request],
                    kv_cache=kv,
                    num_prompt_tokens=length,
                )
            )
        return outputs

    def close(self) -> None:
        """Undo the construction's patches, last first: the model is as it was given
        (on this executor's device, in eval mode). Closing again does nothing."""
        self._undo.close()

    def __enter__(self) -> PreemptibleExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _split_bound(max_blocking_ms: float | None, granularity: Granularity) -> float | None:
    """The splitting bound in seconds; None when nothing is split (unset, or a coarser
    granularity than operator, which keeps its own contract)."""
    if max_blocking_ms is None or granularity is not Granularity.OPERATOR:
        return None
    if not max_blocking_ms > 0:
        raise ValueError(f"max_blocking_ms must be positive, got {max_blocking_ms}")
    return max_blocking_ms / 1000.0


def _attention_shape(model: PreTrainedModel) -> tuple[int, int]:
    """Query heads *on this rank* and head dim: a tensor-parallel shard keeps the full
    model's config, so heads come from the first layer's ``q_proj`` weight when there is
    one."""
    config = model.config
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    layer = find_decoder_layers(model)[1][0]
    q_proj = getattr(getattr(layer, "self_attn", None), "q_proj", None)
    if isinstance(q_proj, torch.nn.Linear):
        heads = int(q_proj.weight.shape[0]) // head_dim
    return heads, head_dim


def _full_kv(layer: object, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of one cache layer, checked to hold every prompt token.

    A sliding-window or linear-attention layer would hold fewer (or no) positions; the KV
    hand-off needs all of them, so such models are rejected here rather than handing off
    a truncated cache.
    """
    keys = getattr(layer, "keys", None)
    values = getattr(layer, "values", None)
    if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
        raise ValueError(f"cache layer {type(layer).__name__} holds no key/value tensors")
    if keys.shape[-2] != num_tokens:
        raise ValueError(
            f"cache layer {type(layer).__name__} holds {keys.shape[-2]} of {num_tokens} "
            "positions (sliding window?); the executor needs full-attention layers"
        )
    return keys, values
