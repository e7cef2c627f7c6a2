"""One prompt through the engine for an HTTP request, its failures as HTTP answers: what
``/v1/prefill`` and vLLM's P/D ``/v1/completions`` share."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from fastapi import Request

from flowprefill.errors import EngineClosedError, InvalidRequestError, TaskCancelledError
from flowprefill.prefill.engine import PrefillEngine
from flowprefill.web.disconnect import ClientDisconnected, unless_disconnected
from flowprefill.web.errors import error_response

log = logging.getLogger(__name__)


async def run_prefill(
    engine: PrefillEngine,
    request: Request,
    token_ids: Sequence[int],
    *,
    request_id: str,
    ttft_slo_s: float,
    elapsed_s: float,
    slo_class: str,
) -> Any:
    """The engine's result (a ``PrefillResult``), or the error answer (a
    ``JSONResponse``): 499 when the client went away (the request is cancelled in the
    engine: a running prefill stops at its next checkpoint) or it was cancelled, 503 while
    the engine is closed, 400 for a prompt it refuses, 500 (logged) for anything else."""
    try:
        fut = engine.submit(
            token_ids,
            ttft_slo_s=ttft_slo_s,
            elapsed_s=elapsed_s,
            slo_class=slo_class,
            request_id=request_id,
        )
    except EngineClosedError as e:
        return error_response(503, str(e), "service_unavailable")
    answer = asyncio.wrap_future(fut)
    try:
        # Shielded: the engine owns its future (it must stay settable); a client gone
        # cancels the request in the engine instead, which then fails the future.
        return await unless_disconnected(request, asyncio.shield(answer))
    except ClientDisconnected:
        # Nobody awaits the answer any more: take its TaskCancelledError when it comes, or
        # asyncio logs "Future exception was never retrieved" for every client gone.
        answer.add_done_callback(_retrieve)
        engine.cancel(request_id)
        log.info("client gone: cancelled %s", request_id)
        return error_response(499, "client closed the request", "cancelled")
    except TaskCancelledError as e:
        return error_response(499, str(e), "cancelled")
    except EngineClosedError as e:
        return error_response(503, str(e), "service_unavailable")
    except InvalidRequestError as e:
        return error_response(400, str(e), "invalid_request_error")
    except Exception as e:
        log.exception("prefill of %s failed", request_id)
        return error_response(500, f"prefill failed: {type(e).__name__}: {e}", "server_error")


def _retrieve(answer: asyncio.Future[Any]) -> None:
    if not answer.cancelled():
        answer.exception()
