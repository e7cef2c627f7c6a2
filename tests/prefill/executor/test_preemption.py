"""The preemption protocol (Figure 7) on its own: signal, ACK, park, resume, cancel."""

from __future__ import annotations

import threading
import time

import pytest

from flowprefill.errors import TaskCancelledError
from flowprefill.prefill.executor.context import activate, checkpoint
from flowprefill.prefill.executor.preemption import TaskControl


def run_steps(control: TaskControl, steps: int, log: list[int]) -> threading.Thread:
    def body() -> None:
        with activate(control):
            try:
                for i in range(steps):
                    time.sleep(0.0005)
                    checkpoint()
                    log.append(i)
            except TaskCancelledError:
                log.append(-1)
            finally:
                control.mark_done()

    t = threading.Thread(target=body)
    t.start()
    return t


def test_preempt_right_after_resume_is_a_new_signal_not_an_error() -> None:
    """The scheduler can resume a task and preempt it again before its thread wakes."""
    control = TaskControl()
    log: list[int] = []
    t = run_steps(control, 400, log)
    for _ in range(50):
        parked, _ = control.request_preempt(timeout_s=5)
        if not parked:
            break
        assert control.parked
        control.resume()
        assert not control.parked  # resumed as far as the scheduler is concerned
    t.join(10)
    assert log[-1] == 399 and log == list(range(400))


def test_finish_before_checkpoint_reports_not_parked() -> None:
    control = TaskControl()
    log: list[int] = []
    t = run_steps(control, 1, log)
    t.join()
    assert control.request_preempt(timeout_s=1) == (False, 0.0)
    assert control.handoff_s == 0.0


def test_the_handoff_is_the_blocking_after_the_checkpoint_not_the_operator() -> None:
    """A signal that lands in a 100 ms operator blocks until the operator ends; the
    handoff (checkpoint -> ACK seen) is only what comes after it."""
    control = TaskControl()
    in_operator = threading.Event()

    def body() -> None:
        with activate(control):
            checkpoint()
            in_operator.set()
            time.sleep(0.1)  # one long operator, no checkpoint inside
            checkpoint()
        control.mark_done()

    t = threading.Thread(target=body)
    t.start()
    assert in_operator.wait(5)
    parked, blocking_s = control.request_preempt(timeout_s=5)
    assert parked and blocking_s >= 0.08
    assert 0 <= control.handoff_s < 0.05 and control.handoff_s < blocking_s - 0.05
    control.resume()
    t.join(5)


def test_cancel_running_and_parked_tasks() -> None:
    running = TaskControl()
    log: list[int] = []
    t = run_steps(running, 10_000, log)
    time.sleep(0.01)
    running.cancel()
    t.join(5)
    assert log[-1] == -1

    parked = TaskControl()
    log2: list[int] = []
    t2 = run_steps(parked, 10_000, log2)
    assert parked.request_preempt(timeout_s=5)[0]
    parked.cancel()
    t2.join(5)
    assert log2[-1] == -1 and not t2.is_alive()


def test_resume_of_a_task_that_is_not_parked_is_refused() -> None:
    control = TaskControl()
    with pytest.raises(RuntimeError, match="not parked"):
        control.resume()


def test_preempt_times_out_instead_of_hanging() -> None:
    control = TaskControl()  # no task thread ever reaches a checkpoint
    with pytest.raises(TimeoutError):
        control.request_preempt(timeout_s=0.05)
    assert not control.preempt_requested
