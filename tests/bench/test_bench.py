"""`flowprefill bench` against a real local gateway: per-class results, JSON and PNG."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flowprefill.bench.report import goodput
from flowprefill.cli import main
from flowprefill.models import named_model_dir
from tests.helpers import local_stack

TABLE = {
    "version": 1,
    "default_class": "text",
    "classes": [
        {"name": n, "task_type": n, "ttft_slo_ms": ms, "priority": 0, "attainment_target": 0.9}
        for n, ms in (("text", 2000), ("image", 3000), ("search", 20000), ("file", 30000))
    ],
}


def test_bench_reports_per_class_attainment(tmp_path: Path) -> None:
    model_dir = named_model_dir("tiny-llama", cache_dir=tmp_path / "models")
    (tmp_path / "slo.json").write_text(json.dumps(TABLE))
    (tmp_path / "bench-slo.json").write_text(
        json.dumps({c["name"]: c["ttft_slo_ms"] / 1e3 for c in TABLE["classes"]})
    )
    with local_stack(model_dir, tmp_path / "slo.json") as stack:
        code = main(
            [
                "bench",
                "--url",
                stack["url"],
                "--workload",
                "qwen-like",
                "--num-requests",
                "24",
                "--rates",
                "8,16",
                "--length-scale",
                "0.1",
                "--max-tokens",
                "1",
                "--slo-table",
                str(tmp_path / "bench-slo.json"),
                "--out",
                str(tmp_path / "out"),
            ]
        )
    assert code == 0
    report = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert (tmp_path / "out" / "attainment.png").stat().st_size > 1000
    for rate in ("8.0", "16.0"):
        res = report["rates"][rate]
        assert res["all"]["requests"] == 24 and res["all"]["errors"] == 0
        assert {"text", "search"} <= set(res)
        assert res["text"]["slo_s"] == 2.0
    # Loose SLOs on a fast tiny model: everything meets them, so goodput is the top rate.
    assert report["goodput_req_s"] == 16.0


def test_goodput_is_the_highest_rate_meeting_the_target() -> None:
    def res(att: float) -> dict:
        return {"all": {"attainment": att}}

    assert goodput({1.0: res(1.0), 2.0: res(0.95), 4.0: res(0.5)}) == 2.0
    assert goodput({1.0: res(0.5)}) is None


def test_bad_flags_are_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--rates", "1,x", "--url", "http://127.0.0.1:9"]) == 2
    assert "--rates" in capsys.readouterr().err
    assert main(["bench", "--rates", "-1", "--url", "http://127.0.0.1:9"]) == 2
    assert "--rates" in capsys.readouterr().err
    assert main(["bench", "--slo-table", "gpt-9", "--url", "http://127.0.0.1:9"]) == 2
    assert "gpt-9" in capsys.readouterr().err
