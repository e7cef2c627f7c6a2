"""Decode-aware preemption through ``flowprefill up``: TBT gaps of a streaming decode and
TTFT of long prompts arriving beside it, switch off vs on (docs/executor.md).

Two stacks of this checkout run side by side (``off``: ``flowprefill up``; ``on``: the same
with ``--decode-aware``; the file hand-off, as the other stack benchmarks; one TTFT
profile for both), measured one after the other, the order alternating between rounds so
that other load on the machine falls on both alike. One probe: a ``text``-class request
streams ``--stream-tokens`` output tokens through the gateway; once it streams,
``--prompts`` long prompts (``--tokens`` tokens, class ``file``) arrive ``--spacing`` s
apart, each streamed until its first token (its TTFT at the client). Reported per system:
the stream's gaps between tokens while the long prompts are in flight (median, p90, max,
share within ``--tbt`` s), the long prompts' TTFT, and the prefill's decode parks.

    python benchmarks/stack/decode_aware.py [--rounds 2] [--tokens 3000] [--prompts 3]
        [--spacing 1.0] [--stream-tokens 600] [--tbt 0.1] [--out runs/decode-aware]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.stack.common import Server, scrape, up_server, wait_all
from flowprefill.contracts.metrics import PREFILL_DECODE_PARKED, PREFILL_DECODE_PARKS

PARKS = f"{PREFILL_DECODE_PARKS}_total"
PARKED = f"{PREFILL_DECODE_PARKED}_total"


def _stream(server: Server, body: dict[str, Any], cls: str, times: list[float],
            stop: threading.Event | None = None) -> None:  # fmt: skip
    """Stream a completion through the gateway; append each chunk's arrival time."""
    headers = {"x-slo-class": cls}
    with httpx.stream(
        "POST", f"{server.base_url}/v1/completions", json={**body, "stream": True},
        headers=headers, timeout=600,
    ) as r:  # fmt: skip
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                times.append(time.monotonic())
                if stop is None or stop.is_set():
                    return


