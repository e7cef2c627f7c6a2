"""The simulator's routers are the gateway's: the same code choosing from the same kind of
in-flight book, kept the same way (booked when sent, out with the first token or when shed).

Each test drives the simulator's router and a gateway pool
(:class:`flowprefill.gateway.routing.InstancePool`) with the same arrivals and the same
first tokens, and both must pick the same instance every time, ties and rotation
included.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from flowprefill.contracts.names import Granularity, Router
from flowprefill.gateway.routing import Instance, InstancePool
from flowprefill.lab.sim.driver import Instance as SimInstance
from flowprefill.lab.sim.driver import Simulation
from flowprefill.lab.sim.gateway import ROUTERS, GatewayRouter, SlackRouter, get_router
from flowprefill.lab.sim.pool import SimulatedPool
from flowprefill.prefill.request import Request, RequestState
from flowprefill.prefill.scheduler.batching import get_batching
from flowprefill.prefill.scheduler.core import Scheduler

from .conftest import ToyCost


def P(n: int) -> float:
    return n / 1000.0  # 1 ms per token, on both sides


@dataclass(eq=False)
class View:
    scheduler: Scheduler


def req(rid: str, tokens: int, slo_s: float, arrival_s: float = 0.0) -> Request:
    return Request.create(rid, arrival_s=arrival_s, ttft_slo_s=slo_s, num_tokens=tokens)


def first_token(r: Request, now_s: float) -> None:
    r.transition(RequestState.RUNNING, now_s)
    r.transition(RequestState.FINISHED, now_s)


class Both:
    """A simulator router and a gateway pool over ``n`` instances, fed the same events."""

    def __init__(self, policy: Router, n: int) -> None:
        self.now_s = 0.0
        self.pool = InstancePool(
            "prefill",
            [f"http://i{k}" for k in range(n)],
            policy=policy,
            predict_s=P,
            clock=lambda: self.now_s,
        )
        self.router = get_router(policy)
        self.views = [View(Scheduler(predict_s=P, batching=get_batching("none"))) for _ in range(n)]
        self.live: list[tuple[Request, Instance]] = []

    def arrive(self, r: Request) -> tuple[int, int]:
        """(simulator's choice, gateway's choice); the gateway books it as failover does."""
        sim = self.router.choose(r, self.views, self.now_s)
        inst = self.pool.pick(deadline_s=r.deadline_s, num_tokens=r.num_tokens)
        self.pool.begin(inst, r.request_id, r.deadline_s, r.num_tokens)
        self.live.append((r, inst))
        return sim, self.pool.instances.index(inst)

    def answer(self, r: Request) -> None:
        """``r``'s first token: the simulator finishes it, the gateway ends its attempt."""
        first_token(r, self.now_s)
        inst = next(i for q, i in self.live if q is r)
        self.pool.end(inst, r.request_id)
        self.live = [(q, i) for q, i in self.live if q is not r]


def test_the_simulator_offers_exactly_the_gateways_routers() -> None:
    assert set(ROUTERS) == set(Router)
    for name in ("slack-aware", "SLACK_AWARE", "least-loaded", "round_robin"):
        assert get_router(name).name is Router.parse(name)


@pytest.mark.parametrize("policy", list(Router))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_same_book_same_choices(policy: Router, seed: int) -> None:
    """Random arrivals (tight and loose SLOs, short and long prompts) and first tokens on
    three instances: the same choice at every arrival."""
    rng = random.Random(seed)
    both = Both(policy, 3)
    choices = []
    for k in range(300):
        both.now_s += rng.expovariate(40.0)
        for r, _ in list(both.live):
            if rng.random() < 0.25:
                both.answer(r)
        new = req(
            f"r{k}",
            rng.choice([1, 50, 400, 2000]),
            rng.choice([0.2, 1.0, 5.0]),
            arrival_s=both.now_s,
        )
        sim, gateway = both.arrive(new)
        assert sim == gateway, (k, new)
        choices.append(sim)
    assert len(set(choices)) == 3  # every instance was chosen: the test saw real choices


def test_slack_aware_counts_work_due_earlier_late_or_not_and_ignores_work_due_later() -> None:
    both = Both(Router.SLACK_AWARE, 2)
    assert both.arrive(req("late", 500, 0.3)) == (0, 0)  # a tie: the rotation starts at 0
    assert both.arrive(req("later", 2000, 10.0)) == (1, 1)  # 0 holds 500 due before it
    both.now_s = 0.1
    # Due before the new request: 500 tokens on 0 (already late), none on 1.
    assert both.arrive(req("new", 100, 1.0, arrival_s=0.1)) == (1, 1)


def test_least_loaded_counts_requests_not_tokens_until_their_first_token() -> None:
    both = Both(Router.LEAST_LOADED, 2)
    long, a, b = req("long", 2000, 10.0), req("a", 10, 10.0), req("b", 10, 10.0)
    assert both.arrive(long) == (0, 0)
    assert both.arrive(a) == (1, 1)
    assert both.arrive(b) == (0, 0)  # one each (2000 tokens vs 10): a tie, rotated to 0
    assert both.arrive(req("c", 10, 10.0)) == (1, 1)  # 0 holds two, 1 one
    both.answer(long)
    both.answer(b)
    assert both.arrive(req("d", 10, 10.0)) == (0, 0)  # 0's answered: it holds none


@pytest.mark.parametrize("router", list(Router))
def test_a_single_instance_gets_everything(router: Router) -> None:
    assert Both(router, 1).arrive(req("new", 10, 1.0)) == (0, 0)


def test_a_simulation_books_what_it_routes_until_the_first_token() -> None:
    """Through the driver: a request stays in its instance's book while it runs, and is
    out of it once done."""

    def instance() -> SimInstance:
        scheduler = Scheduler(predict_s=P, batching=get_batching("none"))
        return SimInstance(scheduler, SimulatedPool(ToyCost(), Granularity.OPERATOR))

    a, b = instance(), instance()
    router: GatewayRouter = SlackRouter()
    long = req("long", 2000, 10.0)
    urgent = req("urgent", 100, 0.2, arrival_s=0.1)
    Simulation([a, b], router=router).run([long, urgent])
    assert urgent.state is RequestState.FINISHED and b.scheduler.stats.num_submits == 1
    after = req("after", 10, 1.0, arrival_s=100.0)
    router.choose(after, [a, b], 100.0)
    books = [router.book(a).in_flight, router.book(b).in_flight]
    assert sorted(rid for book in books for rid in book) == ["after"]
