"""The discrete-event driver: the engine's scheduling round against simulated pools.

Each :class:`Instance` is one prefill instance's scheduler loop on a virtual clock. A
wake-up happens at the time of its earliest queued event (an arrival or a completion) —
or, if the loop was still blocked in a preempt, when it is free again — and then runs the
engine's own :func:`~flowprefill.prefill.scheduler.round.run_round` with *every* event queued by
then: the same event handling, progress refresh, single ``Scheduler.schedule`` and
in-order commands as :class:`~flowprefill.prefill.scheduler.loop.SchedulerLoop`. The simulated
pool keeps time: a ``preempt`` moves its clock on by the victim's remaining operator (or
layer, or chunk), so the following ``submit``/``resume`` starts when it returns.
Scheduling decisions cost no simulated time. The driver itself only queues events,
schedules each started task's completion and counts results.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from flowprefill.lab.sim.gateway import Admission, AdmitAll, RoundRobin, Router
from flowprefill.lab.sim.pool import SimulatedPool
from flowprefill.prefill.request import Request, RequestState, Task
from flowprefill.prefill.scheduler.core import CommandKind, Scheduler
from flowprefill.prefill.scheduler.round import (
    Arrival,
    Completion,
    Event,
    Pool,
    PreemptOutcome,
    run_round,
)

_ARRIVAL, _COMPLETION = 0, 1
_Event = tuple[float, int, int, Request | Task, int]

LIVE_PROGRESS = True
"""Whether a round refreshes the running task's progress from the pool, as the engine's
round always does. Off models an earlier engine, which refreshed it only at preemption:
the running task keeps the progress it had when it last started (0 for a fresh task),
which overestimates its remaining time and can sink it as infeasible."""


class _ProgressAtStart:
    """``pool`` as a round of the earlier engine saw it: a running task's progress is what
    it was when the task last started (the value the scheduler already holds)."""

    def __init__(self, pool: Pool) -> None:
        self._pool = pool

    def submit(self, task: Task) -> None:
        self._pool.submit(task)

    def preempt(self, task: Task) -> PreemptOutcome:
        return self._pool.preempt(task)

    def resume(self, task: Task) -> None:
        self._pool.resume(task)

    def cancel(self, task: Task) -> None:
        self._pool.cancel(task)

    def release(self, task: Task) -> None:
        self._pool.release(task)

    def progress(self, task: Task) -> float:
        return task.progress

    def held_bytes(self, task: Task) -> int | None:
        return self._pool.held_bytes(task)


@dataclass(eq=False)
class Instance:
    """One prefill instance: the engine's scheduler, a simulated pool, an event queue."""

    scheduler: Scheduler
    pool: SimulatedPool
    admission: Admission = field(default_factory=AdmitAll)
    live_progress: bool = LIVE_PROGRESS
    num_shed: int = 0
    _events: list[_Event] = field(default_factory=list)
    _seq: itertools.count[int] = field(default_factory=itertools.count)

    @property
    def loop_free_s(self) -> float:
        """When the loop is free again (after the last round's preempts)."""
        return self.pool.now_s

    def post(self, time_s: float, kind: int, payload: Request | Task, token: int = 0) -> None:
        heapq.heappush(self._events, (time_s, next(self._seq), kind, payload, token))

    def next_wake_s(self) -> float:
        events = self._events
        while events and events[0][2] == _COMPLETION:
            _, _, _, task, token = events[0]
            if self.pool.token(task) == token:  # type: ignore[arg-type]
                break
            heapq.heappop(events)  # superseded: the task was preempted or resumed since
        if not events:
            return math.inf
        return max(events[0][0], self.loop_free_s)

    def wake(self, now_s: float, sim: Simulation) -> None:
        queued, pool = self._events, self.pool
        events: list[Event] = []
        while queued and queued[0][0] <= now_s:
            _, _, kind, payload, token = heapq.heappop(queued)
            if kind == _ARRIVAL:
                assert isinstance(payload, Request)
                events.append(Arrival(payload))
            else:
                assert isinstance(payload, Task)
                if pool.token(payload) == token:  # else superseded
                    events.append(Completion(payload, None, None))
        pool.advance_to(now_s)
        out = run_round(
            self.scheduler,
            pool if self.live_progress else _ProgressAtStart(pool),
            events,
            now_s,
            admit=self.admission.admit,
        )
        for _ in out.shed:
            self.num_shed += 1
            sim.count_miss()
        for done in out.completed:
            sim.count_finished(done.task)
        for cmd in out.commands:
            if cmd.kind is not CommandKind.PREEMPT:
                self.post(pool.done_s(cmd.task), _COMPLETION, cmd.task, pool.token(cmd.task) or 0)


