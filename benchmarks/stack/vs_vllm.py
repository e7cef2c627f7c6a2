"""Goodput of the whole stack against vLLM alone on the paper's mixed workload, on this CPU.

Systems, same model, all started at once and measured interleaved (one probe each in turn,
the order rotating), so that other jobs on this machine load them alike:

* ``flowprefill``: ``flowprefill up`` (S-EDF, operator-level preemption, SLO-aware
  batching), one prefill and one vLLM decode instance, its SLO table = the one judged;
* ``flowprefill-fcfs``: the same stack with ``--policy fcfs`` (optional);
* ``vllm``: one vLLM server alone, ``--scheduling-policy priority``, chunked prefill with
  chunks of ``2048 × length scale`` tokens (the paper's CP2K, scaled with the prompts), and
  each request's ``priority`` from its class (tightest SLO first);
* ``vllm-cp8k`` (optional): the same with ``8192 × length scale`` tokens (the paper's
  CP8K; 2048 at the default scale, which is also vLLM's default token budget).

Workload: QwenTrace-like (the paper's Table 1 lengths × ``--length-scale``, Table 2's
Llama-3-8B SLOs × an SLO scale), Poisson arrivals, one seeded workload per seed.
**Scale**: the SLO scale is chosen so that a mean search prompt's prefill over the text
SLO is what it is for Llama-3-8B on an A100 (the simulator's GPU cost model) — on this
CPU, this engine's fitted profile; both ratios are printed. Goodput = the highest rate
with ≥ 90 % of all requests within their class's TTFT SLO, found per system and seed by
bisection on the rate (``benchmarks/stack/goodput_search.py``) to ``--precision``. Writes
``summary.json``, every probe, and ``attainment.png`` (per-class attainment against the
rate) into ``--out``.

    python benchmarks/stack/vs_vllm.py [--quick] [--seeds 0,1,2] [--duration 40]
        [--precision 0.1] [--systems flowprefill,flowprefill-fcfs,vllm]
        [--warmup-lengths 64,512,2048,6000]

A probe replays ``--duration`` seconds of arrivals (at least ``--min-requests``): the
seed's first requests, so a faster rate sends more of the same sequence and every probe
lasts about as long (a probe of a fixed count at a high rate ends before queues reach
their steady state). Needs the ``decode`` extra (vLLM). ``--quick``: one seed, 20 s per
probe, 30 % precision, no FCFS stack (about 8 minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

# Run as a script: the repository root goes on the path so that ``benchmarks`` imports as a
# package.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.stack.common import Server, up_server, vllm_server, wait_all
from benchmarks.stack.goodput_search import Bisection, Probe, plot_attainment

if TYPE_CHECKING:
    from flowprefill.bench.workload import Workload
    from flowprefill.prefill.predictor.model import TTFTPredictor

CHUNK_TOKENS_PAPER = 2048
"""The paper's CP2K baseline: 2K-token chunks at full prompt lengths."""
VOCAB = 30000
MAX_PROMPT_TOKENS = 7680
"""Prompt cap: vLLM's max model length here is 8192, less the output tokens."""


@dataclass(frozen=True)
class Calibration:
    """How the workload is scaled to this machine (see the module docstring)."""

    length_scale: float
    slo_scale: float
    a100_search_s: float
    cpu_search_s: float
    search_tokens: int
    cpu_search_tokens: int
    text_slo_s: float

    @property
    def paper_ratio(self) -> float:
        return self.a100_search_s / self.text_slo_s

    @property
    def cpu_ratio(self) -> float:
        return self.cpu_search_s / (self.text_slo_s * self.slo_scale)


