"""HTTP clients of the gateway's upstreams: prefill instances and vLLM decode instances.

Failures become :class:`UpstreamError` with the status the gateway should answer (502 for
an instance that failed or vanished mid-request, 503 when none is available, 504 on
timeout) and a reason label for metrics; a 4xx from an upstream is passed through.

Two upstream calls per request (prefill, then the decode stream) are most of the
gateway's own CPU time, so the HTTP client matters: aiohttp is used when it is installed
(it costs several times less CPU per request than httpx, whose connection pool also scans
every pooled connection on each request), httpx otherwise. Both keep connections alive
and send the same bytes; see docs/gateway.md for the measurements.
"""

from __future__ import annotations

import asyncio
import json
import logging
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, replace
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    import aiohttp

log = logging.getLogger(__name__)

HTTP_BACKENDS = ("auto", "aiohttp", "httpx")
DRAIN_TIMEOUT_S = 1.0
KEEPALIVE_S = 4.0
"""Idle upstream connections are dropped after this; below uvicorn's (and so vLLM's)
default 5 s keep-alive, so the gateway does not send a request on a connection the
server is closing."""


class UpstreamError(Exception):
    def __init__(self, status: int, message: str, reason: str, retryable: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.retryable = retryable
        """True only when nothing was processed (connection refused): safe to try elsewhere."""


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
        502, f"{role} instance {url} failed mid-request ({type(exc).__name__})", f"{role}_failed"
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


@dataclass(frozen=True, slots=True)
class PrefillAnswer:
    first_token_id: int
    num_prompt_tokens: int
    prefill_ms: float
    num_preemptions: int
    kv_transfer_params: dict[str, Any] | None
    kv_pending: asyncio.Task[dict[str, Any] | None] | None = None
    """The rest of a streamed answer: the hand-off parameters once prefill has written them."""
    prefill_url: str | None = None
    """The prefill instance that answered (base URL): it serves ``DELETE /v1/kv/<id>``."""

    async def hand_off(self) -> dict[str, Any] | None:
        """What decode needs to load the prompt's KV cache; None: decode recomputes it."""
        if self.kv_pending is None:
            return self.kv_transfer_params
        return await self.kv_pending


def _answer(data: Any) -> PrefillAnswer:
    try:
        return PrefillAnswer(
            first_token_id=int(data["first_token_id"]),
            num_prompt_tokens=int(data["num_prompt_tokens"]),
            prefill_ms=float(data["queue_and_prefill_ms"]),
            num_preemptions=int(data.get("num_preemptions", 0)),
            kv_transfer_params=data.get("kv_transfer_params"),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise UpstreamError(
            502, f"prefill instance sent a malformed answer ({e!r})", "prefill_failed"
        ) from e


async def _kv_params(payloads: AsyncGenerator[str, None], request_id: str) -> dict[str, Any] | None:
    """Read a streamed prefill answer to its end; its ``kv_transfer_params`` event, if any.

    Never raises (but for cancellation): a hand-off that does not arrive (prefill died
    after the first token, a malformed event) means decode recomputes the prompt, not a
    failed request."""
    params: dict[str, Any] | None = None
    try:
        async with aclosing(payloads):
            async for payload in payloads:
                event = json.loads(payload)
                if isinstance(event, dict) and isinstance(event.get("kv_transfer_params"), dict):
                    params = event["kv_transfer_params"]
    except Exception as e:
        log.warning("KV hand-off of %s did not arrive (%r); decode will recompute", request_id, e)
    return params


_BACKGROUND: set[asyncio.Task[Any]] = set()
"""Hand-off reads and releases nobody may await (first token EOS, client gone): the event
loop keeps only weak references to tasks."""


class PrefillClient:
    def __init__(self, http: UpstreamHTTP) -> None:
        self.http = http

    def release(self, answer: PrefillAnswer) -> None:
        """Decode will not load this answer's KV hand-off: delete it through the prefill
        instance that wrote it (``source`` in the parameters for the ``http`` transport,
        else the instance that answered: it owns the shared directory) instead of leaving
        it to prefill's age sweep, so it does not fill the disk. In the background; a
        failure only leaves the file to the sweep."""
        task = asyncio.create_task(self._release(answer))
        _BACKGROUND.add(task)
        task.add_done_callback(_BACKGROUND.discard)

    async def _release(self, answer: PrefillAnswer) -> None:
        params = await answer.hand_off()
        body = (params or {}).get("flowprefill")
        if not isinstance(body, dict):
            return
        source, handoff_id = body.get("source") or answer.prefill_url, body.get("handoff_id")
        if not (isinstance(source, str) and isinstance(handoff_id, str)):
            return
        try:
            await self.http.delete("prefill", f"{source.rstrip('/')}/v1/kv/{handoff_id}")
        except UpstreamError as e:
            log.debug("release of KV hand-off %s failed (%s); left to the sweep", handoff_id, e)

    async def prefill(
        self,
        url: str,
        *,
        request_id: str,
        token_ids: list[int],
        ttft_budget_ms: float,
        slo_class: str,
        headers: dict[str, str],
        hand_off_kv: bool = True,
    ) -> PrefillAnswer:
        """The first token as soon as prefill has it. With ``hand_off_kv`` the answer is
        streamed and the hand-off parameters follow (:meth:`PrefillAnswer.hand_off`), so
        writing the KV cache is not on the time to first token."""
        body = {
            "request_id": request_id,
            "prompt_token_ids": token_ids,
            "ttft_budget_ms": max(ttft_budget_ms, 0.001),
            "slo_class": slo_class,
            "hand_off_kv": hand_off_kv,
        }
        base, url = url, f"{url}/v1/prefill"
        if not hand_off_kv:
            return _answer(await self.http.post_json("prefill", url, body, headers))
        payloads = self.http.sse("prefill", url, {**body, "stream": True}, headers)
        try:
            first = await anext(payloads, None)
            if first is None:
                raise UpstreamError(
                    502, "prefill instance ended its answer early", "prefill_failed"
                )
            try:
                answer = _answer(json.loads(first))
            except ValueError as e:
                raise UpstreamError(
                    502, f"prefill instance sent a malformed answer ({e})", "prefill_failed"
                ) from e
        except BaseException:
            await payloads.aclose()
            raise
        task = asyncio.create_task(_kv_params(payloads, request_id))
        _BACKGROUND.add(task)
        task.add_done_callback(_BACKGROUND.discard)
        return replace(answer, kv_pending=task, prefill_url=base)


@dataclass(frozen=True, slots=True)
class DecodeDelta:
    text: str
    finish_reason: str | None = None
    completion_tokens: int | None = None


class DecodeClient:
    """Streams a continuation from a vLLM OpenAI server's ``/v1/completions``."""

    def __init__(self, http: UpstreamHTTP, model: str) -> None:
        self.http = http
        self.model = model

    async def stream(
        self,
        url: str,
        *,
        prompt_token_ids: list[int],
        max_tokens: int,
        sampling: dict[str, Any],
        kv_transfer_params: dict[str, Any] | None,
        headers: dict[str, str],
        request_id: str,
    ) -> AsyncGenerator[DecodeDelta, None]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt_token_ids,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            **sampling,
        }
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        headers = {**headers, "x-request-id": request_id}
        payloads = self.http.sse("decode", f"{url}/v1/completions", body, headers)
        async with aclosing(payloads):  # an early exit closes the upstream connection now
            async for payload in payloads:
                chunk = json.loads(payload)
                if "error" in chunk:
                    raise UpstreamError(502, str(chunk["error"]), "decode_stream_error")
                usage = chunk.get("usage") or {}
                choices = chunk.get("choices") or []
                if choices:
                    c = choices[0]
                    yield DecodeDelta(c.get("text") or "", c.get("finish_reason"))
                if usage.get("completion_tokens") is not None:
                    yield DecodeDelta("", None, int(usage["completion_tokens"]))
