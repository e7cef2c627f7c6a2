"""The gateway's SSE response (:class:`flowprefill.gateway.relay.EventStreamResponse`):
what it sends, and a client that leaves mid-stream stops the events at once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

import pytest

from flowprefill.gateway.relay import EventStreamResponse
from flowprefill.web.disconnect import DisconnectWatch
from flowprefill.web.sse import DONE, MEDIA_TYPE

SCOPE: dict[str, Any] = {"type": "http", "asgi": {"spec_version": "2.3"}}


async def run(
    events: AsyncIterator[str], disconnect: asyncio.Event | None = None
) -> list[MutableMapping[str, Any]]:
    sent: list[MutableMapping[str, Any]] = []
    never = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await (disconnect or never).wait()
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    response = EventStreamResponse(events, media_type=MEDIA_TYPE)
    await asyncio.wait_for(response(SCOPE, receive, send), timeout=5)
    return sent


def test_events_are_sent_as_they_come_and_done_ends_the_body() -> None:
    async def events() -> AsyncIterator[str]:
        yield "data: {}\n\n"
        yield "data: {}\n\n" + DONE

    sent = asyncio.run(run(events()))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in sent[0]["headers"]
    bodies = [(m["body"], m["more_body"]) for m in sent[1:]]
    # The last event goes out with the end of the body: no empty write after it.
    assert bodies == [(b"data: {}\n\n", True), ((b"data: {}\n\n" + DONE.encode()), False)]


def test_a_body_without_done_still_ends() -> None:
    async def events() -> AsyncIterator[str]:
        yield "data: {}\n\n"

    sent = asyncio.run(run(events()))
    assert [m["more_body"] for m in sent[1:]] == [True, False]


def test_a_client_gone_mid_stream_closes_the_events_at_once() -> None:
    closed: list[str] = []

    async def scenario() -> list[MutableMapping[str, Any]]:
        gone = asyncio.Event()

        async def events() -> AsyncIterator[str]:
            try:
                yield "data: {}\n\n"
                gone.set()  # the client leaves while the next token is awaited
                await asyncio.Event().wait()  # decode's next token: never
                yield "data: never\n\n"
            finally:
                closed.append("closed")

        return await run(events(), gone)

    sent = asyncio.run(scenario())
    assert closed == ["closed"]
    assert [m.get("body") for m in sent[1:]] == [b"data: {}\n\n"]


def test_a_server_cancellation_is_not_swallowed() -> None:
    async def scenario() -> None:
        async def events() -> AsyncIterator[str]:
            yield "data: {}\n\n"
            await asyncio.Event().wait()
            yield DONE

        task = asyncio.ensure_future(run(events()))
        await asyncio.sleep(0.05)
        task.cancel()
        await task

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(scenario())


def test_a_client_gone_before_the_stream_gets_nothing_and_its_events_are_closed() -> None:
    """The request's watch (made while it waited for its first token) saw the client
    leave: the response sends nothing and closes the events (so decode never starts)."""
    closed: list[str] = []

    async def scenario() -> list[MutableMapping[str, Any]]:
        async def receive() -> dict[str, Any]:
            return {"type": "http.disconnect"}

        watch = DisconnectWatch(receive)
        watch.follow(asyncio.current_task())
        with pytest.raises(asyncio.CancelledError):
            await asyncio.sleep(1)  # the watcher cancels the waiting task...
        task = asyncio.current_task()
        assert task is not None and task.uncancel() == 0
        watch.follow(None)  # ...and follows nobody until the response takes over

        async def events() -> AsyncIterator[str]:
            try:
                yield "data: {}\n\n"
            finally:
                closed.append("closed")

        sent: list[MutableMapping[str, Any]] = []

        async def send(message: MutableMapping[str, Any]) -> None:
            sent.append(message)

        response = EventStreamResponse(events(), media_type=MEDIA_TYPE)
        response.watch = watch
        await response(SCOPE, receive, send)
        return sent

    assert asyncio.run(scenario()) == []
    assert closed == []  # closed before it started: no event was made


def test_a_stream_follows_on_with_the_request_s_watch() -> None:
    """One watcher for the request: the stream's sender is cancelled by the watch that
    followed the wait for the first token."""
    closed: list[str] = []

    async def scenario() -> list[MutableMapping[str, Any]]:
        gone = asyncio.Event()
        reads = 0

        async def receive() -> dict[str, Any]:
            nonlocal reads
            reads += 1
            await gone.wait()
            return {"type": "http.disconnect"}

        watch = DisconnectWatch(receive)
        watch.follow(asyncio.current_task())
        await asyncio.sleep(0.01)  # the wait for the first token
        watch.follow(None)

        async def events() -> AsyncIterator[str]:
            try:
                yield "data: {}\n\n"
                gone.set()
                await asyncio.Event().wait()
                yield "data: never\n\n"
            finally:
                closed.append("closed")

        sent: list[MutableMapping[str, Any]] = []

        async def send(message: MutableMapping[str, Any]) -> None:
            sent.append(message)

        response = EventStreamResponse(events(), media_type=MEDIA_TYPE)
        response.watch = watch
        await asyncio.wait_for(response(SCOPE, receive, send), 5)
        assert reads == 1  # one watcher, one pending read
        return sent

    sent = asyncio.run(scenario())
    assert closed == ["closed"]
    assert [m.get("body") for m in sent[1:]] == [b"data: {}\n\n"]
