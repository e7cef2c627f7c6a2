"""The simulator's shedding systems decide as the gateway does: the same function, the
same estimate on the same queues, and only for sheddable classes."""

from __future__ import annotations

from flowprefill.contracts.gateway import OverloadSettings
from flowprefill.contracts.names import Granularity
from flowprefill.gateway.admission import Refuse
from flowprefill.gateway.routing import InstancePool, Placement
from flowprefill.lab.sim.driver import Instance, Simulation
from flowprefill.lab.sim.gateway import SIM_PRIORITIES, ShedQueue, get_admission
from flowprefill.lab.sim.pool import SimulatedPool
from flowprefill.lab.sim.systems import build_instance, get_system
from flowprefill.prefill.request import Request, RequestState
from flowprefill.prefill.scheduler.batching import get_batching
from flowprefill.prefill.scheduler.core import Scheduler

from .conftest import PREDICTOR, ToyCost, req

P = PREDICTOR.predict_s  # 1 ms per token


def _instance(admission: ShedQueue) -> Instance:
    sched = Scheduler(predict_s=P, batching=get_batching("none"))
    return Instance(sched, SimulatedPool(ToyCost(), Granularity.OPERATOR), admission)


def test_only_sheddable_classes_are_shed() -> None:
    inst = _instance(ShedQueue(frozenset({"file"})))
    first = req("a", 0.0, 400, 1.0, cls="text")
    second = req("b", 0.0, 400, 0.7, cls="text")
    doomed_text = req("c", 0.01, 400, 0.75, cls="text")  # 0.8 s > 0.75 s: late, but kept
    doomed_file = req("d", 0.01, 400, 0.75, cls="file")  # the same, sheddable: shed
    result = Simulation([inst]).run([first, second, doomed_text, doomed_file])
    assert result.num_shed == 1 and doomed_file.state is RequestState.CANCELLED
    assert doomed_text.state is RequestState.FINISHED


def test_shedding_systems_use_the_class_priorities() -> None:
    assert SIM_PRIORITIES["file"] < 0
    assert all(p >= 0 for c, p in SIM_PRIORITIES.items() if c != "file")
    shed = build_instance(get_system("fp-shed-queue"), ToyCost(), P).admission
    assert isinstance(shed, ShedQueue) and shed.sheddable == frozenset({"file"})
    nobody = build_instance(get_system("fp-shed"), ToyCost(), P, priorities={"file": 0})
    assert nobody.admission.sheddable == frozenset()  # type: ignore[attr-defined]
    assert get_admission("shed-queue").sheddable is None  # type: ignore[attr-defined]


def test_simulator_and_gateway_refuse_the_same_requests() -> None:
    """One instance, the same queue: the simulator's shed-queue and the gateway's pool."""
    queue = [
        Request.create("q1", arrival_s=0.0, ttft_slo_s=0.5, num_tokens=300),
        Request.create("q2", arrival_s=0.0, ttft_slo_s=0.9, num_tokens=400),
        Request.create("late", arrival_s=0.0, ttft_slo_s=0.1, num_tokens=500),  # doomed
    ]
    now = 0.05
    for slo_s, tokens in ((1.0, 200), (1.0, 400), (0.8, 50), (2.0, 1500), (0.75, 100)):
        new = Request.create("new", arrival_s=now, ttft_slo_s=slo_s, num_tokens=tokens)
        sched = Scheduler(predict_s=P, batching=get_batching("none"))
        pool = InstancePool("prefill", ["http://i0"], predict_s=P, clock=lambda: now)
        for r in queue:
            sched.add(r)
            pool.begin(pool.instances[0], r.request_id, r.deadline_s, r.num_tokens)
        sim_admits = ShedQueue().admit(new, sched, now)
        decision = pool.admit(Placement("new", new.deadline_s, tokens), sheddable=True)
        assert sim_admits is not isinstance(decision, Refuse), (slo_s, tokens)


def test_non_sheddable_classes_are_refused_past_their_useful_wait_as_the_gateway_does() -> None:
    """The gateway's 503 too_late rule: a non-sheddable request predicted past its
    deadline plus its useful wait is refused by the simulator's shedding admission too,
    and the simulator and the gateway's pool agree request by request."""
    overload = OverloadSettings(useful_wait_factor=1.0, useful_wait_floor_s=0.2)
    queue = [
        Request.create(f"q{k}", arrival_s=0.0, ttft_slo_s=1.0, num_tokens=400) for k in range(3)
    ]
    now = 0.05
    for slo_s, tokens in (
        (0.3, 100),
        (0.5, 200),
        (0.5, 900),
        (0.1, 100),
        (1.0, 400),
        (1.0, 1500),
        (0.2, 1000),
    ):
        new = Request.create(
            "new", arrival_s=now, ttft_slo_s=slo_s, num_tokens=tokens, slo_class="text"
        )
        sched = Scheduler(predict_s=P, batching=get_batching("none"))
        pool = InstancePool("prefill", ["http://i0"], predict_s=P, clock=lambda: now)
        for r in queue:
            sched.add(r)
            pool.begin(pool.instances[0], r.request_id, r.deadline_s, r.num_tokens)
        sim_admits = ShedQueue(frozenset({"file"}), overload).admit(new, sched, now)
        decision = pool.admit(
            Placement("new", new.deadline_s, tokens),
            sheddable=False,
            useful_wait_s=overload.useful_wait_s(slo_s),
        )
        assert sim_admits is not isinstance(decision, Refuse), (slo_s, tokens)
        # 1.2 s of work due earlier: past deadline + useful wait (max(slo, 0.2 s)) or not.
        predicted = now + P(1200 + tokens) if slo_s >= 1.0 else now + P(tokens)
        assert sim_admits is (predicted <= new.deadline_s + max(slo_s, 0.2)), (slo_s, tokens)
    # The default useful wait (a 1 s floor) keeps the request a little late in the
    # earlier test; one doomed by far is refused.
    inst = _instance(ShedQueue(frozenset({"file"})))
    hopeless = req("h", 0.0, 3000, 0.5, cls="text")  # 3 s of prefill, 0.5 s target
    result = Simulation([inst]).run([hopeless])
    assert result.num_shed == 1 and hopeless.state is RequestState.CANCELLED
