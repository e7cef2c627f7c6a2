"""A lean HTTP/1.1 client for the gateway's upstream calls: keep-alive connections per
upstream, one request at a time on each, responses parsed by httptools (uvicorn's parser).

Why not aiohttp: two upstream calls per request were a quarter of the gateway's CPU time,
most of it in aiohttp's per-request machinery (request and response objects, URL and
header handling, a timer rescheduled per chunk) that a gateway talking to its own
upstreams does not need. What this client does, and no more:

- ``request(method, url, body, headers)`` sends the request in one write (request line,
  ``host``, ``content-length`` when there is a body, the given headers) on an idle
  connection to that upstream (the most recently used: warm), or a new one;
- :class:`Response` gives the status, then the body as it arrives (``chunks()``, with the
  transport paused while more than :data:`HIGH_WATER` bytes wait unread) or whole
  (``read()``);
- a response read to its end on a keep-alive connection returns the connection to the
  pool; any other (closed early, failed, cancelled) closes it, so the upstream sees the
  client leave; idle connections are closed after ``keepalive_s``;
- errors, for the caller to translate: :class:`ConnectError` (refused, unresolvable),
  :class:`TimeoutError` (connecting took over ``connect_timeout_s``, or nothing arrived
  for ``read_timeout_s`` while a response was awaited), :class:`ConnectionLost` (the
  connection broke or the answer was not HTTP).
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import urlsplit

import httptools

HIGH_WATER = 256 * 1024
"""Unread body bytes above which reading from the upstream pauses."""


class ConnectError(OSError):
    """The upstream could not be connected to (refused, unresolvable, unreachable)."""


class ConnectionLost(Exception):
    """The connection broke before the response was complete, or the answer was not HTTP."""


@dataclass(frozen=True, slots=True)
class Origin:
    scheme: str
    host: str
    port: int

    @property
    def host_header(self) -> bytes:
        default = 443 if self.scheme == "https" else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        return (host if self.port == default else f"{host}:{self.port}").encode()


_ORIGINS: dict[str, tuple[Origin, bytes]] = {}


def split_url(url: str) -> tuple[Origin, bytes]:
    """(origin, request target) of an absolute http(s) URL; cached (a gateway calls few)."""
    cached = _ORIGINS.get(url)
    if cached is not None:
        return cached
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    result = (Origin(parts.scheme, parts.hostname, port), target.encode())
    if len(_ORIGINS) < 10_000:  # bounded: URLs with ids (DELETE /v1/kv/<id>) are many
        _ORIGINS[url] = result
    return result


def _header_lines(headers: dict[str, str]) -> bytes:
    lines = []
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
            raise ValueError(f"invalid header {name!r}")
        lines.append(f"{name}: {value}\r\n")
    return "".join(lines).encode()


class Connection(asyncio.Protocol):
    """One connection; the response being read on it, as httptools parses it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, read_timeout_s: float | None) -> None:
        self.loop = loop
        self.read_timeout_s = read_timeout_s
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.lost = False
        self.idle_since = 0.0
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers_done = False
        self.keep_alive = False
        self.complete = False
        self.error: BaseException | None = None
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.paused = False
        self.delimited = False  # content-length or chunked: httptools sees the end
        self.waiter: asyncio.Future[None] | None = None
        self.last_data = self.loop.time()
        self.timer: asyncio.TimerHandle | None = None

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but behave as one.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.last_data = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(ConnectionLost(f"not an HTTP response ({e})"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.headers_done and not self.complete and not self.delimited and exc is None:
            self.complete = True  # a body that ends with the connection
        elif not self.complete and self.error is None:
            self.error = ConnectionLost(f"connection lost ({exc or 'closed by the server'})")
        self._wake()

    def pause_writing(self) -> None:  # requests are small: one write each
        pass

    def resume_writing(self) -> None:
        pass

    # httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-length" or (
            name == b"transfer-encoding" and b"chunked" in value.lower()
        ):
            self.delimited = True

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()  # llhttp's answer is valid here
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()

    # the request's side

    def _fail(self, error: BaseException) -> None:
        self.error = error
        if self.transport is not None:
            self.transport.close()
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _check_timeout(self) -> None:
        """One timer, re-armed from the last data rather than rescheduled per chunk; it
        lapses while nobody waits (the next wait arms it again)."""
        self.timer = None
        if self.waiter is None:
            return
        assert self.read_timeout_s is not None
        left = self.last_data + self.read_timeout_s - self.loop.time()
        if left > 0:
            self.timer = self.loop.call_at(self.loop.time() + left, self._check_timeout)
            return
        self._fail(TimeoutError(f"no data for {self.read_timeout_s:g} s"))

    async def wait(self) -> None:
        """Until the parser or the connection has news; raises what broke it. The read
        timeout counts while someone waits: from the last data or the wait's start."""
        if self.error is None:
            self.waiter = self.loop.create_future()
            if self.read_timeout_s is not None:
                self.last_data = max(self.last_data, self.loop.time())
                if self.timer is None:
                    self.timer = self.loop.call_at(
                        self.last_data + self.read_timeout_s, self._check_timeout
                    )
            try:
                await self.waiter
            finally:
                self.waiter = None
        if self.error is not None:
            raise self.error

    def take(self) -> bytes:
        chunk = self.chunks.popleft()
        self.buffered -= len(chunk)
        if self.paused and self.buffered <= HIGH_WATER // 4 and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return chunk

    def finish(self) -> bool:
        """The response is over (read or not): True when the connection may be reused."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        reusable = (
            self.complete
            and self.error is None
            and not self.lost
            and not self.chunks
            and self.keep_alive
        )
        if not reusable and self.transport is not None:
            self.transport.close()
        return reusable


class Response:
    """The status at once, the body as it comes (see the module docstring)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self.status = conn.status

    @property
    def received(self) -> bool:
        """The whole body has arrived: reading what is left of it never waits."""
        return self._conn.complete

    async def chunks(self) -> AsyncIterator[bytes]:
        conn = self._conn
        while True:
            if conn.chunks:
                yield conn.take()
            elif conn.complete:
                return
            else:
                await conn.wait()

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])


