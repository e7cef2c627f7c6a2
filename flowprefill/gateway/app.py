"""The OpenAI-compatible gateway: classify, stamp the deadline, prefill, decode, relay.

Per request: classify into an SLO class (:mod:`flowprefill.gateway.classify`), stamp
``arrival`` and ``deadline = arrival + ttft_slo``, tokenize, pick a prefill instance
(slack-aware by default) and send it the remaining TTFT budget; the first token comes
back from prefill and is sent to the client at once — that moment is the TTFT. Decode
(vLLM) then continues from the prompt *plus* that first token, loading the prompt's KV
through the hand-off, and its stream is relayed.

Errors: client mistakes are 4xx with an OpenAI error body; an upstream that fails before
the first byte is a 5xx; one that fails mid-stream ends the stream with an error event.
A client that disconnects cancels its prefill (the upstream connection closes, and the
prefill server cancels the request) and its decode stream.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from flowprefill.gateway.classify import Classification, SLOTableFile, classify
from flowprefill.gateway.metrics import GatewayMetrics
from flowprefill.gateway.openai_models import ChatCompletionRequest, CompletionRequest
from flowprefill.gateway.routing import InstancePool, NoHealthyInstanceError
from flowprefill.gateway.upstream import DecodeClient, PrefillAnswer, PrefillClient, UpstreamError
from flowprefill.server.errors import error_response, install_error_handlers

FALLBACK_HEADER = "x-flowprefill-slo-class-fallback"
CLASS_HEADER = "x-flowprefill-slo-class"


class Tokenizer:
    """The few tokenizer operations the gateway needs (a transformers tokenizer fits)."""

    def __init__(self, hf_tokenizer: Any, max_model_len: int, eos_token_ids: set[int]) -> None:
        self.tok = hf_tokenizer
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self._backend = _plain_backend(hf_tokenizer)

    def encode_prompt(self, prompt: str) -> list[int]:
        if self._backend is not None:  # the same ids, without the wrapper's ~3x overhead
            return list(self._backend.encode(prompt, add_special_tokens=True).ids)
        return list(self.tok(prompt, add_special_tokens=True)["input_ids"])

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        out = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
        return [int(t) for t in ids]

    def decode_token(self, token_id: int) -> str:
        return str(self.tok.decode([token_id], skip_special_tokens=True))


def _plain_backend(hf_tokenizer: Any) -> Any:
    """The Rust tokenizer under a transformers fast tokenizer, when calling it directly
    gives what ``hf_tokenizer(text)`` gives: no truncation, padding or special-token
    splitting configured (a call through the wrapper first resets those to its defaults,
    as every call through it does). None otherwise."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if not getattr(hf_tokenizer, "is_fast", False) or backend is None:
        return None
    hf_tokenizer("", add_special_tokens=True)
    plain = (
        backend.truncation is None
        and backend.padding is None
        and not getattr(backend, "encode_special_tokens", False)
    )
    return backend if plain else None


@dataclass
class GatewayState:
    model_name: str
    tokenizer: Tokenizer
    slo_file: SLOTableFile
    prefill_pool: InstancePool
    decode_pool: InstancePool | None
    prefill_client: PrefillClient
    decode_client: DecodeClient | None
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    clock: Callable[[], float] = time.monotonic
    table_refresh_s: float = 1.0


@dataclass
class Job:
    """One request on its way through the gateway."""

    request_id: str
    kind: str  # "text_completion" | "chat.completion"
    body: CompletionRequest | ChatCompletionRequest
    token_ids: list[int]
    cls: Classification
    arrival_s: float
    deadline_s: float
    created: int = field(default_factory=lambda: int(time.time()))
    completion_tokens: int = 1  # the first token; decode's usage adds the rest
    decode_has_it: bool = False
    """A decode instance may hold the request, so its connector deletes the hand-off when
    the request ends there; the gateway deleting it too could race that instance's load."""

    @property
    def slo_name(self) -> str:
        return self.cls.slo_class.name

    def forward_headers(self, now_s: float) -> dict[str, str]:
        """llm-d / Dynamo-compatible hints for upstreams that understand them."""
        c = self.cls.slo_class
        headers = {
            "x-gateway-inference-objective": c.name,
            "x-slo-ttft-ms": str(max(1, round((self.deadline_s - now_s) * 1e3))),
            "x-dynamo-request-priority": str(c.priority),
        }
        if c.tpot_slo_ms is not None:
            headers["x-slo-tpot-ms"] = str(c.tpot_slo_ms)
        return headers


