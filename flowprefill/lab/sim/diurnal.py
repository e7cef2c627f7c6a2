"""A day-long workload: a diurnal request-rate curve with bursts, time-compressed.

The rate follows one cosine day — lowest at ``trough_at`` (04:00), highest twelve hours
later (16:00), ``trough_fraction`` of the peak at the bottom — and on top of it
``num_bursts`` bursts, each multiplying the rate by ``burst_factor`` for ``burst_s``,
placed at seeded random times that do not overlap. Arrivals are a non-homogeneous Poisson
process drawn by thinning; prompts and classes are the QwenTrace-like mix of
:func:`flowprefill.bench.workload.qwen_like` (Table 1 lengths, Table 2 SLOs).

**Time compression.** A real day is 86 400 s; simulating it request by request at a
production rate would take minutes of wall time per system. The day is compressed by
``compression`` (default 60: one real hour is one simulated minute, the day 24 minutes),
while *requests* keep real time: prompt lengths, the A100's speed and the TTFT SLOs are
not scaled, so a replica serves as many requests per simulated second as a real one. Every
duration of the control plane — pod start-up, control period, the autoscalers' windows,
cool-downs and stabilization, burst length — is divided by the same factor
(:meth:`DiurnalSpec.scaled`), so their relations to each other and to the day hold.
What does not hold: a window holds ``compression``× fewer requests than in production
(burn rates are noisier, and a rare class reaches ``min_requests`` less often).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from flowprefill.bench.workload import Workload, check_positive, qwen_like
from flowprefill.errors import InvalidRequestError

REAL_DAY_S = 86_400.0


@dataclass(frozen=True)
class DiurnalSpec:
    peak_rps: float = 30.0
    """Request rate at the top of the curve (before bursts), req/s of simulated time."""
    trough_fraction: float = 0.25
    """The rate at the bottom of the curve, as a fraction of ``peak_rps``."""
    trough_at: float = 4 / 24
    """Where in the day (fraction) the rate is lowest; the peak is half a day later."""
    num_bursts: int = 4
    burst_factor: float = 1.5
    """A burst multiplies the curve's rate by this."""
    burst_real_s: float = 600.0
    """Length of one burst in real seconds (10 min); simulated: ÷ ``compression``."""
    compression: float = 60.0
    """Real seconds per simulated second (60: the day lasts 24 simulated minutes)."""
    seed: int = 0
    model: str = "llama3-8b"
    max_tokens: int = 32768

    def __post_init__(self) -> None:
        check_positive("peak_rps", self.peak_rps)
        check_positive("compression", self.compression)
        check_positive("burst_factor", self.burst_factor)
        check_positive("burst_real_s", self.burst_real_s)
        if not 0 < self.trough_fraction <= 1:
            raise InvalidRequestError(
                f"trough_fraction must be in (0, 1], got {self.trough_fraction!r}"
            )
        if self.num_bursts < 0:
            raise InvalidRequestError(f"num_bursts must be ≥ 0, got {self.num_bursts!r}")
        if self.num_bursts * self.burst_s * 2 > self.day_s:
            raise InvalidRequestError(
                f"{self.num_bursts} bursts of {self.burst_s:g} s do not fit in a "
                f"{self.day_s:g} s day"
            )

    @property
    def day_s(self) -> float:
        """Length of the simulated day."""
        return REAL_DAY_S / self.compression

    @property
    def burst_s(self) -> float:
        return self.scaled(self.burst_real_s)

    def scaled(self, real_s: float) -> float:
        """A real-world duration in simulated seconds."""
        return real_s / self.compression

    def bursts(self) -> list[tuple[float, float]]:
        """(start, end) of every burst, simulated seconds, ascending, not overlapping."""
        rng = np.random.default_rng([self.seed, 1])
        # Place bursts in equal slots of the day so they never overlap, each at a random
        # offset inside its slot.
        if self.num_bursts == 0:
            return []
        slot = self.day_s / self.num_bursts
        starts = [k * slot + rng.uniform(0, slot - self.burst_s) for k in range(self.num_bursts)]
        return [(s, s + self.burst_s) for s in starts]

    def base_rate(self, t_s: float) -> float:
        """The curve's rate at simulated time ``t_s``, without bursts."""
        phase = 2 * math.pi * (t_s / self.day_s - self.trough_at)
        low = self.trough_fraction
        return self.peak_rps * (low + (1 - low) * (1 - math.cos(phase)) / 2)

    def rate(self, t_s: float, bursts: list[tuple[float, float]] | None = None) -> float:
        """The rate at ``t_s`` with bursts (pass ``bursts()`` once to save recomputing)."""
        spans = self.bursts() if bursts is None else bursts
        boost = any(a <= t_s < b for a, b in spans)
        return self.base_rate(t_s) * (self.burst_factor if boost else 1.0)

    @property
    def max_rate(self) -> float:
        return self.peak_rps * max(1.0, self.burst_factor)

    def build(self) -> Workload:
        """The day's requests (arrival times in simulated seconds from 0)."""
        rng = np.random.default_rng([self.seed, 0])
        spans = self.bursts()
        top = self.max_rate
        expected = int(top * self.day_s * 1.05) + 100
        times = np.cumsum(rng.exponential(1.0 / top, expected))
        while times[-1] < self.day_s:  # rare: draw more
            more = np.cumsum(rng.exponential(1.0 / top, expected)) + times[-1]
            times = np.concatenate([times, more])
        times = times[times < self.day_s]
        keep = rng.uniform(0, top, len(times)) < [self.rate(float(t), spans) for t in times]
        arrivals = times[keep]
        if len(arrivals) < 2:
            raise InvalidRequestError("the diurnal workload has fewer than 2 requests")
        prompts = qwen_like(
            len(arrivals), seed=self.seed, model=self.model, max_tokens=self.max_tokens
        )
        return Workload(
            name=f"diurnal/peak{self.peak_rps:g}/x{self.compression:g}/seed{self.seed}",
            arrival_s=tuple(float(t) for t in arrivals),
            num_tokens=prompts.num_tokens,
            slo_class=prompts.slo_class,
            slo_table=prompts.slo_table,
            base_rate=1.0,
        )
