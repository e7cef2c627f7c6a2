"""OpenAI / vLLM request fields: every field of vLLM's request models is served, passed to
decode, accepted with no effect, or refused naming it; tested with the official `openai`
client against a real gateway (tiny-model prefill, a stub decode that records what it got).
Also the ecosystem's SLO headers end to end."""

from __future__ import annotations

import ast
import importlib.util
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from flowprefill.gateway.openai_api import (
    NO_EFFECT,
    PASSED_TO_DECODE,
    REFUSED,
    ChatCompletionRequest,
    CompletionRequest,
)
from flowprefill.models import named_model_dir
from tests.helpers import local_stack, serve_in_thread

OURS_ONLY = {"slo_class", "max_completion_tokens"}
"""Fields of ours that vLLM's model lacks (``max_completion_tokens``: only vLLM's chat has
it; its completions ignore it, ours honour it as chat does)."""


def _fields(tree: ast.Module, cls: str) -> set[str]:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return {
                s.target.id
                for s in node.body
                if isinstance(s, ast.AnnAssign)
                and isinstance(s.target, ast.Name)
                and not s.target.id.startswith("_")  # class constants, private attributes
            }
    raise AssertionError(f"{cls} not found in vLLM's protocol")


def test_the_field_sets_do_not_overlap() -> None:
    """A declared field may also be passed to decode (validated here, sampled there), but
    nothing is both passed and ignored or refused."""
    declared = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
    assert not PASSED_TO_DECODE & NO_EFFECT
    assert not PASSED_TO_DECODE & set(REFUSED)
    assert not NO_EFFECT & set(REFUSED)
    assert not declared & (NO_EFFECT | set(REFUSED))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