def probe(
    server: Server, model: str, args: argparse.Namespace, rng: random.Random
) -> dict[str, Any]:
    before = scrape(server.metrics_urls["prefill"])
    ticks: list[float] = []
    stop = threading.Event()
    streamer = threading.Thread(
        target=_stream,
        args=(
            server,
            {
                "model": model,
                "prompt": [rng.randrange(1, 1000) for _ in range(16)],
                "max_tokens": args.stream_tokens,
                "ignore_eos": True,
            },
            "text",
            ticks,
            stop,
        ),
        daemon=True,
    )
    streamer.start()
    deadline = time.monotonic() + 120
    while len(ticks) < 20:
        if time.monotonic() > deadline or not streamer.is_alive():
            raise RuntimeError(f"{server.name}: the decode stream did not start")
        time.sleep(0.01)
    firsts: list[list[float]] = []
    sent: list[float] = []
    threads = []
    t0 = time.monotonic()
    for i in range(args.prompts):
        out: list[float] = []
        firsts.append(out)
        body = {"model": model, "prompt": [rng.randrange(1, 1000) for _ in range(args.tokens)],
                "max_tokens": 2}  # fmt: skip
        sent.append(time.monotonic())
        t = threading.Thread(target=_stream, args=(server, body, "file", out), daemon=True)
        t.start()
        threads.append(t)
        if i + 1 < args.prompts:
            time.sleep(args.spacing)
    for t in threads:
        t.join(600)
    t1 = time.monotonic()
    stop.set()
    streamer.join(60)
    after = scrape(server.metrics_urls["prefill"])
    gaps = [b - a for a, b in itertools.pairwise(ticks) if t0 <= b <= t1]
    ttfts = [f[0] - s for f, s in zip(firsts, sent, strict=True) if f]
    return {
        "gaps_s": gaps,
        "ttft_s": ttfts,
        "window_s": t1 - t0,
        "parks": after.get(PARKS, 0.0) - before.get(PARKS, 0.0),
        "parked_s": after.get(PARKED, 0.0) - before.get(PARKED, 0.0),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo-llama")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=3000, help="tokens per long prompt")
    ap.add_argument("--prompts", type=int, default=3, help="long prompts per probe")
    ap.add_argument("--spacing", type=float, default=1.0, help="seconds between them")
    ap.add_argument("--stream-tokens", type=int, default=600, help="the stream's max_tokens")
    ap.add_argument("--tbt", type=float, default=0.1, help="TBT target (s), also the switch's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", help="TTFT profile JSON (default: profiled by the first up)")
    ap.add_argument("--out", default=f"runs/decode-aware-{time.strftime('%Y%m%d-%H%M%S')}")
    args = ap.parse_args()
    from flowprefill.models import resolve_model_path

    console = Console(width=140)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model_path(args.model)
    profile = Path(args.profile).resolve() if args.profile else out / "ttft-profile.json"
    if not profile.exists():
        from flowprefill.contracts import EngineConfig
        from flowprefill.prefill.factory import build_backend, quick_profile

        with build_backend(EngineConfig(model_path=str(model_dir))) as backend:
            quick_profile(backend, console, model_name=args.model).save(profile)
    servers = {
        "off": up_server("off", model_dir, profile, out, []),
        "on": up_server("on", model_dir, profile, out,
                        ["--decode-aware", "--decode-aware-tbt", str(args.tbt)]),
    }  # fmt: skip
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in servers}
    rng = random.Random(args.seed)
    try:
        for s in servers.values():
            s.start()
        wait_all(list(servers.values()))
        for r in range(args.rounds):
            order = list(servers) if r % 2 == 0 else list(servers)[::-1]
            for name in order:
                res = probe(servers[name], str(model_dir), args, rng)
                results[name].append(res)
                console.print(f"round {r + 1} {name}: {len(res['gaps_s'])} gaps, "
                              f"TTFT {[round(t, 2) for t in res['ttft_s']]}, "
                              f"parks {res['parks']:.0f}")  # fmt: skip
    finally:
        for s in servers.values():
            s.stop()
    title = (
        f"decode-aware preemption through up ({args.rounds} rounds, "
        f"{args.prompts} × {args.tokens}-token prompts {args.spacing} s apart)"
    )
    table = Table(title=title)
    for col in ("switch", "gaps", "median gap", "p90 gap", "max gap", f"within {args.tbt} s",
                "mean TTFT", "max TTFT", "parks/s", "parked"):  # fmt: skip
        table.add_column(col)
    summary: dict[str, Any] = {"args": vars(args), "systems": {}}
    for name, runs in results.items():
        gaps = sorted(g for res in runs for g in res["gaps_s"])
        ttfts = [t for res in runs for t in res["ttft_s"]]
        window = sum(res["window_s"] for res in runs)
        parks = sum(res["parks"] for res in runs)
        parked = sum(res["parked_s"] for res in runs)
        if not gaps or not ttfts:
            table.add_row(name, "0", *["-"] * 8)
            continue
        row = {
            "gaps": len(gaps),
            "median_gap_s": statistics.median(gaps),
            "p90_gap_s": gaps[int(0.9 * (len(gaps) - 1))],
            "max_gap_s": gaps[-1],
            "within_tbt": sum(g <= args.tbt for g in gaps) / len(gaps),
            "mean_ttft_s": statistics.fmean(ttfts),
            "max_ttft_s": max(ttfts),
            "parks_per_s": parks / window,
            "parked_s": parked,
        }
        summary["systems"][name] = row
        table.add_row(
            name, str(len(gaps)), f"{row['median_gap_s'] * 1e3:.0f} ms",
            f"{row['p90_gap_s'] * 1e3:.0f} ms", f"{row['max_gap_s'] * 1e3:.0f} ms",
            f"{row['within_tbt']:.0%}", f"{row['mean_ttft_s']:.2f} s",
            f"{row['max_ttft_s']:.2f} s", f"{row['parks_per_s']:.1f}", f"{parked:.2f} s",
        )  # fmt: skip
    console.print(table)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    console.print(f"results: {out / 'summary.json'}")


if __name__ == "__main__":
    main()
