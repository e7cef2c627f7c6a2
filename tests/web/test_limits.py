"""Bounded memory and time for huge, endless and slow request bodies, over real sockets.

The server is uvicorn as ``serve-prefill`` and ``serve-gateway`` run it
(:func:`flowprefill.web.limits.uvicorn_options`, the app wrapped in ``BodySizeLimit``); the
clients are raw sockets, so that they can misbehave as no HTTP library lets them.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from fastapi import FastAPI, Request

from flowprefill.web.errors import BodySizeLimit, install_error_handlers
from flowprefill.web.limits import uvicorn_options
from tests.helpers import serve_in_thread

MAX_BODY = 64 * 1024
HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.0


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "coalesced"])
def server(request: pytest.FixtureRequest) -> Iterator[tuple[str, int, dict[str, int]]]:
    """An app that reads whole bodies (as every JSON endpoint does) and counts the bytes
    it was given; under uvicorn as serve-prefill runs it and as serve-gateway does
    (coalesced writes)."""
    app = FastAPI()
    install_error_handlers(app)
    seen = {"bytes": 0}

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, int]:
        body = await request.body()
        seen["bytes"] += len(body)
        return {"num_bytes": len(body)}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    options = uvicorn_options(header_timeout_s=HEADER_TIMEOUT_S, coalesce_writes=request.param)
    limited = BodySizeLimit(app, MAX_BODY, body_timeout_s=BODY_TIMEOUT_S)
    with serve_in_thread(limited, **options) as url:
        yield url, int(url.rsplit(":", 1)[1]), seen


def connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    return s


def read_response(s: socket.socket) -> bytes:
    """Everything the server sends until it closes (or 10 s pass)."""
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return out


def test_declared_oversized_body_is_refused_before_it_is_sent(
    server: tuple[str, int, dict[str, int]],
) -> None:
    _, port, _ = server
    with connect(port) as s:
        s.sendall(
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000000\r\n\r\n"
        )
        t0 = time.monotonic()
        answer = s.recv(65536)  # not one body byte sent
        assert time.monotonic() - t0 < 2
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"larger than 65536 bytes" in answer


def test_endless_chunked_body_is_cut_off(server: tuple[str, int, dict[str, int]]) -> None:
    """No Content-Length: the server counts as the chunks arrive and answers 413 once past
    the limit, having been given no more than the limit plus one read's worth."""
    _, port, seen = server
    before = seen["bytes"]
    chunk = b"%x\r\n%s\r\n" % (4096, b"x" * 4096)
    sent = 0
    with connect(port) as s:
        s.sendall(
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        s.settimeout(0.5)
        answer = b""
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                s.sendall(chunk)
                sent += 4096
            except OSError:  # the server closed: stop sending
                break
            try:
                s.setblocking(False)
                answer += s.recv(65536)
            except BlockingIOError:
                pass
            except OSError:
                break
            finally:
                s.setblocking(True)
                s.settimeout(0.5)
            if answer:
                break
        s.settimeout(5)
        answer += read_response(s)
    assert answer.startswith(b"HTTP/1.1 413"), (sent, answer[:200])
    assert sent < 64 * MAX_BODY, f"the client could send {sent} bytes"
    assert seen["bytes"] == before  # the app never got a body


def _slow_client(port: int, head: bytes, trickle: bytes, every_s: float) -> tuple[float, bytes]:
    """Send ``head`` at once, then ``trickle`` one byte every ``every_s``; how long until
    the server answers or closes, and what it said."""
    with connect(port) as s:
        s.sendall(head)
        t0 = time.monotonic()
        s.settimeout(every_s)
        for i in range(len(trickle)):
            try:
                got = s.recv(65536)
                return time.monotonic() - t0, got + read_response(s)
            except TimeoutError:
                pass
            except OSError:
                return time.monotonic() - t0, b""
            try:
                s.sendall(trickle[i : i + 1])
            except OSError:
                return time.monotonic() - t0, b""
        return time.monotonic() - t0, b"(never cut off)"


def test_slow_headers_are_cut_off(server: tuple[str, int, dict[str, int]]) -> None:
    """Slowloris: headers one byte at a time, never finished."""
    _, port, _ = server
    elapsed, answer = _slow_client(
        port, b"GET /health HTTP/1.1\r\nHost: x\r\n", b"X-A: b" * 50, 0.2
    )
    assert answer != b"(never cut off)"
    assert elapsed < HEADER_TIMEOUT_S + 2, elapsed


def test_slow_body_gets_408(server: tuple[str, int, dict[str, int]]) -> None:
    _, port, _ = server
    head = (
        b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100\r\n\r\n"
    )
    elapsed, answer = _slow_client(port, head, b"1" * 100, 0.2)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:300]
    assert b"request body" in answer
    assert elapsed < BODY_TIMEOUT_S + 2, elapsed


def test_slow_clients_do_not_block_others(server: tuple[str, int, dict[str, int]]) -> None:
    """Twenty slowloris connections open at once; a normal client is served meanwhile,
    and every slow one is gone within the bound."""
    url, port, _ = server
    results: list[tuple[float, bytes]] = []

    def slow(i: int) -> None:
        head = (
            b"GET /health HTTP/1.1\r\nHost: x\r\n"
            if i % 2
            else (b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
        )
        results.append(_slow_client(port, head, b"X" * 100, 0.1))

    threads = [threading.Thread(target=slow, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    with httpx.Client(base_url=url, timeout=5) as client:
        assert client.post("/echo", content=b"{}").json() == {"num_bytes": 2}
        assert client.get("/health").status_code == 200
    assert time.monotonic() - t0 < 1.0
    for t in threads:
        t.join(10)
    assert len(results) == 20
    assert all(answer != b"(never cut off)" for _, answer in results)
    assert max(elapsed for elapsed, _ in results) < max(HEADER_TIMEOUT_S, BODY_TIMEOUT_S) + 2


@pytest.mark.parametrize("module", ["flowprefill.prefill.server.cli", "flowprefill.gateway.cli"])
def test_the_servers_take_the_limits_as_flags(module: str) -> None:
    import argparse
    import importlib

    parser = argparse.ArgumentParser()
    importlib.import_module(module).add_arguments(parser)
    required = ["--config", "c", "--slo-table", "t"] if "gateway" in module else []
    args = parser.parse_args([*required, "--header-timeout", "3", "--body-timeout", "7"])
    assert (args.header_timeout, args.body_timeout) == (3.0, 7.0)
    assert parser.parse_args(required).header_timeout > 0
