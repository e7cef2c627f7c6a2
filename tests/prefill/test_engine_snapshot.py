"""The snapshot the engine's scheduler thread publishes after each round, for other threads."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence

import pytest

from flowprefill.prefill.engine import EngineSnapshot, PrefillEngine, take_snapshot
from flowprefill.prefill.executor.context import checkpoint
from flowprefill.prefill.executor.preemption import TaskControl
from flowprefill.prefill.request import Request, Task
from flowprefill.prefill.scheduler.batching import get_batching
from flowprefill.prefill.scheduler.core import Scheduler
from tests.prefill.test_engine import PREDICTOR, SteppedBackend, prompt


def P(n: int) -> float:
    return 0.01 + n / 1000.0


def req(rid: str, tokens: int) -> Request:
    return Request.create(rid, arrival_s=0.0, ttft_slo_s=1.0, num_tokens=tokens)


def wait_for(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def test_an_idle_scheduler_holds_nothing() -> None:
    snap = take_snapshot(Scheduler(predict_s=P), running=True)
    assert snap == EngineSnapshot(running=True, backlog_tokens=0, queue_delay_s=0.0, num_requests=0)


def test_backlog_counts_waiting_parked_and_the_rest_of_the_running_task() -> None:
    sched = Scheduler(predict_s=P, batching=get_batching("none"))
    sched.add(req("w", 300))
    parked = Task([req("p1", 200), req("p2", 200)], progress=0.5)  # 200 tokens left
    running = Task([req("r", 1000)], progress=0.9)  # 100 left
    sched.preempted[parked.task_id] = parked
    sched.running = running
    snap = take_snapshot(sched, running=True)
    assert (snap.backlog_tokens, snap.num_requests) == (600, 4)
    assert snap.queue_delay_s == pytest.approx(P(600))  # the engine's own predictor
    assert snap.load.model_dump() == {
        "backlog_tokens": 600,
        "queue_delay_s": pytest.approx(P(600)),
        "num_requests": 4,
    }


class GatedBackend(SteppedBackend):
    """Runs nothing until ``gate`` opens, so the backlog holds still for the test."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def run(self, prompts: Sequence[Sequence[int]], control: TaskControl) -> list[int]:
        while not self.gate.wait(0.001):
            checkpoint()
        return super().run(prompts, control)


def test_each_round_publishes_a_new_snapshot_and_never_changes_a_published_one() -> None:
    backend = GatedBackend()
    eng = PrefillEngine(backend, PREDICTOR, batching="none")
    assert not eng.snapshot.running
    with eng:
        assert eng.snapshot.running
        first = eng.submit(prompt(1, 500), ttft_slo_s=30.0)
        wait_for(lambda: eng.snapshot.num_requests == 1)
        held = eng.snapshot
        second = eng.submit(prompt(2, 300), ttft_slo_s=30.0)
        wait_for(lambda: eng.snapshot.num_requests == 2)
        assert eng.snapshot is not held
        assert eng.snapshot.backlog_tokens == 800
        # What a reader holds stays as published, and cannot be changed.
        assert (held.num_requests, held.backlog_tokens) == (1, 500)
        with pytest.raises(dataclasses.FrozenInstanceError):
            held.num_requests = 5
        backend.gate.set()
        first.result(timeout=10)
        second.result(timeout=10)
        # Published before the futures resolved: a woken caller sees its request gone.
        assert eng.snapshot.num_requests == 0 and eng.snapshot.backlog_tokens == 0
    assert not eng.snapshot.running


# The scheduler thread dies of the injected bug by design.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_crashed_loop_publishes_that_it_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    eng = PrefillEngine(SteppedBackend(), PREDICTOR).start()

    def broken(now_s: float) -> None:
        raise RuntimeError("bug")

    monkeypatch.setattr(eng.scheduler, "schedule", broken)
    with pytest.raises(RuntimeError, match="prefill scheduler failed"):
        eng.submit(prompt(1, 50), ttft_slo_s=5.0).result(timeout=10)
    wait_for(lambda: not eng.snapshot.running)
    eng.close(drain=False)
