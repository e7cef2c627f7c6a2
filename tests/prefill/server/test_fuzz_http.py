"""The prefill server under hostile and broken requests (hypothesis), over real HTTP.

The real apps (tiny model, real engine, ``http`` KV transport routes: the main listener
and the KV listener, each behind the CLI's ``BodySizeLimit`` and uvicorn options) on
loopback; the properties are those of :mod:`tests.http_fuzz`: no 5xx for a client's
mistake, a 4xx names what was wrong, no hang, still serving after.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from flowprefill.models import build_named
from flowprefill.prefill.engine import PrefillEngine
from flowprefill.prefill.executor.runner import PreemptibleExecutor
from flowprefill.prefill.predictor.model import TTFTPredictor
from flowprefill.prefill.server.kv_http import create_kv_app
from flowprefill.prefill.server.kv_sink import directory_sink
from flowprefill.prefill.server.prefill import create_app
from flowprefill.web.errors import BodySizeLimit
from flowprefill.web.limits import uvicorn_options
from tests.helpers import serve_in_thread
from tests.http_fuzz import (
    CONTENT_TYPES,
    FUZZ,
    METHODS,
    Call,
    bodies,
    check_answer,
    header_values,
)

VALID = {
    "request_id": "fuzz",
    "prompt_token_ids": [5, 9, 13, 17],
    "ttft_slo_s": 5.0,
    "elapsed_s": 0.0,
    "slo_class": "chat",
    "hand_off_kv": True,
    "stream": False,
}
PATHS = ["/v1/prefill", "/v1/kv/x", "/health", "/ready", "/metrics", "/", "/v1/prefill/"]


def _limited(app: Any) -> Any:
    return serve_in_thread(BodySizeLimit(app, 64 * 1024, 10.0), **uvicorn_options(10.0))


@pytest.fixture(scope="module")
def clients(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, httpx.Client]]:
    """The main listener's client and the KV listener's."""
    model = build_named("tiny-llama", seed=0)
    with PreemptibleExecutor(model, granularity="operator") as executor:
        engine = PrefillEngine(executor, TTFTPredictor.linear(1e-5))
        sink = directory_sink(Path(tmp_path_factory.mktemp("kv")), executor.model.config)
        with (
            _limited(create_kv_app(sink.transport)) as kv_url,
            _limited(create_app(engine, sink, sink.transport, kv_url)) as url,
            httpx.Client(base_url=url) as c,
            httpx.Client(base_url=kv_url) as kv,
        ):
            sink.source = kv_url
            served = c.post("/v1/prefill", json={**VALID, "request_id": "served"}, timeout=30)
            assert served.status_code == 200, served.text
            yield {"main": c, "kv": kv}
            # Still a working prefill server after everything the fuzzers sent, whose
            # hand-offs decode can still pull.
            ok = c.post("/v1/prefill", json={**VALID, "request_id": "after"}, timeout=30)
            assert ok.status_code == 200, ok.text
            assert kv.get("/v1/kv/after", timeout=30).status_code == 200


@pytest.fixture(scope="module")
def client(clients: dict[str, httpx.Client]) -> httpx.Client:
    return clients["main"]


@given(
    body=bodies(VALID, ["prompt", "model", "priority", "kv_transfer_params"]),
    content_type=st.sampled_from(CONTENT_TYPES),
    slo_header=st.none() | header_values(),
)
@FUZZ
def test_prefill_endpoint(
    client: httpx.Client, body: bytes, content_type: str | None, slo_header: str | None
) -> None:
    headers = {} if content_type is None else {"content-type": content_type}
    if slo_header is not None:
        headers["x-slo-class"] = slo_header
    check_answer(client, Call("POST", "/v1/prefill", body, headers))


@given(
    method=st.sampled_from(METHODS),
    path=st.sampled_from(PATHS)
    | st.text(max_size=140).map(lambda s: "/v1/kv/" + quote(s, safe="")),
    body=st.none() | bodies(VALID, ["extra"]),
    headers=st.dictionaries(
        st.sampled_from(["x-slo-class", "range", "content-type", "accept", "x-request-id"]),
        header_values(),
        max_size=3,
    ),
)
@FUZZ
def test_every_route_and_method(
    client: httpx.Client, method: str, path: str, body: bytes | None, headers: dict[str, str]
) -> None:
    """Any method on any route (the KV routes with any id and any ``Range``)."""
    check_answer(client, Call(method, path, body, headers))


@given(
    method=st.sampled_from(METHODS),
    path=st.sampled_from([*PATHS, "/v1/kv/served", "/v1/kv/served"])  # a real hand-off
    | st.text(max_size=140).map(lambda s: "/v1/kv/" + quote(s, safe="")),
    body=st.none() | bodies(VALID, ["extra"]),
    headers=st.dictionaries(
        st.sampled_from(["range", "content-type", "accept", "if-range", "if-none-match"]),
        header_values(),
        max_size=3,
    ),
)
@FUZZ
def test_every_route_and_method_of_the_kv_listener(
    clients: dict[str, httpx.Client],
    method: str,
    path: str,
    body: bytes | None,
    headers: dict[str, str],
) -> None:
    """The KV listener (what decode pods reach) under the same: any method, path, id,
    ``Range``."""
    check_answer(clients["kv"], Call(method, path, body, headers))
