"""Usage as vLLM reports it: ``stream_options.continuous_usage_stats`` (the usage so far in
every chunk, as guidellm asks for it), ``prompt_tokens_details.cached_tokens`` only when
decode reports it for the client; on both paths to the completion endpoints (the direct
one, :class:`flowprefill.gateway.asgi.GatewayApp`, and FastAPI's).

The upstreams: the benchmark's contract-built prefill stub, and a decode that streams as
vLLM's ``/v1/completions`` does with ``stream_interval`` 2 (two tokens a chunk, so a chunk's
count is decode's, not one per chunk), the usage in every chunk under
``continuous_usage_stats`` (only with ``include_usage``, as vLLM), the last usage with
``prompt_tokens_details`` when the test says decode has ``--enable-prompt-tokens-details``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from benchmarks.gateway.stubs import prefill_answer
from flowprefill.contracts import Endpoint, GatewayConfig, SLOTable
from flowprefill.contracts.deployment import HEALTH_PATH, KV_HTTP_PATH, PREFILL_API_PATH
from flowprefill.contracts.kv import HandoffRef
from flowprefill.contracts.prefill_api import KVHandoffEvent, PrefillRequest, PrefillResponse
from flowprefill.gateway.app import GatewayState, create_gateway_app
from flowprefill.gateway.cli import build_state
from flowprefill.models import named_model_dir
from flowprefill.web.sse import DONE, MEDIA_TYPE, sse_event
from tests.helpers import serve_in_thread

CHUNK_TOKENS = 2


class Upstream:
    """What the stub upstreams do for the next requests, and what decode was sent."""

    def __init__(self) -> None:
        self.cached_tokens: int | None = None
        """Decode reports ``prompt_tokens_details.cached_tokens`` (None: it does not)."""
        self.hand_off = False
        """Prefill writes a hand-off decode loads (False: none, decode recomputes)."""
        self.decode_bodies: list[dict[str, Any]] = []


def upstream_app(up: Upstream) -> FastAPI:
    app = FastAPI()

    @app.post(PREFILL_API_PATH, response_model=None)
    async def prefill(request: PrefillRequest) -> PrefillResponse | StreamingResponse:
        if not request.stream:
            return prefill_answer(request)

        async def events() -> AsyncIterator[str]:
            yield sse_event(prefill_answer(request))
            if request.hand_off_kv:
                params = HandoffRef("h-" + request.request_id[-12:]).to_params()
                yield sse_event(KVHandoffEvent(kv_transfer_params=params if up.hand_off else None))
            yield DONE

        return StreamingResponse(events(), media_type=MEDIA_TYPE)

    @app.delete(KV_HTTP_PATH + "{handoff_id}")
    async def release(handoff_id: str) -> dict[str, str]:
        return {}

    @app.post("/v1/completions")
    async def completions(body: dict[str, Any]) -> StreamingResponse:
        up.decode_bodies.append(body)
        return StreamingResponse(decode_events(body, up.cached_tokens), media_type=MEDIA_TYPE)

    @app.get(HEALTH_PATH)
    async def ok() -> dict[str, str]:
        return {}

    return app


async def decode_events(body: dict[str, Any], cached_tokens: int | None) -> AsyncIterator[str]:
    """vLLM's completion stream (vllm/entrypoints/openai/completion/serving.py), two tokens
    a chunk."""
    options = body.get("stream_options") or {}
    include_usage = bool(options.get("include_usage"))
    continuous = include_usage and bool(options.get("continuous_usage_stats"))
    prompt, n = len(body["prompt"]), int(body["max_tokens"])
    envelope = {"id": "cmpl-d", "object": "text_completion", "created": 0, "model": "d"}
    done = 0
    while done < n:
        step = min(CHUNK_TOKENS, n - done)
        done += step
        text = "".join(f" t{done - step + k}" for k in range(step))
        finish = "length" if done == n else None
        chunk: dict[str, Any] = {
            **envelope,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
        }
        if continuous:
            chunk["usage"] = {
                "prompt_tokens": prompt,
                "completion_tokens": done,
                "total_tokens": prompt + done,
            }
        yield sse_event(chunk)
    if include_usage:
        usage: dict[str, Any] = {
            "prompt_tokens": prompt,
            "completion_tokens": n,
            "total_tokens": prompt + n,
        }
        if cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
        yield sse_event({**envelope, "choices": [], "usage": usage})
    yield DONE


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[str, Upstream]]:
    up = Upstream()
    with serve_in_thread(upstream_app(up)) as url:
        yield url, up


@pytest.fixture
def up(upstream: tuple[str, Upstream]) -> Iterator[Upstream]:
    u = upstream[1]
    yield u
    u.cached_tokens, u.hand_off = None, False
    u.decode_bodies.clear()


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory, upstream: tuple[str, Upstream]) -> GatewayState:
    model_dir: Path = named_model_dir("tiny-llama", cache_dir=tmp_path_factory.mktemp("models"))
    table = tmp_path_factory.mktemp("slo") / "slo.json"
    table.write_text(SLOTable.paper().model_dump_json())
    port = int(upstream[0].rsplit(":", 1)[1])
    ep = Endpoint.at("s", "127.0.0.1", port)
    config = GatewayConfig(
        service="t", model_name="tiny", tokenizer_path=str(model_dir), prefill=[ep], decode=[ep]
    )
    return build_state(config, table)


COMPLETION = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 6}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 6}
GUIDELLM = {"include_usage": True, "continuous_usage_stats": True}
"""What guidellm 0.8.1 sends with every streamed request."""
PATHS = {"completion": ("/v1/completions", COMPLETION), "chat": ("/v1/chat/completions", CHAT)}


async def _post(
    state: GatewayState, direct: bool, path: str, body: dict[str, Any]
) -> httpx.Response:
    """``body`` to ``path``: through the gateway's direct path, or FastAPI's alone."""
    gateway = create_gateway_app(state)
    app: Any = gateway if direct else gateway.app
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
            return await c.post(path, json=body)
    finally:
        await state.prefill_client.http.aclose()


def _events(r: httpx.Response) -> list[dict[str, Any]]:
    assert r.status_code == 200, r.text
    datas = [line[len("data: ") :] for line in r.text.split("\n") if line.startswith("data: ")]
    assert datas[-1] == "[DONE]"
    return [json.loads(d) for d in datas[:-1]]


def _text(kind: str, chunk: dict[str, Any]) -> str:
    (choice,) = chunk["choices"]
    return str(choice["delta"].get("content", "")) if kind == "chat" else str(choice["text"])


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "fastapi"])
@pytest.mark.parametrize("kind", ["completion", "chat"])
async def test_continuous_usage_in_every_chunk(
    state: GatewayState, up: Upstream, kind: str, direct: bool
) -> None:
    path, base = PATHS[kind]
    whole = (await _post(state, direct, path, base)).json()
    events = _events(
        await _post(state, direct, path, {**base, "stream": True, "stream_options": GUIDELLM})
    )
    assert up.decode_bodies[-1]["stream_options"] == GUIDELLM  # asked of decode too
    *chunks, last = events
    assert last["choices"] == [] and last["usage"] == whole["usage"]
    prompt = whole["usage"]["prompt_tokens"]
    # The first chunk holds the first token (prefill's); then decode's chunks, two tokens
    # each (the last one: what is left of max_tokens - 1 = 5).
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == [1, 3, 5, 6]
    for chunk in chunks:
        assert set(chunk["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}
        assert chunk["usage"]["prompt_tokens"] == prompt
        assert chunk["usage"]["total_tokens"] == prompt + chunk["usage"]["completion_tokens"]
    assert [_text(kind, c).count(" t") for c in chunks[1:]] == [2, 2, 1]
    assert chunks[-1]["usage"] == whole["usage"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    if kind == "chat":
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "fastapi"])
@pytest.mark.parametrize(
    "options",
    [{"continuous_usage_stats": True}, {"include_usage": True}, None],
    ids=["continuous-only", "include-only", "none"],
)
async def test_usage_chunks_as_vllm_without_both_options(
    state: GatewayState, up: Upstream, options: dict[str, bool] | None, direct: bool
) -> None:
    """vLLM honours continuous_usage_stats only with include_usage: alone, no usage at all."""
    body: dict[str, Any] = {**COMPLETION, "stream": True}
    if options is not None:
        body["stream_options"] = options
    *chunks, last = _events(await _post(state, direct, "/v1/completions", body))
    assert all("usage" not in c for c in chunks)
    assert ("usage" in last) == bool(options and options.get("include_usage"))
    assert up.decode_bodies[-1]["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "fastapi"])
async def test_cached_tokens_passed_through_when_decode_reports_them(
    state: GatewayState, up: Upstream, direct: bool
) -> None:
    up.cached_tokens = 3
    whole = (await _post(state, direct, "/v1/completions", COMPLETION)).json()
    assert whole["usage"]["prompt_tokens_details"] == {"cached_tokens": 3}
    stream = {**COMPLETION, "stream": True, "stream_options": GUIDELLM}
    *chunks, last = _events(await _post(state, direct, "/v1/completions", stream))
    assert last["usage"] == whole["usage"]
    # As vLLM: the details ride on the last usage only, not on each chunk's.
    assert all("prompt_tokens_details" not in c["usage"] for c in chunks)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "fastapi"])
async def test_cached_tokens_absent_unless_decode_reports_them_for_the_client(
    state: GatewayState, up: Upstream, direct: bool
) -> None:
    whole = (await _post(state, direct, "/v1/completions", COMPLETION)).json()
    assert "prompt_tokens_details" not in whole["usage"]  # decode reported none
    # Decode loaded the hand-off: its count is the tokens prefill computed for this very
    # request, not a cache hit. Left out.
    up.cached_tokens, up.hand_off = 5, True
    whole = (await _post(state, direct, "/v1/completions", COMPLETION)).json()
    assert "kv_transfer_params" in up.decode_bodies[-1]
    assert whole["usage"]["completion_tokens"] == 6
    assert "prompt_tokens_details" not in whole["usage"]


MSGS = [{"role": "user", "content": "Hi there"}]
CLIENT_BODIES = {
    "guidellm-completions": (
        "/v1/completions",
        {
            "model": "tiny",
            "prompt": "The quick",
            "max_tokens": 4,
            "ignore_eos": True,
            "stream": True,
            "stream_options": GUIDELLM,
        },
    ),
    "guidellm-chat": (
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": MSGS,
            "max_completion_tokens": 4,
            "ignore_eos": True,
            "stream": True,
            "stream_options": GUIDELLM,
        },
    ),
    "inference-perf-completions": (
        "/v1/completions",
        {
            "model": "tiny",
            "prompt": "The quick",
            "max_tokens": 4,
            "ignore_eos": False,
            "stream": True,
            "stream_options": {"include_usage": True},
            "add_special_tokens": True,
        },
    ),
    "inference-perf-chat": (
        "/v1/chat/completions",
        {"model": "tiny", "messages": MSGS, "max_tokens": 4, "ignore_eos": False, "stream": False},
    ),
    "aiperf-chat": (
        "/v1/chat/completions",
        {
            "messages": MSGS,
            "model": "tiny",
            "stream": True,
            "max_completion_tokens": 4,
            "stream_options": {"include_usage": True},
        },
    ),
    "vllm-bench-completions": (
        "/v1/completions",
        {
            "model": "tiny",
            "prompt": "The quick",
            "repetition_penalty": 1.0,
            "max_tokens": 4,
            "logprobs": None,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        },
    ),
    "vllm-bench-chat": (
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
            "max_completion_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        },
    ),
}
"""The bodies the benchmark clients build by default (docs/gateway.md, "What benchmark
clients send"), with the headers below."""
CLIENT_HEADERS = {
    "authorization": "Bearer sk-none",
    "x-request-id": "client-1",
    "x-correlation-id": "c-1",
    "user-agent": "aiperf/0.13.0",
}


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "fastapi"])
@pytest.mark.parametrize("client", list(CLIENT_BODIES))
async def test_benchmark_clients_bodies_are_served(
    state: GatewayState, up: Upstream, client: str, direct: bool
) -> None:
    path, body = CLIENT_BODIES[client]
    gateway = create_gateway_app(state)
    transport = httpx.ASGITransport(app=gateway if direct else gateway.app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
            r = await c.post(path, json=body, headers=CLIENT_HEADERS)
    finally:
        await state.prefill_client.http.aclose()
    if not body["stream"]:
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        return
    *chunks, last = _events(r)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert last["usage"]["completion_tokens"] == 4
    # The client's request id is not the answer's (docs/gateway.md: it names the hand-off).
    assert "client-1" not in last["id"]
    assert all(("usage" in c) == (body["stream_options"] == GUIDELLM) for c in chunks)
