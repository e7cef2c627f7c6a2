"""Gateway-side decisions the simulator can try: admission (shedding) and routing.

Neither changes how an instance schedules. All are named, so an experiment is a config
change.

Admission (per instance, at arrival, before the request joins ``Q_w``):

* ``none`` — admit everything (the paper).
* ``shed-infeasible`` — reject a request whose slack is already negative at arrival:
  ``deadline − now − predict_s(n) < 0`` even on an idle device. The gateway learns it at
  once and can answer early or reroute instead of letting it wait to miss.
* ``shed-queue`` — also count the work queued ahead of it: the remaining tokens of every
  runnable entry with an earlier deadline that is not already late, predicted as one batch
  together with the new request (optimistic, so only clearly doomed requests go). This is
  the gateway's estimate (:meth:`flowprefill.gateway.routing.InstancePool.admit`), here
  read from the instance's queues.

Both shed only *sheddable* classes — a negative priority, as in the SLOClass CRD — and
decide with the gateway's own function (:func:`flowprefill.gateway.admission.decide`) on
the instance the router chose (:data:`SIM_PRIORITIES`: the paper's task types with
``file`` sheddable, unless a run says otherwise). Built without priorities, every class
is sheddable (the earlier experiment). Any other class is refused as the gateway refuses
it with 503 ``too_late``: predicted past its deadline plus its useful wait
(:class:`~flowprefill.contracts.gateway.OverloadSettings`, the gateway's defaults unless
given). The gateway's other two overload bounds are not simulated: ``expired`` (abandoning
an admitted request still waiting past its useful wait) would need the simulated engine to
cancel a queued request, and ``queue_full`` counts a gateway's waiting requests, which the
simulator's per-instance admission does not see; both only act once the first has let
more in than the instances can serve.

Admission reads an instance's scheduler queues and the scheduler's own ``predict_s``.

Routing (across ``--instances`` prefill instances) is the gateway's own code
(:func:`flowprefill.gateway.routing.route`, by the gateway's names: ``round-robin``,
``least-loaded``, ``slack-aware``; ties rotate) choosing from the same kind of in-flight
book the gateway keeps (:class:`flowprefill.gateway.routing.Instance`), kept as the gateway
keeps it: a request is booked, whole, on the instance it is sent to and leaves the book
with its first token (or when shed). The router never reads an instance's queues, so a
simulated router result measures the serving router. Its predictor is the instances'
(``scheduler.predict_s``), as the gateway's is the engines' TTFT profile.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Protocol

from flowprefill.contracts import names
from flowprefill.contracts.gateway import OverloadSettings
from flowprefill.contracts.slo import PAPER_PRIORITIES
from flowprefill.gateway import routing
from flowprefill.gateway.admission import (
    Estimate,
    Refuse,
    decide,
    is_sheddable,
    predicted_finish_s,
)
from flowprefill.prefill.request import Request, Task
from flowprefill.prefill.scheduler.core import Scheduler


class InstanceView(Protocol):
    @property
    def scheduler(self) -> Scheduler: ...


def _remaining_tokens(item: Request | Task) -> float:
    if isinstance(item, Request):
        return float(item.num_tokens)
    return item.num_tokens * max(0.0, 1.0 - item.progress)


def tokens_ahead(scheduler: Scheduler, request: Request, now_s: float, *, skip_late: bool) -> float:
    """Remaining tokens of runnable entries due no later than ``request``; with
    ``skip_late``, not those already late (S-EDF sinks them below every feasible one)."""
    total = 0.0
    for item in scheduler.runnable():
        rank = scheduler.rank_input(item)
        if rank.deadline_s > request.deadline_s:
            continue
        if skip_late and rank.deadline_s - now_s - rank.predicted_remaining_s < 0:
            continue
        total += _remaining_tokens(item)
    return total


def outstanding_tokens(scheduler: Scheduler) -> float:
    return sum(_remaining_tokens(item) for item in scheduler.runnable())


SIM_PRIORITIES: dict[str, int] = {**PAPER_PRIORITIES, "file": -10}
"""Class priorities of the simulator's shedding systems: the paper's, with ``file`` (the
least urgent task type, 4 % of requests, 14 % of the tokens) sheddable."""


def sheddable_classes(priorities: Mapping[str, int]) -> frozenset[str]:
    return frozenset(c for c, p in priorities.items() if is_sheddable(p))


class Admission(Protocol):
    name: names.Admission

    def admit(self, request: Request, scheduler: Scheduler, now_s: float) -> bool: ...


class _Shed(ABC):
    """Admission by :func:`~flowprefill.gateway.admission.decide` on one instance;
    ``sheddable``: the classes it may shed (None: every class); the others are refused
    past their useful wait (``overload``)."""

    def __init__(
        self, sheddable: frozenset[str] | None = None, overload: OverloadSettings | None = None
    ) -> None:
        self.sheddable = sheddable
        self.overload = overload or OverloadSettings()

    @abstractmethod
    def finish_s(self, request: Request, scheduler: Scheduler, now_s: float) -> float:
        """When ``request``'s first token is predicted on the instance of ``scheduler``."""

    def admit(self, request: Request, scheduler: Scheduler, now_s: float) -> bool:
        sheddable = self.sheddable is None or request.slo_class in self.sheddable
        estimate = Estimate(0, self.finish_s(request, scheduler, now_s))
        decision = decide(
            sheddable=sheddable,
            deadline_s=request.deadline_s,
            estimates=[estimate],
            preferred=0,
            useful_wait_s=self.overload.useful_wait_s(request.ttft_slo_s),
        )
        return not isinstance(decision, Refuse)