@pytest.mark.parametrize(
    ("module", "cls", "ours"),
    [
        ("completion", "CompletionRequest", CompletionRequest),
        ("chat_completion", "ChatCompletionRequest", ChatCompletionRequest),
    ],
)
def test_every_field_of_vllms_request_models_has_a_treatment(
    module: str, cls: str, ours: type[Any]
) -> None:
    """Read (not import: that takes seconds) vLLM's protocol: a field added by a vLLM
    upgrade fails here until docs/gateway.md and openai_fields.py say what happens to it."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    path = Path(spec.origin).parent / "entrypoints" / "openai" / module / "protocol.py"
    theirs = _fields(ast.parse(path.read_text()), cls)
    known = set(ours.model_fields) | PASSED_TO_DECODE | NO_EFFECT | set(REFUSED)
    assert theirs - known == set()
    assert set(ours.model_fields) - theirs <= OURS_ONLY


# --------------------------------------------------------------------- over HTTP

SLO_TABLE = {
    "version": 1,
    "default_class": "chat",
    "classes": [
        {
            "name": "chat",
            "task_type": "text",
            "ttft_slo_ms": 5000,
            "priority": 30,
            "attainment_target": 0.9,
        },
        {
            "name": "batch",
            "task_type": "file",
            "ttft_slo_ms": 60000,
            "priority": 0,
            "attainment_target": 0.9,
            "claim": {"anyone": True},
        },
        {
            "name": "vip",
            "task_type": "text",
            "ttft_slo_ms": 2000,
            "priority": 50,
            "attainment_target": 0.9,
        },
    ],
}


def stub_decode(seen: list[dict[str, Any]]) -> FastAPI:
    """vLLM's /v1/completions as the gateway calls it: records the body, streams two
    pieces and the usage."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        seen.append(await request.json())

        async def events() -> AsyncIterator[str]:
            for text, finish in ((" one", None), (" two", "length")):
                chunk = {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            yield f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': 2}})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    model_dir = named_model_dir("tiny-llama", cache_dir=tmp_path_factory.mktemp("models"))
    table = tmp_path_factory.mktemp("gateway") / "slo-table.json"
    table.write_text(json.dumps(SLO_TABLE))
    seen: list[dict[str, Any]] = []
    with (
        serve_in_thread(stub_decode(seen)) as decode_url,
        local_stack(model_dir, table, num_prefill=1, decode_urls=(decode_url,)) as s,
    ):
        yield {**s, "decode_seen": seen}


@pytest.fixture
def client(stack: dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack['url']}/v1", api_key="none", max_retries=0)


PASSED = {
    "top_k": 5,
    "min_p": 0.1,
    "repetition_penalty": 1.1,
    "frequency_penalty": 0.5,
    "presence_penalty": 0.2,
    "stop_token_ids": [99999],
    "include_stop_str_in_output": True,
    "skip_special_tokens": False,
    "cache_salt": "salt-123",
}


def test_passed_fields_reach_decode(stack: dict[str, Any], client: openai.OpenAI) -> None:
    seen = stack["decode_seen"]
    seen.clear()
    resp = client.completions.create(
        model="tiny",
        prompt="hello there",
        max_tokens=3,
        temperature=0.5,
        seed=7,
        stop=["\n\n"],
        user="u-1",  # accepted, no effect
        extra_body={**PASSED, "metadata": {"k": "v"}, "request_id": "mine"},
    )
    assert resp.choices[0].text.endswith(" one two")
    assert resp.usage is not None and resp.usage.completion_tokens == 3
    (body,) = seen
    for key, value in {**PASSED, "temperature": 0.5, "seed": 7, "stop": ["\n\n"]}.items():
        assert body[key] == value, key
    for key in ("user", "metadata", "request_id", "priority", "slo_class"):
        assert key not in body, key
    assert body["max_tokens"] == 2  # the first token came from prefill


def test_chat_fields_shape_the_prompt_as_tokenize_shows(
    stack: dict[str, Any], client: openai.OpenAI
) -> None:
    """Chat template options are served: the prompt prefill gets is what /tokenize gives."""
    messages: list[Any] = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    for extra in ({}, {"add_generation_prompt": False, "continue_final_message": True}):
        resp = client.chat.completions.with_raw_response.create(
            model="tiny", messages=messages, max_tokens=1, extra_body=extra
        )
        usage = resp.parse().usage
        assert usage is not None
        count = httpx.post(
            f"{stack['url']}/tokenize", json={"model": "tiny", "messages": messages, **extra}
        ).json()["count"]
        assert usage.prompt_tokens == count


REFUSALS = [
    ("completions", {"logprobs": 2}, "logprobs"),
    ("completions", {"echo": True}, "echo"),
    ("completions", {"suffix": "x"}, "suffix"),
    ("completions", {"logit_bias": {"5": 10}}, "logit_bias"),
    ("completions", {"min_tokens": 2}, "min_tokens"),
    ("completions", {"use_beam_search": True}, "use_beam_search"),
    ("completions", {"kv_transfer_params": {"do_remote_prefill": True}}, "kv_transfer_params"),
    ("completions", {"truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
    ("completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("completions", {"n": 2}, "n"),
    ("completions", {"frobnicate": 1}, "frobnicate"),
    ("completions", {"prompt": ["a", "b"]}, "prompt"),
    ("chat", {"logprobs": True}, "logprobs"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("chat", {"audio": {"voice": "alloy"}}, "audio"),
    ("chat", {"chat_template": "{{ x }}"}, "chat_template"),
    ("chat", {"chat_template_kwargs": {"chat_template": "x"}}, "chat_template_kwargs"),
    (
        "chat",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages",
    ),
]


@pytest.mark.parametrize(
    ("endpoint", "extra", "field"), REFUSALS, ids=[f"{e}-{f}" for e, _, f in REFUSALS]
)
def test_refused_fields_are_a_400_naming_the_field(
    client: openai.OpenAI, endpoint: str, extra: dict[str, Any], field: str
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        if endpoint == "completions":
            client.completions.create(model="tiny", prompt="x", max_tokens=1, extra_body=extra)
        else:
            client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "x"}],
                max_tokens=1,
                extra_body=extra,
            )
    assert field in str(e.value.message)
    assert e.value.param is not None and e.value.param.startswith(field)


def test_slo_conventions_end_to_end(stack: dict[str, Any], client: openai.OpenAI) -> None:
    # Anyone may claim batch; nobody may claim vip; a looser target is honoured.
    raw = client.completions.with_raw_response.create(
        model="tiny", prompt="x", max_tokens=1, extra_headers={"x-slo-class": "batch"}
    )
    assert raw.headers["x-flowprefill-slo-class"] == "batch"
    assert "x-flowprefill-slo-class-fallback" not in raw.headers
    raw = client.completions.with_raw_response.create(
        model="tiny", prompt="x", max_tokens=1, extra_headers={"x-slo-class": "vip"}
    )
    assert raw.headers["x-flowprefill-slo-class"] == "chat"
    assert raw.headers["x-flowprefill-slo-class-fallback"].startswith("claim-refused 'vip'")
    raw = client.completions.with_raw_response.create(
        model="tiny",
        prompt="x",
        max_tokens=1,
        extra_body={"priority": 50},  # vLLM: late
    )
    assert raw.headers["x-flowprefill-slo-class"] == "batch"
    raw = client.completions.with_raw_response.create(
        model="tiny", prompt="x", max_tokens=1, extra_headers={"x-slo-ttft-ms": "100"}
    )
    assert raw.headers["x-flowprefill-slo-class-fallback"].startswith("ttft-refused")
    with pytest.raises(openai.BadRequestError, match="x-slo-ttft-ms"):
        client.completions.create(
            model="tiny", prompt="x", max_tokens=1, extra_headers={"x-slo-ttft-ms": "soon"}
        )
    metrics = httpx.get(f"{stack['url']}/metrics").text
    assert 'flowprefill_gateway_slo_claims_refused_total{claim="class",slo_class="vip"} 1.0' in (
        metrics
    )
    assert 'flowprefill_gateway_slo_claims_refused_total{claim="ttft",slo_class="chat"} 1.0' in (
        metrics
    )


def test_the_first_token_ends_the_answer_where_vllm_would_stop() -> None:
    body = CompletionRequest.model_validate({"model": "m", "prompt": "x", "stop_token_ids": [5]})
    assert body.first_token_ends(5, {2}) and body.first_token_ends(2, {2})
    assert not body.first_token_ends(7, {2})
    assert not CompletionRequest(model="m", prompt="x", ignore_eos=True).first_token_ends(2, {2})
    assert body.decode_sampling()["stop_token_ids"] == [5]
