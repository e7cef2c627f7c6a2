"""The gateway's upstream HTTP client against stub upstreams: answers, error statuses and
reasons, connections kept alive across requests (a decode stream is read to its end), and
a request given up on (client gone) closes its upstream connection so the upstream can
cancel.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from flowprefill.contracts.kv import HandoffRef
from flowprefill.contracts.prefill_api import PrefillRequest
from flowprefill.gateway.errors import UpstreamError
from flowprefill.gateway.upstream import DecodeClient, PrefillClient, UpstreamHTTP
from tests.helpers import free_port, serve_in_thread


class Seen:
    def __init__(self) -> None:
        self.client_ports: list[int] = []
        self.disconnected = threading.Event()
        self.stream_abandoned = threading.Event()


def stub(seen: Seen) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/prefill")
    async def prefill(request: Request) -> Any:
        assert request.client is not None
        seen.client_ports.append(request.client.port)
        body = await request.json()
        fail = request.headers.get("x-fail")
        if fail == "400":
            return JSONResponse({"error": {"message": "prompt too long"}}, status_code=400)
        if fail == "500":
            return JSONResponse({"detail": "boom"}, status_code=500)
        if fail == "slow":
            for _ in range(200):
                if await request.is_disconnected():
                    seen.disconnected.set()
                    break
                await asyncio.sleep(0.05)
        n = len(body["prompt_token_ids"])
        answer = {
            "request_id": body["request_id"],
            "first_token_id": n,
            "num_prompt_tokens": n,
            "ttft_s": body["elapsed_s"] + 0.0015,
            "met_slo": True,
            "num_preemptions": 0,
            "batch_size": 1,
        }
        kv = {"kv_transfer_params": HandoffRef(f"{body['slo_class']}-{n}", n).to_params()}
        if not body.get("stream"):
            return {**answer, **kv}

        async def events() -> AsyncIterator[str]:
            yield f"data: {json.dumps(answer)}\n\n"
            if fail == "kv-slow":
                await asyncio.sleep(1.0)
            if fail == "kv-dies":
                raise RuntimeError("prefill died after the first token")
            if fail == "kv-garbage":
                yield "data: {not json\n\n"
            yield f"data: {json.dumps(kv)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        assert request.client is not None
        seen.client_ports.append(request.client.port)
        body = await request.json()
        fail = request.headers.get("x-fail")
        if fail == "400":
            return JSONResponse({"error": {"message": "bad sampling"}}, status_code=400)

        async def gen() -> AsyncIterator[str]:
            done = False
            try:
                async for part in parts():
                    yield part
                done = True
            finally:
                if not done:
                    seen.stream_abandoned.set()

        async def parts() -> AsyncIterator[str]:
            for i in range(body["max_tokens"]):
                if fail == "die" and i == 1:
                    raise RuntimeError("decode instance died")
                if fail == "error" and i == 1:
                    yield f"data: {json.dumps({'error': {'message': 'oom'}})}\n\n"
                if fail == "slow":
                    await asyncio.sleep(0.05)
                finish = "length" if i == body["max_tokens"] - 1 else None
                chunk = {"choices": [{"index": 0, "text": f" é{i}", "finish_reason": finish}]}
                yield (
                    f"data: {json.dumps(chunk)}\r\n\r\n"
                    if i % 2
                    else f"data: {json.dumps(chunk)}\n\n"
                )
            usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}
            yield f"data: {json.dumps(usage)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[str, Seen]]:
    seen = Seen()
    with serve_in_thread(stub(seen)) as url:
        yield url, seen


@pytest.fixture
async def http() -> AsyncIterator[UpstreamHTTP]:
    h = UpstreamHTTP(timeout_s=5.0)
    yield h
    await h.aclose()


def request(rid: str = "r1", token_ids: tuple[int, ...] = (1, 2, 3), stream: bool = True) -> Any:
    return PrefillRequest(
        request_id=rid,
        prompt_token_ids=list(token_ids),
        ttft_slo_s=0.5,
        elapsed_s=0.2,
        slo_class="chat",
        hand_off_kv=stream,
        stream=stream,
    )


HANDOFF = HandoffRef("chat-3", 3)


async def prefill(http: UpstreamHTTP, url: str, fail: str | None = None) -> Any:
    return await PrefillClient(http).prefill(url, request(), {"x-fail": fail} if fail else {})


async def decode(http: UpstreamHTTP, url: str, fail: str | None = None, n: int = 4) -> list:
    client = DecodeClient(http, model="m")
    return [
        d
        async for d in client.stream(
            url,
            prompt_token_ids=[1, 2],
            max_tokens=n,
            sampling={},
            handoff=None,
            headers={"x-fail": fail} if fail else {},
            request_id="r1",
        )
    ]


async def test_answers_parsed_and_connections_kept_alive(
    http: UpstreamHTTP, upstream: tuple[str, Seen]
) -> None:
    url, seen = upstream
    seen.client_ports.clear()
    for _ in range(3):
        a = await prefill(http, url)
        assert (a.first_token_id, await a.hand_off()) == (3, HANDOFF)
        assert a.wait_s == pytest.approx(0.0015)  # ttft_s from gateway arrival - elapsed_s
        deltas = await decode(http, url)
        assert "".join(d.text for d in deltas) == " é0 é1 é2 é3"
        assert [d.finish_reason for d in deltas if d.finish_reason] == ["length"]
        assert deltas[-1].completion_tokens == 4
    assert len(seen.client_ports) == 6
    assert len(set(seen.client_ports)) == 1, "a new upstream connection per request"


async def test_first_token_comes_before_the_kv_hand_off(
    http: UpstreamHTTP, upstream: tuple[str, Seen]
) -> None:
    url, _ = upstream
    t0 = time.monotonic()
    a = await prefill(http, url, "kv-slow")  # the hand-off event comes 1 s after the token
    assert a.first_token_id == 3
    assert time.monotonic() - t0 < 0.8
    assert await a.hand_off() == HANDOFF
    assert time.monotonic() - t0 >= 1.0


@pytest.mark.parametrize("fail", ["kv-dies", "kv-garbage"])
async def test_a_hand_off_that_never_arrives_means_recompute_not_failure(
    http: UpstreamHTTP, upstream: tuple[str, Seen], fail: str
) -> None:
    url, _ = upstream
    a = await prefill(http, url, fail)
    assert a.first_token_id == 3
    assert await a.hand_off() is None


async def test_without_a_hand_off_the_answer_is_one_json_body(
    http: UpstreamHTTP, upstream: tuple[str, Seen]
) -> None:
    url, _ = upstream
    a = await PrefillClient(http).prefill(url, request("r2", (1, 2), stream=False), {})
    assert (a.first_token_id, a.kv_pending) == (2, None)
    assert await a.hand_off() == HandoffRef("chat-2", 2)


async def test_upstream_errors_become_gateway_statuses(
    http: UpstreamHTTP, upstream: tuple[str, Seen]
) -> None:
    url, _ = upstream
    with pytest.raises(UpstreamError) as e:
        await prefill(http, url, "400")
    assert (e.value.status, e.value.reason, str(e.value)) == (400, "prefill_400", "prompt too long")
    with pytest.raises(UpstreamError) as e:
        await prefill(http, url, "500")
    assert (e.value.status, e.value.reason, e.value.retryable) == (502, "prefill_500", False)
    assert "boom" in str(e.value)
    with pytest.raises(UpstreamError) as e:
        await decode(http, url, "400")
    assert (e.value.status, e.value.reason, str(e.value)) == (400, "decode_400", "bad sampling")
    with pytest.raises(UpstreamError) as e:
        await decode(http, url, "error")
    assert (e.value.status, e.value.reason) == (502, "decode_stream_error")
    with pytest.raises(UpstreamError) as e:
        await decode(http, url, "die")
    assert (e.value.status, e.value.reason) == (502, "decode_failed")
    assert "failed mid-request" in str(e.value)
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(UpstreamError) as e:
        await prefill(http, dead)
    assert (e.value.status, e.value.reason, e.value.retryable) == (503, "prefill_unreachable", True)
    with pytest.raises(UpstreamError) as e:
        await decode(http, dead)
    assert (e.value.status, e.value.reason, e.value.retryable) == (503, "decode_unreachable", True)
    # After all that, the clients still work.
    assert (await prefill(http, url)).first_token_id == 3


async def test_slow_upstream_times_out(upstream: tuple[str, Seen]) -> None:
    url, _ = upstream
    http = UpstreamHTTP(timeout_s=0.2)
    try:
        with pytest.raises(UpstreamError) as e:
            await prefill(http, url, "slow")
        assert (e.value.status, e.value.reason) == (504, "prefill_timeout")
    finally:
        await http.aclose()


async def test_cancelled_request_closes_its_upstream_connection(
    http: UpstreamHTTP, upstream: tuple[str, Seen]
) -> None:
    url, seen = upstream
    seen.disconnected.clear()
    task = asyncio.ensure_future(prefill(http, url, "slow"))
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    deadline = time.monotonic() + 5
    while not seen.disconnected.is_set():
        assert time.monotonic() < deadline, "the upstream never saw the client leave"
        await asyncio.sleep(0.05)
    # A decode stream abandoned part-way closes its connection too (vLLM then aborts).
    stream = DecodeClient(http, model="m").stream(
        url,
        prompt_token_ids=[1],
        max_tokens=50,
        sampling={},
        handoff=None,
        headers={"x-fail": "slow"},
        request_id="r2",
    )
    seen.stream_abandoned.clear()
    first = await anext(stream)
    assert first.text == " é0"
    await stream.aclose()
    deadline = time.monotonic() + 5
    while not seen.stream_abandoned.is_set():
        assert time.monotonic() < deadline, "the upstream kept streaming to nobody"
        await asyncio.sleep(0.05)
    assert (await prefill(http, url)).first_token_id == 3
