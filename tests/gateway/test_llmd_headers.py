"""llm-d renamed its headers (``x-slo-ttft-ms`` -> ``x-llm-d-slo-ttft-ms``,
``x-gateway-inference-objective`` -> ``x-llm-d-inference-objective``) and keeps the old
names as deprecated aliases: a request carrying only the new names gets the class and the
TTFT target the old names give, the new name wins when both are sent, and upstream calls
carry both."""

from __future__ import annotations

from typing import Any

import pytest

from flowprefill.contracts.deployment import SLO_OBJECTIVE_HEADERS, SLO_TTFT_HEADERS
from flowprefill.gateway.classify import Classification, Job, slo_request
from flowprefill.gateway.errors import ClientError
from flowprefill.gateway.openai_api import CompletionRequest
from tests.gateway.test_slo_request import KEY_HASH, run, table

OLD = {"objective": "x-gateway-inference-objective", "ttft": "x-slo-ttft-ms"}
NEW = {"objective": "x-llm-d-inference-objective", "ttft": "x-llm-d-slo-ttft-ms"}

OPEN = {"anyone": True}
FLOOR = {"api_key_hashes": [KEY_HASH], "min_ttft_slo_ms": 80}
# (claim rules per class, {"objective"|"ttft": value}, with the client's API key)
CASES: list[tuple[dict[str, dict[str, Any]], dict[str, str], bool]] = [
    ({"search": OPEN}, {"objective": "search"}, False),  # a class it may claim
    ({}, {"objective": "search"}, False),  # claim refused: the default, reported
    ({}, {"objective": "platinum"}, False),  # unknown class
    ({}, {"ttft": "2000"}, False),  # looser: always honoured
    ({}, {"ttft": "100"}, False),  # tighter without a floor: refused
    ({"text": FLOOR}, {"ttft": "100"}, True),  # tighter over the floor: honoured
    ({"text": FLOOR}, {"ttft": "50"}, True),  # under the floor: limited to it
    ({"search": OPEN, "image": FLOOR}, {"objective": "image", "ttft": "9000"}, True),
]


def outcome(c: Classification) -> tuple[Any, ...]:
    refusals = tuple((r.reason, r.slo_class, r.requested, r.claim) for r in c.refusals)
    return c.slo_class.name, c.source, c.ttft_slo_ms, refusals


def named(names: dict[str, str], asked: dict[str, str]) -> dict[str, str]:
    return {names[k]: v for k, v in asked.items()}


@pytest.mark.parametrize(("claims", "asked", "key"), CASES)
def test_the_llm_d_names_alone_classify_as_the_old_names_do(
    claims: dict[str, dict[str, Any]], asked: dict[str, str], key: bool
) -> None:
    t = table(**claims)
    old = run(t, named(OLD, asked), key=key)
    new = run(t, named(NEW, asked), key=key)
    assert outcome(new) == outcome(old)
    assert new.ttft_slo_s == old.ttft_slo_s


def test_the_new_name_wins_when_both_are_sent() -> None:
    t = table(search=OPEN, image=OPEN)
    both = {NEW["objective"]: "search", OLD["objective"]: "image"}
    assert run(t, both).slo_class.name == "search"
    # The alias is ignored, not validated: a garbled old value beside a good new one is fine.
    c = run(t, {NEW["ttft"]: "2000", OLD["ttft"]: "soon"})
    assert c.ttft_slo_ms == 2000.0
    asked = slo_request({**both, NEW["ttft"]: "3000", OLD["ttft"]: "4000"}, body_class=None,
                        body_priority=0)  # fmt: skip
    assert (asked.names, asked.ttft_slo_ms) == ((("objective", "search"),), 3000.0)


def test_a_blank_new_name_falls_back_to_the_alias() -> None:
    asked = slo_request({NEW["ttft"]: " ", OLD["ttft"]: "1500"}, body_class=None, body_priority=0)
    assert asked.ttft_slo_ms == 1500.0


@pytest.mark.parametrize("value", ["fast", "0", "-5", "nan", "600001"])
def test_a_malformed_new_name_is_a_400_naming_it(value: str) -> None:
    with pytest.raises(ClientError) as e:
        slo_request({NEW["ttft"]: value}, body_class=None, body_priority=0)
    assert e.value.status == 400 and e.value.param == NEW["ttft"]
    assert NEW["ttft"] in str(e.value)


def test_upstream_hints_carry_both_names() -> None:
    body = CompletionRequest(model="m", prompt="x")
    c = run(table(), {NEW["ttft"]: "2000"})
    hints = Job("cmpl-1", "text_completion", body, [1], c, arrival_s=100.0).upstream_hints(101.0)
    assert hints[NEW["ttft"]] == hints[OLD["ttft"]] == "1000"
    assert hints[NEW["objective"]] == hints[OLD["objective"]] == "text"


def test_the_contract_lists_the_current_name_first() -> None:
    assert (NEW["ttft"], OLD["ttft"]) == SLO_TTFT_HEADERS
    assert (NEW["objective"], OLD["objective"]) == SLO_OBJECTIVE_HEADERS
