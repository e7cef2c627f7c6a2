"""The direct path to the completion endpoints (:class:`flowprefill.gateway.asgi.GatewayApp`)
answers exactly as the FastAPI app behind it: the same status, body and headers for
well-formed requests (streamed and not) and for every kind of bad one, and it takes the
direct path only for well-formed ones.

Each request is sent to the gateway app and to its FastAPI app alone (``GatewayApp.app``),
both serving the same state in front of the benchmark's stub upstreams (instant prefill and
decode, built from the contracts), through httpx in-process.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.types import Receive, Scope, Send

from benchmarks.gateway.stubs import serve_stub
from flowprefill.contracts import Endpoint, GatewayConfig, SLOTable
from flowprefill.gateway.app import GatewayState, create_gateway_app
from flowprefill.gateway.asgi import GatewayApp
from flowprefill.gateway.cli import build_state
from flowprefill.models import named_model_dir
from flowprefill.web.errors import BodySizeLimit
from tests.helpers import free_port, serve_in_thread

MAX_BODY = 16384


@pytest.fixture(scope="module")
def stub_port() -> Iterator[int]:
    port = free_port()
    proc = mp.get_context("spawn").Process(target=serve_stub, args=(port,), daemon=True)
    proc.start()
    try:
        for _ in range(300):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        yield port
    finally:
        proc.terminate()
        proc.join()


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory, stub_port: int) -> GatewayState:
    model_dir: Path = named_model_dir("tiny-llama", cache_dir=tmp_path_factory.mktemp("models"))
    table = tmp_path_factory.mktemp("slo") / "slo.json"
    table.write_text(SLOTable.paper().model_dump_json())
    ep = Endpoint.at("s", "127.0.0.1", stub_port)
    config = GatewayConfig(
        service="t", model_name="tiny", tokenizer_path=str(model_dir), prefill=[ep], decode=[ep]
    )
    return build_state(config, table)


class Spy:
    """An ASGI app that counts the requests it is handed."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.calls = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.calls += 1
        await self.app(scope, receive, send)


_IDS = re.compile(r'"(id|created)":\s*("[^"]*"|\d+)')


def _normalised(r: httpx.Response) -> tuple[int, str, dict[str, str]]:
    """Status, body and headers, with the per-request id and time taken out."""
    headers = {k: v for k, v in r.headers.items() if k not in ("content-length", "date")}
    return r.status_code, _IDS.sub(r'"\1": _', r.text), headers


JSON = {"content-type": "application/json"}
COMPLETION = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 5}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 3}

# (path, headers, body, direct?): the direct path serves only the well-formed ones. Those
# that reach an endpoint: answered, or refused with a 4xx by its handlers.
CASES: list[tuple[str, dict[str, str], bytes, bool]] = [
    ("/v1/completions", JSON, json.dumps(COMPLETION).encode(), True),
    ("/v1/completions", JSON, json.dumps({**COMPLETION, "stream": True}).encode(), True),
    (
        "/v1/completions",
        JSON,
        json.dumps(
            {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}}
        ).encode(),
        True,
    ),
    ("/v1/chat/completions", JSON, json.dumps(CHAT).encode(), True),
    ("/v1/chat/completions", JSON, json.dumps({**CHAT, "stream": True}).encode(), True),
    # Well-formed, refused by the endpoint (unknown model, refused field, too long, bad
    # SLO header, unknown class: a fallback header), as FastAPI's handlers answer.
    ("/v1/completions", JSON, json.dumps({**COMPLETION, "model": "other"}).encode(), True),
    ("/v1/completions", JSON, json.dumps({**COMPLETION, "logit_bias": {"1": 2}}).encode(), True),
    ("/v1/completions", JSON, json.dumps({**COMPLETION, "max_tokens": 10**6}).encode(), True),
    ("/v1/completions", JSON, json.dumps({**COMPLETION, "max_tokens": 1}).encode(), True),
    (
        "/v1/completions",
        {**JSON, "x-llm-d-slo-ttft-ms": "soon"},
        json.dumps(COMPLETION).encode(),
        True,
    ),
    ("/v1/completions", {**JSON, "x-slo-class": "nope"}, json.dumps(COMPLETION).encode(), True),
    # Not for the direct path: FastAPI answers (the same as without it).
    ("/v1/completions", JSON, b'{"model": "tiny", "prompt": ', False),
    ("/v1/completions", JSON, b"", False),
    ("/v1/completions", JSON, b"[1, 2]", False),
    ("/v1/completions", JSON, b"null", False),
    ("/v1/completions", JSON, b"\xff\xfe\x00", False),
    ("/v1/completions", JSON, b'{"a":' * 1500 + b"1" + b"}" * 1500, False),  # RecursionError
    ("/v1/completions", JSON, json.dumps({**COMPLETION, "max_tokens": 0}).encode(), False),
    ("/v1/completions", JSON, json.dumps({"model": "tiny"}).encode(), False),
    ("/v1/chat/completions", JSON, json.dumps({**CHAT, "messages": []}).encode(), False),
    ("/v1/completions", {"content-type": "text/plain"}, json.dumps(COMPLETION).encode(), False),
    ("/v1/completions", {}, json.dumps(COMPLETION).encode(), False),
    (
        "/v1/completions",
        {"content-type": "application/json; charset=utf-8"},
        json.dumps(COMPLETION).encode(),
        False,
    ),
    ("/v1/completions", JSON, json.dumps({**COMPLETION, "pad": "x" * MAX_BODY}).encode(), False),
]