def calibrate(predictor: TTFTPredictor, length_scale: float) -> Calibration:
    from flowprefill.bench.workload import QWEN_TYPES
    from flowprefill.contracts.slo import paper_ttft_slos_s
    from flowprefill.lab.sim.cost import build_cost_model

    search = round(next(t.mean for t in QWEN_TYPES if t.name == "search"))
    a100_s = build_cost_model("llama3-8b", "a100").pass_cost([(search, 0)]).total_s
    cpu_tokens = round(search * length_scale)
    cpu_s = predictor.predict_s(cpu_tokens)
    return Calibration(
        length_scale=length_scale,
        slo_scale=cpu_s / a100_s,  # search prefill / text SLO equal on both
        a100_search_s=a100_s,
        cpu_search_s=cpu_s,
        search_tokens=search,
        cpu_search_tokens=cpu_tokens,
        text_slo_s=paper_ttft_slos_s()["text"],
    )


def ratio_table(cal: Calibration, predictor: TTFTPredictor, slos_s: dict[str, float]) -> Table:
    """Mean prompt's prefill / class SLO, A100 vs here, per task type."""
    from flowprefill.bench.workload import QWEN_TYPES
    from flowprefill.contracts.slo import paper_ttft_slos_s
    from flowprefill.lab.sim.cost import build_cost_model

    a100 = build_cost_model("llama3-8b", "a100")
    paper = paper_ttft_slos_s()
    t = Table(title="prefill of the mean prompt / SLO: Llama-3-8B on A100 vs this CPU")
    for col in ("class", "A100 tokens", "ms", "SLO ms", "ratio", "here tokens", "ms", "SLO ms"):
        t.add_column(col, justify="right")
    t.add_column("ratio", justify="right")
    for task in QWEN_TYPES:
        n = round(task.mean)
        a_s = a100.pass_cost([(n, 0)]).total_s
        m = round(n * cal.length_scale)
        c_s = predictor.predict_s(m)
        t.add_row(
            task.name,
            str(n),
            f"{a_s * 1e3:.0f}",
            f"{paper[task.name] * 1e3:.0f}",
            f"{a_s / paper[task.name]:.2f}",
            str(m),
            f"{c_s * 1e3:.0f}",
            f"{slos_s[task.name] * 1e3:.0f}",
            f"{c_s / slos_s[task.name]:.2f}",
        )
    t.caption = (
        f"search prefill / text SLO: A100 {cal.paper_ratio:.2f}, here {cal.cpu_ratio:.2f} "
        f"(length scale {cal.length_scale:g}, SLO scale {cal.slo_scale:.3f})"
    )
    return t


def make_requests(workload: Workload, rate: float, length_scale: float) -> list[Any]:
    reqs = workload.requests(rate)
    for r in reqs:
        r.num_tokens = max(1, min(MAX_PROMPT_TOKENS, round(r.num_tokens * length_scale)))
    return reqs


def probe_requests(workload: Workload, rate: float, args: argparse.Namespace) -> list[Any]:
    """The seed's first ``max(min_requests, rate × duration)`` requests at ``rate``."""
    n = max(args.min_requests, math.ceil(rate * args.duration))
    return make_requests(workload.head(n), rate, args.length_scale)


def run_probe(
    server: Server,
    model: str,
    workload: Workload,
    rate: float,
    seed: int,
    args: argparse.Namespace,
    progress: Progress,
    slos_s: dict[str, float],
) -> Probe:
    from flowprefill.bench.client import SendOptions, replay
    from flowprefill.bench.report import summarize

    vllm = server.name.startswith("vllm")
    order = sorted(slos_s, key=lambda c: slos_s[c])
    opts = SendOptions(
        url=server.base_url,
        model=model,
        max_tokens=args.max_tokens,
        vocab_size=VOCAB,
        class_header=None if vllm else "x-slo-class",
        priorities={c: i for i, c in enumerate(order)} if vllm else None,
        seed=seed,
    )
    reqs = probe_requests(workload, rate, args)
    bar = progress.add_task(f"  {server.name} seed {seed} @ {rate:.3g} req/s", total=len(reqs))
    t0 = time.monotonic()
    # round_index from the rate: the same (seed, rate) sends the same prompts to every
    # system, and no server sees a prompt twice (vLLM's prefix cache would skip it).
    outcomes = asyncio.run(
        replay(reqs, opts, lambda _: progress.advance(bar), round_index=round(rate * 1e4))
    )
    progress.remove_task(bar)
    classes = summarize(outcomes)
    missed = [(o.slo_class, o.num_tokens, o.ttft_s) for o in outcomes if not o.met]
    return Probe(rate, classes["all"]["attainment"], classes, time.monotonic() - t0, missed)


