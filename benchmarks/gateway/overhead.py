"""Gateway overhead: latency it adds per request and requests/s it sustains (2 cores).

Stub upstreams answer instantly — a prefill stub returns a fixed first token and a decode
stub streams a few fixed tokens — so what is measured is the gateway alone: parsing,
classification, tokenization, routing, two upstream calls and the SSE relay. Each
process (stubs, gateway, load generator) is separate, as in a deployment, and the gateway
is served as ``flowprefill serve-gateway`` serves it (body-size limit, access log on, to a
file here).

    python benchmarks/gateway/overhead.py [--seconds 10] [--concurrency 32]
    python benchmarks/gateway/overhead.py --gateway aiohttp httpx/asyncio/h11 --rounds 3
    python benchmarks/gateway/overhead.py --baseline HEAD~1 --rounds 3    # code compared

Added latency = p50/p99 of (client → gateway → stubs) minus the stubs called directly in
sequence (prefill then decode) by the same client, interleaved. Sustained = completed
requests/s with ``--concurrency`` clients for ``--seconds``. On a small machine the load
generator and the stubs take CPU the gateway could use, so the gateway's own CPU time per
request (from /proc) is reported too: it does not depend on what else runs. With several
gateways (``--gateway`` settings, ``--baseline`` git revisions) each runs in its own
process and the measurements alternate between them, ``--rounds`` times.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

DECODE_TOKENS = 4
PROMPT = "The quick brown fox jumps over the lazy dog"
REPO = Path(__file__).resolve().parents[2]


def stub_app() -> Any:
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    app = FastAPI()

    @app.post("/v1/prefill")
    async def prefill(body: dict[str, Any]) -> dict[str, Any]:
        return {
            "request_id": body["request_id"],
            "first_token_id": 42,
            "num_prompt_tokens": len(body["prompt_token_ids"]),
            "ttft_s": 0.0001,
            "met_slo": True,
            "num_preemptions": 0,
            "batch_size": 1,
            "kv_transfer_params": None,
        }

    @app.post("/v1/completions")
    async def completions(body: dict[str, Any]) -> StreamingResponse:
        async def gen() -> AsyncIterator[str]:
            for i in range(min(DECODE_TOKENS, body.get("max_tokens", 1))):
                chunk = {"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    @app.get("/health")
    @app.get("/ready")
    async def ok() -> dict[str, str]:
        return {"status": "ok"}

    return app


def serve_stub(port: int) -> None:
    import uvicorn

    uvicorn.run(stub_app(), host="127.0.0.1", port=port, log_level="error")


def serve_gateway(config: str, table: str, port: int, spec: str, src: str | None, log: str) -> None:
    """As ``flowprefill serve-gateway`` does; ``src``: a checkout to import flowprefill from."""
    if src:
        sys.path.insert(0, src)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    import uvicorn

    from flowprefill.contracts import GatewayConfig
    from flowprefill.gateway.app import create_gateway_app
    from flowprefill.gateway.cli import build_state
    from flowprefill.web.errors import BodySizeLimit

    upstream_http, loop, http = parse_spec(spec)
    kwargs: dict[str, Any] = {} if upstream_http == "auto" else {"upstream_http": upstream_http}
    state = build_state(
        GatewayConfig.model_validate_json(Path(config).read_text()), table, **kwargs
    )
    app = BodySizeLimit(create_gateway_app(state), 32 * 2**20)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="info", loop=loop, http=http)


def parse_spec(spec: str) -> tuple[str, str, str]:
    """``CLIENT[/LOOP[/HTTP]]``: the gateway's upstream HTTP client (auto, aiohttp, httpx),
    uvicorn's event loop (auto, asyncio, uvloop) and HTTP parser (auto, h11, httptools);
    auto is what ``flowprefill serve-gateway`` does."""
    parts = [*spec.split("/"), "auto", "auto"][:3]
    choices = (
        ("auto", "aiohttp", "httpx"),
        ("auto", "asyncio", "uvloop"),
        ("auto", "h11", "httptools"),
    )
    for part, allowed in zip(parts, choices, strict=True):
        if part not in allowed:
            raise SystemExit(f"--gateway {spec!r}: {part!r} is not one of {allowed}")
    return parts[0], parts[1], parts[2]


# The load generator: aiohttp when installed (several times less CPU per request than
# httpx, so it takes less of the machine from the gateway), else httpx.


class Client:
    async def gateway(self, url: str) -> None:
        raise NotImplementedError

    async def direct(self, stub: str) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError


GATEWAY_BODY = {"model": "tiny", "prompt": PROMPT, "max_tokens": DECODE_TOKENS + 1, "stream": True}
PREFILL_BODY = {"request_id": "x", "prompt_token_ids": [1] * 10, "ttft_slo_s": 1.0}
DECODE_BODY = {"prompt": [1] * 11, "max_tokens": DECODE_TOKENS}


class HttpxClient(Client):
    def __init__(self, concurrency: int) -> None:
        self.c = httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=concurrency))

    async def _stream(self, url: str, body: dict[str, Any]) -> None:
        async with self.c.stream("POST", url, json=body) as r:
            r.raise_for_status()
            async for _ in r.aiter_lines():
                pass

    async def gateway(self, url: str) -> None:
        await self._stream(f"{url}/v1/completions", GATEWAY_BODY)

    async def direct(self, stub: str) -> None:
        (await self.c.post(f"{stub}/v1/prefill", json=PREFILL_BODY)).raise_for_status()
        await self._stream(f"{stub}/v1/completions", DECODE_BODY)

    async def close(self) -> None:
        await self.c.aclose()


class AiohttpClient(Client):
    def __init__(self, concurrency: int) -> None:
        import aiohttp

        self.c = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=concurrency),
            timeout=aiohttp.ClientTimeout(total=30),
            raise_for_status=True,
        )

    async def _stream(self, url: str, body: dict[str, Any]) -> None:
        async with self.c.post(url, json=body) as r:
            async for _ in r.content.iter_any():
                pass

    async def gateway(self, url: str) -> None:
        await self._stream(f"{url}/v1/completions", GATEWAY_BODY)

    async def direct(self, stub: str) -> None:
        async with self.c.post(f"{stub}/v1/prefill", json=PREFILL_BODY) as r:
            await r.read()
        await self._stream(f"{stub}/v1/completions", DECODE_BODY)

    async def close(self) -> None:
        await self.c.close()


def make_client(kind: str, concurrency: int) -> Client:
    if kind == "auto":
        try:
            import aiohttp  # noqa: F401

            kind = "aiohttp"
        except ImportError:
            kind = "httpx"
    return AiohttpClient(concurrency) if kind == "aiohttp" else HttpxClient(concurrency)


async def timed(f: Callable[[], Awaitable[None]]) -> float:
    t0 = time.perf_counter()
    await f()
    return time.perf_counter() - t0


async def latency(client: str, gw: str, stub: str, n: int) -> tuple[list[float], list[float]]:
    c = make_client(client, 1)
    via, direct = [], []
    try:
        for _ in range(20):  # warm-up
            await c.gateway(gw)
            await c.direct(stub)
        for _ in range(n):  # interleaved, so machine noise hits both alike
            via.append(await timed(lambda: c.gateway(gw)))
            direct.append(await timed(lambda: c.direct(stub)))
    finally:
        await c.close()
    return via, direct


async def throughput(client: str, gw: str, seconds: float, concurrency: int) -> tuple[int, int]:
    done = errors = 0
    c = make_client(client, concurrency)
    stop = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done, errors
        while time.perf_counter() < stop:
            try:
                await c.gateway(gw)
                done += 1
            except Exception:  # counted; the run goes on
                errors += 1

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        await c.close()
    return done, errors


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


@dataclass
class Variant:
    name: str
    spec: str
    src: str | None
    port: int = 0
    proc: mp.process.BaseProcess | None = None
    via: list[float] = field(default_factory=list)
    direct: list[float] = field(default_factory=list)
    done: int = 0
    errors: int = 0
    wall_s: float = 0.0
    cpu_s: dict[str, float] = field(default_factory=lambda: {"gateway": 0.0, "stub": 0.0})
    loadgen_cpu_s: float = 0.0


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def checkout(rev: str, into: Path) -> str:
    """The flowprefill package as of git ``rev``, unpacked under ``into``."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", rev, "flowprefill"], check=True, capture_output=True
    ).stdout
    into.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return str(into)


