"""Overload bounds without HTTP (docs/gateway.md, "Overload"): a non-sheddable request
predicted past its deadline plus its useful wait is refused (503 ``too_late``), one still
waiting then is abandoned (503 ``expired``), and no more than ``max_waiting`` requests
wait for their first token (503 ``queue_full``); every 503 carries ``Retry-After`` and is
counted per class and reason."""

from __future__ import annotations

import asyncio

import pytest

from flowprefill.contracts.gateway import GatewayConfig, OverloadSettings
from flowprefill.contracts.prefill_api import PrefillRequest
from flowprefill.gateway.admission import Accept, Estimate, Refuse, decide
from flowprefill.gateway.errors import OverloadError, ShedError
from flowprefill.gateway.metrics import GatewayMetrics
from flowprefill.gateway.prefill import PrefillStage
from flowprefill.gateway.routing import Admitted, InstancePool, Placement
from flowprefill.gateway.upstream import PrefillAnswer
from tests.gateway.test_admission import Clock, P, Prefill, job


def test_useful_wait_is_a_multiple_of_the_target_with_a_floor() -> None:
    s = OverloadSettings()
    assert (s.useful_wait_factor, s.useful_wait_floor_s, s.max_waiting) == (1.0, 1.0, 10_000)
    assert s.useful_wait_s(5.0) == 5.0  # served by twice its target at worst
    assert s.useful_wait_s(0.2) == 1.0  # a tight target still gets the floor
    tuned = OverloadSettings(useful_wait_factor=3, useful_wait_floor_s=0.5)
    assert tuned.useful_wait_s(0.1) == 0.5 and tuned.useful_wait_s(2.0) == 6.0


def test_gateway_json_carries_the_overload_settings() -> None:
    base = {"service": "s", "model_name": "m", "prefill": [], "decode": []}
    assert GatewayConfig.model_validate(base).overload == OverloadSettings()
    cfg = GatewayConfig.model_validate(base | {"overload": {"max_waiting": 64}})
    assert cfg.overload.max_waiting == 64
    with pytest.raises(ValueError):
        GatewayConfig.model_validate(base | {"overload": {"max_waiting": 0}})


def test_non_sheddable_is_refused_only_past_its_useful_wait() -> None:
    late, later = Estimate(0, 11.5), Estimate(1, 13.0)
    # Late but within deadline 10 + useful wait 2: served late, on the routed instance.
    assert decide(
        sheddable=False, deadline_s=10.0, estimates=[late, later], preferred=0, useful_wait_s=2.0
    ) == Accept(0)
    # The routed instance is past the limit, another is not: rerouted.
    assert decide(
        sheddable=False, deadline_s=10.0, estimates=[late, later], preferred=1, useful_wait_s=2.0
    ) == Accept(0, rerouted=True)
    # Both past it: refused as overloaded (not shed), retry when the best would fit.
    refused = decide(
        sheddable=False, deadline_s=10.0, estimates=[late, later], preferred=0, useful_wait_s=0.4
    )
    assert refused == Refuse(retry_after_s=2.0, best_finish_s=11.5, shed=False)
    # A sheddable request's limit stays its deadline, whatever the useful wait.
    shed = decide(sheddable=True, deadline_s=10.0, estimates=[late], preferred=0, useful_wait_s=5.0)
    assert isinstance(shed, Refuse) and shed.shed
    # Without a useful wait (the default) a non-sheddable request is never refused.
    assert decide(sheddable=False, deadline_s=0.0, estimates=[later], preferred=1) == Accept(1)
    with pytest.raises(ValueError):
        decide(sheddable=False, deadline_s=0, estimates=[late], preferred=0, useful_wait_s=-1)


def pool_of(n: int, clock: Clock, overload: OverloadSettings) -> InstancePool:
    return InstancePool(
        "prefill",
        [f"http://i{k}" for k in range(n)],
        policy="slack-aware",
        predict_s=P,
        clock=clock,
        overload=overload,
    )


