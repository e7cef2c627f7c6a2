"""Soak: minutes of the paper's mixed workload against ``flowprefill up`` at a fraction of its
goodput, watching every process of the stack for memory or file-descriptor growth and
checking the gateway's counters against the client's.

    python benchmarks/soak/soak.py --rate 4.28 [--fraction 0.7] [--minutes 10] [--warmup 2]
        [--decode 1] [--reference docs/data/stack-vs-vllm-summary.json] [--out DIR]

``--rate``: the stack's goodput, req/s, as ``benchmarks/stack/vs_vllm.py`` measures it (its
``summary.json``: ``systems.flowprefill.goodput_mean_req_s``; docs/stack.md quotes it). The
load is offered at ``--fraction`` of it, on the workload that goodput was measured on: the
QwenTrace-like mix with the SLO table, length scale and output tokens of that run's
summary (``--reference``; the default is the run docs/stack.md quotes), Poisson arrivals
from ``--seed``. Before the load the stack gets the same warm-up prompts as in that
benchmark.

During the load, every ``--sample-s`` seconds: resident memory and open file descriptors of
every process under ``up``'s supervisor (``procs``), and the stack's gauges of work
in hand (in flight at the gateway, queued and parked at the first prefill instance: growth
that follows a backlog is not a leak). After it: per process, a least-squares slope over
the samples from ``--warmup`` minutes to the last arrival (the drain after it is plotted,
not fitted), with a verdict (``trend``: "growth" only when the slope's 95 % interval
excludes 0 *and* the fitted change over the window exceeds ``--growth-mb`` /
``--growth-fds``); and the gateway's ``/metrics`` deltas against the client's counts
(``counts``). Writes ``summary.json`` (settings, load, trends, every sample,
reconciliation, failures), ``soak.png`` (RSS, fds and gauges over time), the stack's log
and run folder into ``--out``.

Exit status 1 when anything failed: a count mismatch, any request that ended in an error
(the soak sends only valid requests and waits for every answer, so none is its own doing),
a process of the stack that died, or growth (unless ``--allow-growth``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

# Run as a script: the repository root goes on the path so that ``benchmarks`` imports as a
# package.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.soak.counts import (
    GATEWAY_IN_FLIGHT,
    PREFILL_QUEUE_DEPTH,
    Page,
    Row,
    client_counts,
    gateway_counts,
    parse_page,
    reconcile,
)
from benchmarks.soak.procs import MB, Probe, Series, TreeSampler, plot
from benchmarks.soak.trend import fit_trend
from benchmarks.stack.common import ROOT, Server, up_server, wait_all
from benchmarks.stack.vs_vllm import MAX_PROMPT_TOKENS, VOCAB, make_requests, warm_up
from flowprefill.contracts.metrics import PREFILL_PARKED_BYTES

if TYPE_CHECKING:
    from flowprefill.bench.client import Outcome, SendOptions
    from flowprefill.prefill.request import Request

REFERENCE = ROOT / "docs" / "data" / "stack-vs-vllm-summary.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--rate", type=float, required=True, help="the stack's goodput, req/s (see above)"
    )
    ap.add_argument("--fraction", type=float, default=0.7, help="load = this × --rate")
    ap.add_argument("--minutes", type=float, default=10.0, help="minutes of arrivals")
    ap.add_argument("--warmup", type=float, default=2.0, help="minutes left out of the slopes")
    ap.add_argument("--sample-s", type=float, default=5.0, help="seconds between samples")
    ap.add_argument("--growth-mb", type=float, default=10.0, help="RSS change that counts")
    ap.add_argument("--growth-fds", type=float, default=5.0, help="fd change that counts")
    ap.add_argument("--allow-growth", action="store_true", help="growth does not fail the run")
    ap.add_argument("--reference", default=str(REFERENCE), help="a stack/vs_vllm.py summary.json")
    ap.add_argument("--model", help="default: the reference's")
    ap.add_argument("--length-scale", type=float, help="default: the reference's")
    ap.add_argument("--max-tokens", type=int, help="default: the reference's (1 with --decode 0)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefill", type=int, default=1, help="up --prefill")
    ap.add_argument("--decode", type=int, default=1, help="up --decode (0: prefill only)")
    ap.add_argument(
        "--up-arg",
        action="append",
        default=[],
        help="one more `up` argument (repeat it); KEY=VALUE sets the stack's environment",
    )
    ap.add_argument("--profile", help="TTFT profile JSON (default: profiled here first)")
    ap.add_argument("--out", default=f"runs/soak-{time.strftime('%Y%m%d-%H%M%S')}")
    args = ap.parse_args(argv)
    for name in ("rate", "fraction", "minutes", "sample_s"):
        if not getattr(args, name) > 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0")
    if not 0 <= args.warmup < args.minutes:
        ap.error("--warmup must be >= 0 and shorter than --minutes")
    return args


def load_reference(args: argparse.Namespace) -> dict[str, float]:
    """The reference run's SLO table; fills in the workload settings not given."""
    path = Path(args.reference)
    try:
        ref = json.loads(path.read_text())
        slo_s = {str(c): float(s) for c, s in ref["slo_s"].items()}
        settings = ref["settings"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise SystemExit(f"--reference {path}: not a stack/vs_vllm.py summary.json ({e!r})") from e
    args.model = args.model or settings["model"]
    args.length_scale = args.length_scale or settings["length_scale"]
    # Without decode the gateway answers the first token only (503 for more).
    args.max_tokens = args.max_tokens or (settings["max_tokens"] if args.decode else 1)
    if args.decode == 0 and args.max_tokens > 1:
        raise SystemExit("--decode 0 serves one token per request: --max-tokens 1")
    return slo_s


def build_requests(args: argparse.Namespace, slo_s: dict[str, float]) -> list[Request]:
    from flowprefill.bench.workload import qwen_like

    rate = args.rate * args.fraction
    duration_s = args.minutes * 60
    mean = rate * duration_s  # Poisson: this many on average; 6 sigma more is plenty
    workload = qwen_like(math.ceil(mean + 6 * math.sqrt(mean) + 10), seed=args.seed)
    reqs = make_requests(replace(workload, slo_table=slo_s), rate, args.length_scale)
    return [r for r in reqs if r.arrival_s <= duration_s]


def vocab_size(model_dir: Path) -> int:
    """Prompt ids stay below the model's vocabulary (the benchmark's, when it is larger)."""
    config = json.loads((model_dir / "config.json").read_text())
    return min(VOCAB, int(config["vocab_size"]))


def profile_here(model_dir: Path, model: str, path: Path, console: Console) -> None:
    from flowprefill.contracts import EngineConfig
    from flowprefill.prefill.factory import build_executor, profile_executor

    config = EngineConfig(model_path=str(model_dir))
    with console.status("profiling this machine's prefill"), build_executor(config) as ex:
        report = profile_executor(ex, num_points=8, max_tokens=8192, model_name=model)
    report.predictor.save(path)


def scrape_page(server: Server) -> Page:
    return parse_page(httpx.get(f"{server.base_url}/metrics", timeout=30).text)


def gauge_probe(url: str, name: str, scale: float = 1.0) -> Probe:
    """Reads gauge ``name`` (summed over labels) × ``scale`` from ``url``'s /metrics."""

    def read() -> float | None:
        try:
            page = parse_page(httpx.get(f"{url}/metrics", timeout=5).text)
        except (httpx.HTTPError, ValueError):
            return None  # busy or restarting: a gap in the plot, not a failure
        return scale * sum(v for (n, _), v in page.items() if n == name)

    return read


def stack_probes(server: Server) -> dict[str, Probe]:
    gateway, prefill = server.metrics_urls["gateway"], server.metrics_urls["prefill"]
    return {
        "in flight at the gateway": gauge_probe(gateway, GATEWAY_IN_FLIGHT),
        "queued at prefill 0": gauge_probe(prefill, PREFILL_QUEUE_DEPTH),
        "parked MB at prefill 0": gauge_probe(prefill, PREFILL_PARKED_BYTES, 1 / MB),
    }


async def drive(
    requests: list[Request],
    opts: SendOptions,
    sampler: TreeSampler,
    sample_s: float,
    progress: Progress,
) -> list[Outcome]:
    """Replay ``requests`` while sampling the stack every ``sample_s`` (t = 0: the start)."""
    from flowprefill.bench.client import replay

    bar = progress.add_task("soak", total=len(requests), errors=0)
    errors = 0

    def done(o: Outcome) -> None:
        nonlocal errors
        errors += o.error is not None
        progress.update(bar, advance=1, errors=errors)

    t0 = time.monotonic()
    stop = asyncio.Event()

    async def sampling() -> None:
        while not stop.is_set():
            await asyncio.to_thread(sampler.sample, time.monotonic() - t0)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), sample_s)
        await asyncio.to_thread(sampler.sample, time.monotonic() - t0)

    task = asyncio.create_task(sampling())
    try:
        return await replay(requests, opts, done)
    finally:
        stop.set()
        await task