def wait_ready(url: str) -> None:
    for _ in range(600):
        try:
            if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not become ready")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seconds", type=float, default=10.0, help="throughput time per round")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests", type=int, default=300, help="latency samples per round")
    ap.add_argument(
        "--gateway",
        nargs="+",
        default=["auto"],
        metavar="CLIENT[/LOOP[/HTTP]]",
        help="gateway settings (see parse_spec), e.g. aiohttp httpx/asyncio/h11; several: "
        "one gateway each, compared",
    )
    ap.add_argument(
        "--baseline",
        nargs="*",
        default=[],
        metavar="REV",
        help="also run the gateway as of these git revisions (its default client)",
    )
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument(
        "--client", default="auto", choices=("auto", "aiohttp", "httpx"), help="load generator"
    )
    args = ap.parse_args()

    from flowprefill.contracts import Endpoint, GatewayConfig
    from flowprefill.models import named_model_dir

    model_dir = named_model_dir("tiny-llama")
    tmp = Path(tempfile.mkdtemp())
    for spec in args.gateway:
        parse_spec(spec)
    variants = [Variant(f"this tree, {spec}", spec, None) for spec in args.gateway]
    for rev in args.baseline:
        variants.append(Variant(f"{rev}, auto", "auto", checkout(rev, tmp / f"src-{rev}")))
    stub_port = free_port()
    stub = f"http://127.0.0.1:{stub_port}"
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
    stub_proc = ctx.Process(target=serve_stub, args=(stub_port,), daemon=True)
    stub_proc.start()
    for i, v in enumerate(variants):
        v.port = free_port()
        v.proc = ctx.Process(
            target=serve_gateway,
            args=(
                str(tmp / "gw.json"),
                str(tmp / "slo.json"),
                v.port,
                v.spec,
                v.src,
                str(tmp / f"gateway-{i}.log"),
            ),
            daemon=True,
        )
        v.proc.start()
    try:
        wait_ready(stub)
        for v in variants:
            wait_ready(f"http://127.0.0.1:{v.port}")
        for _ in range(args.rounds):
            for v in variants:
                gw = f"http://127.0.0.1:{v.port}"
                via, direct = asyncio.run(latency(args.client, gw, stub, args.requests))
                v.via += via
                v.direct += direct
                assert v.proc is not None and v.proc.pid is not None and stub_proc.pid is not None
                before = (cpu_seconds(v.proc.pid), cpu_seconds(stub_proc.pid), own_cpu_seconds())
                t0 = time.perf_counter()
                done, errors = asyncio.run(
                    throughput(args.client, gw, args.seconds, args.concurrency)
                )
                v.wall_s += time.perf_counter() - t0
                v.cpu_s["gateway"] += cpu_seconds(v.proc.pid) - before[0]
                v.cpu_s["stub"] += cpu_seconds(stub_proc.pid) - before[1]
                v.loadgen_cpu_s += own_cpu_seconds() - before[2]
                v.done += done
                v.errors += errors
    finally:
        for p in [stub_proc, *(v.proc for v in variants if v.proc)]:
            p.terminate()

    console = Console(width=max(Console().width, 150))
    t = Table(
        title=f"gateway overhead (stub upstreams, {DECODE_TOKENS} decode tokens streamed; "
        f"{args.rounds} round(s), {args.requests} sequential requests and {args.seconds:.0f} s "
        f"at concurrency {args.concurrency} per round; load generator: {args.client})"
    )
    for col in (
        "gateway",
        "via gw p50 ms",
        "direct p50 ms",
        "added p50 ms",
        "added p99 ms",
        "req/s",
        "gw CPU ms/req",
        "CPU gw/stub/load",
        "errors",
    ):
        t.add_column(col, justify="left" if col == "gateway" else "right")
    for v in variants:
        added = [a - b for a, b in zip(v.via, v.direct, strict=True)]
        share = " / ".join(
            f"{x / v.wall_s * 100:.0f}%" for x in (*v.cpu_s.values(), v.loadgen_cpu_s)
        )
        t.add_row(
            v.name,
            f"{pct(v.via, 0.5) * 1e3:.2f}",
            f"{pct(v.direct, 0.5) * 1e3:.2f}",
            f"{pct(added, 0.5) * 1e3:.2f}",
            f"{pct(added, 0.99) * 1e3:.2f}",
            f"{v.done / v.wall_s:.0f}",
            f"{v.cpu_s['gateway'] / max(v.done, 1) * 1e3:.2f}",
            share,
            str(v.errors),
        )
    console.print(t)
    console.print(
        f"({os.cpu_count()} CPUs; mean sequential latency through the gateway: "
        + ", ".join(f"{v.name} {statistics.mean(v.via) * 1e3:.2f} ms" for v in variants)
        + ")"
    )


if __name__ == "__main__":
    main()
