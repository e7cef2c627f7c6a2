"""The prefill instance's listeners: its main API and, with the ``http`` KV transport, the
KV hand-off listener (:mod:`flowprefill.prefill.server.kv_http`) — two uvicorn servers on one
event loop in one process, which start, stop and drain together.

* **Start.** The KV listener binds first and the main one once it listens, so a KV port
  in use stops the process (uvicorn exits with status 3) before it takes any traffic: an
  instance is never half up.
* **Stop.** SIGTERM/SIGINT (or ``main.should_exit``, as a failed tensor-parallel rank sets
  it) stops the main listener as uvicorn always did: no new connections, in-flight
  prefills finish within the drain timeout, then the engine closes. The KV listener keeps
  serving all that time — the hand-offs of the prefills finishing in the drain are what
  decode pulls then — and stops after the main one, finishing its own transfers within the
  same timeout. A second SIGINT forces both out at once. The signal is raised again once
  both are down (as uvicorn does for one server), so the process ends as it was told to.
* **Failure.** A KV listener that stops on its own takes the main one down with it: an
  instance whose hand-offs cannot be pulled should be restarted, not keep answering.

Both carry the same client limits (:class:`~flowprefill.web.errors.BodySizeLimit`, the
header deadline of :func:`~flowprefill.web.limits.uvicorn_options`).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

import uvicorn

from flowprefill.web.errors import BodySizeLimit
from flowprefill.web.limits import uvicorn_options

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@dataclass(frozen=True)
class ClientLimits:
    """What one client may cost a listener (serve-prefill's command line)."""

    max_body_bytes: int
    body_timeout_s: float
    header_timeout_s: float
    drain_timeout_s: float


class Listener(uvicorn.Server):
    """A uvicorn server that leaves signals to :func:`serve`: uvicorn's own handling would
    let only the server installed last see them."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def listener(app: Any, host: str, port: int, limits: ClientLimits) -> Listener:
    return Listener(
        uvicorn.Config(
            BodySizeLimit(app, limits.max_body_bytes, limits.body_timeout_s),
            host=host,
            port=port,
            timeout_graceful_shutdown=int(limits.drain_timeout_s),
            log_level="info",
            **uvicorn_options(limits.header_timeout_s),
        )
    )


def serve(main: Listener, kv: Listener | None = None) -> None:
    """Run ``main`` (and ``kv``) until a signal or ``main.should_exit``; see the module
    docstring for the order of start and stop."""
    captured: list[int] = []

    def on_signal(sig: int, frame: FrameType | None) -> None:
        captured.append(sig)
        main.handle_exit(sig, frame)
        if kv is not None and main.force_exit:  # a second Ctrl-C
            kv.force_exit = True

    in_main_thread = threading.current_thread() is threading.main_thread()
    originals = {s: signal.signal(s, on_signal) for s in HANDLED_SIGNALS} if in_main_thread else {}
    try:
        asyncio.run(_serve(main, kv))
    finally:
        for sig, handler in originals.items():
            signal.signal(sig, handler)
    for number in reversed(captured):
        signal.raise_signal(number)


async def _serve(main: Listener, kv: Listener | None) -> None:
    if kv is None:
        await main.serve()
        return
    kv_task = asyncio.create_task(kv.serve(), name="kv-listener")
    while not kv.started:
        if kv_task.done():
            await kv_task  # uvicorn raises SystemExit when it cannot bind
            raise RuntimeError(f"the KV listener on port {kv.config.port} stopped before starting")
        await asyncio.sleep(0.01)

    def kv_stopped(_: asyncio.Task[None]) -> None:
        main.should_exit = True

    kv_task.add_done_callback(kv_stopped)
    try:
        await main.serve()
    finally:
        kv.should_exit = True
        await kv_task
