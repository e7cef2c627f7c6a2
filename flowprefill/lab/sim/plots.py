"""Matplotlib figures in the paper's layout (Figures 9–12, 15), written as PNG files."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt
from matplotlib import ticker

from flowprefill.lab.sim.sweep import SweepResult, SystemOutcome

GROUPS: dict[str, tuple[str, tuple[str, ...]]] = {
    "fig9_end_to_end": (
        "End to end (paper Figure 9)",
        ("distserve-fcfs", "distserve-cp2k", "distserve-cp8k", "sedf-layer", "flowprefill"),
    ),
    "fig10_policies": (
        "Scheduling policy (paper Figure 10)",
        ("flowprefill", "dedf-op", "edf-op"),
    ),
    "fig11_batching": (
        "Batch token budget (paper Figure 11)",
        ("fp-budget2k", "flowprefill", "fp-budget8k", "fp-nobatch"),
    ),
    "fig15_chunks": (
        "FlowPrefill with chunked prefill (paper Figure 15)",
        ("flowprefill", "fp-cp8k", "distserve-cp8k"),
    ),
    "beyond": (
        "Beyond the paper",
        ("flowprefill", "fp-plus", "fp-member", "fp-headroom", "fp-shed", "fp-shed-queue"),
    ),
}


def _plot_group(result: SweepResult, outcomes: list[SystemOutcome], title: str, path: Path) -> None:
    target = result.config.get("target", 0.9)
    fig, (ax_rate, ax_slo) = plt.subplots(1, 2, figsize=(11, 4))
    for o in outcomes:
        xs = [p.rate for p in o.rate_curve]
        ys = [100 * p.attainment for p in o.rate_curve]
        (line,) = ax_rate.plot(xs, ys, marker="o", ms=3, label=o.label)
        if o.goodput_rps > 0:
            ax_rate.axvline(o.goodput_rps, color=line.get_color(), ls=":", lw=1)
        xs = [p.slo_scale for p in o.slo_curve]
        ys = [100 * p.attainment for p in o.slo_curve]
        ax_slo.plot(xs, ys, marker="o", ms=3, color=line.get_color(), label=o.label)
        if math.isfinite(o.tightest_slo_scale):
            ax_slo.axvline(o.tightest_slo_scale, color=line.get_color(), ls=":", lw=1)
    for ax in (ax_rate, ax_slo):
        ax.axhline(100 * target, color="grey", lw=0.8)
        ax.set_ylabel("SLO attainment (%)")
        ax.set_ylim(0, 102)
        ax.grid(alpha=0.3)
    ax_rate.set_xlabel("request rate (req/s)")
    ax_slo.set_xlabel(f"SLO scale (at {result.reference_rate_rps:.2f} req/s)")
    ax_slo.set_xscale("log")
    ax_slo.xaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
    ax_slo.xaxis.set_minor_formatter(ticker.NullFormatter())
    ax_slo.set_xticks([0.1, 0.2, 0.3, 0.5, 1, 2, 3, 5])
    ax_rate.legend(fontsize=8)
    fig.suptitle(f"{title} — {result.cost_model}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_blocking(result: SweepResult, path: Path) -> None:
    with_preemption = [o for o in result.systems if o.reference.num_preemptions > 0]
    if not with_preemption:
        return
    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [o.label for o in with_preemption]
    means = [o.reference.blocking_mean_ms for o in with_preemption]
    maxes = [o.reference.blocking_max_ms for o in with_preemption]
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], means, width=0.4, label="mean")
    ax.bar([x + 0.2 for x in xs], maxes, width=0.4, label="max")
    ax.set_xticks(list(xs), labels, rotation=30, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("preemption blocking (ms)")
    ax.set_title(f"Preemption blocking time (paper Figure 12) — {result.cost_model}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_plots(result: SweepResult, folder: Path) -> list[Path]:
    """Every figure whose systems were simulated; returns the files written."""
    by_name = result.by_name()
    written: list[Path] = []
    for stem, (title, names) in GROUPS.items():
        outcomes = [by_name[n] for n in names if n in by_name]
        if len(outcomes) < 2:
            continue
        path = folder / f"{stem}.png"
        _plot_group(result, outcomes, title, path)
        written.append(path)
    others = [o for o in result.systems if not any(o.name in g[1] for g in GROUPS.values())]
    if others:
        path = folder / "other_systems.png"
        _plot_group(result, others, "Other systems", path)
        written.append(path)
    path = folder / "fig12_blocking.png"
    _plot_blocking(result, path)
    if path.exists():
        written.append(path)
    return written
