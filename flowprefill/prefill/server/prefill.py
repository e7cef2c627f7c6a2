"""HTTP server of one prefill instance: ``flowprefill serve-prefill``.

Endpoints:

* ``POST /v1/prefill`` — :mod:`flowprefill.contracts.prefill_api`: a
  :class:`~flowprefill.contracts.prefill_api.PrefillRequest` (the class's ``ttft_slo_s``
  and the ``elapsed_s`` since gateway arrival) is answered, when its prefill produced the
  first token, with a :class:`~flowprefill.contracts.prefill_api.PrefillResponse`:
  ``ttft_s`` from gateway arrival and ``met_slo`` against the class SLO, as the engine
  judged them (the outcome metric uses the same), the KV hand-off for decode, and on a
  colocated instance its own decode's URL (``decode_url``, where the gateway decodes). With
  ``"stream": true`` the answer is server-sent events: the response as soon as the first
  token exists, then a :class:`~flowprefill.contracts.prefill_api.KVHandoffEvent` once
  the hand-off is written (``null`` if writing failed: decode recomputes), then
  ``[DONE]`` — so the KV write is not on the request's time to first token.
* ``GET /v1/load`` — the instance's backlog as the engine published it after its latest
  scheduling round (:class:`~flowprefill.prefill.engine.EngineSnapshot`; as a
  :class:`~flowprefill.contracts.prefill_api.PrefillLoad`: tokens still to prefill and the
  engine's predicted time for them); every prefill answer carries the same in its ``load``
  field, which the gateway's admission reads (:mod:`flowprefill.gateway.admission`).
* ``DELETE /v1/kv/{id}`` — the gateway releases a hand-off decode will not load (both
  transports). Reads of hand-offs are not served here: with the ``http`` transport decode
  pulls them from the instance's KV listener (:mod:`flowprefill.prefill.server.kv_http`, its own
  port, so that only decode pods need reach it); ``GET`` here answers 405 naming it.
* ``GET /health`` (process alive), ``GET /ready`` (engine accepting; 503 while draining),
  ``GET /metrics`` (Prometheus text format).

``HEAD`` on any path is answered as ``GET`` is there, without the body
(:mod:`flowprefill.web.head`, as the gateway does): FastAPI's ``GET`` routes alone answer
405 to it, and scrapers and load balancers send ``HEAD /metrics`` or ``HEAD /health``.

A client that disconnects while its request waits or runs cancels it in the engine
(a running prefill stops at its next checkpoint). On SIGTERM uvicorn stops accepting
connections, ``/ready`` turns 503, in-flight requests finish, then the engine closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from flowprefill.contracts.deployment import PREFILL_API_PATH
from flowprefill.contracts.prefill_api import (
    LOAD_PATH,
    KVHandoffEvent,
    PrefillLoad,
    PrefillRequest,
    PrefillResponse,
    check_decode_url,
)
from flowprefill.errors import KVBudgetExceededError
from flowprefill.kv import SharedDirTransport
from flowprefill.prefill.engine import PrefillEngine
from flowprefill.prefill.server.kv_http import add_delete_route, add_read_refusal
from flowprefill.prefill.server.kv_sink import KVSink
from flowprefill.prefill.server.submit import run_prefill
from flowprefill.web.errors import install_error_handlers
from flowprefill.web.head import head_as_get, is_head
from flowprefill.web.probes import add_probe_routes
from flowprefill.web.sse import DONE, MEDIA_TYPE, sse_event

log = logging.getLogger(__name__)


def create_app(
    engine: PrefillEngine,
    kv_sink: KVSink | None = None,
    kv_store: SharedDirTransport | None = None,
    kv_url: str | None = None,
    decode_url: str | None = None,
) -> FastAPI:
    """``kv_store``: the directory ``kv_sink`` writes, whose hand-offs the gateway deletes
    at ``DELETE /v1/kv/{id}``; None serves no KV route. ``kv_url``: the base URL of the
    instance's KV listener (``http`` transport), named by the 405 a read here gets.
    ``decode_url``: this colocated instance's own decode, named in every answer
    (:attr:`~flowprefill.contracts.prefill_api.PrefillResponse.decode_url`; ValueError
    when it is no ``http(s)://host:port``)."""
    if decode_url is not None:
        decode_url = check_decode_url(decode_url)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if not engine.snapshot.running:
            engine.start()
        try:
            yield
        finally:
            # uvicorn already drained in-flight HTTP requests; finish anything left.
            await asyncio.to_thread(engine.close, drain=True, timeout_s=30.0)

    app = FastAPI(title="FlowPrefill prefill instance", lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(HeadAsGet)

    @app.post(PREFILL_API_PATH, response_model=PrefillResponse)
    async def prefill(body: PrefillRequest, request: Request) -> Any:
        res = await run_prefill(
            engine,
            request,
            body.prompt_token_ids,
            request_id=body.request_id,
            ttft_slo_s=body.ttft_slo_s,
            elapsed_s=body.elapsed_s,
            slo_class=body.slo_class,
        )
        if isinstance(res, JSONResponse):
            return res
        answer = PrefillResponse(
            request_id=res.request_id,
            first_token_id=int(res.output.first_token_id),
            num_prompt_tokens=int(res.output.num_prompt_tokens),
            ttft_s=res.ttft_s,
            met_slo=res.met_slo,
            num_preemptions=res.num_preemptions,
            batch_size=res.batch_size,
            load=engine.snapshot.load,
            decode_url=decode_url,
        )
        write_kv = kv_sink is not None and body.hand_off_kv

        async def hand_off() -> dict[str, Any] | None:
            assert kv_sink is not None
            t0 = time.perf_counter()
            try:
                # In a thread: the event loop keeps serving while the file is written. A
                # client gone meanwhile leaves the file to the sweep.
                params: dict[str, Any] | None = await asyncio.to_thread(
                    kv_sink, body.request_id, body.prompt_token_ids, res.output
                )
            except KVBudgetExceededError as e:
                # The first token is still good; decode will recompute the prompt.
                engine.metrics.count_kv_refusal(e)
                log.warning("no KV hand-off for %s (%s); decode will recompute", body.request_id, e)
                return None
            except Exception as e:
                engine.metrics.count_kv_refusal(e)
                log.exception("KV hand-off of %s failed; decode will recompute", body.request_id)
                return None
            log.debug(
                "KV hand-off of %s took %.1f ms", body.request_id, (time.perf_counter() - t0) * 1e3
            )
            return params

        if body.stream:

            async def events() -> AsyncIterator[str]:
                yield sse_event(answer)
                if write_kv:
                    yield sse_event(KVHandoffEvent(kv_transfer_params=await hand_off()))
                yield DONE

            return StreamingResponse(events(), media_type=MEDIA_TYPE)
        if write_kv:
            answer.kv_transfer_params = await hand_off()
        return answer

    @app.get(LOAD_PATH, response_model=PrefillLoad)
    async def load() -> PrefillLoad:
        return engine.snapshot.load

    if kv_store is not None:
        add_delete_route(app, kv_store)
        add_read_refusal(app, kv_url)

    add_probe_routes(
        app,
        not_ready=lambda: None if engine.accepting else _why_not_ready(engine),
        registry=engine.metrics.registry,
    )
    return app


class HeadAsGet:
    """ASGI middleware: a ``HEAD`` request is served as the app serves ``GET`` on its path,
    without the body (same status and headers, ``content-length`` included); every other
    request passes through untouched. It covers routes added after :func:`create_app`
    returns too (the NIXL discard and PD routes)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if is_head(scope):
            await head_as_get(self.app, scope, receive, send)
        else:
            await self.app(scope, receive, send)


def _why_not_ready(engine: PrefillEngine) -> str:
    failure = engine.failure
    return "draining" if failure is None else f"failed: {failure}"
