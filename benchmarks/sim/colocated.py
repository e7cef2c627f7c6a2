"""Colocated serving (the paper's §6.5, Figure 16): TTFT and TBT attainment vs request rate.

    python benchmarks/sim/colocated.py [--num-requests 800] [--seeds 0,1] [--rates 1,2,...]
                                       [--interference 1.0] [--quick] [--out DIR]

One A100 (simulated) serves Llama-3-8B with prefill and decode colocated
(flowprefill/lab/sim/colocated.py): vLLM with 2,048-token chunked prefill (vLLM-CP2K),
FlowPrefill (the engine's scheduler for prefill, decode steps sharing the device), and
FlowPrefill with decode-aware parking. QwenTrace-like requests (Table 1 prompts, Poisson),
output lengths drawn by flowprefill/lab/sim/decode.py (log-normal, median 128), TTFT
targets 3× Table 2 and TBT targets 0.1 s (text, image) / 0.2 s (search, file), as §6.5.

Prints a table per rate (TTFT, TBT, both, per-gap attainment), goodput under both targets
(the rate where "both" crosses 90 %, interpolated on the rate grid) and the TBT ratio
beside the paper's "up to 1.6×"; writes ``result.json`` and ``fig16_colocated.png`` to
``--out`` (default runs/bench-sim-colocated-<time>). About 1 minute on 2 cores with the
defaults; ``--quick`` is the CI smoke size (a few seconds).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from flowprefill.bench.workload import qwen_like
from flowprefill.lab.sim.colocated import (
    COLOCATED_SYSTEMS,
    INTERFERENCE,
    TTFT_SCALE,
    ColocatedResult,
    run_colocated,
)
from flowprefill.lab.sim.cost import build_cost_model
from flowprefill.lab.sim.decode import DecodeCostModel

PAPER_TBT = (
    "§6.5, Figure 16(b): \"because FlowPrefill's adaptive preemption expedites short "
    "prefills, it incidentally reduces the duration of interference, improving TBT SLO "
    'attainment by up to 1.6×"'
)
PAPER_TBT_RATIO = 1.6
TARGET = 0.9
DEFAULT_RATES = (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0)
METRICS = ("ttft", "tbt", "both", "gap")


def pooled(results: list[ColocatedResult]) -> dict[str, float]:
    """Attainments over every seed's requests together (gaps: every gap together)."""
    n = sum(len(r.records) for r in results)
    gaps = sum(x.num_gaps for r in results for x in r.records)
    return {
        "ttft": sum(r.ttft_attainment * len(r.records) for r in results) / n,
        "tbt": sum(r.tbt_attainment * len(r.records) for r in results) / n,
        "both": sum(r.both_attainment * len(r.records) for r in results) / n,
        "gap": sum(x.gaps_within for r in results for x in r.records) / gaps if gaps else 0.0,
        "parks": float(sum(r.num_parks for r in results)),
    }


def crossing(rates: list[float], values: list[float], target: float = TARGET) -> float | None:
    """The highest rate at which ``values`` are still ≥ target, interpolated linearly to
    the first point below it; None when even the lowest rate misses it."""
    if not values or values[0] < target:
        return None
    for k in range(1, len(values)):
        if values[k] < target:
            r0, r1, v0, v1 = rates[k - 1], rates[k], values[k - 1], values[k]
            return r0 + (r1 - r0) * (v0 - target) / (v0 - v1)
    return rates[-1]  # never crossed on the grid: at least the last rate


