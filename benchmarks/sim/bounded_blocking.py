"""Bounded blocking: FlowPrefill with run-time operator splitting, bound by bound.

    python benchmarks/sim/bounded_blocking.py [--bounds 1,2,3,4,6,8,none] [--out DIR]

Operator-level preemption blocks an urgent arrival for the rest of the operator in
flight, and one operator of a long prompt is long (attention of a 32K prompt: 47 ms per
layer on the A100 model). The engine splits operators predicted longer than
``max_blocking_ms`` (default 4 ms) into pieces with a checkpoint between them; the
simulator models it (flowprefill/lab/sim/split.py, docs/simulator.md "Bounded blocking").
This benchmark runs FlowPrefill (Llama-3-8B, A100 model) at each bound on two workloads:

* ``paper`` — ``flowprefill simulate --systems paper``'s QwenTrace-like workload,
  ``--num-requests`` (800) requests of each of ``--seeds`` (1);
* ``long`` — prompts up to 32K tokens: 70 % Table 1 text prompts (250 ms SLO) and 30 %
  file prompts uniform in [16K, 32K] tokens (6 s SLO), Poisson arrivals, same size and
  seed (written to ``long.jsonl`` in ``--out`` and replayed as a trace).

For each bound: goodput (bisection to ``--tolerance``, default 0.5 %), blocking mean /
max at the sweep's reference rate (25 % of the work-conserving bound) and at the
unsplit run's goodput, the checkpoints splitting added per request, and the solo
prefill time it adds. Prints a table, writes ``result.json`` and ``bounded_blocking.png``
to ``--out`` (default runs/bench-bounded-blocking-<time>).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from flowprefill.bench.workload import QWEN_TYPES
from flowprefill.lab.sim.cli import max_blocking_ms
from flowprefill.lab.sim.config import CostSpec, SweepConfig, WorkloadSpec
from flowprefill.lab.sim.search import highest_passing
from flowprefill.lab.sim.split import TilePlan
from flowprefill.lab.sim.sweep import Evaluator
from flowprefill.lab.sim.systems import get_system

SYSTEM = "flowprefill"
PAPER_MAX_MS = 4.5
"""Paper §6.4: "all observed latencies remaining below 4.5 ms"."""
GOODPUT_WITHIN = 0.01
"""The issue's goal: goodput within 1 % of unsplit FlowPrefill."""
LONG_SHARE = 0.3
LONG_TOKENS = (16384, 32768)


@dataclass
class Row:
    workload: str
    arm: str
    bound_ms: float | None
    overhead_us: float | None
    tile_plan: str
    goodput_rps: float
    ref_rate_rps: float
    blocking_mean_ms: float
    blocking_max_ms: float
    num_preemptions: int
    hi_rate_rps: float
    hi_blocking_mean_ms: float
    hi_blocking_max_ms: float
    hi_num_preemptions: int
    added_checkpoints_per_request: float
    solo_added_pct: float
    """Device time splitting adds over the workload's prompts, each run alone."""
    solo_32k_added_pct: float
    max_piece_ms: float
    """Longest stretch between two checkpoints inside the layers, over the workload's
    prompts run alone."""
    max_prologue_ms: float
    prologue_tokens: int
    """From a pass's start to its first checkpoint — per-pass overhead + embedding, plus
    the first qkv segment when it is not split (a split operator begins with a
    checkpoint) — worst over the workload's prompts, and that prompt's length: the wait
    of a preempt signalled just as such a pass starts."""


def write_long_trace(path: Path, num_requests: int, seed: int) -> None:
    """70 % Table 1 text prompts, 30 % uniform in [16K, 32K]; Poisson at 1 req/s."""
    rng = np.random.default_rng(seed)
    text = next(t for t in QWEN_TYPES if t.name == "text")
    shape = (text.mean / text.std) ** 2
    long = rng.random(num_requests) < LONG_SHARE
    lengths = np.where(
        long,
        rng.integers(LONG_TOKENS[0], LONG_TOKENS[1] + 1, num_requests),
        np.clip(np.rint(rng.gamma(shape, text.mean / shape, num_requests)), 16, None),
    )
    times = np.cumsum(rng.exponential(1.0, num_requests))
    with path.open("w") as f:
        for t, n, is_long in zip(times, lengths, long, strict=True):
            row = {
                "timestamp": float(t),
                "input_length": int(n),
                "output_length": 1,
                "type": "file" if is_long else "text",
            }
            f.write(json.dumps(row) + "\n")


