"""SLOClass claim rules: the CRD and the model refuse bad ones, the table builder carries
them to the gateway (Secrets hashed), and the gateway's classifier honours what it gets."""

from __future__ import annotations

from typing import Any

import pytest
from flowprefill_operator.builders import (
    SLOClassView,
    build_slo_table,
    judge_classes,
    sha256_hex,
)
from flowprefill_operator.models import SLOClassSpec
from pydantic import ValidationError

from flowprefill.contracts import SLOTable
from flowprefill.gateway.classify import classify, slo_request
from tests.operator.crdcheck import validate_cr


def _slo(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "flowprefill.io/v1alpha1",
        "kind": "SLOClass",
        "metadata": {"name": "chat", "namespace": "ns"},
        "spec": {"taskType": "text", "ttftSloMs": 250, **spec},
    }


def view(name: str, **spec: Any) -> SLOClassView:
    parsed = SLOClassSpec.model_validate({"taskType": "text", "ttftSloMs": 250, **spec})
    return SLOClassView(name, {}, "t0", 1, parsed)


BAD_CLAIMS = [
    ({"claim": {"apiKeyHashes": ["plaintext-key"]}}, "apiKeyHashes"),
    (
        {"claim": {"apiKeyHashes": ["a" * 64], "apiKeySecretRef": {"name": "s"}}},
        "either apiKeyHashes or apiKeySecretRef",
    ),
    ({"claim": {"anyone": True, "apiKeyHashes": ["a" * 64]}}, "list no API keys"),
    ({"claim": {"anyone": True, "apiKeySecretRef": {"name": "s"}}}, "list no API keys"),
    ({"claim": {"minTtftSloMs": 300}}, "minTtftSloMs must not exceed ttftSloMs"),
    ({"claim": {"minTtftSloMs": 0}}, "minTtftSloMs"),
]


@pytest.mark.parametrize(("override", "message"), BAD_CLAIMS, ids=[m for _, m in BAD_CLAIMS])
def test_bad_claims_are_refused_by_schema_cel_and_model(
    override: dict[str, Any], message: str, crd_schemas: Any
) -> None:
    obj = _slo(**override)
    errors = validate_cr(obj, crd_schemas)
    assert any(message in e for e in errors), errors
    with pytest.raises(ValidationError):
        SLOClassSpec.model_validate(obj["spec"])


@pytest.mark.parametrize(
    "claim",
    [
        {},
        {"anyone": True},
        {"anyone": True, "minTtftSloMs": 100},
        {"apiKeyHashes": ["a" * 64], "minTtftSloMs": 250},
        {"apiKeySecretRef": {"name": "s"}},
    ],
)
def test_good_claims_pass_both(claim: dict[str, Any], crd_schemas: Any) -> None:
    obj = _slo(claim=claim)
    assert validate_cr(obj, crd_schemas) == []
    SLOClassSpec.model_validate(obj["spec"])


def test_claims_reach_the_table_with_secret_keys_hashed() -> None:
    classes = [
        view("chat", priority=30, claim={"apiKeySecretRef": {"name": "tenants"}}),
        view(
            "file",
            ttftSloMs=6000,
            default=True,
            claim={"anyone": True, "minTtftSloMs": 1000},
        ),
        view("image", ttftSloMs=500, priority=20),
    ]
    secrets = {"tenants": [sha256_hex("sk-a")]}
    verdicts = judge_classes(classes, secrets)
    assert all(v.accepted for v in verdicts.values())
    table = build_slo_table(classes, [None], verdicts, secrets)
    rows = {c.name: c.claim for c in table.classes}
    assert rows["chat"].api_key_hashes == [sha256_hex("sk-a")] and not rows["chat"].anyone
    assert rows["file"].anyone and rows["file"].min_ttft_slo_ms == 1000
    assert rows["image"].api_key_hashes == [] and not rows["image"].anyone
    assert "sk-a" not in table.model_dump_json()

    # What the gateway does with that table: only sk-a may name chat.
    gateway_table = SLOTable.model_validate_json(table.model_dump_json())

    def served(headers: dict[str, str]) -> str:
        asked = slo_request(headers, body_class=None, body_priority=0)
        c = classify(gateway_table, asked, headers=headers, model="m", path="/v1/completions")
        return c.slo_class.name

    assert served({"x-slo-class": "chat", "authorization": "Bearer sk-a"}) == "chat"
    assert served({"x-slo-class": "chat", "authorization": "Bearer sk-b"}) == "file"
    assert served({"x-slo-class": "image"}) == "file"


def test_a_claim_secret_that_is_missing_is_reported() -> None:
    classes = [view("chat", claim={"apiKeySecretRef": {"name": "gone"}})]
    assert classes[0].spec is not None and classes[0].spec.secret_names() == ["gone"]
    verdict = judge_classes(classes, {"gone": None})["chat"]
    assert (verdict.accepted, verdict.reason) == (False, "SecretNotFound")
    assert "'gone'" in verdict.message
    table = build_slo_table(classes, [None], {"chat": verdict}, {"gone": None})
    assert table.classes[0].claim.api_key_hashes == []  # nobody, not everybody


def test_a_header_rule_on_the_claim_header_is_flagged() -> None:
    """Before claim rules, examples matched x-slo-class as a rule: it still works (a rule
    is the operator's own choice) but the verdict says it admits every client."""
    chat = view("chat", match={"headers": [{"name": "x-slo-class", "value": "chat"}]})
    verdict = judge_classes([chat], {})["chat"]
    assert verdict.accepted
    assert "admits every client" in verdict.message and "spec.claim" in verdict.message
    assert judge_classes([view("plain")], {})["plain"].message == "in use"
