"""The simulator and the engine agree round for round on a seeded workload.

Both sides run the same :func:`~flowprefill.prefill.scheduler.round.run_round` over a scheduler
configured the same way, and the test checks they issue the same commands in the same
order:

* the engine side is a :class:`PrefillEngine`'s scheduler, driving the
  real :class:`ExecutionPool` (task threads, TaskControl's signal/ACK/park protocol,
  checkpoint-counted progress) on a :class:`VirtualDevice`: task threads run their
  checkpointed blocks of work in lock-step with virtual time, so every round happens at
  a known instant whatever the machine's speed;
* the simulator side is ``build_instance`` + ``Simulation`` with a cost model that gives
  each task the same blocks (one "operator" per block, a checkpoint after each).

Anything that makes one side decide differently — another setting (live progress), a
different event handling, another preempt model — shows up as a different sequence.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from flowprefill.bench.workload import qwen_like
from flowprefill.lab.sim.cost import PassCost, Segment
from flowprefill.lab.sim.driver import Simulation
from flowprefill.lab.sim.profile import split_evenly
from flowprefill.lab.sim.systems import build_instance, get_system
from flowprefill.prefill.engine import PrefillEngine
from flowprefill.prefill.executor.context import checkpoint
from flowprefill.prefill.executor.pool import ExecutionPool
from flowprefill.prefill.executor.preemption import TaskControl
from flowprefill.prefill.predictor.model import TTFTPredictor
from flowprefill.prefill.request import Request, Task
from flowprefill.prefill.scheduler.core import CommandKind, Scheduler, SchedulerOutput
from flowprefill.prefill.scheduler.round import Arrival, Completion, Event, run_round

PER_TOKEN_S = 5e-5
BLOCK_TOKENS = 128
PREDICTOR = TTFTPredictor.linear(per_token_s=PER_TOKEN_S)
"""Exact for both sides' cost."""

Step = tuple[int, str, tuple[str, ...]]
"""(round, command kind, request ids of the command's task)."""


def blocks(num_tokens: int) -> tuple[int, float]:
    """A task of ``num_tokens`` runs as this many equal blocks of this many seconds."""
    num_blocks = max(1, math.ceil(num_tokens / BLOCK_TOKENS))
    return num_blocks, num_tokens * PER_TOKEN_S / num_blocks


class BlockCost:
    """Simulator cost model: a pass is ``blocks(n)`` layers of one operator each, so at
    operator granularity a task has a checkpoint after every block, like the backend."""

    name = "blocks"
    max_context_tokens = 1 << 20
    checkpoint_s = 0.0

    def pass_cost(self, segments: Sequence[Segment]) -> PassCost:
        num_blocks, block_s = blocks(sum(new for new, _ in segments))
        return PassCost(0.0, (block_s,), num_blocks)

    def split_pass_cost(self, segments: Sequence[Segment], max_blocking_s: float) -> PassCost:
        return split_evenly(self.pass_cost(segments), max_blocking_s, 0.0)

    def ideal_cost_s(self, num_tokens: int) -> float:
        return num_tokens * PER_TOKEN_S


@dataclass
class Trace:
    steps: list[Step] = field(default_factory=list)
    rounds: list[tuple[int, float, float | None]] = field(default_factory=list)
    """(round, time, running task's progress as the round saw it), to 1 ns / 1e-9."""


def recorder(scheduler: Scheduler) -> Trace:
    """Record every round (spying on ``schedule``, which run_round calls once a round)."""
    trace = Trace()
    original = scheduler.schedule

    def schedule(now_s: float) -> SchedulerOutput:
        running = scheduler.running
        progress = None if running is None else round(running.progress, 9)
        out = original(now_s)
        trace.rounds.append((out.round_index, round(now_s, 9), progress))
        for cmd in out.commands:
            ids = tuple(r.request_id for r in cmd.task.requests)
            trace.steps.append((out.round_index, cmd.kind.value, ids))
        return out

    scheduler.schedule = schedule  # type: ignore[method-assign]
    return trace


# ------------------------------------------------------------------- engine side


@dataclass
class _Run:
    time_s: float
    """Virtual time this task has reached (its last block end, or its (re)start)."""


