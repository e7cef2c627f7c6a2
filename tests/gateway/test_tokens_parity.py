"""The gateway's own tokenizer loader (:mod:`flowprefill.gateway.model_files`, no
transformers) gives transformers' ids: for the demo tokenizer, and for a second directory
with a Llama-3-style template (BOS in the template, a ``tools`` branch, named templates),
special tokens missing from tokenizer.json, and a post-processor that adds BOS. Then the
gateway built as ``serve-gateway`` builds it answers ``/tokenize`` in an interpreter where
transformers, torch and matplotlib cannot be imported."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from flowprefill.gateway.errors import ClientError
from flowprefill.gateway.model_files import FileTokenizer, read_model_config
from flowprefill.gateway.tokens import Tokenizer
from flowprefill.models import named_model_dir

PROMPTS = [
    "The quick brown fox jumps over the lazy dog",
    "  leading and trailing spaces  ",
    "tabs\tand\nnew\r\nlines\n\n",
    "ünïcödé — 日本語のテキスト 🙂",
    "special tokens in text: <|im_end|> <|endoftext|> <|eot_id|> <|begin_of_text|>",
    "",
]

CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello there, how are you?"}],
    [
        {"role": "system", "content": "Réponds en français, brièvement."},
        {"role": "user", "content": "Quel temps fait-il à Zürich ?"},
        {"role": "assistant", "content": "Il pleut. "},
        {"role": "user", "content": "<|im_end|> and <|eot_id|> typed by the user"},
    ],
]

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Météo d'une ville",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]

BOS, EOT = "<|begin_of_text|>", "<|eot_id|>"

# Llama 3.1's template, cut down: BOS from the template, tools as indented JSON (non-ASCII
# kept), strftime_now, loop controls, a {% generation %} block, and raise_exception.
LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools is not none %}"
    "<|start_header_id|>system<|end_header_id|>\n\nYear {{ strftime_now('%Y') }}. Tools:\n"
    "{% for t in tools %}{{ t | tojson(indent=2) }}\n{% endfor %}{{ eos_token }}"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + m.role) }}"
    "{% endif %}"
    "<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content | trim }}{% endgeneration %}"
    "{% else %}{{ m.content | trim }}{% endif %}{{ eos_token }}"
    "{% if loop.index > 8 %}{% break %}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
TOOL_USE_TEMPLATE = "{{ bos_token }}tools={{ tools | tojson }}\n" + LLAMA3_TEMPLATE


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return named_model_dir("tiny-llama", cache_dir=tmp_path_factory.mktemp("models"))


def llama3_dir(demo_dir: Path, root: Path, templates: str) -> Path:
    """The demo's vocabulary saved as a Llama-3-style directory. ``templates``: where the
    chat template lives (``jinja``: chat_template.jinja; ``config``: a string in
    tokenizer_config.json; ``named``: a list of named ones there, ``tool_use`` beside
    ``default``; ``files``: chat_template.jinja plus additional_chat_templates/)."""
    out = root / f"llama3-{templates}"
    out.mkdir()
    state = json.loads((demo_dir / "tokenizer.json").read_text())
    bos_id = len(state["model"]["vocab"])
    state["added_tokens"].append(
        {
            "id": bos_id,
            "content": BOS,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
    )
    state["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": BOS, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [
            {"SpecialToken": {"id": BOS, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": {BOS: {"id": BOS, "ids": [bos_id], "tokens": [BOS]}},
    }
    (out / "tokenizer.json").write_text(json.dumps(state, ensure_ascii=False))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        # An AddedToken object for BOS; EOT and the header tokens are not in tokenizer.json.
        "bos_token": {
            "__type": "AddedToken",
            "content": BOS,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        },
        "eos_token": EOT,
        "pad_token": None,
        "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>"],
        # transformers 5 ignores it with a tokenizer.json (the post-processor adds BOS).
        "add_bos_token": False,
        "model_max_length": 131072,
    }
    if templates == "config":
        config["chat_template"] = LLAMA3_TEMPLATE
    elif templates == "named":
        config["chat_template"] = [
            {"name": "default", "template": LLAMA3_TEMPLATE},
            {"name": "tool_use", "template": TOOL_USE_TEMPLATE},
        ]
    else:
        config["chat_template"] = "{{ 'overridden by chat_template.jinja' }}"
        (out / "chat_template.jinja").write_text(LLAMA3_TEMPLATE)
        if templates == "files":
            (out / "additional_chat_templates").mkdir()
            (out / "additional_chat_templates" / "tool_use.jinja").write_text(TOOL_USE_TEMPLATE)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    model_config = json.loads((demo_dir / "config.json").read_text())
    model_config["eos_token_id"] = [2, bos_id + 1]
    (out / "config.json").write_text(json.dumps(model_config))
    return out


@pytest.fixture(scope="module", params=["demo", "jinja", "config", "named", "files"])
def model_dir(
    request: pytest.FixtureRequest, demo_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    if request.param == "demo":
        return demo_dir
    return llama3_dir(demo_dir, tmp_path_factory.mktemp("dirs"), request.param)


@pytest.fixture(scope="module")
def pair(model_dir: Path) -> tuple[Tokenizer, Any]:
    """Ours (as the gateway wraps it) and transformers' for the same directory."""
    ours = Tokenizer(FileTokenizer.from_dir(model_dir), max_model_len=1 << 20, eos_token_ids=set())
    return ours, AutoTokenizer.from_pretrained(model_dir)