def trends(
    series: list[Series], args: argparse.Namespace
) -> tuple[Table, list[dict[str, Any]], list[str]]:
    """The trend table, its JSON rows, and the processes that grew."""
    warmup_s, end_s = args.warmup * 60, args.minutes * 60
    t = Table(
        title=f"per process from {args.warmup:g} min (warm-up) to {args.minutes:g} min (last "
        "arrival): start → end, slope ± 95 %"
    )
    for col in ("process", "samples", "RSS MB", "MB/min", "RSS", "fds", "fds/min", "fds"):
        t.add_column(col, justify="left" if col == "process" else "right")
    rows: list[dict[str, Any]] = []
    grew: list[str] = []
    for s in sorted(series, key=lambda s: (s.role, s.pid)):
        w = s.between(warmup_s, end_s)
        row: dict[str, Any] = {"process": s.label, "role": s.role, "pid": s.pid}
        cells = [s.label, str(len(w.t_s))]
        for name, values, threshold in (
            ("rss_mb", w.rss_mb, args.growth_mb),
            ("fds", w.fds, args.growth_fds),
        ):
            if not values:
                row[name] = None
                cells += ["-", "-", "too few samples"]
                continue
            trend = fit_trend(w.t_s, [float(v) for v in values])
            verdict = trend.verdict(threshold)
            row[name] = {**asdict(trend), "verdict": verdict, "threshold": threshold}
            if verdict == "growth":
                grew.append(f"{s.label}: {name} {trend.slope_per_min:+.2f}/min")
            cells += [
                f"{trend.start:.0f} → {trend.end:.0f}",
                f"{trend.slope_per_min:+.2f} ± {trend.ci_per_min:.2f}",
                f"[red]{verdict}[/]" if verdict == "growth" else verdict,
            ]
        t.add_row(*cells)
        rows.append(row)
    t.caption = (
        f"growth: the slope's 95 % interval excludes 0 and slope × window > "
        f"{args.growth_mb:g} MB / {args.growth_fds:g} fds"
    )
    return t, rows, grew


