"""vLLM's ``/tokenize`` and ``/detokenize`` on the gateway: the same JSON as vLLM's server,
the same ids the completion endpoints send to prefill, and 4xx answers for bad bodies.

The app is driven in-process through httpx (no prefill instance is needed: neither
endpoint calls one).
"""

from __future__ import annotations

import ast
import importlib.util
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from flowprefill.contracts import Endpoint, GatewayConfig, SLOTable
from flowprefill.gateway import tokens
from flowprefill.gateway.app import GatewayState, create_gateway_app
from flowprefill.gateway.classify import intake
from flowprefill.gateway.cli import build_state
from flowprefill.gateway.errors import ClientError
from flowprefill.gateway.openai_api import (
    ChatCompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from flowprefill.gateway.tokens import Tokenizer, prompt_token_ids
from flowprefill.models import named_model_dir

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello there, how are you?"},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return named_model_dir("tiny-llama", cache_dir=tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def state(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> GatewayState:
    table = tmp_path_factory.mktemp("slo") / "slo.json"
    table.write_text(SLOTable.paper().model_dump_json())
    config = GatewayConfig(
        service="t",
        model_name="tiny",
        tokenizer_path=str(model_dir),
        prefill=[Endpoint.at("p", "127.0.0.1", 9)],  # never called
        decode=[],
    )
    return build_state(config, table)


@pytest.fixture
async def client(state: GatewayState) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=create_gateway_app(state))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        yield c


def _prefilled_ids(state: GatewayState, body: ChatCompletionRequest | Any) -> list[int]:
    """The token ids stage 1 puts in the job, i.e. what prefill is sent."""
    job = intake(
        body,
        arrival_s=0.0,
        headers={},
        path="/v1/completions",
        model_name="tiny",
        table=state.slo_file.table,
        tokenizer=state.tokenizer,
    )
    return job.token_ids


async def test_tokenize_a_prompt_as_vllm_answers(
    client: httpx.AsyncClient, state: GatewayState, model_dir: Path
) -> None:
    hf: Any = AutoTokenizer.from_pretrained(model_dir)
    prompt = "The quick brown fox jumps over the lazy dog"
    r = await client.post("/tokenize", json={"model": "tiny", "prompt": prompt})
    assert r.status_code == 200, r.text
    body = r.json()
    assert list(body) == ["count", "max_model_len", "tokens", "token_strs"]
    assert body["tokens"] == list(hf(prompt, add_special_tokens=True)["input_ids"])
    assert body["count"] == len(body["tokens"])
    assert body["max_model_len"] == state.tokenizer.max_model_len
    assert body["token_strs"] is None
    # The ids /v1/completions would send to prefill for the same prompt.
    from flowprefill.gateway.openai_api import CompletionRequest

    assert body["tokens"] == _prefilled_ids(state, CompletionRequest(model="tiny", prompt=prompt))

    r = await client.post(
        "/tokenize",
        json={"prompt": prompt, "add_special_tokens": False, "return_token_strs": True},
    )
    assert r.status_code == 200, r.text  # model is optional, as in vLLM
    body = r.json()
    assert body["tokens"] == list(hf(prompt, add_special_tokens=False)["input_ids"])
    assert body["token_strs"] == hf.convert_ids_to_tokens(body["tokens"])


async def test_tokenize_a_chat_matches_what_chat_completions_prefills(
    client: httpx.AsyncClient, state: GatewayState, model_dir: Path
) -> None:
    hf: Any = AutoTokenizer.from_pretrained(model_dir)
    r = await client.post("/tokenize", json={"model": "tiny", "messages": CHAT})
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    expected = hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert ids == list(expected)
    chat = ChatCompletionRequest.model_validate({"model": "tiny", "messages": CHAT})
    assert ids == _prefilled_ids(state, chat)

    # vLLM's other chat flags reach the template.
    r = await client.post(
        "/tokenize",
        json={"messages": CHAT, "add_generation_prompt": False, "return_token_strs": True},
    )
    plain = r.json()
    assert plain["count"] < len(ids) and ids[: plain["count"]] == plain["tokens"]
    assert plain["token_strs"] == hf.convert_ids_to_tokens(plain["tokens"])
    reply = [*CHAT, {"role": "assistant", "content": "Fine"}]
    r = await client.post(
        "/tokenize",
        json={"messages": reply, "add_generation_prompt": False, "continue_final_message": True},
    )
    assert r.status_code == 200, r.text
    assert hf.decode(r.json()["tokens"]).endswith("Fine")


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


async def test_tokenize_and_chat_completions_share_one_tokenization(
    client: httpx.AsyncClient, state: GatewayState
) -> None:
    """/tokenize answers the ids chat completions send to prefill, and both refuse a chat
    template in the request with the same 400."""
    chat = {"model": "tiny", "messages": CHAT, "chat_template_kwargs": {"note": "x"}}
    r = await client.post("/tokenize", json={**chat, "tools": []})
    assert r.status_code == 200, r.text
    body = ChatCompletionRequest.model_validate({**chat, "tools": []})
    assert r.json()["tokens"] == _prefilled_ids(state, body)
    templates = ({"chat_template": "{{ 1 }}"}, {"chat_template_kwargs": {"chat_template": "x"}})
    for template in templates:
        tokenized = await client.post("/tokenize", json={**chat, **template})
        completed = await client.post(
            "/v1/chat/completions", json={**chat, **template, "max_tokens": 1}
        )
        assert tokenized.status_code == completed.status_code == 400, completed.text
        assert tokenized.json() == completed.json()
        assert tokenized.json()["error"]["param"] == next(iter(template))


