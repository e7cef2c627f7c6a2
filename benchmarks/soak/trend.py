"""Is a resource of a process growing? A least-squares slope over the samples taken after
warm-up, its 95 % confidence interval, and a verdict (for ``benchmarks/soak/soak.py``).

**Growth** is said only when the slope is beyond noise, which here means both:

1. the slope's 95 % confidence interval lies wholly above 0 (ordinary least squares,
   Student's t with ``n - 2`` degrees of freedom), and
2. the change the fit implies over the window (slope × window length) exceeds a small
   absolute threshold (``--growth-mb``, ``--growth-fds``).

The second condition is there because the first alone is too eager: consecutive samples of
a resident set are correlated (an allocator keeps what it took), so OLS's interval is too
narrow, and a steady process that settles one megabyte higher half-way through has a
"significant" slope. A leak shows both: a trend that stays, and one large enough to
matter over the window. **Falling** is the mirror image (lower bound below 0 and a drop
past the threshold); everything else is **steady**. Fewer than :data:`MIN_SAMPLES`
samples give no verdict.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Literal

import numpy as np

MIN_SAMPLES = 6
"""Fewest samples in the window for a verdict (4 degrees of freedom)."""
CONFIDENCE = 0.95

Verdict = Literal["growth", "steady", "falling", "too few samples"]


def t_quantile(p: float, dof: int) -> float:
    """Student's t quantile, by the Cornish-Fisher expansion around the normal one
    (Abramowitz & Stegun 26.7.5): within 0.3 % of the exact value from 4 degrees of
    freedom up (the benchmarks do not depend on scipy)."""
    if dof < 1:
        raise ValueError(f"degrees of freedom must be >= 1, not {dof}")
    z = NormalDist().inv_cdf(p)
    g = (
        (z**3 + z) / 4,
        (5 * z**5 + 16 * z**3 + 3 * z) / 96,
        (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384,
        (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160,
    )
    return z + sum(gi / dof ** (i + 1) for i, gi in enumerate(g))


@dataclass(frozen=True)
class Trend:
    """A least-squares line through one resource's samples of one process."""

    num_samples: int
    window_min: float
    """From the first to the last sample of the window, minutes."""
    start: float
    """First sample of the window (the value, not the fit)."""
    end: float
    slope_per_min: float
    ci_per_min: float
    """Half-width of the slope's 95 % confidence interval (nan: too few samples)."""

    @property
    def fitted_change(self) -> float:
        """Slope × window: the change the line implies from first to last sample."""
        return self.slope_per_min * self.window_min

    def verdict(self, threshold: float) -> Verdict:
        """See the module docstring; ``threshold``: the smallest change over the window
        that counts (MB or descriptors)."""
        if self.num_samples < MIN_SAMPLES or math.isnan(self.ci_per_min):
            return "too few samples"
        low = self.slope_per_min - self.ci_per_min
        high = self.slope_per_min + self.ci_per_min
        if low > 0 and self.fitted_change > threshold:
            return "growth"
        if high < 0 and -self.fitted_change > threshold:
            return "falling"
        return "steady"


def fit_trend(t_s: Sequence[float], values: Sequence[float]) -> Trend:
    """OLS of ``values`` against ``t_s`` (seconds); slope and interval per minute."""
    if len(t_s) != len(values):
        raise ValueError(f"{len(t_s)} times but {len(values)} values")
    if not values:
        raise ValueError("no samples to fit")
    n = len(values)
    t_min = np.asarray(t_s, dtype=float) / 60.0
    y = np.asarray(values, dtype=float)
    window = float(t_min[-1] - t_min[0])
    sxx = float(np.sum((t_min - t_min.mean()) ** 2))
    if n < 3 or sxx == 0.0:
        return Trend(n, window, float(y[0]), float(y[-1]), 0.0, math.nan)
    slope = float(np.sum((t_min - t_min.mean()) * (y - y.mean())) / sxx)
    residuals = y - (y.mean() + slope * (t_min - t_min.mean()))
    se = math.sqrt(float(np.sum(residuals**2)) / (n - 2) / sxx)
    ci = t_quantile(0.5 + CONFIDENCE / 2, n - 2) * se
    return Trend(n, window, float(y[0]), float(y[-1]), slope, ci)
