"""One scheduling round, shared by the engine's loop thread and the simulator.

A round is what the event-driven loop does on each wake-up (Algorithm 2, lines 3–26):
apply every queued event to the :class:`~flowprefill.prefill.scheduler.core.Scheduler` in order
(arrivals, completions, cancellations), refresh the running task's progress from the
pool, run **one** ``Scheduler.schedule`` and carry out its commands on the pool in order.
:func:`run_round` does exactly that and returns a :class:`RoundOutput`; it never waits on
a queue, reads a clock or touches a future. The engine's :class:`SchedulerLoop` feeds it
events from a thread-safe queue and hands its output to the engine; the simulator's
``Instance`` feeds it events from a heap at simulated times. Both pools follow
:class:`Pool`: the engine's runs threads on the wall clock, the simulator's advances its
own virtual clock (a ``preempt`` there costs the victim's remaining operator), so time is
each pool's concern and the decisions are the round's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from flowprefill.prefill.request import Request, RequestState, Task
from flowprefill.prefill.scheduler.core import Command, CommandKind, Scheduler, SchedulerOutput


@dataclass(frozen=True, slots=True)
class PreemptOutcome:
    """What a pool's ``preempt`` reports (the engine's threads and the simulator alike)."""

    parked: bool
    """False when the task reached its end before a checkpoint (it finished instead)."""
    blocking_s: float
    """Signal → ACK (or → finish) time: the paper's preemption blocking time."""
    handoff_s: float = 0.0
    """Of ``blocking_s``, checkpoint → ACK seen: the device drain, the GIL and the thread
    wake-ups (the rest is the operator the signal landed in). 0 where the task finished
    instead, and in the simulator, which hands off instantly."""


class Pool(Protocol):
    """An execution pool as a round drives it: one task runs, the others are parked."""

    def submit(self, task: Task) -> None: ...
    def preempt(self, task: Task) -> PreemptOutcome:
        """Return once ``task`` has parked at a checkpoint (or finished)."""
        ...

    def resume(self, task: Task) -> None: ...
    def cancel(self, task: Task) -> None:
        """Stop ``task`` at its next checkpoint; its completion still arrives, failed."""
        ...

    def release(self, task: Task) -> None:
        """Forget a task whose completion has been applied."""
        ...

    def progress(self, task: Task) -> float:
        """Fraction (0..1) of the task's work done by now."""
        ...

    def held_bytes(self, task: Task) -> int | None:
        """Bytes the parked ``task`` holds, measured; None when this pool cannot measure
        (the scheduler keeps its upper bound)."""
        ...


# ---------------------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class Arrival:
    request: Request


@dataclass(frozen=True, slots=True)
class Completion:
    """``task`` left the pool: ``result`` is the backend's output (None in the simulator)
    and ``error`` what ended it, if anything (TaskCancelledError for a cancelled task)."""

    task: Task
    result: Any
    error: BaseException | None


@dataclass(frozen=True, slots=True)
class Cancel:
    request_id: str


@dataclass(frozen=True, slots=True)
class Stop:
    """End the loop: the round applies the other events but schedules nothing."""


Event = Arrival | Completion | Cancel | Stop

Admit = Callable[[Request, Scheduler, float], bool]
"""An arrival gate evaluated in event order against the scheduler as it stands (the
simulator's gateway experiments); the engine admits every request."""


# ---------------------------------------------------------------------------- output


@dataclass(frozen=True, slots=True)
class Cancelled:
    request_id: str
    request: Request | None
    """None when no queue held it (already finished, or never seen)."""


@dataclass(frozen=True, slots=True)
class Preempted:
    task: Task
    outcome: PreemptOutcome


@dataclass(slots=True)
class RoundOutput:
    """What one round did, for whoever resolves futures, counts or schedules completions."""

    now_s: float
    scheduled: SchedulerOutput | None
    """The round's decision; None when a Stop event ended the loop instead."""
    completed: list[Completion] = field(default_factory=list)
    """Completions applied (the scheduler has stamped their requests' ``finish_s``)."""
    cancelled: list[Cancelled] = field(default_factory=list)
    shed: list[Request] = field(default_factory=list)
    """Arrivals the ``admit`` gate refused (now CANCELLED)."""
    preempted: list[Preempted] = field(default_factory=list)

    @property
    def commands(self) -> list[Command]:
        return [] if self.scheduled is None else self.scheduled.commands

    @property
    def stopped(self) -> bool:
        return self.scheduled is None


def run_round(
    scheduler: Scheduler,
    pool: Pool,
    events: Sequence[Event],
    now_s: float,
    *,
    admit: Admit | None = None,
) -> RoundOutput:
    """Apply ``events`` in order at ``now_s``, run one scheduling round, carry it out.

    Commands are applied to ``pool`` in the order the scheduler issued them, so a
    ``preempt`` returns (the victim parked) before the following ``submit``/``resume``.
    The running task's progress is refreshed from ``pool`` before scheduling, so S-EDF ranks
    it by what it really has left.
    With a :class:`Stop` among ``events`` the other events are still applied (their
    completions must be answered) and no round is scheduled.
    """
    out = RoundOutput(now_s, None)
    stop = False
    for ev in events:
        if isinstance(ev, Arrival):
            if admit is None or admit(ev.request, scheduler, now_s):
                scheduler.add(ev.request)
            else:
                ev.request.transition(RequestState.CANCELLED, now_s)
                out.shed.append(ev.request)
        elif isinstance(ev, Completion):
            scheduler.finish(ev.task, now_s, failed=ev.error is not None)
            pool.release(ev.task)
            out.completed.append(ev)
        elif isinstance(ev, Cancel):
            request = scheduler.find(ev.request_id)
            emptied = scheduler.cancel(ev.request_id, now_s)
            if emptied is not None:
                # Nobody wants this task's output any more: stop it at its next
                # checkpoint. Its completion (failed) frees the slot and wakes the loop.
                pool.cancel(emptied)
            out.cancelled.append(Cancelled(ev.request_id, request))
        else:
            stop = True
    if stop:
        return out
    running = scheduler.running
    if running is not None:
        running.progress = pool.progress(running)
    out.scheduled = scheduler.schedule(now_s)
    for cmd in out.scheduled.commands:
        if cmd.kind is CommandKind.PREEMPT:
            out.preempted.append(Preempted(cmd.task, pool.preempt(cmd.task)))
        elif cmd.kind is CommandKind.SUBMIT:
            pool.submit(cmd.task)
        else:
            pool.resume(cmd.task)
    # Measured after the submit/resume, so the urgent task does not wait for it.
    for p in out.preempted:
        if p.outcome.parked:
            held = pool.held_bytes(p.task)
            if held is not None:
                scheduler.parked_memory.measured(p.task, held)
    return out
