"""``flowprefill simulate``: arguments and entry point (registered by flowprefill/cli.py).

Two modes:

* sweep (default) — every system: attainment-vs-rate and -vs-SLO-scale curves, goodput
  and tightest SLO scale by bisection, the oracle and the work-conserving bound; a table
  on the terminal, ``result.json`` and PNG figures in ``--out``.
* ``--rate R`` — one run per system at ``R`` req/s (and ``--slo-scale``): per-class
  attainment, blocking, rounds. ``--compare-measured FILE`` (with ``--profile``) replays an
  engine run and reports the simulator's TTFT error against it.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from rich.console import Console
from rich.table import Table

from flowprefill.contracts.engine import DEFAULT_MAX_BLOCKING_MS, DEFAULT_MAX_BLOCKING_MS_CPU, OFF
from flowprefill.errors import FlowPrefillError, InvalidRequestError
from flowprefill.lab.sim.config import CostSpec, SweepConfig, WorkloadSpec
from flowprefill.lab.sim.cost import TP_CHECK_S
from flowprefill.lab.sim.gateway import ROUTERS
from flowprefill.lab.sim.handoff import DEFAULT_TRANSPORT, TRANSPORTS
from flowprefill.lab.sim.systems import DEFAULT_SYSTEMS, PAPER_SYSTEMS, SYSTEMS


def _floats(flag: str) -> Callable[[str], tuple[float, ...]]:
    def parse(text: str) -> tuple[float, ...]:
        try:
            return tuple(float(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{flag}: expected numbers separated by commas"
            ) from None

    return parse


def _seeds(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError("--seeds: expected integers separated by commas") from None


def max_blocking_ms(text: str) -> float | Literal["off"]:
    """``--max-blocking-ms``: a positive number of ms, or ``none`` / ``off`` / ``0``."""
    if text.strip().lower() in ("none", "off", "0", "0.0"):
        return OFF
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--max-blocking-ms: expected milliseconds or 'none', got {text!r}"
        ) from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"--max-blocking-ms must be positive, got {text}")
    return value


def _systems(text: str) -> tuple[str, ...]:
    names: list[str] = []
    for item in (x.strip().lower() for x in text.split(",") if x.strip()):
        if item == "all":
            names.extend(SYSTEMS)
        elif item == "default":
            names.extend(DEFAULT_SYSTEMS)
        elif item == "paper":
            names.extend(PAPER_SYSTEMS)
        else:
            names.append(item)
    return tuple(dict.fromkeys(names))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    dev = parser.add_argument_group("device")
    dev.add_argument("--model", default="llama3-8b", help="llama3-8b | qwen2.5-14b | llama3-70b")
    dev.add_argument("--gpu", default="a100", help="a100 (measured) | a800 | h100 (scaled)")
    dev.add_argument("--tp", type=int, default=None, help="tensor-parallel degree (1,2,4,8)")
    dev.add_argument("--attn-efficiency", type=float, default=0.6, help="attention efficiency")
    dev.add_argument("--pass-overhead-ms", type=float, default=2.0, help="fixed cost per pass")
    dev.add_argument(
        "--tp-check-us",
        type=float,
        default=TP_CHECK_S * 1e6,
        help="with --tp > 1: µs each preemption checkpoint adds (the ranks' agreement-table "
        "check; measured 1.6 on CPU, benchmarks/prefill/tp_overhead.py)",
    )
    dev.add_argument(
        "--max-blocking-ms",
        type=max_blocking_ms,
        default=None,
        help="run-time operator splitting as the engine's max_blocking_ms: operators "
        "predicted longer run in pieces with a checkpoint between (operator-level systems "
        f"only). Default: the paper's {DEFAULT_MAX_BLOCKING_MS:g} on a GPU (the engine "
        "splits on a GPU only when its max_blocking_ms is set), the engine's "
        f"{DEFAULT_MAX_BLOCKING_MS_CPU:g} with --profile (CPU); none/0 = never split",
    )
    dev.add_argument(
        "--split-overhead-us",
        type=float,
        default=None,
        help="µs each piece added by splitting costs (default 10 on a GPU: a kernel launch "
        "behind the checkpoint's sync; 20 for --profile)",
    )
    dev.add_argument(
        "--tile-plan",
        choices=("profiled", "equal"),
        default="profiled",
        help="how split GEMMs are tiled: profiled = the engine on CUDA (cheapest plan on the "
        "measured times per row count), equal = ceil(t/b) equal tiles (FLOP rate only)",
    )
    dev.add_argument(
        "--calibration",
        default=None,
        metavar="CSV",
        help="operator times measured on --gpu (vidur's CSV format, optional `attention` "
        "column; benchmarks/gpu_validate.py writes one) instead of the A100 profile scaled "
        "by peak FLOP/s",
    )
    dev.add_argument("--profile", default=None, help="a `flowprefill profile` JSON to simulate")
    dev.add_argument("--profile-layers", type=int, default=4, help="layers of the profiled model")
    kv = parser.add_argument_group("KV hand-off and second token")
    kv.add_argument(
        "--transport",
        type=str.lower,
        choices=tuple(TRANSPORTS),
        default=DEFAULT_TRANSPORT,
        help="how the KV reaches decode; each finished request's gap to its second token "
        "(hand-off + one decode step) is judged against its class's TBT SLO. Default: "
        "today's file+http path (docs/simulator.md, 'KV hand-off and the second token')",
    )
    kv.add_argument(
        "--kv-per-rank",
        action="store_true",
        help="with --tp > 1: every rank sends its own KV heads (NIXL) instead of gathering "
        "them to rank 0 first",
    )
    wl = parser.add_argument_group("workload")
    wl.add_argument("--workload", choices=("qwen", "sharegpt", "trace"), default="qwen")
    wl.add_argument("--trace", default=None, help="JSONL or CSV trace to replay")
    wl.add_argument("--num-requests", type=int, default=2500, help="requests per seed")
    wl.add_argument("--seeds", type=_seeds, default=(0, 1), help="comma-separated workload seeds")
    wl.add_argument("--arrival", choices=("poisson", "gamma"), default="poisson")
    wl.add_argument("--burst-cv", type=float, default=2.0, help="gamma arrivals: CV of the gaps")
    sw = parser.add_argument_group("sweep")
    sw.add_argument(
        "--systems",
        type=_systems,
        default=tuple(DEFAULT_SYSTEMS),
        help=f"comma list; 'paper', 'default' or 'all'. Known: {', '.join(SYSTEMS)}",
    )
    sw.add_argument("--target", type=float, default=0.9, help="attainment defining goodput")
    sw.add_argument("--tolerance", type=float, default=0.02, help="relative bisection precision")
    sw.add_argument("--rates", type=_floats("--rates"), default=(), help="rate grid, req/s")
    sw.add_argument("--slo-scales", type=_floats("--slo-scales"), default=None)
    sw.add_argument("--slo-rate", type=float, default=None, help="rate of the SLO-scale sweep")
    sw.add_argument("--no-oracles", action="store_true", help="skip the oracle searches")
    sw.add_argument("--instances", type=int, default=1, help="prefill instances")
    sw.add_argument("--router", default="round-robin", help=f"one of {', '.join(ROUTERS)}")
    sw.add_argument(
        "--live-progress",
        action=argparse.BooleanOptionalAction,
        default=None,  # None: SweepConfig's default, which is the engine's behaviour
        help="refresh the running task's progress every round, as the engine's loop does; "
        "--no-live-progress models the earlier engine that refreshed it only at preemption",
    )
    sw.add_argument("--jobs", type=int, default=2, help="worker processes")
    one = parser.add_argument_group("single run")
    one.add_argument("--rate", type=float, default=None, help="one run per system at this rate")
    one.add_argument("--slo-scale", type=float, default=1.0, help="SLO scale of --rate runs")
    one.add_argument("--compare-measured", default=None, help="engine TTFT records (JSONL)")
    out = parser.add_argument_group("output")
    out.add_argument("--out", default=None, help="folder (default runs/simulate-<time>)")
    out.add_argument("--no-plots", action="store_true")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")


def config_from_args(args: argparse.Namespace) -> SweepConfig:
    if args.pass_overhead_ms < 0:
        raise InvalidRequestError(f"--pass-overhead-ms must be ≥ 0, got {args.pass_overhead_ms}")
    if args.num_requests <= 0:
        raise InvalidRequestError(f"--num-requests must be positive, got {args.num_requests}")
    kind = "trace" if args.trace is not None else args.workload
    cost = CostSpec(
        model=args.model,
        gpu=args.gpu,
        tp=args.tp,
        attn_efficiency=args.attn_efficiency,
        pass_overhead_s=args.pass_overhead_ms / 1e3,
        tp_check_s=args.tp_check_us / 1e6,
        profile=args.profile,
        profile_layers=args.profile_layers,
        calibration=args.calibration,
        split_overhead_s=None if args.split_overhead_us is None else args.split_overhead_us / 1e6,
        tile_plan=args.tile_plan,
    )
    workload = WorkloadSpec(
        kind=kind,
        num_requests=args.num_requests,
        seeds=args.seeds,
        arrival=args.arrival,
        burst_cv=args.burst_cv,
        trace=args.trace,
    )
    extra: dict[str, object] = {}
    if args.slo_scales is not None:
        extra["slo_scales"] = args.slo_scales
    if args.live_progress is not None:
        extra["live_progress"] = args.live_progress
    cfg = SweepConfig(
        cost=cost,
        workload=workload,
        systems=args.systems,
        target=args.target,
        rel_tol=args.tolerance,
        rates=args.rates,
        slo_rate=args.slo_rate,
        oracles=not args.no_oracles,
        instances=args.instances,
        router=args.router,
        max_blocking_ms=args.max_blocking_ms,
        jobs=args.jobs,
        transport=args.transport,
        kv_per_rank=args.kv_per_rank,
        **extra,
    )
    cfg.check()
    from flowprefill.lab.sim.gateway import get_router

    get_router(cfg.router)
    return cfg


def _out_dir(args: argparse.Namespace) -> Path:
    folder = Path(args.out or f"runs/simulate-{time.strftime('%Y%m%d-%H%M%S')}")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def run(args: argparse.Namespace) -> int:
    # Piped output (logs, CI) still gets the whole table instead of 80 squeezed columns.
    console = Console() if Console().is_terminal else Console(width=150)
    try:
        cfg = config_from_args(args)
        if args.compare_measured is not None:
            return _compare(cfg, args, console)
        if args.rate is not None:
            return _single(cfg, args, console)
        return _sweep(cfg, args, console)
    except FlowPrefillError as e:
        console.print(f"[red]error:[/red] {e}")
        return 2


def _sweep(cfg: SweepConfig, args: argparse.Namespace, console: Console) -> int:
    from flowprefill.lab.sim.plots import write_plots
    from flowprefill.lab.sim.report import print_report, write_json
    from flowprefill.lab.sim.sweep import run_sweep

    folder = _out_dir(args)
    result = run_sweep(cfg, progress=not args.no_progress)
    print_report(result, console)
    write_json(result, folder / "result.json")
    written = [] if args.no_plots else write_plots(result, folder)
    console.print(f"wrote {folder / 'result.json'} and {len(written)} figure(s) to {folder}/")
    return 0


def _single(cfg: SweepConfig, args: argparse.Namespace, console: Console) -> int:
    from flowprefill.lab.sim.sweep import evaluator
    from flowprefill.lab.sim.systems import get_system

    ev = evaluator(cfg)
    table = Table(title=f"{ev.cost.name} at {args.rate} req/s, SLO scale {args.slo_scale}")
    columns = ("system", "attainment %", "per class %", "blocking ms mean/max", "rounds/req")
    for col in (*columns, f"TBT 1st gap % ({cfg.transport})"):
        table.add_column(col)
    for name in cfg.systems:
        r = ev.run(get_system(name), args.rate, args.slo_scale)
        classes = " ".join(f"{c}={100 * m / t:.0f}" for c, (m, t) in r.per_class.items() if t)
        table.add_row(
            name,
            f"{100 * r.attainment:.1f}",
            classes,
            f"{r.blocking_mean_ms:.2f} / {r.blocking_max_ms:.2f}",
            f"{r.rounds_per_request:.2f}",
            "—" if r.first_gap_attainment is None else f"{100 * r.first_gap_attainment:.1f}",
        )
    console.print(table)
    return 0


def _compare(cfg: SweepConfig, args: argparse.Namespace, console: Console) -> int:
    from flowprefill.lab.sim.validate import compare_with_measured, load_measured

    if cfg.cost.profile is None:
        raise InvalidRequestError("--compare-measured needs --profile (the engine's cost model)")
    records = load_measured(Path(args.compare_measured))
    report = compare_with_measured(cfg, records, system=cfg.systems[0])
    console.print(report.summary())
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m flowprefill.lab.sim.cli`` — the same as ``flowprefill simulate``."""
    parser = argparse.ArgumentParser(prog="flowprefill simulate", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
