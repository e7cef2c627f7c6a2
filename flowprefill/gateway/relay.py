"""Stage 4 of the pipeline: relay the first token and decode's pieces to the client, as
one OpenAI body or as an OpenAI SSE stream; the OpenAI wire format of the gateway's
answers, in one place.

Completions answer ``text_completion`` objects, chat completions ``chat.completion``
(streamed: ``chat.completion.chunk``); one choice (n=1). A stream is SSE: the first chunk
(chat: with ``role: assistant``), one chunk per decoded piece, under
``stream_options.include_usage`` a last chunk with no choices and the usage, then
``[DONE]``. Error bodies are :func:`flowprefill.web.errors.error_body`.

Usage (:func:`usage`): prompt, completion and total tokens, plus
``prompt_tokens_details.cached_tokens`` only where decode reported it for the client
(:mod:`flowprefill.gateway.decode`). Under vLLM's ``continuous_usage_stats`` (with
``include_usage``, as vLLM requires) every chunk carries the usage so far, as vLLM's
serving code builds it: prompt, completion and total tokens only (vLLM adds the details
to the last usage only). The first chunk counts the first token (vLLM's chat sends a
role chunk with no text and 0 first; the gateway's first chunk already holds the first
token), each later one what decode reported for its chunk; the last usage equals the
non-streamed answer's.

A failure after the first token: a collected answer raises it (the client gets its
status); a stream, whose 200 is already sent, counts it (``flowprefill_gateway_errors``)
and ends with an error event and ``[DONE]`` (no usage, as vLLM).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from pydantic_core import to_json
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from flowprefill.gateway.classify import Job
from flowprefill.gateway.decode import Piece
from flowprefill.gateway.errors import GatewayError
from flowprefill.gateway.metrics import GatewayMetrics
from flowprefill.web.disconnect import DisconnectWatch
from flowprefill.web.errors import error_body
from flowprefill.web.sse import DONE


def sse_event(payload: dict[str, Any]) -> str:
    """One SSE event, framed as :func:`flowprefill.web.sse.sse_event` frames it but encoded
    by pydantic-core (compact, UTF-8): several times less CPU than ``json.dumps``, and a
    stream writes one per token."""
    return f"data: {to_json(payload).decode()}\n\n"


def usage_so_far(job: Job) -> dict[str, int]:
    """The counts as they stand: a chunk's usage under ``continuous_usage_stats``."""
    prompt = len(job.token_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": job.num_completion_tokens,
        "total_tokens": prompt + job.num_completion_tokens,
    }


def usage(job: Job) -> dict[str, Any]:
    """A finished answer's usage (the body's, or the last chunk's)."""
    counts: dict[str, Any] = usage_so_far(job)
    if job.cached_tokens is not None:
        counts["prompt_tokens_details"] = {"cached_tokens": job.cached_tokens}
    return counts


def _envelope(job: Job, model: str, obj: str) -> dict[str, Any]:
    return {"id": job.request_id, "object": obj, "created": job.created, "model": model}


def _chunk_object(job: Job) -> str:
    return "chat.completion.chunk" if job.kind == "chat.completion" else job.kind


def completion_body(job: Job, model: str, text: str, finish_reason: str) -> dict[str, Any]:
    """A whole (non-streamed) answer."""
    choice: dict[str, Any]
    if job.kind == "chat.completion":
        choice = {
            "index": 0,
            "finish_reason": finish_reason,
            "message": {"role": "assistant", "content": text},
        }
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
    return {**_envelope(job, model, job.kind), "choices": [choice], "usage": usage(job)}


def _chunk_choice(chat: bool, text: str, finish_reason: str | None, first: bool) -> dict[str, Any]:
    """A streamed piece's one choice: a chat delta (the role on the first) or a text."""
    if chat:
        delta: dict[str, Any] = {"content": text}
        if first:
            delta["role"] = "assistant"
        return {"index": 0, "delta": delta, "finish_reason": finish_reason}
    return {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}


def chunk_event(
    job: Job,
    model: str,
    text: str,
    finish_reason: str | None,
    *,
    first: bool = False,
    with_usage: bool = False,
) -> str:
    """One streamed piece as an SSE event; ``with_usage``: with the usage so far."""
    choice = _chunk_choice(job.kind == "chat.completion", text, finish_reason, first)
    payload = {**_envelope(job, model, _chunk_object(job)), "choices": [choice]}
    if with_usage:
        payload["usage"] = usage_so_far(job)
    return sse_event(payload)


