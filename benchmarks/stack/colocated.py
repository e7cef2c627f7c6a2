"""Colocated on the CPU stack (the paper's §6.5, Figure 16; issue 24 item 4): TTFT and TBT
attainment per class of ``flowprefill up`` against vLLM alone with 2K chunks and priority.

``flowprefill up`` is the colocated shape on one machine: the gateway, one prefill instance
and one vLLM decode instance share its cores. The baseline is one ``vllm serve`` doing both
phases in its own iterations. Systems (all started once, measured one after another at
every rate, the order alternating between rates, so that other load on the machine falls
on both alike):

* ``flowprefill``: ``flowprefill up`` (file hand-off, as the other stack benchmarks), its
  SLO table = the TTFT targets judged;
* ``vllm-cp2k``: ``vllm serve`` alone, ``--scheduling-policy priority`` (each request's
  ``priority`` from its class, tightest TTFT target first), chunked prefill of
  ``2048 × length scale`` tokens — the paper's CP2K scaled with the prompts, the
  convention of ``vs_vllm.py`` (its ``vllm`` arm);
* ``--variant NAME=ARGS``: another ``flowprefill up`` with extra arguments (``KEY=VALUE``
  words: its environment), as in ``uniform.py``.

Workload (``vs_vllm.py``'s): QwenTrace-like task types with their classes, Table 1 lengths
× ``--length-scale`` (capped at 7,680 tokens), Poisson arrivals from ``--seed``; a probe
replays ``--duration`` seconds of arrivals (at least ``--min-requests``), every rate with
prompts of its own (vLLM's prefix cache never sees one twice). **TTFT targets**: Table 2's
Llama-3-8B targets × ``vs_vllm.py``'s SLO scale (this machine's profile: a mean search
prompt's prefill over the text target as on an A100) × ``--ttft-scale`` (3, §6.5).
**TBT targets**: §6.5's 0.1 s (text, image) and 0.2 s (search, file) × ``--tbt-scale``
(1: the script prints the decode step it measured on each system when idle and a prefill
chunk's time from the profile beside the A100's, so a reader sees what the targets mean
here). Every request asks for ``--max-tokens`` output tokens (32; the built-in models
never stop early).

**TBT rule** (the simulator's, ``flowprefill/lab/sim/decode.py``): a request meets its TBT
target when it succeeded and its *mean* gap between tokens — DistServe's TPOT,
``(last − first token) / (n − 1)`` — is within it. The stricter "every gap within it"
(``flowprefill bench``'s rule) is reported beside it. "both": TTFT and (mean-gap) TBT met.
Goodput under both targets: the highest rate tried with ≥ 90 % of all requests meeting
both, and the crossing interpolated on the rate grid as ``benchmarks/sim/colocated.py``
does.

    python benchmarks/stack/colocated.py [--rates 0.5,1,2,3,4,5] [--seed 0] [--duration 40]
        [--min-requests 40] [--max-tokens 32] [--ttft-scale 3] [--tbt-scale 1]
        [--systems flowprefill,vllm-cp2k] [--variant NAME=ARGS ...] [--rounds 1]

Writes ``summary.json`` (settings, calibration, every probe with per-class figures,
the load average before and after) and ``colocated.png`` (TTFT and TBT attainment against
the rate, one panel per class and one for all, a line per system) into ``--out``. Needs the
``decode`` extra (vLLM) and ``lab`` (plots).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

# Run as a script: the repository root goes on the path so that ``benchmarks`` imports as a
# package.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# The goodput crossing is the simulator benchmark's own rule, so the two compare.
from benchmarks.sim.colocated import crossing
from benchmarks.stack.colocated_report import (
    TARGET,
    mean_gap_s,
    met_tbt_mean,
    plot,
    pool,
    ratio_to_baseline,
    results_table,
    summarize,
    targets_table,
)
from benchmarks.stack.common import (
    Server,
    hop_means_ms,
    scrape_all,
    up_server,
    vllm_server,
    wait_all,
)
from benchmarks.stack.vs_vllm import (
    CHUNK_TOKENS_PAPER,
    VOCAB,
    calibrate,
    make_requests,
    ratio_table,
    warm_up,
)

if TYPE_CHECKING:
    from flowprefill.bench.workload import Workload

DEFAULT_RATES = "0.5,1,2,3,4,5"


def options(
    server: Server,
    model: str,
    args: argparse.Namespace,
    ttft_s: dict[str, float],
    tbt_s: dict[str, float],
    seed: int,
) -> Any:
    from flowprefill.bench.client import SendOptions

    vllm = not server.metrics_urls  # vLLM alone: no FlowPrefill gateway to tag classes
    order = sorted(ttft_s, key=lambda c: ttft_s[c])
    return SendOptions(
        url=server.base_url,
        model=model,
        max_tokens=args.max_tokens,
        vocab_size=VOCAB,
        class_header=None if vllm else "x-slo-class",
        priorities={c: i for i, c in enumerate(order)} if vllm else None,
        tbt_slos_s=tbt_s,
        seed=seed,
    )


def idle_decode_step_ms(server: Server, opts: Any, max_tokens: int, repeats: int) -> float:
    """Median gap between tokens after the first of ``repeats`` short prompts sent one at
    a time to an idle system: its decode step with nothing else running (the first gap is
    left out: on ``up`` it carries the KV hand-off)."""
    from flowprefill.bench.client import replay
    from flowprefill.prefill.request import Request

    reqs = [
        Request.create(f"step{i}", arrival_s=0.0, ttft_slo_s=60.0, num_tokens=16, slo_class="text")
        for i in range(repeats)
    ]
    gaps: list[float] = []
    for i, r in enumerate(reqs):
        (o,) = asyncio.run(replay([r], replace(opts, max_tokens=max_tokens), round_index=-1 - i))
        if o.error is not None:
            raise RuntimeError(f"{server.name}: decode-step probe failed: {o.error}")
        gaps.extend(o.gaps_s[1:])
    if not gaps:
        raise RuntimeError(f"{server.name}: decode-step probe streamed fewer than 3 tokens")
    return statistics.median(gaps) * 1e3


def build_servers(
    args: argparse.Namespace, model_dir: Path, profile: Path, slo_file: Path, out: Path
) -> list[Server]:
    servers = []
    for system in args.systems.split(","):
        if system == "flowprefill":
            servers.append(
                up_server(system, model_dir, profile, out, ["--slo-table", str(slo_file)])
            )
        elif system == "vllm-cp2k":
            extra = [
                "--scheduling-policy",
                "priority",
                "--enable-chunked-prefill",
                "--max-num-batched-tokens",
                str(args.chunk_tokens),
            ]
            servers.append(vllm_server(system, model_dir, out, extra))
        else:
            raise SystemExit(
                f"unknown system {system!r}: flowprefill, vllm-cp2k (--variant for more)"
            )
    for v in args.variant:
        name, sep, rest = v.partition("=")
        if not sep or not name:
            raise SystemExit(f"--variant {v!r}: expected NAME=ARGS")
        if name in {s.name for s in servers}:
            raise SystemExit(f"--variant {v!r}: the name {name!r} is taken")
        extra = ["--slo-table", str(slo_file), *shlex.split(rest)]
        servers.append(up_server(name, model_dir, profile, out, extra))
    return servers


def parse_rates(spec: str) -> list[float]:
    try:
        rates = sorted({float(r) for r in spec.split(",") if r.strip()})
    except ValueError:
        raise SystemExit(f"--rates {spec!r}: expected comma-separated numbers") from None
    if not rates or any(not (r > 0 and math.isfinite(r)) for r in rates):
        raise SystemExit(f"--rates {spec!r}: expected positive request rates")
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="demo-llama")
    ap.add_argument("--rates", default=DEFAULT_RATES, help="req/s, comma-separated")
    ap.add_argument("--rounds", type=int, default=1, help="sweeps over the rates")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per probe")
    ap.add_argument("--min-requests", type=int, default=40, help="fewest requests per probe")
    ap.add_argument("--length-scale", type=float, default=0.25, help="prompt lengths × this")
    ap.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    ap.add_argument("--ttft-scale", type=float, default=3.0, help="TTFT targets × this (§6.5: 3)")
    ap.add_argument("--tbt-scale", type=float, default=1.0, help="TBT targets × this")
    ap.add_argument(
        "--slo-scale",
        type=float,
        help="Table 2 × this before --ttft-scale (default: from this run's profile, as "
        "vs_vllm.py; pass a quiet machine's figure, e.g. its summary's, when other jobs load "
        "the profile)",
    )
    ap.add_argument(
        "--warmup-lengths",
        default="64,512,2048,6000",
        help="prompt lengths sent to each system, one at a time, before the first probe",
    )
    ap.add_argument("--systems", default="flowprefill,vllm-cp2k")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS")
    ap.add_argument("--profile", help="TTFT profile JSON (default: profiled here)")
    ap.add_argument("--out", default=f"runs/stack-colocated-{time.strftime('%Y%m%d-%H%M%S')}")
    args = ap.parse_args()
    rates = parse_rates(args.rates)
    for flag in ("rounds", "min_requests", "max_tokens"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be at least 1")
    for flag in ("duration", "length_scale", "ttft_scale", "tbt_scale", "slo_scale"):
        value = getattr(args, flag)
        if flag == "slo_scale" and value is None:
            continue
        if not (value > 0 and math.isfinite(value)):
            raise SystemExit(f"--{flag.replace('_', '-')} must be a positive number, got {value}")
    args.chunk_tokens = max(64, round(CHUNK_TOKENS_PAPER * args.length_scale))

    from flowprefill.bench import workload as wl
    from flowprefill.contracts import EngineConfig
    from flowprefill.contracts.slo import PAPER_TBT_SLOS_S
    from flowprefill.lab.sim.cost import build_cost_model
    from flowprefill.lab.sim.decode import DecodeCostModel
    from flowprefill.models import resolve_model_path
    from flowprefill.prefill.factory import build_executor, profile_executor
    from flowprefill.prefill.predictor.model import TTFTPredictor

    console = Console()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    console.print(f"load average before: {' '.join(f'{x:.2f}' for x in load_before)}")
    model_dir = resolve_model_path(args.model)
    profile = out / "ttft-profile.json"
    if args.profile:
        predictor = TTFTPredictor.load(args.profile)
    else:
        config = EngineConfig(model_path=str(model_dir))
        with console.status("profiling this machine's prefill"), build_executor(config) as ex:
            report = profile_executor(
                ex, num_points=8, repeats=2, max_tokens=8192, model_name=args.model
            )
        predictor = report.predictor
    predictor.save(profile)
    fit = predictor.fit_error
    console.print(
        "prefill profile: "
        + (
            f"fit error {fit.mean_abs_pct:.1f} % mean ({fit.max_abs_pct:.1f} % max); "
            if fit is not None
            else ""
        )
        + ", ".join(f"{n} tokens {predictor.predict_s(n) * 1e3:.0f} ms" for n in (128, 512, 2048))
    )
    cal = calibrate(predictor, args.length_scale)
    if args.slo_scale is not None:
        cal = replace(cal, slo_scale=args.slo_scale)
    scaled = {c: s * cal.slo_scale for c, s in wl.get_slo_table("llama3-8b").items()}
    ttft_s = {c: s * args.ttft_scale for c, s in scaled.items()}
    tbt_s = {c: s * args.tbt_scale for c, s in PAPER_TBT_SLOS_S.items()}
    slo_file = out / "slo.json"
    slo_file.write_text(json.dumps(ttft_s))
    console.print(ratio_table(cal, predictor, scaled))

    servers = build_servers(args, model_dir, profile, slo_file, out)
    names = [s.name for s in servers]
    model = str(model_dir)  # the gateway and vLLM both answer to the model's path
    longest = max(args.min_requests, math.ceil(max(rates) * args.duration))
    workload = replace(wl.qwen_like(longest, seed=args.seed), slo_table=ttft_s)
    probes: dict[str, dict[float, list[dict[str, Any]]]] = {n: {} for n in names}
    steps_ms: dict[str, float] = {}
    t_start = time.monotonic()
    try:
        with console.status("starting " + ", ".join(names) + " (a few minutes)"):
            for s in servers:
                s.start()
            wait_all(servers)
            loosest = max(ttft_s, key=lambda c: ttft_s[c])
            for s in servers:
                warm_up(s, model, [int(n) for n in args.warmup_lengths.split(",")], loosest)
        with console.status("timing each system's decode step when idle"):
            for s in servers:
                opts = options(s, model, args, ttft_s, tbt_s, args.seed)
                steps_ms[s.name] = idle_decode_step_ms(s, opts, max(4, args.max_tokens), 3)
        console.print(
            targets_table(args, cal, predictor, steps_ms, tbt_s, build_cost_model, DecodeCostModel)
        )
        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
        )
        with Progress(*columns, console=console) as progress:
            overall = progress.add_task("probes", total=args.rounds * len(rates) * len(servers))
            step = 0
            for rnd in range(args.rounds):
                for rate in rates:
                    # Interleaved: the order alternates from one rate to the next.
                    order = servers if step % 2 == 0 else list(reversed(servers))
                    step += 1
                    for s in order:
                        time.sleep(1.5)  # vLLM busy-waits 1 s after its last step
                        res = run_probe(
                            s, model, workload, rate, rnd, args, ttft_s, tbt_s, progress
                        )
                        probes[s.name].setdefault(rate, []).append(res)
                        progress.advance(overall)
                        a = res["classes"]["all"]
                        progress.console.print(
                            f"round {rnd + 1} {s.name:<14} {rate:6.3g} req/s "
                            f"({a['requests']} requests, {res['wall_s']:.0f} s): "
                            f"TTFT {a['ttft']:6.1%}  TBT {a['tbt']:6.1%} "
                            f"(every gap {a['tbt_every']:6.1%})  both {a['both']:6.1%}  "
                            f"errors {a['errors']}"
                            + "".join(f"  {k} {v:g}" for k, v in res["stack"].items())
                        )
    finally:
        for s in servers:
            s.stop()

    load_after = os.getloadavg()
    classes = sorted(ttft_s, key=lambda c: ttft_s[c])
    pooled = {n: {r: pool(ps) for r, ps in by_rate.items()} for n, by_rate in probes.items()}
    wide = Console(width=max(console.width, 170))
    wide.print(results_table(pooled, rates, [*classes, "all"]))
    goodputs = {}
    for n in names:
        both = [pooled[n][r]["all"]["both"] for r in rates]
        tried = [r for r in rates if pooled[n][r]["all"]["both"] >= TARGET]
        goodputs[n] = {
            "highest_passing_req_s": max(tried, default=None),
            "crossing_req_s": crossing(rates, both),
        }
    wide.print(ratio_to_baseline(pooled, rates, names, goodputs))
    console.print(
        f"load average before {' '.join(f'{x:.2f}' for x in load_before)}, after "
        f"{' '.join(f'{x:.2f}' for x in load_after)}; {time.monotonic() - t_start:.0f} s"
    )
    summary = {
        "command": " ".join(sys.argv),
        "settings": vars(args),
        "calibration": {**cal.__dict__, "paper_ratio": cal.paper_ratio, "cpu_ratio": cal.cpu_ratio},
        "ttft_slo_s": ttft_s,
        "tbt_slo_s": tbt_s,
        "tbt_rule": "mean gap between tokens ((last - first) / (n - 1)) within the class's "
        "TBT target, as the simulator; tbt_every: every gap within it",
        "idle_decode_step_ms": steps_ms,
        "load_average": {"before": load_before, "after": load_after},
        "wall_s": round(time.monotonic() - t_start),
        "goodput_both": goodputs,
        "systems": {n: {str(r): pooled[n][r] for r in rates} for n in names},
        "probes": {n: {str(r): ps for r, ps in by_rate.items()} for n, by_rate in probes.items()},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    title = (
        f"QwenTrace-like ×{args.length_scale:g}, TTFT targets {args.ttft_scale:g}× scaled "
        f"Table 2, TBT {', '.join(f'{c} {tbt_s[c] * 1e3:.0f}' for c in classes)} ms (mean "
        f"gap), {args.max_tokens} output tokens, seed {args.seed}"
    )
    plot(out / "colocated.png", pooled, rates, classes, ttft_s, tbt_s, title)
    console.print(f"wrote {out / 'summary.json'} and {out / 'colocated.png'}")


def run_probe(
    server: Server,
    model: str,
    workload: Workload,
    rate: float,
    rnd: int,
    args: argparse.Namespace,
    ttft_s: dict[str, float],
    tbt_s: dict[str, float],
    progress: Progress,
) -> dict[str, Any]:
    """One system at one rate: the seed's first ``max(min_requests, rate × duration)``
    requests, open loop, streamed."""
    from flowprefill.bench.client import replay

    opts = options(server, model, args, ttft_s, tbt_s, args.seed)
    n = max(args.min_requests, math.ceil(rate * args.duration))
    reqs = make_requests(workload.head(n), rate, args.length_scale)
    bar = progress.add_task(f"  {server.name} @ {rate:.3g} req/s", total=len(reqs))
    before = scrape_all(server)
    t0 = time.monotonic()
    # round_index from the round and the rate: every system gets the same prompts at a
    # (round, rate), and no server sees a prompt twice (vLLM's prefix cache would skip it).
    outcomes = asyncio.run(
        replay(
            reqs, opts, lambda _: progress.advance(bar), round_index=rnd * 10**6 + round(rate * 1e4)
        )
    )
    wall_s = time.monotonic() - t0
    progress.remove_task(bar)
    return {
        "rate": rate,
        "round": rnd,
        "wall_s": wall_s,
        "stack": hop_means_ms(before, scrape_all(server)),
        "classes": summarize(outcomes),
        "missed": [
            {
                "class": o.slo_class,
                "tokens": o.num_tokens,
                "ttft_s": o.ttft_s,
                "mean_gap_s": mean_gap_s(o),
                "error": o.error,
            }
            for o in outcomes
            if not (o.met and met_tbt_mean(o))
        ],
    }


if __name__ == "__main__":
    main()
