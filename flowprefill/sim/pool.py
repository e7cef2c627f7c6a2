"""The simulated execution pool: carries out submit / preempt / resume on a virtual clock.

Same contract as :class:`flowprefill.executor.pool.ExecutionPool` — one task runs, the
others are parked with their progress — but a task is an :class:`ExecutionPlan` instead of
a thread. ``preempt`` returns the blocking time: from the signal to the next checkpoint of
the running task (the rest of the operator, layer or chunk in flight), during which the
device keeps running the victim. The victim keeps the work done up to that checkpoint and
continues from there when resumed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flowprefill.errors import UnknownTaskError
from flowprefill.request import Task
from flowprefill.sim.cost import CostModel
from flowprefill.sim.plan import ExecutionPlan, Granularity


@dataclass(slots=True)
class _Run:
    plan: ExecutionPlan
    done_s: float = 0.0
    """Run time completed up to the last park."""
    started_s: float | None = None
    """Clock time the current run began; None while parked."""
    token: int = 0
    """Bumped whenever the task's expected completion time changes."""


@dataclass(frozen=True, slots=True)
class PreemptResult:
    parked: bool
    """False when the task reached its end before any checkpoint (it finished)."""
    blocking_s: float


@dataclass(slots=True)
class SimulatedPool:
    cost: CostModel
    granularity: Granularity
    chunk_size: int | None = None
    running: Task | None = None
    blocking_s: list[float] = field(default_factory=list)
    work_s: float = 0.0
    """Device time of every task submitted so far (each runs to its end eventually)."""
    _runs: dict[int, _Run] = field(default_factory=dict)

    # ----------------------------------------------------------------- commands

    def submit(self, task: Task, now_s: float) -> float:
        """Start ``task``; returns its completion time if it is not preempted."""
        if self.running is not None:
            raise RuntimeError(f"cannot submit {task!r}: {self.running!r} is running")
        lengths = [r.num_tokens for r in task.requests]
        plan = ExecutionPlan.build(
            self.cost, lengths, granularity=self.granularity, chunk_size=self.chunk_size
        )
        self._runs[task.task_id] = _Run(plan)
        self.work_s += plan.total_s
        return self.resume(task, now_s)

    def resume(self, task: Task, now_s: float) -> float:
        run = self._run(task)
        if self.running is not None and self.running is not task:
            raise RuntimeError(f"cannot resume {task!r}: {self.running!r} is running")
        run.started_s = now_s
        run.token += 1
        self.running = task
        return now_s + run.plan.total_s - run.done_s

    def preempt(self, task: Task, now_s: float) -> PreemptResult:
        """Signal ``task``; it parks at its next checkpoint (or finishes first)."""
        run = self._run(task)
        if run.started_s is None or self.running is not task:
            raise RuntimeError(f"{task!r} is not running")
        plan = run.plan
        elapsed = min(run.done_s + (now_s - run.started_s), plan.total_s)
        checkpoint = plan.next_checkpoint_s(elapsed)
        self.running = None
        if checkpoint is None:
            # Finishes first: its completion (already scheduled) stays valid.
            blocking = plan.total_s - elapsed
            run.done_s = plan.total_s
            run.started_s = None
            task.progress = 1.0
            self.blocking_s.append(blocking)
            return PreemptResult(False, blocking)
        checkpoint = max(checkpoint, elapsed)
        blocking = checkpoint - elapsed
        run.done_s = checkpoint
        run.started_s = None
        run.token += 1
        task.progress = plan.progress(checkpoint)
        self.blocking_s.append(blocking)
        return PreemptResult(True, blocking)

    def release(self, task: Task) -> None:
        self._runs.pop(task.task_id, None)
        if self.running is task:
            self.running = None

    # ----------------------------------------------------------------- queries

    def progress(self, task: Task, now_s: float) -> float:
        """Live fraction of the task's run time done at ``now_s``."""
        run = self._run(task)
        elapsed = run.done_s
        if run.started_s is not None:
            elapsed += now_s - run.started_s
        return run.plan.progress(elapsed)

    def token(self, task: Task) -> int | None:
        run = self._runs.get(task.task_id)
        return None if run is None else run.token

    def plan(self, task: Task) -> ExecutionPlan:
        return self._run(task).plan

    def _run(self, task: Task) -> _Run:
        run = self._runs.get(task.task_id)
        if run is None:
            raise UnknownTaskError(f"the simulated pool holds no task {task!r}")
        return run
