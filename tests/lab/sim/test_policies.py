"""The simulator's own admission and routing policies, and the batching names it uses.

The batching policies themselves are the engine's (tests/prefill/scheduler/test_batching.py)
and the ablations' (test_batching.py)."""

from __future__ import annotations

import pytest

from flowprefill.contracts.names import Granularity
from flowprefill.errors import UnknownNameError
from flowprefill.lab.sim.batching import SIM_BATCHING, get_batching
from flowprefill.lab.sim.driver import Instance, Simulation
from flowprefill.lab.sim.gateway import (
    ShedInfeasible,
    ShedQueue,
    SlackRouter,
    get_admission,
    get_router,
)
from flowprefill.lab.sim.pool import SimulatedPool
from flowprefill.lab.sim.systems import SYSTEMS, build_instance, get_system
from flowprefill.prefill.request import RequestState
from flowprefill.prefill.scheduler.batching import MemberHeadroomBatching
from flowprefill.prefill.scheduler.core import Scheduler

from .conftest import PREDICTOR, ToyCost, req

P = PREDICTOR.predict_s  # 1 ms per token


def test_every_system_batches_with_the_policy_of_that_name(toy: ToyCost) -> None:
    for spec in SYSTEMS.values():
        inst = build_instance(spec, toy, P)
        assert type(inst.scheduler.batching) is SIM_BATCHING[spec.batching]
    assert type(build_instance(get_system("fp-plus"), toy, P).scheduler.batching) is (
        MemberHeadroomBatching
    )


def test_policy_names() -> None:
    assert get_batching("slo-aware").name == "slo-aware"
    assert get_batching("Greedy").name == "greedy"
    with pytest.raises(UnknownNameError, match="batching"):
        get_batching("fifo")
    with pytest.raises(UnknownNameError, match="admission"):
        get_admission("drop-all")
    with pytest.raises(UnknownNameError, match="routing policy"):
        get_router("random")


def _instance(admission=None) -> Instance:  # type: ignore[no-untyped-def]
    sched = Scheduler(predict_s=P, batching=get_batching("none"))
    inst = Instance(sched, SimulatedPool(ToyCost(), Granularity.OPERATOR))
    if admission is not None:
        inst.admission = admission
    return inst


def test_shed_infeasible_rejects_only_requests_that_cannot_make_it_alone() -> None:
    inst = _instance(ShedInfeasible())
    doomed = req("d", 0.0, 500, 0.2)
    fine = req("f", 0.0, 100, 0.2)
    result = Simulation([inst]).run([doomed, fine])
    assert result.num_shed == 1 and doomed.state is RequestState.CANCELLED
    assert fine.ttft_s == pytest.approx(0.1)
    assert result.num_met == 1


def test_shed_queue_counts_the_work_ahead() -> None:
    inst = _instance(ShedQueue())
    first = req("a", 0.0, 400, 1.0)
    second = req("b", 0.0, 400, 0.7)  # earlier deadline: runs first, 0.4 s
    third = req("c", 0.01, 400, 0.75)  # 0.4 s ahead + 0.4 s own > 0.75 s
    result = Simulation([inst]).run([first, second, third])
    assert result.num_shed == 1 and third.state is RequestState.CANCELLED


def test_slack_router_sends_urgent_work_to_the_idle_instance() -> None:
    a, b = _instance(), _instance()
    long = req("long", 0.0, 2000, 10.0)
    urgent = req("urgent", 0.1, 100, 0.2)
    Simulation([a, b], router=SlackRouter()).run([long, urgent])
    assert urgent.ttft_s == pytest.approx(0.1)
    assert b.scheduler.stats.num_submits == 1
