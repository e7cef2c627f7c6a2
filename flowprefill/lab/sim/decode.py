"""Decode in the simulator: the cost of a decode step, output lengths, TBT per request.

**Step cost.** One iteration is one forward pass over its rows: the prefill segments it
carries (vLLM's mixed batches; none for a pure decode step) and one row per decoding
request, ``(1 new token, context)``. Its time is a roofline of two figures:

* the prefill cost model's own pass (:meth:`GPUCostModel.pass_cost`): per-pass overhead
  (2 ms, ``PASS_OVERHEAD_S``), the GEMM-type operators at the pass's row count from the
  vidur profile — *measured* on an A100 at 1…32K rows, so a batch of ``b`` decodes pays
  what ``b``-row GEMMs measured — and each row's attention (FLOPs + its context's KV read
  from HBM), plus the LM head read once per iteration that emits decode tokens;
* a memory floor: overhead + (every weight, LM head included, + every decoding row's KV)
  over :data:`~flowprefill.lab.sim.handoff.DECODE_HBM_EFFICIENCY` (0.8) of the GPU's
  datasheet HBM bandwidth — what no decode step can beat, and what binds on GPUs whose
  GEMM times are scaled by peak FLOP/s (H100: 3.35 TB/s, NVIDIA H100 SXM datasheet).

Sources: Llama-3-8B config.json (32 layers, 8 KV heads, head dim 128 → 128 KiB of bf16 KV
per token; 7.50 G parameters read per step with the untied 128,256-row LM head:
:attr:`ModelShape.decode_weight_params`); A100-SXM4-80GB datasheet (2,039 GB/s HBM2e);
microsoft/vidur's A100 profile (``data/vidur``). Check (docs/simulator.md, "Colocated"):
at one row vidur measured the 32 layers' linear operators at 9.76 ms, against 8.56 ms for
their 13.96 GB at 0.8 × 2,039 GB/s — the profile's figure binds (70 % of datasheet), and a
batch of 1 with 1K of context costs 12.5 ms (80 tokens/s).

**Output lengths.** The QwenTrace-like workload has none (Table 1 gives prompts only), so
:func:`output_lengths` draws them: log-normal, median 128 tokens, σ = 0.8 (mean ≈ 174),
clipped to [2, 1024], from their own seed — an assumption, not fitted to any trace.

**TBT.** A request's time between tokens is each gap between consecutive output tokens
(first token → second …). A request meets its TBT target when its *mean* gap — DistServe's
TPOT, ``(last − first token) / (n − 1)`` — is within it; :class:`DecodeRecord` also keeps
the largest gap and the count of gaps within the target.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from flowprefill.errors import InvalidRequestError
from flowprefill.lab.sim.cost import GPUCostModel, Segment
from flowprefill.lab.sim.handoff import DECODE_HBM_EFFICIENCY

OUTPUT_MEDIAN_TOKENS = 128
OUTPUT_SIGMA = 0.8
OUTPUT_MIN_TOKENS, OUTPUT_MAX_TOKENS = 2, 1024
_OUTPUT_SEED_SALT = 0xDEC0DE


class DecodeCostModel:
    """Iteration times on ``cost``'s device (module docstring). Pure: same rows, same time."""

    def __init__(self, cost: GPUCostModel, *, hbm_efficiency: float = DECODE_HBM_EFFICIENCY):
        if not 0 < hbm_efficiency <= 1:
            raise InvalidRequestError(f"HBM efficiency must be in (0, 1], got {hbm_efficiency}")
        model, gpu, tp = cost.model, cost.gpu, cost.tp
        self.cost = cost
        self.name = f"{cost.name}/decode"
        hbm = gpu.hbm_bytes_per_s * hbm_efficiency
        self.weights_s = model.decode_weight_params * 2 / tp / hbm
        """Every weight read once (per GPU: 1/TP of them), LM head included."""
        self.lm_head_s = model.vocab_size * model.hidden_size * 2 / tp / hbm
        self.kv_per_token_s = model.num_layers * model.kv_bytes_per_token_per_layer(tp) / hbm
        """One token of context: its K and V in every layer read once."""

    def memory_floor_s(self, contexts: Sequence[int]) -> float:
        """Overhead + weights + the rows' KV at the effective HBM bandwidth."""
        return self.cost.pass_overhead_s + self.weights_s + sum(contexts) * self.kv_per_token_s

    def iteration_s(self, prefill: Sequence[Segment], contexts: Sequence[int]) -> float:
        """One pass: ``prefill`` segments ``(new, cached)`` and one decode row per entry
        of ``contexts`` (its tokens of KV). 0 for an empty iteration."""
        if any(c < 0 for c in contexts):
            raise ValueError(f"a decode context cannot be negative: {list(contexts)}")
        rows = [*prefill, *((1, c) for c in contexts)]
        if not rows:
            return 0.0
        pass_s = self.cost.pass_cost(rows).total_s
        if not contexts:
            return pass_s
        return max(pass_s + self.lm_head_s, self.memory_floor_s(contexts))

    def step_s(self, contexts: Sequence[int]) -> float:
        """A pure decode step: one token for each request of the batch."""
        return self.iteration_s((), contexts)