def warm_up(
    server: Server, model: str, lengths: list[int], slo_class: str, max_tokens: int = 4
) -> None:
    """A few prompts of growing length, one at a time: the first hand-off through the
    connector and the first pass at each size pay one-time costs. Sent as ``slo_class``
    (vLLM ignores the header): FlowPrefill's gateway answers 503 to a request it predicts,
    or finds, later than its class's target plus the useful wait, which a 6,000-token
    prompt of the tightest class is here."""
    for i, n in enumerate(lengths):
        prompt = [(7 * i + j) % VOCAB + 1 for j in range(n)]
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens}
        headers = {"x-slo-class": slo_class}
        r = httpx.post(f"{server.base_url}/v1/completions", json=body, headers=headers, timeout=600)
        r.raise_for_status()


def build_servers(
    args: argparse.Namespace, model_dir: Path, profile: Path, slo_file: Path, out: Path
) -> list[Server]:
    servers = []
    chunk = max(64, round(CHUNK_TOKENS_PAPER * args.length_scale))
    for system in args.systems.split(","):
        if system == "flowprefill":
            servers.append(
                up_server(system, model_dir, profile, out, ["--slo-table", str(slo_file)])
            )
        elif system == "flowprefill-fcfs":
            extra = ["--slo-table", str(slo_file), "--policy", "fcfs"]
            servers.append(up_server(system, model_dir, profile, out, extra))
        elif system in ("vllm", "vllm-cp8k"):
            tokens = (
                chunk if system == "vllm" else round(4 * CHUNK_TOKENS_PAPER * args.length_scale)
            )
            extra = [
                "--scheduling-policy", "priority", "--enable-chunked-prefill",
                "--max-num-batched-tokens", str(tokens),
            ]  # fmt: skip
            servers.append(vllm_server(system, model_dir, out, extra))
        else:
            raise SystemExit(
                f"unknown system {system!r}: flowprefill, flowprefill-fcfs, vllm, vllm-cp8k"
            )
    return servers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="demo-llama")
    ap.add_argument("--quick", action="store_true", help="a few minutes: see above")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per probe")
    ap.add_argument("--min-requests", type=int, default=60, help="fewest requests per probe")
    ap.add_argument("--precision", type=float, default=0.1, help="stop at fail/pass <= 1 + this")
    ap.add_argument(
        "--start-rate",
        type=float,
        help="first probe (req/s; default: half the rate the profile says prefill can serve)",
    )
    ap.add_argument(
        "--min-rate", type=float, default=0.25, help="below this a system's goodput is 0"
    )
    ap.add_argument("--max-rate", type=float, default=64.0)
    ap.add_argument("--length-scale", type=float, default=0.25, help="prompt lengths × this")
    ap.add_argument("--max-tokens", type=int, default=4, help="output tokens per request")
    ap.add_argument(
        "--warmup-lengths",
        default="64,512,2048,6000",
        help="prompt lengths sent to each system, one at a time, before the first probe",
    )
    ap.add_argument("--systems", default="flowprefill,flowprefill-fcfs,vllm")
    ap.add_argument("--profile", help="TTFT profile JSON (default: profiled here)")
    ap.add_argument("--out", default=f"runs/stack-vs-vllm-{time.strftime('%Y%m%d-%H%M%S')}")
    args = ap.parse_args()
    if args.quick:
        args.seeds, args.duration, args.min_requests, args.precision = "0", 20.0, 30, 0.3
        if args.systems == ap.get_default("systems"):
            args.systems = "flowprefill,vllm"

    from flowprefill.bench import workload as wl
    from flowprefill.contracts import EngineConfig
    from flowprefill.models import resolve_model_path
    from flowprefill.prefill.factory import build_executor, profile_executor
    from flowprefill.prefill.predictor.model import TTFTPredictor

    console = Console()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model_path(args.model)
    profile = out / "ttft-profile.json"
    if args.profile:
        predictor = TTFTPredictor.load(args.profile)
    else:
        config = EngineConfig(model_path=str(model_dir))
        with console.status("profiling this machine's prefill"), build_executor(config) as ex:
            report = profile_executor(
                ex, num_points=8, repeats=2 if args.quick else 3, max_tokens=8192,
                model_name=args.model,
            )  # fmt: skip
        predictor = report.predictor
    predictor.save(profile)
    cal = calibrate(predictor, args.length_scale)
    paper = wl.get_slo_table("llama3-8b")
    slos_s = {c: s * cal.slo_scale for c, s in paper.items()}
    slo_file = out / "slo.json"
    slo_file.write_text(json.dumps(slos_s))
    console.print(ratio_table(cal, predictor, slos_s))

    seeds = [int(s) for s in args.seeds.split(",")]
    if args.start_rate is None:
        lengths = make_requests(wl.qwen_like(1000, seed=99), 1.0, args.length_scale)
        busy_s = statistics.mean(predictor.predict_s(r.num_tokens) for r in lengths)
        args.start_rate = float(f"{0.5 / busy_s:.2g}")
        console.print(
            f"mean prefill {busy_s * 1e3:.0f} ms per request (profile): first probe at "
            f"{args.start_rate:g} req/s"
        )
    longest = max(args.min_requests, math.ceil(args.max_rate * args.duration))
    servers = build_servers(args, model_dir, profile, slo_file, out)
    names = [s.name for s in servers]
    results: dict[str, dict[int, Bisection]] = {n: {} for n in names}
    model = str(model_dir)  # the gateway and vLLM both answer to the model's path
    t_start = time.monotonic()
    try:
        with console.status("starting " + ", ".join(names) + " (a few minutes)"):
            for s in servers:
                s.start()
            wait_all(servers)
            for s in servers:
                loosest = max(slos_s, key=lambda c: slos_s[c])
                warm_up(s, model, [int(n) for n in args.warmup_lengths.split(",")], loosest)
        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
        )
        with Progress(*columns, console=console) as progress:
            overall = progress.add_task("seeds", total=len(seeds))
            for seed in seeds:
                workload = replace(wl.qwen_like(longest, seed=seed), slo_table=slos_s)
                for name in names:
                    previous = [b.goodput for b in results[name].values() if b.goodput > 0]
                    start = statistics.median(previous) if previous else args.start_rate
                    results[name][seed] = Bisection(
                        start, args.precision, args.min_rate, args.max_rate
                    )
                step = 0
                while not all(results[n][seed].done for n in names):
                    # Interleaved: one probe per system in turn, the order rotating.
                    turn = servers[step % len(servers) :] + servers[: step % len(servers)]
                    for server in turn:
                        bis = results[server.name][seed]
                        rate = bis.next_rate()
                        if rate is None:
                            continue
                        time.sleep(1.5)  # vLLM busy-waits 1 s after its last step
                        probe = run_probe(
                            server, model, workload, rate, seed, args, progress, slos_s
                        )
                        bis.add(probe)
                        progress.console.print(
                            f"seed {seed} {server.name:<17} {rate:7.3f} req/s: "
                            f"{probe.attainment:6.1%} "
                            + " ".join(
                                f"{c} {probe.classes[c]['attainment']:.0%}"
                                for c in workload.classes
                                if c in probe.classes
                            )
                            + ("  pass" if probe.passed else "  FAIL")
                        )
                    step += 1
                progress.advance(overall)
    finally:
        for s in servers:
            s.stop()

    classes = sorted(slos_s, key=lambda c: slos_s[c])
    summary = report_results(console, results, classes, cal, args)
    summary["wall_s"] = round(time.monotonic() - t_start)
    summary["slo_s"] = slos_s
    summary["command"] = " ".join(sys.argv)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    title = (
        f"QwenTrace-like ×{args.length_scale:g} lengths, SLO scale {cal.slo_scale:.3f}, "
        f"{args.duration:g} s per probe"
    )
    plot_attainment(
        out / "attainment.png", results, classes, {c: s * 1e3 for c, s in slos_s.items()}, title
    )
    console.print(f"wrote {out / 'summary.json'} and {out / 'attainment.png'}")


