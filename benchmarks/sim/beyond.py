"""Beyond the paper: how far FlowPrefill is from its limits, and what closes the gap.

    python benchmarks/sim/beyond.py [--num-requests 3000] [--seeds 0]

For Llama-3-8B/A100 on the QwenTrace-like workload (Poisson, and bursty gamma CV=2):

* goodput of FlowPrefill, its oracle (instant, free preemption, same policy) and the
  work-conserving bound;
* the named policies that try to close the distance: ``fp-plus`` (member-headroom
  batching), ``fp-headroom`` (batches keep half the leader's slack free), ``fp-member``
  (member-aware batching), ``fp-shed`` / ``fp-shed-queue`` (gateway admission), and
  ``fp-nobatch`` for reference; plus goodput and saturated throughput on the single-SLO
  ShareGPT-like workload;
* FlowPrefill and ``fp-plus`` as the earlier engine ran them, with the running task's
  progress refreshed only when it parks (``--no-live-progress``; the engine now refreshes
  it every round, which every other row does);
* routing over 2 prefill instances: round-robin vs least-loaded vs slack-aware (the
  gateway's routers).
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ProcessPoolExecutor

from rich.console import Console
from rich.table import Table

from flowprefill.lab.sim.config import SweepConfig, WorkloadSpec
from flowprefill.lab.sim.search import highest_passing
from flowprefill.lab.sim.sweep import evaluator
from flowprefill.lab.sim.systems import get_system

POLICIES = (
    "flowprefill",
    "fp-plus",
    "fp-headroom",
    "fp-member",
    "fp-shed",
    "fp-shed-queue",
    "fp-nobatch",
)
ROUTERS = ("round-robin", "least-loaded", "slack-aware")
SINGLE = ("distserve-cp2k", "flowprefill", "fp-plus", "fp-nobatch", "fp-member", "fp-headroom")
"""Systems compared on the single-SLO ShareGPT-like workload."""
EARLIER = ("flowprefill", "fp-plus")
"""Run again as the earlier engine did: running task's progress refreshed only at preemption."""


def goodput(job: tuple[SweepConfig, str, bool]) -> tuple[float, float]:
    """(goodput, bound) of one system; with ``oracle`` its instant-preemption oracle."""
    cfg, name, oracle = job
    ev = evaluator(cfg)
    spec = get_system(name)
    if oracle:
        spec = spec.oracle()
    g = highest_passing(
        lambda r: ev.passes(spec, r, 1.0), guess=ev.bound_rps() / 2, rel_tol=cfg.rel_tol
    )
    return g, ev.bound_rps()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=2500)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    seeds = tuple(int(s) for s in args.seeds.split(","))
    console = Console(width=150)
    t0 = time.perf_counter()

    jobs: list[tuple[SweepConfig, str, bool]] = []
    for arrival in ("poisson", "gamma"):
        cfg = SweepConfig(
            workload=WorkloadSpec(num_requests=args.num_requests, seeds=seeds, arrival=arrival)
        )
        jobs.append((cfg, "flowprefill", True))
        jobs.extend((cfg, name, False) for name in POLICIES)
        earlier = cfg.model_copy(update={"live_progress": False})
        jobs.extend((earlier, name, False) for name in EARLIER)
    for router in ROUTERS:
        cfg = SweepConfig(
            workload=WorkloadSpec(num_requests=args.num_requests, seeds=seeds),
            instances=2,
            router=router,
        )
        jobs.extend((cfg, name, False) for name in ("flowprefill", "fp-plus"))
    single_cfg = SweepConfig(
        workload=WorkloadSpec(kind="sharegpt", num_requests=args.num_requests, seeds=seeds)
    )
    jobs.extend((single_cfg, name, False) for name in SINGLE)
    with ProcessPoolExecutor(args.jobs) as pool:
        results = list(pool.map(goodput, jobs))

    table = Table(title="Distance to the limits (1 instance, Llama-3-8B/A100, QwenTrace-like)")
    for col in (
        "arrivals",
        "system",
        "goodput req/s",
        "vs FlowPrefill",
        "% of oracle",
        "% of bound",
    ):
        table.add_column(col)
    i = 0
    for arrival in ("poisson", "gamma CV=2"):
        (oracle, bound) = results[i]
        base = results[i + 1][0]
        table.add_row(
            arrival, "FlowPrefill oracle", f"{oracle:.2f}", "", "100", f"{100 * oracle / bound:.0f}"
        )
        for k, name in enumerate(POLICIES):
            g, _ = results[i + 1 + k]
            table.add_row(
                arrival,
                name,
                f"{g:.2f}",
                f"{g / base:.2f}×",
                f"{100 * g / oracle:.0f}",
                f"{100 * g / bound:.0f}",
            )
        for k, name in enumerate(EARLIER):
            g, _ = results[i + 1 + len(POLICIES) + k]
            table.add_row(
                arrival,
                f"{name}, earlier engine (--no-live-progress)",
                f"{g:.2f}",
                f"{g / base:.2f}×",
                f"{100 * g / oracle:.0f}",
                f"{100 * g / bound:.0f}",
            )
        table.add_row(arrival, "work-conserving bound", f"{bound:.2f}", "", "", "100")
        i += 1 + len(POLICIES) + len(EARLIER)
    console.print(table)

    routing = Table(title="Routing over 2 prefill instances (total goodput, req/s)")
    routing.add_column("router")
    for name in ("flowprefill", "fp-plus"):
        routing.add_column(name, justify="right")
    for router in ROUTERS:
        a, b = results[i][0], results[i + 1][0]
        routing.add_row(router, f"{a:.2f}", f"{b:.2f}")
        i += 2
    console.print(routing)

    single = evaluator(single_cfg)
    sat = Table(title="Single-SLO ShareGPT-like: goodput and saturated throughput (paper Fig. 14)")
    sat.add_column("system")
    sat.add_column("goodput req/s", justify="right")
    sat.add_column("saturated ktok/s", justify="right")
    for k, name in enumerate(SINGLE):
        tput = single.saturation_tokens_per_s(get_system(name))
        sat.add_row(name, f"{results[i + k][0]:.2f}", f"{tput / 1e3:.2f}")
    console.print(sat)
    console.print(f"wall time {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
