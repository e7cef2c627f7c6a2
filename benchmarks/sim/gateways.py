"""Gateway replicas: what routing with each replica's partial view costs.

    python benchmarks/sim/gateways.py [--num-requests 2000] [--instances 4] [--seed 0]

Llama-3-8B/A100 FlowPrefill instances (``--instances`` of them), QwenTrace-like workload
(Poisson), the same arrivals at the same rate for 1, 2 and 4 gateway replicas in front of
them (:class:`flowprefill.lab.sim.gateways.Replicas`: each replica routes with its own
in-flight book; a load balancer splits the requests round-robin, or at random). Rates are
fractions of the instances' work-conserving bound (the rate at which the cheapest 90 % of
the requests' ideal prefill work fills every device). Printed per routing policy and rate:
attainment (first token within the TTFT SLO) and goodput (such requests per second of
arrivals) for each number of gateways, and the loss against one gateway in points.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flowprefill.lab.sim.config import SweepConfig, WorkloadSpec
from flowprefill.lab.sim.gateways import SPLITS, Split, run_replicated
from flowprefill.lab.sim.sweep import evaluator
from flowprefill.lab.sim.systems import get_system

ROUTERS = ("slack-aware", "least-loaded", "round-robin")
LOADS = (0.7, 0.85, 1.0)
GATEWAYS = (1, 2, 4)

Job = tuple[SweepConfig, str, float, int, Split]
Row = tuple[str, float, int, float, float, float]
"""router, load, gateways, rate req/s, attainment, goodput req/s."""


def run_one(job: Job) -> Row:
    cfg, router, load, gateways, split = job
    ev = evaluator(cfg)
    spec = get_system("flowprefill")
    rate = load * ev.bound_rps()
    met = total = 0
    span_s = 0.0
    for w in ev.workloads:
        res = run_replicated(
            spec,
            w,
            ev.cost,
            rate=rate,
            gateways=gateways,
            num_instances=cfg.instances,
            router=router,
            split=split,
            predictor=ev.predictor_for(spec),
            max_blocking_s=cfg.max_blocking_s,
        )
        met += res.num_met
        total += res.num_requests
        span_s += w.arrival_s[-1] * w.base_rate / rate
    return (router, load, gateways, rate, met / total, met / span_s if span_s > 0 else 0.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=2000)
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--split", choices=SPLITS, default="round-robin")
    ap.add_argument("--routers", nargs="+", default=list(ROUTERS), choices=ROUTERS)
    ap.add_argument("--loads", type=float, nargs="+", default=list(LOADS))
    ap.add_argument("--gateways", type=int, nargs="+", default=list(GATEWAYS))
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args(argv)
    cfg = SweepConfig(
        workload=WorkloadSpec(num_requests=args.num_requests, seeds=(args.seed,)),
        instances=args.instances,
    )
    console = Console(width=max(Console().width, 140))
    t0 = time.perf_counter()
    jobs: list[Job] = [
        (cfg, router, load, g, args.split)
        for router in args.routers
        for load in args.loads
        for g in sorted(set(args.gateways))
    ]
    rows: dict[tuple[str, float, int], Row] = {}
    with ProcessPoolExecutor(args.jobs) as pool:
        for row in pool.map(run_one, jobs):
            rows[row[:3]] = row
            console.print(
                f"[{len(rows)}/{len(jobs)}] {row[0]} at {row[1]:g}× with {row[2]} gateway(s): "
                f"{100 * row[4]:.1f} % ({time.perf_counter() - t0:.0f} s)"
            )
    gateways = sorted(set(args.gateways))
    t = Table(
        title=f"Routing with {', '.join(map(str, gateways))} gateway replicas in front of "
        f"{args.instances} FlowPrefill instances ({args.split} split; {args.num_requests} "
        f"requests, seed {args.seed}; load × work-conserving bound)"
    )
    for col in ("router", "load", "rate req/s"):
        t.add_column(col)
    for g in gateways:
        t.add_column(f"{g} gw attainment", justify="right")
        t.add_column(f"{g} gw goodput req/s", justify="right")
    t.add_column("worst loss vs 1 gw (points)", justify="right")
    for router in args.routers:
        for load in args.loads:
            cells = [rows[(router, load, g)] for g in gateways]
            first = cells[0][4]
            t.add_row(
                router,
                f"{load:g}×",
                f"{cells[0][3]:.2f}",
                *[x for c in cells for x in (f"{100 * c[4]:.1f} %", f"{c[5]:.2f}")],
                f"{100 * max(first - c[4] for c in cells):.1f}",
            )
    console.print(t)
    console.print(f"total {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