def sample(metrics: GatewayMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


async def test_stage_refuses_a_non_sheddable_request_too_late_to_be_useful() -> None:
    clock = Clock(100.0)
    pool = pool_of(2, clock, OverloadSettings(useful_wait_factor=1, useful_wait_floor_s=0.5))
    for k, inst in enumerate(pool.instances):
        for j in range(4):
            pool.begin(inst, f"g{k}{j}", 100.95, 900)  # 3.6 s due before ours, each feasible
    metrics, client = GatewayMetrics(), Prefill()
    stage = PrefillStage(pool, client, metrics, clock, has_decode=False)
    with pytest.raises(OverloadError) as refused:
        await stage.run(job(5, arrival_s=100.0))  # 1 s target: limit 102, predicted 103.7
    err = refused.value
    assert (err.status, err.reason, err.slo_class) == (503, "too_late", "chat")
    assert err.headers["retry-after"] == "2" and err.type_ == "service_unavailable"
    assert "useful wait" in str(err) and "'chat'" in str(err)
    assert client.sent == []  # nothing went upstream
    assert sample(metrics, "flowprefill_gateway_overload_refused_total", slo_class="chat",
                  reason="too_late") == 1  # fmt: skip
    # Under the same load a sheddable request is shed (429), not refused as overloaded.
    with pytest.raises(ShedError):
        await stage.run(job(-1, arrival_s=100.0, rid="cmpl-2"))
    # A looser target's useful wait covers it: served, late.
    await stage.run(job(5, arrival_s=100.0, slo_ms=2000, rid="cmpl-3"))
    assert len(client.sent) == 1


class Hanging(Prefill):
    """Never answers until ``go`` is set; records the requests it saw cancelled."""

    def __init__(self) -> None:
        super().__init__()
        self.go = asyncio.Event()
        self.cancelled: list[str] = []

    async def prefill(
        self, url: str, request: PrefillRequest, headers: dict[str, str]
    ) -> PrefillAnswer:
        try:
            await self.go.wait()
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise
        return await super().prefill(url, request, headers)


async def test_no_more_than_max_waiting_requests_wait_for_their_first_token() -> None:
    clock = Clock(100.0)
    pool = pool_of(1, clock, OverloadSettings(max_waiting=2, useful_wait_floor_s=60))
    metrics, client = GatewayMetrics(), Hanging()
    stage = PrefillStage(pool, client, metrics, clock, has_decode=False)
    held = [asyncio.create_task(stage.run(job(5, arrival_s=100.0, rid=f"w{k}"))) for k in (0, 1)]
    await asyncio.sleep(0.01)
    assert stage.waiting == 2
    assert sample(metrics, "flowprefill_gateway_waiting_requests") == 2
    for priority in (5, -1):  # whatever its class
        with pytest.raises(OverloadError) as full:
            await stage.run(job(priority, arrival_s=100.0, rid="over"))
        assert (full.value.status, full.value.reason) == (503, "queue_full")
        assert int(full.value.headers["retry-after"]) >= 1
    client.go.set()
    await asyncio.gather(*held)
    assert stage.waiting == 0
    assert sample(metrics, "flowprefill_gateway_waiting_requests") == 0
    assert sample(metrics, "flowprefill_gateway_waiting_requests_max") == 2
    for cls in ("chat", "batch"):
        assert sample(metrics, "flowprefill_gateway_overload_refused_total", slo_class=cls,
                      reason="queue_full") == 1  # fmt: skip
    await stage.run(job(5, arrival_s=100.0, rid="after"))  # room again


async def test_a_request_still_waiting_past_its_useful_wait_is_abandoned() -> None:
    clock = Clock(100.0)  # the timer runs on the loop; the clock only says when it started
    overload = OverloadSettings(useful_wait_factor=0, useful_wait_floor_s=0.05)
    pool = pool_of(1, clock, overload)
    metrics, client = GatewayMetrics(), Hanging()
    stage = PrefillStage(pool, client, metrics, clock, has_decode=False)
    started = asyncio.get_running_loop().time()
    with pytest.raises(OverloadError) as expired:
        await stage.run(job(5, arrival_s=100.0, slo_ms=50, rid="slow"))
    waited = asyncio.get_running_loop().time() - started
    assert 0.09 <= waited < 1.0  # its deadline (50 ms) plus its useful wait (50 ms)
    assert (expired.value.status, expired.value.reason) == (503, "expired")
    assert "abandoned" in str(expired.value) and expired.value.headers["retry-after"] == "1"
    assert client.cancelled == ["slow"]  # the upstream call was cancelled, not left running
    assert stage.waiting == 0 and pool.instances[0].in_flight == {}
    assert sample(metrics, "flowprefill_gateway_overload_refused_total", slo_class="chat",
                  reason="expired") == 1  # fmt: skip
    # Counted missed at its deadline, and no first token recorded.
    assert sample(metrics, "flowprefill_gateway_slo_requests_total", slo_class="chat",
                  outcome="missed") == 1  # fmt: skip
    assert sample(metrics, "flowprefill_gateway_ttft_seconds_count", slo_class="chat") is None


def test_pool_admission_refuses_non_sheddable_only_with_a_finite_useful_wait() -> None:
    clock = Clock(100.0)
    pool = pool_of(1, clock, OverloadSettings())
    for k in range(3):
        pool.begin(pool.instances[0], f"g{k}", 100.49, 400)  # each feasible, 1.2 s in all
    work = Placement("r", 100.5, 100)  # predicted 101.3
    assert pool.admit(work, sheddable=False) == Admitted("r", pool.instances[0])
    assert isinstance(pool.admit(work, sheddable=False, useful_wait_s=0.5), Refuse)
    assert pool.admit(work, sheddable=False, useful_wait_s=0.9) == Admitted("r", pool.instances[0])
