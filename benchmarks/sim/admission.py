"""Admission under overload: what refusing a sheddable class early buys the others.

    python benchmarks/sim/admission.py [--num-requests 2500] [--seed 0] [--sheddable file]

Llama-3-8B/A100, QwenTrace-like workload (Poisson), one prefill instance. The classes
named by ``--sheddable`` get a negative priority (the SLOClass convention); the others keep
the paper's. First the saturation rate — the highest rate at which FlowPrefill without
admission meets 90 % of all requests (bisection to 2 %) — then, at multiples of it, each
system's goodput of the non-sheddable classes (their requests that met their TTFT SLO,
per second of arrivals), their attainment, and what happened to the sheddable class:

* ``flowprefill`` — no admission (the paper);
* ``fp-shed`` — refuse a sheddable request predicted late even on an idle device;
* ``fp-shed-queue`` — refuse a sheddable request predicted late behind the work queued
  ahead of it: the gateway's decision (:func:`flowprefill.gateway.admission.decide`).
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ProcessPoolExecutor

from rich.console import Console
from rich.table import Table

from flowprefill.contracts.slo import PAPER_PRIORITIES
from flowprefill.lab.sim.config import SweepConfig, WorkloadSpec
from flowprefill.lab.sim.search import highest_passing
from flowprefill.lab.sim.sweep import evaluator
from flowprefill.lab.sim.systems import get_system, run_system

SYSTEMS = ("flowprefill", "fp-shed", "fp-shed-queue")
LOADS = (1.0, 1.25, 1.5, 2.0, 3.0)
"""Request rates as multiples of FlowPrefill's saturation rate."""

Row = tuple[str, float, float, float, int, int, int, int]
"""system, load, non-sheddable goodput (req/s), their attainment, sheddable met, shed,
sheddable total, non-sheddable total."""


def _config(args: argparse.Namespace) -> SweepConfig:
    return SweepConfig(workload=WorkloadSpec(num_requests=args.num_requests, seeds=(args.seed,)))


def saturation_rps(cfg: SweepConfig) -> float:
    ev = evaluator(cfg)
    spec = get_system("flowprefill")
    return highest_passing(lambda r: ev.passes(spec, r, 1.0), guess=ev.bound_rps() / 2)


def run_one(job: tuple[SweepConfig, str, float, float, tuple[str, ...]]) -> Row:
    cfg, name, load, base_rps, sheddable = job
    ev = evaluator(cfg)
    spec = get_system(name)
    priorities = {**PAPER_PRIORITIES, **{c: -10 for c in sheddable}}
    rate = load * base_rps
    met_keep = total_keep = met_shed = total_shed = shed = 0
    span_s = 0.0
    for w in ev.workloads:
        res = run_system(
            spec,
            w,
            ev.cost,
            rate=rate,
            predictor=ev.predictor_for(spec),
            max_blocking_s=cfg.max_blocking_s,
            priorities=priorities,
        )
        shed += res.num_shed
        span_s += w.arrival_s[-1] * w.base_rate / rate
        for c, (m, t) in res.per_class.items():
            if c in sheddable:
                met_shed, total_shed = met_shed + m, total_shed + t
            else:
                met_keep, total_keep = met_keep + m, total_keep + t
    goodput = met_keep / span_s if span_s > 0 else 0.0
    attainment = met_keep / total_keep if total_keep else 0.0
    return (name, load, goodput, attainment, met_shed, shed, total_shed, total_keep)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=2500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sheddable", default="file", help="comma-separated task types made sheddable")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    sheddable = tuple(c.strip() for c in args.sheddable.split(",") if c.strip())
    unknown = sorted(set(sheddable) - set(PAPER_PRIORITIES))
    if unknown:
        ap.error(f"--sheddable: unknown task type {unknown[0]!r}; one of {list(PAPER_PRIORITIES)}")
    console = Console(width=140)
    t0 = time.perf_counter()
    cfg = _config(args)
    console.print(
        f"[saturation] bisecting FlowPrefill's 90 % rate on {args.num_requests} requests…"
    )
    base = saturation_rps(cfg)
    console.print(f"[saturation] {base:.2f} req/s ({time.perf_counter() - t0:.0f} s)")
    jobs = [(cfg, name, load, base, sheddable) for load in LOADS for name in SYSTEMS]
    rows: list[Row] = []
    with ProcessPoolExecutor(args.jobs) as pool:
        for row in pool.map(run_one, jobs):
            rows.append(row)
            console.print(
                f"[{len(rows)}/{len(jobs)}] {row[0]} at {row[1]:g}x: "
                f"{row[2]:.2f} req/s non-sheddable ({time.perf_counter() - t0:.0f} s)"
            )
    table = Table(
        title=f"Non-sheddable goodput under overload (sheddable: {', '.join(sheddable)}; "
        f"saturation {base:.2f} req/s; {args.num_requests} requests, seed {args.seed})"
    )
    for col in (
        "load",
        "rate req/s",
        "system",
        "non-sheddable goodput req/s",
        "vs no admission",
        "non-sheddable attainment",
        "sheddable met / shed / total",
    ):
        table.add_column(col)
    plain = {row[1]: row[2] for row in rows if row[0] == "flowprefill"}
    for name, load, goodput, att, met_s, shed, tot_s, _ in rows:
        table.add_row(
            f"{load:g}x",
            f"{load * base:.2f}",
            name,
            f"{goodput:.2f}",
            f"{goodput / plain[load]:.2f}×" if plain[load] > 0 else "—",
            f"{100 * att:.1f} %",
            f"{met_s} / {shed} / {tot_s}",
        )
    console.print(table)
    console.print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