def output_lengths(num_requests: int, seed: int) -> list[int]:
    """Output tokens per request (first token included), module docstring's distribution;
    the same for every rate and system of a seeded run."""
    rng = np.random.default_rng([seed, _OUTPUT_SEED_SALT])
    draws = rng.lognormal(np.log(OUTPUT_MEDIAN_TOKENS), OUTPUT_SIGMA, num_requests)
    clipped = np.clip(np.rint(draws), OUTPUT_MIN_TOKENS, OUTPUT_MAX_TOKENS)
    return [int(x) for x in clipped]


@dataclass(slots=True)
class DecodeRecord:
    """One request's output tokens as they come: first token, then one per step."""

    prompt_tokens: int
    num_output: int
    tbt_target_s: float
    first_token_s: float | None = None
    last_token_s: float | None = None
    num_emitted: int = 0
    gaps_within: int = 0
    max_gap_s: float = 0.0
    gaps_s: list[float] = field(default_factory=list)
    """Every gap, only when the record was made with ``keep_gaps`` (tests, small runs)."""
    keep_gaps: bool = False

    @property
    def context(self) -> int:
        """KV tokens the next decode step reads: the prompt and the tokens so far."""
        return self.prompt_tokens + self.num_emitted

    @property
    def remaining(self) -> int:
        return self.num_output - self.num_emitted

    @property
    def done(self) -> bool:
        return self.num_emitted >= self.num_output

    def emit(self, time_s: float) -> None:
        """An output token at ``time_s`` (the first one is the prefill's)."""
        if self.done:
            raise RuntimeError("every output token was already emitted")
        if self.last_token_s is None:
            self.first_token_s = time_s
        else:
            gap = time_s - self.last_token_s
            if gap < 0:
                raise ValueError(f"tokens out of order: {gap} s gap")
            self.gaps_within += gap <= self.tbt_target_s
            self.max_gap_s = max(self.max_gap_s, gap)
            if self.keep_gaps:
                self.gaps_s.append(gap)
        self.last_token_s = time_s
        self.num_emitted += 1

    @property
    def num_gaps(self) -> int:
        return max(0, self.num_emitted - 1)

    @property
    def mean_tbt_s(self) -> float | None:
        """(last − first token) / gaps; None before the second token."""
        if self.num_gaps == 0 or self.first_token_s is None or self.last_token_s is None:
            return None
        return (self.last_token_s - self.first_token_s) / self.num_gaps

    @property
    def met_tbt(self) -> bool:
        """Every token emitted and the mean gap within the target."""
        mean = self.mean_tbt_s
        return self.done and (mean is None or mean <= self.tbt_target_s)
