from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from flowprefill.contracts import SLOTable
from flowprefill.errors import InvalidRequestError
from flowprefill.gateway.classify import SLOTableFile, classify

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


def cls(
    headers: dict[str, str] | None = None,
    body: str | None = None,
    model: str | None = "m",
    path: str = "/v1/completions",
) -> tuple[str, str, str | None]:
    c = classify(
        SLOTable.model_validate(TABLE),
        headers=headers or {},
        body_class=body,
        model=model,
        path=path,
    )
    return c.slo_class.name, c.source, c.unknown_requested


def test_header_then_field_then_rules_then_default() -> None:
    assert cls({"x-slo-class": "search"}, body="file") == ("search", "header", None)
    assert cls(body="file") == ("file", "field", None)
    assert cls(path="/v1/chat/completions") == ("chat", "rule", None)
    assert cls({"x-task": "vision"}, model="llava") == ("image", "rule", None)
    assert cls({"x-task": "vision"}, model="other")[0] == "chat"  # all rules must hold
    assert cls({"authorization": "Bearer sk-batch"}) == ("file", "rule", None)
    assert cls({"authorization": "Bearer sk-other"}) == ("chat", "default", None)


def test_unknown_class_falls_back_and_is_reported() -> None:
    assert cls({"x-slo-class": "platinum"}) == ("chat", "default", "platinum")
    assert cls(body="gold", path="/v1/chat/x") == ("chat", "rule", "gold")


def test_no_default_and_no_match_is_a_clear_error() -> None:
    table = SLOTable.model_validate({**TABLE, "default_class": None})
    with pytest.raises(InvalidRequestError, match="no default class"):
        classify(table, headers={}, body_class=None, model="m", path="/v1/completions")


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
