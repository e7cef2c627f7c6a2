"""The load ``overhead.py`` and ``streams.py`` put on a gateway: the request bodies (the
gateway's, and what it must send the stub upstreams for them), the client that sends them
and checks every streamed answer, and the latency and throughput phases. No processes
are started here."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx

from benchmarks.gateway.stubs import DECODE_TOKENS, PROMPT
from flowprefill.contracts.deployment import PREFILL_API_PATH
from flowprefill.contracts.prefill_api import PrefillRequest

# The load generator: aiohttp when installed (several times less CPU per request than
# httpx, so it takes less of the machine from the gateway), else httpx.

GATEWAY_BODY = {"model": "tiny", "prompt": PROMPT, "max_tokens": DECODE_TOKENS + 1, "stream": True}
# What the gateway sends the stubs for GATEWAY_BODY (the prompt as tiny-llama tokenizes it).
PREFILL_BODY = PrefillRequest(
    request_id="direct",
    prompt_token_ids=[1] * 11,
    ttft_slo_s=0.25,
    slo_class="chat",
    hand_off_kv=True,
    stream=True,
).model_dump()
DECODE_BODY = {
    "model": "tiny",
    "prompt": [1] * 11,
    "max_tokens": DECODE_TOKENS,
    "stream": True,
    "stream_options": {"include_usage": True},
}


@dataclass(frozen=True)
class Bodies:
    """What the load generator sends: through the gateway, and to the stubs directly (the
    bodies the gateway sends them for it)."""

    gateway: dict[str, Any]
    prefill: dict[str, Any]
    decode: dict[str, Any]

    @classmethod
    def for_prompt(cls, prompt: str, token_ids: list[int]) -> Bodies:
        """``prompt`` as text through the gateway; ``token_ids``: how it tokenizes it."""
        prefill = PrefillRequest.model_validate({**PREFILL_BODY, "prompt_token_ids": token_ids})
        return cls(
            {**GATEWAY_BODY, "prompt": prompt},
            prefill.model_dump(),
            {**DECODE_BODY, "prompt": [*token_ids, 42]},
        )


DEFAULT_BODIES = Bodies(GATEWAY_BODY, PREFILL_BODY, DECODE_BODY)


def long_prompt(num_words: int) -> str:
    """A text prompt of ``num_words`` words (the default prompt's, repeated)."""
    words = PROMPT.split()
    return " ".join(words[i % len(words)] for i in range(num_words))


def long_prompt_bodies(gateway: str, num_tokens: int) -> Bodies:
    """Bodies for a text prompt of about ``num_tokens`` tokens, as the gateway's
    ``/tokenize`` counts them (the direct bodies carry those ids)."""

    def tokenize(prompt: str) -> list[int]:
        answer = httpx.post(
            f"{gateway}/tokenize", json={"model": "tiny", "prompt": prompt}, timeout=30
        )
        answer.raise_for_status()
        ids: list[int] = answer.json()["tokens"]
        return ids

    # Words per token depend on the tokenizer: measured once, then scaled.
    sample = len(tokenize(long_prompt(num_tokens)))
    prompt = long_prompt(max(1, num_tokens * num_tokens // max(sample, 1)))
    return Bodies.for_prompt(prompt, tokenize(prompt))


class StreamError(Exception):
    """An answer that is not a whole, successful SSE stream."""


def check_stream(lines: list[str]) -> None:
    """Raise :class:`StreamError` unless ``lines`` are an SSE stream with no error event
    that ends with ``[DONE]``."""
    payloads = [line[5:].strip() for line in lines if line.startswith("data:")]
    if not payloads or payloads[-1] != "[DONE]":
        raise StreamError(f"no [DONE] at the end of the stream: {lines[-3:]!r}")
    for payload in payloads[:-1]:
        if "error" in json.loads(payload):
            raise StreamError(payload)


class Client:
    bodies: Bodies = DEFAULT_BODIES

    async def stream(self, url: str, body: dict[str, Any]) -> None:
        raise NotImplementedError

    async def gateway(self, url: str) -> None:
        await self.stream(f"{url}/v1/completions", self.bodies.gateway)

    async def direct(self, stub: str) -> None:
        await self.stream(f"{stub}{PREFILL_API_PATH}", self.bodies.prefill)
        await self.stream(f"{stub}/v1/completions", self.bodies.decode)

    async def close(self) -> None:
        raise NotImplementedError


class HttpxClient(Client):
    def __init__(self, concurrency: int) -> None:
        self.c = httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=concurrency))

    async def stream(self, url: str, body: dict[str, Any]) -> None:
        async with self.c.stream("POST", url, json=body) as r:
            r.raise_for_status()
            check_stream([line async for line in r.aiter_lines()])

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

    async def stream(self, url: str, body: dict[str, Any]) -> None:
        async with self.c.post(url, json=body) as r:
            check_stream([line.decode() async for line in r.content])

    async def close(self) -> None:
        await self.c.close()


def make_client(kind: str, concurrency: int, bodies: Bodies = DEFAULT_BODIES) -> Client:
    if kind == "auto":
        try:
            import aiohttp  # noqa: F401

            kind = "aiohttp"
        except ImportError:
            kind = "httpx"
    client = AiohttpClient(concurrency) if kind == "aiohttp" else HttpxClient(concurrency)
    client.bodies = bodies
    return client


@dataclass
class Failures:
    """Requests that failed, and the first reason (the run goes on; the exit status says)."""

    count: int = 0
    first: str | None = None

    def add(self, e: BaseException) -> None:
        self.count += 1
        if self.first is None:
            self.first = f"{type(e).__name__}: {e}"


async def timed(f: Callable[[], Awaitable[None]]) -> float:
    t0 = time.perf_counter()
    await f()
    return time.perf_counter() - t0


async def latency(
    client: str,
    gw: str,
    stub: str,
    n: int,
    warmup: int,
    failures: Failures,
    bodies: Bodies = DEFAULT_BODIES,
) -> tuple[list[float], list[float]]:
    """``n`` interleaved pairs (through the gateway, direct), after ``warmup`` of each; a
    pair with a failed request is left out (and counted in ``failures``)."""
    c = make_client(client, 1, bodies)
    via, direct = [], []
    try:
        for i in range(warmup + n):  # interleaved, so machine noise hits both alike
            try:
                pair = (await timed(lambda: c.gateway(gw)), await timed(lambda: c.direct(stub)))
            except Exception as e:
                failures.add(e)
                continue
            if i >= warmup:
                via.append(pair[0])
                direct.append(pair[1])
    finally:
        await c.close()
    return via, direct


async def throughput(
    client: str,
    gw: str,
    seconds: float,
    concurrency: int,
    failures: Failures,
    bodies: Bodies = DEFAULT_BODIES,
) -> int:
    """Requests completed through the gateway by ``concurrency`` clients in ``seconds``."""
    done = 0
    c = make_client(client, concurrency, bodies)
    stop = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < stop:
            try:
                await c.gateway(gw)
                done += 1
            except Exception as e:
                failures.add(e)

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        await c.close()
    return done
