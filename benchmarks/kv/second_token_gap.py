"""The gap between the first token (from prefill) and the second (from decode) through
``flowprefill up``, per KV transport, in one run.

Starts one ``flowprefill up`` per transport (default: ``nixl`` and ``http``, the file
path) side by side, demo Llama (float32, 6 KiB of KV per token), and sends the same
streamed completions to each in turn (interleaved, a pause between requests so that vLLM's
idle busy-wait after one request does not land on the next). For each request the client
records when the first and the second token arrived; the gap is what the hand-off adds
to the time between tokens (plus one decode step)::

    python benchmarks/kv/second_token_gap.py                     # 1K, 4K, 8K tokens
    python benchmarks/kv/second_token_gap.py --tokens 8000 --repeats 5 --json gap.json

8,000 tokens is the largest prompt the demo model (8,192 positions) and decode's
``--max-model-len`` allow with room for the output.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.stack.common import Server, up_server, wait_all

KV_BYTES_PER_TOKEN = 6 * 2 * 64 * 4 * 2
"""demo-llama: layers × KV heads × head size × float32 × (K, V)."""


def stream_gap(client: httpx.Client, url: str, ids: list[int]) -> tuple[float, float, float]:
    """Seconds to the first token, from the first to the second (hand-off + a decode
    step), from the second to the third (a decode step alone)."""
    model = client.get(f"{url}/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": ids, "max_tokens": 8, "temperature": 0,
            "stream": True, "ignore_eos": True}  # fmt: skip
    stamps: list[float] = []
    t0 = time.perf_counter()
    # The loosest class, as a long prompt's would be: under text's target (under a second
    # here) the gateway abandons a prefill of a few thousand tokens as expired (503).
    with client.stream(
        "POST", f"{url}/v1/completions", json=body, headers={"x-slo-class": "file"}
    ) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                stamps.append(time.perf_counter())
                if len(stamps) == 3:
                    break
    if len(stamps) < 3:
        raise FewTokens(f"{url}: fewer than three tokens streamed (an early end of sequence)")
    return stamps[0] - t0, stamps[1] - stamps[0], stamps[2] - stamps[1]


class FewTokens(RuntimeError):
    """The random prompt's completion ended before its third token: draw another."""


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--transports", default="nixl,http")
    p.add_argument("--tokens", default="1000,4000,8000")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--pause", type=float, default=1.5, help="seconds between requests")
    p.add_argument("--out", default="runs/second-token-gap")
    p.add_argument("--json", help="write the samples here")
    args = p.parse_args(argv)
    console = Console()
    transports = args.transports.split(",")
    sizes = [int(t) for t in args.tokens.split(",")]
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)

    from flowprefill.models import named_model_dir
    from flowprefill.prefill.predictor.model import TTFTPredictor

    model_dir = named_model_dir("demo-llama")
    profile = out / "profile.json"
    TTFTPredictor.linear(2e-4).save(profile)
    servers: dict[str, Server] = {
        t: up_server(t, model_dir, profile, out, ["--kv-transport", t]) for t in transports
    }
    samples: dict[str, dict[int, list[float]]] = {t: {n: [] for n in sizes} for t in transports}
    steps: dict[str, dict[int, list[float]]] = {t: {n: [] for n in sizes} for t in transports}
    try:
        for s in servers.values():
            s.start()
        with console.status("starting the stacks"):
            wait_all(list(servers.values()))
        rng = random.Random(0)
        total = len(sizes) * args.repeats * len(transports)
        done = 0
        with httpx.Client(timeout=600) as client:
            for n in sizes:
                for r in range(args.repeats + 1):  # the first round warms each stack up
                    order = transports[r % len(transports) :] + transports[: r % len(transports)]
                    for t in order:
                        for _ in range(5):
                            ids = [rng.randrange(5, 30000) for _ in range(n)]
                            try:
                                ttft, gap, step = stream_gap(client, servers[t].base_url, ids)
                                break
                            except FewTokens:
                                time.sleep(args.pause)
                            except httpx.HTTPStatusError as e:
                                # On 2 shared cores a long prefill can miss two health
                                # probes and the gateway gives up its request (503): say
                                # so and draw again rather than lose the run.
                                console.print(f"{t} {n} tokens: {e.response.status_code}, again")
                                time.sleep(args.pause)
                        else:
                            raise RuntimeError(f"{t}: five prompts in a row ended early")
                        if r:
                            samples[t][n].append(gap)
                            steps[t][n].append(step)
                            done += 1
                            console.print(
                                f"[{done}/{total}] {t} {n} tokens: first token "
                                f"{ttft * 1e3:.0f} ms, second-token gap {gap * 1e3:.1f} ms, "
                                f"third {step * 1e3:.1f} ms"
                            )
                        time.sleep(args.pause)
    finally:
        for s in servers.values():
            s.stop()

    table = Table(
        title="Gap between the first and second token through flowprefill up (demo Llama)"
    )
    table.add_column("prompt tokens", justify="right")
    table.add_column("KV", justify="right")
    for t in transports:
        table.add_column(f"{t}: 1st→2nd ms", justify="right")
        table.add_column(f"{t}: 2nd→3rd ms", justify="right")
    if len(transports) > 1:
        table.add_column(f"{transports[1]} / {transports[0]}", justify="right")
    for n in sizes:
        row = [f"{n:,}", f"{n * KV_BYTES_PER_TOKEN / 2**20:.1f} MiB"]
        medians = []
        for t in transports:
            medians.append(statistics.median(samples[t][n]))
            row += [f"{medians[-1] * 1e3:.1f}", f"{statistics.median(steps[t][n]) * 1e3:.1f}"]
        if len(transports) > 1:
            row.append(f"{medians[1] / medians[0]:.2f}×")
        table.add_row(*row)
    console.print(table)
    result = {
        "transports": transports,
        "samples_s": {t: {str(n): v for n, v in d.items()} for t, d in samples.items()},
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
