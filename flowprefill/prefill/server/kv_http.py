"""The prefill instance's KV hand-off endpoints, split between its two listeners.

A hand-off file is the prompt's KV cache: prompt-derived data that only decode needs to
read. With the ``http`` transport the prefill server therefore serves reads on a port of
its own (:data:`~flowprefill.contracts.deployment.PREFILL_KV_PORT`), which a
NetworkPolicy opens to decode pods alone, and not on its main port, which the gateways
reach:

=====================  ===========================  ==================================
listener               ``/v1/kv/<id>``               who calls it
=====================  ===========================  ==================================
KV port (http only)    ``GET``/``HEAD``, ``DELETE``  decode: pulls the file (``Range``
                                                     answered), deletes it once loaded
main port              ``DELETE``                    gateway: releases a hand-off
                                                     decode will not load
main port              ``GET``/``HEAD`` → 405        nobody: the answer names the KV
                                                     listener (or the shared volume)
=====================  ===========================  ==================================

Answers: the file (streamed), ``{"handoff_id", "deleted": true}``, 404 (OpenAI-style
error body) when absent — never written, consumed or swept — and 400 for an id that is
not a valid hand-off id.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response

from flowprefill.contracts.deployment import HEALTH_PATH, KV_HTTP_PATH
from flowprefill.errors import KVHandoffError
from flowprefill.kv import SharedDirTransport
from flowprefill.web.errors import error_response, install_error_handlers

ROUTE = KV_HTTP_PATH + "{handoff_id}"
READ_METHODS = ["GET", "HEAD"]


class _KVFileResponse(FileResponse):
    chunk_size = 1 << 20  # hand-offs are MiBs; 64 KiB sends cost more event-loop turns


def create_kv_app(store: SharedDirTransport) -> FastAPI:
    """The KV listener's app: reads and deletes of the hand-offs in ``store``, and
    ``GET /health`` (the listener is up). No prefill API, readiness or metrics: those are
    the main port's."""
    app = FastAPI(
        title="FlowPrefill prefill instance: KV hand-offs",
        openapi_url=None,  # nothing to discover on a port only decode reaches
    )
    install_error_handlers(app)
    _add_read_route(app, store)
    add_delete_route(app, store)

    @app.get(HEALTH_PATH)
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


def add_delete_route(app: FastAPI, store: SharedDirTransport) -> None:
    """``DELETE /v1/kv/<id>``: the caller is done with the hand-off (or will not load it)."""

    @app.delete(ROUTE)
    async def delete_kv(handoff_id: str) -> Any:
        found = _locate(store, handoff_id)
        if isinstance(found, JSONResponse):
            return found
        if not store.delete(handoff_id):  # deleted concurrently
            return error_response(404, f"no KV hand-off {handoff_id!r} on this prefill instance")
        return {"handoff_id": handoff_id, "deleted": True}


def add_discard_route(app: FastAPI, discard: Callable[[str], bool]) -> None:
    """``DELETE /v1/kv/<id>`` for the ``nixl`` transport: free a published prompt's blocks
    that no decode will read (``discard(id)`` is False when none are held)."""

    @app.delete(ROUTE)
    async def discard_kv(handoff_id: str) -> Any:
        if not discard(handoff_id):
            return error_response(404, f"no KV of {handoff_id!r} held on this prefill instance")
        return {"handoff_id": handoff_id, "deleted": True}


def add_read_refusal(app: FastAPI, kv_url: str | None) -> None:
    """``GET``/``HEAD /v1/kv/<id>`` on the main port: 405 (``Allow: DELETE``) saying where
    hand-offs are read instead — ``kv_url``, the KV listener decode is told about, or with
    no listener (``shared_dir``) the shared volume."""
    where = (
        f"the KV port: GET {kv_url}{KV_HTTP_PATH}<id>"
        if kv_url is not None
        else "the shared hand-off directory (shared_dir transport): this instance serves none"
    )
    message = (
        f"KV hand-offs are not read on this port, which serves only DELETE {KV_HTTP_PATH}<id>; "
        f"decode reads them from {where}"
    )

    @app.api_route(ROUTE, methods=READ_METHODS, include_in_schema=False)
    async def refuse_read(handoff_id: str) -> Response:
        return error_response(405, message, headers={"allow": "DELETE"})


def _add_read_route(app: FastAPI, store: SharedDirTransport) -> None:
    @app.api_route(ROUTE, methods=READ_METHODS)
    async def get_kv(handoff_id: str, request: Request) -> Response:
        found = _locate(store, handoff_id)
        if isinstance(found, JSONResponse):
            return found
        path, st = found
        refused = check_range(request.headers.get("range"), st.st_size)
        if refused is not None:
            return refused
        # stat_result given: no second stat. A sweep between here and the open (files
        # older than the sweep age only) drops the connection, which decode reports.
        return _KVFileResponse(path, stat_result=st, media_type="application/octet-stream")


_RANGE = re.compile(r"bytes=([0-9]{0,19})-([0-9]{0,19})")


def check_range(value: str | None, size: int) -> JSONResponse | None:
    """The error answer for a ``Range`` header the KV listener does not serve, else None.

    One byte range — ``bytes=<first>-[<last>]`` or ``bytes=-<suffix length>``, all that
    decode sends — which Starlette's file response then serves; anything else gets an
    OpenAI-style 400 naming the header (Starlette's own answers to a bad range are plain
    text), a range past the end 416 with ``Content-Range: bytes */<size>``.
    """
    if value is None:
        return None
    match = _RANGE.fullmatch(value)
    if match is None or match.groups() == ("", ""):
        return error_response(
            400,
            f"Range header {value[:100]!r} is not one byte range: bytes=<first>-[<last>] or "
            "bytes=-<suffix length>",
            param="range",
        )
    first, last = match.groups()
    if first and last and int(last) < int(first):
        return error_response(
            400, f"Range header {value!r}: the last byte is before the first", param="range"
        )
    start = int(first) if first else size - int(last)
    if start >= size or (not first and int(last) == 0):
        return error_response(
            416,
            f"Range header {value!r} is outside the hand-off's {size} bytes",
            "invalid_request_error",
            param="range",
            headers={"content-range": f"bytes */{size}"},
        )
    return None


def _locate(
    store: SharedDirTransport, handoff_id: str
) -> tuple[str, os.stat_result] | JSONResponse:
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
