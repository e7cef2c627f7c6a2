"""Randomised preemption storms on a two-rank instance.

Hypothesis draws a sequence of tasks and what happens to the running one after a random
number of checkpoints (preempted by the next task, cancelled, or left to finish), with
parked tasks sometimes cancelled, then resumes everything left in LIFO order. Checked:
no rank ever parks a task at a different checkpoint than another, every task reached
every rank exactly once, finished tasks are bit-identical to their solo runs, cancelled
ones stop on every rank, and nothing hangs (every wait is bounded).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flowprefill.errors import TaskCancelledError
from flowprefill.prefill.executor.preemption import TaskControl
from flowprefill.prefill.tp.prefill_backend import TPPrefillBackend
from tests.prefill.tp.conftest import tp_config
from tests.prefill.tp.harness import Task, assert_same, prompts, ranks_agree

ACTIONS = ("preempt", "preempt", "cancel", "finish", "cancel-parked")

Step = tuple[int, int, str]


@pytest.fixture(scope="module")
def llama_tp2() -> Iterator[TPPrefillBackend]:
    backend = TPPrefillBackend(tp_config("llama"))
    yield backend
    backend.close()


def _finish(task: Task) -> str:
    try:
        task.join()
    except TaskCancelledError:
        return "cancelled"
    return "finished"


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    steps=st.lists(
        st.tuples(st.integers(8, 400), st.integers(0, 12), st.sampled_from(ACTIONS)),
        min_size=2,
        max_size=6,
    ),
    seed=st.integers(0, 2**16),
)
def test_preemption_storm(llama_tp2: TPPrefillBackend, steps: list[Step], seed: int) -> None:
    backend = llama_tp2
    before = {key for key, _ in backend.parked_at}
    tasks: list[tuple[Task, list[list[int]]]] = []
    outcome: dict[str, str] = {}
    parked: list[Task] = []
    running: Task | None = None
    for index, (length, wait, action) in enumerate(steps):
        batch = prompts([length], backend.vocab_size, seed=seed + index)
        if running is not None:
            running.wait_checkpoints(running.control.num_checkpoints + wait)
            if action == "preempt":
                if running.preempt():
                    parked.append(running)
                else:
                    outcome[running.control.name] = _finish(running)
            elif action == "cancel":
                running.control.cancel()
                outcome[running.control.name] = _finish(running)
            else:
                outcome[running.control.name] = _finish(running)
            if action == "cancel-parked" and parked:
                victim = parked.pop()
                victim.control.cancel()
                outcome[victim.control.name] = _finish(victim)
        running = Task(backend, batch, f"t{index}").start()
        tasks.append((running, batch))
    assert running is not None
    outcome[running.control.name] = _finish(running)
    while parked:
        task = parked.pop()
        task.control.resume()
        outcome[task.control.name] = _finish(task)

    for task, batch in tasks:
        if outcome[task.control.name] == "finished":
            assert task.result is not None
            assert_same(task.result, backend.run(batch, TaskControl("solo")))
    agreed = ranks_agree(backend)
    # Each task of this example (plus its solo re-run) reached the followers exactly once.
    keys = sorted(set(agreed) - before)
    reports = backend.follower_reports()
    for report in reports:
        assert set(keys) <= set(report)
    assert len(keys) == len(tasks) + sum(v == "finished" for v in outcome.values())
