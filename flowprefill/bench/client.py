"""Replaying a workload against an OpenAI-compatible endpoint and timing first tokens.

Each request is sent at its arrival time (open loop: a slow server does not slow the
arrivals) and streamed; the arrival of every chunk that carries a choice is recorded
(``token_times_s``; vLLM and the FlowPrefill gateway send one token per chunk, and this is
what ``vllm bench serve`` times as well). The first is the TTFT; the gaps between them are
the times between tokens (TBT), judged against the class's TBT SLO: a request meets it when
it succeeded and *every* gap is within the SLO (its largest gap is; docs/bench.md). Prompts
are token-id lists of the workload's lengths (random ids from a seeded generator), which
both vLLM and the FlowPrefill gateway accept. The stream asks for OpenAI's closing usage
chunk (``stream_options.include_usage``), so the time per output token after the first
(TPOT, a mean) is measured on the tokens the server says it generated.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from flowprefill.contracts.deployment import SLO_CLASS_HEADER
from flowprefill.prefill.request import Request


@dataclass(slots=True)
class Outcome:
    request_id: str
    slo_class: str
    num_tokens: int
    ttft_slo_s: float
    sent_s: float
    tbt_slo_s: float | None = None
    """The class's time-between-tokens SLO; None: none is judged for this class."""
    ttft_s: float | None = None
    latency_s: float | None = None
    output_tokens: int | None = None
    status: int = 0
    error: str | None = None
    token_times_s: list[float] = field(default_factory=list)
    """When each streamed token arrived, seconds after the request was sent."""

    @property
    def met(self) -> bool:
        return self.ttft_s is not None and self.error is None and self.ttft_s <= self.ttft_slo_s

    @property
    def gaps_s(self) -> list[float]:
        """Times between consecutive tokens (none before the first)."""
        t = self.token_times_s
        return [b - a for a, b in itertools.pairwise(t)]

    @property
    def met_tbt(self) -> bool | None:
        """Whether every time between tokens was within the TBT SLO, for a request that
        succeeded (one with a single token has no gap and meets it); None without an SLO."""
        if self.tbt_slo_s is None:
            return None
        if self.error is not None or not self.token_times_s:
            return False
        return all(g <= self.tbt_slo_s for g in self.gaps_s)

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None without two tokens."""
        if self.error is not None or self.ttft_s is None or self.latency_s is None:
            return None
        if self.output_tokens is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True, slots=True)
class SendOptions:
    url: str
    model: str
    max_tokens: int = 4
    vocab_size: int = 1000
    class_header: str | None = SLO_CLASS_HEADER
    priorities: dict[str, int] | None = None
    """vLLM ``priority`` per class (lower runs first); None sends no priority field."""
    tbt_slos_s: dict[str, float] = field(default_factory=dict)
    """Time-between-tokens SLO per class, seconds; a class not named has none."""
    timeout_s: float = 600.0
    seed: int = 0


async def _one(
    client: httpx.AsyncClient, opts: SendOptions, r: Request, prompt: list[int], start: float
) -> Outcome:
    out = Outcome(
        r.request_id,
        r.slo_class,
        r.num_tokens,
        r.ttft_slo_s,
        r.arrival_s,
        tbt_slo_s=opts.tbt_slos_s.get(r.slo_class),
    )
    body: dict[str, object] = {
        "model": opts.model,
        "prompt": prompt,
        "max_tokens": opts.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
    }
    if opts.priorities is not None:
        body["priority"] = opts.priorities.get(r.slo_class, 0)
    headers = {opts.class_header: r.slo_class} if opts.class_header else {}
    delay = start + r.arrival_s - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
    t0 = time.monotonic()
    try:
        async with client.stream(
            "POST", f"{opts.url}/v1/completions", json=body, headers=headers
        ) as resp:
            out.status = resp.status_code
            if resp.status_code >= 400:
                await resp.aread()
                out.error = resp.text[:300]
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line.endswith("[DONE]"):
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    out.error = str(chunk["error"])[:300]
                    break
                if chunk.get("choices"):
                    out.token_times_s.append(time.monotonic() - t0)
                    if out.ttft_s is None:
                        out.ttft_s = out.token_times_s[0]
                usage = chunk.get("usage")
                if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                    out.output_tokens = usage["completion_tokens"]
        out.latency_s = time.monotonic() - t0
    except httpx.HTTPError as e:
        out.error = f"{type(e).__name__}: {e}"[:300]
    return out


def random_prompts(
    requests: list[Request], vocab_size: int, seed: int, round_index: int
) -> list[list[int]]:
    """Random token ids, one prompt per request, different in every round of a run.

    A server with a prefix cache (vLLM's is on by default) would otherwise recognise the
    previous rate's prompts and skip their prefill, so every rate after the first would
    measure cache hits, not scheduling. Seeded: the same (seed, round) gives the same prompts.
    """
    rng = random.Random(f"{seed}:{round_index}")
    return [[rng.randrange(1, vocab_size) for _ in range(r.num_tokens)] for r in requests]


async def replay(
    requests: list[Request],
    opts: SendOptions,
    on_done: Callable[[Outcome], None] | None = None,
    *,
    round_index: int = 0,
) -> list[Outcome]:
    """Send ``requests`` open-loop at their arrival times; ``round_index`` numbers the
    replays of one run (one per rate) so that each gets prompts of its own."""
    prompts = random_prompts(requests, opts.vocab_size, opts.seed, round_index)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=opts.timeout_s, limits=limits) as client:
        start = time.monotonic() + 0.2

        async def run(r: Request, p: list[int]) -> Outcome:
            o = await _one(client, opts, r, p, start)
            if on_done is not None:
                on_done(o)
            return o

        return list(
            await asyncio.gather(*(run(r, p) for r, p in zip(requests, prompts, strict=True)))
        )
