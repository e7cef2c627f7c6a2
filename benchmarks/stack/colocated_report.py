"""What ``benchmarks/stack/colocated.py`` makes of its probes: per-class attainment from the
clients' outcomes (TTFT; TBT by the mean-gap rule and by every gap; both), rounds pooled,
goodput as the rate where "both" crosses 90 %, and the tables and figure it prints and
writes. No servers, no clock: functions of recorded outcomes and probe summaries."""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.table import Table

from benchmarks.stack.vs_vllm import CHUNK_TOKENS_PAPER

if TYPE_CHECKING:
    from flowprefill.bench.client import Outcome


TARGET = 0.9
METRICS = ("ttft", "tbt", "tbt_every", "both")
"""Per class and for all: TTFT met; mean gap within the TBT target; every gap within it;
TTFT and mean-gap TBT both met."""


def mean_gap_s(o: Outcome) -> float | None:
    """DistServe's TPOT from the client's token times: (last − first) / (n − 1); None
    with fewer than two tokens."""
    t = o.token_times_s
    return (t[-1] - t[0]) / (len(t) - 1) if len(t) >= 2 else None


def met_tbt_mean(o: Outcome) -> bool:
    """The simulator's rule: succeeded, and the mean gap within the class's TBT target (a
    request that streamed one token has no gap and meets it)."""
    if o.error is not None or not o.token_times_s or o.tbt_slo_s is None:
        return False
    gap = mean_gap_s(o)
    return gap is None or gap <= o.tbt_slo_s


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def class_stats(outcomes: list[Outcome]) -> dict[str, Any]:
    """Attainments (``METRICS``) and latency percentiles of one class (or of all)."""
    n = len(outcomes)
    ok = [o for o in outcomes if o.error is None and o.ttft_s is not None]
    ttfts = [o.ttft_s for o in ok if o.ttft_s is not None]
    gaps = [g for o in ok if (g := mean_gap_s(o)) is not None]
    every = [g for o in ok for g in o.gaps_s]
    tokens = [len(o.token_times_s) for o in ok]
    return {
        "requests": n,
        "errors": n - len(ok),
        "ttft": sum(o.met for o in outcomes) / n,
        "tbt": sum(met_tbt_mean(o) for o in outcomes) / n,
        "tbt_every": sum(bool(o.met_tbt) for o in outcomes) / n,
        "both": sum(o.met and met_tbt_mean(o) for o in outcomes) / n,
        "ttft_p50_s": pct(ttfts, 0.5),
        "ttft_p99_s": pct(ttfts, 0.99),
        "mean_gap_p50_s": pct(gaps, 0.5),
        "mean_gap_p99_s": pct(gaps, 0.99),
        "gap_p99_s": pct(every, 0.99),
        "gap_max_s": max(every) if every else None,
        "tokens_mean": statistics.mean(tokens) if tokens else 0.0,
        "ttft_slo_s": outcomes[0].ttft_slo_s if outcomes else None,
        "tbt_slo_s": outcomes[0].tbt_slo_s if outcomes else None,
    }


def summarize(outcomes: list[Outcome]) -> dict[str, dict[str, Any]]:
    by_class: dict[str, list[Outcome]] = {}
    for o in outcomes:
        by_class.setdefault(o.slo_class, []).append(o)
    out = {c: class_stats(os_) for c, os_ in sorted(by_class.items())}
    out["all"] = class_stats(outcomes)
    out["all"]["ttft_slo_s"] = out["all"]["tbt_slo_s"] = None
    return out


