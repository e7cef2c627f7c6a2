"""`flowprefill bench` against a real local gateway: per-class results, JSON and PNG."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi import Request as FastAPIRequest
from fastapi.responses import StreamingResponse

from flowprefill.bench.report import goodput
from flowprefill.cli import main
from flowprefill.models import named_model_dir
from tests.helpers import local_stack, serve_in_thread

TABLE: dict[str, Any] = {
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


def _recording_server(seen: list[tuple[int, ...]]) -> FastAPI:
    """An OpenAI-style completions endpoint that streams one token and keeps each prompt."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: FastAPIRequest) -> StreamingResponse:
        body = await request.json()
        seen.append(tuple(body["prompt"]))

        async def events() -> AsyncIterator[str]:
            yield 'data: {"choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}\n\n'
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def test_every_rate_sends_prompts_of_its_own(tmp_path: Path) -> None:
    # Re-sent prompts would be prefix-cache hits on vLLM: every rate after the first would
    # measure the cache, not the scheduler.
    seen: list[tuple[int, ...]] = []
    args = ["bench", "--num-requests", "20", "--length-scale", "0.05", "--max-tokens", "1"]
    with serve_in_thread(_recording_server(seen)) as url:
        for out in ("a", "b"):
            argv = [*args, "--url", url, "--model", "m", "--rates", "40,80,160"]
            assert main([*argv, "--out", str(tmp_path / out)]) == 0
    assert len(seen) == 2 * 3 * 20
    first_run, second_run = seen[:60], seen[60:]
    # The prompts' leading tokens (a 16-token block: vLLM's cache granularity) never repeat
    # within a run...
    blocks = [p[:16] for p in first_run if len(p) >= 16]
    assert len(blocks) > 30 and len(set(blocks)) == len(blocks)
    # ...and a second run with the same seed sends the same prompts (reproducible).
    assert sorted(first_run) == sorted(second_run)


def _paced_server(gap_s: float, tokens: int, usage: bool) -> FastAPI:
    """Streams ``tokens`` chunks ``gap_s`` apart, then (``usage``) OpenAI's usage chunk."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: FastAPIRequest) -> StreamingResponse:
        body = await request.json()
        assert body["stream_options"] == {"include_usage": True}

        async def events() -> AsyncIterator[str]:
            for i in range(tokens):
                if i:
                    await asyncio.sleep(gap_s)
                choice = {"index": 0, "text": "x", "finish_reason": None}
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
            if usage:
                counts = {
                    "prompt_tokens": 3,
                    "completion_tokens": tokens,
                    "total_tokens": 3 + tokens,
                }
                yield f"data: {json.dumps({'choices': [], 'usage': counts})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.mark.parametrize("usage", [True, False])
def test_time_per_output_token_comes_from_the_usage_the_server_reports(
    tmp_path: Path, usage: bool
) -> None:
    args = ["bench", "--num-requests", "6", "--length-scale", "0.05", "--max-tokens", "5"]
    with serve_in_thread(_paced_server(0.05, 5, usage)) as url:
        argv = [*args, "--url", url, "--model", "m", "--rates", "20"]
        assert main([*argv, "--out", str(tmp_path / "out")]) == 0
    res = json.loads((tmp_path / "out" / "bench.json").read_text())["rates"]["20.0"]["all"]
    if not usage:  # no token count: no TPOT rather than a guess from chunk counts
        assert res["tpot_p50_s"] is None
        return
    # 4 gaps of 50 ms after the first token: at least 50 ms per token, whatever the load.
    assert 0.05 <= res["tpot_p50_s"] <= res["tpot_p99_s"] < 1.0
