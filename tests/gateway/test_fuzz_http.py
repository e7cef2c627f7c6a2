"""The gateway under hostile and broken requests (hypothesis), over real HTTP.

The real gateway (tokenizer of the tiny model, the CLI's ``BodySizeLimit``) in front of a
real prefill instance, no decode (as tests/gateway/test_app.py); the properties are those
of :mod:`tests.http_fuzz`: no 5xx for a client's mistake, a 4xx names what was wrong, no
hang, still serving after. Valid requests for more than one token are answered 503 by a
gateway without decode instances: the one 5xx expected here.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from flowprefill.models import named_model_dir
from tests.gateway.test_app import SLO_TABLE
from tests.helpers import local_stack
from tests.http_fuzz import (
    CONTENT_TYPES,
    FUZZ,
    METHODS,
    Call,
    bodies,
    check_answer,
    header_values,
)

NO_DECODE = ("no decode instances",)
COMPLETION = {"model": "tiny", "prompt": "hello there", "max_tokens": 1, "stream": False}
CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 1,
    "stream": True,
}
TOKENIZE = {"model": "tiny", "prompt": "hello", "add_special_tokens": True}
DETOKENIZE = {"model": "tiny", "tokens": [5, 9, 13]}
ENDPOINTS: dict[str, dict[str, Any]] = {
    "/v1/completions": COMPLETION,
    "/v1/chat/completions": CHAT,
    "/tokenize": TOKENIZE,
    "/detokenize": DETOKENIZE,
}
# Fields of the OpenAI and vLLM bodies the gateway reads, for the mutator to add.
EXTRA_KEYS = [
    "slo_class",
    "temperature",
    "top_p",
    "n",
    "stop",
    "logprobs",
    "stream_options",
    "ignore_eos",
    "messages",
    "prompt",
    "tools",
    "chat_template",
    "chat_template_kwargs",
    "return_token_strs",
    "add_generation_prompt",
    "continue_final_message",
    "user",
    "seed",
    "max_completion_tokens",
]
CLASS_HEADERS = ["x-slo-class", "x-task", "authorization", "content-type", "accept", "user-agent"]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    model_dir = named_model_dir("tiny-llama", cache_dir=tmp_path_factory.mktemp("models"))
    table = Path(tmp_path_factory.mktemp("gateway")) / "slo-table.json"
    table.write_text(json.dumps(SLO_TABLE))
    with (
        local_stack(model_dir, table, num_prefill=1) as stack,
        httpx.Client(base_url=stack["url"]) as c,
    ):
        yield c
        # Still a working gateway after everything the fuzzers sent.
        ok = c.post("/v1/completions", json=COMPLETION, timeout=30)
        assert ok.status_code == 200, ok.text


@given(
    data=st.data(),
    path=st.sampled_from(sorted(ENDPOINTS)),
    content_type=st.sampled_from(CONTENT_TYPES),
    headers=st.dictionaries(st.sampled_from(CLASS_HEADERS), header_values(), max_size=3),
)
@FUZZ
def test_json_endpoints(
    client: httpx.Client,
    data: st.DataObject,
    path: str,
    content_type: str | None,
    headers: dict[str, str],
) -> None:
    """Bodies near the valid one of each endpoint, any JSON, or not JSON at all; any
    classification header (an SLO class that does not exist, an odd API key)."""
    body = data.draw(bodies(ENDPOINTS[path], EXTRA_KEYS), label="body")
    if content_type is not None:
        headers = {**headers, "content-type": content_type}
    check_answer(client, Call("POST", path, body, headers), expected_5xx=NO_DECODE)


@given(
    method=st.sampled_from(METHODS),
    path=st.sampled_from([*ENDPOINTS, "/v1/models", "/health", "/ready", "/metrics", "/", "/v1"]),
    body=st.none() | bodies(COMPLETION, EXTRA_KEYS),
)
@FUZZ
def test_every_route_and_method(
    client: httpx.Client, method: str, path: str, body: bytes | None
) -> None:
    check_answer(client, Call(method, path, body), expected_5xx=NO_DECODE)
