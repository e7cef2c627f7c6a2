"""Uniform load as a new user measures it: ``vllm bench serve`` (vLLM's own client, random
prompts of one length) against ``flowprefill up`` and against ``vllm serve`` alone on the
same model, interleaved.

Both systems are started once and stay up (the one not being measured is idle); each
round runs the client against every system in turn, the order alternating between rounds
(A B, B A, ...), with the same seed for every system within a round, so load from other
jobs on this machine falls on both alike. Per run: TTFT mean / median / p99, TPOT mean /
median, and the CPU seconds each process used (gateway, prefill, vLLM API server, engine
core, worker, and the client)::

    python benchmarks/stack/uniform.py [--rate 2] [--num-prompts 40] [--input-len 512]
        [--output-len 16] [--rounds 3] [--warmup 4] [--systems flowprefill,vllm]
        [--variant NAME='--threads 1' ...]

``--variant NAME=ARGS`` adds a ``flowprefill up`` with extra arguments (and ``KEY=VALUE``
words taken as its environment), e.g. ``--variant 'spin=FLOWPREFILL_VLLM_IDLE_SPIN_S=1'``.
Needs the ``decode`` extra (vLLM).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

# Run as a script: the repository root goes on the path so that ``benchmarks`` imports as a
# package.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.stack.common import (
    Server,
    cpu_delta,
    hop_means_ms,
    scrape_all,
    up_server,
    vllm_bench_serve,
    vllm_server,
    wait_all,
)

METRICS = (
    ("mean_ttft_ms", "TTFT mean"),
    ("median_ttft_ms", "TTFT p50"),
    ("p99_ttft_ms", "TTFT p99"),
    ("mean_tpot_ms", "TPOT mean"),
    ("median_tpot_ms", "TPOT p50"),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="demo-llama")
    ap.add_argument("--rate", type=float, default=2.0)
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--warmup", type=int, default=4, help="requests per system before the rounds (0: none)"
    )
    ap.add_argument("--systems", default="flowprefill,vllm")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS")
    ap.add_argument(
        "--before-tree",
        help="also run `flowprefill up` of this checkout as system 'before' (a git worktree "
        "of an earlier commit)",
    )
    ap.add_argument("--profile", help="TTFT profile JSON for up (default: profiled once here)")
    ap.add_argument("--out", default=f"runs/stack-uniform-{time.strftime('%Y%m%d-%H%M%S')}")
    args = ap.parse_args()

    from flowprefill.models import resolve_model_path

    console = Console()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model_path(args.model)
    profile = Path(args.profile) if args.profile else out / "ttft-profile.json"
    if not args.profile:
        from flowprefill.contracts import EngineConfig
        from flowprefill.prefill.factory import build_executor, quick_profile

        with build_executor(EngineConfig(model_path=str(model_dir))) as executor:
            quick_profile(executor, console, model_name=args.model).save(profile)

    servers: list[Server] = []
    for system in args.systems.split(","):
        if system == "flowprefill":
            servers.append(up_server(system, model_dir, profile, out, []))
        elif system == "vllm":
            servers.append(vllm_server("vllm", model_dir, out))
        else:
            raise SystemExit(f"unknown system {system!r} (flowprefill, vllm; --variant for more)")
    if args.before_tree:
        tree = Path(args.before_tree).resolve()
        servers.append(up_server("before", model_dir, profile, out, [], tree))
    for v in args.variant:
        name, _, rest = v.partition("=")
        servers.append(up_server(name, model_dir, profile, out, shlex.split(rest)))

    results: dict[str, list[dict[str, Any]]] = {s.name: [] for s in servers}
    try:
        with console.status("starting " + ", ".join(s.name for s in servers)):
            for s in servers:
                s.start()
            wait_all(servers)
        bench_log = out / "vllm-bench.log"
        with console.status(f"warm-up: {args.warmup} requests each"):
            for s in servers if args.warmup else []:
                vllm_bench_serve(
                    s.base_url, str(model_dir), model_dir, out / f"warmup-{s.name}.json",
                    input_len=args.input_len, output_len=args.output_len, rate=args.rate,
                    num_prompts=args.warmup, seed=1000, log=bench_log,
                )  # fmt: skip
        for rnd in range(args.rounds):
            order = servers if rnd % 2 == 0 else list(reversed(servers))
            for s in order:
                with console.status(f"round {rnd + 1}/{args.rounds}: {s.name}"):
                    time.sleep(3)  # vLLM alone busy-waits 1 s after its last step
                    before, metrics = s.cpu_s(), scrape_all(s)
                    res = vllm_bench_serve(
                        s.base_url, str(model_dir), model_dir, out / f"{s.name}-r{rnd}.json",
                        input_len=args.input_len, output_len=args.output_len, rate=args.rate,
                        num_prompts=args.num_prompts, seed=rnd, log=bench_log,
                    )  # fmt: skip
                    res["server_cpu_s"] = cpu_delta(before, s.cpu_s())
                    res["hops_ms"] = hop_means_ms(metrics, scrape_all(s))
                results[s.name].append(res)
                console.print(
                    f"round {rnd + 1} {s.name}: "
                    + ", ".join(f"{label} {res[k]:.1f} ms" for k, label in METRICS)
                    + f"; failed {res['failed']}"
                    + "".join(f"; {k} {v:g}" for k, v in res["hops_ms"].items())
                )
    finally:
        for s in servers:
            s.stop()

    t = Table(
        title=f"vllm bench serve: random {args.input_len}-token prompts, {args.output_len} "
        f"output tokens, {args.rate:g} req/s, {args.num_prompts} requests; mean over "
        f"{args.rounds} interleaved rounds (min–max)"
    )
    t.add_column("system")
    for _, label in METRICS:
        t.add_column(f"{label} ms", justify="right")
    t.add_column("inside the stack, mean", justify="left")
    t.add_column("CPU s per run (by process)", justify="left")
    for name, runs in results.items():
        cells = []
        for k, _ in METRICS:
            v = [r[k] for r in runs]
            cells.append(f"{statistics.mean(v):.0f} ({min(v):.0f}–{max(v):.0f})")
        hops: dict[str, float] = {}
        for r in runs:
            for k, v in r.get("hops_ms", {}).items():
                hops[k] = hops.get(k, 0.0) + v / len(runs)
        cells.append(", ".join(f"{k} {v:.1f}" for k, v in hops.items()))
        cpu: dict[str, float] = {}
        for r in runs:
            for role, sec in {**r["server_cpu_s"], "client": r["client_cpu_s"]}.items():
                cpu[role] = cpu.get(role, 0.0) + sec / len(runs)
        cells.append(", ".join(f"{k} {v:.1f}" for k, v in sorted(cpu.items()) if v >= 0.05))
        t.add_row(name, *cells)
    Console(width=max(console.width, 160)).print(t)
    summary = {
        "settings": vars(args),
        "runs": {
            name: [
                {
                    k: r[k]
                    for k in (*dict(METRICS), "failed", "server_cpu_s", "client_cpu_s", "hops_ms")
                }
                for r in runs
            ]
            for name, runs in results.items()
        },
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    console.print(f"results in {out}")


if __name__ == "__main__":
    main()
