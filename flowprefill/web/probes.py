"""The probe and metrics routes every FlowPrefill server has (paths from
:mod:`flowprefill.contracts.deployment`).

* ``GET /health``: 200 while the process serves HTTP (liveness).
* ``GET /ready``: 200 ``{"status": "ready"}``, or 503 with the reason the server gives
  (draining, no upstream) — readiness, so load balancers stop sending work.
* ``GET /metrics``: the server's Prometheus registry in the text format.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from flowprefill.contracts.deployment import HEALTH_PATH, METRICS_PATH, READY_PATH


def add_probe_routes(
    app: FastAPI, *, not_ready: Callable[[], str | None], registry: CollectorRegistry
) -> None:
    """``not_ready()`` returns None when ready, else why not (the 503 body's status)."""

    @app.get(HEALTH_PATH)
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get(READY_PATH)
    async def ready() -> JSONResponse:
        reason = not_ready()
        if reason is None:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": reason}, status_code=503)

    @app.get(METRICS_PATH)
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
