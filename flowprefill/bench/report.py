"""Bench results: per-class attainment, TTFT and TPOT percentiles, goodput over rates, JSON,
plot."""

from __future__ import annotations

import json
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
        }
    return classes


def goodput(rate_results: dict[float, dict[str, Any]], target: float = TARGET) -> float | None:
    """Highest rate whose overall attainment reaches ``target`` (rates tried, ascending)."""
    ok = [r for r, res in sorted(rate_results.items()) if res["all"]["attainment"] >= target]
    return max(ok) if ok else None


def table(rate_results: dict[float, dict[str, Any]], title: str) -> Table:
    t = Table(title=title)
    for col in (
        "rate req/s",
        "class",
        "SLO ms",
        "requests",
        "errors",
        "attainment",
        "p50 TTFT ms",
        "p99 TTFT ms",
        "p50 TPOT ms",
        "p99 TPOT ms",
    ):
        t.add_column(col, justify="left" if col == "class" else "right")

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.0f}"

    def ms1(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.1f}"

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
                end_section=name == "all",
            )
    return t


def write(
    out_dir: Path,
    meta: dict[str, Any],
    rate_results: dict[float, dict[str, Any]],
    raw: dict[float, list[Outcome]],
) -> tuple[Path, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig, ax = plt.subplots(figsize=(6, 4))
    rates = sorted(rate_results)
    names = [n for n in rate_results[rates[0]] if n != "all"] + ["all"]
    for name in names:
        ax.plot(
            rates,
            [rate_results[r].get(name, {}).get("attainment", 0) * 100 for r in rates],
            marker="o",
            label=name,
            linewidth=2.5 if name == "all" else 1.2,
        )
    ax.axhline(TARGET * 100, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("TTFT SLO attainment (%)")
    ax.set_ylim(0, 105)
    ax.set_title(meta.get("title", "TTFT SLO attainment"))
    ax.legend()
    fig.tight_layout()
    png_path = out_dir / "attainment.png"
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return json_path, png_path
