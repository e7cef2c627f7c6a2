"""Coalesced writes (:mod:`flowprefill.web.coalesce`): what one loop iteration writes goes
out as one write, in order, before a close; and uvicorn with ``coalesce_writes`` answers
streams and keep-alive requests byte for byte as without it."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route

from flowprefill.web.coalesce import CoalescingTransport
from flowprefill.web.limits import uvicorn_options
from tests.helpers import serve_in_thread


class FakeTransport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False
        self.aborted = False

    def write(self, data: bytes) -> None:
        assert not self.closed
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = self.closed = True

    def get_extra_info(self, name: str) -> Any:
        return f"info:{name}"


def _wrap(fake: FakeTransport) -> CoalescingTransport:
    return CoalescingTransport(fake, asyncio.get_running_loop())  # type: ignore[arg-type]


async def test_one_iteration_s_writes_leave_as_one_in_order() -> None:
    fake = FakeTransport()
    t = _wrap(fake)
    t.write(b"a")
    t.writelines([b"b", bytearray(b"c")])
    assert fake.writes == []
    await asyncio.sleep(0)
    assert fake.writes == [b"abc"]
    t.write(b"d")
    await asyncio.sleep(0)
    assert fake.writes == [b"abc", b"d"]
    assert t.get_extra_info("peername") == "info:peername"  # the rest is the transport's


async def test_close_sends_what_is_held_first_and_abort_drops_it() -> None:
    fake = FakeTransport()
    t = _wrap(fake)
    t.write(b"last words")
    t.close()
    assert fake.writes == [b"last words"] and fake.closed
    await asyncio.sleep(0)  # the scheduled flush finds nothing to send
    assert fake.writes == [b"last words"]
    fake = FakeTransport()
    t = _wrap(fake)
    t.write(b"dropped")
    t.abort()
    await asyncio.sleep(0)
    assert fake.writes == [] and fake.aborted


async def test_nothing_is_written_to_a_closing_transport() -> None:
    fake = FakeTransport()
    t = _wrap(fake)
    t.write(b"x")
    fake.closed = True  # the peer went away meanwhile
    await asyncio.sleep(0)
    assert fake.writes == []


async def _events(request: Request) -> StreamingResponse:
    async def gen() -> AsyncIterator[str]:
        yield "data: 1\n\n"
        yield "data: 2\n\n"
        await asyncio.sleep(0.01)
        yield "data: [DONE]\n\n"

    return StreamingResponse(gen(), media_type="text/event-stream")


async def _plain(request: Request) -> PlainTextResponse:
    return PlainTextResponse("hello")


APP = Starlette(routes=[Route("/events", _events), Route("/plain", _plain)])


def _exchange(url: str, requests: list[bytes]) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        got = b""
        for request in requests:
            s.sendall(request)
            while not (got.endswith(b"0\r\n\r\n") or got.endswith(b"hello")):
                data = s.recv(65536)
                assert data, "connection closed early"
                got += data
            got += b"|"
    return got


def _without_date(raw: bytes) -> bytes:
    return b"\r\n".join(line for line in raw.split(b"\r\n") if not line.startswith(b"date:"))


@pytest.mark.parametrize("path", ["/events", "/plain"])
def test_uvicorn_answers_byte_for_byte_as_without_coalescing(path: str) -> None:
    request = f"GET {path} HTTP/1.1\r\nhost: x\r\n\r\n".encode()
    answers = []
    for coalesce in (False, True):
        with serve_in_thread(APP, **uvicorn_options(5.0, coalesce_writes=coalesce)) as url:
            answers.append(_without_date(_exchange(url, [request, request])))  # keep-alive
    assert answers[0] == answers[1]
    assert answers[1].count(b"HTTP/1.1 200 OK") == 2