class StreamEvents:
    """One stream's events, character for character as :func:`chunk_event` and
    :func:`usage_event` write them, with what every event of the stream repeats (id,
    object, created, model) encoded once: the events' JSON is compact, in the dicts'
    order, so the envelope's text is a prefix of every event's."""

    def __init__(self, job: Job, model: str) -> None:
        self.job = job
        self.chat = job.kind == "chat.completion"
        envelope = to_json(_envelope(job, model, _chunk_object(job))).decode()
        self.head = f'data: {envelope[:-1]},"choices":['

    def chunk(
        self, text: str, finish_reason: str | None, *, first: bool = False, with_usage: bool
    ) -> str:
        """:func:`chunk_event`'s event."""
        choice = _chunk_choice(self.chat, text, finish_reason, first)
        if with_usage:
            counts = to_json(usage_so_far(self.job)).decode()
            return f'{self.head}{to_json(choice).decode()}],"usage":{counts}}}\n\n'
        return f"{self.head}{to_json(choice).decode()}]}}\n\n"

    def usage(self) -> str:
        """:func:`usage_event`'s event."""
        return f'{self.head}],"usage":{to_json(usage(self.job)).decode()}}}\n\n'


def usage_event(job: Job, model: str) -> str:
    """OpenAI's last chunk under ``stream_options.include_usage``: no choices, the usage."""
    payload = {**_envelope(job, model, _chunk_object(job)), "choices": [], "usage": usage(job)}
    return sse_event(payload)


def error_event(err: GatewayError) -> str:
    """A stream's end after a failure past its first byte (the status is already sent)."""
    return sse_event(error_body(str(err), "upstream_error", code=err.reason))


_DONE = DONE.encode()


class EventStreamResponse(StreamingResponse):
    """An SSE answer: Starlette's :class:`StreamingResponse` (same headers, same events)
    sent with less work per request and per event.

    A client that disconnects still stops the stream at once — the events' generator is
    cancelled wherever it waits (decode's upstream read: its connection closes) — but the
    disconnect is watched by one plain asyncio task that cancels the sending one, where
    Starlette (under uvicorn's ASGI 2.3) runs an anyio task group of two per response; and
    the event that ends with ``[DONE]`` is sent with the body's end, one write less."""

    watch: DisconnectWatch | None = None
    """The request's disconnect watch, when it has one already (it is closed at the end);
    None: one of the response's own."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        watch = self.watch if self.watch is not None else DisconnectWatch(receive)
        if watch.gone:  # left before the answer started: nothing to send
            watch.close()
            await self._close_body()
            return
        watch.follow(task)
        try:
            try:
                await self._send_all(send)
            finally:
                watch.close()
                await self._close_body()
        except asyncio.CancelledError:
            # Ours (the client left), not the server's: the answer is over, nothing to send.
            if watch.gone and task.uncancel() == 0:
                return
            raise
        if self.background is not None:
            await self.background()

    async def _close_body(self) -> None:
        """Close the events' generator (and so decode) when it did not end by itself."""
        aclose = getattr(self.body_iterator, "aclose", None)
        if aclose is not None:
            await aclose()

    async def _send_all(self, send: Send) -> None:
        start = {"type": "http.response.start", "status": self.status_code}
        await send({**start, "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            data = chunk.encode(self.charset) if isinstance(chunk, str) else bytes(chunk)
            ended = data.endswith(_DONE)
            await send({"type": "http.response.body", "body": data, "more_body": not ended})
            if ended:
                return
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def models_body(model: str) -> dict[str, Any]:
    """``GET /v1/models``."""
    return {
        "object": "list",
        "data": [{"id": model, "object": "model", "created": 0, "owned_by": "flowprefill"}],
    }


class Relay:
    def __init__(
        self, model_name: str, metrics: GatewayMetrics, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.model = model_name
        self.metrics = metrics
        self.clock = clock

    async def stream(
        self, job: Job, first_text: str, pieces: AsyncGenerator[Piece, None]
    ) -> AsyncIterator[str]:
        """SSE events; a client gone mid-stream closes ``pieces`` (and decode) at once."""
        first_s = self.clock()
        every = job.body.usage_in_chunks
        events = StreamEvents(job, self.model)
        yield events.chunk(first_text, None, first=True, with_usage=every)
        try:
            async with aclosing(pieces):
                async for piece in pieces:
                    # The decode stage has counted the piece's tokens before it comes.
                    yield events.chunk(piece.text, piece.finish_reason, with_usage=every)
        except GatewayError as e:
            self.metrics.failed(e)
            yield error_event(e)
        else:  # as vLLM does: no usage after an error event
            self._decoded(job, first_s)
            if job.body.usage_at_end:
                # With [DONE], as one write: nothing comes between them.
                yield events.usage() + DONE
                return
        yield DONE

    async def collect(
        self, job: Job, first_text: str, pieces: AsyncGenerator[Piece, None]
    ) -> dict[str, Any]:
        """The whole answer's body; raises :class:`GatewayError`."""
        first_s = self.clock()
        texts = [first_text]
        finish = "length"
        async with aclosing(pieces):
            async for piece in pieces:
                texts.append(piece.text)
                finish = piece.finish_reason or finish
        self._decoded(job, first_s)
        return completion_body(job, self.model, "".join(texts), finish)

    def _decoded(self, job: Job, first_s: float) -> None:
        """TPOT of a finished request: the first token was handed over at ``first_s``."""
        self.metrics.decoded(
            job.slo.name, decode_s=self.clock() - first_s, num_tokens=job.num_completion_tokens
        )
