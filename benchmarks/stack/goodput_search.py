"""Goodput by bisection on the request rate, and the attainment plot (for
``benchmarks/stack/vs_vllm.py``).

Goodput, as in the paper: the highest request rate at which at least 90 % of all requests
(every class together) get their first token within their class's TTFT SLO. One
:class:`Bisection` finds it for one system on one seeded workload: it doubles (or halves)
the rate from a start until it has a rate that passes and one that fails, then bisects
between them geometrically until ``fail / pass <= 1 + precision``; the goodput is the
highest rate that passed (0 when even ``min_rate`` failed). It assumes attainment falls
with the rate; a noisy machine can break that, which the plot of every probe shows.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

TARGET = 0.9


@dataclass
class Probe:
    """One replay of the workload at ``rate`` against one system."""

    rate: float
    attainment: float
    """Fraction of all requests within their class's TTFT SLO."""
    classes: dict[str, dict[str, Any]]
    """``flowprefill.bench.report.summarize`` of the replay: per class and ``all``."""
    wall_s: float
    missed: list[tuple[str, int, float | None]] = field(default_factory=list)
    """(class, prompt tokens, TTFT s or None for an error) of every request that missed."""

    @property
    def passed(self) -> bool:
        return self.attainment >= TARGET


@dataclass
class Bisection:
    start: float
    precision: float
    min_rate: float
    max_rate: float
    probes: list[Probe] = field(default_factory=list)
    lo: float | None = None
    """Highest rate that passed."""
    hi: float | None = None
    """Lowest rate that failed."""

    def next_rate(self) -> float | None:
        """The rate to probe next; None once the goodput is known to the precision."""
        lo, hi = self.lo, self.hi
        if lo is None and hi is None:
            return self.start
        if hi is None:
            assert lo is not None
            return None if lo >= self.max_rate else min(self.max_rate, 2 * lo)
        if lo is None:
            return None if hi <= self.min_rate else max(self.min_rate, hi / 2)
        if hi / lo <= 1 + self.precision:
            return None
        return round(math.sqrt(lo * hi), 4)

    def add(self, probe: Probe) -> None:
        self.probes.append(probe)
        if probe.passed:
            self.lo = probe.rate if self.lo is None else max(self.lo, probe.rate)
        else:
            self.hi = probe.rate if self.hi is None else min(self.hi, probe.rate)

    @property
    def done(self) -> bool:
        return self.next_rate() is None

    @property
    def goodput(self) -> float:
        return self.lo or 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "goodput_req_s": self.goodput,
            "bracket_req_s": [self.lo, self.hi],
            "probes": [asdict(p) for p in sorted(self.probes, key=lambda p: p.rate)],
        }


def plot_attainment(
    path: Path,
    results: dict[str, dict[int, Bisection]],
    classes: list[str],
    slo_ms: dict[str, float],
    title: str,
) -> None:
    """Per-class TTFT attainment against the rate, every probe of every system and seed
    (one line per seed), with each system's mean goodput marked on the last panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [*classes, "all"]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4), sharey=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    markers = "os^Dv<>p"
    for i, (system, seeds) in enumerate(results.items()):
        color = colors[i % len(colors)]
        for j, (seed, bis) in enumerate(sorted(seeds.items())):
            probes = sorted(bis.probes, key=lambda p: p.rate)
            rates = [p.rate for p in probes]
            for ax, name in zip(axes, panels, strict=True):
                values = [100 * p.classes.get(name, {}).get("attainment", math.nan) for p in probes]
                ax.plot(
                    rates,
                    values,
                    color=color,
                    marker=markers[j % len(markers)],
                    markersize=4,
                    linewidth=1.0,
                    alpha=0.8,
                    label=f"{system} (seed {seed})" if name == "all" else None,
                )
        goodputs = [b.goodput for b in seeds.values()]
        mean = sum(goodputs) / len(goodputs)
        axes[-1].axvline(mean, color=color, linestyle=":", linewidth=1.2)
    for ax, name in zip(axes, panels, strict=True):
        ax.axhline(100 * TARGET, color="grey", linestyle="--", linewidth=0.8)
        ax.set_xlabel("request rate (req/s)")
        slo = f" (SLO {slo_ms[name]:.0f} ms)" if name in slo_ms else ""
        ax.set_title(f"{name}{slo}")
        ax.set_ylim(0, 102)
    axes[0].set_ylabel("TTFT SLO attainment (%)")
    axes[-1].legend(fontsize=7, loc="lower left")
    fig.suptitle(title + " — dotted: mean goodput")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
