"""The gateway's stages without HTTP: fake upstream clients, a hand-driven clock.

What crosses to prefill (the class SLO and the time spent since arrival), how the first
token is judged (class SLO from gateway arrival), the one failover rule, and who releases
a KV hand-off.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import pytest

from flowprefill.contracts import SLOTable, SLOTableClass
from flowprefill.contracts.kv import HandoffRef
from flowprefill.contracts.names import Router
from flowprefill.contracts.prefill_api import PrefillRequest, PrefillResponse
from flowprefill.gateway.classify import Classification, Job
from flowprefill.gateway.decode import DecodeStage, Piece
from flowprefill.gateway.errors import NoHealthyInstanceError, UpstreamError
from flowprefill.gateway.metrics import GatewayMetrics
from flowprefill.gateway.openai_api import CompletionRequest
from flowprefill.gateway.prefill import PrefillStage
from flowprefill.gateway.routing import Instance, InstancePool, Placement, failover_call
from flowprefill.gateway.upstream import DecodeClient, DecodeDelta, PrefillAnswer, PrefillClient


class Clock:
    def __init__(self, now_s: float = 100.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


def job(arrival_s: float, ttft_slo_ms: int = 1000, max_tokens: int = 4) -> Job:
    slo = SLOTableClass(
        name="chat", task_type="text", ttft_slo_ms=ttft_slo_ms, priority=3, attainment_target=0.9
    )
    return Job(
        request_id="cmpl-1",
        kind="text_completion",
        body=CompletionRequest(model="m", prompt=[1, 2, 3], max_tokens=max_tokens),
        token_ids=[1, 2, 3],
        classification=Classification(slo, "default"),
        arrival_s=arrival_s,
    )


def response(request_id: str = "cmpl-1", first: int = 7, ttft_s: float = 0.0) -> PrefillResponse:
    return PrefillResponse(
        request_id=request_id,
        first_token_id=first,
        num_prompt_tokens=3,
        ttft_s=ttft_s,
        met_slo=True,
        num_preemptions=0,
        batch_size=1,
    )


class FakePrefill(PrefillClient):
    """Answers after ``took_s`` on the clock; ``refuse`` lists URLs that refuse."""

    def __init__(self, clock: Clock, took_s: float, refuse: tuple[str, ...] = ()) -> None:
        self.clock, self.took_s, self.refuse = clock, took_s, refuse
        self.sent: list[tuple[str, PrefillRequest, dict[str, str]]] = []
        self.released: list[PrefillAnswer] = []

    async def prefill(
        self, url: str, request: PrefillRequest, headers: dict[str, str]
    ) -> PrefillAnswer:
        self.sent.append((url, request, headers))
        if url in self.refuse:
            raise UpstreamError(503, f"{url} refused", "prefill_unreachable", retryable=True)
        self.clock.now_s += self.took_s
        ttft_s = request.elapsed_s + self.took_s
        return PrefillAnswer(response(ttft_s=ttft_s), request.elapsed_s, url)

    def release(self, answer: PrefillAnswer) -> None:
        self.released.append(answer)


async def test_prefill_gets_the_class_slo_and_elapsed_and_is_judged_from_arrival() -> None:
    clock = Clock(100.6)  # the request arrived at 100.0: 0.6 s went by (tokenizing, queueing)
    metrics = GatewayMetrics()
    client = FakePrefill(clock, took_s=0.5)
    pool = InstancePool("prefill", ["http://p"], clock=clock)
    stage = PrefillStage(pool, client, metrics, clock, has_decode=True)
    answer = await stage.run(job(arrival_s=100.0, ttft_slo_ms=1000))
    _, sent, headers = client.sent[0]
    assert (sent.ttft_slo_s, sent.elapsed_s) == (1.0, pytest.approx(0.6))
    assert sent.hand_off_kv and sent.stream
    assert headers["x-slo-ttft-ms"] == "400"  # the budget left when sent
    assert headers["x-llm-d-slo-ttft-ms"] == "400"  # and under llm-d's current name
    assert headers["x-llm-d-inference-objective"] == headers["x-gateway-inference-objective"]
    assert answer.wait_s == pytest.approx(0.5)
    # 1.1 s from arrival > the class's 1 s: missed, though prefill took only 0.5 s.
    r = metrics.registry
    labels = {"slo_class": "chat"}
    assert (
        r.get_sample_value(
            "flowprefill_gateway_slo_requests_total", {**labels, "outcome": "missed"}
        )
        == 1
    )
    assert (
        r.get_sample_value("flowprefill_gateway_slo_requests_total", {**labels, "outcome": "met"})
        is None
    )
    assert r.get_sample_value("flowprefill_gateway_ttft_seconds_sum", labels) == pytest.approx(1.1)


async def test_a_refused_connection_is_tried_once_more_elsewhere() -> None:
    clock = Clock()
    pool = InstancePool(
        "prefill", ["http://a", "http://b", "http://c"], policy="round-robin", clock=clock
    )
    client = FakePrefill(clock, took_s=0.0, refuse=("http://a",))
    stage = PrefillStage(pool, client, GatewayMetrics(), clock, has_decode=False)
    answer = await stage.run(job(arrival_s=clock.now_s))
    urls = [url for url, _, _ in client.sent]
    assert urls[0] == "http://a" and len(urls) == 2 and urls[1] != "http://a"
    assert answer.prefill_url == urls[1]
    a = pool.instances[0]
    assert (a.healthy, a.consecutive_failures) == (False, 1)
    assert all(not i.in_flight for i in pool.instances)  # nothing left booked
    assert not client.sent[0][1].hand_off_kv  # no decode: no hand-off asked for


async def test_failover_gives_up_after_a_non_retryable_error_or_a_second_refusal() -> None:
    pool = InstancePool("decode", ["http://a", "http://b", "http://c"], policy=Router.ROUND_ROBIN)
    work = Placement("r", deadline_s=1.0, num_tokens=3)
    calls: list[str] = []

    async def failing(inst: Instance) -> None:
        calls.append(inst.url)
        raise UpstreamError(502, "died", "decode_failed")

    with pytest.raises(UpstreamError, match="died"):
        await failover_call(pool, work, failing)
    assert calls == ["http://a"]  # may have been processed: never tried twice

    async def refused(inst: Instance) -> None:
        calls.append(inst.url)
        raise UpstreamError(503, "refused", "decode_unreachable", retryable=True)

    calls.clear()
    with pytest.raises(UpstreamError, match="refused"):
        await failover_call(pool, work, refused)
    assert sorted(calls) == ["http://b", "http://c"]  # a is backing off; b, c refused
    with pytest.raises(NoHealthyInstanceError):  # all three back off now
        await failover_call(pool, work, refused)


class FakeDecode(DecodeClient):
    def __init__(self, fail: UpstreamError | None = None) -> None:
        self.fail = fail
        self.handoffs: list[HandoffRef | None] = []
        self.sampling: list[dict[str, Any]] = []

    async def stream(self, url: str, **kw: Any) -> AsyncGenerator[DecodeDelta, None]:
        self.handoffs.append(kw["handoff"])
        self.sampling.append(kw["sampling"])
        if self.fail is not None:
            raise self.fail
        yield DecodeDelta(" a")
        yield DecodeDelta(" b", "length")
        yield DecodeDelta("", None, 3)


async def _pieces(stage: DecodeStage, j: Job, answer: PrefillAnswer) -> list[Piece]:
    return [p async for p in stage.continuation(j, answer)]


async def test_decode_continues_and_the_handoff_is_released_once_decode_is_done() -> None:
    clock = Clock()
    prefill = FakePrefill(clock, 0.0)
    ref = HandoffRef("cmpl-1", 3)
    answer = PrefillAnswer(
        response(first=7).model_copy(update={"kv_transfer_params": ref.to_params()}),
        0.0,
        "http://p",
    )
    pool = InstancePool("decode", ["http://d"], policy="least-loaded", clock=clock)
    decode = FakeDecode()
    stage = DecodeStage(pool, decode, prefill, eos_token_ids={2}, clock=clock)
    j = job(arrival_s=clock.now_s)
    assert await _pieces(stage, j, answer) == [Piece(" a"), Piece(" b", "length")]
    assert decode.handoffs == [ref] and j.num_completion_tokens == 4
    assert prefill.released == [answer]  # finished there: nothing loads it again

    decode.fail = UpstreamError(400, "bad sampling", "decode_400")
    with pytest.raises(UpstreamError):
        await _pieces(stage, job(arrival_s=clock.now_s), answer)
    assert prefill.released == [answer, answer]  # decode refused it: nobody will load it

    eos = PrefillAnswer(response(first=2), 0.0, "http://p")
    assert await _pieces(stage, job(arrival_s=clock.now_s), eos) == [Piece("", "stop")]
    assert prefill.released[-1] is eos


def test_routing_policies_come_from_gateway_json(tmp_path: Path) -> None:
    from flowprefill.contracts import Endpoint, GatewayConfig
    from flowprefill.gateway.cli import build_state
    from flowprefill.models import named_model_dir

    (tmp_path / "slo.json").write_text(SLOTable.paper().model_dump_json())
    e = Endpoint.at("p", "h", 1)
    config = GatewayConfig(
        service="t",
        model_name="tiny",
        tokenizer_path=str(named_model_dir("tiny-llama", cache_dir=tmp_path / "models")),
        prefill=[e],
        decode=[e],
    )
    state = build_state(config, tmp_path / "slo.json")
    assert state.decode_pool is not None
    assert (state.prefill_pool.policy, state.decode_pool.policy) == (
        Router.SLACK_AWARE,
        Router.LEAST_LOADED,
    )
    config = GatewayConfig.model_validate(
        {**config.model_dump(), "prefill_routing": "round_robin", "decode_routing": "slack-aware"}
    )
    state = build_state(config, tmp_path / "slo.json")
    assert state.decode_pool is not None
    assert (state.prefill_pool.policy, state.decode_pool.policy) == (
        Router.ROUND_ROBIN,
        Router.SLACK_AWARE,
    )


def test_the_gateway_imports_no_torch_and_nothing_of_the_prefill_server() -> None:
    import subprocess
    import sys

    code = (
        "import sys, flowprefill.gateway.app, flowprefill.gateway.cli\n"
        "bad = [m for m in sys.modules if m in ('torch', 'transformers') or "
        "m.startswith(('flowprefill.prefill', 'flowprefill.kv'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


async def test_ignore_eos_continues_past_an_eos_first_token_and_reaches_decode() -> None:
    # vLLM's ignore_eos (vllm bench serve sends it with random prompts): the request runs
    # to max_tokens, so the gateway neither stops at an EOS first token nor drops the flag.
    clock = Clock()
    prefill = FakePrefill(clock, 0.0)
    pool = InstancePool("decode", ["http://d"], policy="least-loaded", clock=clock)
    decode = FakeDecode()
    stage = DecodeStage(pool, decode, prefill, eos_token_ids={2}, clock=clock)
    j = job(arrival_s=clock.now_s)
    j.body = CompletionRequest(model="m", prompt=[1, 2, 3], max_tokens=4, ignore_eos=True)
    eos = PrefillAnswer(response(first=2), 0.0, "http://p")
    assert await _pieces(stage, j, eos) == [Piece(" a"), Piece(" b", "length")]
    assert decode.sampling == [{"ignore_eos": True}]
    plain = CompletionRequest(model="m", prompt=[1], temperature=0.0)
    assert plain.decode_sampling() == {"temperature": 0.0}


class SlowPrefill(FakePrefill):
    """Takes ``took_s`` of real time (the gateway's deadline timer runs on the loop)."""

    async def prefill(
        self, url: str, request: PrefillRequest, headers: dict[str, str]
    ) -> PrefillAnswer:
        self.sent.append((url, request, headers))
        await asyncio.sleep(self.took_s)
        if url in self.refuse:
            raise UpstreamError(502, f"{url} failed", "prefill_failed")
        return PrefillAnswer(response(), 0.0, url)


def _slo_count(metrics: GatewayMetrics, outcome: str) -> float | None:
    return metrics.registry.get_sample_value(
        "flowprefill_gateway_slo_requests_total", {"slo_class": "chat", "outcome": outcome}
    )


async def test_a_request_still_waiting_at_its_deadline_is_counted_missed_then_and_once() -> None:
    clock = time.monotonic
    metrics = GatewayMetrics()
    pool = InstancePool("prefill", ["http://p"], clock=clock)
    stage = PrefillStage(pool, SlowPrefill(Clock(), took_s=1.0), metrics, clock, has_decode=False)
    running = asyncio.create_task(stage.run(job(arrival_s=clock(), ttft_slo_ms=100)))
    await asyncio.sleep(0.5)  # past the 100 ms deadline, prefill still running
    assert _slo_count(metrics, "missed") == 1 and not running.done()
    await running
    assert _slo_count(metrics, "missed") == 1 and _slo_count(metrics, "met") is None
    ttft = metrics.registry.get_sample_value(
        "flowprefill_gateway_ttft_seconds_count", {"slo_class": "chat"}
    )
    assert ttft == 1  # its TTFT is still observed, once


async def test_a_request_that_fails_before_its_deadline_is_not_counted() -> None:
    clock = time.monotonic
    metrics = GatewayMetrics()
    pool = InstancePool("prefill", ["http://p"], clock=clock)
    client = SlowPrefill(Clock(), took_s=0.05, refuse=("http://p",))
    stage = PrefillStage(pool, client, metrics, clock, has_decode=False)
    with pytest.raises(UpstreamError):
        await stage.run(job(arrival_s=clock(), ttft_slo_ms=400))
    await asyncio.sleep(0.5)  # the deadline passes: the timer was cancelled with it
    assert _slo_count(metrics, "missed") is None and _slo_count(metrics, "met") is None
