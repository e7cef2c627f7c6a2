"""HTTP server of one prefill instance: ``flowprefill serve-prefill``.

Endpoints:

* ``POST /v1/prefill`` — body :class:`PrefillRequest`; answers when the request's prefill
  finished with its first token and the KV hand-off parameters for decode. With
  ``"stream": true`` the answer is server-sent events: the first token as soon as it
  exists, then ``{"kv_transfer_params": ...}`` once the hand-off is written (``null`` if
  writing failed: decode recomputes), then ``[DONE]`` — so the KV write is not on the
  request's time to first token.
* ``GET /v1/kv/{id}``, ``DELETE /v1/kv/{id}`` — with the ``http`` KV transport: the
  hand-off file (streamed; ``Range`` requests answered, so decode reads the header alone)
  and its removal once decode is done. 404 when it is absent (never written, consumed or
  swept), 400 for an id that is not a valid hand-off id.
* ``GET /health`` (process alive), ``GET /ready`` (engine accepting; 503 while draining),
  ``GET /metrics`` (Prometheus text format).

A client that disconnects while its request waits or runs cancels it in the engine
(a running prefill stops at its next checkpoint). On SIGTERM uvicorn stops accepting
connections, ``/ready`` turns 503, in-flight requests finish, then the engine closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import (
    FileResponse,
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from flowprefill.engine import PrefillEngine, PrefillResult
from flowprefill.errors import (
    EngineClosedError,
    InvalidRequestError,
    KVHandoffError,
    TaskCancelledError,
)
from flowprefill.kv import SharedDirTransport
from flowprefill.server.errors import error_response, install_error_handlers
from flowprefill.server.kv_sink import KVSink

log = logging.getLogger(__name__)


class PrefillRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    request_id: str = Field(min_length=1, max_length=256, description="Unique per request.")
    prompt_token_ids: list[int] = Field(description="The tokenized prompt.")
    ttft_budget_ms: float = Field(
        gt=0, description="Time left until the request's TTFT deadline, as the gateway saw it."
    )
    slo_class: str = Field("default", max_length=128, description="SLO class name (metrics).")
    hand_off_kv: bool = Field(True, description="Write the KV hand-off for decode.")
    stream: bool = Field(
        False,
        description="Answer as server-sent events: the first token at once, the KV hand-off "
        "parameters when written.",
    )


class PrefillResponse(BaseModel):
    request_id: str
    first_token_id: int
    num_prompt_tokens: int
    queue_and_prefill_ms: float = Field(description="Arrival here → first token.")
    met_slo: bool
    num_preemptions: int
    batch_size: int
    kv_transfer_params: dict[str, Any] | None = Field(
        None, description="What decode needs to load this request's KV cache."
    )


async def _wait_unless_disconnected(request: Request, fut: Future[PrefillResult]) -> bool:
    """Wait for ``fut``; return False if the client went away first."""
    result: asyncio.Future[Any] = asyncio.wrap_future(fut)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher: asyncio.Future[Any] = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({result, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    return result in done


class _KVFileResponse(FileResponse):
    chunk_size = 1 << 20  # hand-offs are MiBs; 64 KiB sends cost more event-loop turns


def create_app(
    engine: PrefillEngine,
    kv_sink: KVSink | None = None,
    kv_store: SharedDirTransport | None = None,
) -> FastAPI:
    """``kv_store``: the directory ``kv_sink`` writes, served at ``/v1/kv/{id}`` (the
    ``http`` transport); None serves nothing (``shared_dir``: decode reads the volume)."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if not engine.loop.running:
            engine.start()
        try:
            yield
        finally:
            # uvicorn already drained in-flight HTTP requests; finish anything left.
            await asyncio.to_thread(engine.close, drain=True, timeout_s=30.0)

    app = FastAPI(title="FlowPrefill prefill instance", lifespan=lifespan)
    install_error_handlers(app)

    @app.post("/v1/prefill", response_model=PrefillResponse)
    async def prefill(body: PrefillRequest, request: Request) -> Any:
        try:
            fut = engine.submit(
                body.prompt_token_ids,
                ttft_slo_s=body.ttft_budget_ms / 1e3,
                slo_class=body.slo_class,
                request_id=body.request_id,
            )
        except EngineClosedError as e:
            return error_response(503, str(e), "service_unavailable")
        if not await _wait_unless_disconnected(request, fut):
            engine.cancel(body.request_id)
            log.info("client gone: cancelled %s", body.request_id)
            return error_response(499, "client closed the request", "cancelled")
        try:
            res = fut.result()
        except TaskCancelledError as e:
            return error_response(499, str(e), "cancelled")
        except EngineClosedError as e:
            return error_response(503, str(e), "service_unavailable")
        except InvalidRequestError as e:
            return error_response(400, str(e), "invalid_request_error")
        except Exception as e:
            log.exception("prefill of %s failed", body.request_id)
            return error_response(500, f"prefill failed: {type(e).__name__}: {e}", "server_error")
        answer = PrefillResponse(
            request_id=res.request_id,
            first_token_id=int(res.output.first_token_id),
            num_prompt_tokens=int(res.output.num_prompt_tokens),
            queue_and_prefill_ms=res.ttft_s * 1e3,
            met_slo=res.met_slo,
            num_preemptions=res.num_preemptions,
            batch_size=res.batch_size,
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
            except Exception:
                # The first token is still good; decode will recompute the prompt.
                log.exception("KV hand-off of %s failed; decode will recompute", body.request_id)
                return None
            log.debug(
                "KV hand-off of %s took %.1f ms", body.request_id, (time.perf_counter() - t0) * 1e3
            )
            return params

        if body.stream:

            async def events() -> AsyncIterator[str]:
                yield f"data: {answer.model_dump_json()}\n\n"
                if write_kv:
                    yield f"data: {json.dumps({'kv_transfer_params': await hand_off()})}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        if write_kv:
            answer.kv_transfer_params = await hand_off()
        return answer

    if kv_store is not None:
        _add_kv_routes(app, kv_store)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        if engine.accepting:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "draining"}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(
            generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST
        )

    return app


def _add_kv_routes(app: FastAPI, store: SharedDirTransport) -> None:
    def locate(handoff_id: str) -> tuple[str, os.stat_result] | JSONResponse:
        try:
            path = store.path(handoff_id)
        except KVHandoffError as e:
            return error_response(400, str(e), param="handoff_id")
        try:
            st = path.stat()
        except FileNotFoundError:
            return error_response(
                404,
                f"no KV hand-off {handoff_id!r} on this prefill instance (never written, "
                "already consumed, or swept)",
            )
        return str(path), st

    @app.get("/v1/kv/{handoff_id}")
    async def get_kv(handoff_id: str) -> Response:
        found = locate(handoff_id)
        if isinstance(found, JSONResponse):
            return found
        path, st = found
        # stat_result given: no second stat. A sweep between here and the open (files
        # older than the sweep age only) drops the connection, which decode reports.
        return _KVFileResponse(path, stat_result=st, media_type="application/octet-stream")

    @app.delete("/v1/kv/{handoff_id}")
    async def delete_kv(handoff_id: str) -> Any:
        found = locate(handoff_id)
        if isinstance(found, JSONResponse):
            return found
        if not store.delete(handoff_id):  # deleted concurrently
            return error_response(404, f"no KV hand-off {handoff_id!r} on this prefill instance")
        return {"handoff_id": handoff_id, "deleted": True}
