from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest

from flowprefill.contracts import SLOTable
from flowprefill.contracts.slo import Fallback
from flowprefill.errors import InvalidRequestError
from flowprefill.gateway.classify import (
    SLORequest,
    SLOTableFile,
    classify,
    fallback_note,
    slo_request,
)

KEY_HASH = hashlib.sha256(b"sk-batch").hexdigest()
TABLE = {
    "version": 1,
    "default_class": "chat",
    "classes": [
        {
            "name": "chat",
            "task_type": "text",
            "ttft_slo_ms": 250,
            "priority": 10,
            "attainment_target": 0.9,
            "match": {"paths": ["/v1/chat/"]},
        },
        {
            "name": "image",
            "task_type": "image",
            "ttft_slo_ms": 500,
            "priority": 5,
            "attainment_target": 0.9,
            "match": {"models": ["llava"], "headers": {"x-task": "vision"}},
        },
        {
            "name": "file",
            "task_type": "file",
            "ttft_slo_ms": 6000,
            "priority": 0,
            "attainment_target": 0.9,
            "match": {"api_key_hashes": [KEY_HASH]},
        },
        {
            "name": "search",
            "task_type": "search",
            "ttft_slo_ms": 4000,
            "priority": 0,
            "attainment_target": 0.9,
        },
    ],
}


def with_claims(claims: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """TABLE with these classes' claim rules."""
    table = json.loads(json.dumps(TABLE))
    for c in table["classes"]:
        if c["name"] in claims:
            c["claim"] = claims[c["name"]]
    return table


def cls(
    headers: dict[str, str] | None = None,
    body: str | None = None,
    model: str | None = "m",
    path: str = "/v1/completions",
    table: dict[str, Any] = TABLE,
    priority: int = 0,
) -> tuple[str, str, str | None]:
    """(class, source, the first refused or unknown request)"""
    headers = headers or {}
    c = classify(
        SLOTable.model_validate(table),
        slo_request(headers, body_class=body, body_priority=priority),
        headers=headers,
        model=model,
        path=path,
    )
    return c.slo_class.name, c.source, c.refusals[0].requested if c.refusals else None


def test_rules_then_default() -> None:
    assert cls(path="/v1/chat/completions") == ("chat", "rule", None)
    assert cls({"x-task": "vision"}, model="llava") == ("image", "rule", None)
    assert cls({"x-task": "vision"}, model="other")[0] == "chat"  # all rules must hold
    assert cls({"authorization": "Bearer sk-batch"}) == ("file", "rule", None)
    assert cls({"authorization": "Bearer sk-other"}) == ("chat", "default", None)


def test_nobody_may_claim_a_class_by_default() -> None:
    """The secure default: a name the claim rule does not admit falls back to the rules."""
    assert cls({"x-slo-class": "search"}) == ("chat", "default", "search")
    assert cls(body="file") == ("chat", "default", "file")
    assert cls({"x-gateway-inference-objective": "image"}) == ("chat", "default", "image")
    # The batch key's rules give it file; it may not name chat to jump the queue.
    assert cls({"authorization": "Bearer sk-batch", "x-slo-class": "chat"}) == (
        "file",
        "rule",
        "chat",
    )
    # Naming the class the rules give anyway is no escalation.
    assert cls({"authorization": "Bearer sk-batch"}, body="file") == ("file", "field", None)


def test_claims_admit_anyone_or_listed_keys_in_header_objective_field_order() -> None:
    table = with_claims({"search": {"anyone": True}, "image": {"api_key_hashes": [KEY_HASH]}})
    assert cls({"x-slo-class": "search"}, body="file", table=table) == ("search", "header", None)
    assert cls({"x-gateway-inference-objective": "search"}, table=table)[:2] == (
        "search",
        "objective",
    )
    batch = {"authorization": "Bearer sk-batch"}
    assert cls({**batch, "x-slo-class": "image"}, table=table) == ("image", "header", None)
    other = {"authorization": "Bearer sk-other", "x-slo-class": "image"}
    assert cls(other, table=table) == ("chat", "default", "image")
    # A refused name does not stop a later one that is allowed.
    assert cls({"x-slo-class": "image"}, body="search", table=table) == ("search", "field", "image")


def test_unknown_class_falls_back_and_is_reported() -> None:
    assert cls({"x-slo-class": "platinum"}) == ("chat", "default", "platinum")
    assert cls(body="gold", path="/v1/chat/x") == ("chat", "rule", "gold")


def test_refusals_say_why_and_what_was_used() -> None:
    table = SLOTable.model_validate(TABLE)
    headers = {"x-slo-class": "platinum", "x-gateway-inference-objective": "image"}
    c = classify(
        table,
        slo_request(headers, body_class=None, body_priority=0),
        headers=headers,
        model="m",
        path="/v1/completions",
    )
    assert [(r.reason, r.slo_class, r.claim) for r in c.refusals] == [
        (Fallback.UNKNOWN_CLASS, None, None),
        (Fallback.CLASS_REFUSED, "image", "class"),
    ]
    assert fallback_note(c) == "unknown-class 'platinum', claim-refused 'image'; used chat (250 ms)"
    weird = {"x-slo-class": "caf\u00e9\r\nx-evil: 1"}
    c = classify(
        table,
        slo_request(weird, body_class=None, body_priority=0),
        headers=weird,
        model="m",
        path="/v1/completions",
    )
    note = fallback_note(c)
    assert note is not None and note.isascii() and "\r" not in note and "\n" not in note


def test_no_default_and_no_match_is_a_clear_error() -> None:
    table = SLOTable.model_validate({**TABLE, "default_class": None})
    with pytest.raises(InvalidRequestError, match="no default class"):
        classify(table, SLORequest(), headers={}, model="m", path="/v1/completions")
    with pytest.raises(InvalidRequestError, match="unknown SLO class 'gold'"):
        classify(table, SLORequest(names=(("field", "gold"),)), headers={}, model="m", path="/v1/x")


def test_table_file_reloads_on_change_and_survives_bad_writes(tmp_path: Path) -> None:
    path = tmp_path / "slo-table.json"
    path.write_text(json.dumps(TABLE))
    f = SLOTableFile(path)
    assert f.refresh() is False
    changed = json.loads(json.dumps(TABLE))
    changed["classes"][0]["ttft_slo_ms"] = 300
    # ConfigMap-style update: write elsewhere and swap in place.
    tmp = tmp_path / "new.json"
    tmp.write_text(json.dumps(changed))
    os.replace(tmp, path)
    assert f.refresh() is True
    assert f.table.classes[0].ttft_slo_ms == 300
    path.write_text("{ not json")
    assert f.refresh() is False
    assert f.table.classes[0].ttft_slo_ms == 300  # last good table kept
    with pytest.raises(InvalidRequestError, match="invalid"):
        SLOTableFile(path)