def workload_spec(name: str, args: argparse.Namespace, out: Path) -> WorkloadSpec:
    if name == "paper":
        return WorkloadSpec(num_requests=args.num_requests, seeds=args.seeds)
    return WorkloadSpec(kind="trace", trace=str(out / "long.jsonl"))


@dataclass(frozen=True)
class Arm:
    bound_ms: float | None
    overhead_us: float | None = None
    """Per added checkpoint; None: the cost model's default (10 µs)."""
    tile_plan: TilePlan = "profiled"
    """How split GEMMs are tiled (flowprefill/prefill/executor/tiling.py)."""

    @property
    def label(self) -> str:
        text = "none" if self.bound_ms is None else f"{self.bound_ms:g} ms"
        if self.overhead_us is not None:
            text += f", {self.overhead_us:g} µs/checkpoint"
        if self.tile_plan != "profiled" and self.bound_ms is not None:
            text += f", {self.tile_plan} tiles"
        return text


def config(workload: WorkloadSpec, arm: Arm, tol: float) -> SweepConfig:
    overhead = None if arm.overhead_us is None else arm.overhead_us / 1e6
    return SweepConfig(
        cost=CostSpec(split_overhead_s=overhead, tile_plan=arm.tile_plan),
        workload=workload,
        systems=(SYSTEM,),
        rel_tol=tol,
        max_blocking_ms="off" if arm.bound_ms is None else arm.bound_ms,
        oracles=False,
        jobs=1,
    )


def goodput_job(job: tuple[SweepConfig, Arm]) -> float:
    cfg, _arm = job
    ev = Evaluator(cfg)
    spec = get_system(SYSTEM)
    return highest_passing(
        lambda r: ev.passes(spec, r, 1.0), guess=ev.bound_rps() / 4, rel_tol=cfg.rel_tol
    )


def detail_job(job: tuple[str, SweepConfig, Arm, float, float]) -> Row:
    name, cfg, arm, goodput, hi_rate = job
    return _detail(name, cfg, arm, goodput, hi_rate)


def _detail(name: str, cfg: SweepConfig, arm: Arm, goodput: float, hi_rate: float) -> Row:
    """Blocking at two rates, added checkpoints, solo time added."""
    ev = Evaluator(cfg)
    spec = get_system(SYSTEM)
    ref = ev.run(spec, ev.reference_rate(), 1.0)
    hi = ev.run(spec, hi_rate, 1.0)
    cost, bound = ev.cost, cfg.max_blocking_s
    lengths = [n for w in ev.workloads for n in w.num_tokens]

    def solo_s(n: int, split: bool) -> float:
        seg = [(n, 0)]
        return (
            cost.split_pass_cost(seg, bound) if split and bound else cost.pass_cost(seg)
        ).total_s

    whole = sum(solo_s(n, False) for n in lengths)
    split = sum(solo_s(n, True) for n in lengths)
    p32 = cost.split_pass_cost([(32768, 0)], bound) if bound else cost.pass_cost([(32768, 0)])
    pieces, prologue = 0.0, (0.0, 0)
    for n in sorted(set(lengths)):
        pc = cost.split_pass_cost([(n, 0)], bound) if bound else cost.pass_cost([(n, 0)])
        pieces = max(pieces, max(pc.op_s))
        prologue = max(prologue, (pc.pre_s + pc.op_s[0], n))
    return Row(
        workload=name,
        arm=arm.label,
        bound_ms=arm.bound_ms,
        overhead_us=arm.overhead_us,
        tile_plan=arm.tile_plan,
        goodput_rps=goodput,
        ref_rate_rps=ev.reference_rate(),
        blocking_mean_ms=ref.blocking_mean_ms,
        blocking_max_ms=ref.blocking_max_ms,
        num_preemptions=ref.num_preemptions,
        hi_rate_rps=hi_rate,
        hi_blocking_mean_ms=hi.blocking_mean_ms,
        hi_blocking_max_ms=hi.blocking_max_ms,
        hi_num_preemptions=hi.num_preemptions,
        added_checkpoints_per_request=ref.num_added_checkpoints / ev.num_requests,
        solo_added_pct=100 * (split / whole - 1),
        solo_32k_added_pct=100 * (p32.total_s / solo_s(32768, False) - 1),
        max_piece_ms=1e3 * pieces,
        max_prologue_ms=1e3 * prologue[0],
        prologue_tokens=prologue[1],
    )


