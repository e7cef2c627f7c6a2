"""Gateway-side decisions the simulator can try: admission (shedding) and routing.

Both read an instance's scheduler queues and the scheduler's own ``predict_s``; neither
changes how an instance schedules. All are named, so an experiment is a config change.

Admission (per instance, at arrival, before the request joins ``Q_w``):

* ``none`` — admit everything (the paper).
* ``shed-infeasible`` — reject a request whose slack is already negative at arrival:
  ``deadline − now − predict_s(n) < 0`` even on an idle device. The gateway learns it at
  once and can answer early or reroute instead of letting it wait to miss.
* ``shed-queue`` — also count the work queued ahead of it: the remaining tokens of every
  runnable entry with an earlier deadline that is not already late, predicted as one batch
  together with the new request (optimistic, so only clearly doomed requests go).

Routing (across ``--instances`` prefill instances):

* ``round-robin`` — the baseline.
* ``least-work`` — the instance with the fewest outstanding predicted tokens.
* ``slack`` — the instance where the new request's queue-aware predicted slack is largest
  (ties: the one with less outstanding work).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Protocol

from flowprefill.errors import UnknownNameError
from flowprefill.request import Request, Task
from flowprefill.scheduler.core import Scheduler


class InstanceView(Protocol):
    @property
    def scheduler(self) -> Scheduler: ...


def _remaining_tokens(item: Request | Task) -> float:
    if isinstance(item, Request):
        return float(item.num_tokens)
    return item.num_tokens * max(0.0, 1.0 - item.progress)


def tokens_ahead(scheduler: Scheduler, request: Request, now_s: float) -> float:
    """Remaining tokens of runnable entries due no later than ``request`` and not late."""
    total = 0.0
    for item in scheduler.runnable():
        rank = scheduler.rank_input(item)
        if rank.deadline_s > request.deadline_s:
            continue
        if rank.deadline_s - now_s - rank.predicted_remaining_s < 0:
            continue  # already late: S-EDF sinks it below every feasible request
        total += _remaining_tokens(item)
    return total


def outstanding_tokens(scheduler: Scheduler) -> float:
    return sum(_remaining_tokens(item) for item in scheduler.runnable())


def queue_aware_slack_s(scheduler: Scheduler, request: Request, now_s: float) -> float:
    ahead = tokens_ahead(scheduler, request, now_s)
    return request.deadline_s - now_s - scheduler.predict_s(round(ahead) + request.num_tokens)


class Admission(Protocol):
    name: str

    def admit(self, request: Request, scheduler: Scheduler, now_s: float) -> bool: ...


class AdmitAll:
    name = "none"

    def admit(self, request: Request, scheduler: Scheduler, now_s: float) -> bool:
        return True


class ShedInfeasible:
    name = "shed-infeasible"

    def admit(self, request: Request, scheduler: Scheduler, now_s: float) -> bool:
        return request.deadline_s - now_s - scheduler.predict_s(request.num_tokens) >= 0


class ShedQueue:
    name = "shed-queue"

    def admit(self, request: Request, scheduler: Scheduler, now_s: float) -> bool:
        return queue_aware_slack_s(scheduler, request, now_s) >= 0


ADMISSIONS: dict[str, type[Admission]] = {a.name: a for a in (AdmitAll, ShedInfeasible, ShedQueue)}


def get_admission(name: str) -> Admission:
    cls = ADMISSIONS.get(name.lower())
    if cls is None:
        raise UnknownNameError("admission policy", name, sorted(ADMISSIONS))
    return cls()


class Router(Protocol):
    name: str

    def choose(self, request: Request, instances: Sequence[InstanceView], now_s: float) -> int:
        """Index of the instance that gets ``request``."""
        ...


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self._next = itertools.count()

    def choose(self, request: Request, instances: Sequence[InstanceView], now_s: float) -> int:
        return next(self._next) % len(instances)


class LeastWork:
    name = "least-work"

    def choose(self, request: Request, instances: Sequence[InstanceView], now_s: float) -> int:
        loads = [outstanding_tokens(x.scheduler) for x in instances]
        return loads.index(min(loads))


class SlackRouter:
    name = "slack"

    def choose(self, request: Request, instances: Sequence[InstanceView], now_s: float) -> int:
        # Ties (e.g. the request would preempt whatever runs on either instance) go to the
        # instance with less outstanding work: it has less to block on and to catch up.
        keys = [
            (queue_aware_slack_s(x.scheduler, request, now_s), -outstanding_tokens(x.scheduler))
            for x in instances
        ]
        return keys.index(max(keys))


ROUTERS: dict[str, type[Router]] = {r.name: r for r in (RoundRobin, LeastWork, SlackRouter)}


def get_router(name: str) -> Router:
    cls = ROUTERS.get(name.lower())
    if cls is None:
        raise UnknownNameError("router", name, sorted(ROUTERS))
    return cls()