def plot(path: Path, rates: list[float], curves: dict[str, dict[str, list[float]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, metric, title in zip(axes, ("ttft", "tbt"), ("(a) TTFT", "(b) TBT"), strict=True):
        for name, curve in curves.items():
            ax.plot(rates, curve[metric], marker="o", label=COLOCATED_SYSTEMS[name].label)
        ax.axhline(TARGET, color="grey", lw=0.8)
        ax.set_xlabel("request rate (req/s)")
        ax.set_title(f"{title} SLO attainment")
    axes[0].set_ylabel("SLO attainment")
    axes[0].legend(loc="lower left")
    fig.suptitle("Colocated, Llama-3-8B on A100 (simulated; cf. paper Figure 16)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=800)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--rates", default=",".join(f"{r:g}" for r in DEFAULT_RATES))
    ap.add_argument("--systems", default=",".join(COLOCATED_SYSTEMS))
    ap.add_argument("--gpu", default="a100")
    ap.add_argument("--interference", type=float, default=INTERFERENCE)
    ap.add_argument("--quick", action="store_true", help="CI smoke size: 60 requests, 2 rates")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.num_requests, args.seeds, args.rates = 60, "0", "2,6"
    seeds = [int(s) for s in args.seeds.split(",")]
    rates = sorted(float(r) for r in args.rates.split(","))
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    out = args.out or Path("runs") / f"bench-sim-colocated-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    console = Console()
    cost = build_cost_model("llama3-8b", args.gpu)
    decode = DecodeCostModel(cost)
    workloads = {s: qwen_like(args.num_requests, seed=s) for s in seeds}
    curves: dict[str, dict[str, list[float]]] = {
        name: {m: [] for m in (*METRICS, "parks")} for name in systems
    }
    started = time.perf_counter()
    with Progress(console=console, transient=True) as progress:
        job = progress.add_task("colocated runs", total=len(systems) * len(rates) * len(seeds))
        for name in systems:
            for rate in rates:
                runs = []
                for seed in seeds:
                    runs.append(
                        run_colocated(
                            name,
                            workloads[seed],
                            cost,
                            rate=rate,
                            seed=seed,
                            interference=args.interference,
                            decode=decode,
                        )
                    )
                    progress.advance(job)
                for metric, value in pooled(runs).items():
                    curves[name][metric].append(value)
    wall_s = time.perf_counter() - started

    table = Table(
        title=f"Colocated Llama-3-8B/{args.gpu}: SLO attainment (TTFT {TTFT_SCALE:g}× Table 2, "
        f"TBT 0.1/0.2 s mean gap), {args.num_requests} requests × seeds {args.seeds}, "
        f"interference α={args.interference:g}"
    )
    for col in ("rate", "system", "TTFT", "TBT", "both", "per gap"):
        table.add_column(col, justify="left" if col == "system" else "right")
    for k, rate in enumerate(rates):
        for j, name in enumerate(systems):
            cells = [f"{curves[name][m][k]:.1%}" for m in METRICS]
            table.add_row(
                f"{rate:g}" if j == 0 else "",
                COLOCATED_SYSTEMS[name].label,
                *cells,
                end_section=j == len(systems) - 1,
            )
    console.print(table)

    goodput = {name: crossing(rates, curves[name]["both"]) for name in systems}
    summary: dict[str, object] = {"goodput_both_req_s": goodput}
    for name in systems:
        g = goodput[name]
        console.print(
            f"goodput under both targets ({TARGET:.0%}), {COLOCATED_SYSTEMS[name].label}: "
            + (
                "below the lowest rate"
                if g is None
                else f"≥ {g:g} req/s (the highest rate run)"
                if g == rates[-1] and curves[name]["both"][-1] >= TARGET
                else f"{g:.2f} req/s"
            )
            + f"; per-gap TBT attainment {min(curves[name]['gap']):.1%}–"
            f"{max(curves[name]['gap']):.1%}; decode-aware parks {int(sum(curves[name]['parks']))}"
        )
    if "vllm-cp2k" in systems:
        base = curves["vllm-cp2k"]
        for name in systems:
            if name == "vllm-cp2k":
                continue
            ratios = [
                (rate, fp / vl)
                for rate, fp, vl in zip(rates, curves[name]["tbt"], base["tbt"], strict=True)
                if vl > 0
            ]
            best = max(ratios, key=lambda x: x[1]) if ratios else None
            g, gb = goodput[name], goodput["vllm-cp2k"]
            line = f"{COLOCATED_SYSTEMS[name].label} / vLLM-CP2K: TBT attainment ratio " + (
                f"up to {best[1]:.2f}× (at {best[0]:g} req/s)" if best else "n/a"
            )
            line += f" — paper: up to {PAPER_TBT_RATIO}×"
            if g is not None and gb is not None:
                line += f"; goodput (both) {g / gb:.2f}×"
            console.print(line)
            ttft_ge = all(a >= b for a, b in zip(curves[name]["ttft"], base["ttft"], strict=True))
            console.print(f"  TTFT attainment ≥ vLLM-CP2K's at every rate: {ttft_ge}")
            summary[f"{name}_tbt_ratio_max"] = best
            summary[f"{name}_ttft_ge_at_every_rate"] = ttft_ge
    console.print(f"[dim]paper: {PAPER_TBT}[/dim]")
    console.print(f"[dim]{wall_s:.1f} s; results in {out}[/dim]")
    doc = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "rates": rates,
        "curves": curves,
        "summary": summary,
        "decode_step_ms_b1_ctx1k": decode.step_s([1024]) * 1e3,
        "wall_s": wall_s,
    }
    (out / "result.json").write_text(json.dumps(doc, indent=2))
    if not args.no_plots:
        plot(out / "fig16_colocated.png", rates, curves)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
