"""Hand-offs decode will never load are deleted through the prefill instance that wrote
them, on the port the gateway calls.

A real gateway between stub upstreams: prefill streams its first token and then hand-off
parameters naming its KV listener as ``source`` (http transport: a port of its own, which
only decode may reach) or no source (shared_dir); decode is a stub vLLM. Left alone such
files would stay on disk until the age sweep.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from flowprefill.contracts import Endpoint, GatewayConfig
from flowprefill.contracts.kv import HandoffRef
from flowprefill.gateway.app import create_gateway_app
from flowprefill.gateway.cli import build_state
from flowprefill.models import named_model_dir
from tests.gateway.test_app import SLO_TABLE
from tests.helpers import serve_in_thread


class Upstreams:
    def __init__(self) -> None:
        self.first_token = 5
        self.source = ""
        self.decode_status = 200
        self.decode_delay_s = 0.0
        self.prefilled: list[str] = []
        self.deleted: list[str] = []
        self.deleted_at_source: list[str] = []
        self.decoded: list[dict[str, Any]] = []
        self.event = threading.Event()


def upstream_app(u: Upstreams) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/prefill")
    async def prefill(request: Request) -> Any:
        body = await request.json()
        assert body["stream"] is True
        u.prefilled.append(body["request_id"])
        answer = {
            "request_id": body["request_id"],
            "first_token_id": u.first_token,
            "num_prompt_tokens": len(body["prompt_token_ids"]),
            "ttft_s": body["elapsed_s"] + 0.001,
            "met_slo": True,
            "num_preemptions": 0,
            "batch_size": 1,
        }
        params = HandoffRef(body["request_id"], source=u.source or None).to_params()

        async def events() -> AsyncIterator[str]:
            yield f"data: {json.dumps(answer)}\n\n"
            yield f"data: {json.dumps({'kv_transfer_params': params})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.delete("/v1/kv/{handoff_id}")
    async def delete(handoff_id: str) -> Any:
        u.deleted.append(handoff_id)
        u.event.set()
        return {"deleted": True}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await request.json()
        if u.decode_status != 200:
            return JSONResponse({"error": {"message": "no"}}, status_code=u.decode_status)
        u.decoded.append(body)

        async def events() -> AsyncIterator[str]:
            await asyncio.sleep(u.decode_delay_s)
            chunk = {"choices": [{"index": 0, "text": " x", "finish_reason": "length"}]}
            yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def kv_listener_app(u: Upstreams) -> FastAPI:
    """Prefill's KV listener (``source``): decode's, never the gateway's to call."""
    app = FastAPI()

    @app.delete("/v1/kv/{handoff_id}")
    async def delete(handoff_id: str) -> Any:
        u.deleted_at_source.append(handoff_id)
        return {"deleted": True}

    return app


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Upstreams, Any]]:
    tmp = tmp_path_factory.mktemp("release")
    model_dir = named_model_dir("tiny-llama", cache_dir=tmp / "models")
    (tmp / "slo.json").write_text(json.dumps(SLO_TABLE))
    u = Upstreams()
    with serve_in_thread(upstream_app(u)) as url, serve_in_thread(kv_listener_app(u)) as kv:
        u.source = kv
        endpoint = Endpoint(pool="p", host="h", port=1, url=url)
        config = GatewayConfig(
            service="t",
            model_name="tiny",
            tokenizer_path=str(model_dir),
            prefill=[endpoint],
            decode=[endpoint.model_copy(update={"pool": "d"})],
        )
        state = build_state(config, tmp / "slo.json")
        with serve_in_thread(create_gateway_app(state)) as gw:
            yield gw, u, state


def _complete(gw: str, **extra: Any) -> httpx.Response:
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4, **extra}
    return httpx.post(f"{gw}/v1/completions", json=body, timeout=30)


def _deleted(u: Upstreams, rid: str) -> bool:
    deadline = time.monotonic() + 5
    while rid not in u.deleted and time.monotonic() < deadline:
        u.event.wait(0.1)
        u.event.clear()
    return rid in u.deleted


def test_first_token_eos_releases_the_hand_off(gateway: tuple[str, Upstreams, Any]) -> None:
    gw, u, state = gateway
    u.first_token = min(state.tokenizer.eos_token_ids)
    r = _complete(gw)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop"
    assert _deleted(u, r.json()["id"])
    assert u.deleted_at_source == []  # not at the KV listener the parameters name


def test_failed_decode_releases_it_and_so_does_a_finished_one(
    gateway: tuple[str, Upstreams, Any],
) -> None:
    gw, u, _ = gateway
    u.first_token, u.decode_status = 5, 400
    r = _complete(gw)
    assert r.status_code == 400
    assert _deleted(u, u.prefilled[-1])
    u.decode_status = 200
    r = _complete(gw)
    assert r.status_code == 200 and r.json()["choices"][0]["text"].endswith(" x")
    # Decode got the hand-off, and once it finished nothing loads it again: the gateway
    # releases it at once rather than trusting the connector's delayed delete, which a
    # decode process killed within that delay would never run.
    assert u.decoded[-1]["kv_transfer_params"]["flowprefill"]["handoff_id"] == r.json()["id"]
    assert _deleted(u, r.json()["id"])


def test_shared_dir_handoff_is_released_through_the_prefill_that_wrote_it(
    gateway: tuple[str, Upstreams, Any],
) -> None:
    gw, u, state = gateway
    source, u.source = u.source, ""  # shared_dir: the parameters name no source
    try:
        u.first_token = min(state.tokenizer.eos_token_ids)
        r = _complete(gw)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop"
        assert _deleted(u, r.json()["id"])
    finally:
        u.source, u.first_token = source, 5


def test_a_client_gone_while_decode_has_the_request_leaves_it_to_decode(
    gateway: tuple[str, Upstreams, Any],
) -> None:
    """Decode may be loading the hand-off: its connector deletes it when the request ends
    there. A DELETE from the gateway as well could pull the file from under that load."""
    gw, u, _ = gateway
    u.first_token, u.decode_delay_s = 5, 2.0
    try:
        with pytest.raises(httpx.ReadTimeout):
            body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4, "stream": True}
            with httpx.stream("POST", f"{gw}/v1/completions", json=body, timeout=0.5) as r:
                for _ in r.iter_lines():
                    pass
        rid = u.prefilled[-1]
        assert u.decoded and u.decoded[-1]["kv_transfer_params"]["flowprefill"]["handoff_id"] == rid
        time.sleep(1.0)
        assert rid not in u.deleted
    finally:
        u.decode_delay_s = 0.0


def test_a_stream_that_failed_in_decode_ends_with_the_error_not_usage(
    gateway: tuple[str, Upstreams, Any],
) -> None:
    gw, u, _ = gateway
    u.first_token, u.decode_status = 5, 400
    try:
        body = {
            "model": "tiny",
            "prompt": [1, 2, 3],
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with httpx.stream("POST", f"{gw}/v1/completions", json=body, timeout=30) as r:
            events = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
        assert events[-1] == "[DONE]"
        assert "error" in json.loads(events[-2])
        assert not any("usage" in json.loads(e) for e in events[:-1])
        u.decode_status = 200
        with httpx.stream("POST", f"{gw}/v1/completions", json=body, timeout=30) as r:
            events = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
        last = json.loads(events[-2])
        assert last["choices"] == [] and last["usage"]["prompt_tokens"] == 3
    finally:
        u.decode_status = 200
