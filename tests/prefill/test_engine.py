"""The engine's threads (scheduler loop + execution pool + preemption protocol) end to end.

The backend here is a stand-in for the model: it walks through a fixed number of
checkpoints per token block, sleeping between them, so timings are controlled. The real
model executor is exercised with the same engine in tests/prefill/executor.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import NoReturn

import pytest

from flowprefill.errors import EngineClosedError, InvalidRequestError, TaskCancelledError
from flowprefill.prefill.engine import PrefillEngine
from flowprefill.prefill.executor.context import checkpoint
from flowprefill.prefill.executor.preemption import TaskControl
from flowprefill.prefill.predictor.model import TTFTPredictor
from flowprefill.prefill.scheduler.core import SchedulerOutput

OP_S = 0.002  # one "operator"
TOKENS_PER_OP = 50


class SteppedBackend:
    """Prefill stand-in: one checkpointed step per TOKENS_PER_OP tokens of the batch."""

    max_prompt_tokens = 100_000

    def __init__(self) -> None:
        self.order: list[tuple[str, tuple[int, ...]]] = []

    def validate(self, prompts: Sequence[Sequence[int]]) -> None:
        if any(t < 0 for p in prompts for t in p):
            raise InvalidRequestError("negative token id")

    def run(self, prompts: Sequence[Sequence[int]], control: TaskControl) -> list[int]:
        key = tuple(p[0] for p in prompts)
        self.order.append(("start", key))
        steps = max(1, sum(len(p) for p in prompts) // TOKENS_PER_OP)
        control.num_checkpoints_expected = steps
        for _ in range(steps):
            time.sleep(OP_S)
            checkpoint()
        self.order.append(("end", key))
        return [p[0] * 10 for p in prompts]


PREDICTOR = TTFTPredictor.linear(per_token_s=OP_S / TOKENS_PER_OP)


def prompt(tag: int, n: int) -> list[int]:
    return [tag] * n


def test_urgent_request_preempts_long_one_and_both_finish() -> None:
    backend = SteppedBackend()
    with PrefillEngine(backend, PREDICTOR, batching="none") as eng:
        long_f = eng.submit(prompt(1, 10_000), ttft_slo_s=10.0, slo_class="file")  # ~0.4 s
        time.sleep(0.05)
        short_f = eng.submit(prompt(2, 100), ttft_slo_s=0.2, slo_class="chat")
        short = short_f.result(timeout=10)
        long = long_f.result(timeout=10)
    assert short.output == 20 and long.output == 10
    assert short.met_slo
    assert long.num_preemptions == 1
    # The short one started and ended while the long one was parked.
    assert backend.order == [
        ("start", (1,)),
        ("start", (2,)),
        ("end", (2,)),
        ("end", (1,)),
    ]
    assert len(eng.blocking_times_s) == 1
    assert eng.blocking_times_s[0] < 0.25  # bounded by one step, not the whole prefill
    assert eng.scheduler.stats.num_rounds >= 4


def test_fcfs_does_not_preempt() -> None:
    backend = SteppedBackend()
    with PrefillEngine(backend, PREDICTOR, policy="fcfs", batching="none") as eng:
        a = eng.submit(prompt(1, 5_000), ttft_slo_s=10.0)
        time.sleep(0.03)
        b = eng.submit(prompt(2, 100), ttft_slo_s=0.05)
        assert not b.result(timeout=10).met_slo
        assert a.result(timeout=10).num_preemptions == 0
    assert backend.order[:2] == [("start", (1,)), ("end", (1,))]


def test_queued_short_requests_are_batched() -> None:
    backend = SteppedBackend()
    with PrefillEngine(backend, PREDICTOR, token_budget=4096) as eng:
        blocker = eng.submit(prompt(9, 3000), ttft_slo_s=30.0)
        time.sleep(0.02)
        futs = [eng.submit(prompt(i, 200), ttft_slo_s=5.0) for i in range(3)]
        results = [f.result(timeout=10) for f in futs]
        blocker.result(timeout=10)
    assert {r.batch_size for r in results} == {3}
    assert [r.output for r in results] == [0, 10, 20]


def test_cancel_waiting_and_running_requests() -> None:
    backend = SteppedBackend()
    with PrefillEngine(backend, PREDICTOR, batching="none") as eng:
        running = eng.submit(prompt(1, 20_000), ttft_slo_s=30.0, request_id="run")
        waiting = eng.submit(prompt(2, 20_000), ttft_slo_s=60.0, request_id="wait")
        time.sleep(0.05)
        eng.cancel("wait")
        eng.cancel("run")
        with pytest.raises(TaskCancelledError):
            waiting.result(timeout=5)
        with pytest.raises(TaskCancelledError):
            running.result(timeout=5)
        ok = eng.submit(prompt(3, 100), ttft_slo_s=1.0)
        assert ok.result(timeout=5).output == 30
        assert eng.pool.num_tasks == 0


def test_backend_error_fails_only_its_requests() -> None:
    class Flaky(SteppedBackend):
        def run(self, prompts: Sequence[Sequence[int]], control: TaskControl) -> list[int]:
            if prompts[0][0] == 13:
                raise RuntimeError("device fell over")
            return super().run(prompts, control)

    with PrefillEngine(Flaky(), PREDICTOR, batching="none") as eng:
        bad = eng.submit(prompt(13, 100), ttft_slo_s=1.0)
        with pytest.raises(RuntimeError, match="device fell over"):
            bad.result(timeout=5)
        assert eng.submit(prompt(4, 100), ttft_slo_s=1.0).result(timeout=5).output == 40


def test_bad_requests_and_closed_engine() -> None:
    eng = PrefillEngine(SteppedBackend(), PREDICTOR).start()
    with pytest.raises(InvalidRequestError, match="empty"):
        eng.submit([], ttft_slo_s=1.0)
    with pytest.raises(InvalidRequestError, match="context"):
        eng.submit(prompt(1, 200_000), ttft_slo_s=1.0)
    with pytest.raises(InvalidRequestError, match="positive"):
        eng.submit(prompt(1, 10), ttft_slo_s=-1.0)
    with pytest.raises(InvalidRequestError, match="negative token id"):
        eng.submit([1, -3], ttft_slo_s=1.0)
    eng.submit(prompt(1, 10), ttft_slo_s=1.0, request_id="same")
    with pytest.raises(InvalidRequestError, match="already in flight"):
        eng.submit(prompt(1, 10), ttft_slo_s=1.0, request_id="same")
    eng.close()
    with pytest.raises(EngineClosedError):
        eng.submit(prompt(1, 10), ttft_slo_s=1.0)


def test_close_without_drain_answers_every_caller() -> None:
    eng = PrefillEngine(SteppedBackend(), PREDICTOR, batching="none").start()
    futs = [eng.submit(prompt(i, 5_000), ttft_slo_s=30.0) for i in range(3)]
    time.sleep(0.02)
    eng.close(drain=False)
    for f in futs:
        assert f.done()
        assert f.exception() is not None


def test_metrics_are_exported() -> None:
    from prometheus_client import generate_latest

    with PrefillEngine(SteppedBackend(), PREDICTOR, batching="none") as eng:
        long_f = eng.submit(prompt(1, 10_000), ttft_slo_s=10.0, slo_class="file")
        time.sleep(0.03)
        eng.submit(prompt(2, 100), ttft_slo_s=0.5, slo_class="chat").result(timeout=5)
        long_f.result(timeout=5)
    text = generate_latest(eng.metrics.registry).decode()
    assert "flowprefill_prefill_preemptions_total 1.0" in text
    assert 'flowprefill_prefill_ttft_seconds_count{slo_class="chat"} 1.0' in text
    assert "flowprefill_prefill_preemption_blocking_seconds_count 1.0" in text
    assert "flowprefill_prefill_preemption_handoff_seconds_count 1.0" in text
    (outcome,) = eng.preemptions
    assert outcome.parked and 0 <= outcome.handoff_s <= outcome.blocking_s
    assert 'flowprefill_prefill_requests_total{outcome="met",slo_class="chat"} 1.0' in text


# The scheduler thread dies of the injected bug by design; the test checks what callers see.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_scheduler_crash_fails_waiting_callers_instead_of_hanging(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    eng = PrefillEngine(SteppedBackend(), PREDICTOR, batching="none").start()
    long_f = eng.submit(prompt(1, 10_000), ttft_slo_s=30.0)
    time.sleep(0.02)

    def broken(now_s: float) -> NoReturn:
        raise RuntimeError("bug in a round")

    monkeypatch.setattr(eng.scheduler, "schedule", broken)
    short_f = eng.submit(prompt(2, 100), ttft_slo_s=1.0)
    with pytest.raises(RuntimeError, match="prefill scheduler failed"):
        short_f.result(timeout=5)
    with pytest.raises(RuntimeError, match="prefill scheduler failed"):
        long_f.result(timeout=5)
    with pytest.raises(EngineClosedError):
        eng.submit(prompt(3, 10), ttft_slo_s=1.0)
    eng.close(drain=False)


def test_rounds_see_the_running_tasks_progress() -> None:
    seen: list[float] = []
    with PrefillEngine(SteppedBackend(), PREDICTOR, batching="none") as eng:
        original = eng.scheduler.schedule

        def spy(now_s: float) -> SchedulerOutput:
            if eng.scheduler.running is not None:
                seen.append(eng.scheduler.running.progress)
            return original(now_s)

        eng.scheduler.schedule = spy  # type: ignore[method-assign]
        long_f = eng.submit(prompt(1, 10_000), ttft_slo_s=30.0)  # ~0.4 s, 200 checkpoints
        time.sleep(0.2)
        eng.submit(prompt(2, 100), ttft_slo_s=60.0).result(timeout=10)  # a round mid-way
        assert long_f.result(timeout=10).output == 10
    # The arrival's round ranked the long task with how far it really got (about half).
    assert seen and 0.1 < seen[0] < 0.95


def test_met_slo_is_the_class_slo_from_the_gateway_arrival() -> None:
    """``elapsed_s`` moves the arrival back; the class SLO, not the budget left, is judged.

    ``late`` spent 0.6 s before reaching the engine against a 0.5 s class SLO: from the
    engine's own arrival it would be met, from the gateway's it is missed. ``early`` spent
    0.3 s: met, with a TTFT that includes those 0.3 s and the class SLO (not the 0.2 s
    left) in its result.
    """
    from prometheus_client import generate_latest

    clock = time.monotonic
    with PrefillEngine(SteppedBackend(), PREDICTOR, batching="none", clock=clock) as eng:
        t0 = clock()
        late = eng.submit(prompt(1, 100), ttft_slo_s=0.5, elapsed_s=0.6, slo_class="chat")
        late_res = late.result(timeout=5)
        early = eng.submit(prompt(2, 100), ttft_slo_s=0.5, elapsed_s=0.3, slo_class="image")
        early_res = early.result(timeout=5)
        with pytest.raises(InvalidRequestError, match="elapsed_s"):
            eng.submit(prompt(3, 10), ttft_slo_s=0.5, elapsed_s=-0.1)
    assert late_res.arrival_s <= t0 - 0.6 + 0.05
    assert late_res.ttft_slo_s == 0.5 and late_res.ttft_s >= 0.6
    assert not late_res.met_slo
    assert early_res.ttft_slo_s == 0.5 and 0.3 <= early_res.ttft_s < 0.5
    assert early_res.met_slo
    text = generate_latest(eng.metrics.registry).decode()
    assert 'flowprefill_prefill_requests_total{outcome="missed",slo_class="chat"} 1.0' in text
    assert 'flowprefill_prefill_requests_total{outcome="met",slo_class="image"} 1.0' in text
    assert 'flowprefill_prefill_ttft_seconds_bucket{le="0.5",slo_class="chat"} 0.0' in text


def test_blocking_history_is_bounded() -> None:
    from flowprefill.prefill.engine import BLOCKING_HISTORY
    from flowprefill.prefill.scheduler.round import PreemptOutcome

    eng = PrefillEngine(SteppedBackend(), PREDICTOR)
    eng.preemptions.extend(PreemptOutcome(True, float(i)) for i in range(BLOCKING_HISTORY + 5))
    assert len(eng.blocking_times_s) == BLOCKING_HISTORY
    assert eng.blocking_times_s[-1] == BLOCKING_HISTORY + 4


def test_a_cancelled_running_request_is_counted_under_its_class() -> None:
    from prometheus_client import generate_latest

    with PrefillEngine(SteppedBackend(), PREDICTOR, batching="none") as eng:
        fut = eng.submit(prompt(1, 20_000), ttft_slo_s=30.0, slo_class="file", request_id="r")
        time.sleep(0.03)
        eng.cancel("r")
        with pytest.raises(TaskCancelledError):
            fut.result(timeout=5)
    text = generate_latest(eng.metrics.registry).decode()
    assert 'flowprefill_prefill_requests_total{outcome="cancelled",slo_class="file"} 1.0' in text