async def _send(app: Any, path: str, headers: dict[str, str], body: bytes) -> httpx.Response:
    limited = BodySizeLimit(app, MAX_BODY)
    transport = httpx.ASGITransport(app=limited)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        # A generator: no content-length, so an oversized body is cut while it is read.
        async def chunks() -> Any:
            yield body

        return await c.post(path, headers=headers, content=chunks() if body else b"")


@pytest.mark.parametrize(("path", "headers", "body", "direct"), CASES)
async def test_direct_path_answers_as_fastapi(
    state: GatewayState, path: str, headers: dict[str, str], body: bytes, direct: bool
) -> None:
    gateway = create_gateway_app(state)
    assert isinstance(gateway, GatewayApp)
    spy = Spy(gateway.app)
    gateway.app = spy  # type: ignore[assignment]
    via_gateway = await _send(gateway, path, headers, body)
    assert spy.calls == (0 if direct else 1)
    via_fastapi = await _send(spy.app, path, headers, body)
    await state.prefill_client.http.aclose()
    assert _normalised(via_gateway) == _normalised(via_fastapi)


async def test_other_routes_go_to_fastapi(state: GatewayState) -> None:
    gateway = create_gateway_app(state)
    spy = Spy(gateway.app)
    gateway.app = spy  # type: ignore[assignment]
    transport = httpx.ASGITransport(app=gateway)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        assert (await c.get("/v1/models")).status_code == 200
        refused = await c.get("/v1/completions")
        assert refused.status_code == 405 and refused.headers["allow"] == "POST"
        r = await c.post("/v1/completions/", json=COMPLETION, follow_redirects=False)
        assert r.status_code == 307
    assert spy.calls == 3


GET_ROUTES = ["/metrics", "/v1/models", "/health", "/ready", "/version", "/openapi.json"]


async def test_version_is_flowprefills_in_vllms_shape(state: GatewayState) -> None:
    from flowprefill import __version__

    transport = httpx.ASGITransport(app=create_gateway_app(state))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        r = await c.get("/version")
    assert r.status_code == 200 and r.json() == {"version": __version__}


def test_head_answers_as_get_without_a_body(state: GatewayState) -> None:
    """Through a real server (uvicorn sends no HEAD body itself; the app must not try):
    every GET route, and paths GET does not serve (their 404 / 405), answer HEAD with GET's
    status and headers and no body."""
    with serve_in_thread(create_gateway_app(state)) as url, httpx.Client(base_url=url) as c:
        for path in [*GET_ROUTES, "/nowhere", "/v1/completions", "/tokenize"]:
            head, get = c.head(path), c.get(path)
            assert head.status_code == get.status_code, path
            assert head.content == b"", path
            assert get.content, path
            for name in ("content-type", "content-length", "allow"):
                if path == "/metrics" and name == "content-length":
                    continue  # the counters move between the two requests
                assert head.headers.get(name) == get.headers.get(name), (path, name)
        assert c.head("/metrics").headers["content-type"].startswith("text/plain")
        assert c.head("/v1/completions").status_code == 405


async def test_head_in_process_sends_no_body(state: GatewayState) -> None:
    """The app itself sends an empty body for HEAD (not only uvicorn's dropping it)."""
    transport = httpx.ASGITransport(app=create_gateway_app(state))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        for path in GET_ROUTES:
            head, get = await c.head(path), await c.get(path)
            assert (head.status_code, head.content) == (get.status_code, b""), path
            assert head.headers["content-type"] == get.headers["content-type"], path
