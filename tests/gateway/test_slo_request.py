"""The ecosystem's SLO conventions: priorities (Dynamo, vLLM) and per-request TTFT targets
(llm-d / Inference Extension), mapped onto classes and deadlines under the claim rules."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from flowprefill.contracts import SLOTable
from flowprefill.contracts.slo import Fallback
from flowprefill.gateway.classify import (
    Classification,
    Job,
    SLORequest,
    classify,
    fallback_note,
    slo_request,
)
from flowprefill.gateway.errors import ClientError
from flowprefill.gateway.openai_api import CompletionRequest

KEY = "sk-tenant"
KEY_HASH = hashlib.sha256(KEY.encode()).hexdigest()


def table(**claims: dict[str, Any]) -> SLOTable:
    """The paper's four classes (text 250 ms p30, image 500 p20, search 4 s p10, file 6 s
    p0; text the default) with these claim rules."""
    paper = SLOTable.paper()
    classes = [
        c.model_copy(update={"claim": c.claim.model_validate(claims.get(c.name, {}))})
        for c in paper.classes
    ]
    return paper.model_copy(update={"classes": classes})


def run(
    t: SLOTable, headers: dict[str, str] | None = None, priority: int = 0, key: bool = False
) -> Classification:
    headers = dict(headers or {})
    if key:
        headers["authorization"] = f"Bearer {KEY}"
    asked = slo_request(headers, body_class=None, body_priority=priority)
    return classify(t, asked, headers=headers, model="m", path="/v1/completions")


@pytest.mark.parametrize(
    ("headers", "param"),
    [
        ({"x-slo-ttft-ms": "fast"}, "x-slo-ttft-ms"),
        ({"x-slo-ttft-ms": "0"}, "x-slo-ttft-ms"),
        ({"x-slo-ttft-ms": "-5"}, "x-slo-ttft-ms"),
        ({"x-slo-ttft-ms": "nan"}, "x-slo-ttft-ms"),
        ({"x-slo-ttft-ms": "600001"}, "x-slo-ttft-ms"),
        ({"x-dynamo-request-priority": "high"}, "x-dynamo-request-priority"),
        ({"x-dynamo-request-priority": "1.5"}, "x-dynamo-request-priority"),
    ],
)
def test_malformed_values_are_a_400_naming_the_header(headers: dict[str, str], param: str) -> None:
    with pytest.raises(ClientError) as e:
        slo_request(headers, body_class=None, body_priority=0)
    assert e.value.status == 400 and e.value.param == param and param in str(e.value)


def test_parsing_conventions() -> None:
    asked = slo_request(
        {"x-slo-class": "a", "x-gateway-inference-objective": "b", "x-slo-ttft-ms": "120.5"},
        body_class="c",
        body_priority=0,
    )
    assert asked.names == (("header", "a"), ("objective", "b"), ("field", "c"))
    assert asked.ttft_slo_ms == 120.5 and asked.priority is None
    # vLLM: lower = earlier, so it is negated onto the classes' scale; Dynamo is not.
    assert slo_request({}, body_class=None, body_priority=-30).priority == 30
    dynamo = slo_request({"x-dynamo-request-priority": "20"}, body_class=None, body_priority=5)
    assert (dynamo.priority, dynamo.priority_sent) == (20, "x-dynamo-request-priority: 20")
    # 0 is both conventions' default: it asks for nothing.
    assert slo_request({"x-dynamo-request-priority": "0"}, body_class=None, body_priority=0) == (
        SLORequest()
    )


def test_priority_maps_to_the_nearest_class_the_client_may_claim() -> None:
    open_table = table(text={"anyone": True}, image={"anyone": True}, search={"anyone": True})
    c = run(open_table, {"x-dynamo-request-priority": "22"})
    assert (c.slo_class.name, c.source, c.refusals) == ("image", "priority", ())
    assert run(open_table, priority=-9).slo_class.name == "search"  # vLLM -9 -> 9 -> search
    # A tie (15 is 5 from image and from search) goes to the less urgent class.
    assert run(open_table, {"x-dynamo-request-priority": "15"}).slo_class.name == "search"


def test_priority_never_escalates_past_what_the_client_may_claim() -> None:
    t = table(search={"anyone": True}, image={"api_key_hashes": [KEY_HASH]})
    # Nobody may claim text (30) but text is the default here, so anyone "has" it anyway.
    assert run(t, {"x-dynamo-request-priority": "30"}).slo_class.name == "text"
    # Asking for image (20) without the key: nearest allowed is text (default) or search.
    c = run(t, {"x-dynamo-request-priority": "19"})
    assert c.slo_class.name == "search"
    assert [(r.reason, r.slo_class, r.requested) for r in c.refusals] == [
        (Fallback.PRIORITY_REFUSED, "image", "x-dynamo-request-priority: 19")
    ]
    assert run(t, {"x-dynamo-request-priority": "19"}, key=True).slo_class.name == "image"
    # A name the client may claim beats its priority.
    c = run(t, {"x-slo-class": "search", "x-dynamo-request-priority": "30"})
    assert (c.slo_class.name, c.source) == ("search", "header")


def test_a_looser_ttft_target_is_always_honoured() -> None:
    c = run(table(), {"x-slo-ttft-ms": "2000"})
    assert (c.slo_class.name, c.ttft_slo_ms, c.refusals) == ("text", 2000.0, ())


def test_a_tighter_ttft_target_needs_the_class_to_allow_it() -> None:
    refused = run(table(), {"x-slo-ttft-ms": "100"})
    assert (refused.ttft_slo_ms, refused.refusals[0].reason) == (250.0, Fallback.TTFT_REFUSED)
    assert fallback_note(refused) == "ttft-refused '100 ms'; used text (250 ms)"
    # Admitted by the claim rule but no floor set: still refused.
    assert run(table(text={"anyone": True}), {"x-slo-ttft-ms": "100"}).ttft_slo_ms == 250
    floor = table(text={"api_key_hashes": [KEY_HASH], "min_ttft_slo_ms": 80})
    assert run(floor, {"x-slo-ttft-ms": "100"}, key=True).ttft_slo_ms == 100
    assert run(floor, {"x-slo-ttft-ms": "100"}).ttft_slo_ms == 250  # not this client
    limited = run(floor, {"x-slo-ttft-ms": "50"}, key=True)
    assert (limited.ttft_slo_ms, limited.refusals[0].reason) == (80.0, Fallback.TTFT_LIMITED)
    assert limited.refusals[0].claim == "ttft"


def test_the_target_is_the_jobs_deadline_and_what_met_is_judged_against() -> None:
    body = CompletionRequest(model="m", prompt="x")
    c = run(table(), {"x-slo-ttft-ms": "2000"})
    job = Job("cmpl-1", "text_completion", body, [1], c, arrival_s=100.0)
    assert job.ttft_slo_s == 2.0 and job.deadline_s == 102.0
    assert job.met_slo(1.5) and not job.met_slo(2.5)  # the class's 250 ms is not the bar
    assert job.upstream_hints(101.0)["x-slo-ttft-ms"] == "1000"
    plain = Job("cmpl-2", "text_completion", body, [1], run(table()), arrival_s=100.0)
    assert plain.deadline_s == pytest.approx(100.25)