def _response_headers(cls: Classification) -> dict[str, str]:
    headers = {CLASS_HEADER: cls.slo_class.name}
    if cls.unknown_requested:
        headers[FALLBACK_HEADER] = (
            f"unknown class {cls.unknown_requested!r}; used {cls.slo_class.name}"
        )
    return headers


async def _unless_disconnected(request: Request, coro: Any) -> Any:
    """Await ``coro``; if the client disconnects first, cancel it and raise CancelledError."""
    task = asyncio.ensure_future(coro)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task not in done:
        task.cancel()
        raise asyncio.CancelledError("client disconnected")
    return task.result()


def create_gateway_app(state: GatewayState) -> FastAPI:
    import contextlib

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async def watch_table() -> None:
            while True:
                await asyncio.sleep(state.table_refresh_s)
                if state.slo_file.refresh():
                    state.metrics.table_reloads.inc()

        watcher = asyncio.create_task(watch_table())
        try:
            yield
        finally:
            watcher.cancel()
            await state.prefill_client.http.aclose()

    app = FastAPI(title="FlowPrefill gateway", lifespan=lifespan)
    install_error_handlers(app)
    m = state.metrics

    def new_job(
        request: Request, body: CompletionRequest | ChatCompletionRequest, kind: str
    ) -> Job | JSONResponse:
        arrival = state.clock()
        if body.model != state.model_name:
            return error_response(
                404,
                f"model {body.model!r} does not exist; this gateway serves {state.model_name!r}",
                "not_found_error",
                param="model",
            )
        cls = classify(
            state.slo_file.table,
            headers=request.headers,
            body_class=body.slo_class,
            model=body.model,
            path=request.url.path,
        )
        if isinstance(body, ChatCompletionRequest):
            token_ids = state.tokenizer.encode_chat(
                [{"role": msg.role, "content": msg.text()} for msg in body.messages]
            )
        elif isinstance(body.prompt, str):
            token_ids = state.tokenizer.encode_prompt(body.prompt)
        else:
            token_ids = list(body.prompt)
        limit = state.tokenizer.max_model_len
        if len(token_ids) + body.output_budget > limit:
            return error_response(
                400,
                f"this model's maximum context length is {limit} tokens; the prompt has "
                f"{len(token_ids)} and max_tokens asks for {body.output_budget} more",
                param="max_tokens" if len(token_ids) < limit else "prompt",
            )
        prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
        return Job(
            request_id=f"{prefix}-{uuid.uuid4().hex}",
            kind=kind,
            body=body,
            token_ids=token_ids,
            cls=cls,
            arrival_s=arrival,
            deadline_s=arrival + cls.slo_class.ttft_slo_ms / 1e3,
        )

    async def run_prefill(request: Request, job: Job) -> PrefillAnswer:
        tokens = len(job.token_ids)
        for attempt in range(2):
            inst = state.prefill_pool.pick(deadline_s=job.deadline_s, num_tokens=tokens)
            state.prefill_pool.begin(inst, job.request_id, job.deadline_s, tokens)
            try:
                now = state.clock()
                answer: PrefillAnswer = await _unless_disconnected(
                    request,
                    state.prefill_client.prefill(
                        inst.url,
                        request_id=job.request_id,
                        token_ids=job.token_ids,
                        ttft_budget_ms=(job.deadline_s - now) * 1e3,
                        slo_class=job.slo_name,
                        headers=job.forward_headers(now),
                        hand_off_kv=state.decode_pool is not None and job.body.output_budget > 1,
                    ),
                )
                state.prefill_pool.mark_success(inst)
                return answer
            except UpstreamError as e:
                if e.status >= 500:
                    state.prefill_pool.mark_failure(inst)
                if not (e.retryable and attempt == 0):
                    raise
            finally:
                state.prefill_pool.end(inst, job.request_id)
        raise AssertionError("unreachable")

    def record_first_token(job: Job, answer: PrefillAnswer) -> None:
        ttft = state.clock() - job.arrival_s
        m.ttft.labels(job.slo_name).observe(ttft)
        met = ttft * 1e3 <= job.cls.slo_class.ttft_slo_ms
        m.slo_requests.labels(job.slo_name, "met" if met else "missed").inc()
        m.queue_time.labels(job.slo_name).observe(answer.prefill_ms / 1e3)

    async def continuation(
        job: Job, answer: PrefillAnswer
    ) -> AsyncIterator[tuple[str, str | None]]:
        """(text, finish_reason) pieces after the first token."""
        if answer.first_token_id in state.tokenizer.eos_token_ids:
            state.prefill_client.release(answer)  # nothing to decode: nobody loads it
            yield "", "stop"
            return
        budget = job.body.output_budget - 1
        if budget <= 0:  # prefill was asked for no hand-off
            yield "", "length"
            return
        try:
            # aclosing: a client gone closes the decode stream now, not at garbage collection.
            async with aclosing(decode(job, answer, budget)) as pieces:
                async for piece in pieces:
                    yield piece
        finally:
            # Nobody will load the hand-off when no decode instance got the request (client
            # gone before decode, every instance refused or rejected it). Once one may
            # have it, its connector deletes the hand-off when the request ends there.
            if not job.decode_has_it:
                state.prefill_client.release(answer)

    async def decode(
        job: Job, answer: PrefillAnswer, budget: int
    ) -> AsyncGenerator[tuple[str, str | None], None]:
        if state.decode_pool is None or state.decode_client is None:
            raise UpstreamError(503, "this gateway has no decode instances", "no_decode")
        # The first token went out before prefill finished writing the KV cache.
        kv_params = await answer.hand_off()
        finish: str | None = None
        for attempt in range(2):
            inst = state.decode_pool.pick(deadline_s=job.deadline_s, num_tokens=budget)
            state.decode_pool.begin(inst, job.request_id, job.deadline_s, budget)
            streamed = False
            job.decode_has_it = True  # from the moment the request may reach the instance
            try:
                async for delta in state.decode_client.stream(
                    inst.url,
                    prompt_token_ids=[*job.token_ids, answer.first_token_id],
                    max_tokens=budget,
                    sampling=job.body.decode_sampling(),
                    kv_transfer_params=kv_params,
                    headers=job.forward_headers(state.clock()),
                    request_id=job.request_id,
                ):
                    streamed = True
                    if delta.completion_tokens is not None:
                        job.completion_tokens = 1 + delta.completion_tokens
                    if delta.text or delta.finish_reason:
                        finish = delta.finish_reason or finish
                        yield delta.text, delta.finish_reason
                state.decode_pool.mark_success(inst)
                break
            except UpstreamError as e:
                # Refused, or answered with an error before any output: vLLM did not keep
                # the request, so its connector will not clean up after it.
                job.decode_has_it = streamed
                if e.status >= 500:
                    state.decode_pool.mark_failure(inst)
                # A refused connection means the instance never saw the request, so another
                # one may take it (the hand-off is in shared storage; a decode that cannot
                # read it recomputes). Anything later could duplicate output: give up.
                if not (e.retryable and attempt == 0):
                    raise
            finally:
                state.decode_pool.end(inst, job.request_id)
        if finish is None:
            yield "", "length"

    def chunk(job: Job, text: str, finish: str | None, first: bool = False) -> str:
        if job.kind == "chat.completion":
            delta: dict[str, Any] = {"content": text}
            if first:
                delta["role"] = "assistant"
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
            obj = "text_completion"
        payload = {
            "id": job.request_id,
            "object": obj,
            "created": job.created,
            "model": state.model_name,
            "choices": [choice],
        }
        return f"data: {json.dumps(payload)}\n\n"

    async def serve(request: Request, job: Job) -> Any:
        headers = _response_headers(job.cls)
        m.in_flight.inc()
        try:
            try:
                answer = await run_prefill(request, job)
            except NoHealthyInstanceError as e:
                m.errors.labels("no_prefill_instance").inc()
                return error_response(503, str(e), headers=headers)
            except UpstreamError as e:
                m.errors.labels(e.reason).inc()
                return error_response(e.status, str(e), headers=headers)
            except asyncio.CancelledError:
                m.errors.labels("client_disconnected").inc()
                return error_response(499, "client disconnected", headers=headers)
            record_first_token(job, answer)
            first_text = state.tokenizer.decode_token(answer.first_token_id)
            if job.body.stream:
                return StreamingResponse(
                    stream(job, answer, first_text),
                    media_type="text/event-stream",
                    headers=headers,
                )
            return await collect(job, answer, first_text, headers)
        finally:
            m.in_flight.dec()

    async def stream(job: Job, answer: PrefillAnswer, first_text: str) -> AsyncIterator[str]:
        yield chunk(job, first_text, None, first=True)
        options = job.body.stream_options
        try:
            async for text, finish in continuation(job, answer):
                yield chunk(job, text, finish)
        except (UpstreamError, NoHealthyInstanceError) as e:
            reason = e.reason if isinstance(e, UpstreamError) else "no_decode_instance"
            m.errors.labels(reason).inc()
            err = {"error": {"message": str(e), "type": "upstream_error", "code": reason}}
            yield f"data: {json.dumps(err)}\n\n"
        else:  # as vLLM does: no usage after an error event
            if options is not None and options.include_usage:
                yield usage_chunk(job)
        yield "data: [DONE]\n\n"

    def usage_chunk(job: Job) -> str:
        """OpenAI's last chunk under ``stream_options.include_usage``: no choices, the usage."""
        payload = {
            "id": job.request_id,
            "object": "chat.completion.chunk" if job.kind == "chat.completion" else job.kind,
            "created": job.created,
            "model": state.model_name,
            "choices": [],
            "usage": usage(job),
        }
        return f"data: {json.dumps(payload)}\n\n"

    def usage(job: Job) -> dict[str, int]:
        return {
            "prompt_tokens": len(job.token_ids),
            "completion_tokens": job.completion_tokens,
            "total_tokens": len(job.token_ids) + job.completion_tokens,
        }

    async def collect(
        job: Job, answer: PrefillAnswer, first_text: str, headers: dict[str, str]
    ) -> JSONResponse:
        texts = [first_text]
        finish = "length"
        try:
            async for text, reason in continuation(job, answer):
                texts.append(text)
                finish = reason or finish
        except (UpstreamError, NoHealthyInstanceError) as e:
            reason = e.reason if isinstance(e, UpstreamError) else "no_decode_instance"
            m.errors.labels(reason).inc()
            status = e.status if isinstance(e, UpstreamError) else 503
            return error_response(status, str(e), headers=headers)
        text = "".join(texts)
        if job.kind == "chat.completion":
            choice: dict[str, Any] = {
                "index": 0,
                "finish_reason": finish,
                "message": {"role": "assistant", "content": text},
            }
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        body = {
            "id": job.request_id,
            "object": job.kind,
            "created": job.created,
            "model": state.model_name,
            "choices": [choice],
            "usage": usage(job),
        }
        return JSONResponse(body, headers=headers)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        job = new_job(request, body, "text_completion")
        return job if isinstance(job, JSONResponse) else await serve(request, job)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        job = new_job(request, body, "chat.completion")
        return job if isinstance(job, JSONResponse) else await serve(request, job)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {"id": state.model_name, "object": "model", "created": 0, "owned_by": "flowprefill"}
            ],
        }

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        if state.prefill_pool.healthy():
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "no healthy prefill instance"}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)

    return app
