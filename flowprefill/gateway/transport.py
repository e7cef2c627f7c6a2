"""The gateway's HTTP client for its upstreams: POST a JSON body, read a JSON answer or
an SSE stream, DELETE; every failure becomes an :class:`~flowprefill.gateway.errors.UpstreamError`
with the status the gateway answers (502 for an instance that failed or vanished
mid-request, 503 when it refused the connection, 504 on timeout; a 4xx is passed through)
and a reason label ``<role>_<what>`` for metrics.

Two upstream calls per request (prefill, then the decode stream) are most of the
gateway's own CPU time, so the HTTP client matters: aiohttp is used when it is installed
(it costs several times less CPU per request than httpx, whose connection pool also scans
every pooled connection on each request), httpx otherwise. Both keep connections alive
and send the same bytes; see docs/gateway.md for the measurements.
"""

from __future__ import annotations

import asyncio
import json
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

import httpx

from flowprefill.gateway.errors import UpstreamError

if TYPE_CHECKING:
    import aiohttp

HTTP_BACKENDS = ("auto", "aiohttp", "httpx")
DRAIN_TIMEOUT_S = 1.0
KEEPALIVE_S = 4.0
"""Idle upstream connections are dropped after this; below uvicorn's (and so vLLM's)
default 5 s keep-alive, so the gateway does not send a request on a connection the
server is closing."""


def _upstream_message(status: int, content: bytes) -> str:
    try:
        err = json.loads(content).get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
    except (ValueError, AttributeError):
        pass
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = ""
    return content.decode("utf-8", errors="replace")[:500] or phrase


def _status_error(role: str, status: int, content: bytes) -> UpstreamError:
    return UpstreamError(
        status if status < 500 else 502, _upstream_message(status, content), f"{role}_{status}"
    )


def _unreachable(role: str, url: str) -> UpstreamError:
    return UpstreamError(
        503, f"{role} instance {url} is unreachable", f"{role}_unreachable", retryable=True
    )


def _timed_out(role: str, url: str) -> UpstreamError:
    return UpstreamError(504, f"{role} instance {url} timed out", f"{role}_timeout")


def _failed(role: str, url: str, exc: BaseException) -> UpstreamError:
    return UpstreamError(
        502,
        f"{role} instance {url} failed mid-request ({type(exc).__name__})",
        f"{role}_failed",
        connection_lost=True,
    )


def _encode_json(body: dict[str, Any]) -> bytes:
    # As httpx's json= does, so both clients send the same bytes.
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


async def _sse_data(lines: AsyncIterator[str]) -> AsyncGenerator[str, None]:
    """The payloads of an SSE stream's ``data:`` lines, up to ``[DONE]``.

    After ``[DONE]`` the rest of the body (its chunked-encoding end) is read, so the
    connection goes back to the pool: a response left unfinished closes its connection,
    and the next request would pay for a new one. Bounded: an upstream that keeps the
    stream open after ``[DONE]`` only loses its connection."""
    async for line in lines:
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            try:
                async with asyncio.timeout(DRAIN_TIMEOUT_S):
                    async for _ in lines:
                        pass
            except TimeoutError:
                pass
            return
        yield payload


class UpstreamHTTP(ABC):
    """POST a JSON body and read a JSON answer or an SSE stream; ``role`` (prefill or
    decode) names the instance in errors and their reason labels."""

    @abstractmethod
    async def post_json(
        self, role: str, url: str, body: dict[str, Any], headers: dict[str, str]
    ) -> Any:
        """The decoded JSON answer."""

    @abstractmethod
    def sse(
        self, role: str, url: str, body: dict[str, Any], headers: dict[str, str]
    ) -> AsyncGenerator[str, None]:
        """The ``data:`` payloads of the streamed answer, up to ``[DONE]``."""

    @abstractmethod
    async def delete(self, role: str, url: str) -> int:
        """DELETE ``url``; the status (a missing resource is the caller's business)."""

    @abstractmethod
    async def aclose(self) -> None:
        """Close the pooled connections."""