class Client:
    """Keep-alive connection pools, one per upstream origin (see the module docstring)."""

    def __init__(
        self,
        *,
        connect_timeout_s: float,
        read_timeout_s: float | None,
        keepalive_s: float,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.keepalive_s = keepalive_s
        self._idle: dict[Origin, list[Connection]] = {}
        self._sweep: asyncio.TimerHandle | None = None
        self._ssl: ssl.SSLContext | None = None

    async def _connect(self, origin: Origin) -> Connection:
        loop = asyncio.get_running_loop()
        idle = self._idle.get(origin)
        while idle:
            conn = idle.pop()
            if not conn.lost and loop.time() - conn.idle_since < self.keepalive_s:
                conn._reset()
                return conn
            if conn.transport is not None:
                conn.transport.close()
        if origin.scheme == "https" and self._ssl is None:
            self._ssl = ssl.create_default_context()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                transport, conn = await loop.create_connection(
                    lambda: Connection(loop, self.read_timeout_s),
                    origin.host,
                    origin.port,
                    ssl=self._ssl if origin.scheme == "https" else None,
                )
        except TimeoutError:
            raise
        except OSError as e:
            raise ConnectError(
                e.errno, f"cannot connect to {origin.host}:{origin.port}: {e}"
            ) from e
        # uvloop may resolve create_connection before it calls connection_made.
        conn.transport = transport
        return conn

    def _release(self, origin: Origin, conn: Connection) -> None:
        conn.idle_since = conn.loop.time()
        self._idle.setdefault(origin, []).append(conn)
        if self._sweep is None:
            self._sweep = conn.loop.call_later(self.keepalive_s, self._close_idle)

    def _close_idle(self) -> None:
        self._sweep = None
        loop = asyncio.get_running_loop()
        now, left = loop.time(), 0
        for conns in self._idle.values():
            for conn in [c for c in conns if c.lost or now - c.idle_since >= self.keepalive_s]:
                conns.remove(conn)
                if conn.transport is not None:
                    conn.transport.close()
            left += len(conns)
        if left:
            self._sweep = loop.call_later(self.keepalive_s, self._close_idle)

    def request(
        self, method: str, url: str, body: bytes | None, headers: dict[str, str]
    ) -> _Exchange:
        """``async with client.request(...) as response``: the connection is the
        response's until the block ends (see the module docstring)."""
        return _Exchange(self, method, url, body, headers)

    def close(self) -> None:
        """Close the idle connections (those in use close when their exchange ends)."""
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for conns in self._idle.values():
            for conn in conns:
                if conn.transport is not None:
                    conn.transport.close()
        self._idle.clear()


class _Exchange:
    def __init__(
        self, client: Client, method: str, url: str, body: bytes | None, headers: dict[str, str]
    ) -> None:
        self.client = client
        self.origin, target = split_url(url)
        head = [method.encode(), b" ", target, b" HTTP/1.1\r\nhost: ", self.origin.host_header]
        head.append(b"\r\n")
        if body is not None:
            head.append(b"content-length: %d\r\n" % len(body))
        head += [_header_lines(headers), b"\r\n"]
        if body:
            head.append(body)
        self.request = b"".join(head)
        self.conn: Connection | None = None

    async def __aenter__(self) -> Response:
        self.conn = conn = await self.client._connect(self.origin)
        assert conn.transport is not None
        conn.last_data = conn.loop.time()  # the read timeout runs from the request
        try:
            conn.transport.write(self.request)
            while not conn.headers_done:
                await conn.wait()
        except BaseException:
            conn.finish()  # not complete: closed
            raise
        return Response(conn)

    async def __aexit__(self, *exc: Any) -> None:
        conn = self.conn
        if conn is not None and conn.finish():
            self.client._release(self.origin, conn)