def test_tools_reach_the_template_on_the_one_path(model_dir: Path) -> None:
    """With a template that lists tools, /tokenize's ids include them, and they are the
    ids the chat path computes for the same body (which chat completions then refuse:
    tool calls are not parsed out of the answer)."""
    hf: Any = AutoTokenizer.from_pretrained(model_dir)
    hf.chat_template = (
        "{% for t in tools or [] %}tool {{ t.function.name }}\n{% endfor %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    )
    tok = Tokenizer(hf, max_model_len=512, eos_token_ids=set())
    chat = {"model": "tiny", "messages": CHAT, "tools": TOOLS}
    ids = tokens.tokenize(tokens.parse_tokenize(chat), tok, "tiny")["tokens"]
    assert "tool get_weather" in hf.decode(ids)
    body = ChatCompletionRequest.model_validate(chat)
    assert ids == prompt_token_ids(body, tok)
    assert [param for param, _ in body.refusals()] == ["tools"]
    without = tokens.tokenize(tokens.parse_tokenize({**chat, "tools": None}), tok, "tiny")
    assert without["tokens"] != ids


async def test_detokenize_round_trips_and_keeps_special_tokens(
    client: httpx.AsyncClient, model_dir: Path
) -> None:
    hf: Any = AutoTokenizer.from_pretrained(model_dir)
    ids = (await client.post("/tokenize", json={"messages": CHAT})).json()["tokens"]
    r = await client.post("/detokenize", json={"model": "tiny", "tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": hf.decode(ids)}
    assert "<|im_start|>" in r.json()["prompt"]
    r = await client.post("/detokenize", json={"tokens": []})
    assert r.json() == {"prompt": ""}


@pytest.mark.parametrize(
    ("path", "content", "status", "param", "needle"),
    [
        ("/tokenize", "{oops", 400, None, "not valid JSON"),
        ("/tokenize", "[1, 2]", 400, None, "dictionary"),
        ("/tokenize", {"model": "tiny"}, 400, "prompt", "prompt or messages"),
        ("/tokenize", {"prompt": "a", "messages": CHAT}, 400, "messages", "not both"),
        ("/tokenize", {"prompt": 5}, 400, "prompt", "string"),
        ("/tokenize", {"prompt": [1, 2]}, 400, "prompt", "string"),
        ("/tokenize", {"messages": []}, 400, "messages", "at least 1"),
        ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, None, "role"),
        ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model", "does not exist"),
        (
            "/tokenize",
            {"messages": CHAT, "continue_final_message": True, "add_generation_prompt": True},
            400,
            None,
            "Cannot set both",
        ),
        ("/tokenize", {"messages": CHAT, "chat_template": "{{ 1 }}"}, 400, "chat_template", ""),
        (
            "/tokenize",
            {"messages": CHAT, "chat_template_kwargs": {"chat_template": "x"}},
            400,
            "chat_template_kwargs",
            "not served",
        ),
        ("/detokenize", {"model": "tiny"}, 400, "tokens", "Field required"),
        ("/detokenize", {"tokens": [1, "a"]}, 400, "tokens.1", "integer"),
        ("/detokenize", {"tokens": [1, -3]}, 400, "tokens", "tokens[1]: token id -3"),
        ("/detokenize", {"tokens": [10**30]}, 400, "tokens", "out of vocabulary"),
        ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "model", "does not exist"),
    ],
)
async def test_bad_bodies_get_openai_style_4xx(
    client: httpx.AsyncClient,
    path: str,
    content: str | dict[str, Any],
    status: int,
    param: str | None,
    needle: str,
) -> None:
    raw = content if isinstance(content, str) else json.dumps(content)
    r = await client.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and "Traceback" not in r.text
    if param is not None:
        assert err["param"] == param


def test_a_template_that_refuses_the_chat_is_a_400(model_dir: Path) -> None:
    # Templates raise on chats they cannot render (e.g. roles that do not alternate):
    # the client's to fix, so a 400 naming messages rather than a 500.
    hf: Any = AutoTokenizer.from_pretrained(model_dir)
    hf.chat_template = "{{ raise_exception('Conversation roles must alternate') }}"
    tok = Tokenizer(hf, max_model_len=64, eos_token_ids=set())
    with pytest.raises(ClientError) as e:
        tok.encode_chat(CHAT)
    assert (e.value.status, e.value.param) == (400, "messages")
    assert "Conversation roles must alternate" in str(e.value)


async def test_token_id_prompts_outside_the_vocabulary_are_refused(
    client: httpx.AsyncClient, state: GatewayState
) -> None:
    n = state.tokenizer.vocab_size
    r = await client.post("/v1/completions", json={"model": "tiny", "prompt": [1, n]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt"
    assert f"prompt[1]: token id {n} is out of vocabulary" in r.json()["error"]["message"]


def _fields(tree: ast.Module, cls: str) -> set[str]:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return {
                s.target.id
                for s in node.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            }
    raise AssertionError(f"{cls} not found in vLLM's protocol")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_request_fields_follow_vllms_protocol() -> None:
    """Read (not import: that takes seconds) vLLM's tokenize protocol and check that every
    field it accepts is ours too; the multimodal ones are accepted and ignored here."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    path = Path(spec.origin).parent / "entrypoints" / "serve" / "tokenize" / "protocol.py"
    tree = ast.parse(path.read_text())
    text_only = {"media_io_kwargs", "mm_processor_kwargs"}
    for theirs, ours in (
        ("TokenizeCompletionRequest", TokenizeCompletionRequest),
        ("TokenizeChatRequest", TokenizeChatRequest),
        ("DetokenizeRequest", DetokenizeRequest),
    ):
        assert _fields(tree, theirs) - text_only == set(ours.model_fields), theirs
    assert _fields(tree, "TokenizeResponse") == {"count", "max_model_len", "tokens", "token_strs"}
    assert _fields(tree, "DetokenizeResponse") == {"prompt"}
