"""TTFT through a running stack, one request at a time, by prompt length.

Start a stack first (``flowprefill up``), then::

    python benchmarks/stack/ttft.py --url http://127.0.0.1:8000 [--lengths 100,800,1400]
        [--repeats 15] [--max-tokens 4] [--gap 0]

Each round sends one streamed completion per length (random token ids, so no prefix-cache
hits), in turn, and times the first chunk carrying a token. With ``--max-tokens 1`` the
gateway skips decode and the KV hand-off, so comparing 1 and 4 shows what decode and the
hand-off add to the next request's TTFT; ``--gap`` waits between requests.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import httpx
from rich.console import Console
from rich.table import Table


def first_token_ms(client: httpx.Client, url: str, model: str, n: int, max_tokens: int) -> float:
    ids = [random.randrange(1, 30000) for _ in range(n)]
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "stream": True}
    t0 = time.perf_counter()
    ttft = None
    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():  # read to the end: the next request starts clean
            if ttft is None and line.startswith("data:") and '"choices"' in line:
                ttft = (time.perf_counter() - t0) * 1e3
    if ttft is None:
        raise RuntimeError(f"no token in the answer to a {n}-token prompt")
    return ttft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--lengths", default="100,800,1400")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--gap", type=float, default=0.0, help="seconds between requests")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    console = Console()
    with httpx.Client(timeout=120) as client:
        model = client.get(f"{args.url}/v1/models").json()["data"][0]["id"]
        samples: dict[int, list[float]] = {n: [] for n in lengths}
        with console.status("timing") as status:
            for rep in range(args.repeats):
                for n in lengths:
                    time.sleep(args.gap)
                    samples[n].append(first_token_ms(client, args.url, model, n, args.max_tokens))
                status.update(f"round {rep + 1}/{args.repeats}")
    table = Table(title=f"TTFT at {args.url}, max_tokens {args.max_tokens}, one at a time")
    for col in ("prompt tokens", "p50 ms", "p90 ms", "min ms", "n"):
        table.add_column(col, justify="right")
    for n, v in samples.items():
        v.sort()
        table.add_row(
            str(n),
            f"{statistics.median(v):.1f}",
            f"{v[int(0.9 * (len(v) - 1))]:.1f}",
            f"{v[0]:.1f}",
            str(len(v)),
        )
    console.print(table)


if __name__ == "__main__":
    main()