@dataclass(slots=True)
class SimResult:
    num_requests: int
    num_met: int
    num_shed: int
    num_missed_seen: int
    stopped_early: bool
    per_class: dict[str, tuple[int, int]]
    """class → (met, total)."""
    ttft_s: list[float | None]
    blocking_s: list[float]
    num_rounds: int
    num_preemptions: int
    first_arrival_s: float
    last_finish_s: float
    num_tokens_done: int
    num_added_checkpoints: int = 0
    """Checkpoints run-time operator splitting added to the tasks submitted."""
    requests: list[Request] = field(default_factory=list)
    """Every request of the run, in arrival order (the order of ``ttft_s``)."""
    decode_start_s: list[float | None] = field(default_factory=list)
    """Per request (same order): when decode holds its KV — first token + hand-off; None
    if its prefill never finished. Empty until a hand-off model is attached
    (:func:`flowprefill.lab.sim.handoff.attach_second_token`)."""
    first_gap_s: list[float | None] = field(default_factory=list)
    """Per request: second token − first token (hand-off + one decode step); as above."""

    @property
    def attainment(self) -> float:
        return self.num_met / self.num_requests if self.num_requests else 0.0

    @property
    def throughput_tokens_per_s(self) -> float:
        span = self.last_finish_s - self.first_arrival_s
        return self.num_tokens_done / span if span > 0 else 0.0

    @property
    def rounds_per_request(self) -> float:
        return self.num_rounds / self.num_requests if self.num_requests else 0.0


class Simulation:
    """Drive requests through ``instances``; ``miss_budget`` stops early once more than
    that many requests have missed (the attainment is then known to be too low)."""

    def __init__(
        self,
        instances: Sequence[Instance],
        *,
        router: Router | None = None,
        miss_budget: int | None = None,
    ) -> None:
        if not instances:
            raise ValueError("a simulation needs at least one instance")
        self.instances = list(instances)
        self.router = router or RoundRobin()
        self.miss_budget = miss_budget
        self._deadlines: list[tuple[float, int, Request]] = []
        self._misses = 0
        self._tokens_done = 0
        self._last_finish_s = 0.0

    def count_miss(self) -> None:
        self._misses += 1

    def count_finished(self, task: Task) -> None:
        for r in task.requests:
            if r.state is RequestState.FINISHED:
                self._tokens_done += r.num_tokens
                self._last_finish_s = max(self._last_finish_s, r.finish_s or 0.0)

    def _expire(self, now_s: float) -> None:
        """Count every request whose deadline passed before ``now_s`` without its token."""
        dl = self._deadlines
        while dl and dl[0][0] < now_s:
            _, _, r = heapq.heappop(dl)
            if r.state is RequestState.CANCELLED:
                continue  # shed: counted when it was shed
            if not (r.state is RequestState.FINISHED and r.met_slo):
                self._misses += 1

    # Hooks for a pool whose instances come and go mid-run (flowprefill/lab/sim/elastic.py);
    # the defaults keep the fixed pool every other experiment uses.
    def routable(self, now_s: float) -> Sequence[Instance]:
        """The instances an arrival at ``now_s`` may be routed to."""
        return self.instances

    def next_tick_s(self) -> float:
        """When the next control step is due (never, for a fixed pool)."""
        return math.inf

    def tick(self, now_s: float) -> None:
        """Run the control step due at ``now_s`` (it may add to ``self.instances``)."""

    def _over_budget(self) -> bool:
        return self.miss_budget is not None and self._misses > self.miss_budget

    def run(self, requests: Sequence[Request]) -> SimResult:
        arrivals = sorted(requests, key=lambda r: (r.arrival_s, r.seq))
        instances = self.instances
        stopped = False
        i, n = 0, len(arrivals)
        while True:
            t_arr = arrivals[i].arrival_s if i < n else math.inf
            inst, wake_s = None, math.inf
            for x in instances:
                w = x.next_wake_s()
                if w < wake_s:
                    inst, wake_s = x, w
            t_tick = self.next_tick_s()
            if t_tick <= min(t_arr, wake_s) and (i < n or inst is not None):
                self.tick(t_tick)  # ticks run only while work remains
            elif t_arr <= wake_s and i < n:
                r = arrivals[i]
                i += 1
                self._expire(t_arr)
                heapq.heappush(self._deadlines, (r.deadline_s, r.seq, r))
                targets = self.routable(t_arr)
                k = self.router.choose(r, targets, t_arr)
                targets[k].post(t_arr, _ARRIVAL, r)
            elif inst is not None:
                self._expire(wake_s)
                inst.wake(wake_s, self)
            else:
                break
            if self._over_budget():
                stopped = True
                break
        if not stopped:
            self._expire(math.inf)
        return self._result(arrivals, stopped)

    def _result(self, arrivals: list[Request], stopped: bool) -> SimResult:
        per_class: dict[str, list[int]] = {}
        num_met = 0
        ttft: list[float | None] = []
        for r in arrivals:
            met = r.state is RequestState.FINISHED and bool(r.met_slo)
            num_met += met
            slot = per_class.setdefault(r.slo_class, [0, 0])
            slot[0] += met
            slot[1] += 1
            ttft.append(r.ttft_s if r.state is RequestState.FINISHED else None)
        scheds = [x.scheduler for x in self.instances]
        return SimResult(
            num_requests=len(arrivals),
            num_met=num_met,
            num_shed=sum(x.num_shed for x in self.instances),
            num_missed_seen=self._misses,
            stopped_early=stopped,
            per_class={k: (v[0], v[1]) for k, v in sorted(per_class.items())},
            ttft_s=ttft,
            blocking_s=[b for x in self.instances for b in x.pool.blocking_s],
            num_rounds=sum(s.stats.num_rounds for s in scheds),
            num_preemptions=sum(s.stats.num_preemptions for s in scheds),
            first_arrival_s=arrivals[0].arrival_s if arrivals else 0.0,
            last_finish_s=self._last_finish_s,
            num_tokens_done=self._tokens_done,
            num_added_checkpoints=sum(x.pool.num_added_checkpoints for x in self.instances),
            requests=arrivals,
        )
