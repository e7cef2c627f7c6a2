"""The gateway over real HTTP, in front of real prefill instances (tiny model, CPU).

These requests stop at the first token (max_tokens=1) or exercise failures, so no decode
instance is needed; the disaggregated path through vLLM is tested in tests/e2e.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from flowprefill.models import load_model, named_model_dir
from tests.helpers import local_stack

SLO_TABLE = {
    "version": 1,
    "default_class": "chat",
    "classes": [
        {
            "name": "chat",
            "task_type": "text",
            "ttft_slo_ms": 5000,
            "priority": 10,
            "attainment_target": 0.9,
        },
        {
            "name": "file",
            "task_type": "file",
            "ttft_slo_ms": 60000,
            "priority": 0,
            "attainment_target": 0.9,
            "match": {"headers": {"x-task": "summarise"}},
        },
    ],
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return named_model_dir("tiny-llama", cache_dir=tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    table = tmp_path_factory.mktemp("gateway") / "slo-table.json"
    table.write_text(json.dumps(SLO_TABLE))
    with local_stack(model_dir, table) as s:
        yield {**s, "table": table, "model": load_model(model_dir)}


@pytest.fixture
def client(stack: dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack['url']}/v1", api_key="none", max_retries=0)


def test_completion_returns_the_prefill_first_token(
    stack: dict[str, Any], client: openai.OpenAI
) -> None:
    raw = client.completions.with_raw_response.create(
        model="tiny", prompt="hello world, how are you", max_tokens=1
    )
    resp = raw.parse()
    assert raw.headers["x-flowprefill-slo-class"] == "chat"
    tok = stack["state"].tokenizer
    ids = tok.encode_prompt("hello world, how are you")
    import torch

    with torch.inference_mode():
        logits = stack["model"](torch.tensor([ids])).logits[0, -1]
    assert resp.choices[0].text == tok.decode_token(int(logits.argmax()))
    assert resp.choices[0].finish_reason in ("length", "stop")
    assert resp.usage is not None and resp.usage.prompt_tokens == len(ids)


def test_streaming_chat_first_chunk_then_done(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hi there"}],
            max_tokens=1,
            stream=True,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    assert client.models.list().data[0].id == "tiny"


def test_classification_by_rule_header_and_unknown_fallback(
    stack: dict[str, Any], client: openai.OpenAI
) -> None:
    raw = client.completions.with_raw_response.create(
        model="tiny", prompt="x", max_tokens=1, extra_headers={"x-task": "summarise"}
    )
    assert raw.headers["x-flowprefill-slo-class"] == "file"
    raw = client.completions.with_raw_response.create(
        model="tiny", prompt="x", max_tokens=1, extra_body={"slo_class": "platinum"}
    )
    assert raw.headers["x-flowprefill-slo-class"] == "chat"
    assert "platinum" in raw.headers["x-flowprefill-slo-class-fallback"]
    metrics = httpx.get(f"{stack['url']}/metrics").text
    assert 'flowprefill_gateway_slo_requests_total{outcome="met",slo_class="file"}' in metrics


def test_slo_table_reload_changes_classification(
    stack: dict[str, Any], client: openai.OpenAI
) -> None:
    table = json.loads(json.dumps(SLO_TABLE))
    table["default_class"] = "file"
    tmp = stack["table"].with_suffix(".new")
    tmp.write_text(json.dumps(table))
    tmp.replace(stack["table"])
    import time

    deadline = time.monotonic() + 5
    while stack["state"].slo_file.table.default_class != "file":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    raw = client.completions.with_raw_response.create(model="tiny", prompt="x", max_tokens=1)
    assert raw.headers["x-flowprefill-slo-class"] == "file"
    stack["table"].write_text(json.dumps(SLO_TABLE))


@pytest.mark.parametrize(
    ("content", "status", "needle"),
    [
        ("{oops", 400, "not valid JSON"),
        (json.dumps({"model": "tiny"}), 400, "prompt"),
        (json.dumps({"model": "tiny", "prompt": ""}), 400, "empty"),
        (json.dumps({"model": "nope", "prompt": "x"}), 404, "does not exist"),
        (json.dumps({"model": "tiny", "prompt": [1] * 9000}), 400, "maximum context"),
        (json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 0}), 400, "max_tokens"),
        (
            json.dumps({"model": "tiny", "prompt": "x", "stream_options": {"include_usage": True}}),
            400,
            "stream_options is only allowed when stream is true",
        ),
        (json.dumps({"model": "tiny", "prompt": "x" * 300_000}), 413, "larger than"),
    ],
)
def test_bad_input_gets_openai_style_errors(
    stack: dict[str, Any], content: str, status: int, needle: str
) -> None:
    r = httpx.post(
        f"{stack['url']}/v1/completions",
        content=content,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]


def test_typed_errors_through_the_openai_client(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[], max_tokens=1)


def test_without_decode_longer_outputs_fail_clearly(client: openai.OpenAI) -> None:
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=5)
    assert e.value.status_code == 503
    assert "no decode" in str(e.value)
