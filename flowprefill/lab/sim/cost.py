"""Cost models: how long one forward pass (one chunk of a task) takes, operator by operator.

A pass runs ``pre_s`` (per-pass overhead + embedding), then ``num_layers`` identical layers,
each a sequence of segments between checkpoints (``op_s``: qkv_proj, attention, o_proj,
gate_up, down_proj). :mod:`flowprefill.lab.sim.plan` places preemption points on that timeline.

Two models:

* :class:`GPUCostModel` — the vidur A100 profile of Llama-3-8B (:mod:`.vidur`) for the
  GEMM-type operators, interpolated in the token count; attention from FLOPs
  (``4·h·d·(c·p + c²/2)`` per layer for ``c`` new tokens after ``p`` cached ones) at
  ``attn_efficiency`` of the GPU's peak, plus the **KV re-read** of a chunk: ``p`` cached
  tokens' K and V come back from HBM once per layer, which (with the per-pass overhead)
  makes small chunks slow (paper §3.1). Other models scale each operator by its weight (or
  width) ratio to Llama-3-8B at the same TP degree; other GPUs by the ratio of peak FLOP/s
  (and of HBM bandwidth for the re-read); TP>1 adds a ring all-reduce after o_proj and
  down_proj (the row-parallel layers' own all-reduces, on the critical path), and
  ``checkpoint_s`` per preemption checkpoint: what each rank's check of the shared
  agreement table costs (the paper's synchronised counter, §5.1, done without a
  collective: flowprefill/prefill/tp/agreement.py). :mod:`.plan` charges it per checkpoint of
  the granularity in use (5 per layer at operator level, 1 at layer level, none between
  chunks).
* :class:`~flowprefill.lab.sim.profile.ProfileCostModel` — the engine's own ``flowprefill
  profile`` fit (:class:`~flowprefill.prefill.predictor.model.TTFTPredictor`), for simulating
  this CPU engine (:mod:`.profile`).

Both also price run-time operator splitting (:meth:`CostModel.split_pass_cost`, the
engine's ``max_blocking_ms``; :mod:`.split`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Protocol

import numpy as np

from flowprefill.errors import InvalidRequestError, UnknownNameError
from flowprefill.lab.sim.hardware import (
    GPUS,
    MODELS,
    REFERENCE_GPU,
    REFERENCE_MODEL,
    GPUSpec,
    ModelShape,
    get_gpu,
    get_model,
)
from flowprefill.lab.sim.split import (
    GPU_PIECE_OVERHEAD_S,
    TilePlan,
    attention_pieces,
    gemm_pieces,
)
from flowprefill.lab.sim.vidur import VIDUR_OPS, load_tables

SEGMENTS = ("qkv_proj", "attention", "o_proj", "gate_up", "down_proj")

# --- constants (see docs/simulator.md, "Cost model") --------------------------------------
ATTN_EFFICIENCY = 0.6
"""Fraction of peak BF16 FLOP/s a prefill attention kernel reaches. FlashAttention-2 (Dao,
2023, §4) reports 50–73 % of A100 peak for the forward pass at head dim 128."""
PASS_OVERHEAD_S = 0.002
"""Per forward pass (per chunk): scheduling step, input preparation, sampling, launch gaps
not in the operator profile. An assumption of the order vLLM shows; ``--pass-overhead-ms``."""
ALLREDUCE_LATENCY_S = 10e-6
"""Fixed latency of one NCCL all-reduce on NVLink (order of the NCCL-tests small-message
latency); only used when TP > 1."""
TP_CHECK_S = 2e-6
"""With TP > 1, what one preemption checkpoint adds to a task: each rank records its count
and reads the target in a shared-memory table under one lock (flowprefill/prefill/tp/agreement.py;
no collective). Measured 1.6 µs per checkpoint per rank on this CPU
(``benchmarks/prefill/tp_overhead.py``, against 246 µs for a gloo all-reduce of a flag); a host-side
lock costs the same order next to a GPU, not measured there. ``--tp-check-us`` (0 = the
paper's "negligible"; ~10-50 for an all-reduce of a flag at every checkpoint)."""


@dataclass(frozen=True, slots=True)
class PassCost:
    """Timeline of one forward pass: ``pre_s``, then ``num_layers`` × ``op_s``.

    ``op_s`` are the stretches between consecutive operator-level checkpoints of a layer:
    one per segment, or — split (:meth:`CostModel.split_pass_cost`) — the pieces of every
    segment in order, ``pieces[i]`` of them for segment ``i``."""

    pre_s: float
    op_s: tuple[float, ...]
    num_layers: int
    pieces: tuple[int, ...] = ()
    """Pieces per segment when split; empty: one stretch per segment."""

    @property
    def num_added_checkpoints(self) -> int:
        """Checkpoints splitting added to this pass (all layers)."""
        return self.num_layers * (len(self.op_s) - len(self.pieces)) if self.pieces else 0

    @property
    def layer_s(self) -> float:
        return sum(self.op_s)

    @property
    def total_s(self) -> float:
        return self.pre_s + self.num_layers * self.layer_s


Segment = tuple[int, int]
"""``(num_new_tokens, num_prefix_tokens)`` of one request in one pass."""


class CostModel(Protocol):
    name: str
    max_context_tokens: int
    checkpoint_s: float
    """Time each preemption checkpoint adds to a task (TP ranks agreeing); 0 on one device."""

    def pass_cost(self, segments: Sequence[Segment]) -> PassCost:
        """Cost of one pass over these request segments (batched, one chunk each)."""
        ...

    def split_pass_cost(self, segments: Sequence[Segment], max_blocking_s: float) -> PassCost:
        """The same pass with every segment predicted longer than ``max_blocking_s`` run
        in pieces (:mod:`.split`); segments within the bound as in :meth:`pass_cost`."""
        ...

    def ideal_cost_s(self, num_tokens: int) -> float:
        """Lower bound on the device time one request of this length can cost (ideal
        batching, no overheads): used for the work-conserving bound."""
        ...


def _op_scale(model: ModelShape, ref: ModelShape) -> dict[str, float]:
    """Per vidur operator: how much bigger this model's operator is than Llama-3-8B's."""
    hidden = model.hidden_size / ref.hidden_size
    return {
        "emb": hidden,
        "input_layernorm": hidden,
        "post_attention_layernorm": hidden,
        "add": hidden,
        "attn_pre_proj": model.qkv_weights / ref.qkv_weights,
        "attn_rope": (model.num_heads + model.num_kv_heads) / (ref.num_heads + ref.num_kv_heads),
        "attn_post_proj": model.o_weights / ref.o_weights,
        "mlp_up_proj": model.gate_up_weights / ref.gate_up_weights,
        "mlp_act": model.intermediate_size / ref.intermediate_size,
        "mlp_down_proj": model.down_weights / ref.down_weights,
    }


def _check_calibration_shape(shape: dict[str, int], source: str) -> None:
    """A calibration must be of the reference model (every model is scaled from it)."""
    ref = MODELS[REFERENCE_MODEL]
    for name, value in shape.items():
        if getattr(ref, name) != value:
            raise InvalidRequestError(
                f"--calibration {source}: measured with {name} = {value}, but the simulator "
                f"scales every model from {REFERENCE_MODEL}'s ({name} = {getattr(ref, name)}); "
                "calibrate with a model of that shape"
            )


class GPUCostModel:
    """Operator times of ``model`` at TP ``tp`` on ``gpu`` (see the module docstring)."""

    def __init__(
        self,
        model: ModelShape,
        gpu: GPUSpec,
        *,
        tp: int | None = None,
        attn_efficiency: float = ATTN_EFFICIENCY,
        pass_overhead_s: float = PASS_OVERHEAD_S,
        tp_check_s: float = TP_CHECK_S,
        split_overhead_s: float = GPU_PIECE_OVERHEAD_S,
        calibration: str | None = None,
        tile_plan: TilePlan = "profiled",
    ) -> None:
        tables = load_tables(calibration)
        tp = model.default_tp if tp is None else tp
        if tp not in tables:
            raise UnknownNameError("tensor-parallel degree", str(tp), [str(t) for t in tables])
        if not 0 < attn_efficiency <= 1:
            raise InvalidRequestError(f"--attn-efficiency must be in (0, 1], got {attn_efficiency}")
        if pass_overhead_s < 0:
            raise InvalidRequestError(f"--pass-overhead-ms must be ≥ 0, got {pass_overhead_s}")
        if tp_check_s < 0:
            raise InvalidRequestError(f"--tp-check-us must be ≥ 0, got {tp_check_s * 1e6:g}")
        if split_overhead_s < 0:
            raise InvalidRequestError(
                f"--split-overhead-us must be ≥ 0, got {split_overhead_s * 1e6:g}"
            )
        self.model, self.gpu, self.tp = model, gpu, tp
        self.split_overhead_s = split_overhead_s
        self.tile_plan: TilePlan = tile_plan
        self.checkpoint_s = tp_check_s if tp > 1 else 0.0
        self.name = f"{model.name}/{gpu.name}/tp{tp}"
        self.max_context_tokens = model.max_context_tokens
        self.attn_efficiency = attn_efficiency
        self.pass_overhead_s = pass_overhead_s
        ref, table = MODELS[REFERENCE_MODEL], tables[tp]
        if calibration is None:
            self.compute_speedup = gpu.peak_bf16_flops / GPUS[REFERENCE_GPU].peak_bf16_flops
        else:  # measured on this GPU: no scaling by peak FLOP/s
            _check_calibration_shape(table.shape, calibration)
            self.compute_speedup = 1.0
            self.name += f"/calibrated:{Path(calibration).name}"
        self._measured_attention = table if table.attention_ms is not None else None
        # Measured attention is per GPU with the reference model's heads at this TP.
        self._attention_scale = (max(1, model.num_heads // tp) * model.head_dim) / (
            max(1, ref.num_heads // tp) * ref.head_dim
        )
        scale = _op_scale(model, ref)
        ms = {op: table.times_ms[op] * scale[op] for op in VIDUR_OPS}
        add = ms["add"]
        # Segment arrays in seconds on the reference GPU, by table.num_tokens.
        self._xs = table.num_tokens
        self._ys = np.stack(
            [
                ms["emb"],
                ms["input_layernorm"] + ms["attn_pre_proj"] + ms["attn_rope"],
                ms["attn_post_proj"] + add,
                ms["post_attention_layernorm"] + ms["mlp_up_proj"],
                ms["mlp_act"] + ms["mlp_down_proj"] + add,
            ]
        ) * (1e-3 / self.compute_speedup)
        self._attn_flop_s = 1.0 / (gpu.peak_bf16_flops * attn_efficiency)
        self._heads = max(1, model.num_heads // tp)
        self._kv_bytes = model.kv_bytes_per_token_per_layer(tp)
        self._compute = lru_cache(maxsize=1 << 16)(self._compute_uncached)

    def _compute_uncached(self, num_tokens: int) -> tuple[float, float, float, float, float]:
        """(emb, qkv, o_proj, gate_up, down_proj) compute seconds at ``num_tokens`` rows."""
        xs, ys = self._xs, self._ys
        if num_tokens > xs[-1]:
            vals = ys[:, -1] * (num_tokens / xs[-1])
        else:
            vals = np.array([np.interp(num_tokens, xs, row) for row in ys])
        emb, qkv, o, up, down = (float(v) for v in vals)
        return emb, qkv, o, up, down

    def _gemm(self, num_tokens: int) -> tuple[float, float, float, float, float]:
        """(emb, qkv, o_proj, gate_up, down_proj) seconds for a pass of ``num_tokens``,
        the all-reduces after o_proj and down_proj included."""
        emb, qkv, o, up, down = self._compute(num_tokens)
        comm = self.allreduce_s(num_tokens)
        return emb, qkv, o + comm, up, down + comm

    def allreduce_s(self, num_tokens: int) -> float:
        """Ring all-reduce of the ``num_tokens × hidden`` bf16 activations (TP > 1 only)."""
        if self.tp == 1:
            return 0.0
        return ALLREDUCE_LATENCY_S + num_tokens * self._allreduce_per_token_s

    @functools.cached_property
    def _allreduce_per_token_s(self) -> float:
        """Bandwidth term of one all-reduce per token: each rank sends and receives
        ``2(TP−1)/TP`` of the token's ``hidden`` bf16 activations (ring algorithm)."""
        if self.tp == 1:
            return 0.0
        ring = 2 * (self.tp - 1) / self.tp
        return ring * self.model.hidden_size * 2 / self.gpu.nvlink_bytes_per_s

    def attention_s(self, segments: Sequence[Segment]) -> float:
        """One layer's attention over all segments: FLOPs (or the calibration's measured
        attention) + KV re-read of prefixes."""
        if self._measured_attention is not None:
            return sum(sum(self._segment_attention_s(c, p)) for c, p in segments)
        pairs = 0.0
        prefix_tokens = 0
        for c, p in segments:
            pairs += c * p + c * c / 2
            prefix_tokens += p
        flops = 4.0 * self._heads * self.model.head_dim * pairs
        reread_s = prefix_tokens * self._kv_bytes / self.gpu.hbm_bytes_per_s
        return flops * self._attn_flop_s + reread_s

    def _segment_attention_s(self, new: int, prefix: int) -> tuple[float, float]:
        """(compute, KV re-read) seconds of one request's attention in one layer. Measured
        attention (a calibration) is of a prefill with no cache: a segment costs what it
        costs at the token count with as many causal query-key pairs, ``sqrt(2cp + c²)``."""
        pairs = new * prefix + new * new / 2
        if self._measured_attention is None:
            compute = 4.0 * self._heads * self.model.head_dim * pairs * self._attn_flop_s
        else:
            ms = self._measured_attention.attention_time_ms(math.sqrt(2 * pairs))
            compute = 1e-3 * ms * self._attention_scale
        return compute, self._reread_s(prefix)

    def _reread_s(self, prefix_tokens: int) -> float:
        return prefix_tokens * self._kv_bytes / self.gpu.hbm_bytes_per_s

    def pass_cost(self, segments: Sequence[Segment]) -> PassCost:
        num_tokens = sum(c for c, _ in segments)
        emb, qkv, o, up, down = self._gemm(num_tokens)
        attn = self.attention_s(segments)
        return PassCost(self.pass_overhead_s + emb, (qkv, attn, o, up, down), self.model.num_layers)

    def split_pass_cost(self, segments: Sequence[Segment], max_blocking_s: float) -> PassCost:
        """GEMM tiles at the profile's time for the tile's token count; attention blocks
        at their FLOPs; ``split_overhead_s`` per added piece (:mod:`.split`)."""
        whole = self.pass_cost(segments)
        b, extra = max_blocking_s, self.split_overhead_s
        if max(whole.op_s) <= b:
            return whole
        n = sum(c for c, _ in segments)
        comm = self.allreduce_s(n)

        def segment(i: int) -> tuple[float, ...]:
            if whole.op_s[i] <= b:
                return (whole.op_s[i],)
            if i == 1:
                return attention_pieces(segments, self._segment_attention_s, b, extra)
            tail = comm if i in (2, 4) else 0.0
            column = i if i else 1  # _compute's columns: emb, qkv, o_proj, gate_up, down_proj
            return gemm_pieces(
                lambda m: self._compute(m)[column],
                n,
                b,
                extra,
                tail_s=tail,
                tile_plan=self.tile_plan,
                per_row_s=self._large_gemm_per_row_s[column],
            )

        split = [segment(i) for i in range(len(whole.op_s))]
        return PassCost(
            whole.pre_s,
            tuple(t for pieces in split for t in pieces),
            whole.num_layers,
            tuple(len(pieces) for pieces in split),
        )

    @functools.cached_property
    def _large_gemm_per_row_s(self) -> tuple[float, ...]:
        """Each segment's time per row at the profile's largest token count: the rate
        the engine's calibration would measure on a large GEMM (sizes the tile grid)."""
        n = int(self._xs[-1])
        return tuple(t / n for t in self._compute(n))

    def ideal_cost_s(self, num_tokens: int) -> float:
        """Cheapest GEMM time per token, the all-reduces' bandwidth (two per layer: no
        schedule avoids moving the activations) and the request's own attention."""
        attn = self.attention_s([(num_tokens, 0)]) * self.model.num_layers
        comm = 2 * self.model.num_layers * self._allreduce_per_token_s
        return (self._min_gemm_per_token_s + comm) * num_tokens + attn

    @functools.cached_property
    def _min_gemm_per_token_s(self) -> float:
        """Cheapest GEMM time per token over the profile (the best batch size), no
        per-pass overhead: what a token costs in an ideally batched pass."""
        per_pass = self._ys[0] + self.model.num_layers * self._ys[1:].sum(axis=0)
        return float((per_pass / self._xs).min())


def build_cost_model(
    model: str,
    gpu: str,
    *,
    tp: int | None = None,
    attn_efficiency: float = ATTN_EFFICIENCY,
    pass_overhead_s: float = PASS_OVERHEAD_S,
    tp_check_s: float = TP_CHECK_S,
    split_overhead_s: float = GPU_PIECE_OVERHEAD_S,
    calibration: str | None = None,
    tile_plan: TilePlan = "profiled",
) -> GPUCostModel:
    """By name; unknown model or GPU names raise UnknownNameError listing the known ones.
    ``calibration``: a CSV of operator times measured on ``gpu`` (:mod:`.vidur`)."""
    return GPUCostModel(
        get_model(model),
        get_gpu(gpu),
        tp=tp,
        attn_efficiency=attn_efficiency,
        pass_overhead_s=pass_overhead_s,
        tp_check_s=tp_check_s,
        split_overhead_s=split_overhead_s,
        calibration=calibration,
        tile_plan=tile_plan,
    )
