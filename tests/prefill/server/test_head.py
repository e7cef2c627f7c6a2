"""``HEAD`` on the prefill instance's main port: answered as ``GET`` is, without the body
(``flowprefill.prefill.server.prefill.HeadAsGet``), over real HTTP with the real tiny
model executor. Before it, FastAPI's ``GET`` routes answered ``HEAD /metrics`` with 405."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client import CONTENT_TYPE_LATEST

from flowprefill.contracts.deployment import HEALTH_PATH, METRICS_PATH, READY_PATH
from flowprefill.contracts.prefill_api import LOAD_PATH
from flowprefill.kv import SharedDirTransport
from flowprefill.models import build_named
from flowprefill.prefill.engine import PrefillEngine
from flowprefill.prefill.executor.runner import PreemptibleExecutor
from flowprefill.prefill.predictor.model import TTFTPredictor
from flowprefill.prefill.server.prefill import create_app
from flowprefill.web.errors import BodySizeLimit
from tests.helpers import serve_in_thread

GET_PATHS = [METRICS_PATH, HEALTH_PATH, READY_PATH, LOAD_PATH, "/openapi.json"]


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    kv_store = SharedDirTransport(Path(tmp_path_factory.mktemp("kv")))
    with PreemptibleExecutor(build_named("tiny-llama", seed=0), granularity="operator") as ex:
        engine = PrefillEngine(ex, TTFTPredictor.linear(1e-5))
        app = BodySizeLimit(create_app(engine, kv_store=kv_store), 64 * 1024)
        with serve_in_thread(app) as base:
            # One prefill first: /metrics then has labelled samples, not only empty families.
            body = {"request_id": "h", "prompt_token_ids": list(range(1, 20)), "ttft_slo_s": 60.0}
            assert httpx.post(f"{base}/v1/prefill", json=body, timeout=60).status_code == 200
            yield base


def _headers(r: httpx.Response) -> dict[str, str]:
    """The answer's headers but ``date`` (the two answers may straddle a second)."""
    return {k: v for k, v in r.headers.items() if k != "date"}


@pytest.mark.parametrize("path", GET_PATHS)
def test_head_on_a_get_endpoint_is_its_get_without_the_body(url: str, path: str) -> None:
    get = httpx.get(f"{url}{path}")
    head = httpx.head(f"{url}{path}")
    assert head.status_code == get.status_code == 200, (path, head.status_code)
    assert head.content == b"" and get.content, path
    assert _headers(head) == _headers(get), path
    assert head.headers["content-length"] == str(len(get.content)), path


def test_head_metrics_announces_the_prometheus_text_format(url: str) -> None:
    head = httpx.head(f"{url}{METRICS_PATH}")
    assert head.status_code == 200
    assert head.headers["content-type"] == CONTENT_TYPE_LATEST
    assert 'outcome="met"' in httpx.get(f"{url}{METRICS_PATH}").text  # what GET then reads


@pytest.mark.parametrize(
    ("path", "status", "allow"),
    [
        # POST only: HEAD gets GET's 405 (the error handlers' body, Allow), bodiless.
        ("/v1/prefill", 405, "POST"),
        ("/v1/kv/h", 405, "DELETE"),  # reads refused on the main port (kv_http)
        ("/no-such-path", 404, None),
    ],
)
def test_head_where_get_is_refused_gets_the_same_refusal_without_the_body(
    url: str, path: str, status: int, allow: str | None
) -> None:
    get = httpx.get(f"{url}{path}")
    head = httpx.head(f"{url}{path}")
    assert head.status_code == get.status_code == status, path
    assert head.content == b"" and get.content, path
    assert head.headers.get("allow") == get.headers.get("allow") == allow, path
    assert _headers(head) == _headers(get), path
