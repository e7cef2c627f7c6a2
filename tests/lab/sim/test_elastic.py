"""Elastic prefill pool: start-up delay, draining, GPU-time accounting, the control loop.

ToyCost(): 1 ms per token, so a 100-token request runs 0.1 s alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from flowprefill.autoscale.policy import PoolObservation, ScalerSettings
from flowprefill.contracts.names import Granularity
from flowprefill.lab.sim.autoscalers import Judge, Observed, SloScaler, Windows
from flowprefill.lab.sim.driver import Instance
from flowprefill.lab.sim.elastic import ElasticSimulation
from flowprefill.lab.sim.gateway import InstanceView, RoundRobin
from flowprefill.lab.sim.pool import SimulatedPool
from flowprefill.prefill.request import Request, RequestState
from flowprefill.prefill.scheduler.batching import NoBatching
from flowprefill.prefill.scheduler.core import Scheduler
from flowprefill.prefill.scheduler.policies import get_policy

from .conftest import PREDICTOR, ToyCost, req


def make_instance() -> Instance:
    sched = Scheduler(
        predict_s=PREDICTOR.predict_s,
        policy=get_policy("s-edf"),
        batching=NoBatching(),
        token_budget=4096,
    )
    return Instance(sched, SimulatedPool(ToyCost(), Granularity.OPERATOR))


class Scripted:
    """Replicas by time: the last entry whose time has come; records what it saw."""

    name = "scripted"

    def __init__(self, script: Sequence[tuple[float, int]]) -> None:
        self.script = sorted(script)
        self.seen: list[PoolObservation] = []

    def decide(self, observed: Observed) -> int:
        self.seen.append(observed.pool)
        now = observed.pool.now_s
        due = [n for t, n in self.script if t <= now]
        return due[-1] if due else observed.pool.replicas


class RecordingRouter(RoundRobin):
    def __init__(self) -> None:
        super().__init__()
        self.routed: list[tuple[float, list[InstanceView], InstanceView]] = []

    def choose(self, request: Request, instances: Sequence[InstanceView], now_s: float) -> int:
        k = super().choose(request, instances, now_s)
        self.routed.append((now_s, list(instances), instances[k]))
        return k


def elastic(
    script: Sequence[tuple[float, int]],
    *,
    initial: int = 1,
    startup_s: float = 2.0,
    horizon_s: float = 10.0,
    gpus: int = 1,
) -> tuple[ElasticSimulation, Scripted, RecordingRouter]:
    ctl, router = Scripted(script), RecordingRouter()
    sim = ElasticSimulation(
        make_instance,
        ctl,
        initial_replicas=initial,
        startup_s=startup_s,
        period_s=1.0,
        horizon_s=horizon_s,
        router=router,
        gpus_per_replica=gpus,
    )
    return sim, ctl, router


def test_a_new_replica_takes_traffic_only_after_its_start_up_delay() -> None:
    sim, ctl, router = elastic([(1.0, 2)], startup_s=2.0)
    reqs = [req(f"r{i}", 0.25 * i + 0.01, 100, 5.0) for i in range(24)]  # to t = 5.76
    res = sim.run(reqs)
    assert res.num_met == len(reqs)
    new = sim.replicas[1]
    assert (new.started_s, new.ready_s) == (1.0, 3.0)
    # Asked for at t=1: warming (not ready) at the steps before t=3, ready from then on.
    by_time = {o.now_s: o for o in ctl.seen}
    assert (by_time[2.0].replicas, by_time[2.0].ready_replicas) == (2, 1)
    assert by_time[2.0].warming_replicas == 1
    assert by_time[3.0].warming_replicas == 0 and by_time[3.0].ready_replicas == 2
    # The router is offered the new replica only from t=3, and then it does get traffic.
    for t, offered, _ in router.routed:
        assert (new.instance in offered) == (t >= 3.0)
    assert sum(chosen is new.instance for t, _, chosen in router.routed) > 0
    assert new.instance.scheduler.stats.num_rounds > 0


def test_a_removed_replica_drains_its_work_and_gets_nothing_new() -> None:
    sim, _, router = elastic([(1.0, 1)], initial=2, horizon_s=20.0)
    # 1000-token requests (1 s each) every 0.4 s on two replicas: both hold a queue at
    # t=1, when one of them is removed.
    reqs = [req(f"r{i}", 0.4 * i, 1000, 60.0) for i in range(12)]
    sim.run(reqs)
    removed = [r for r in sim.replicas if r.removed_s is not None]
    assert len(removed) == 1 and removed[0].removed_s == 1.0
    gone = removed[0].instance
    assert all(gone not in offered for t, offered, _ in router.routed if t >= 1.0)
    assert all(r.state is RequestState.FINISHED for r in reqs)  # it finished what it had
    # Its GPU is held until its last task finished, after the removal.
    assert removed[0].stopped_s is not None and removed[0].stopped_s > 1.0
    assert removed[0].stopped_s == pytest.approx(gone.pool.now_s)
    assert gone.scheduler.queue_depth == 0


def test_gpu_hours_of_a_hand_made_day() -> None:
    """r0 0→10 (10 s); r1, r2 asked at 1: one removed at 2 (idle: 1 s), one to 10 (9 s);
    r3, r4 asked at 3: the newest removed at 4 while warming (1 s), the other to 10 (7 s).
    28 replica-seconds × 2 GPUs."""
    sim, _, _ = elastic([(1.0, 3), (2.0, 2), (3.0, 4), (4.0, 3)], startup_s=2.0, gpus=2)
    reqs = [req(f"r{i}", 0.5 * i + 0.1, 1, 1.0) for i in range(19)]  # 1 ms each, to 9.1
    sim.run(reqs)
    spans = sorted((r.started_s, r.stopped_s or 10.0) for r in sim.replicas)
    assert spans == [(0.0, 10.0), (1.0, 2.0), (1.0, 10.0), (3.0, 4.0), (3.0, 10.0)]
    assert sum(r.stopped_s is None for r in sim.replicas) == 3  # held to the horizon
    assert sim.gpu_seconds() == pytest.approx(2 * 28.0)
    assert sim.gpu_hours() == pytest.approx(2 * 28.0 / 3600)


def test_ours_scales_up_under_sustained_overload_and_down_when_idle() -> None:
    settings = ScalerSettings(
        min_replicas=1,
        max_replicas=6,
        scale_up_cooldown_s=1.0,
        scale_down_cooldown_s=3.0,
        warmup_s=1.0,
        min_requests=5,
    )
    ctl = SloScaler(settings, Windows(2.0, 6.0), {"x": 0.9})
    sim = ElasticSimulation(
        make_instance,
        ctl,
        initial_replicas=1,
        startup_s=1.0,
        period_s=0.5,
        horizon_s=80.0,
        router=RoundRobin(),
        judge=Judge.DEADLINE,
    )
    # 20 s at twice what one replica serves (0.2 s of work every 0.1 s), then 50 s light.
    heavy = [req(f"h{i}", 0.1 * i, 200, 0.5) for i in range(200)]
    light = [req(f"l{i}", 20.0 + 0.1 * i, 10, 0.5) for i in range(500)]
    sim.run(heavy + light)
    during = [s.replicas for s in sim.samples if s.time_s <= 20.0]
    assert max(during) >= 2  # it added capacity under the overload
    assert ctl.reasons[0][3].startswith("scale up")
    assert sim.samples[-1].replicas == 1  # and gave it back once the load was light
    assert any(reason.startswith("scale down") for *_, reason in ctl.reasons)


def test_the_elastic_pool_rejects_an_empty_start() -> None:
    with pytest.raises(ValueError, match="initial_replicas"):
        ElasticSimulation(
            make_instance, Scripted([]), initial_replicas=0, startup_s=1, period_s=1, horizon_s=1
        )
