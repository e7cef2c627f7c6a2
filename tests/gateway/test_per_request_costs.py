"""What the gateway's per-request shortcuts must keep as it was: request ids written as
``uuid.uuid4().hex`` writes them (and not repeated across a fork), upstream JSON bodies
with the same values and the same refusal of non-finite numbers as ``json.dumps``, a first
token's text remembered per id with the tokenizer's own answer, and upstream hints made
from the request's own class (cached per class, never across classes)."""

from __future__ import annotations

import json
import math
import os
import random
import uuid
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from flowprefill.contracts.slo import SLOTable, SLOTableClass
from flowprefill.gateway.classify import Job, SLORequest, classify, random_uuid_hex
from flowprefill.gateway.openai_api import CompletionRequest
from flowprefill.gateway.tokens import Tokenizer
from flowprefill.gateway.upstream import _encode_json
from flowprefill.models import named_model_dir


def test_request_ids_are_version_4_uuids_and_unique() -> None:
    ids = [random_uuid_hex() for _ in range(20_000)]
    assert len(set(ids)) == len(ids)
    for h in ids[:2000]:
        u = uuid.UUID(hex=h)
        assert (u.version, u.variant, u.hex) == (4, uuid.RFC_4122, h)
    # Both fixed fields are set, whatever the random bits (all ones, all zeros).
    assert {h[12] for h in ids} == {"4"}
    assert {h[16] for h in ids} <= set("89ab")


def test_seeding_random_does_not_repeat_request_ids() -> None:
    random.seed(0)
    first = random_uuid_hex()
    random.seed(0)
    assert random_uuid_hex() != first


def test_a_forked_child_draws_other_ids_than_its_parent() -> None:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, to the parent
        try:
            os.write(write, " ".join(random_uuid_hex() for _ in range(4)).encode())
        finally:
            os._exit(0)
    os.close(write)
    child = os.read(read, 4096).decode().split()
    os.close(read)
    os.waitpid(pid, 0)
    parent = [random_uuid_hex() for _ in range(4)]
    assert len(child) == 4 and not set(child) & set(parent)


BODIES: list[dict[str, Any]] = [
    {"model": "tiny", "prompt": list(range(5000)), "max_tokens": 16, "stream": True},
    {"temperature": 0.7, "top_p": 1e-05, "seed": 2**70, "stop": ["é\u2028", '\x00\n"\\']},
    {"stop": ["NaN", "Infinity"], "min_p": 0.1},  # the names inside strings: the slow path
    {"kv_transfer_params": {"a": [1.5, -2.25e300, None, True, {}]}, "x": []},
]


@pytest.mark.parametrize("body", BODIES)
def test_upstream_json_has_the_values_json_dumps_writes(body: dict[str, Any]) -> None:
    data = _encode_json(body)
    assert b", " not in data and b": " not in data  # compact (no string here holds them)
    assert json.loads(data) == body
    assert data.decode("utf-8")  # UTF-8, not ASCII escapes
    assert ("é" in str(body)) == ("é" in data.decode())


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_non_finite_number_is_refused_as_json_dumps_refuses_it(value: float) -> None:
    with pytest.raises(ValueError, match="not JSON compliant"):
        _encode_json({"model": "m", "min_p": value, "stop": ["NaN"]})
    with pytest.raises(ValueError, match="not JSON compliant"):
        _encode_json({"nested": [{"x": value}]})


def test_bytes_are_sent_as_they_are() -> None:
    assert _encode_json(b'{"a": NaN}') == b'{"a": NaN}'


