"""Decode-aware yield: beats in, park and resume out, at checkpoints only, bounded.

The decision is tested on crafted beats (times chosen by the test); parking and resuming
on a real executor's prefill, with real beats through a real socket and listener.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import pytest
import torch
from transformers import PreTrainedModel

from flowprefill.contracts.engine import DecodeAwareSettings
from flowprefill.kv.beats import END, GAP, MEAN, START, Beat, BeatListener, BeatSender, DecodeState
from flowprefill.prefill.executor.decode_yield import DecodeYield, Parkable
from flowprefill.prefill.executor.preemption import TaskControl
from flowprefill.prefill.executor.runner import PreemptibleExecutor
from flowprefill.prefill.request import Request, Task
from tests.prefill.executor.helpers import TIMEOUT_S, TaskThread


def _beat(kind: int, t: float, ids: tuple[str, ...] = ("a",)) -> Beat:
    return Beat(kind, 0, t, len(ids), ids)


def _decoding(target: float = 0.1, rule: str = GAP) -> DecodeState:
    """Decode ran 51 solo steps of 0.01 s, 0.01 s apart, the first ending at 9.0, the last
    at 10.0 (no prefill ran: solo step 0.01 s, quiet gap 0.01 s, slowdown unknown: 2)."""
    state = DecodeState(target, rule)
    for i in range(51):
        end = 10.0 - 0.02 * (50 - i)
        state.on_beat(_beat(START, end - 0.01))
        state.on_beat(_beat(END, end))
    return state


def test_goes_on_while_decode_can_still_make_it() -> None:
    state = _decoding()  # the next token is due at 10.1
    decide = DecodeYield(state)
    decide.stretch_s = 0.02
    # Alone, decode needs the rest of its quiet gap (progressing at half speed meanwhile)
    # and a step: at 10.01, 0.005 + 0.01.
    assert decide.solo_left_s(10.01) == pytest.approx(0.015)
    assert not decide.should_park(10.01)  # 10.01 + 0.02 + 0.015 <= 10.1
    assert not decide.should_park(10.05)  # 10.05 + 0.02 + 0.01
    assert decide.should_park(10.075)  # 10.075 + 0.02 + 0.01 > 10.1: the last chance


def test_parks_just_in_time_in_a_step() -> None:
    state = _decoding()
    state.on_beat(_beat(START, 10.01))
    decide = DecodeYield(state)
    decide.stretch_s = 0.02
    assert decide.solo_left_s(10.02) == pytest.approx(0.005)
    assert not decide.should_park(10.02)  # 10.02 + 0.02 + 0.005 <= 10.1
    assert decide.should_park(10.085)  # 10.085 + 0.02 > 10.1


def test_nothing_pending_or_stale_never_parks() -> None:
    state = _decoding()
    state.on_beat(_beat(START, 10.01, ()))
    state.on_beat(_beat(END, 10.02, ()))  # the last request finished
    decide = DecodeYield(state)
    assert not state.active
    assert not decide.should_park(10.5)  # no step pending
    busy = _decoding()
    decide = DecodeYield(busy, stale_s=1.0)
    assert decide.should_park(10.5)  # far past the deadline, beats recent enough
    assert not decide.should_park(11.5)  # no beat for > stale_s: decode is gone
    assert not busy.active  # ... and the hot path skips it until the next beat


def test_mean_rule_lets_banked_slack_run_prefill() -> None:
    gap, mean = _decoding(rule=GAP), _decoding(rule=MEAN)
    for state in (gap, mean):
        state.on_beat(_beat(START, 10.01))
    # The gap rule wants the token by 10.1; the mean rule by 9.0 + 51 * 0.1 (50 quick
    # gaps banked ~4.5 s of slack).
    assert DecodeYield(gap).should_park(10.2)
    assert not DecodeYield(mean).should_park(10.2)
    assert mean.next_deadline_s == pytest.approx(14.1)


def _halfway(budget: tuple[float, float] | None) -> TaskControl:
    """A task halfway through its checkpoints, with ``budget`` (deadline, predicted s)."""
    control = TaskControl()
    control.num_checkpoints, control.num_checkpoints_expected = 5, 10
    control.decode_budget = budget
    return control


@pytest.mark.parametrize(
    ("deadline", "parks"),
    [
        (10.59, True),  # 10.075 + 0.01 parked + 0.5 s left <= 10.59
        (10.58, False),  # ... > 10.58: the park would cost the task its deadline
        (10.2, False),  # already late: a park would only delay the queue behind it
        (None, True),  # no budget known: decode's target alone decides
    ],
)
def test_a_park_never_costs_the_running_tasks_deadline(deadline: float | None, parks: bool) -> None:
    state = _decoding()  # at 10.075 a park is due (test_goes_on_while_decode_can_still_make_it)
    vetoed: list[None] = []
    decide = DecodeYield(
        state, max_park_s=0.05, on_veto=lambda: vetoed.append(None), clock=lambda: 10.075
    )
    decide.stretch_s = 0.02
    control = _halfway(None if deadline is None else (deadline, 1.0))
    assert decide.solo_left_s(10.075) == pytest.approx(0.01)
    decide.at_checkpoint(control)  # no END comes: a park here times out after 0.05 s
    assert (decide.parks, decide.vetoes, len(vetoed)) == ((1, 0, 0) if parks else (0, 1, 1))


def test_a_task_gets_its_budget_on_the_policys_clock_when_it_starts() -> None:
    seen: list[Task] = []

    def budget(task: Task) -> tuple[float, float]:
        seen.append(task)
        return 0.4, 0.3  # deadline 0.4 s away, 0.3 s of prefill predicted

    decide = DecodeYield(DecodeState(0.1), budget=budget, clock=lambda: 50.0)
    task = Task([Request.create("r", arrival_s=0.0, ttft_slo_s=1.0, num_tokens=8)])
    control = TaskControl()
    decide.task_started(control, task)
    assert seen == [task] and control.decode_budget == (50.4, 0.3)
    assert decide.state.prefill_running == 1
    decide.task_ended()
    assert decide.state.prefill_running == 0
    assert decide.affordable(control, 50.0, 0.1)  # 50.0 + 0.1 + 0.3 <= 50.4
    assert not decide.affordable(control, 50.0, 0.11)
    # A waiting request that must start by 50.39 to make its deadline: it waits for the
    # park and the running task's rest.
    decide.queue_start_by_s = 50.39
    assert not decide.affordable(control, 50.0, 0.1)
    assert decide.affordable(control, 50.0, 0.09)
    control.decode_budget = None  # the task's own budget unknown: the queue still counts
    assert decide.affordable(control, 50.0, 0.39) and not decide.affordable(control, 50.0, 0.4)


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="max_park_s"):
        DecodeYield(DecodeState(0.1), max_park_s=0.0)
    with pytest.raises(ValueError, match="socket_path"):
        DecodeAwareSettings(socket_path="/" + "x" * 200)


class CountingYield(DecodeYield):
    """Counts how often the checkpoint consults it (the hot path must not)."""

    calls = 0

    def at_checkpoint(self, control: Parkable) -> None:
        self.calls += 1
        super().at_checkpoint(control)


@pytest.fixture
def model(tiny_models: dict[str, PreTrainedModel]) -> PreTrainedModel:
    return tiny_models["llama"]


def _prompt(n: int = 96) -> list[int]:
    return torch.randint(0, 100, (n,), generator=torch.Generator().manual_seed(3)).tolist()


def test_idle_decode_costs_the_checkpoint_nothing(
    make_executor: Callable[..., PreemptibleExecutor], model: PreTrainedModel
) -> None:
    executor = make_executor(model, granularity="operator")
    state = DecodeState(0.1)
    control = TaskControl("t")
    control.decode_yield = decide = CountingYield(state)
    executor.run([_prompt()], control)
    assert control.num_checkpoints > 0 and decide.calls == 0  # nothing decoding
    state.on_beat(_beat(END, time.monotonic() + 100.0))  # decoding, next token far off
    control = TaskControl("t2")
    control.decode_yield = decide
    executor.run([_prompt()], control)
    assert decide.calls == control.num_checkpoints and decide.parks == 0


def _stack_of(thread_name: str) -> list[tuple[str, str]]:
    ident = next(t.ident for t in threading.enumerate() if t.name == thread_name)
    assert ident is not None
    frame: FrameType | None = sys._current_frames()[ident]
    out = []
    while frame is not None:
        out.append((Path(frame.f_code.co_filename).name, frame.f_code.co_name))
        frame = frame.f_back
    return out


def _wait_for(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def test_parks_at_a_checkpoint_until_the_step_ends(
    make_executor: Callable[..., PreemptibleExecutor], model: PreTrainedModel, tmp_path: Path
) -> None:
    executor = make_executor(model, granularity="operator")
    reference = executor.run([_prompt()], TaskControl("reference"))
    state = DecodeState(10.0)
    listener = BeatListener(tmp_path / "beats.sock", state)
    sender = BeatSender(str(tmp_path / "beats.sock"))
    try:
        now = time.monotonic()
        # A token was due long ago and a step is running: park at the first checkpoint.
        state.on_beat(_beat(END, now - 30.0))
        state.on_beat(_beat(START, now))
        control = TaskControl("prefill")
        control.decode_yield = decide = DecodeYield(state)
        task = TaskThread(executor, [_prompt()], control).start()
        _wait_for(lambda: state.parked_since is not None, "the park")
        time.sleep(0.05)
        assert control.num_checkpoints == 1  # parked there, not running on
        stack = _stack_of("prefill")
        names = [name for _, name in stack]
        at = names.index("at_checkpoint")
        # Inside the checkpoint the model's operator hook called, in the forward pass.
        assert stack[at + 1] == ("preemption.py", "check")
        assert stack[at + 2] == ("context.py", "checkpoint")
        assert "forward" in names[at + 3 :]
        sender.send(END, 1, ["a"])  # the step ended: the prefill goes on
        outputs = task.join()
    finally:
        listener.close()
        sender.close()
    assert decide.parks == 1 and decide.timeouts == 0
    assert 0.05 <= decide.parked_s < TIMEOUT_S
    # Parking inside the forward pass changes nothing of the result.
    assert outputs[0].first_token_id == reference[0].first_token_id
    for (k, v), (rk, rv) in zip(outputs[0].kv_cache, reference[0].kv_cache, strict=True):
        assert torch.equal(k, rk) and torch.equal(v, rv)


def test_a_lost_end_beat_costs_one_bounded_park(
    make_executor: Callable[..., PreemptibleExecutor], model: PreTrainedModel
) -> None:
    executor = make_executor(model, granularity="operator")
    state = DecodeState(10.0)
    now = time.monotonic()
    state.on_beat(_beat(END, now - 30.0))
    state.on_beat(_beat(START, now))  # ... and its END never comes
    control = TaskControl("prefill")
    parks: list[float] = []
    control.decode_yield = decide = DecodeYield(state, max_park_s=0.2, on_park=parks.append)
    t0 = time.monotonic()
    executor.run([_prompt()], control)
    took = time.monotonic() - t0
    assert decide.parks == 1 and decide.timeouts == 1
    assert parks[0] == pytest.approx(0.2, abs=0.1)
    assert took < 0.2 + 5.0  # one bound, not one per checkpoint
    # A new END makes the yield consider parking again.
    state.on_beat(_beat(END, time.monotonic() - 30.0))
    assert decide.should_park(time.monotonic())


def test_preemption_signal_during_a_park_is_acked_after_it(
    make_executor: Callable[..., PreemptibleExecutor], model: PreTrainedModel
) -> None:
    executor = make_executor(model, granularity="operator")
    state = DecodeState(10.0)
    now = time.monotonic()
    state.on_beat(_beat(END, now - 30.0))
    state.on_beat(_beat(START, now))
    control = TaskControl("prefill")
    control.decode_yield = DecodeYield(state, max_park_s=0.3)
    task = TaskThread(executor, [_prompt()], control).start()
    _wait_for(lambda: state.parked_since is not None, "the park")
    parked, blocking_s = control.request_preempt(timeout_s=TIMEOUT_S)
    assert parked and control.num_checkpoints == 1  # the same checkpoint
    assert blocking_s < 0.3 + 1.0
    control.resume()
    task.join()