class VirtualDevice:
    """Virtual time for the engine's task threads.

    The test thread (playing the loop thread) sets a horizon; the active task's thread
    runs each block only once the block's end is within the horizon, and a pending
    preempt signal lets it finish the block in flight at once — moving the loop's clock
    to the block's end, as the blocking preempt would — and then park at the checkpoint.
    """

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.now_s = 0.0
        self.horizon_s = 0.0
        self.active: int | None = None
        self.blocked: tuple[int, float] | None = None
        """(task, end of its next block) while a task thread waits for the horizon."""
        self.runs: dict[int, _Run] = {}
        self.completions: list[tuple[float, Completion]] = []

    # task threads
    def run(self, task: Task, control: TaskControl) -> list[None]:
        num_blocks, block_s = blocks(task.num_tokens)
        control.num_checkpoints_expected = num_blocks
        for _ in range(num_blocks):
            self._block(task.task_id, control, block_s)
            checkpoint()
        # Parked after its last block, it ends when resumed: wait for the loop's start.
        with self.cond:
            self.cond.wait_for(lambda: self.active == task.task_id)
        return [None] * len(task.requests)

    def _block(self, task_id: int, control: TaskControl, block_s: float) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.active == task_id and task_id in self.runs)
            run = self.runs[task_id]
            end = run.time_s + block_s
            self.blocked = (task_id, end)
            self.cond.notify_all()
            # preempt_requested is raised under TaskControl's own lock: poll it.
            while not (end <= self.horizon_s or control.preempt_requested):
                self.cond.wait(timeout=0.0005)
            self.blocked = None
            run.time_s = end
            if control.preempt_requested:
                self.now_s = end  # the loop waited for this checkpoint
                self.active = None
            self.cond.notify_all()

    def on_done(self, task: Task, result: Any, error: BaseException | None) -> None:
        with self.cond:
            done_s = self.runs[task.task_id].time_s
            self.completions.append((done_s, Completion(task, result, error)))
            if self.active == task.task_id:
                self.active = None
            self.cond.notify_all()

    # the loop's side
    def start(self, task: Task) -> None:
        """``task`` was just submitted or resumed at ``now_s``."""
        with self.cond:
            self.runs.setdefault(task.task_id, _Run(self.now_s)).time_s = self.now_s
            self.active = task.task_id
            self.cond.notify_all()

    def _settled(self) -> bool:
        """Nothing runs, or the active task waits for a block that ends past the horizon."""
        if self.active is None:
            return True
        if self.blocked is None:
            return False
        task_id, end = self.blocked
        return task_id == self.active and end > self.horizon_s

    def run_until(self, horizon_s: float) -> float | None:
        """Let the active task run up to ``horizon_s``; its completion time if it ended."""
        with self.cond:
            self.horizon_s = horizon_s
            self.cond.notify_all()
            self.cond.wait_for(self._settled)
            return min((t for t, _ in self.completions), default=None)


def run_engine(requests: list[Request]) -> Trace:
    spec = get_system("flowprefill")
    engine = PrefillEngine(
        _NoBackend(),
        PREDICTOR,
        policy=spec.policy,
        batching=spec.batching,
        token_budget=spec.token_budget,
    )
    scheduler = engine.scheduler
    trace = recorder(scheduler)
    device = VirtualDevice()
    pool: ExecutionPool[list[None]] = ExecutionPool(device.run, device.on_done)
    arrivals = sorted(requests, key=lambda r: r.arrival_s)
    i = 0
    while True:
        t_arrival = arrivals[i].arrival_s if i < len(arrivals) else math.inf
        done_s = device.run_until(max(t_arrival, device.now_s))
        if done_s is not None:
            now_s = done_s
        elif i < len(arrivals):
            now_s = max(t_arrival, device.now_s)
        else:
            break
        events: list[Event] = []
        while i < len(arrivals) and arrivals[i].arrival_s <= now_s:
            events.append(Arrival(arrivals[i]))
            i += 1
        with device.cond:
            events += [c for t, c in device.completions if t <= now_s]
            device.completions = [(t, c) for t, c in device.completions if t > now_s]
            device.now_s = now_s
        out = run_round(scheduler, pool, events, now_s)
        for cmd in out.commands:
            if cmd.kind is not CommandKind.PREEMPT:
                device.start(cmd.task)
    pool.join(timeout_s=5.0)
    assert not scheduler.runnable(), "the engine side left work behind"
    return trace


class _NoBackend:
    """The engine object only lends its scheduler here."""

    max_prompt_tokens = 1 << 20

    def run(self, prompts: Sequence[Sequence[int]], control: TaskControl) -> list[Any]:
        raise AssertionError("the device runs the tasks")

    def validate(self, prompts: Sequence[Sequence[int]]) -> None:
        return None


# ---------------------------------------------------------------- simulator side


def run_simulator(requests: list[Request], **overrides: Any) -> Trace:
    inst = build_instance(get_system("flowprefill"), BlockCost(), PREDICTOR.predict_s)
    for name, value in overrides.items():
        setattr(inst, name, value)
    trace = recorder(inst.scheduler)
    result = Simulation([inst]).run(requests)
    assert result.num_requests == len(requests)
    return trace


WORKLOAD = qwen_like(48, seed=7)
RATE = 4.0  # req/s: about 75 % of the device busy, so urgent arrivals preempt long tasks


def test_engine_and_simulator_issue_the_same_commands_round_for_round() -> None:
    engine = run_engine(WORKLOAD.requests(RATE))
    sim = run_simulator(WORKLOAD.requests(RATE))
    kinds = [kind for _, kind, _ in sim.steps]
    assert kinds.count("preempt") >= 5 and kinds.count("resume") >= 5, "exercise preemption"
    assert any(len(ids) > 1 for _, _, ids in sim.steps), "and batching"
    assert engine.steps == sim.steps
    # And each round saw the same time and the same progress of the running task.
    assert engine.rounds == sim.rounds


def test_the_comparison_sees_a_simulator_that_drifted() -> None:
    """Without live progress (the simulator's model of an earlier engine) the decisions
    differ."""
    engine = run_engine(WORKLOAD.requests(RATE))
    drifted = run_simulator(WORKLOAD.requests(RATE), live_progress=False)
    assert engine.steps != drifted.steps