def test_first_token_text_is_the_tokenizers_every_time(tmp_path: Path) -> None:
    hf = AutoTokenizer.from_pretrained(named_model_dir("tiny-llama", cache_dir=tmp_path))
    tok = Tokenizer(hf, max_model_len=1 << 20, eos_token_ids=set())
    ids = [*range(0, tok.vocab_size, max(1, tok.vocab_size // 300)), tok.vocab_size - 1]
    for _ in range(2):  # the second round from the cache
        for i in ids:
            assert tok.decode_token(i) == hf.decode([i], skip_special_tokens=True)
    assert set(tok._token_texts) == set(ids)
    assert set(tok._token_texts) <= set(range(tok.vocab_size))


def table(priority: int, name: str = "chat", tpot: int | None = None) -> SLOTable:
    c = SLOTableClass(
        name=name,
        task_type="text",
        ttft_slo_ms=250,
        priority=priority,
        attainment_target=0.9,
        **({"tpot_slo_ms": tpot} if tpot is not None else {}),
    )
    return SLOTable(default_class=name, classes=[c])


def hints(t: SLOTable, now_s: float = 100.1) -> dict[str, str]:
    c = classify(t, SLORequest(), headers={}, model="m", path="/v1/completions")
    body = CompletionRequest(model="m", prompt="x")
    return Job("cmpl-1", "text_completion", body, [1], c, arrival_s=100.0).upstream_hints(now_s)


def test_upstream_hints_are_each_requests_own_class() -> None:
    first = hints(table(0))
    assert first == {
        "x-llm-d-inference-objective": "chat",
        "x-gateway-inference-objective": "chat",
        "x-llm-d-slo-ttft-ms": "150",
        "x-slo-ttft-ms": "150",
        "x-dynamo-request-priority": "0",
    }
    assert list(first) == list(hints(table(0)))  # the order of the headers on the wire
    # A reloaded table's classes (maybe at a freed class's address) are not the old ones.
    for i in range(50):
        got = hints(table(i, name=f"c{i}", tpot=i + 1), now_s=100.2)
        assert got["x-dynamo-request-priority"] == str(i)
        assert got["x-llm-d-inference-objective"] == f"c{i}"
        assert got["x-slo-tpot-ms"] == str(i + 1)
        assert got["x-slo-ttft-ms"] == "50"
    assert hints(table(0), now_s=101.0)["x-slo-ttft-ms"] == "1"  # at least 1 ms
    # A per-request dict: changing one request's hints changes no other's.
    mine = hints(table(3))
    mine["x-dynamo-request-priority"] = "9"
    assert hints(table(3))["x-dynamo-request-priority"] == "3"


@pytest.mark.parametrize("n", [1, 100, 101, 5000])
@pytest.mark.parametrize("has_decode", [False, True])
def test_prefill_requests_are_what_validating_them_whole_gives(n: int, has_decode: bool) -> None:
    from flowprefill.contracts.prefill_api import PrefillRequest
    from flowprefill.gateway.classify import Classification
    from flowprefill.gateway.metrics import GatewayMetrics
    from flowprefill.gateway.prefill import PrefillStage
    from flowprefill.gateway.routing import InstancePool
    from flowprefill.gateway.upstream import PrefillClient, UpstreamHTTP

    c = table(0).classes[0]
    ids = [(i * 7919) % 32000 for i in range(n)]
    body = CompletionRequest(model="m", prompt=ids, max_tokens=4)
    job = Job("cmpl-9", "text_completion", body, ids, Classification(c, "default"), 100.0)
    pool = InstancePool("prefill", ["http://i0"], policy="round-robin")
    stage = PrefillStage(
        pool, PrefillClient(UpstreamHTTP()), GatewayMetrics(), lambda: 100.5,
        has_decode=has_decode,
    )  # fmt: skip
    got = stage.request(job, 100.02)
    whole = PrefillRequest(
        request_id="cmpl-9",
        prompt_token_ids=ids,
        ttft_slo_s=0.25,
        elapsed_s=job.elapsed_s(100.02),
        slo_class="chat",
        hand_off_kv=has_decode,
        stream=has_decode,
    )
    assert got == whole and got.model_fields_set == whole.model_fields_set
    assert got.model_dump_json() == whole.model_dump_json()
    assert got.prompt_token_ids == ids


@pytest.mark.parametrize("kind", ["text_completion", "chat.completion"])
@pytest.mark.parametrize("model", ["tiny", 'a "quoted" módel\n'])
def test_stream_events_are_chunk_event_and_usage_event_character_for_character(
    kind: Any, model: str
) -> None:
    from flowprefill.gateway.classify import Classification
    from flowprefill.gateway.relay import StreamEvents, chunk_event, usage_event

    c = table(0).classes[0]
    body = CompletionRequest(model="m", prompt="x")
    job = Job("cmpl-7", kind, body, [1, 2, 3], Classification(c, "default"), 100.0)
    events = StreamEvents(job, model)
    for text in ["", " word", 'é"\\\n\u2028🙂']:
        for finish in [None, "stop", "length"]:
            for first in (False, True):
                for with_usage in (False, True):
                    job.num_completion_tokens += 1
                    assert events.chunk(
                        text, finish, first=first, with_usage=with_usage
                    ) == chunk_event(job, model, text, finish, first=first, with_usage=with_usage)
    for cached in (None, 0, 2):
        job.cached_tokens = cached
        assert events.usage() == usage_event(job, model)


@pytest.mark.parametrize(
    ("ids", "bad"),
    [([], None), ([0], None), ([5, 0, 99], None), ([5, -1, 100], 1), ([1, 2, 100, -3], 2),
     ([10**30], 0), ([*range(100), 100], 100)],
)  # fmt: skip
def test_token_ids_outside_the_vocabulary_name_the_first(ids: list[int], bad: int | None) -> None:
    from flowprefill.gateway.errors import ClientError

    class Plain:
        def __len__(self) -> int:
            return 100

    tok = Tokenizer(Plain(), max_model_len=1000, eos_token_ids=set())
    if bad is None:
        tok.check_token_ids(ids, "prompt")
        return
    with pytest.raises(ClientError) as e:
        tok.check_token_ids(ids, "prompt")
    assert str(e.value).startswith(f"prompt[{bad}]: token id {ids[bad]} is out of vocabulary")
    assert e.value.param == "prompt" and e.value.status == 400
