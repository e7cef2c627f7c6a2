"""Several gateway replicas in front of the same prefill instances: what each replica's
partial view costs routing.

A deployment runs more than one gateway (for availability and for CPU); a load balancer in
front of them splits the requests, and each gateway routes with its own in-flight book
(:class:`flowprefill.gateway.routing.Instance`): it sees the requests it sent, not its
peers'. :class:`Replicas` is that, as a simulator router: ``n`` replicas of the gateway's
routing (:class:`~flowprefill.lab.sim.gateway.GatewayRouter`, each with its own books and
its own round-robin turn), each request given to one of them by ``split``
(``round-robin``: a load balancer's rotation; ``random``: a hash of the connection).
``n = 1`` is the single gateway the other experiments simulate, exactly.

What the replicas do not model: the instances' load reports
(:class:`~flowprefill.contracts.prefill_api.PrefillLoad`) the gateway passes to admission —
the gateway's routing does not read them either (:func:`flowprefill.gateway.routing.route`
reads the in-flight book alone), so routing here is what the serving router does.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Literal

from flowprefill.bench.workload import Workload
from flowprefill.contracts import names
from flowprefill.lab.sim.cost import CostModel
from flowprefill.lab.sim.driver import SimResult, Simulation
from flowprefill.lab.sim.gateway import SIM_PRIORITIES, GatewayRouter, InstanceView, get_router
from flowprefill.lab.sim.systems import SystemSpec, build_instance, cached_predict, fit_predictor
from flowprefill.prefill.predictor.model import TTFTPredictor
from flowprefill.prefill.request import Request

Split = Literal["round-robin", "random"]
SPLITS: tuple[Split, ...] = ("round-robin", "random")


class Replicas:
    """``n`` gateway replicas running routing policy ``policy``, each with its own view.

    Satisfies :class:`flowprefill.lab.sim.gateway.Router`: the simulation asks it where a
    request goes; it hands the request to one replica (by ``split``; ``seed`` seeds the
    random split), whose own books and turn decide."""

    def __init__(
        self, policy: str | names.Router, n: int, *, split: Split = "round-robin", seed: int = 0
    ) -> None:
        if n < 1:
            raise ValueError(f"gateway replicas: need at least one, got {n}")
        if split not in SPLITS:
            raise ValueError(f"gateway split: one of {SPLITS}, got {split!r}")
        self.replicas: list[GatewayRouter] = [get_router(policy) for _ in range(n)]
        self.name = self.replicas[0].name
        self.split = split
        self._rng = random.Random(seed)
        self._turn = 0

    def choose(self, request: Request, instances: Sequence[InstanceView], now_s: float) -> int:
        if self.split == "random":
            k = self._rng.randrange(len(self.replicas))
        else:
            k = self._turn % len(self.replicas)
            self._turn += 1
        return self.replicas[k].choose(request, instances, now_s)


def run_replicated(
    spec: SystemSpec,
    workload: Workload,
    cost: CostModel,
    *,
    rate: float,
    gateways: int,
    num_instances: int,
    router: str = "slack-aware",
    split: Split = "round-robin",
    predictor: TTFTPredictor | None = None,
    slo_scale: float = 1.0,
    max_blocking_s: float | None = None,
    priorities: Mapping[str, int] = SIM_PRIORITIES,
    seed: int = 0,
) -> SimResult:
    """:func:`flowprefill.lab.sim.systems.run_system` with ``gateways`` replicas of the
    router in front of the ``num_instances`` instances (``gateways=1``: the same run)."""
    predict_s = cached_predict(predictor or fit_predictor(cost))
    instances = [
        build_instance(spec, cost, predict_s, max_blocking_s=max_blocking_s, priorities=priorities)
        for _ in range(num_instances)
    ]
    replicas = Replicas(router, gateways, split=split, seed=seed)
    sim = Simulation(instances, router=replicas)
    return sim.run(workload.requests(rate, slo_scale))
