"""What sharing a small CPU host with vLLM decode does to a prefill instance.

Start a stack first (``flowprefill up --port 8000 --kv-transport shared_dir``: the file
path, whose connector caps vLLM's busy-wait; prefill on 8100, vLLM decode on
8200), then::

    python benchmarks/stack/prefill_beside_decode.py [--prefill-url http://127.0.0.1:8100]
        [--decode-url http://127.0.0.1:8200] [--tokens 800] [--repeats 6] [--stop-worker]

Three measurements, the first two straight against the prefill instance's ``/v1/prefill``:

1. the KV hand-off write: wall time of a prefill answered with the hand-off written
   (non-streamed answer: the token waits for the file) vs one asking for no hand-off,
   interleaved, at 100 and 1,400 tokens;
2. the engine's own prefill time (``ttft_s`` of the answer) of a ``--tokens`` prompt one
   second after nothing, 0.3 s after a one-token vLLM request, and (``--stop-worker``) the
   same with vLLM's worker process paused (SIGSTOP) meanwhile — so any difference is
   what that process does between steps;
3. vLLM's own decode speed (ms per output token of a 32-token completion), so that a cap
   on vLLM's busy-wait is seen to cost decode nothing.

Run it once with ``flowprefill up --kv-transport shared_dir`` as is (vLLM's idle busy-wait
capped) and once with ``FLOWPREFILL_VLLM_IDLE_SPIN_S= flowprefill up --kv-transport
shared_dir`` (empty: vLLM's default 1 s busy-wait).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import httpx
from rich.console import Console
from rich.table import Table

from flowprefill.contracts.deployment import DECODE_PORT, PREFILL_API_PATH, PREFILL_PORT
from flowprefill.contracts.prefill_api import PrefillRequest, PrefillResponse


def prefill(client: httpx.Client, url: str, n: int, hand_off: bool) -> tuple[float, float]:
    """(wall ms, engine ms) of one prefill of ``n`` random tokens."""
    ids = [random.randrange(1, 30000) for _ in range(n)]
    body = PrefillRequest(
        request_id=f"bench-{time.time_ns()}",
        prompt_token_ids=ids,
        ttft_slo_s=60.0,
        slo_class="bench",
        hand_off_kv=hand_off,
    )
    t0 = time.perf_counter()
    r = client.post(f"{url}{PREFILL_API_PATH}", json=body.model_dump())
    r.raise_for_status()
    wall_ms = (time.perf_counter() - t0) * 1e3
    return wall_ms, PrefillResponse.model_validate_json(r.content).ttft_s * 1e3


def vllm_request(client: httpx.Client, url: str, model: str) -> None:
    ids = [random.randrange(1, 30000) for _ in range(100)]
    body = {"model": model, "prompt": ids, "max_tokens": 1}
    client.post(f"{url}/v1/completions", json=body).raise_for_status()


def decode_ms_per_token(client: httpx.Client, url: str, model: str, tokens: int = 32) -> float:
    ids = [random.randrange(1, 30000) for _ in range(20)]
    body = {"model": model, "prompt": ids, "max_tokens": tokens, "ignore_eos": True}
    t0 = time.perf_counter()
    client.post(f"{url}/v1/completions", json=body).raise_for_status()
    return (time.perf_counter() - t0) * 1e3 / tokens


@contextmanager
def decoding(url: str, model: str, streams: int, tokens: int = 256) -> Iterator[None]:
    """``streams`` vLLM completions of ``tokens`` tokens decoding for the block: sent in
    threads, the block entered once each has its first token (0.3 s after sending; a
    20-token prompt's prefill is a few ms), the threads joined after it."""
    import threading

    def one() -> None:
        ids = [random.randrange(1, 30000) for _ in range(20)]
        body = {"model": model, "prompt": ids, "max_tokens": tokens, "ignore_eos": True}
        httpx.post(f"{url}/v1/completions", json=body, timeout=600).raise_for_status()

    threads = [threading.Thread(target=one) for _ in range(streams)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    try:
        yield
    finally:
        for t in threads:
            t.join()


def vllm_workers() -> list[int]:
    out = subprocess.run(["pgrep", "-f", "VLLM::Worker"], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


@contextmanager
def paused(pids: list[int]) -> Iterator[None]:
    """``pids`` stopped for the block; every one stopped is continued, whatever happens (a
    process gone meanwhile is skipped)."""
    stopped: list[int] = []
    try:
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
        yield
    finally:
        for pid in stopped:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--prefill-url", default=f"http://127.0.0.1:{PREFILL_PORT}")
    ap.add_argument("--decode-url", default=f"http://127.0.0.1:{DECODE_PORT}")
    ap.add_argument("--tokens", type=int, default=800)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--stop-worker", action="store_true", help="also pause vLLM's worker")
    ap.add_argument(
        "--busy-streams",
        type=int,
        default=4,
        help="vLLM completions decoding during the 'decode busy' prefill (0: no such row)",
    )
    args = ap.parse_args()
    console = Console()
    med = statistics.median
    with httpx.Client(timeout=120) as client:
        model = client.get(f"{args.decode_url}/v1/models").json()["data"][0]["id"]
        workers = vllm_workers() if args.stop_worker else []
        if args.stop_worker and not workers:
            raise SystemExit("--stop-worker: no VLLM::Worker process found")

        write = Table(title="KV hand-off write (wall ms, median)")
        for col in ("prompt tokens", "no hand-off", "hand-off written", "difference"):
            write.add_column(col, justify="right")
        with console.status("timing the hand-off write"):
            for n in (100, 1400):
                with_kv, without = [], []
                for _ in range(args.repeats):
                    without.append(prefill(client, args.prefill_url, n, False)[0])
                    with_kv.append(prefill(client, args.prefill_url, n, True)[0])
                a, b = med(without), med(with_kv)
                write.add_row(str(n), f"{a:.1f}", f"{b:.1f}", f"{b - a:+.1f}")
        console.print(write)

        runs: dict[str, list[float]] = {"after 1 s idle": [], "0.3 s after a vLLM request": []}
        if workers:
            runs["same, vLLM worker paused"] = []
        busy = f"during {args.busy_streams} vLLM decodes"
        if args.busy_streams > 0:
            runs[busy] = []
        with console.status("timing prefill beside decode"):
            for _ in range(args.repeats):
                time.sleep(1.0)
                runs["after 1 s idle"].append(
                    prefill(client, args.prefill_url, args.tokens, False)[1]
                )
                vllm_request(client, args.decode_url, model)
                time.sleep(0.3)
                runs["0.3 s after a vLLM request"].append(
                    prefill(client, args.prefill_url, args.tokens, False)[1]
                )
                if workers:
                    time.sleep(1.0)
                    vllm_request(client, args.decode_url, model)
                    with paused(workers):
                        time.sleep(0.3)
                        runs["same, vLLM worker paused"].append(
                            prefill(client, args.prefill_url, args.tokens, False)[1]
                        )
                if args.busy_streams > 0:
                    time.sleep(1.0)
                    with decoding(args.decode_url, model, args.busy_streams):
                        runs[busy].append(prefill(client, args.prefill_url, args.tokens, False)[1])
    table = Table(title=f"engine prefill time of {args.tokens} tokens (ms)")
    for col in ("when", "median", "min", "max", "vs idle"):
        table.add_column(col, justify="right")
    idle = med(runs["after 1 s idle"])
    for when, v in runs.items():
        table.add_row(
            when, f"{med(v):.0f}", f"{min(v):.0f}", f"{max(v):.0f}", f"{med(v) / idle:.2f}x"
        )
    console.print(table)
    with httpx.Client(timeout=600) as client, console.status("timing vLLM decode"):
        per_token = [
            decode_ms_per_token(client, args.decode_url, model) for _ in range(args.repeats)
        ]
    console.print(
        f"vLLM decode, 32-token completions: {med(per_token):.1f} ms per token "
        f"(median of {args.repeats}; max {max(per_token):.1f})"
    )


if __name__ == "__main__":
    main()
