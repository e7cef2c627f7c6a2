"""``flowprefill demo``: the engine on a local tiny model, FlowPrefill against FCFS.

Two task types share one model: short chat prompts with a tight TTFT target and long
search-style prompts with a loose one. The same seeded arrival sequence is replayed in
real time through a real :class:`~flowprefill.prefill.engine.PrefillEngine` twice — once with
FlowPrefill (S-EDF, operator-level preemption, SLO-aware batching) and once with FCFS
and no preemption (DistServe's prefill) — and per-class TTFT attainment is printed.

SLOs are set relative to *this* machine's measured prefill speed (the TTFT profile), so
the demo means the same on a laptop as on a server: chat must finish within
``chat_slo_x`` times its own predicted prefill time of the longest chat prompt, long
prompts within ``long_slo_x`` times theirs.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from rich.console import Console
from rich.table import Table

from flowprefill.contracts import EngineConfig
from flowprefill.prefill.engine import PrefillEngine, PrefillResult
from flowprefill.prefill.predictor.model import TTFTPredictor


@dataclass(frozen=True, slots=True)
class DemoClass:
    name: str
    share: float
    min_tokens: int
    max_tokens: int
    slo_x: float


@dataclass(frozen=True, slots=True)
class Arrival:
    at_s: float
    slo_class: str
    num_tokens: int
    ttft_slo_s: float
    token_ids: tuple[int, ...]


@dataclass
class RunReport:
    name: str
    results: list[PrefillResult] = field(default_factory=list)
    failures: int = 0
    num_preemptions: int = 0
    blocking_s: list[float] = field(default_factory=list)
    num_rounds: int = 0
    num_command_rounds: int = 0


def make_workload(
    predictor: TTFTPredictor,
    *,
    classes: list[DemoClass],
    duration_s: float,
    load: float,
    vocab_size: int,
    seed: int,
) -> list[Arrival]:
    """Poisson arrivals at a rate that keeps the prefill device ``load`` busy on average."""
    rng = random.Random(seed)
    mean_work_s = sum(
        c.share * predictor.predict_s((c.min_tokens + c.max_tokens) // 2) for c in classes
    )
    rate = load / mean_work_s
    slos = {c.name: c.slo_x * predictor.predict_s(c.max_tokens) for c in classes}
    out: list[Arrival] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t > duration_s:
            return out
        c = rng.choices(classes, weights=[c.share for c in classes])[0]
        n = rng.randint(c.min_tokens, c.max_tokens)
        ids = tuple(rng.randrange(vocab_size) for _ in range(n))
        out.append(Arrival(t, c.name, n, slos[c.name], ids))


def replay(engine: PrefillEngine, name: str, workload: list[Arrival]) -> RunReport:
    """Submit each arrival at its time (real time) and wait for every answer."""
    futures: list[Future[PrefillResult]] = []
    start = time.monotonic()
    for a in workload:
        delay = start + a.at_s - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        futures.append(
            engine.submit(list(a.token_ids), ttft_slo_s=a.ttft_slo_s, slo_class=a.slo_class)
        )
    report = RunReport(name)
    for f in futures:
        try:
            report.results.append(f.result(timeout=600))
        except Exception:
            report.failures += 1
    report.blocking_s = list(engine.blocking_times_s)
    report.num_preemptions = engine.scheduler.stats.num_preemptions
    report.num_rounds = engine.scheduler.stats.num_rounds
    report.num_command_rounds = engine.scheduler.stats.num_command_rounds
    return report


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def render(reports: list[RunReport], classes: list[DemoClass], slos: dict[str, float]) -> Table:
    table = Table(title="TTFT SLO attainment (same arrivals, same model)")
    table.add_column("system")
    table.add_column("class")
    table.add_column("SLO ms", justify="right")
    table.add_column("requests", justify="right")
    table.add_column("attainment", justify="right")
    table.add_column("p50 TTFT ms", justify="right")
    table.add_column("p99 TTFT ms", justify="right")
    for rep in reports:
        for c in [*classes, None]:
            rs = [r for r in rep.results if c is None or r.slo_class == c.name]
            if not rs:
                continue
            ttfts = [r.ttft_s * 1e3 for r in rs]
            att = sum(r.met_slo for r in rs) / len(rs)
            table.add_row(
                rep.name if c is classes[0] else "",
                c.name if c else "[b]all[/b]",
                f"{slos[c.name] * 1e3:.0f}" if c else "",
                str(len(rs)),
                f"{att:.0%}",
                f"{statistics.median(ttfts):.0f}",
                f"{_pct(ttfts, 0.99):.0f}",
                end_section=c is None,
            )
    return table


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="demo-llama", help="built-in model name or local path")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per run")
    p.add_argument("--load", type=float, default=0.7, help="offered load (busy fraction)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", default=None, help="TTFT profile JSON (profiled when absent)")


def run(args: argparse.Namespace) -> int:
    from flowprefill.prefill.factory import build_executor, load_engine_model, quick_profile

    console = Console()
    if args.duration <= 0:
        raise SystemExit("--duration must be positive")
    if not 0 < args.load <= 2:
        raise SystemExit("--load must be in (0, 2]")
    systems = {
        "FlowPrefill": dict(policy="s-edf", batching="slo-aware", granularity="operator"),
        "FCFS": dict(policy="fcfs", batching="none", granularity="none"),
    }
    base = EngineConfig(model_path=args.model)
    with console.status(f"loading {args.model}"):
        model = load_engine_model(base)
    executor = build_executor(base, model)
    predictor = (
        TTFTPredictor.load(args.profile)
        if args.profile
        else quick_profile(executor, console, model_name=args.model)
    )
    executor.close()
    classes = [
        DemoClass("chat", 0.7, 32, 384, slo_x=3.0),
        DemoClass("search", 0.3, 1024, min(3072, executor.max_prompt_tokens), slo_x=8.0),
    ]
    slos = {c.name: c.slo_x * predictor.predict_s(c.max_tokens) for c in classes}
    workload = make_workload(
        predictor,
        classes=classes,
        duration_s=args.duration,
        load=args.load,
        vocab_size=executor.vocab_size,
        seed=args.seed,
    )
    console.print(
        f"{len(workload)} requests over {args.duration:.0f} s per system; "
        + ", ".join(f"{k} SLO {v * 1e3:.0f} ms" for k, v in slos.items())
    )
    reports = []
    for name, settings in systems.items():
        config = base.model_copy(update={"granularity": settings["granularity"]})
        with build_executor(config, model) as ex:
            engine = PrefillEngine(
                ex, predictor, policy=settings["policy"], batching=settings["batching"]
            )
            with engine, console.status(f"replaying {len(workload)} requests through {name}"):
                reports.append(replay(engine, name, workload))
    console.print(render(reports, classes, slos))
    for rep in reports:
        blocking = (
            f"blocking mean {statistics.mean(rep.blocking_s) * 1e3:.2f} ms, "
            f"max {max(rep.blocking_s) * 1e3:.2f} ms"
            if rep.blocking_s
            else "no preemptions"
        )
        console.print(
            f"{rep.name}: {rep.num_preemptions} preemptions ({blocking}); "
            f"{rep.num_rounds} scheduling rounds, {rep.num_command_rounds} issued commands; "
            f"{rep.failures} failed"
        )
    return 0 if all(r.failures == 0 for r in reports) else 1
