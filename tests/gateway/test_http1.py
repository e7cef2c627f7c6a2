"""The gateway's HTTP/1.1 client (:mod:`flowprefill.gateway.http1`) against raw asyncio
servers: what goes on the wire, which connections are reused and which are closed, bodies
ended by the connection, flow control and the timeouts. (Answers, statuses and errors
through :class:`~flowprefill.gateway.upstream.UpstreamHTTP` are tested against real HTTP
stubs in test_upstream.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from flowprefill.gateway import http1

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Server:
    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed = asyncio.Event()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer)
        finally:
            writer.close()
            self.closed.set()

    async def read_request(self, reader: asyncio.StreamReader) -> bytes | None:
        head = await reader.readuntil(b"\r\n\r\n") if not reader.at_eof() else b""
        if not head:
            return None
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        request = head + await reader.readexactly(length)
        self.requests.append(request)
        return request


Start = Callable[[Handler], Awaitable[tuple["Server", str]]]


@pytest.fixture
async def serve() -> AsyncIterator[Start]:
    servers: list[asyncio.Server] = []

    async def start(handler: Handler) -> tuple[Server, str]:
        s = Server(handler)
        server = await asyncio.start_server(s._serve, "127.0.0.1", 0)
        servers.append(server)
        return s, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"

    yield start
    for server in servers:
        server.close()


def client(**kw: float | None) -> http1.Client:
    args: dict[str, float | None] = {
        "connect_timeout_s": 2.0,
        "read_timeout_s": 5.0,
        "keepalive_s": 4.0,
    }
    args.update(kw)
    return http1.Client(**args)  # type: ignore[arg-type]


OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


async def test_requests_are_one_write_and_keep_alive_connections_are_reused(serve: Start) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await server.read_request(reader):
            writer.write(OK)

    server, url = await serve(handler)
    c = client()
    for _ in range(3):
        async with c.request("POST", f"{url}/v1/x?a=1", b'{"k":1}', {"x-id": "r1"}) as r:
            assert (r.status, await r.read()) == (200, b"ok")
    async with c.request("DELETE", f"{url}/v1/kv/7", None, {}) as r:
        assert r.status == 200 and await r.read() == b"ok"
    assert server.connections == 1
    host = url.removeprefix("http://").encode()
    assert server.requests[0] == (
        b"POST /v1/x?a=1 HTTP/1.1\r\nhost: " + host + b"\r\ncontent-length: 7\r\n"
        b"x-id: r1\r\n\r\n"
        b'{"k":1}'
    )
    assert server.requests[-1] == b"DELETE /v1/kv/7 HTTP/1.1\r\nhost: " + host + b"\r\n\r\n"
    c.close()


async def test_a_response_not_read_to_its_end_closes_its_connection(serve: Start) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nab\r\n")
        await reader.read()  # until the client closes

    server, url = await serve(handler)
    c = client()
    async with c.request("POST", url, b"", {}) as r:
        async for chunk in r.chunks():
            assert chunk == b"ab"
            break
    await asyncio.wait_for(server.closed.wait(), 2)  # the upstream sees the client leave
    c.close()


async def test_connection_close_and_a_body_ended_by_the_connection(serve: Start) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nuntil the end")

    server, url = await serve(handler)
    c = client()
    for _ in range(2):
        async with c.request("POST", url, b"", {}) as r:
            assert await r.read() == b"until the end"
    assert server.connections == 2  # not reused: the server said close
    c.close()


async def test_a_connection_the_server_closed_while_idle_is_not_reused(serve: Start) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(OK)  # keep-alive, then closed at once

    server, url = await serve(handler)
    c = client()
    for _ in range(2):
        async with c.request("POST", url, b"", {}) as r:
            assert await r.read() == b"ok"
        await asyncio.sleep(0.1)
    assert server.connections == 2
    c.close()


async def test_idle_connections_are_closed_after_the_keepalive(serve: Start) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await server.read_request(reader):
            writer.write(OK)

    server, url = await serve(handler)
    c = client(keepalive_s=0.2)
    async with c.request("POST", url, b"", {}) as r:
        await r.read()
    await asyncio.wait_for(server.closed.wait(), 2)
    async with c.request("POST", url, b"", {}) as r:
        assert await r.read() == b"ok"
    assert server.connections == 2
    c.close()


async def test_a_large_body_pauses_reading_and_arrives_whole(serve: Start) -> None:
    size = 8 * http1.HIGH_WATER

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
        writer.write(b"x" * size)
        await writer.drain()
        await reader.read()

    server, url = await serve(handler)
    c = client()
    got = 0
    async with c.request("POST", url, b"", {}) as r:
        async for chunk in r.chunks():
            got += len(chunk)
            await asyncio.sleep(0)  # a slow reader
    assert got == size
    c.close()


async def test_errors(serve: Start) -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        await reader.read()  # never answers; returns once the client closes

    server, url = await serve(silent)
    c = client(read_timeout_s=0.2)
    with pytest.raises(TimeoutError):
        async with c.request("POST", url, b"", {}) as r:
            await r.read()
    await asyncio.wait_for(server.closed.wait(), 2)  # given up: the connection is closed

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")

    _, url = await serve(garbage)
    with pytest.raises(http1.ConnectionLost):
        async with c.request("POST", url, b"", {}) as r:
            await r.read()

    async def dies(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")

    _, url = await serve(dies)
    with pytest.raises(http1.ConnectionLost):
        async with c.request("POST", url, b"", {}) as r:
            await r.read()

    with pytest.raises(http1.ConnectError):
        async with c.request("POST", "http://127.0.0.1:9/", b"", {}):
            pass
    with pytest.raises(ValueError, match="invalid header"):
        c.request("POST", url, b"", {"x-a": "1\r\nx-injected: 2"})
    c.close()


async def test_received_says_when_the_whole_body_has_arrived(serve: Start) -> None:
    go = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nab\r\n")
        await go.wait()
        writer.write(b"2\r\ncd\r\n0\r\n\r\n")
        await reader.read()

    server, url = await serve(handler)
    c = client()
    async with c.request("POST", url, b"", {}) as r:
        chunks = r.chunks()
        assert await anext(chunks) == b"ab"
        assert not r.received  # the rest is still to come
        go.set()
        assert await anext(chunks) == b"cd"
        assert r.received  # the end came with it: what is left never waits
        assert [chunk async for chunk in chunks] == []
    c.close()
