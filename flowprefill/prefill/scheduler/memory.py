"""The parked-memory budget: bytes held by preempted tasks, and whether one more may park.

A preempted task stays parked inside its forward pass holding its activations and the
KV cache it has filled (:mod:`flowprefill.prefill.executor.memory`). :class:`ParkedMemory` keeps
one number per parked task — an upper bound from the task's token count while it has
not been measured, the pool's measurement once it has — and answers the one question the
scheduler asks before a preemption: would the parked set after this switch still fit the
budget? The switch parks the running task and, when the scheduler resumes a parked task
instead of starting a new one, unparks that one (its bytes become the running task's).

Policy when it would not fit: **do not preempt**. The running task continues and the
more urgent entry waits in its queue until the next round (the running task's completion
at the latest, which every task reaches). Nothing is dropped, spilled or recomputed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from flowprefill.prefill.request import Task

ParkedBytesFn = Callable[[int, int], int]
"""``(num_tokens, num_requests) -> bytes``: an upper bound on what a task of that many
prompt tokens and requests holds while parked, decided before it parks."""


@dataclass(slots=True)
class ParkedMemory:
    """Bytes of the parked tasks against ``budget_bytes`` (None: unbounded)."""

    budget_bytes: int | None = None
    estimate: ParkedBytesFn | None = None
    held_bytes: dict[int, int] = field(default_factory=dict)
    """task_id -> bytes: the estimate at park time, replaced by the pool's measurement."""

    def __post_init__(self) -> None:
        if self.budget_bytes is not None:
            if self.budget_bytes < 0:
                raise ValueError(f"parked memory budget must be >= 0, got {self.budget_bytes}")
            if self.estimate is None:
                raise ValueError("a parked memory budget needs an estimate of parked bytes")

    @property
    def total_bytes(self) -> int:
        return sum(self.held_bytes.values())

    def estimate_bytes(self, task: Task) -> int:
        if self.estimate is None:
            return 0
        return self.estimate(task.num_tokens, len(task.requests))

    def fits_switch(self, victim: Task, resumed: Task | None) -> bool:
        """Whether parking ``victim`` (and unparking ``resumed``, if any) keeps the parked
        bytes within the budget. The victim counts at its upper bound: it has not parked
        yet, and where it will park is not known."""
        if self.budget_bytes is None:
            return True
        freed = self.held_bytes.get(resumed.task_id, 0) if resumed is not None else 0
        after = self.total_bytes - freed + self.estimate_bytes(victim)
        return after <= self.budget_bytes

    def park(self, task: Task) -> None:
        self.held_bytes[task.task_id] = self.estimate_bytes(task)

    def measured(self, task: Task, num_bytes: int) -> None:
        """The pool measured what ``task`` holds now that it is parked."""
        if task.task_id in self.held_bytes:
            self.held_bytes[task.task_id] = num_bytes

    def unpark(self, task: Task) -> None:
        """``task`` resumed or ended: it holds nothing parked any more."""
        self.held_bytes.pop(task.task_id, None)
