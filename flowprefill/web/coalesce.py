"""Writes to a connection made in the same event-loop iteration, sent as one.

uvicorn writes each ASGI message to its socket at once: a streamed answer's headers, then
every event, each a ``send`` system call (and, on loopback or a busy host, a wake-up of
the reader) — seven for a four-token completion stream. Much of that is ready at the
same moment: the headers and the first token; decode's tokens that arrived in one read,
the usage and ``[DONE]``. :class:`CoalescingTransport` holds what is written during one
iteration of the loop and sends it with one write at the start of the next: nothing
waits for anything but the code already running, so no event is delayed past the
moment the loop would have sent it anyway (a few microseconds).

Order is kept (one buffer, flushed before ``close``); ``abort`` drops what is held, as
it drops the transport's own buffer. Everything but ``write``/``writelines``/``close``/
``abort`` is the wrapped transport's (flow control included: what is held is at most one
iteration's writes).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any


class CoalescingTransport:
    """Wraps ``transport`` (see the module docstring)."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self._held:
            self._loop.call_soon(self._flush)
        self._held.append(bytes(data))

    def writelines(self, lines: Iterable[bytes | bytearray | memoryview]) -> None:
        for data in lines:
            self.write(data)

    def _flush(self) -> None:
        if not self._held:
            return
        data = self._held[0] if len(self._held) == 1 else b"".join(self._held)
        self._held = []
        if not self._transport.is_closing():
            self._transport.write(data)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def abort(self) -> None:
        self._held = []
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)
