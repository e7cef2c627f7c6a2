"""The systems compared, by name, and how one simulated run is assembled.

A system is a configuration of the *engine's* scheduler (policy, batching, token budget)
plus how the simulated pool may preempt (granularity, chunk size) and what the gateway
does at arrival (admission). Baselines, ablations and the oracle are just other rows.

Baseline modelling choices (docs/simulator.md, "Systems"):

* DistServe FCFS — ``fcfs`` policy (never preempts), no chunking, ``greedy`` batching to a
  4K-token budget (DistServe batches prefills FCFS up to a token limit).
* DistServe + CP + EDF — ``edf`` policy, ``greedy`` batching with the budget equal to the
  chunk size (vLLM's ``max_num_batched_tokens``), preemption only at chunk boundaries.
  A request is never split *across* tasks to top up a chunk (vLLM would); long prompts run
  alone, chunk after chunk, each chunk paying its pass overhead and the KV re-read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import lru_cache

from flowprefill.bench.workload import Workload
from flowprefill.contracts.names import Granularity
from flowprefill.errors import UnknownNameError
from flowprefill.lab.sim.batching import get_batching
from flowprefill.lab.sim.cost import CostModel
from flowprefill.lab.sim.driver import LIVE_PROGRESS, Instance, SimResult, Simulation
from flowprefill.lab.sim.gateway import SIM_PRIORITIES, get_admission, get_router
from flowprefill.lab.sim.plan import INSTANT, Preemption
from flowprefill.lab.sim.pool import SimulatedPool
from flowprefill.prefill.predictor.model import TTFTPredictor
from flowprefill.prefill.scheduler.core import Scheduler
from flowprefill.prefill.scheduler.memory import ParkedBytesFn, ParkedMemory
from flowprefill.prefill.scheduler.policies import get_policy

OP, LAYER, NONE = Granularity.OPERATOR, Granularity.LAYER, Granularity.NONE


@dataclass(frozen=True, slots=True)
class SystemSpec:
    name: str
    label: str
    policy: str
    batching: str
    token_budget: int
    granularity: Preemption
    chunk_size: int | None = None
    admission: str = "none"
    group: str = "paper"
    """paper | ablation | beyond | oracle"""

    def oracle(self) -> SystemSpec:
        """Same policy, batching and admission; instant, free preemption; no chunks."""
        return replace(
            self,
            name=f"{self.name}@oracle",
            label=f"{self.label} (oracle)",
            granularity=INSTANT,
            chunk_size=None,
            group="oracle",
        )

    @property
    def oracle_key(self) -> tuple[str, str, int, str]:
        return (self.policy, self.batching, self.token_budget, self.admission)


S = SystemSpec
_ALL = (
    S("distserve-fcfs", "DistServe (FCFS)", "fcfs", "greedy", 4096, NONE),
    S("distserve-cp2k", "DistServe-CP2K (EDF)", "edf", "greedy", 2048, NONE, 2048),
    S("distserve-cp8k", "DistServe-CP8K (EDF)", "edf", "greedy", 8192, NONE, 8192),
    S("sedf-layer", "S-EDF, layer preemption", "s-edf", "slo-aware", 4096, LAYER),
    S("flowprefill", "FlowPrefill", "s-edf", "slo-aware", 4096, OP),
    S("edf-op", "EDF, operator", "edf", "slo-aware", 4096, OP, group="ablation"),
    S("dedf-op", "D-EDF, operator", "d-edf", "slo-aware", 4096, OP, group="ablation"),
    S("fp-nobatch", "FlowPrefill, no batching", "s-edf", "none", 4096, OP, group="ablation"),
    S("fp-budget2k", "FlowPrefill, budget 2K", "s-edf", "slo-aware", 2048, OP, group="ablation"),
    S("fp-budget8k", "FlowPrefill, budget 8K", "s-edf", "slo-aware", 8192, OP, group="ablation"),
    S("fp-cp8k", "FlowPrefill + 8K chunks", "s-edf", "slo-aware", 4096, OP, 8192,
      group="ablation"),
    S("fp-member", "FlowPrefill, member-aware", "s-edf", "member-aware", 4096, OP, group="beyond"),
    S("fp-headroom", "FlowPrefill, headroom batching", "s-edf", "headroom", 4096, OP,
      group="beyond"),
    S("fp-plus", "FlowPrefill+ (member-headroom)", "s-edf", "member-headroom", 4096, OP,
      group="beyond"),
    S("fp-shed", "FlowPrefill, shed infeasible", "s-edf", "slo-aware", 4096, OP,
      admission="shed-infeasible", group="beyond"),
    S("fp-shed-queue", "FlowPrefill, shed queue-aware", "s-edf", "slo-aware", 4096, OP,
      admission="shed-queue", group="beyond"),
)  # fmt: skip
SYSTEMS: dict[str, SystemSpec] = {s.name: s for s in _ALL}
PAPER_SYSTEMS = [s.name for s in _ALL if s.group == "paper"]
DEFAULT_SYSTEMS = [s.name for s in _ALL if s.group != "beyond" or s.name == "fp-plus"]
"""Paper systems, ablations, and the beyond-the-paper policy that measurably helps
(benchmarks/sim/beyond.py measures the others)."""


def get_system(name: str) -> SystemSpec:
    spec = SYSTEMS.get(name.lower())
    if spec is None:
        raise UnknownNameError("system", name, list(SYSTEMS))
    return spec


def fit_predictor(
    cost: CostModel, *, max_tokens: int | None = None, max_blocking_s: float | None = None
) -> TTFTPredictor:
    """What ``flowprefill profile`` would fit on this simulated device: a degree-2
    polynomial through solo prefill times at 24 geometric points from 16 tokens — of an
    engine that splits operators at ``max_blocking_s`` when given (it profiles its own
    prefills, split pieces included)."""
    return _fit_cached(cost, max_tokens or cost.max_context_tokens, max_blocking_s)


_FITS: dict[tuple[int, int, float | None], tuple[CostModel, TTFTPredictor]] = {}


def _fit_cached(cost: CostModel, max_tokens: int, max_blocking_s: float | None) -> TTFTPredictor:
    key = (id(cost), max_tokens, max_blocking_s)
    hit = _FITS.get(key)
    if hit is not None and hit[0] is cost:
        return hit[1]
    points = sorted({round(16 * (max_tokens / 16) ** (i / 23)) for i in range(24)})

    def solo_s(n: int) -> float:
        if max_blocking_s is None:
            return cost.pass_cost([(n, 0)]).total_s
        return cost.split_pass_cost([(n, 0)], max_blocking_s).total_s

    samples = [(n, solo_s(n)) for n in points]
    fit = TTFTPredictor.fit(samples, 2, hardware=cost.name, model="simulated")
    _FITS[key] = (cost, fit)
    return fit


def cached_predict(predictor: TTFTPredictor) -> Callable[[int], float]:
    return lru_cache(maxsize=1 << 16)(predictor.predict_s)


def build_instance(
    spec: SystemSpec,
    cost: CostModel,
    predict_s: Callable[[int], float],
    *,
    live_progress: bool = LIVE_PROGRESS,
    max_blocking_s: float | None = None,
    parked_memory_bytes: int | None = None,
    parked_bytes: ParkedBytesFn | None = None,
    priorities: Mapping[str, int] = SIM_PRIORITIES,
) -> Instance:
    """``max_blocking_s`` splits operators at run time (only systems that preempt at
    operator level, as the engine; the baselines are unchanged). ``parked_memory_bytes``
    bounds the bytes parked tasks hold, as the engine's does, with ``parked_bytes`` the
    bound on one task (the simulated pool measures nothing: parked tasks count at it).
    ``priorities``: class -> priority; a shedding system refuses only negative ones."""
    scheduler = Scheduler(
        predict_s=predict_s,
        policy=get_policy(spec.policy),
        batching=get_batching(spec.batching),
        token_budget=spec.token_budget,
        parked_memory=ParkedMemory(parked_memory_bytes, parked_bytes),
    )
    pool = SimulatedPool(cost, spec.granularity, spec.chunk_size, max_blocking_s)
    admission = get_admission(spec.admission, priorities)
    return Instance(scheduler, pool, admission, live_progress=live_progress)


def run_system(
    spec: SystemSpec,
    workload: Workload,
    cost: CostModel,
    *,
    rate: float,
    slo_scale: float = 1.0,
    predictor: TTFTPredictor | None = None,
    num_instances: int = 1,
    router: str = "round-robin",
    miss_budget: int | None = None,
    live_progress: bool = LIVE_PROGRESS,
    max_blocking_s: float | None = None,
    priorities: Mapping[str, int] = SIM_PRIORITIES,
) -> SimResult:
    """One simulated run of ``workload`` at ``rate`` req/s (over all instances)."""
    predict_s = cached_predict(predictor or fit_predictor(cost))
    instances = [
        build_instance(
            spec,
            cost,
            predict_s,
            live_progress=live_progress,
            max_blocking_s=max_blocking_s,
            priorities=priorities,
        )
        for _ in range(num_instances)
    ]
    sim = Simulation(instances, router=get_router(router), miss_budget=miss_budget)
    return sim.run(workload.requests(rate, slo_scale))
