"""run_round: events in order, one schedule, commands applied in order, a RoundOutput."""

from __future__ import annotations

from flowprefill.prefill.request import Request, RequestState, Task
from flowprefill.prefill.scheduler.batching import get_batching
from flowprefill.prefill.scheduler.core import Scheduler
from flowprefill.prefill.scheduler.round import (
    Arrival,
    Cancel,
    Completion,
    PreemptOutcome,
    Stop,
    run_round,
)


class FakePool:
    """Records the commands it is given; progress is whatever the test sets."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str]]] = []
        self.progress_of: dict[int, float] = {}
        self.held_of: dict[int, int] = {}

    def _log(self, name: str, task: Task) -> None:
        self.calls.append((name, [r.request_id for r in task.requests]))

    def submit(self, task: Task) -> None:
        self._log("submit", task)

    def preempt(self, task: Task) -> PreemptOutcome:
        self._log("preempt", task)
        return PreemptOutcome(True, 0.001)

    def resume(self, task: Task) -> None:
        self._log("resume", task)

    def cancel(self, task: Task) -> None:
        self._log("cancel", task)

    def release(self, task: Task) -> None:
        self._log("release", task)

    def progress(self, task: Task) -> float:
        return self.progress_of.get(task.task_id, 0.0)

    def held_bytes(self, task: Task) -> int | None:
        return self.held_of.get(task.task_id)


def req(rid: str, tokens: int, arrival: float, slo: float, cls: str = "x") -> Request:
    return Request.create(rid, arrival_s=arrival, ttft_slo_s=slo, num_tokens=tokens, slo_class=cls)


def scheduler() -> Scheduler:
    return Scheduler(predict_s=lambda n: n / 1000.0, batching=get_batching("none"))


def test_preempt_then_submit_in_order_with_the_outcome() -> None:
    s, pool = scheduler(), FakePool()
    run_round(s, pool, [Arrival(req("A", 1000, 1.0, 10.0))], 1.0)
    out = run_round(s, pool, [Arrival(req("B", 100, 1.2, 0.5))], 1.2)
    assert pool.calls == [("submit", ["A"]), ("preempt", ["A"]), ("submit", ["B"])]
    assert [p.task.leader.request_id for p in out.preempted] == ["A"]
    assert out.preempted[0].outcome.blocking_s == 0.001
    assert out.scheduled is not None and out.scheduled.round_index == 2


def test_completion_is_applied_and_released_before_the_round() -> None:
    s, pool = scheduler(), FakePool()
    run_round(s, pool, [Arrival(req("A", 100, 0.0, 1.0))], 0.0)
    task = s.running
    assert task is not None
    out = run_round(s, pool, [Completion(task, ["tok"], None)], 0.1)
    assert [c.task for c in out.completed] == [task]
    assert task.leader.state is RequestState.FINISHED and task.leader.finish_s == 0.1
    assert pool.calls[-1] == ("release", ["A"])


def test_a_round_refreshes_the_running_tasks_progress_from_the_pool() -> None:
    s, pool = scheduler(), FakePool()
    run_round(s, pool, [Arrival(req("A", 1000, 0.0, 10.0))], 0.0)
    assert s.running is not None and s.running.progress == 0.0
    pool.progress_of[s.running.task_id] = 0.5
    run_round(s, pool, [Arrival(req("B", 10, 0.5, 60.0))], 0.5)
    assert s.running.progress == 0.5


def test_cancel_names_the_request_and_stops_an_emptied_task() -> None:
    s, pool = scheduler(), FakePool()
    run_round(s, pool, [Arrival(req("A", 1000, 0.0, 10.0, cls="file"))], 0.0)
    out = run_round(s, pool, [Cancel("A"), Cancel("nobody")], 0.1)
    assert [(c.request_id, c.request and c.request.slo_class) for c in out.cancelled] == [
        ("A", "file"),
        ("nobody", None),
    ]
    assert ("cancel", ["A"]) in pool.calls


def test_stop_applies_the_other_events_and_schedules_nothing() -> None:
    s, pool = scheduler(), FakePool()
    run_round(s, pool, [Arrival(req("A", 100, 0.0, 1.0))], 0.0)
    task = s.running
    assert task is not None
    out = run_round(
        s, pool, [Completion(task, ["t"], None), Stop(), Arrival(req("B", 1, 0.1, 1))], 0.1
    )
    assert out.stopped and out.commands == []
    assert out.completed and "B" in s.waiting  # applied, never scheduled
    assert s.stats.num_rounds == 1


def test_a_refused_arrival_is_shed_not_queued() -> None:
    s, pool = scheduler(), FakePool()
    out = run_round(
        s,
        pool,
        [Arrival(req("A", 100, 0.0, 1.0)), Arrival(req("B", 100, 0.0, 1.0))],
        0.0,
        admit=lambda r, sched, now: r.request_id != "B",
    )
    assert [r.request_id for r in out.shed] == ["B"]
    assert out.shed[0].state is RequestState.CANCELLED
    assert pool.calls == [("submit", ["A"])]