def report_results(
    console: Console,
    results: dict[str, dict[int, Bisection]],
    classes: list[str],
    cal: Calibration,
    args: argparse.Namespace,
) -> dict[str, Any]:
    seeds = sorted(next(iter(results.values())))
    t = Table(
        title=f"goodput (req/s at ≥ 90 % TTFT attainment, all classes), bisection to "
        f"{args.precision:.0%}, {args.duration:g} s of arrivals (≥ {args.min_requests} "
        "requests) per probe"
    )
    t.add_column("system")
    for seed in seeds:
        t.add_column(f"seed {seed}", justify="right")
    for col in ("mean", "min–max", "× best vLLM (per seed)", "probes"):
        t.add_column(col, justify="right")
    # The baseline per seed is the best vLLM arm of that seed, so adding a vLLM
    # configuration can only make FlowPrefill's ratio smaller.
    vllm_arms = [r for n, r in results.items() if n.startswith("vllm")]
    best_vllm = {s: max(r[s].goodput for r in vllm_arms) for s in seeds} if vllm_arms else None
    summary: dict[str, Any] = {
        "calibration": {
            **cal.__dict__,
            "paper_ratio": cal.paper_ratio,
            "cpu_ratio": cal.cpu_ratio,
        },
        "settings": vars(args),
        "systems": {},
    }
    for name, by_seed in results.items():
        g = [by_seed[s].goodput for s in seeds]
        ratios = [
            g_i / best_vllm[s] if best_vllm[s] else float("inf")
            for g_i, s in zip(g, seeds, strict=True)
            if best_vllm is not None
        ]
        t.add_row(
            name,
            *(f"{x:.2f}" for x in g),
            f"{statistics.mean(g):.2f}",
            f"{min(g):.2f}–{max(g):.2f}",
            " ".join(f"{r:.2f}" for r in ratios) if not name.startswith("vllm") and ratios else "-",
            str(sum(len(by_seed[s].probes) for s in seeds)),
        )
        summary["systems"][name] = {
            "goodput_req_s": {str(s): by_seed[s].goodput for s in seeds},
            "goodput_mean_req_s": statistics.mean(g),
            "ratio_to_vllm": ratios if not name.startswith("vllm") else None,
            "seeds": {str(s): by_seed[s].to_json() for s in seeds},
        }
    wide = Console(width=max(console.width, 150))
    wide.print(t)
    c = Table(title="at each system's goodput (mean over seeds): attainment · TTFT p50 / p99 ms")
    c.add_column("system")
    for name in classes:
        c.add_column(name, justify="right")
    for name, by_seed in results.items():
        at = [max((p for p in b.probes if p.passed), key=lambda p: p.rate, default=None)
              for b in by_seed.values()]  # fmt: skip
        probes = [p for p in at if p is not None]
        cells = []
        for cls in classes:
            rows = [p.classes[cls] for p in probes if cls in p.classes]
            if not rows:
                cells.append("-")
                continue
            att = statistics.mean(r["attainment"] for r in rows)
            p50 = statistics.mean(r["ttft_p50_s"] or 0 for r in rows) * 1e3
            p99 = statistics.mean(r["ttft_p99_s"] or 0 for r in rows) * 1e3
            cells.append(f"{att:.0%} · {p50:.0f} / {p99:.0f}")
        c.add_row(name, *cells)
    wide.print(c)
    return summary


if __name__ == "__main__":
    main()
