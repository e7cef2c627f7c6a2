"""The simulated execution pool: carries out submit / preempt / resume on a virtual clock.

Same contract (:class:`flowprefill.prefill.scheduler.round.Pool`) as the engine's
:class:`flowprefill.prefill.executor.pool.ExecutionPool` — one task runs, the others are parked
with their progress — but a task is an :class:`ExecutionPlan` instead of a thread, and
time is the pool's own clock. ``preempt`` returns the blocking time: from the signal to
the next checkpoint of the running task (the rest of the operator, layer or chunk in
flight), during which the device keeps running the victim. The victim keeps the work done
up to that checkpoint and continues from there when resumed.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from flowprefill.contracts.names import Granularity
from flowprefill.errors import UnknownTaskError
from flowprefill.lab.sim.cost import CostModel
from flowprefill.lab.sim.plan import INSTANT, ExecutionPlan, Preemption
from flowprefill.prefill.request import Task
from flowprefill.prefill.scheduler.round import PreemptOutcome

_EPS_S = 1e-12
"""Rounding slack when deciding whether a checkpoint has been reached."""


def last_checkpoint_s(plan: ExecutionPlan, elapsed_s: float) -> float:
    """The last checkpoint at or before ``elapsed_s`` (0.0 when none has been reached)."""
    g = plan.granularity
    if g is INSTANT or elapsed_s >= plan.total_s - _EPS_S:
        return elapsed_s
    k = max(0, bisect.bisect_right(plan.starts_s, elapsed_s + _EPS_S) - 1)
    start = plan.starts_s[k]  # a chunk boundary (a checkpoint) when k > 0
    p = plan.passes[k]
    y = elapsed_s - start - p.pre_s
    layer_s = p.layer_s
    if g is Granularity.NONE or y < -_EPS_S or layer_s <= 0:
        return start
    layers_done = min(int((y + _EPS_S) // layer_s), p.num_layers)
    t = start + p.pre_s + layers_done * layer_s
    if g is Granularity.LAYER or layers_done == p.num_layers:
        return t
    within = y - layers_done * layer_s
    ends = plan.op_ends_s[k]
    i = bisect.bisect_right(ends, within + _EPS_S)  # stretches ended by now
    return t + (ends[i - 1] if i else 0.0)


@dataclass(slots=True)
class _Run:
    plan: ExecutionPlan
    done_s: float = 0.0
    """Run time completed up to the last park."""
    started_s: float | None = None
    """Clock time the current run began; None while parked."""
    token: int = 0
    """Bumped whenever the task's expected completion time changes."""


def _elapsed(run: _Run, now_s: float) -> float:
    """Run time a running task has completed by ``now_s`` (none during a stall)."""
    assert run.started_s is not None
    return run.done_s + max(0.0, now_s - run.started_s)


