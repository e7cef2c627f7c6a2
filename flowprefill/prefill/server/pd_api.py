"""vLLM's own prefill/decode request shape on a FlowPrefill prefill instance.

Routers that drive vLLM P/D pairs (vLLM's proxy examples, llm-d's P/D sidecar, Dynamo)
send the prefill instance an OpenAI completion with ``kv_transfer_params:
{"do_remote_decode": true}`` and ``max_tokens: 1``, read back the ``kv_transfer_params``
a vLLM producer answers with, and send decode the same prompt with those parameters.
``POST /v1/completions`` here answers that shape, so such a router can use a FlowPrefill
pool as its prefill pool and gain preemption unchanged:

* the prompt is a string (tokenized with the model directory's tokenizer, special tokens
  added as vLLM does) or a list of token ids;
* the deadline: ``ttft_slo_s`` in the body, else llm-d's TTFT header (its current name
  ``x-llm-d-slo-ttft-ms``, else the deprecated ``x-slo-ttft-ms``; the current name wins
  when both are sent: :data:`~flowprefill.contracts.deployment.SLO_TTFT_HEADERS`), else
  the instance's default; ``x-slo-class`` names the class in metrics;
* the answer is a non-streamed ``text_completion`` with one choice, the first token (as
  text and in ``usage``), and vLLM's producer ``kv_transfer_params`` — the blocks for the
  prompt alone, since decode is sent the prompt alone and samples the first token itself.

Requests without ``do_remote_decode`` are refused (400): this instance only prefills.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from flowprefill.contracts.deployment import SLO_CLASS_HEADER, SLO_TTFT_HEADERS, first_header
from flowprefill.contracts.nixl import wants_remote_decode
from flowprefill.prefill.engine import PrefillEngine
from flowprefill.prefill.server.nixl_sink import NixlSink
from flowprefill.prefill.server.submit import run_prefill
from flowprefill.web.errors import error_response

PD_PATH = "/v1/completions"


class PDPrefillRequest(BaseModel):
    """The fields a P/D prefill request is read for; the rest of an OpenAI completion
    body (sampling, streaming options) is accepted and has no effect on a prefill."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | list[int] = Field(description="Text, or token ids.")
    max_tokens: int | None = Field(None, ge=1)
    kv_transfer_params: dict[str, Any] | None = None
    ttft_slo_s: float | None = Field(None, gt=0)


def add_pd_route(
    app: FastAPI,
    engine: PrefillEngine,
    sink: NixlSink,
    tokenizer: Callable[[], Any],
    *,
    model_name: str,
    default_ttft_slo_s: float,
) -> None:
    """``tokenizer()`` returns the model's (transformers) tokenizer; called once, on the
    first request that sends text."""
    load_tokenizer = functools.cache(tokenizer)

    @app.post(PD_PATH)
    async def completions(request: Request) -> Any:
        try:
            body = PDPrefillRequest.model_validate(await request.json())
        except (ValidationError, ValueError) as e:
            return error_response(400, f"invalid completion request: {e}", "invalid_request_error")
        if not wants_remote_decode(body.kv_transfer_params):
            return error_response(
                400,
                'this is a prefill instance: send kv_transfer_params {"do_remote_decode": true} '
                "(vLLM's P/D request) and decode elsewhere",
                "invalid_request_error",
            )
        if isinstance(body.prompt, str):
            tok = await asyncio.to_thread(load_tokenizer)
            token_ids = list(tok(body.prompt, add_special_tokens=True)["input_ids"])
        else:
            token_ids = list(body.prompt)
        if not token_ids:
            return error_response(400, "the prompt is empty", "invalid_request_error")
        header_ms = _header_float(request, SLO_TTFT_HEADERS)
        slo = body.ttft_slo_s or (header_ms / 1e3 if header_ms else None) or default_ttft_slo_s
        request_id = f"cmpl-{uuid.uuid4().hex}"
        res = await run_prefill(
            engine,
            request,
            token_ids,
            request_id=request_id,
            ttft_slo_s=slo,
            elapsed_s=0.0,
            slo_class=request.headers.get(SLO_CLASS_HEADER, "default")[:128],
        )
        if isinstance(res, JSONResponse):
            return res
        error: str | None = None
        try:
            params = await asyncio.to_thread(
                sink.publish, request_id, res.output.kv_cache, token_ids, len(token_ids)
            )
        except Exception as e:  # no blocks free, a layout mismatch: decode recomputes
            params = None
            error = f"{type(e).__name__}: {e}"
            engine.metrics.count_kv_refusal(e)
        first = int(res.output.first_token_id)
        text = ""
        if isinstance(body.prompt, str):
            text = load_tokenizer().decode([first])
        answer: dict[str, Any] = {
            "id": request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.model or model_name,
            "choices": [
                {"index": 0, "text": text, "logprobs": None, "finish_reason": "length",
                 "stop_reason": None, "token_ids": [first]}
            ],
            "usage": {
                "prompt_tokens": len(token_ids),
                "completion_tokens": 1,
                "total_tokens": len(token_ids) + 1,
            },
            "kv_transfer_params": params,
        }  # fmt: skip
        if error is not None:
            answer["kv_transfer_error"] = error
        return answer


def _header_float(request: Request, names: tuple[str, ...]) -> float | None:
    """The first of ``names`` sent, as a positive number; None when none is, or it is not
    one (a router's hint: the instance's default deadline then applies)."""
    sent = first_header(request.headers, names)
    if sent is None:
        return None
    raw = sent[1]
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if value > 0 else None
