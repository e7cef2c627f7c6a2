"""What a prefill instance reports as its backlog (flowprefill.prefill.server.load)."""

from __future__ import annotations

import pytest

from flowprefill.contracts.prefill_api import PrefillLoad
from flowprefill.prefill.request import Request, Task
from flowprefill.prefill.scheduler.batching import get_batching
from flowprefill.prefill.scheduler.core import Scheduler
from flowprefill.prefill.server.load import backlog


def P(n: int) -> float:
    return 0.01 + n / 1000.0


def req(rid: str, tokens: int) -> Request:
    return Request.create(rid, arrival_s=0.0, ttft_slo_s=1.0, num_tokens=tokens)


def test_idle_engine_reports_nothing_queued() -> None:
    sched = Scheduler(predict_s=P, batching=get_batching("none"))
    assert backlog(sched) == PrefillLoad(backlog_tokens=0, queue_delay_s=0.0, num_requests=0)


def test_backlog_counts_waiting_parked_and_the_rest_of_the_running_task() -> None:
    sched = Scheduler(predict_s=P, batching=get_batching("none"))
    sched.add(req("w", 300))
    parked = Task([req("p1", 200), req("p2", 200)], progress=0.5)  # 200 tokens left
    running = Task([req("r", 1000)], progress=0.9)  # 100 left
    sched.preempted[parked.task_id] = parked
    sched.running = running
    load = backlog(sched)
    assert (load.backlog_tokens, load.num_requests) == (600, 4)
    assert load.queue_delay_s == pytest.approx(P(600))  # the engine's own predictor
