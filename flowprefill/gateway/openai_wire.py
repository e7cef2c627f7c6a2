"""The OpenAI wire format of the gateway's answers, in one place.

Completions answer ``text_completion`` objects, chat completions ``chat.completion``
(streamed: ``chat.completion.chunk``); one choice (n=1). A stream is SSE: the first chunk
(chat: with ``role: assistant``), one chunk per decoded piece, under
``stream_options.include_usage`` a last chunk with no choices and the usage, then
``[DONE]``; a stream that fails after its first byte ends with an error event and
``[DONE]`` (no usage, as vLLM). Error bodies are :func:`flowprefill.web.errors.error_body`.
"""

from __future__ import annotations

from typing import Any

from flowprefill.gateway.errors import GatewayError
from flowprefill.gateway.job import Job
from flowprefill.web.errors import error_body
from flowprefill.web.sse import sse_event


def usage(job: Job) -> dict[str, int]:
    prompt = len(job.token_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": job.num_completion_tokens,
        "total_tokens": prompt + job.num_completion_tokens,
    }


def _envelope(job: Job, model: str, obj: str) -> dict[str, Any]:
    return {"id": job.request_id, "object": obj, "created": job.created, "model": model}


def _chunk_object(job: Job) -> str:
    return "chat.completion.chunk" if job.kind == "chat.completion" else job.kind


def completion_body(job: Job, model: str, text: str, finish_reason: str) -> dict[str, Any]:
    """A whole (non-streamed) answer."""
    choice: dict[str, Any]
    if job.kind == "chat.completion":
        choice = {
            "index": 0,
            "finish_reason": finish_reason,
            "message": {"role": "assistant", "content": text},
        }
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
    return {**_envelope(job, model, job.kind), "choices": [choice], "usage": usage(job)}


def chunk_event(
    job: Job, model: str, text: str, finish_reason: str | None, *, first: bool = False
) -> str:
    """One streamed piece as an SSE event."""
    choice: dict[str, Any]
    if job.kind == "chat.completion":
        delta: dict[str, Any] = {"content": text}
        if first:
            delta["role"] = "assistant"
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
    return sse_event({**_envelope(job, model, _chunk_object(job)), "choices": [choice]})


def usage_event(job: Job, model: str) -> str:
    """OpenAI's last chunk under ``stream_options.include_usage``: no choices, the usage."""
    payload = {**_envelope(job, model, _chunk_object(job)), "choices": [], "usage": usage(job)}
    return sse_event(payload)


def error_event(err: GatewayError) -> str:
    """A stream's end after a failure past its first byte (the status is already sent)."""
    return sse_event(error_body(str(err), "upstream_error", code=err.reason))


def models_body(model: str) -> dict[str, Any]:
    """``GET /v1/models``."""
    return {
        "object": "list",
        "data": [{"id": model, "object": "model", "created": 0, "owned_by": "flowprefill"}],
    }
