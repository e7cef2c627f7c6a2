"""Workloads: QwenTrace-like and ShareGPT-like generators, SLO tables, rate scaling.

A :class:`Workload` is a fixed list of requests with arrival times at a *base rate*; the
sweeps scale those times to any request rate (common random numbers: every system and
every rate sees the same prompts in the same order), and scale every SLO by one factor.

QwenTrace-like prompts follow the paper's Table 1 per task type. Each type's length
distribution is matched to the table's mean and standard deviation; the family (gamma or
log-normal) is the one whose 99th percentile lands closer to the table's P99:

=======  =====  ====  =====  =====  ==========  ==================
type     ratio  mean  P99    std    family      P99 of the family
=======  =====  ====  =====  =====  ==========  ==================
text     68 %   590   3040   652    gamma       ≈ 3010
image    8 %    532   2764   510    log-normal  ≈ 2515
search   20 %   5976  16635  3456   gamma       ≈ 16700
file     4 %    6833  22390  5186   gamma       ≈ 24260
=======  =====  ====  =====  =====  ==========  ==================

Lengths are rounded and clipped to ``[16, max_tokens]``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from flowprefill.contracts.slo import PAPER_TTFT_SLOS_S
from flowprefill.errors import InvalidRequestError, UnknownNameError
from flowprefill.prefill.request import Request

SLO_TABLES = PAPER_TTFT_SLOS_S  # Table 2, owned by the contracts


@dataclass(frozen=True, slots=True)
class TaskType:
    name: str
    ratio: float
    mean: float
    p99: float
    std: float
    family: str  # "gamma" | "lognormal"


QWEN_TYPES = (
    TaskType("text", 0.68, 590, 3040, 652, "gamma"),
    TaskType("image", 0.08, 532, 2764, 510, "lognormal"),
    TaskType("search", 0.20, 5976, 16635, 3456, "gamma"),
    TaskType("file", 0.04, 6833, 22390, 5186, "gamma"),
)
MIN_PROMPT_TOKENS = 16

ARRIVALS = ("poisson", "gamma")


@dataclass(frozen=True)
class Workload:
    name: str
    arrival_s: tuple[float, ...]
    """Arrival times at ``base_rate`` (seconds, ascending)."""
    num_tokens: tuple[int, ...]
    slo_class: tuple[str, ...]
    slo_table: dict[str, float]
    base_rate: float
    """Request rate (req/s) the arrival times correspond to."""

    def __post_init__(self) -> None:
        if not self.arrival_s:
            raise InvalidRequestError(f"workload {self.name!r} has no requests")
        if not (len(self.arrival_s) == len(self.num_tokens) == len(self.slo_class)):
            raise ValueError("workload columns differ in length")
        if not (self.base_rate > 0 and math.isfinite(self.base_rate)):
            raise InvalidRequestError(f"workload {self.name!r}: base rate {self.base_rate}")
        missing = sorted(set(self.slo_class) - set(self.slo_table))
        if missing:
            raise UnknownNameError("SLO class", missing[0], sorted(self.slo_table))

    def __len__(self) -> int:
        return len(self.arrival_s)

    def head(self, num_requests: int) -> Workload:
        """The first ``num_requests`` requests, same base rate."""
        k = max(1, min(num_requests, len(self)))
        return Workload(
            name=f"{self.name}[:{k}]",
            arrival_s=self.arrival_s[:k],
            num_tokens=self.num_tokens[:k],
            slo_class=self.slo_class[:k],
            slo_table=self.slo_table,
            base_rate=self.base_rate,
        )

    @property
    def classes(self) -> list[str]:
        return sorted(set(self.slo_class))

    def requests(self, rate: float, slo_scale: float = 1.0) -> list[Request]:
        """Fresh requests at ``rate`` req/s with every SLO multiplied by ``slo_scale``."""
        check_positive("--rate", rate)
        check_positive("--slo-scale", slo_scale)
        stretch = self.base_rate / rate
        table = self.slo_table
        return [
            Request.create(
                f"r{i}",
                arrival_s=t * stretch,
                ttft_slo_s=table[c] * slo_scale,
                num_tokens=n,
                slo_class=c,
            )
            for i, (t, n, c) in enumerate(
                zip(self.arrival_s, self.num_tokens, self.slo_class, strict=True)
            )
        ]


def check_positive(flag: str, value: float) -> None:
    if not (isinstance(value, int | float) and value > 0 and math.isfinite(value)):
        raise InvalidRequestError(f"{flag} must be a positive number, got {value!r}")


def get_slo_table(model: str) -> dict[str, float]:
    table = SLO_TABLES.get(model.lower())
    if table is None:
        raise UnknownNameError("model (SLO table)", model, sorted(SLO_TABLES))
    return dict(table)


def _sample_lengths(rng: np.random.Generator, t: TaskType, size: int) -> np.ndarray:
    if t.family == "gamma":
        shape = (t.mean / t.std) ** 2
        return rng.gamma(shape, t.mean / shape, size)
    sigma2 = math.log(1 + (t.std / t.mean) ** 2)
    return rng.lognormal(math.log(t.mean) - sigma2 / 2, math.sqrt(sigma2), size)


def interarrivals(rng: np.random.Generator, kind: str, size: int, cv: float) -> np.ndarray:
    """Mean-1 gaps: exponential (Poisson process) or gamma with coefficient of variation
    ``cv`` (``cv > 1`` is burstier than Poisson)."""
    if kind == "poisson":
        return rng.exponential(1.0, size)
    if kind == "gamma":
        check_positive("--burst-cv", cv)
        shape = 1.0 / (cv * cv)
        return rng.gamma(shape, 1.0 / shape, size)
    raise UnknownNameError("arrival process", kind, list(ARRIVALS))


def _check_count(num_requests: int) -> None:
    if num_requests <= 0:
        raise InvalidRequestError(f"--num-requests must be positive, got {num_requests}")


def qwen_like(
    num_requests: int,
    *,
    seed: int = 0,
    arrival: str = "poisson",
    burst_cv: float = 2.0,
    model: str = "llama3-8b",
    max_tokens: int = 32768,
) -> Workload:
    """QwenTrace-like multi-SLO workload at 1 req/s (Table 1 lengths, Table 2 SLOs)."""
    _check_count(num_requests)
    rng = np.random.default_rng(seed)
    kinds = rng.choice(len(QWEN_TYPES), size=num_requests, p=[t.ratio for t in QWEN_TYPES])
    lengths = np.zeros(num_requests)
    for k, t in enumerate(QWEN_TYPES):
        mask = kinds == k
        lengths[mask] = _sample_lengths(rng, t, int(mask.sum()))
    gaps = interarrivals(rng, arrival, num_requests, burst_cv)
    tokens = np.clip(np.rint(lengths), MIN_PROMPT_TOKENS, max_tokens).astype(int)
    return Workload(
        name=f"qwen-like/{arrival}/seed{seed}",
        arrival_s=tuple(float(x) for x in np.cumsum(gaps)),
        num_tokens=tuple(int(x) for x in tokens),
        slo_class=tuple(QWEN_TYPES[k].name for k in kinds),
        slo_table=get_slo_table(model),
        base_rate=1.0,
    )


SHAREGPT_MEDIAN_TOKENS = 256
SHAREGPT_SIGMA = 1.0
SHAREGPT_MAX_TOKENS = 2047


def sharegpt_like(num_requests: int, *, seed: int = 0, model: str = "llama3-8b") -> Workload:
    """Single-SLO chat workload (paper §6.5): every request is ``text`` (the chat SLO).

    Prompt lengths are log-normal (median 256, σ = 1.0, mean ≈ 420) resampled until below
    2K tokens — an assumption shaped like ShareGPT's long-tailed prompts, not fitted to it;
    replay a ShareGPT-derived trace file for real lengths. Poisson arrivals.
    """
    _check_count(num_requests)
    rng = np.random.default_rng(seed)
    out: list[int] = []
    while len(out) < num_requests:
        draw = rng.lognormal(math.log(SHAREGPT_MEDIAN_TOKENS), SHAREGPT_SIGMA, num_requests)
        out.extend(int(x) for x in np.rint(draw) if MIN_PROMPT_TOKENS <= x <= SHAREGPT_MAX_TOKENS)
    gaps = rng.exponential(1.0, num_requests)
    return Workload(
        name=f"sharegpt-like/seed{seed}",
        arrival_s=tuple(float(x) for x in np.cumsum(gaps)),
        num_tokens=tuple(out[:num_requests]),
        slo_class=("text",) * num_requests,
        slo_table=get_slo_table(model),
        base_rate=1.0,
    )


def from_rows(
    name: str,
    times_s: Sequence[float],
    num_tokens: Sequence[int],
    classes: Sequence[str],
    slo_table: dict[str, float],
) -> Workload:
    """A workload from replayed rows (already validated); base rate = N / span."""
    if not times_s:
        raise InvalidRequestError(f"trace {name} has no requests")
    order = sorted(range(len(times_s)), key=lambda i: times_s[i])
    t0 = times_s[order[0]]
    span = times_s[order[-1]] - t0
    if span <= 0:
        raise InvalidRequestError(
            f"trace {name}: every request has the same timestamp, so it has no request rate"
        )
    return Workload(
        name=name,
        arrival_s=tuple(times_s[i] - t0 for i in order),
        num_tokens=tuple(num_tokens[i] for i in order),
        slo_class=tuple(classes[i] for i in order),
        slo_table=slo_table,
        base_rate=len(order) / span,
    )