def parse_bounds(text: str) -> list[float | None]:
    bounds = [max_blocking_ms(x) for x in text.split(",") if x.strip()]
    return [None if b == "off" else float(b) for b in bounds]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--bounds", type=parse_bounds, default=parse_bounds("1,2,3,4,6,8,none"))
    ap.add_argument("--num-requests", type=int, default=800)
    ap.add_argument(
        "--seeds",
        type=lambda t: tuple(int(x) for x in t.split(",")),
        default=(1,),
        help="workload seeds, pooled (the long trace has num-requests × seeds requests, "
        "drawn with the first seed)",
    )
    ap.add_argument("--tolerance", type=float, default=0.005, help="goodput bisection, relative")
    ap.add_argument(
        "--sensitivity-us",
        type=float,
        default=50.0,
        help="also run the 4 ms bound with this cost per added checkpoint (0: skip)",
    )
    ap.add_argument(
        "--no-equal-tiles",
        action="store_true",
        help="skip the 4 ms arm with equal GEMM tiles (the engine's plan without a profile)",
    )
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    out = Path(args.out or f"runs/bench-bounded-blocking-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    write_long_trace(out / "long.jsonl", args.num_requests * len(args.seeds), args.seeds[0])
    console = Console() if Console().is_terminal else Console(width=160)
    start = time.perf_counter()

    unsplit = Arm(None)
    arms = [Arm(b) for b in args.bounds]
    if unsplit not in arms:
        arms.append(unsplit)  # the reference is always needed
    if args.sensitivity_us > 0:
        arms.append(Arm(4.0, overhead_us=args.sensitivity_us))
    if not args.no_equal_tiles:
        arms.append(Arm(4.0, tile_plan="equal"))
    workloads = ("paper", "long")
    keys = [(w, arm) for w in workloads for arm in arms]
    cfgs = {(w, arm): config(workload_spec(w, args, out), arm, args.tolerance) for w, arm in keys}
    with ProcessPoolExecutor(args.jobs) as pool:
        goodput_jobs = [(cfgs[k], k[1]) for k in keys]
        found = tqdm(pool.map(goodput_job, goodput_jobs), total=len(keys), desc="goodput")
        goodputs = dict(zip(keys, found, strict=True))
        jobs = [(w, cfgs[(w, arm)], arm, goodputs[(w, arm)], goodputs[(w, unsplit)])
                for w, arm in keys]  # fmt: skip
        rows: list[Row] = list(
            tqdm(pool.map(detail_job, jobs), total=len(jobs), desc="blocking", unit="arm")
        )
    wall_s = time.perf_counter() - start

    for w in workloads:
        base = next(r for r in rows if r.workload == w and r.arm == unsplit.label)
        table = Table(
            title=f"FlowPrefill, Llama-3-8B/A100 model, workload {w!r} ({args.num_requests} "
            f"requests × seeds {args.seeds}); blocking at {base.ref_rate_rps:.2f} req/s "
            f"(25 % of the bound) and at {base.hi_rate_rps:.2f} req/s (unsplit goodput)"
        )
        for col in (
            "max_blocking_ms",
            "goodput req/s",
            "vs unsplit",
            "blocking ms mean / max",
            "at goodput: mean / max",
            "preemptions",
            "added checkpoints / request",
            "solo time added",
            "longest piece ms",
            "longest prologue ms (tokens)",
            "32K time added",
        ):
            table.add_column(col, justify="left" if col == "max_blocking_ms" else "right")
        for r in (r for r in rows if r.workload == w):
            rel = r.goodput_rps / base.goodput_rps - 1
            ok = r.blocking_max_ms <= PAPER_MAX_MS and r.hi_blocking_max_ms <= PAPER_MAX_MS
            table.add_row(
                r.arm,
                f"{r.goodput_rps:.3f}",
                f"{100 * rel:+.1f} %" if r is not base else "—",
                f"{r.blocking_mean_ms:.2f} / {r.blocking_max_ms:.2f}",
                f"{r.hi_blocking_mean_ms:.2f} / [{'green' if ok else 'red'}]"
                f"{r.hi_blocking_max_ms:.2f}[/]",
                f"{r.num_preemptions} / {r.hi_num_preemptions}",
                f"{r.added_checkpoints_per_request:.0f}",
                f"{r.solo_added_pct:+.2f} %",
                f"{r.max_piece_ms:.2f}",
                f"{r.max_prologue_ms:.2f} ({r.prologue_tokens})",
                f"{r.solo_32k_added_pct:+.2f} %",
            )
        console.print(table)

    verdicts = []
    for w in workloads:
        base = next(r for r in rows if r.workload == w and r.arm == unsplit.label)
        default = next((r for r in rows if r.workload == w and r.arm == Arm(4.0).label), None)
        if default is None:
            continue
        worst = max(default.blocking_max_ms, default.hi_blocking_max_ms)
        rel = default.goodput_rps / base.goodput_rps - 1
        within = "within" if rel >= -GOODPUT_WITHIN else "outside"
        verdicts.append(
            f"{w}: default 4 ms → max blocking {worst:.2f} ms "
            f"({'≤' if worst <= PAPER_MAX_MS else '>'} {PAPER_MAX_MS} ms), goodput "
            f"{100 * rel:+.1f} % vs unsplit ({within} 1 %; bisection tolerance "
            f"{100 * args.tolerance:g} %)"
        )
    for v in verdicts:
        console.print(v)
    console.print(f"wall time {wall_s:.0f} s (2-core box, shared)")
    summary = {
        "command": " ".join(sys.argv),
        "rows": [asdict(r) for r in rows],
        "verdicts": verdicts,
        "wall_s": wall_s,
    }
    (out / "result.json").write_text(json.dumps(summary, indent=2))
    if not args.no_plot:
        plot(rows, out / "bounded_blocking.png")
    console.print(f"wrote {out / 'result.json'}" + ("" if args.no_plot else " and the figure"))
    return 0


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    finite = [r.bound_ms for r in rows if r.bound_ms is not None]
    none_x = 1.5 * max(finite) if finite else 1.0
    for w, marker in (("paper", "o"), ("long", "s")):
        sel = sorted(
            (
                r
                for r in rows
                if r.workload == w and r.overhead_us is None and r.tile_plan == "profiled"
            ),
            key=lambda r: none_x if r.bound_ms is None else r.bound_ms,
        )
        xs = [none_x if r.bound_ms is None else r.bound_ms for r in sel]
        base = next(r for r in sel if r.bound_ms is None)
        ax1.plot(xs, [max(r.blocking_max_ms, r.hi_blocking_max_ms) for r in sel], marker,
                 linestyle="-", label=f"{w}: max")  # fmt: skip
        ax1.plot(xs, [r.hi_blocking_mean_ms for r in sel], marker, linestyle="--",
                 label=f"{w}: mean (at goodput)")  # fmt: skip
        ax2.plot(xs, [100 * (r.goodput_rps / base.goodput_rps - 1) for r in sel], marker,
                 linestyle="-", label=w)  # fmt: skip
    ax1.axhline(PAPER_MAX_MS, color="grey", linestyle=":", label="paper: < 4.5 ms")
    ax1.set_yscale("log")
    ax1.set_ylabel("blocking ms")
    ax2.axhspan(-100 * GOODPUT_WITHIN, 100 * GOODPUT_WITHIN, color="0.9", label="±1 %")
    ax2.set_ylabel("goodput vs unsplit, %")
    for ax in (ax1, ax2):
        ticks = [*sorted(set(finite)), none_x]
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks[:-1]] + ["none"])
        ax.set_xlabel("max_blocking_ms (split bound)")
        ax.legend(fontsize=8)
    fig.suptitle("FlowPrefill with run-time operator splitting (Llama-3-8B, A100 model)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
