"""The OpenAI-compatible gateway: FastAPI wiring of the request pipeline.

Per request (``POST /v1/completions``, ``POST /v1/chat/completions``)::

    intake (classify, tokenize; stamps arrival_s)    flowprefill.gateway.classify
      -> prefill: the first token                    flowprefill.gateway.prefill
      -> decode: the rest, from vLLM                 flowprefill.gateway.decode
      -> relay: one OpenAI body or an SSE stream     flowprefill.gateway.relay

The first token is sent to the client as soon as prefill returns it (that moment is the
TTFT). Errors: client mistakes are 4xx with an OpenAI error body; a failure before the
first byte is answered with its status (:mod:`flowprefill.gateway.errors`); one after it
ends the stream with an error event. A client that disconnects while prefill runs gets
its prefill cancelled (the upstream connection closes, and the prefill server cancels the
request); one gone mid-stream closes its decode stream. Every answer carries the class
used (``x-flowprefill-slo-class``), and a fallback note when the request asked for a
class, priority or TTFT target it did not get (unknown, or not its to claim). Also
``GET /v1/models``, vLLM's ``POST /tokenize`` and ``/detokenize``
(:mod:`flowprefill.gateway.tokens`), vLLM's ``GET /version`` (FlowPrefill's version),
``/health``, ``/ready`` (503 with no healthy prefill instance) and ``/metrics``, and
``HEAD`` wherever ``GET`` is served (:mod:`flowprefill.gateway.asgi`); the SLO table is
re-read when its file changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Body, FastAPI, Request
from fastapi.responses import JSONResponse

from flowprefill import __version__
from flowprefill.contracts.deployment import SLO_CLASS_USED_HEADER, SLO_FALLBACK_HEADER
from flowprefill.contracts.gateway import HealthProbeSettings
from flowprefill.gateway import tokens
from flowprefill.gateway.asgi import GatewayApp
from flowprefill.gateway.classify import Classification, Job, SLOTableFile, fallback_note, intake
from flowprefill.gateway.decode import DecodeStage
from flowprefill.gateway.errors import ClientError, GatewayError, as_gateway_error
from flowprefill.gateway.health import HealthProber
from flowprefill.gateway.metrics import GatewayMetrics, export_slo_targets
from flowprefill.gateway.openai_api import ChatCompletionRequest, CompletionRequest
from flowprefill.gateway.prefill import PrefillStage
from flowprefill.gateway.relay import EventStreamResponse, Relay, models_body
from flowprefill.gateway.routing import InstancePool
from flowprefill.gateway.tokens import Tokenizer
from flowprefill.gateway.upstream import DecodeClient, PrefillClient
from flowprefill.web.disconnect import ClientDisconnected, DisconnectWatch, unless_disconnected
from flowprefill.web.errors import error_response, install_error_handlers
from flowprefill.web.headers import RequestHeaders
from flowprefill.web.probes import add_probe_routes
from flowprefill.web.sse import MEDIA_TYPE

FALLBACK_HEADER = SLO_FALLBACK_HEADER
CLASS_HEADER = SLO_CLASS_USED_HEADER


@dataclass
class GatewayState:
    """What a gateway serves with: model, tokenizer, SLO table, instance pools, upstream
    clients, metrics, clock. Built by :func:`flowprefill.gateway.cli.build_state`."""

    model_name: str
    tokenizer: Tokenizer
    slo_file: SLOTableFile
    prefill_pool: InstancePool
    decode_pool: InstancePool | None
    prefill_client: PrefillClient
    decode_client: DecodeClient | None
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    clock: Callable[[], float] = time.monotonic
    """Monotonic seconds: arrival, deadlines, TTFT."""
    table_refresh_s: float = 1.0
    """How often the SLO table file is checked for changes."""
    health_probe: HealthProbeSettings | None = field(default_factory=HealthProbeSettings)
    """Liveness probing of the instances (flowprefill.gateway.health.HealthProber); None: off."""

    def __post_init__(self) -> None:
        export_slo_targets(self.metrics.registry, lambda: self.slo_file.table)


def class_headers(classification: Classification) -> dict[str, str]:
    headers = {CLASS_HEADER: classification.slo_class.name}
    note = fallback_note(classification)
    if note is not None:
        headers[FALLBACK_HEADER] = note
    return headers


def create_gateway_app(state: GatewayState) -> GatewayApp:
    """The gateway's ASGI app: a FastAPI app (every route, OpenAPI, the error handlers)
    whose completion endpoints well-formed requests reach directly
    (:class:`~flowprefill.gateway.asgi.GatewayApp`)."""
    m = state.metrics
    prefill = PrefillStage(
        state.prefill_pool,
        state.prefill_client,
        m,
        state.clock,
        has_decode=state.decode_pool is not None,
    )
    decode = DecodeStage(
        state.decode_pool,
        state.decode_client,
        state.prefill_client,
        state.tokenizer.eos_token_ids,
        state.clock,
    )
    relay = Relay(state.model_name, m)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        watcher = asyncio.create_task(_watch_table(state))
        pools = [p for p in (state.prefill_pool, state.decode_pool) if p is not None]
        prober = (
            asyncio.create_task(HealthProber(pools, state.health_probe).run())
            if state.health_probe is not None
            else None
        )
        try:
            yield
        finally:
            watcher.cancel()
            if prober is not None:
                prober.cancel()
            await state.prefill_client.http.aclose()

    app = FastAPI(title="FlowPrefill gateway", lifespan=lifespan)
    install_error_handlers(app)

    @app.exception_handler(ClientError)
    async def _client_error(_: Request, exc: ClientError) -> JSONResponse:
        return error_response(exc.status, str(exc), exc.type_, param=exc.param)

    async def serve(
        request: Request, body: CompletionRequest | ChatCompletionRequest, path: str
    ) -> JSONResponse | EventStreamResponse:
        job = intake(
            body,
            arrival_s=state.clock(),
            headers=RequestHeaders(request.scope["headers"]),  # read once, not per lookup
            path=path,
            model_name=state.model_name,
            table=state.slo_file.table,
            tokenizer=state.tokenizer,
        )
        headers = class_headers(job.classification)
        m.claims(job.classification.refusals)
        m.in_flight.inc()
        try:
            return await _answer(request, job, headers)
        except (GatewayError, ClientDisconnected) as e:
            err = as_gateway_error(e)
            m.failed(err)
            return error_response(err.status, str(err), err.type_, headers=headers | err.headers)
        finally:
            m.in_flight.dec()

    async def _answer(
        request: Request, job: Job, headers: dict[str, str]
    ) -> JSONResponse | EventStreamResponse:
        # One watch for the client leaving, from the wait for the first token to the
        # stream's end (the response closes it); closed here when no stream follows.
        watch: DisconnectWatch | None = DisconnectWatch(request.receive)
        try:
            answer = await unless_disconnected(request, prefill.run(job), watch)
            first_text = state.tokenizer.decode_token(answer.first_token_id)
            pieces = decode.continuation(job, answer)
            if job.body.stream:
                events = relay.stream(job, first_text, pieces)
                response = EventStreamResponse(events, media_type=MEDIA_TYPE, headers=headers)
                response.watch, watch = watch, None
                return response
            return JSONResponse(await relay.collect(job, first_text, pieces), headers=headers)
        finally:
            if watch is not None:
                watch.close()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await serve(request, body, request.url.path)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        return await serve(request, body, request.url.path)

    @app.post("/tokenize")
    async def tokenize(body: Annotated[dict[str, Any], Body()]) -> dict[str, Any]:
        return tokens.tokenize(tokens.parse_tokenize(body), state.tokenizer, state.model_name)

    @app.post("/detokenize")
    async def detokenize(body: Annotated[dict[str, Any], Body()]) -> dict[str, Any]:
        return tokens.detokenize(tokens.parse_detokenize(body), state.tokenizer, state.model_name)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return models_body(state.model_name)

    @app.get("/version")
    async def version() -> dict[str, str]:
        """vLLM's ``/version`` shape, ``{"version": ...}``, with FlowPrefill's version: the
        answers (first token, fields served, errors, usage) are the gateway's, not any one
        vLLM's, and the decode instances behind it may run different vLLM versions (or
        none may be up); a client that keys behaviour on the version must not take this
        for a vLLM server's."""
        return {"version": __version__}

    add_probe_routes(
        app,
        not_ready=lambda: None if state.prefill_pool.healthy() else "no healthy prefill instance",
        registry=m.registry,
    )
    return GatewayApp(app, serve)


async def _watch_table(state: GatewayState) -> None:
    while True:
        await asyncio.sleep(state.table_refresh_s)
        if state.slo_file.refresh():
            state.metrics.table_reloads.inc()