def test_vocabulary_and_special_tokens_match(pair: tuple[Tokenizer, Any]) -> None:
    ours, hf = pair
    mine = ours.tok
    assert isinstance(mine, FileTokenizer)
    assert len(mine) == len(hf)
    assert mine.eos_token_id == hf.eos_token_id
    assert mine.special_tokens_map == hf.special_tokens_map
    assert mine.model_max_length == hf.model_max_length
    assert ours._backend is not None, "the direct encoding path is not taken"


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_completion_prompts_encode_alike(
    pair: tuple[Tokenizer, Any], add_special_tokens: bool
) -> None:
    ours, hf = pair
    for prompt in PROMPTS:
        want = list(hf(prompt, add_special_tokens=add_special_tokens)["input_ids"])
        assert ours.encode_prompt(prompt, add_special_tokens=add_special_tokens) == want


@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize(
    ("add_generation_prompt", "continue_final_message"),
    [(True, False), (False, False), (False, True)],
)
def test_chats_encode_alike(
    pair: tuple[Tokenizer, Any],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
) -> None:
    ours, hf = pair
    for chat in CHATS:
        want = hf.apply_chat_template(
            chat,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=True,
            return_dict=False,
        )
        got = ours.encode_chat(
            chat,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
        assert got == list(want)
    if tools is not None and "tools" in hf.get_chat_template(tools=tools):
        assert "get_weather" in hf.decode(got), "the template's tools branch was not taken"


def test_template_kwargs_and_special_tokens_on_top(pair: tuple[Tokenizer, Any]) -> None:
    ours, hf = pair
    chat = CHATS[1]
    kwargs = {"bos_token": "[start]", "unused_flag": True}
    want = hf.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=False, return_dict=False, **kwargs
    )
    assert ours.encode_chat(chat, template_kwargs=kwargs) == list(
        hf(want, add_special_tokens=False)["input_ids"]
    )
    assert ours.encode_chat(chat, add_special_tokens=True) == list(
        hf(hf.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))["input_ids"]
    )


def test_decoding_matches(pair: tuple[Tokenizer, Any]) -> None:
    ours, hf = pair
    ids = ours.encode_chat(CHATS[1], tools=TOOLS) + ours.encode_prompt(PROMPTS[3])
    assert ours.decode(ids) == hf.decode(ids)
    assert ours.token_strs(ids) == [str(t) for t in hf.convert_ids_to_tokens(ids)]
    assert [ours.decode_token(i) for i in ids] == [
        hf.decode([i], skip_special_tokens=True) for i in ids
    ]


