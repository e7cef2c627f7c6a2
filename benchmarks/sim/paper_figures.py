"""The paper's headline figures from the simulator: Llama-3-8B on A100, QwenTrace-like.

    python benchmarks/sim/paper_figures.py [--num-requests 3000] [--seeds 0] [--out DIR]

Runs the full comparison sweep (every system, oracles, bound; the same as
``flowprefill simulate``) and the single-SLO overhead check (paper Figure 14), then prints
our ratios beside the paper's with a note where they differ. Writes ``result.json``,
``single_slo.json`` and the figures to ``--out`` (default runs/bench-sim-<time>).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from flowprefill.lab.sim.config import SweepConfig, WorkloadSpec
from flowprefill.lab.sim.plots import write_plots
from flowprefill.lab.sim.report import paper_comparison, print_report, write_json
from flowprefill.lab.sim.sweep import run_sweep

WHY = {
    "goodput FlowPrefill / DistServe FCFS": (
        "FCFS goodput is the low end of the scale and hinges on arrival burstiness: with "
        "Poisson arrivals FCFS sustains 1.5 req/s, with gamma CV=2 arrivals only 0.21 "
        "(FlowPrefill 7.4: 35×); QwenTrace's real arrivals lie between, and single "
        "3000-request workloads move FCFS goodput by ±9 %"
    ),
    "goodput FlowPrefill / DistServe-CP8K": (
        "an 8K chunk of Llama-3-8B costs ≈ 0.6 s on the vidur A100 profile, more than twice "
        "the text SLO, so CP8K behaves almost like FCFS for text; the paper's measured system "
        "also mixes chunks of several requests per iteration, which we do not model"
    ),
    "tighter SLO vs CP8K (scale CP8K / FlowPrefill)": (
        "same cause: CP8K's blocking (mean ≈ 0.30 s) must fit inside the scaled text SLO"
    ),
    "operator-level blocking, max (ms)": (
        "the longest operator is gate_up_proj or attention of the longest prompt: 17 ms at "
        "16K, 35–47 ms at 32K tokens on A100; the paper's < 4.5 ms is the largest "
        "per-model *average* of Figure 12, not a maximum over preemptions; 8K chunks cut "
        "our max to 14 ms"
    ),
    "operator-level blocking, mean (ms)": (
        "length-biased remaining time of the operator in flight; our attention is FLOP-"
        "modelled at 60 % of peak, which lengthens attention of long prompts a little"
    ),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=2500)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--arrival", choices=("poisson", "gamma"), default="poisson")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = Path(args.out or f"runs/bench-sim-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    console = Console(width=150)
    seeds = tuple(int(s) for s in args.seeds.split(","))

    t0 = time.perf_counter()
    cfg = SweepConfig(
        workload=WorkloadSpec(num_requests=args.num_requests, seeds=seeds, arrival=args.arrival),
        jobs=args.jobs,
    )
    result = run_sweep(cfg)
    print_report(result, console)
    write_json(result, out / "result.json")
    write_plots(result, out)

    notes = Table(title="Where our ratios differ from the paper's, and why")
    notes.add_column("figure")
    notes.add_column("ours", justify="right")
    notes.add_column("paper", justify="right")
    notes.add_column("why")
    for f in paper_comparison(result):
        ours = "—" if f.ours is None else f"{f.ours:.2f}"
        why = "within the paper's range" if f.verdict == "in range" else WHY.get(f.label, "")
        notes.add_row(f.label, ours, f"{f.paper} ({f.verdict})", why)
    console.print(notes)

    # Paper Figure 14: single-SLO (chat only, < 2K tokens) — preemption checks cost nothing.
    single = SweepConfig(
        workload=WorkloadSpec(kind="sharegpt", num_requests=args.num_requests, seeds=seeds),
        systems=("distserve-cp2k", "flowprefill", "fp-plus"),
        oracles=False,
        jobs=args.jobs,
    )
    res1 = run_sweep(single)
    by = res1.by_name()
    cp2k, fp = by["distserve-cp2k"], by["flowprefill"]
    table = Table(title="Single-SLO ShareGPT-like workload (paper Figure 14: equal throughput)")
    for col in ("system", "goodput req/s", "saturated ktok/s"):
        table.add_column(col)
    for o in res1.systems:
        table.add_row(o.label, f"{o.goodput_rps:.2f}", f"{o.saturation_tokens_per_s / 1e3:.2f}")
    console.print(table)
    ratio = fp.saturation_tokens_per_s / cp2k.saturation_tokens_per_s
    console.print(f"throughput FlowPrefill / CP2K = {ratio:.3f} (paper: equal)")
    write_json(res1, out / "single_slo.json")
    summary = {
        "paper_comparison": [
            {"figure": f.label, "ours": f.ours, "paper": f.paper, "verdict": f.verdict}
            for f in paper_comparison(result)
        ],
        "single_slo_throughput_ratio": ratio,
        "wall_s": time.perf_counter() - t0,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    console.print(f"total wall time {time.perf_counter() - t0:.0f} s; files in {out}/")


if __name__ == "__main__":
    main()
