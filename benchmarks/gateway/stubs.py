"""Upstreams that answer at once, built from the contracts: a prefill instance
(:mod:`flowprefill.contracts.prefill_api`, streamed and not, framed with
:mod:`flowprefill.web.sse` as the prefill server frames it) and a vLLM decode instance
(OpenAI completion stream with the usage chunk). The gateway overhead benchmark runs them
in a process of their own."""

from __future__ import annotations

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


async def decode_events(body: dict[str, Any]) -> AsyncIterator[str]:
    """vLLM's OpenAI completion stream: one chunk per token, the usage chunk when
    ``stream_options.include_usage`` asks for it (the gateway reads the completion tokens
    from it), ``[DONE]``."""
    n = min(DECODE_TOKENS, int(body.get("max_tokens", 1)))
    envelope = {"id": "cmpl-stub", "object": "text_completion", "created": 0, "model": "stub"}
    for i in range(n):
        last = i == n - 1
        choice = {
            "index": 0,
            "text": f" t{i}",
            "logprobs": None,
            "finish_reason": "length" if last else None,
            "stop_reason": None,
        }
        yield sse_event({**envelope, "choices": [choice]})
    if (body.get("stream_options") or {}).get("include_usage"):
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
        usage["total_tokens"] = usage["prompt_tokens"] + n
        yield sse_event({**envelope, "choices": [], "usage": usage})
    yield DONE


def stub_app() -> Any:
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
        return StreamingResponse(decode_events(body), media_type=MEDIA_TYPE)

    @app.get(HEALTH_PATH)
    @app.get(READY_PATH)
    async def ok() -> dict[str, str]:
        return {"status": "ok"}

    return app


def serve_stub(port: int) -> None:
    import uvicorn

    uvicorn.run(stub_app(), host="127.0.0.1", port=port, log_level="error")