class HttpxUpstream(UpstreamHTTP):
    def __init__(self, timeout_s: float = 600.0, connect_timeout_s: float = 5.0) -> None:
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            limits=httpx.Limits(
                max_connections=1000, max_keepalive_connections=100, keepalive_expiry=KEEPALIVE_S
            ),
        )

    @staticmethod
    def _translate(role: str, url: str, exc: httpx.HTTPError) -> UpstreamError:
        if isinstance(exc, httpx.ConnectError):
            return _unreachable(role, url)
        if isinstance(exc, httpx.TimeoutException):
            return _timed_out(role, url)
        return _failed(role, url, exc)

    async def post_json(
        self, role: str, url: str, body: dict[str, Any], headers: dict[str, str]
    ) -> Any:
        try:
            resp = await self.client.post(url, content=_encode_json(body), headers=_json(headers))
        except httpx.HTTPError as e:
            raise self._translate(role, url, e) from e
        if resp.status_code >= 400:
            raise _status_error(role, resp.status_code, resp.content)
        return json.loads(resp.content)

    async def sse(
        self, role: str, url: str, body: dict[str, Any], headers: dict[str, str]
    ) -> AsyncGenerator[str, None]:
        try:
            async with self.client.stream(
                "POST", url, content=_encode_json(body), headers=_json(headers)
            ) as resp:
                if resp.status_code >= 400:
                    raise _status_error(role, resp.status_code, await resp.aread())
                async with aclosing(_sse_data(resp.aiter_lines())) as payloads:
                    async for payload in payloads:
                        yield payload
        except httpx.HTTPError as e:
            raise self._translate(role, url, e) from e

    async def delete(self, role: str, url: str) -> int:
        try:
            resp = await self.client.delete(url)
        except httpx.HTTPError as e:
            raise self._translate(role, url, e) from e
        return resp.status_code

    async def aclose(self) -> None:
        await self.client.aclose()


class AiohttpUpstream(UpstreamHTTP):
    """The session is made on first use, in the event loop that serves requests."""

    def __init__(self, timeout_s: float = 600.0, connect_timeout_s: float = 5.0) -> None:
        import aiohttp

        self._aiohttp = aiohttp
        self.timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout_s, sock_read=timeout_s, connect=timeout_s
        )
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            aiohttp = self._aiohttp
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=1000, limit_per_host=0, keepalive_timeout=KEEPALIVE_S
                ),
                timeout=self.timeout,
                cookie_jar=aiohttp.DummyCookieJar(),
            )
            self._loop = loop
        return self._session

    def _translate(self, role: str, url: str, exc: BaseException) -> UpstreamError:
        if isinstance(exc, TimeoutError):
            return _timed_out(role, url)
        if isinstance(exc, self._aiohttp.ClientConnectorError):
            return _unreachable(role, url)
        return _failed(role, url, exc)

    async def post_json(
        self, role: str, url: str, body: dict[str, Any], headers: dict[str, str]
    ) -> Any:
        try:
            async with self.session().post(
                url, data=_encode_json(body), headers=_json(headers), allow_redirects=False
            ) as resp:
                content = await resp.read()
        except (self._aiohttp.ClientError, TimeoutError) as e:
            raise self._translate(role, url, e) from e
        if resp.status >= 400:
            raise _status_error(role, resp.status, content)
        return json.loads(content)

    async def sse(
        self, role: str, url: str, body: dict[str, Any], headers: dict[str, str]
    ) -> AsyncGenerator[str, None]:
        try:
            async with self.session().post(
                url, data=_encode_json(body), headers=_json(headers), allow_redirects=False
            ) as resp:
                if resp.status >= 400:
                    raise _status_error(role, resp.status, await resp.read())
                async with aclosing(_sse_data(_lines(resp.content))) as payloads:
                    async for payload in payloads:
                        yield payload
        except (self._aiohttp.ClientError, TimeoutError) as e:
            raise self._translate(role, url, e) from e

    async def delete(self, role: str, url: str) -> int:
        try:
            async with self.session().delete(url, allow_redirects=False) as resp:
                await resp.read()
                return resp.status
        except (self._aiohttp.ClientError, TimeoutError) as e:
            raise self._translate(role, url, e) from e

    async def aclose(self) -> None:
        if self._session is not None and self._loop is asyncio.get_running_loop():
            await self._session.close()
        self._session = None


async def _lines(content: aiohttp.StreamReader) -> AsyncIterator[str]:
    """Lines of a streamed body as httpx's ``aiter_lines`` splits them (``\\n``, ``\\r\\n``
    or ``\\r``), without a limit on line length."""
    buf = b""
    async for data in content.iter_any():
        buf += data
        if b"\r" in buf:
            if buf.endswith(b"\r"):  # maybe the first half of a \r\n
                continue
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        *complete, buf = buf.split(b"\n")
        for line in complete:
            yield line.decode("utf-8", errors="replace")
    if buf:
        buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        for line in buf.split(b"\n"):
            if line:
                yield line.decode("utf-8", errors="replace")


def _json(headers: dict[str, str]) -> dict[str, str]:
    return {**headers, "content-type": "application/json"}


def make_upstream_http(
    backend: str = "auto", timeout_s: float = 600.0, connect_timeout_s: float = 5.0
) -> UpstreamHTTP:
    """``auto``: aiohttp when it is installed, else httpx."""
    if backend not in HTTP_BACKENDS:
        raise ValueError(f"unknown upstream HTTP client {backend!r}; one of {HTTP_BACKENDS}")
    if backend == "auto":
        try:
            import aiohttp  # noqa: F401
        except ImportError:
            backend = "httpx"
        else:
            backend = "aiohttp"
    cls = AiohttpUpstream if backend == "aiohttp" else HttpxUpstream
    return cls(timeout_s, connect_timeout_s)