@pytest.mark.parametrize(
    "template",
    [
        "{{ raise_exception('Conversation roles must alternate') }}",
        "{% for m in messages %}{{ m.content }",  # does not compile
        "{{ messages[0].content.upper() }}{{ undefined_thing.attr }}",
    ],
)
def test_template_errors_are_the_same_400(demo_dir: Path, template: str) -> None:
    messages = []
    raw: Any
    for raw in (FileTokenizer.from_dir(demo_dir), AutoTokenizer.from_pretrained(demo_dir)):
        raw.chat_template = template
        with pytest.raises(ClientError) as e:
            Tokenizer(raw, max_model_len=64, eos_token_ids=set()).encode_chat(CHATS[0])
        assert (e.value.status, e.value.param) == (400, "messages")
        messages.append(str(e.value))
    assert messages[0] == messages[1]


def test_a_directory_without_a_template_is_the_same_400(demo_dir: Path, tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(demo_dir, bare)
    (bare / "chat_template.jinja").unlink()
    config = json.loads((bare / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    messages = []
    raw: Any
    for raw in (FileTokenizer.from_dir(bare), AutoTokenizer.from_pretrained(bare)):
        with pytest.raises(ClientError) as e:
            Tokenizer(raw, max_model_len=64, eos_token_ids=set()).encode_chat(CHATS[0])
        messages.append(str(e.value))
    assert messages[0] == messages[1]
    assert "chat_template is not set" in messages[0]


def test_model_config_is_read_as_autoconfig_reads_it(model_dir: Path) -> None:
    from transformers import AutoConfig

    theirs = AutoConfig.from_pretrained(model_dir)
    ours = read_model_config(model_dir)
    assert ours.max_position_embeddings == theirs.max_position_embeddings
    assert ours.vocab_size == theirs.vocab_size
    eos = theirs.eos_token_id
    assert ours.eos_token_ids == set(eos if isinstance(eos, list) else [eos])


# --- the gateway without transformers ------------------------------------------------------

BLOCKED = ("matplotlib", "torch", "transformers")

_FRESH_GATEWAY = """
import importlib.abc, json, sys

BLOCKED = {blocked!r}
refused = []


class Refuse(importlib.abc.MetaPathFinder):
    # Before every other finder: these packages look not installed.
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            refused.append(name)
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)", name=name)
        return None


sys.meta_path.insert(0, Refuse())

from fastapi.testclient import TestClient

from flowprefill.contracts import GatewayConfig
from flowprefill.gateway.app import create_gateway_app
from flowprefill.gateway.cli import build_state

config = GatewayConfig.model_validate_json(open({config!r}).read())
app = create_gateway_app(build_state(config, {table!r}))
with TestClient(app) as client:
    r = client.post("/tokenize", json={{"messages": {chat!r}, "tools": {tools!r}}})
print(json.dumps({{
    "status": r.status_code,
    "body": r.json(),
    "refused": refused,
    "loaded": sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED),
}}))
"""


def test_serve_gateway_answers_tokenize_without_transformers_torch_or_matplotlib(
    demo_dir: Path, tmp_path: Path
) -> None:
    from flowprefill.contracts import Endpoint, GatewayConfig, SLOTable

    model_dir = llama3_dir(demo_dir, tmp_path, "files")
    config = GatewayConfig(
        service="t",
        model_name="tiny",
        tokenizer_path=str(model_dir),
        prefill=[Endpoint.at("p", "127.0.0.1", 9)],  # never called
        decode=[],
    )
    (tmp_path / "gateway.json").write_text(config.model_dump_json())
    (tmp_path / "slo.json").write_text(SLOTable.paper().model_dump_json())
    code = _FRESH_GATEWAY.format(
        blocked=BLOCKED,
        config=str(tmp_path / "gateway.json"),
        table=str(tmp_path / "slo.json"),
        chat=CHATS[1],
        tools=TOOLS,
    )
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["refused"] == [] and result["loaded"] == []
    assert result["status"] == 200, result["body"]
    hf: Any = AutoTokenizer.from_pretrained(model_dir)
    want = hf.apply_chat_template(
        CHATS[1], tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert result["body"]["tokens"] == list(want)
    assert "get_weather" in hf.decode(result["body"]["tokens"])