def counts_table(rows: list[Row]) -> Table:
    t = Table(title="the load's requests: client vs gateway /metrics (delta over the load)")
    for col in ("count", "client", "gateway", ""):
        t.add_column(col, justify="left" if col == "count" else "right")
    for r in rows:
        mark = "[red]MISMATCH[/]" if r.mismatch else ("ok" if r.compared else "(not compared)")
        t.add_row(r.what, f"{r.client:g}", f"{r.gateway:g}", mark)
    return t


def main(argv: list[str] | None = None) -> int:
    from flowprefill.bench.client import SendOptions
    from flowprefill.bench.report import summarize
    from flowprefill.models import resolve_model_path

    args = parse_args(argv)
    slo_s = load_reference(args)
    console = Console()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model_path(args.model)
    profile = Path(args.profile) if args.profile else out / "ttft-profile.json"
    if not args.profile:
        profile_here(model_dir, args.model, profile, console)
    slo_file = out / "slo.json"
    slo_file.write_text(json.dumps(slo_s))
    requests = build_requests(args, slo_s)
    model = str(model_dir)  # the gateway answers to the model's path
    opts = SendOptions(
        url="",
        model=model,
        max_tokens=args.max_tokens,
        vocab_size=vocab_size(model_dir),
        seed=args.seed,
    )
    up_args = ["--slo-table", str(slo_file), "--prefill", str(args.prefill)]
    up_args += ["--decode", str(args.decode), *args.up_arg]
    server = up_server("stack", model_dir, profile, out, up_args)
    opts = replace(opts, url=server.base_url)
    load_before = os.getloadavg()
    t_start = time.monotonic()
    try:
        with console.status(f"starting `flowprefill up` (log: {server.log})"):
            server.start()
            wait_all([server])
            longest = min(MAX_PROMPT_TOKENS, max(r.num_tokens for r in requests))
            lengths = sorted({min(n, longest) for n in (64, 512, 2048, 6000)})
            loosest = max(slo_s, key=lambda c: slo_s[c])  # the tightest may be refused 503
            warm_up(server, model, lengths, loosest, args.max_tokens)
        assert server.proc is not None
        sampler = TreeSampler(server.proc.pid, stack_probes(server))
        before = scrape_page(server)
        console.print(
            f"{len(requests)} requests over {args.minutes:g} min at "
            f"{args.rate * args.fraction:.3g} req/s ({args.fraction:.0%} of {args.rate:g})"
        )
        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("errors {task.fields[errors]}"),
            TimeElapsedColumn(),
        )
        with Progress(*columns, console=console) as progress:
            outcomes = asyncio.run(drive(requests, opts, sampler, args.sample_s, progress))
        after = scrape_page(server)
    finally:
        server.stop()
    load_after = os.getloadavg()

    series = list(sampler.series.values())
    trend_t, trend_rows, grew = trends(series, args)
    rows = reconcile(client_counts(outcomes), gateway_counts(before, after))
    lost = sampler.lost()
    errors = [o for o in outcomes if o.error is not None]
    failures = [f"count mismatch: {r.what} client {r.client:g} gateway {r.gateway:g}"
                for r in rows if r.mismatch]  # fmt: skip
    if errors:
        failures.append(f"{len(errors)} requests ended in an error")
    failures += [f"{s.label} exited during the load" for s in lost]
    if not args.allow_growth:
        failures += [f"growth: {g}" for g in grew]

    classes = summarize(outcomes)
    wide = Console(width=max(console.width, 140))
    wide.print(trend_t)
    wide.print(counts_table(rows))
    console.print(
        f"attainment {classes['all']['attainment']:.1%}; "
        + ", ".join(f"{c} {v['attainment']:.0%}" for c, v in classes.items() if c != "all")
        + f"; load average before {load_before[0]:.1f}, after {load_after[0]:.1f}"
    )
    summary = {
        "command": " ".join(sys.argv),
        "settings": vars(args),
        "offered_rate_req_s": args.rate * args.fraction,
        "slo_s": slo_s,
        "wall_s": round(time.monotonic() - t_start, 1),
        "load_average_1_5_15": {"before": load_before, "after": load_after},
        "load": {"requests": len(outcomes), "errors": len(errors), "classes": classes},
        "errors_first": [f"{o.slo_class} {o.status}: {o.error}" for o in errors[:20]],
        "processes": trend_rows,
        "lost_processes": [s.label for s in lost],
        "reconciliation": [{**asdict(r), "mismatch": r.mismatch} for r in rows],
        "gateway_errors_by_reason": gateway_counts(before, after).errors,
        "failures": failures,
        "passed": not failures,
        "series": [asdict(s) for s in series],
        "gauges": sampler.gauges,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    title = (
        f"soak: {args.rate * args.fraction:.3g} req/s for {args.minutes:g} min "
        f"(--decode {args.decode}, seed {args.seed})"
    )
    marks = {"end of warm-up": args.warmup * 60, "last arrival": args.minutes * 60}
    plot(out / "soak.png", series, sampler.gauges, marks, title)
    console.print(f"wrote {out / 'summary.json'} and {out / 'soak.png'}")
    for f in failures:
        console.print(f"[red]FAILED[/]: {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
