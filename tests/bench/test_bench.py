"""`flowprefill bench` against a real local gateway: per-class results, JSON and PNG."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi import Request as FastAPIRequest
from fastapi.responses import StreamingResponse

from flowprefill.bench.cli import _tbt_slos
from flowprefill.bench.client import Outcome
from flowprefill.bench.report import goodput, summarize, write
from flowprefill.cli import main
from flowprefill.contracts.slo import PAPER_TBT_SLOS_S
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


def _outcome(times: list[float], tbt_slo_s: float | None = 0.1, **kw: Any) -> Outcome:
    o = Outcome("r", kw.pop("slo_class", "text"), 8, 1.0, 0.0, tbt_slo_s=tbt_slo_s, **kw)
    o.token_times_s = times
    o.ttft_s = times[0] if times else None
    return o


def test_a_request_meets_tbt_only_when_every_gap_is_within_the_slo() -> None:
    # Gaps exactly at the SLO are within it (binary fractions: no rounding in the test).
    assert _outcome([0.5, 0.625, 0.75, 0.875], tbt_slo_s=0.125).met_tbt
    assert not _outcome([0.5, 0.625, 0.75, 0.875], tbt_slo_s=0.124).met_tbt
    assert _outcome([0.5, 0.55, 0.6]).gaps_s == pytest.approx([0.05, 0.05])
    # One slow gap among fast ones misses, wherever it is; the TTFT is not a gap.
    assert not _outcome([0.5, 0.52, 0.54, 0.70, 0.72]).met_tbt
    assert not _outcome([0.5, 0.65, 0.67]).met_tbt
    assert _outcome([5.0, 5.05, 5.1]).met_tbt
    assert _outcome([0.5]).met_tbt  # one token: no gap to miss
    assert not _outcome([0.5, 0.55], error="decode failed").met_tbt
    assert not _outcome([], error="503").met_tbt
    assert _outcome([0.5, 0.9], tbt_slo_s=None).met_tbt is None  # no SLO: not judged


def test_summary_counts_tbt_attainment_per_class_and_pools_gaps() -> None:
    outcomes = [
        _outcome([0.1, 0.15, 0.2]),  # met
        _outcome([0.1, 0.15, 0.4]),  # one 250 ms gap: missed
        _outcome([0.1, 0.3], tbt_slo_s=0.2, slo_class="search"),  # met at 200 ms
        _outcome([0.1, 0.2], tbt_slo_s=0.2, slo_class="search", error="x"),  # failed: missed
        _outcome([0.1, 0.5], tbt_slo_s=None, slo_class="other"),  # no TBT SLO
        _outcome([0.1], slo_class="chat"),  # one token only
    ]
    s = summarize(outcomes)
    assert s["text"]["tbt_attainment"] == 0.5 and s["text"]["tbt_slo_s"] == 0.1
    assert s["search"]["tbt_attainment"] == 0.5 and s["search"]["tbt_slo_s"] == 0.2
    assert s["other"]["tbt_attainment"] is None and s["other"]["tbt_slo_s"] is None
    assert s["chat"]["tbt_attainment"] is None  # no gap and no failure: nothing measured
    # all: the 5 requests with a TBT SLO, 3 of which met it (the chat one vacuously).
    assert s["all"]["tbt_attainment"] == pytest.approx(3 / 5)
    assert s["all"]["tbt_slo_s"] is None
    # Gaps of the requests that succeeded: 50, 50, 50, 250, 200, 400 ms.
    assert s["text"]["tbt_max_s"] == pytest.approx(0.25)
    assert s["all"]["tbt_max_s"] == pytest.approx(0.4)
    assert s["all"]["tbt_p50_s"] == pytest.approx(0.05)
    assert s["all"]["tbt_p99_s"] == pytest.approx(0.4)
    assert s["search"]["tbt_p99_s"] == pytest.approx(0.2)  # the failed one's gap is not in


def test_tbt_slo_flag_forms(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    classes = ["file", "image", "other", "search", "text"]
    assert _tbt_slos("paper", classes) == PAPER_TBT_SLOS_S
    assert PAPER_TBT_SLOS_S == {"text": 0.1, "image": 0.1, "search": 0.2, "file": 0.2}
    assert _tbt_slos("0.05", ["a", "b"]) == {"a": 0.05, "b": 0.05}
    assert _tbt_slos("none", classes) == {}
    (tmp_path / "tbt.json").write_text('{"text": 0.3}')
    assert _tbt_slos(str(tmp_path / "tbt.json"), classes) == {"text": 0.3}
    for bad in ("0", "-1", "nan", str(tmp_path / "missing.json")):
        assert main(["bench", "--tbt-slo", bad, "--url", "http://127.0.0.1:9", "--model", "m"]) == 2
        assert f"--tbt-slo {bad}" in capsys.readouterr().err


def _classed_server(gaps_s: dict[str, float], tokens: int) -> FastAPI:
    """Streams ``tokens`` chunks, ``gaps_s[class]`` apart (class from the x-slo-class
    header), then the usage chunk."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: FastAPIRequest) -> StreamingResponse:
        gap_s = gaps_s[request.headers["x-slo-class"]]

        async def events() -> AsyncIterator[str]:
            for i in range(tokens):
                if i:
                    await asyncio.sleep(gap_s)
                choice = {"index": 0, "text": "x", "finish_reason": None}
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
            usage = {"prompt_tokens": 3, "completion_tokens": tokens, "total_tokens": 3 + tokens}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def test_bench_reports_tbt_attainment_per_class_from_streamed_token_times(
    tmp_path: Path,
) -> None:
    # text streams every 20 ms against a 1 s TBT SLO (met with a wide margin even on a busy
    # machine); search every 300 ms against 50 ms (cannot be met however fast the box is).
    trace = tmp_path / "trace.jsonl"
    types = ["text", "search"] * 4
    rows = [{"timestamp": i * 0.05, "input_length": 8, "type": t} for i, t in enumerate(types)]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "ttft.json").write_text(json.dumps({"text": 5.0, "search": 5.0}))
    (tmp_path / "tbt.json").write_text(json.dumps({"text": 1.0, "search": 0.05}))
    with serve_in_thread(_classed_server({"text": 0.02, "search": 0.3}, tokens=4)) as url:
        # fmt: off
        argv = [
            "bench", "--url", url, "--model", "m", "--workload", str(trace), "--rates", "20",
            "--max-tokens", "4", "--slo-table", str(tmp_path / "ttft.json"),
            "--tbt-slo", str(tmp_path / "tbt.json"), "--out", str(tmp_path / "out"),
        ]
        # fmt: on
        assert main(argv) == 0
    report = json.loads((tmp_path / "out" / "bench.json").read_text())
    res = next(iter(report["rates"].values()))
    assert (res["text"]["tbt_attainment"], res["search"]["tbt_attainment"]) == (1.0, 0.0)
    assert res["all"]["tbt_attainment"] == 0.5
    assert res["text"]["tbt_slo_s"] == 1.0 and res["search"]["tbt_slo_s"] == 0.05
    # The server sleeps 300 ms between tokens; a token the client reads late shortens the
    # next gap it sees, so the median may land a little under 0.3 s (seen: 0.2999).
    assert 0.25 <= res["search"]["tbt_p50_s"] < 1.0
    assert res["all"]["attainment"] == 1.0  # TTFT: unaffected
    assert report["tbt_slo_s"] == {"text": 1.0, "search": 0.05}
    sent = next(iter(report["requests"].values()))
    assert all(len(o["token_times_s"]) == 4 for o in sent)  # every token's arrival kept
    assert (tmp_path / "out" / "attainment.png").stat().st_size > 1000


