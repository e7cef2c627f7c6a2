"""Bench results: per-class TTFT and TBT attainment, TTFT / TPOT / TBT percentiles, goodput
over rates, JSON, plot.

TTFT attainment: the fraction of requests that succeeded with their first token within the
class's TTFT SLO (goodput is judged on it, as in the paper). TBT attainment: the fraction
of requests of a class with a TBT SLO that succeeded with every time between tokens within
it (:attr:`Outcome.met_tbt`); None where the class has no TBT SLO, or where nothing could
miss it (no request of the class streamed a second token, none failed). The first gap
between tokens (first → second: with disaggregation, the KV hand-off plus a decode step)
is reported apart, its p50 and p99.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.table import Table

from flowprefill.bench.client import Outcome

TARGET = 0.9


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def summarize(outcomes: list[Outcome]) -> dict[str, Any]:
    by_class: dict[str, list[Outcome]] = {}
    for o in outcomes:
        by_class.setdefault(o.slo_class, []).append(o)
    classes = {}
    for name, os_ in [*sorted(by_class.items()), ("all", outcomes)]:
        ttfts = [o.ttft_s for o in os_ if o.ttft_s is not None and o.error is None]
        tpots = [t for o in os_ if (t := o.tpot_s) is not None]
        classes[name] = {
            "requests": len(os_),
            "errors": sum(o.error is not None for o in os_),
            "attainment": sum(o.met for o in os_) / len(os_) if os_ else 0.0,
            "ttft_p50_s": percentile(ttfts, 0.5),
            "ttft_p99_s": percentile(ttfts, 0.99),
            "tpot_p50_s": percentile(tpots, 0.5),
            "tpot_p99_s": percentile(tpots, 0.99),
            "slo_s": os_[0].ttft_slo_s if name != "all" and os_ else None,
            **tbt_summary(os_, per_class=name != "all"),
        }
    return classes


def tbt_attainment(outcomes: list[Outcome]) -> float | None:
    """Fraction of the requests with a TBT SLO that met it (:attr:`Outcome.met_tbt`);
    None when none has one, or none could miss it (no gap and no failure)."""
    judged = [o for o in outcomes if o.tbt_slo_s is not None]
    if not any(o.gaps_s or o.error is not None for o in judged):
        return None
    return sum(bool(o.met_tbt) for o in judged) / len(judged)


def tbt_summary(outcomes: list[Outcome], *, per_class: bool = True) -> dict[str, Any]:
    """TBT SLO and attainment, and the percentiles of every gap between tokens of the
    requests that succeeded (pooled: a request with more tokens weighs more)."""
    gaps = [g for o in outcomes if o.error is None for g in o.gaps_s]
    # The first gap is where a disaggregated deployment pays the KV hand-off (prefill's
    # first token → decode's second); the others are decode steps.
    first_gaps = [o.gaps_s[0] for o in outcomes if o.error is None and o.gaps_s]
    return {
        "tbt_slo_s": outcomes[0].tbt_slo_s if per_class and outcomes else None,
        "tbt_attainment": tbt_attainment(outcomes),
        "tbt_p50_s": percentile(gaps, 0.5),
        "tbt_p99_s": percentile(gaps, 0.99),
        "tbt_max_s": max(gaps) if gaps else None,
        "first_gap_p50_s": percentile(first_gaps, 0.5),
        "first_gap_p99_s": percentile(first_gaps, 0.99),
    }


def goodput(rate_results: dict[float, dict[str, Any]], target: float = TARGET) -> float | None:
    """Highest rate whose overall attainment reaches ``target`` (rates tried, ascending)."""
    ok = [r for r, res in sorted(rate_results.items()) if res["all"]["attainment"] >= target]
    return max(ok) if ok else None


def table(rate_results: dict[float, dict[str, Any]], title: str) -> Table:
    t = Table(title=title)
    for col in (
        "rate req/s",
        "class",
        "TTFT SLO ms",
        "requests",
        "errors",
        "TTFT attainment",
        "p50 TTFT ms",
        "p99 TTFT ms",
        "p50 TPOT ms",
        "p99 TPOT ms",
        "TBT SLO ms",
        "TBT attainment",
        "p99 TBT ms",
        "p50 1st gap ms",
    ):
        t.add_column(col, justify="left" if col == "class" else "right")

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.0f}"

    def ms1(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.1f}"

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.0%}"

    for rate, classes in sorted(rate_results.items()):
        for i, (name, c) in enumerate(classes.items()):
            t.add_row(
                f"{rate:g}" if i == 0 else "",
                name if name != "all" else "[b]all[/b]",
                ms(c["slo_s"]),
                str(c["requests"]),
                str(c["errors"]),
                f"{c['attainment']:.0%}",
                ms(c["ttft_p50_s"]),
                ms(c["ttft_p99_s"]),
                ms1(c.get("tpot_p50_s")),
                ms1(c.get("tpot_p99_s")),
                ms(c.get("tbt_slo_s")),
                pct(c.get("tbt_attainment")),
                ms1(c.get("tbt_p99_s")),
                ms1(c.get("first_gap_p50_s")),
                end_section=name == "all",
            )
    return t


def write(
    out_dir: Path,
    meta: dict[str, Any],
    rate_results: dict[float, dict[str, Any]],
    raw: dict[float, list[Outcome]],
) -> tuple[Path, Path | None]:
    """bench.json and attainment.png in ``out_dir``; no PNG (None, a warning logged) where
    matplotlib is not installed: it comes with the ``lab`` extra, not with bench's."""
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {
        **meta,
        "goodput_req_s": goodput(rate_results),
        "target_attainment": TARGET,
        "rates": {str(r): res for r, res in sorted(rate_results.items())},
        "requests": {str(r): [asdict(o) for o in os_] for r, os_ in sorted(raw.items())},
    }
    json_path = out_dir / "bench.json"
    json_path.write_text(json.dumps(report, indent=2))
    try:
        import matplotlib
    except ImportError:
        logging.getLogger(__name__).warning(
            "attainment.png not written: matplotlib is not installed "
            "(pip install 'flowprefill[lab]')"
        )
        return json_path, None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ttft_ax, tbt_ax) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    rates = sorted(rate_results)
    names = [n for n in rate_results[rates[0]] if n != "all"] + ["all"]
    # One colour per class in both panels, though a panel may leave a class out.
    colours = {n: f"C{i}" for i, n in enumerate(names)}
    for ax, key in ((ttft_ax, "attainment"), (tbt_ax, "tbt_attainment")):
        for name in names:
            values = [rate_results[r].get(name, {}).get(key) for r in rates]
            if all(v is None for v in values):
                continue  # no SLO of that kind for this class
            ax.plot(
                rates,
                [float("nan") if v is None else v * 100 for v in values],
                marker="o",
                color=colours[name],
                label=name,
                linewidth=2.5 if name == "all" else 1.2,
            )
        ax.axhline(TARGET * 100, color="grey", linestyle="--", linewidth=0.8)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylim(0, 105)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
        else:
            ax.text(0.5, 0.5, "nothing to judge", ha="center", transform=ax.transAxes)
    ttft_ax.set_ylabel("SLO attainment (%)")
    ttft_ax.set_title("TTFT: first token within the class's SLO")
    tbt_ax.set_title("TBT: every gap between tokens within the SLO")
    fig.suptitle(meta.get("title", "SLO attainment"))
    fig.tight_layout()
    png_path = out_dir / "attainment.png"
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return json_path, png_path
