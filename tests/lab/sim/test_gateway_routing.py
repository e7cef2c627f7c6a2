"""The simulator's routers are the gateway's: same names, same choice on the same queues.

The gateway (:class:`flowprefill.gateway.routing.InstancePool`) knows what it sent to each
instance; the simulator reads the instances' queues. Both are built here from the same
requests, and both must pick the same instance.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from flowprefill.contracts.names import Router
from flowprefill.gateway.routing import InstancePool
from flowprefill.lab.sim.gateway import ROUTERS, get_router
from flowprefill.prefill.request import Request
from flowprefill.prefill.scheduler.batching import get_batching
from flowprefill.prefill.scheduler.core import Scheduler


def P(n: int) -> float:
    return n / 1000.0  # 1 ms per token, on both sides


@dataclass
class View:
    scheduler: Scheduler


def req(rid: str, tokens: int, slo_s: float, arrival_s: float = 0.0) -> Request:
    return Request.create(rid, arrival_s=arrival_s, ttft_slo_s=slo_s, num_tokens=tokens)


def both_pick(router: Router, queues: list[list[Request]], new: Request, now_s: float) -> tuple:
    """(simulator's choice, gateway's choice) for ``new`` with ``queues`` outstanding."""
    views = []
    pool = InstancePool(
        "prefill", [f"http://i{k}" for k in range(len(queues))], policy=router, predict_s=P
    )
    pool.clock = lambda: now_s
    for inst, queue in zip(pool.instances, queues, strict=True):
        scheduler = Scheduler(predict_s=P, batching=get_batching("none"))
        for r in queue:
            scheduler.add(r)
            pool.begin(inst, r.request_id, r.deadline_s, r.num_tokens)
        views.append(View(scheduler))
    sim = get_router(router).choose(new, views, now_s)
    gateway = pool.pick(deadline_s=new.deadline_s, num_tokens=new.num_tokens)
    return sim, pool.instances.index(gateway)


def test_the_simulator_offers_exactly_the_gateways_routers() -> None:
    assert set(ROUTERS) == set(Router)
    for name in ("slack-aware", "SLACK_AWARE", "least-loaded", "round_robin"):
        assert get_router(name).name is Router.parse(name)


def test_slack_aware_counts_late_work_due_earlier_as_the_gateway_does() -> None:
    # Instance 0 holds a request that is already late (due 0.3 s, 0.5 s of work at 0.1 s);
    # instance 1 a feasible one with less work. Both are due before the new request.
    late = req("late", 500, 0.3)
    feasible = req("ok", 300, 1.0)
    new = req("new", 100, 1.0, arrival_s=0.1)
    # Counting the late work too: slack 1.1 - 0.1 - 0.6 = 0.4 on 0, 0.6 on 1.
    assert both_pick(Router.SLACK_AWARE, [[late], [feasible]], new, 0.1) == (1, 1)


def test_slack_aware_ignores_work_due_later() -> None:
    later = req("later", 2000, 10.0)
    sooner = req("sooner", 300, 0.8)
    new = req("new", 100, 1.0, arrival_s=0.1)
    assert both_pick(Router.SLACK_AWARE, [[sooner], [later]], new, 0.1) == (1, 1)


def test_least_loaded_counts_requests_not_tokens() -> None:
    one_long = [req("long", 2000, 10.0)]
    two_short = [req("a", 10, 10.0), req("b", 10, 10.0)]
    new = req("new", 100, 1.0, arrival_s=0.1)
    assert both_pick(Router.LEAST_LOADED, [two_short, one_long], new, 0.1) == (1, 1)


@pytest.mark.parametrize("router", list(Router))
def test_a_single_instance_gets_everything(router: Router) -> None:
    assert both_pick(router, [[req("a", 10, 1.0)]], req("new", 10, 1.0), 0.0) == (0, 0)
