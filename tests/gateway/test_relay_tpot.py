"""The gateway's TPOT histogram (the operator sizes decode pools from it): one sample per
request decode continued, (last token - first token) / (tokens - 1), streamed or not."""

from __future__ import annotations

from collections.abc import AsyncGenerator

import pytest

from flowprefill.contracts.metrics import GATEWAY_TPOT
from flowprefill.gateway.classify import Job
from flowprefill.gateway.decode import Piece
from flowprefill.gateway.metrics import GatewayMetrics
from flowprefill.gateway.relay import Relay
from tests.gateway.test_pipeline import Clock, job


async def decoded(j: Job, clock: Clock, num_more: int, step_s: float) -> AsyncGenerator[Piece]:
    """``num_more`` tokens after the first, ``step_s`` apart; decode's usage at the end."""
    for i in range(num_more):
        clock.now_s += step_s
        yield Piece("x", "length" if i == num_more - 1 else None)
    j.num_completion_tokens = 1 + num_more


def tpot(metrics: GatewayMetrics, suffix: str) -> float | None:
    return metrics.registry.get_sample_value(f"{GATEWAY_TPOT}_{suffix}", {"slo_class": "chat"})


@pytest.mark.parametrize("stream", [True, False])
async def test_one_tpot_sample_per_decoded_request(stream: bool) -> None:
    clock, metrics = Clock(), GatewayMetrics()
    relay = Relay("m", metrics, clock)
    j = job(arrival_s=clock.now_s, max_tokens=5)
    pieces = decoded(j, clock, num_more=4, step_s=0.025)
    if stream:
        [event async for event in relay.stream(j, "a", pieces)]
    else:
        await relay.collect(j, "a", pieces)
    assert tpot(metrics, "count") == 1
    assert tpot(metrics, "sum") == pytest.approx(0.025)

    def bucket(le: str) -> float | None:
        return metrics.registry.get_sample_value(
            f"{GATEWAY_TPOT}_bucket", {"slo_class": "chat", "le": le}
        )

    assert (bucket("0.02"), bucket("0.03")) == (0, 1)


async def test_no_sample_without_a_decoded_token() -> None:
    clock, metrics = Clock(), GatewayMetrics()
    j = job(arrival_s=clock.now_s, max_tokens=1)
    await Relay("m", metrics, clock).collect(j, "a", decoded(j, clock, num_more=0, step_s=0.0))
    assert tpot(metrics, "count") is None