class AdmitAll:
    name = names.Admission.NONE

    def admit(self, request: Request, scheduler: Scheduler, now_s: float) -> bool:
        return True


class ShedInfeasible(_Shed):
    name = names.Admission.SHED_INFEASIBLE

    def finish_s(self, request: Request, scheduler: Scheduler, now_s: float) -> float:
        return predicted_finish_s(now_s, 0.0, request.num_tokens, scheduler.predict_s)


class ShedQueue(_Shed):
    name = names.Admission.SHED_QUEUE

    def finish_s(self, request: Request, scheduler: Scheduler, now_s: float) -> float:
        ahead = tokens_ahead(scheduler, request, now_s, skip_late=True)
        return predicted_finish_s(now_s, ahead, request.num_tokens, scheduler.predict_s)


ADMISSIONS: dict[names.Admission, type[Admission]] = {
    a.name: a for a in (AdmitAll, ShedInfeasible, ShedQueue)
}


def get_admission(
    name: str | names.Admission, priorities: Mapping[str, int] | None = None
) -> Admission:
    """Build an admission policy by name, parsed by :meth:`names.Admission.parse`; a
    shedding one refuses only the classes ``priorities`` marks sheddable (None: any)."""
    kind = ADMISSIONS[names.Admission.parse(name)]
    if kind is AdmitAll:
        return AdmitAll()
    sheddable = None if priorities is None else sheddable_classes(priorities)
    return kind(sheddable)  # type: ignore[call-arg]


class Router(Protocol):
    name: names.Router

    def choose(self, request: Request, instances: Sequence[InstanceView], now_s: float) -> int:
        """Index of the instance that gets ``request``."""
        ...


class GatewayRouter:
    """The gateway's routing policy ``name`` (:func:`~flowprefill.gateway.routing.route`)
    over simulated instances, with a gateway in-flight book per instance: ``request`` is
    booked on the instance chosen for it and leaves the book once it has ended (its first
    token: the gateway's prefill answer; or shed)."""

    name: names.Router

    def __init__(self) -> None:
        self._turns = itertools.count()
        self._books: dict[int, tuple[InstanceView, routing.Instance]] = {}
        """id(simulated instance) -> (it, its book); the instance is held so the id stays its."""
        self._sent: dict[str, tuple[Request, routing.Instance]] = {}

    def book(self, instance: InstanceView) -> routing.Instance:
        """``instance``'s in-flight book, as the gateway's pool keeps it."""
        key = id(instance)
        if key not in self._books:
            self._books[key] = (instance, routing.Instance(f"sim-{len(self._books)}"))
        return self._books[key][1]

    def _settle(self) -> None:
        """Take the requests that have ended out of their books."""
        for rid, (request, inst) in list(self._sent.items()):
            if request.is_terminal:
                inst.in_flight.pop(rid, None)
                del self._sent[rid]

    def choose(self, request: Request, instances: Sequence[InstanceView], now_s: float) -> int:
        self._settle()
        books = [self.book(x) for x in instances]
        chosen = routing.route(
            self.name,
            books,
            next(self._turns),
            deadline_s=request.deadline_s,
            num_tokens=request.num_tokens,
            now_s=now_s,
            predict_s=instances[0].scheduler.predict_s,
        )
        chosen.in_flight[request.request_id] = (request.deadline_s, request.num_tokens)
        self._sent[request.request_id] = (request, chosen)
        return books.index(chosen)


class RoundRobin(GatewayRouter):
    name = names.Router.ROUND_ROBIN


class LeastLoaded(GatewayRouter):
    name = names.Router.LEAST_LOADED


class SlackRouter(GatewayRouter):
    name = names.Router.SLACK_AWARE


ROUTERS: dict[names.Router, type[GatewayRouter]] = {
    r.name: r for r in (SlackRouter, RoundRobin, LeastLoaded)
}


def get_router(name: str | names.Router) -> GatewayRouter:
    """Build a router by name, parsed by :meth:`names.Router.parse`."""
    return ROUTERS[names.Router.parse(name)]()
