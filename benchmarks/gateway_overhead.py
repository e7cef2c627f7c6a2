"""Gateway overhead: latency it adds per request and requests/s it sustains (2 cores).

Stub upstreams answer instantly — a prefill stub returns a fixed first token and a decode
stub streams a few fixed tokens — so what is measured is the gateway alone: parsing,
classification, tokenization, routing, two upstream calls and the SSE relay. Each
process (stubs, gateway, load generator) is separate, as in a deployment.

    python benchmarks/gateway_overhead.py [--seconds 10] [--concurrency 32]

Added latency = p50/p99 of (client → gateway → stubs) minus the stubs called directly in
sequence (prefill then decode) by the same client, interleaved.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

DECODE_TOKENS = 4


def stub_app():  # type: ignore[no-untyped-def]
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    app = FastAPI()

    @app.post("/v1/prefill")
    async def prefill(body: dict) -> dict:  # type: ignore[type-arg]
        return {
            "request_id": body["request_id"],
            "first_token_id": 42,
            "num_prompt_tokens": len(body["prompt_token_ids"]),
            "queue_and_prefill_ms": 0.1,
            "met_slo": True,
            "num_preemptions": 0,
            "batch_size": 1,
            "kv_transfer_params": None,
        }

    @app.post("/v1/completions")
    async def completions(body: dict) -> StreamingResponse:  # type: ignore[type-arg]
        async def gen():  # type: ignore[no-untyped-def]
            for i in range(min(DECODE_TOKENS, body.get("max_tokens", 1))):
                chunk = {"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    @app.get("/health")
    @app.get("/ready")
    async def ok() -> dict:  # type: ignore[type-arg]
        return {"status": "ok"}

    return app


def serve_stub(port: int) -> None:
    import uvicorn

    uvicorn.run(stub_app(), host="127.0.0.1", port=port, log_level="error")


def serve_gateway(config: str, table: str, port: int) -> None:
    import uvicorn

    from flowprefill.contracts import GatewayConfig
    from flowprefill.gateway.app import create_gateway_app
    from flowprefill.gateway.cli import build_state

    state = build_state(GatewayConfig.model_validate_json(Path(config).read_text()), table)
    uvicorn.run(create_gateway_app(state), host="127.0.0.1", port=port, log_level="error")


async def one_via_gateway(c: httpx.AsyncClient, url: str) -> float:
    t0 = time.perf_counter()
    async with c.stream(
        "POST",
        f"{url}/v1/completions",
        json={
            "model": "tiny",
            "prompt": "The quick brown fox jumps over the lazy dog",
            "max_tokens": DECODE_TOKENS + 1,
            "stream": True,
        },
    ) as r:
        async for _ in r.aiter_lines():
            pass
    return time.perf_counter() - t0


async def one_direct(c: httpx.AsyncClient, stub: str) -> float:
    t0 = time.perf_counter()
    await c.post(
        f"{stub}/v1/prefill",
        json={"request_id": "x", "prompt_token_ids": [1] * 10, "ttft_budget_ms": 1000},
    )
    async with c.stream(
        "POST", f"{stub}/v1/completions", json={"prompt": [1] * 11, "max_tokens": DECODE_TOKENS}
    ) as r:
        async for _ in r.aiter_lines():
            pass
    return time.perf_counter() - t0


async def latency(gw: str, stub: str, n: int) -> tuple[list[float], list[float]]:
    via, direct = [], []
    async with httpx.AsyncClient(timeout=30) as c:
        for _ in range(20):  # warm-up
            await one_via_gateway(c, gw)
            await one_direct(c, stub)
        for _ in range(n):  # interleaved, so machine noise hits both alike
            via.append(await one_via_gateway(c, gw))
            direct.append(await one_direct(c, stub))
    return via, direct


async def throughput(gw: str, seconds: float, concurrency: int) -> tuple[int, int]:
    done = errors = 0
    stop = time.perf_counter() + seconds

    async def worker(c: httpx.AsyncClient) -> None:
        nonlocal done, errors
        while time.perf_counter() < stop:
            try:
                await one_via_gateway(c, gw)
                done += 1
            except httpx.HTTPError:
                errors += 1

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=30, limits=limits) as c:
        await asyncio.gather(*(worker(c) for _ in range(concurrency)))
    return done, errors


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests", type=int, default=300, help="sequential latency samples")
    args = ap.parse_args()

    from flowprefill.contracts import Endpoint, GatewayConfig
    from flowprefill.models import named_model_dir

    model_dir = named_model_dir("tiny-llama")
    stub_port, gw_port = free_port(), free_port()
    stub, gw = f"http://127.0.0.1:{stub_port}", f"http://127.0.0.1:{gw_port}"
    tmp = Path(tempfile.mkdtemp())
    (tmp / "slo.json").write_text(
        json.dumps(
            {
                "version": 1,
                "default_class": "chat",
                "classes": [
                    {
                        "name": "chat",
                        "task_type": "text",
                        "ttft_slo_ms": 250,
                        "priority": 0,
                        "attainment_target": 0.9,
                    }
                ],
            }
        )
    )
    ep = Endpoint(pool="s", host="127.0.0.1", port=stub_port, url=stub)
    (tmp / "gw.json").write_text(
        GatewayConfig(
            service="bench",
            model_name="tiny",
            tokenizer_path=str(model_dir),
            prefill=[ep],
            decode=[ep],
        ).model_dump_json()
    )
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=serve_stub, args=(stub_port,), daemon=True),
        ctx.Process(
            target=serve_gateway,
            args=(str(tmp / "gw.json"), str(tmp / "slo.json"), gw_port),
            daemon=True,
        ),
    ]
    for p in procs:
        p.start()
    try:
        for url in (stub, gw):
            for _ in range(300):
                try:
                    if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.1)
        via, direct = asyncio.run(latency(gw, stub, args.requests))
        done, errors = asyncio.run(throughput(gw, args.seconds, args.concurrency))
    finally:
        for p in procs:
            p.terminate()
    added = [v - d for v, d in zip(via, direct, strict=True)]
    t = Table(title=f"gateway overhead (stub upstreams, {DECODE_TOKENS} decode tokens streamed)")
    t.add_column("measure")
    t.add_column("p50 ms", justify="right")
    t.add_column("p99 ms", justify="right")
    t.add_row("through the gateway", f"{pct(via, 0.5) * 1e3:.2f}", f"{pct(via, 0.99) * 1e3:.2f}")
    t.add_row(
        "stubs called directly", f"{pct(direct, 0.5) * 1e3:.2f}", f"{pct(direct, 0.99) * 1e3:.2f}"
    )
    t.add_row(
        "[b]added by the gateway[/b]",
        f"{pct(added, 0.5) * 1e3:.2f}",
        f"{pct(added, 0.99) * 1e3:.2f}",
    )
    console = Console()
    console.print(t)
    console.print(
        f"sustained: {done / args.seconds:.0f} requests/s at concurrency "
        f"{args.concurrency} ({errors} errors, {args.seconds:.0f} s, "
        f"mean {statistics.mean(via) * 1e3:.2f} ms sequential)"
    )


if __name__ == "__main__":
    main()
