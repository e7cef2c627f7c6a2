"""Upstreams that answer at once, built from the contracts: a prefill instance
(:mod:`flowprefill.contracts.prefill_api`, streamed and not, framed with
:mod:`flowprefill.web.sse` as the prefill server frames it) and a vLLM decode instance
(OpenAI completion stream with the usage chunk). The gateway benchmarks run them in a
process of their own.

Held streams (:class:`Hold`, for the open-streams sweep): the decode stub sends its first
chunk, then waits until ``POST /stub/release`` before the rest, so that N streams are open
through the gateway at once; ``GET /stub/open`` counts the streams it is holding."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from flowprefill.contracts.deployment import HEALTH_PATH, PREFILL_API_PATH, READY_PATH
from flowprefill.contracts.prefill_api import (
    KVHandoffEvent,
    PrefillLoad,
    PrefillRequest,
    PrefillResponse,
)
from flowprefill.web.sse import DONE, MEDIA_TYPE, sse_event

DECODE_TOKENS = 4
PROMPT = "The quick brown fox jumps over the lazy dog"


def prefill_answer(request: PrefillRequest) -> PrefillResponse:
    """An idle instance's instant answer to ``request``."""
    return PrefillResponse(
        request_id=request.request_id,
        first_token_id=42,
        num_prompt_tokens=len(request.prompt_token_ids),
        ttft_s=0.0001,
        met_slo=True,
        num_preemptions=0,
        batch_size=1,
        load=PrefillLoad(backlog_tokens=0, queue_delay_s=0.0, num_requests=0),
    )


async def prefill_events(request: PrefillRequest) -> AsyncIterator[str]:
    """A streamed prefill answer, framed as the prefill server frames it
    (flowprefill/prefill/server/prefill.py, ``events``): the first token, the hand-off
    event when one was asked for (null: no KV written, decode recomputes), ``[DONE]``."""
    yield sse_event(prefill_answer(request))
    if request.hand_off_kv:
        yield sse_event(KVHandoffEvent(kv_transfer_params=None))
    yield DONE


class Hold:
    """The gate held decode streams wait at (after their first chunk) and their count."""

    def __init__(self) -> None:
        self.open = 0
        self.gate = asyncio.Event()

    def hold(self) -> None:
        """From now on, streams wait at the gate."""
        self.gate = asyncio.Event()

    def release(self) -> None:
        self.gate.set()


async def decode_events(body: dict[str, Any], hold: Hold | None = None) -> AsyncIterator[str]:
    """vLLM's OpenAI completion stream: one chunk per token, the usage chunk when
    ``stream_options.include_usage`` asks for it (the gateway reads the completion tokens
    from it) and the counts so far in every chunk when ``continuous_usage_stats`` is set
    too, ``[DONE]``. With ``hold``, the stream waits at its gate after the first chunk
    (counted in ``hold.open`` meanwhile)."""
    n = min(DECODE_TOKENS, int(body.get("max_tokens", 1)))
    envelope = {"id": "cmpl-stub", "object": "text_completion", "created": 0, "model": "stub"}
    options = body.get("stream_options") or {}
    include_usage = bool(options.get("include_usage"))
    # vLLM puts the counts so far in every chunk only when both options are set.
    continuous = include_usage and bool(options.get("continuous_usage_stats"))
    num_prompt = len(body["prompt"])
    for i in range(n):
        last = i == n - 1
        choice = {
            "index": 0,
            "text": f" t{i}",
            "logprobs": None,
            "finish_reason": "length" if last else None,
            "stop_reason": None,
        }
        chunk: dict[str, Any] = {**envelope, "choices": [choice]}
        if continuous:
            chunk["usage"] = _usage(num_prompt, i + 1)
        yield sse_event(chunk)
        if i == 0 and hold is not None and not hold.gate.is_set():
            hold.open += 1
            try:
                await hold.gate.wait()
            finally:
                hold.open -= 1
    if include_usage:
        yield sse_event({**envelope, "choices": [], "usage": _usage(num_prompt, n)})
    yield DONE


def _usage(num_prompt: int, num_completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
    }


def stub_app(hold: Hold | None = None) -> Any:
    """The stub upstreams' app; with ``hold``, decode streams are held (see the module)."""
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    app = FastAPI()

    @app.post(PREFILL_API_PATH, response_model=None)
    async def prefill(request: PrefillRequest) -> PrefillResponse | StreamingResponse:
        if request.stream:
            return StreamingResponse(prefill_events(request), media_type=MEDIA_TYPE)
        return prefill_answer(request)

    @app.post("/v1/completions")
    async def completions(body: dict[str, Any]) -> StreamingResponse:
        return StreamingResponse(decode_events(body, hold), media_type=MEDIA_TYPE)

    if hold is not None:
        gate = hold

        @app.get("/stub/open")
        async def held() -> dict[str, int]:
            return {"open": gate.open}

        @app.post("/stub/hold")
        async def start_holding() -> dict[str, int]:
            gate.hold()
            return {"open": gate.open}

        @app.post("/stub/release")
        async def release() -> dict[str, int]:
            gate.release()
            return {"open": gate.open}

    @app.get(HEALTH_PATH)
    @app.get(READY_PATH)
    async def ok() -> dict[str, str]:
        return {"status": "ok"}

    return app


def serve_stub(port: int, hold: bool = False) -> None:
    import uvicorn

    raise_fd_limit()
    app = stub_app(Hold() if hold else None)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", backlog=4096)


def raise_fd_limit() -> int:
    """Raise this process's open-file limit to its hard limit (children inherit it); the
    limit now. An open stream takes a socket at the client, two at the gateway (client and
    decode upstream) and one at the stub."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
