"""The gateway's two upstream calls, each in its server's wire format.

- :class:`PrefillClient`: ``POST /v1/prefill`` of a prefill instance
  (:mod:`flowprefill.contracts.prefill_api`), and ``DELETE /v1/kv/<id>`` of a hand-off
  decode will not load.
- :class:`DecodeClient`: a vLLM OpenAI server's streamed ``/v1/completions``, continuing
  from the prompt plus the first token and loading the prompt's KV through
  ``kv_transfer_params`` (:class:`~flowprefill.contracts.kv.DecodeKV`).

Both go through :class:`UpstreamHTTP` (:mod:`flowprefill.gateway.http1`, a lean
keep-alive HTTP/1.1 client on httptools: two upstream calls per request were a quarter of
the gateway's own CPU time under aiohttp, docs/gateway.md has the measurements). It keeps
connections alive, and every failure becomes an
:class:`~flowprefill.gateway.errors.UpstreamError` with the status the gateway answers
(502 for an instance that failed or vanished mid-request, 503 when it refused the
connection, 504 on timeout; a 4xx is passed through) and a reason label
``<role>_<what>`` for metrics.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from pydantic import ValidationError
from pydantic_core import from_json, to_json

from flowprefill.contracts.deployment import KV_HTTP_PATH, PREFILL_API_PATH
from flowprefill.contracts.kv import DecodeKV, decode_kv
from flowprefill.contracts.prefill_api import KVHandoffEvent, PrefillRequest, PrefillResponse
from flowprefill.errors import KVHandoffError
from flowprefill.gateway import http1
from flowprefill.gateway.errors import UpstreamError

log = logging.getLogger(__name__)

_BACKGROUND: set[asyncio.Task[Any]] = set()
"""Hand-off reads and releases nobody may await (first token EOS, client gone): the event
loop keeps only weak references to tasks."""


def _in_background(task: asyncio.Task[Any]) -> None:
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)


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


def _encode_json(body: dict[str, Any] | bytes) -> bytes:
    """``body`` as sent: bytes as they are (a model's own JSON), a dict compact, UTF-8 and
    without NaN — what the servers' JSON parsers accept; a non-finite float raises
    :class:`ValueError` (as ``json.dumps(allow_nan=False)``).

    Encoded by pydantic-core (a decode body holds the whole prompt's ids: about 3x less
    CPU than ``json.dumps`` for a 4,000-token prompt). Its numbers may be written
    differently (``0.00001`` for ``1e-05``), the values are the same. A body whose JSON
    holds what could be a non-finite constant (or a string that contains its name) goes
    through ``json.dumps``, which raises for the former, as before."""
    if isinstance(body, bytes):
        return body
    data = to_json(body, inf_nan_mode="constants")
    if b"NaN" in data or b"Infinity" in data:
        return json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
    return data


async def _sse_data(
    chunks: AsyncIterator[bytes], received: Callable[[], bool] | None = None
) -> AsyncGenerator[str, None]:
    """The payloads of an SSE stream's ``data:`` lines, up to ``[DONE]``, from the body's
    chunks: lines split at ``\\n``, ``\\r\\n`` or ``\\r`` (as SSE allows), without a limit on
    their length. (One generator from bytes to payloads: every line passed up a generator
    of its own — blank lines included — cost more than parsing it.)

    After ``[DONE]`` the rest of the body (its chunked-encoding end) is read, so the
    connection goes back to the pool: a response left unfinished closes its connection,
    and the next request would pay for a new one. Bounded: an upstream that keeps the
    stream open after ``[DONE]`` only loses its connection. ``received``: True once the
    whole body has arrived (usually with ``[DONE]``): the rest is then read without the
    bound, which could never be reached (one timer less per stream)."""
    buf = b""
    async for data in chunks:
        buf += data
        if b"\r" in buf:
            if buf.endswith(b"\r"):  # maybe the first half of a \r\n
                continue
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        *complete, buf = buf.split(b"\n")
        for line in complete:
            if line.startswith(b"data:"):
                payload = line[5:].decode("utf-8", errors="replace").strip()
                if payload == "[DONE]":
                    await _drain(chunks, received is not None and received())
                    return
                yield payload
    for line in buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n"):
        if line.startswith(b"data:"):
            payload = line[5:].decode("utf-8", errors="replace").strip()
            if payload == "[DONE]":
                return
            yield payload


async def _drain(chunks: AsyncIterator[bytes], received: bool = False) -> None:
    """Read the rest of a body, for at most :data:`DRAIN_TIMEOUT_S`; ``received``: it has
    all arrived (nothing to wait for, so no timer)."""
    if received:
        async for _ in chunks:
            pass
        return
    try:
        async with asyncio.timeout(DRAIN_TIMEOUT_S):
            async for _ in chunks:
                pass
    except TimeoutError:
        pass


class UpstreamHTTP:
    """POST a JSON body and read a JSON answer or an SSE stream, DELETE; ``role`` (prefill
    or decode) names the instance in errors and their reason labels. The connection pool
    is made on first use, in the event loop that serves requests. No connection limit:
    every open stream holds its decode connection for its whole answer, so a cap would
    make request N+1 wait for a connection behind the streams of others, beyond
    admission's view; what bounds them is admission and the process's open-file limit.
    ``timeout_s``: the longest wait for data from an upstream while an answer is read."""

    def __init__(self, timeout_s: float = 600.0, connect_timeout_s: float = 5.0) -> None:
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._client: http1.Client | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def client(self) -> http1.Client:
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            self._client = http1.Client(
                connect_timeout_s=self.connect_timeout_s,
                read_timeout_s=self.timeout_s,
                keepalive_s=KEEPALIVE_S,
            )
            self._loop = loop
        return self._client

    def _translate(self, role: str, url: str, exc: BaseException) -> UpstreamError:
        if isinstance(exc, TimeoutError):
            return _timed_out(role, url)
        if isinstance(exc, http1.ConnectError):
            return _unreachable(role, url)
        return _failed(role, url, exc)

    async def post_json(
        self, role: str, url: str, body: dict[str, Any] | bytes, headers: dict[str, str]
    ) -> Any:
        """The decoded JSON answer."""
        try:
            async with self.client().request("POST", url, _encode_json(body), _json(headers)) as r:
                content = await r.read()
        except (OSError, http1.ConnectionLost) as e:  # TimeoutError is an OSError
            raise self._translate(role, url, e) from e
        if r.status >= 400:
            raise _status_error(role, r.status, content)
        return json.loads(content)

    async def sse(
        self, role: str, url: str, body: dict[str, Any] | bytes, headers: dict[str, str]
    ) -> AsyncGenerator[str, None]:
        """The ``data:`` payloads of the streamed answer, up to ``[DONE]``."""
        try:
            async with self.client().request("POST", url, _encode_json(body), _json(headers)) as r:
                if r.status >= 400:
                    raise _status_error(role, r.status, await r.read())
                async with aclosing(_sse_data(r.chunks(), lambda: r.received)) as payloads:
                    async for payload in payloads:
                        yield payload
        except (OSError, http1.ConnectionLost) as e:
            raise self._translate(role, url, e) from e

    async def delete(self, role: str, url: str) -> int:
        """DELETE ``url``; the status (a missing resource is the caller's business)."""
        try:
            async with self.client().request("DELETE", url, None, {}) as r:
                await r.read()
                return r.status
        except (OSError, http1.ConnectionLost) as e:
            raise self._translate(role, url, e) from e

    async def aclose(self) -> None:
        """Close the pooled connections."""
        if self._client is not None and self._loop is asyncio.get_running_loop():
            self._client.close()
        self._client = None


def _json(headers: dict[str, str]) -> dict[str, str]:
    return {**headers, "content-type": "application/json"}


@dataclass(frozen=True, slots=True)
class PrefillAnswer:
    """A prefill instance's answer: the first token at once, the KV hand-off once written."""

    response: PrefillResponse
    elapsed_s: float
    """The ``elapsed_s`` the request was sent with (gateway arrival → sent)."""
    prefill_url: str
    """The instance that answered (base URL): it serves ``DELETE /v1/kv/<id>``."""
    kv_pending: asyncio.Task[DecodeKV | None] | None = None
    """A streamed answer's rest: the hand-off once prefill has written it."""

    @property
    def first_token_id(self) -> int:
        return self.response.first_token_id

    @property
    def wait_s(self) -> float:
        """Time the request spent at the prefill instance (queue and prefill)."""
        return max(0.0, self.response.ttft_s - self.elapsed_s)

    async def hand_off(self) -> DecodeKV | None:
        """Where decode finds the prompt's KV cache; None: decode recomputes it."""
        if self.kv_pending is not None:
            return await self.kv_pending
        return _handoff(self.response.kv_transfer_params, self.response.request_id)


def _handoff(params: dict[str, Any] | None, request_id: str) -> DecodeKV | None:
    """The hand-off ``params`` name; None (decode recomputes) when they name none or
    cannot be used."""
    try:
        return decode_kv(params)
    except KVHandoffError as e:
        log.warning("unusable KV hand-off for %s (%s); decode will recompute", request_id, e)
        return None


def _response(data: Any) -> PrefillResponse:
    try:
        if isinstance(data, str):
            return PrefillResponse.model_validate_json(data)
        return PrefillResponse.model_validate(data)
    except ValidationError as e:
        raise UpstreamError(
            502, f"prefill instance sent a malformed answer ({e})", "prefill_failed"
        ) from e


async def _streamed_handoff(
    payloads: AsyncGenerator[str, None], request_id: str
) -> DecodeKV | None:
    """Read a streamed prefill answer to its end; the hand-off its event names, if any.

    Never raises (but for cancellation): a hand-off that does not arrive (prefill died
    after the first token, a malformed event) means decode recomputes the prompt, not a
    failed request."""
    ref: DecodeKV | None = None
    try:
        async with aclosing(payloads):
            async for payload in payloads:
                event = KVHandoffEvent.model_validate_json(payload)
                ref = _handoff(event.kv_transfer_params, request_id)
    except Exception as e:
        log.warning("KV hand-off of %s did not arrive (%r); decode will recompute", request_id, e)
    return ref


def _known_none(pending: asyncio.Task[DecodeKV | None] | None) -> bool:
    """A streamed hand-off already read, that named none."""
    if pending is None or not pending.done() or pending.cancelled():
        return False
    return pending.exception() is None and pending.result() is None


class PrefillClient:
    def __init__(self, http: UpstreamHTTP) -> None:
        self.http = http

    async def prefill(
        self, url: str, request: PrefillRequest, headers: dict[str, str]
    ) -> PrefillAnswer:
        """The first token as soon as the instance at ``url`` has it. A streamed request
        (``request.stream``) gets the hand-off later (:meth:`PrefillAnswer.hand_off`), so
        writing the KV cache is not on the time to first token."""
        endpoint = f"{url}{PREFILL_API_PATH}"
        # The model's own JSON, in one pass (the request's hot path: no dict in between).
        body = request.model_dump_json().encode()
        if not request.stream:
            data = await self.http.post_json("prefill", endpoint, body, headers)
            return PrefillAnswer(_response(data), request.elapsed_s, url)
        payloads = self.http.sse("prefill", endpoint, body, headers)
        try:
            first = await anext(payloads, None)
            if first is None:
                raise UpstreamError(
                    502, "prefill instance ended its answer early", "prefill_failed"
                )
            response = _response(first)
        except BaseException:
            await payloads.aclose()
            raise
        task = asyncio.create_task(_streamed_handoff(payloads, request.request_id))
        _in_background(task)
        return PrefillAnswer(response, request.elapsed_s, url, kv_pending=task)

    def release(self, answer: PrefillAnswer) -> None:
        """Decode will not load this answer's KV hand-off: delete it through the prefill
        instance that answered (it wrote the file), on the port the gateway calls anyway —
        not at ``source``, the KV listener (``http`` transport) only decode may reach —
        instead of leaving it to prefill's age sweep, so it does not fill the disk. In the
        background; a failure only leaves the file to the sweep."""
        if _known_none(answer.kv_pending):
            return  # prefill wrote nothing (decode recomputes): no task for nothing
        _in_background(asyncio.create_task(self._release(answer)))

    async def _release(self, answer: PrefillAnswer) -> None:
        ref = await answer.hand_off()
        if ref is None:
            return
        url = f"{answer.prefill_url}{KV_HTTP_PATH}{ref.handoff_id}"
        try:
            await self.http.delete("prefill", url)
        except UpstreamError as e:
            log.debug("release of KV hand-off %s failed (%s); left to the sweep", ref.handoff_id, e)


@dataclass(frozen=True, slots=True)
class DecodeDelta:
    """One chunk of decode's stream: its text and finish reason (empty and None for the
    usage-only chunk), and what its usage reports, when it has one."""

    text: str
    finish_reason: str | None = None
    completion_tokens: int | None = None
    """Decode's completion tokens so far (every chunk under ``continuous_usage``, else the
    last one only)."""
    cached_tokens: int | None = None
    """``usage.prompt_tokens_details.cached_tokens``, only when decode reports it (vLLM:
    ``--enable-prompt-tokens-details``, in the last usage)."""


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
        handoff: DecodeKV | None,
        headers: dict[str, str],
        request_id: str,
        continuous_usage: bool = False,
    ) -> AsyncGenerator[DecodeDelta, None]:
        """One delta per chunk of decode's stream. ``continuous_usage``: ask vLLM for the
        usage in every chunk (``continuous_usage_stats``), so each delta carries the
        completion tokens so far (a chunk may hold several tokens: ``stream_interval``)."""
        options: dict[str, bool] = {"include_usage": True}
        if continuous_usage:
            options["continuous_usage_stats"] = True
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt_token_ids,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": options,
            **sampling,
        }
        if handoff is not None:
            body["kv_transfer_params"] = handoff.to_params()
        headers = {**headers, "x-request-id": request_id}
        payloads = self.http.sse("decode", f"{url}/v1/completions", body, headers)
        async with aclosing(payloads):  # an early exit closes the upstream connection now
            async for payload in payloads:
                chunk = from_json(payload)  # several times faster than json.loads
                if "error" in chunk:
                    raise UpstreamError(502, str(chunk["error"]), "decode_stream_error")
                usage = chunk.get("usage") or {}
                completion = usage.get("completion_tokens")
                details = usage.get("prompt_tokens_details") or {}
                cached = details.get("cached_tokens")
                choices = chunk.get("choices") or []
                c = choices[0] if choices else {}
                if c or completion is not None:
                    # One delta for the text and its usage: the count is known when the
                    # text is relayed.
                    yield DecodeDelta(
                        c.get("text") or "",
                        c.get("finish_reason"),
                        None if completion is None else int(completion),
                        cached if isinstance(cached, int) else None,
                    )
