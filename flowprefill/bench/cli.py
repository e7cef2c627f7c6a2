"""``flowprefill bench``: replay a workload against any OpenAI-compatible endpoint.

Reports per-class TTFT attainment, p50/p99 TTFT, TPOT, TBT attainment (every time between
tokens within the class's TBT SLO; docs/bench.md) and goodput (the highest tried rate with
≥ 90 % TTFT attainment) as a table, a JSON file and a PNG plot.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import Progress

from flowprefill.contracts.deployment import SLO_CLASS_HEADER
from flowprefill.errors import InvalidRequestError

if TYPE_CHECKING:
    from flowprefill.bench.client import Outcome


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="OpenAI-compatible base URL")
    p.add_argument("--model", help="model name (default: the first of /v1/models)")
    p.add_argument(
        "--workload",
        default="qwen-like",
        help="qwen-like, sharegpt-like, or a trace file (.jsonl / .csv)",
    )
    p.add_argument("--num-requests", type=int, default=100, help="requests per rate")
    p.add_argument("--duration", type=float, help="seconds per rate (overrides --num-requests)")
    p.add_argument("--rates", default="1", help="comma-separated request rates (req/s)")
    p.add_argument("--arrival", default="poisson", choices=["poisson", "gamma"])
    p.add_argument(
        "--length-scale",
        type=float,
        default=1.0,
        help="multiply prompt lengths (small machines: e.g. 0.1)",
    )
    p.add_argument("--max-prompt-tokens", type=int, default=32768)
    p.add_argument(
        "--slo-table",
        default="llama3-8b",
        help="paper model name (Table 2) or a JSON file {class: seconds}",
    )
    p.add_argument("--slo-scale", type=float, default=1.0, help="multiply every TTFT SLO")
    p.add_argument(
        "--tbt-slo",
        default="paper",
        help="time-between-tokens SLO per class: 'paper' (§6.5: text/image 0.1 s, "
        "search/file 0.2 s; other classes none), seconds for every class, a JSON file "
        "{class: seconds}, or 'none'",
    )
    p.add_argument("--max-tokens", type=int, default=4, help="output tokens per request")
    p.add_argument("--vocab-size", type=int, default=1000, help="prompt token ids are < this")
    p.add_argument(
        "--class-header",
        default=SLO_CLASS_HEADER,
        help="header carrying the class name ('' to send none)",
    )
    p.add_argument(
        "--vllm-priority",
        action="store_true",
        help="send vLLM's `priority` field (tightest SLO first)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="report folder (default runs/bench-<time>)")


def _slo_table(spec: str) -> dict[str, float]:
    from flowprefill.bench.workload import get_slo_table

    path = Path(spec)
    if path.suffix == ".json":
        try:
            table = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise InvalidRequestError(f"--slo-table {spec}: {e}") from None
        if not isinstance(table, dict) or not all(
            isinstance(v, int | float) and v > 0 for v in table.values()
        ):
            raise InvalidRequestError(f"--slo-table {spec}: expected {{class: seconds > 0}}")
        return {str(k): float(v) for k, v in table.items()}
    return get_slo_table(spec)


def _tbt_slos(spec: str, classes: list[str]) -> dict[str, float]:
    """``--tbt-slo`` as seconds per class (classes without one are left out)."""
    from flowprefill.contracts.slo import PAPER_TBT_SLOS_S

    if spec == "none":
        return {}
    if spec == "paper":
        return {c: PAPER_TBT_SLOS_S[c] for c in classes if c in PAPER_TBT_SLOS_S}
    try:
        seconds = float(spec)
    except ValueError:
        pass
    else:
        if not (seconds > 0 and math.isfinite(seconds)):
            raise InvalidRequestError(f"--tbt-slo {spec}: expected seconds > 0")
        return dict.fromkeys(classes, seconds)
    try:
        table = json.loads(Path(spec).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InvalidRequestError(
            f"--tbt-slo {spec}: not 'paper', 'none', seconds or a readable JSON file ({e})"
        ) from None
    if not isinstance(table, dict) or not all(
        isinstance(v, int | float) and v > 0 and math.isfinite(v) for v in table.values()
    ):
        raise InvalidRequestError(f"--tbt-slo {spec}: expected {{class: seconds > 0}}")
    return {str(k): float(v) for k, v in table.items()}


def run(args: argparse.Namespace) -> int:
    import httpx

    from flowprefill.bench import workload as wl
    from flowprefill.bench.client import SendOptions, replay
    from flowprefill.bench.report import goodput, summarize, table, write
    from flowprefill.bench.traces import load_trace

    console = Console()
    try:
        rates = sorted(float(r) for r in args.rates.split(","))
    except ValueError:
        raise InvalidRequestError(f"--rates {args.rates!r}: expected numbers like 1,2,4") from None
    for r in rates:
        wl.check_positive("--rates", r)
    wl.check_positive("--length-scale", args.length_scale)
    slo_table = _slo_table(args.slo_table)
    n = args.num_requests
    if args.duration is not None:
        wl.check_positive("--duration", args.duration)
        n = max(1, round(max(rates) * args.duration))
    if args.workload == "qwen-like":
        workload = wl.qwen_like(n, seed=args.seed, arrival=args.arrival)
    elif args.workload == "sharegpt-like":
        workload = wl.sharegpt_like(n, seed=args.seed)
    else:
        workload = load_trace(args.workload, slo_table, max_tokens=args.max_prompt_tokens)
    workload = replace(workload, slo_table=slo_table)
    model = args.model
    if model is None:
        try:
            model = httpx.get(f"{args.url}/v1/models", timeout=10).json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
            raise InvalidRequestError(f"--url {args.url}: cannot list models ({e})") from None
    priorities = None
    if args.vllm_priority:
        order = sorted(slo_table, key=lambda c: slo_table[c])
        priorities = {c: i for i, c in enumerate(order)}
    tbt_slos = _tbt_slos(args.tbt_slo, workload.classes)
    opts = SendOptions(
        url=args.url.rstrip("/"),
        model=model,
        max_tokens=args.max_tokens,
        vocab_size=args.vocab_size,
        class_header=args.class_header or None,
        priorities=priorities,
        tbt_slos_s=tbt_slos,
        seed=args.seed,
    )
    rate_results: dict[float, dict[str, Any]] = {}
    raw: dict[float, list[Outcome]] = {}
    for round_index, rate in enumerate(rates):
        reqs = workload.requests(rate, slo_scale=args.slo_scale)
        for req in reqs:
            scaled = round(req.num_tokens * args.length_scale)
            req.num_tokens = max(1, min(args.max_prompt_tokens, scaled))
        if args.duration is not None:
            reqs = [q for q in reqs if q.arrival_s <= args.duration] or reqs[:1]
        with Progress(console=console, transient=True) as progress:
            bar = progress.add_task(f"rate {rate:g} req/s", total=len(reqs))
            outcomes = asyncio.run(
                replay(
                    reqs,
                    opts,
                    lambda _, bar=bar: progress.advance(bar),  # type: ignore[misc]
                    round_index=round_index,
                )
            )
        raw[rate] = outcomes
        rate_results[rate] = summarize(outcomes)
    title = f"{workload.name} against {args.url} (SLO scale {args.slo_scale:g})"
    console.print(table(rate_results, title))
    g = goodput(rate_results)
    console.print(f"goodput (≥90% TTFT attainment): {'-' if g is None else f'{g:g} req/s'}")
    out = Path(args.out or f"runs/bench-{time.strftime('%Y%m%d-%H%M%S')}")
    meta = {
        "title": title,
        "url": args.url,
        "model": model,
        "workload": workload.name,
        "slo_table_s": slo_table,
        "slo_scale": args.slo_scale,
        "tbt_slo_s": tbt_slos,
        "tbt_rule": "a request meets its TBT SLO when it succeeded and every gap between "
        "its streamed tokens was within the SLO",
        "length_scale": args.length_scale,
        "max_tokens": args.max_tokens,
    }
    json_path, png_path = write(out, meta, rate_results, raw)
    console.print(f"wrote {json_path}" + (f" and {png_path}" if png_path else ""))
    return 0
