"""The upstream SSE reader (``_sse_data``): payloads of ``data:`` lines from body chunks
split anywhere, lines ended by ``\\n``, ``\\r\\n`` or ``\\r``, up to ``[DONE]`` — after which
the rest of the body is read (so the connection can be reused)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from flowprefill.gateway.upstream import _sse_data

BODY = (
    b'data: {"a": 1}\r\n\r\ndata:{"b":"\xc3\xa9"}\n\n'
    b": comment\revent: x\rdata: 3\r\rdata: [DONE]\n\n"
)


async def _payloads(chunks: list[bytes]) -> tuple[list[str], int]:
    read = 0

    async def source() -> AsyncIterator[bytes]:
        nonlocal read
        for chunk in chunks:
            read += 1
            yield chunk

    return [p async for p in _sse_data(source())], read


@pytest.mark.parametrize("size", [1, 2, 3, 7, len(BODY)])
async def test_payloads_whatever_the_chunking(size: int) -> None:
    chunks = [BODY[i : i + size] for i in range(0, len(BODY), size)] + [b"0\r\n"]
    payloads, read = await _payloads(chunks)
    assert payloads == ['{"a": 1}', '{"b":"é"}', "3"]
    assert read == len(chunks)  # drained to the end after [DONE]


async def test_a_last_line_without_its_newline_still_counts() -> None:
    assert (await _payloads([b"data: 1\n\ndata: 2"]))[0] == ["1", "2"]
    assert (await _payloads([b"data: 1\n\ndata: [DONE]"]))[0] == ["1"]


@pytest.mark.parametrize("received", [None, False, True])
async def test_the_drain_needs_no_timer_once_the_body_has_arrived(
    received: bool | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After ``[DONE]`` the rest is read all the same; the bound on the wait for it (a timer)
    is set only when the body may still be coming."""
    from flowprefill.gateway import upstream

    timers = 0
    real = upstream.asyncio.timeout

    def counted(delay: float | None) -> asyncio.Timeout:
        nonlocal timers
        timers += 1
        return real(delay)

    monkeypatch.setattr(upstream.asyncio, "timeout", counted)
    read = 0
    chunks = [b"data: 1\n\ndata: [DONE]\n\n", b"0\r\n", b"\r\n"]

    async def source() -> AsyncIterator[bytes]:
        nonlocal read
        for chunk in chunks:
            read += 1
            yield chunk

    flag = None if received is None else (lambda: received)
    assert [p async for p in _sse_data(source(), flag)] == ["1"]
    assert read == len(chunks)  # drained to the end either way
    assert timers == (0 if received else 1)