def pool(probes: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Several rounds' probes at one rate as one: attainments weighted by requests, latency
    figures averaged (one round: that probe's figures)."""
    if len(probes) == 1:
        return dict(probes[0]["classes"])
    out: dict[str, dict[str, Any]] = {}
    for name in probes[0]["classes"]:
        rows = [p["classes"][name] for p in probes if name in p["classes"]]
        n = sum(r["requests"] for r in rows)
        merged: dict[str, Any] = {"requests": n, "errors": sum(r["errors"] for r in rows)}
        for m in METRICS:
            merged[m] = sum(r[m] * r["requests"] for r in rows) / n
        for k, v in rows[0].items():
            if k in merged:
                continue
            vals = [r[k] for r in rows if isinstance(r[k], int | float)]
            merged[k] = statistics.mean(vals) if vals else v
        out[name] = merged
    return out


def targets_table(
    args: argparse.Namespace,
    cal: Any,
    predictor: Any,
    steps_ms: dict[str, float],
    tbt_s: dict[str, float],
    build_cost_model: Any,
    decode_cost_model: Any,
) -> Table:
    """What the TBT targets mean here beside on an A100: a decode step and the prefill
    chunk vLLM-CP2K runs in one iteration, each over the tighter TBT target."""
    cost = build_cost_model("llama3-8b", "a100")
    a100_step = decode_cost_model(cost).step_s([1024]) * 1e3
    a100_chunk = cost.pass_cost([(CHUNK_TOKENS_PAPER, 0)]).total_s * 1e3
    here_chunk = predictor.predict_s(args.chunk_tokens) * 1e3
    tight = min(tbt_s.values()) * 1e3
    t = Table(
        title=f"TBT targets against a decode step and a CP2K chunk (tightest target "
        f"{tight:.0f} ms here, 100 ms on the A100)"
    )
    for col in (
        "where",
        "decode step ms",
        "÷ target",
        "chunk tokens",
        "chunk prefill ms",
        "÷ target",
    ):
        t.add_column(col, justify="right")
    t.add_row(
        "A100, Llama-3-8B (simulator's model)",
        f"{a100_step:.1f}",
        f"{a100_step / 100:.2f}",
        str(CHUNK_TOKENS_PAPER),
        f"{a100_chunk:.0f}",
        f"{a100_chunk / 100:.2f}",
    )
    for name, ms in steps_ms.items():
        t.add_row(
            f"here, {name} (measured idle)",
            f"{ms:.1f}",
            f"{ms / tight:.2f}",
            str(args.chunk_tokens),
            f"{here_chunk:.0f}",
            f"{here_chunk / tight:.2f}",
        )
    t.caption = (
        "decode step: A100 at batch 1, 1K context (flowprefill/lab/sim/decode.py); here the "
        "median gap after the second token of 3 lone 16-token prompts. chunk: the prefill "
        "profile's time for vLLM-CP2K's chunk (2,048 × length scale)"
    )
    return t


def results_table(
    pooled: dict[str, dict[float, dict[str, dict[str, Any]]]],
    rates: list[float],
    classes: list[str],
) -> Table:
    t = Table(
        title="per rate, system and class: attainment (TTFT; TBT by mean gap; TBT every "
        "gap; both) and latencies"
    )
    for col in (
        "rate",
        "system",
        "class",
        "requests",
        "errors",
        "TTFT",
        "TBT",
        "TBT every gap",
        "both",
        "TTFT p50 / p99 ms",
        "mean gap p50 / p99 ms",
        "gap p99 / max ms",
        "tokens",
    ):
        t.add_column(col, justify="left" if col in ("system", "class") else "right")

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.0f}"

    for rate in rates:
        for i, (name, by_rate) in enumerate(pooled.items()):
            for j, cls in enumerate(classes):
                c = by_rate[rate].get(cls)
                if c is None:
                    continue
                t.add_row(
                    f"{rate:g}" if i == j == 0 else "",
                    name if j == 0 else "",
                    cls if cls != "all" else "[b]all[/b]",
                    str(c["requests"]),
                    str(c["errors"]),
                    *(f"{c[m]:.0%}" for m in METRICS),
                    f"{ms(c['ttft_p50_s'])} / {ms(c['ttft_p99_s'])}",
                    f"{ms(c['mean_gap_p50_s'])} / {ms(c['mean_gap_p99_s'])}",
                    f"{ms(c['gap_p99_s'])} / {ms(c['gap_max_s'])}",
                    f"{c['tokens_mean']:.1f}",
                    end_section=cls == "all" and i == len(pooled) - 1,
                )
    return t


def ratio_to_baseline(
    pooled: dict[str, dict[float, dict[str, dict[str, Any]]]],
    rates: list[float],
    names: list[str],
    goodputs: dict[str, dict[str, float | None]],
) -> Table:
    """All classes: each system's attainments over vLLM-CP2K's at every rate, and goodput
    under both targets."""
    base = "vllm-cp2k" if "vllm-cp2k" in names else None
    t = Table(
        title="all classes: attainment TTFT / TBT / both" + (" (× vllm-cp2k)" if base else "")
    )
    t.add_column("system")
    for r in rates:
        t.add_column(f"{r:g} req/s", justify="right")
    t.add_column("goodput, both ≥ 90 %: tried / crossing", justify="right")

    def cell(name: str, r: float) -> str:
        a = pooled[name][r]["all"]
        text = " / ".join(f"{a[m]:.0%}" for m in ("ttft", "tbt", "both"))
        if base and name != base:
            b = pooled[base][r]["all"]
            ratios = [a[m] / b[m] if b[m] else math.inf for m in ("ttft", "tbt", "both")]
            text += " (" + " / ".join(f"{x:.2f}" for x in ratios) + ")"
        return text

    def rate(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    for name in names:
        g = goodputs[name]
        t.add_row(
            name,
            *(cell(name, r) for r in rates),
            f"{rate(g['highest_passing_req_s'])} / {rate(g['crossing_req_s'])}",
        )
    return t


def plot(
    path: Path,
    pooled: dict[str, dict[float, dict[str, dict[str, Any]]]],
    rates: list[float],
    classes: list[str],
    ttft_s: dict[str, float],
    tbt_s: dict[str, float],
    title: str,
) -> None:
    """Rows: TTFT attainment, TBT attainment (mean gap); columns: each class, then all;
    one line per system against the rate; dashed: the 90 % target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [*classes, "all"]
    fig, axes = plt.subplots(
        2, len(panels), figsize=(3.6 * len(panels), 7), sharex=True, sharey=True, squeeze=False
    )
    markers = "os^Dv<>p"
    for i, (system, by_rate) in enumerate(pooled.items()):
        for row, metric in zip(axes, ("ttft", "tbt"), strict=True):
            for ax, cls in zip(row, panels, strict=True):
                values = [100 * by_rate[r].get(cls, {}).get(metric, math.nan) for r in rates]
                ax.plot(
                    rates,
                    values,
                    marker=markers[i % len(markers)],
                    color=f"C{i}",
                    linewidth=2.0 if cls == "all" else 1.2,
                    label=system,
                )
    for row, metric in zip(axes, ("TTFT", "TBT"), strict=True):
        for ax, cls in zip(row, panels, strict=True):
            ax.axhline(100 * TARGET, color="grey", linestyle="--", linewidth=0.8)
            ax.set_ylim(0, 103)
            ax.set_xlabel("request rate (req/s)")
            if cls == "all":
                ax.set_title(f"{metric}: all classes", fontsize=10)
            else:
                target = (ttft_s if metric == "TTFT" else tbt_s)[cls] * 1e3
                ax.set_title(f"{metric}: {cls} ({target:.0f} ms)", fontsize=10)
        row[0].set_ylabel(f"{metric} attainment (%)")
    axes[0][-1].legend(fontsize=8, loc="lower left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
