from __future__ import annotations

import math
from pathlib import Path

import pytest

from flowprefill.bench.traces import (
    FILE_FROM_TOKENS,
    SEARCH_FROM_TOKENS,
    load_trace,
    type_by_length,
)
from flowprefill.bench.workload import QWEN_TYPES, get_slo_table
from flowprefill.errors import InvalidRequestError

SLO = get_slo_table("llama3-8b")


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_jsonl_replay_sorts_rebases_and_keeps_types(tmp_path: Path) -> None:
    p = write(
        tmp_path,
        "t.jsonl",
        '{"timestamp": 12.0, "input_length": 300, "output_length": 5, "type": "image"}\n'
        "\n"
        '{"timestamp": 10.0, "input_length": 9000, "output_length": 0}\n'
        '{"timestamp": "1970-01-01T00:00:14+00:00", "input_length": 100, "output_length": 1}\n',
    )
    w = load_trace(p, SLO, max_tokens=32768)
    assert w.arrival_s == (0.0, 2.0, 4.0)
    assert w.num_tokens == (9000, 300, 100)
    assert w.slo_class == ("search", "image", "text")
    assert w.base_rate == pytest.approx(3 / 4)
    assert [r.arrival_s for r in w.requests(rate=3.0)] == pytest.approx([0.0, 0.5, 1.0])


def test_csv_replay_parses_azure_timestamps(tmp_path: Path) -> None:
    p = write(
        tmp_path,
        "azure.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.1805900,25000,10\n",
    )
    w = load_trace(p, SLO, max_tokens=32768)
    assert w.arrival_s == pytest.approx((0.0, 3.5))
    assert w.slo_class == ("text", "file")


@pytest.mark.parametrize(
    ("name", "text", "match"),
    [
        ("a.jsonl", '{"timestamp": 1, "input_length": 5}\n{"timestamp": 2,\n', "a.jsonl line 2"),
        ("b.jsonl", '{"timestamp": 1, "input_length": -5}\n', "b.jsonl line 1: input_length"),
        (
            "c.jsonl",
            '{"timestamp": 1, "input_length": 5, "type": "video"}\n',
            "line 1: unknown type",
        ),
        ("d.jsonl", '{"input_length": 5}\n', "missing field 'timestamp'"),
        ("e.jsonl", '{"timestamp": "yesterday", "input_length": 5}\n', "line 1: timestamp"),
        ("f.jsonl", '{"timestamp": 1, "input_length": 99999}\n', "exceeds the model's context"),
        ("g.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n1,10,2\n2,ten,2\n", "g.csv line 3"),
        ("h.csv", "time,tokens\n1,2\n", "h.csv line 1: expected the header"),
        ("i.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n", "no requests"),
        ("j.jsonl", "", "no requests"),
        ("k.txt", "x", "expected a .jsonl or .csv"),
        (
            "l.jsonl",
            '{"timestamp": 5, "input_length": 5}\n{"timestamp": 5, "input_length": 9}\n',
            "same timestamp",
        ),
    ],
)
def test_malformed_traces_name_the_row(tmp_path: Path, name: str, text: str, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        load_trace(write(tmp_path, name, text), SLO, max_tokens=32768)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match="no such file"):
        load_trace(tmp_path / "nope.jsonl", SLO, max_tokens=10)


def _log_gamma_pdf(n: float, mean: float, std: float) -> float:
    k = (mean / std) ** 2
    theta = mean / k
    return (k - 1) * math.log(n) - n / theta - math.lgamma(k) - k * math.log(theta)


def test_length_rule_is_the_most_likely_table1_type() -> None:
    types = {t.name: t for t in QWEN_TYPES}
    prior = {"text": types["text"].ratio + types["image"].ratio, "search": 0.2, "file": 0.04}

    def map_type(n: int) -> str:
        score = {
            k: math.log(p) + _log_gamma_pdf(n, types[k].mean, types[k].std)
            for k, p in prior.items()
        }
        return max(score, key=lambda k: score[k])

    for n in (16, 500, SEARCH_FROM_TOKENS - 8, SEARCH_FROM_TOKENS + 8, 10000, FILE_FROM_TOKENS + 8):
        assert type_by_length(n) == map_type(n)