@dataclass(slots=True)
class SimulatedPool:
    """:class:`flowprefill.prefill.scheduler.round.Pool` on a virtual clock.

    ``now_s`` is the loop's clock: the driver moves it to the wake-up time before a round
    (:meth:`advance_to`) and a ``preempt`` moves it on by its blocking time, so the next
    command starts once the victim has parked, as the engine's blocking ``preempt`` does.
    """

    cost: CostModel
    granularity: Preemption
    chunk_size: int | None = None
    max_blocking_s: float | None = None
    """Run-time operator splitting bound (operator granularity only); None: never split."""
    now_s: float = 0.0
    running: Task | None = None
    blocking_s: list[float] = field(default_factory=list)
    work_s: float = 0.0
    """Device time of every task submitted so far (each runs to its end eventually)."""
    num_added_checkpoints: int = 0
    """Checkpoints operator splitting added to the tasks submitted so far."""
    _runs: dict[int, _Run] = field(default_factory=dict)

    def advance_to(self, now_s: float) -> None:
        """The loop wakes at ``now_s`` (never earlier than it last got free)."""
        if now_s < self.now_s:
            raise ValueError(f"the simulated clock cannot go back from {self.now_s} to {now_s}")
        self.now_s = now_s

    # ----------------------------------------------------------------- commands

    def submit(self, task: Task) -> None:
        """Start ``task`` now; :meth:`done_s` says when it ends if not preempted."""
        if self.running is not None:
            raise RuntimeError(f"cannot submit {task!r}: {self.running!r} is running")
        lengths = [r.num_tokens for r in task.requests]
        plan = ExecutionPlan.build(
            self.cost,
            lengths,
            granularity=self.granularity,
            chunk_size=self.chunk_size,
            max_blocking_s=self.max_blocking_s,
        )
        self._runs[task.task_id] = _Run(plan)
        self.work_s += plan.total_s
        self.num_added_checkpoints += plan.num_added_checkpoints
        self.resume(task)

    def resume(self, task: Task) -> None:
        run = self._run(task)
        if self.running is not None and self.running is not task:
            raise RuntimeError(f"cannot resume {task!r}: {self.running!r} is running")
        run.started_s = self.now_s
        run.token += 1
        self.running = task

    def preempt(self, task: Task) -> PreemptOutcome:
        """Signal ``task``; it parks at its next checkpoint (or finishes first)."""
        run = self._run(task)
        if run.started_s is None or self.running is not task:
            raise RuntimeError(f"{task!r} is not running")
        plan = run.plan
        elapsed = min(_elapsed(run, self.now_s), plan.total_s)
        # A stalled task (see :meth:`stall`) only reaches its checkpoint after the stall.
        stalled = max(0.0, run.started_s - self.now_s)
        checkpoint = plan.next_checkpoint_s(elapsed)
        self.running = None
        run.started_s = None
        if checkpoint is None:
            # Finishes first: its completion (already scheduled) stays valid.
            blocking = stalled + plan.total_s - elapsed
            run.done_s = plan.total_s
            task.progress = 1.0
            parked = False
        else:
            checkpoint = max(checkpoint, elapsed)
            blocking = stalled + checkpoint - elapsed
            run.done_s = checkpoint
            run.token += 1
            task.progress = plan.progress(checkpoint)
            parked = True
        self.blocking_s.append(blocking)
        self.now_s += blocking
        return PreemptOutcome(parked, blocking)

    def stall(self, delay_s: float, *, now_s: float, at_next_checkpoint: bool = False) -> float:
        """The device is lent to another phase (colocated decode, :mod:`.colocated`): the
        running task makes no progress for ``delay_s`` — from ``now_s``, or from its next
        checkpoint at or after ``now_s`` when ``at_next_checkpoint`` (it parks there for
        a decode step). Its completion moves by ``delay_s`` and its token is bumped (a
        completion already posted is stale). Returns the clock time the stall begins;
        with nothing running, or when the task ends before its next checkpoint, no stall
        happens and that time is returned (``now_s``, or the task's end).

        Until a stall ends the task reports the work done when it began (a round in the
        window sees it, and a ``preempt`` waits for the stall to end as well)."""
        if delay_s < 0:
            raise ValueError(f"a stall cannot be negative: {delay_s}")
        running = self._running_at(now_s)
        if running is None:
            return now_s
        run, elapsed = running
        assert run.started_s is not None
        if elapsed >= run.plan.total_s - _EPS_S:
            return now_s  # done by now: its completion is due, nothing to stall
        begin = now_s
        if at_next_checkpoint:
            park = self.next_park(now_s)
            if park is None:
                return now_s + max(0.0, run.started_s - now_s) + run.plan.total_s - elapsed
            begin = park[0]
        run.done_s = min(_elapsed(run, begin), run.plan.total_s)
        run.started_s = max(begin, run.started_s) + delay_s
        run.token += 1
        return begin

    def _running_at(self, now_s: float) -> tuple[_Run, float] | None:
        """The running task's run and the run time it has completed by ``now_s`` (capped
        at its total); None when nothing runs."""
        if self.running is None:
            return None
        run = self._run(self.running)
        return run, min(_elapsed(run, now_s), run.plan.total_s)

    def next_park(self, now_s: float) -> tuple[float, float] | None:
        """Where the running task would park for a stall from its next checkpoint at or
        after ``now_s`` (:meth:`stall` with ``at_next_checkpoint``): the clock time, and
        its progress there (what the engine's task control reads at that checkpoint).
        None when nothing runs or it ends before another checkpoint."""
        running = self._running_at(now_s)
        if running is None:
            return None
        run, elapsed = running
        assert run.started_s is not None
        checkpoint = run.plan.next_checkpoint_s(elapsed)
        if checkpoint is None or checkpoint >= run.plan.total_s - _EPS_S:
            return None
        checkpoint = max(checkpoint, elapsed)
        begin = now_s + max(0.0, run.started_s - now_s) + checkpoint - elapsed
        return begin, run.plan.progress(checkpoint)

    def cancel(self, task: Task) -> None:
        raise NotImplementedError("the simulator issues no cancellations")

    def release(self, task: Task) -> None:
        self._runs.pop(task.task_id, None)
        if self.running is task:
            self.running = None

    # ----------------------------------------------------------------- queries

    def progress(self, task: Task) -> float:
        """Fraction of the task's run time done at its last checkpoint before ``now_s``.

        The engine's pool learns a task's progress only at checkpoints (TaskControl
        counts them), so a running task reports where its last checkpoint was, not the
        work done since; with no checkpoints (granularity ``none``, one pass) that is 0.
        """
        run = self._run(task)
        elapsed = run.done_s
        if run.started_s is not None:
            elapsed = _elapsed(run, self.now_s)
            elapsed = last_checkpoint_s(run.plan, min(elapsed, run.plan.total_s))
        return run.plan.progress(elapsed)

    def held_bytes(self, task: Task) -> int | None:
        """Not simulated: the scheduler keeps its upper bound for a parked task."""
        return None

    def done_s(self, task: Task) -> float:
        """When ``task`` ends if it keeps running (it must be running)."""
        run = self._run(task)
        if run.started_s is None:
            raise RuntimeError(f"{task!r} is not running")
        return run.started_s + run.plan.total_s - run.done_s

    def token(self, task: Task) -> int | None:
        """Bumped whenever the task's completion time changes: an older one is stale."""
        run = self._runs.get(task.task_id)
        return None if run is None else run.token

    def plan(self, task: Task) -> ExecutionPlan:
        return self._run(task).plan

    def _run(self, task: Task) -> _Run:
        run = self._runs.get(task.task_id)
        if run is None:
            raise UnknownTaskError(f"the simulated pool holds no task {task!r}")
        return run