@pytest.mark.parametrize("with_matplotlib", [True, False])
def test_report_writes_the_plot_only_where_matplotlib_is_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, with_matplotlib: bool
) -> None:
    # matplotlib comes with the lab extra, not bench's: without it the JSON is still written.
    if not with_matplotlib:
        monkeypatch.setitem(sys.modules, "matplotlib", None)
    raw = {1.0: [_outcome([0.1, 0.15, 0.2])]}
    json_path, png_path = write(tmp_path, {"url": "x"}, {1.0: summarize(raw[1.0])}, raw)
    assert json.loads(json_path.read_text())["rates"]["1.0"]["all"]["requests"] == 1
    assert (png_path is not None) == with_matplotlib
    assert (tmp_path / "attainment.png").exists() == with_matplotlib


def test_summary_reports_the_first_gap_apart() -> None:
    """The first gap (prefill's token → decode's: the KV hand-off) beside the pooled ones."""
    outcomes = [
        _outcome([0.1, 0.4, 0.42, 0.44]),  # hand-off 300 ms, then 20 ms steps
        _outcome([0.1, 0.2, 0.22]),  # 100 ms
        _outcome([0.1, 0.9], error="decode failed"),  # failed: not counted
        _outcome([0.1]),  # one token: no gap
    ]
    s = summarize(outcomes)["text"]
    assert s["first_gap_p50_s"] == pytest.approx(0.1)
    assert s["first_gap_p99_s"] == pytest.approx(0.3)
    assert s["tbt_p50_s"] == pytest.approx(0.02)  # the decode steps dominate the pool
