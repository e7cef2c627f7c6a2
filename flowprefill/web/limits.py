"""Time limits on slow clients, for uvicorn as ``serve-prefill`` and ``serve-gateway`` run it.

uvicorn bounds the size of a request's headers (h11/httptools) and the idle time between
keep-alive requests, but not the time a client may take to *send* its headers: a
slowloris client that trickles header bytes holds a connection (and its buffers) for as
long as it likes. :func:`uvicorn_options` gives uvicorn a protocol that closes a
connection whose request headers are not complete ``header_timeout_s`` after the
connection opened (first request) or after the first byte of the next request arrived
(keep-alive) — after answering 408 where nothing has been sent on it yet. The body has
its own deadline, in :class:`~flowprefill.web.errors.BodySizeLimit` (an ASGI middleware:
the app sees the body).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import Any

from flowprefill.web.coalesce import CoalescingTransport

log = logging.getLogger(__name__)

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 60.0

_TIMEOUT_ANSWER = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"content-length: %d\r\n\r\n%s"
)


def header_deadline_protocol(
    header_timeout_s: float, *, coalesce_writes: bool = False
) -> type[asyncio.Protocol]:
    """uvicorn's HTTP/1.1 protocol (httptools or h11, as uvicorn picks) with a deadline for
    request headers. Works through the attributes both share (``cycle``, ``transport``,
    ``loop``): a request's headers are complete once uvicorn made its ``cycle``.
    ``coalesce_writes``: the answers' writes made in one loop iteration go out as one
    (:class:`~flowprefill.web.coalesce.CoalescingTransport`)."""
    if header_timeout_s <= 0:
        raise ValueError(f"header timeout must be positive, got {header_timeout_s}")
    # Imported here: the CLIs read this module's defaults when building their arguments,
    # before they know they will serve.
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    base: Any = AutoHTTPProtocol

    class HeaderDeadlineProtocol(base):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            if coalesce_writes:
                # After uvicorn took the transport for its flow control (pause/resume
                # reading stay the transport's): what its requests write goes through this.
                self.transport = CoalescingTransport(transport, self.loop)
            self._arm()  # a connection that never sends a byte is cut too

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if not self._awaiting_headers():
                self._disarm()
            elif self._header_timer is None:
                self._arm()  # the first bytes of a keep-alive connection's next request

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _awaiting_headers(self) -> bool:
            cycle = self.cycle
            return cycle is None or bool(cycle.response_complete)

        def _arm(self) -> None:
            self._header_timer = self.loop.call_later(header_timeout_s, self._expired)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _expired(self) -> None:
            self._header_timer = None
            if not self._awaiting_headers() or self.transport.is_closing():
                return
            log.info("closing a connection whose request headers took over %g s", header_timeout_s)
            body = (
                b'{"error": {"message": "request headers not received within %g s", '
                % (header_timeout_s)
                + b'"type": "invalid_request_error", "param": null, "code": null}}'
            )
            self.transport.write(_TIMEOUT_ANSWER % (len(body), body))
            self.transport.close()

    return HeaderDeadlineProtocol


def uvicorn_options(
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S, *, coalesce_writes: bool = False
) -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.Config`` that bound what one slow client holds;
    ``coalesce_writes``: see :func:`header_deadline_protocol`."""
    return {"http": header_deadline_protocol(header_timeout_s, coalesce_writes=coalesce_writes)}


def add_client_limit_arguments(p: argparse.ArgumentParser, *, max_body_mb: float) -> None:
    """The flags that bound what one client may cost a server (``serve-prefill`` and
    ``serve-gateway`` alike): body size, and the time to send headers and body."""
    p.add_argument(
        "--max-body-mb",
        type=float,
        default=max_body_mb,
        help="largest accepted body (413 over)",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT_S,
        help="seconds a client may take to send a request's headers (slowloris bound)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=DEFAULT_BODY_TIMEOUT_S,
        help="seconds a client may take to send a request's body (408 after)",
    )
