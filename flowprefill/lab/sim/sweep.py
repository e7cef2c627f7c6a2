"""The comparison sweep: curves, goodput, tightest SLO scale, oracle and bound per system.

Work is split into independent jobs — one per system, one per distinct oracle — run on
``jobs`` worker processes. Every job is a pure function of the config, so the merged
result is identical for any number of workers and any completion order.
"""

from __future__ import annotations

import math
import multiprocessing
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from tqdm import tqdm

from flowprefill.bench.workload import Workload
from flowprefill.contracts.names import Granularity
from flowprefill.errors import FlowPrefillError, InvalidRequestError
from flowprefill.lab.sim.config import SweepConfig
from flowprefill.lab.sim.cost import CostModel
from flowprefill.lab.sim.handoff import SecondTokenModel, attach_second_token
from flowprefill.lab.sim.search import highest_passing, lowest_passing
from flowprefill.lab.sim.systems import SystemSpec, get_system, run_system
from flowprefill.prefill.predictor.model import TTFTPredictor

REF_RATE_FRACTION = 0.25
"""Default rate of the SLO-scale sweep and the per-class table, as a fraction of the bound."""
RATE_GRID_FRACTIONS = tuple(0.05 * i for i in range(1, 17))
"""Default rate grid of the attainment curves: 5 %, 10 %, …, 80 % of the bound."""
SATURATION_REQUESTS = 600
SATURATION_LOAD = 4.0
"""Saturation throughput: the first 600 requests at 4 × the bound, tokens / makespan."""
CURVE_POINTS_PAST_TARGET = 3
CURVE_FLOOR = 0.3
"""A curve stops at its first point below this attainment; that point's run stops as soon
as its attainment is certain to be below it (deep overload costs O(queue) per round)."""


@dataclass
class RunSummary:
    """One (system, rate, SLO scale) point, pooled over the workload's seeds."""

    rate: float
    slo_scale: float
    attainment: float
    per_class: dict[str, tuple[int, int]]
    blocking_mean_ms: float
    blocking_max_ms: float
    num_preemptions: int
    rounds_per_request: float
    throughput_tokens_per_s: float
    num_shed: int
    stopped_early: bool
    num_added_checkpoints: int = 0
    """Checkpoints operator splitting added (all tasks submitted, all seeds)."""
    first_gap_per_class: dict[str, tuple[int, int]] = field(default_factory=dict)
    """class → (first gaps within the class's TBT SLO, requests of the class with one),
    over the seeds run (:func:`~flowprefill.lab.sim.handoff.attach_second_token`); empty
    without a hand-off model (a CPU ``--profile``)."""
    first_gap_attainment: float | None = None
    """Share of the requests with a TBT SLO whose first gap met it (None: none judged)."""


@dataclass
class SystemOutcome:
    name: str
    label: str
    group: str
    goodput_rps: float
    oracle_goodput_rps: float | None
    tightest_slo_scale: float
    saturation_tokens_per_s: float
    reference: RunSummary
    rate_curve: list[RunSummary] = field(default_factory=list)
    slo_curve: list[RunSummary] = field(default_factory=list)


class Evaluator:
    """Cost model, predictor and workloads of one config; runs and pools simulations."""

    def __init__(self, cfg: SweepConfig) -> None:
        self.cfg = cfg
        self.cost: CostModel = cfg.cost.build()
        self.predictor = cfg.cost.predictor(self.cost)
        self.split_predictor = (
            self.predictor
            if cfg.max_blocking_s is None
            else cfg.cost.predictor(self.cost, cfg.max_blocking_s)
        )
        """What an engine splitting operators profiles (systems preempting at operator
        level); the others' is ``predictor``."""
        self.workloads: list[Workload] = cfg.workload.build(
            cfg.cost.model, self.cost.max_context_tokens
        )
        self.num_requests = sum(len(w) for w in self.workloads)
        self.second_token: SecondTokenModel | None = cfg.second_token_model()
        """Prices each finished request's gap to its second token (``--transport``)."""
        self._bound_rps: float | None = None

    def bound_rps(self) -> float:
        if self._bound_rps is None:
            self._bound_rps = self._compute_bound_rps()
        return self._bound_rps

    def _compute_bound_rps(self) -> float:
        """Work-conserving bound: the rate at which the cheapest ``target`` share of the
        requests' ideal prefill work exactly fills the device(s)."""
        cheap_work_s = 0.0
        for w in self.workloads:
            costs = sorted(self.cost.ideal_cost_s(n) for n in w.num_tokens)
            cheap_work_s += sum(costs[: max(1, math.floor(self.cfg.target * len(costs)))])
        # At rate λ the cheapest share brings λ · cheap_work_s / N seconds of work per second.
        return self.cfg.instances * self.num_requests / cheap_work_s

    def predictor_for(self, spec: SystemSpec) -> TTFTPredictor:
        return self.split_predictor if spec.granularity is Granularity.OPERATOR else self.predictor

    def run(
        self, spec: SystemSpec, rate: float, slo_scale: float, *, stop_below: float | None = None
    ) -> RunSummary:
        """Pooled run; with ``stop_below`` it ends once attainment is sure to be lower."""
        budget = None if stop_below is None else math.floor((1 - stop_below) * self.num_requests)
        met = shed = rounds = preemptions = tokens = added = 0
        span = 0.0
        per_class: dict[str, list[int]] = {}
        first_gap: dict[str, list[int]] = {}
        blocking: list[float] = []
        stopped = False
        for w in self.workloads:
            res = run_system(
                spec,
                w,
                self.cost,
                rate=rate,
                slo_scale=slo_scale,
                predictor=self.predictor_for(spec),
                num_instances=self.cfg.instances,
                router=self.cfg.router,
                miss_budget=budget,
                live_progress=self.cfg.live_progress,
                max_blocking_s=self.cfg.max_blocking_s,
            )
            met += res.num_met
            shed += res.num_shed
            rounds += res.num_rounds
            preemptions += res.num_preemptions
            tokens += res.num_tokens_done
            added += res.num_added_checkpoints
            span += res.last_finish_s - res.first_arrival_s
            blocking.extend(res.blocking_s)
            for c, (m, t) in res.per_class.items():
                slot = per_class.setdefault(c, [0, 0])
                slot[0] += m
                slot[1] += t
            if self.second_token is not None:
                for c, (m, t) in attach_second_token(res, self.second_token).items():
                    slot = first_gap.setdefault(c, [0, 0])
                    slot[0] += m
                    slot[1] += t
            if res.stopped_early:
                stopped = True
                break
            if budget is not None:
                budget -= res.num_missed_seen
        return RunSummary(
            rate=rate,
            slo_scale=slo_scale,
            attainment=met / self.num_requests,
            per_class={c: (v[0], v[1]) for c, v in sorted(per_class.items())},
            blocking_mean_ms=1e3 * statistics.fmean(blocking) if blocking else 0.0,
            blocking_max_ms=1e3 * max(blocking) if blocking else 0.0,
            num_preemptions=preemptions,
            rounds_per_request=rounds / self.num_requests,
            throughput_tokens_per_s=tokens / span if span > 0 else 0.0,
            num_shed=shed,
            stopped_early=stopped,
            num_added_checkpoints=added,
            first_gap_per_class={c: (v[0], v[1]) for c, v in sorted(first_gap.items())},
            first_gap_attainment=_share(first_gap),
        )

    def saturation_tokens_per_s(self, spec: SystemSpec) -> float:
        """Tokens per second with the device never idle (efficiency, SLOs aside)."""
        tokens = 0
        span = 0.0
        for w in self.workloads:
            res = run_system(
                spec,
                w.head(SATURATION_REQUESTS),
                self.cost,
                rate=SATURATION_LOAD * self.bound_rps(),
                predictor=self.predictor_for(spec),
                num_instances=self.cfg.instances,
                router=self.cfg.router,
                live_progress=self.cfg.live_progress,
                max_blocking_s=self.cfg.max_blocking_s,
            )
            tokens += res.num_tokens_done
            span += res.last_finish_s - res.first_arrival_s
        return tokens / span if span > 0 else 0.0

    def passes(self, spec: SystemSpec, rate: float, slo_scale: float) -> bool:
        res = self.run(spec, rate, slo_scale, stop_below=self.cfg.target)
        return not res.stopped_early and res.attainment >= self.cfg.target

    def rate_grid(self) -> list[float]:
        if self.cfg.rates:
            return sorted(self.cfg.rates)
        bound = self.bound_rps()
        return [round(f * bound, 4) for f in RATE_GRID_FRACTIONS]

    def reference_rate(self) -> float:
        return self.cfg.slo_rate or round(REF_RATE_FRACTION * self.bound_rps(), 4)


def _share(counts: dict[str, list[int]]) -> float | None:
    """Met / total over every class of ``counts`` (None when nothing was judged)."""
    total = sum(t for _, t in counts.values())
    return sum(m for m, _ in counts.values()) / total if total else None


_EVALUATORS: dict[str, Evaluator] = {}


def evaluator(cfg: SweepConfig) -> Evaluator:
    """One evaluator per config per process (workers build their own)."""
    key = cfg.model_dump_json()
    ev = _EVALUATORS.get(key)
    if ev is None:
        ev = _EVALUATORS[key] = Evaluator(cfg)
    return ev


def _curve(
    point: Callable[[float], RunSummary], xs: list[float], target: float
) -> list[RunSummary]:
    """Evaluate ``xs`` in order (easiest first) until attainment falls below the floor or
    stays below ``target`` for ``CURVE_POINTS_PAST_TARGET`` points (past the knee every
    point costs more and says less)."""
    out: list[RunSummary] = []
    below = 0
    for x in xs:
        p = point(x)
        out.append(p)
        below = below + 1 if p.attainment < target else 0
        if p.stopped_early or p.attainment < CURVE_FLOOR or below >= CURVE_POINTS_PAST_TARGET:
            break
    return out


def system_job(cfg: SweepConfig, name: str) -> SystemOutcome:
    ev = evaluator(cfg)
    spec = get_system(name)
    target = cfg.target
    rate_curve = _curve(
        lambda r: ev.run(spec, r, 1.0, stop_below=CURVE_FLOOR), ev.rate_grid(), target
    )
    goodput = highest_passing(
        lambda r: ev.passes(spec, r, 1.0),
        [(p.rate, p.attainment >= target) for p in rate_curve],
        guess=ev.bound_rps() / 4,
        rel_tol=cfg.rel_tol,
    )
    ref_rate = ev.reference_rate()
    slo_curve = _curve(
        lambda s: ev.run(spec, ref_rate, s, stop_below=CURVE_FLOOR),
        sorted(cfg.slo_scales, reverse=True),
        target,
    )[::-1]
    tightest = lowest_passing(
        lambda s: ev.passes(spec, ref_rate, s),
        [(p.slo_scale, p.attainment >= target) for p in slo_curve],
        rel_tol=cfg.rel_tol,
    )
    reference = next((p for p in slo_curve if p.slo_scale == 1.0 and not p.stopped_early), None)
    if reference is None:
        reference = ev.run(spec, ref_rate, 1.0)
    return SystemOutcome(
        name=spec.name,
        label=spec.label,
        group=spec.group,
        goodput_rps=goodput,
        oracle_goodput_rps=None,
        tightest_slo_scale=tightest,
        saturation_tokens_per_s=ev.saturation_tokens_per_s(spec),
        reference=reference,
        rate_curve=rate_curve,
        slo_curve=slo_curve,
    )


def oracle_job(cfg: SweepConfig, name: str) -> float:
    ev = evaluator(cfg)
    spec = get_system(name).oracle()
    return highest_passing(
        lambda r: ev.passes(spec, r, 1.0), guess=ev.bound_rps() / 2, rel_tol=cfg.rel_tol
    )


def _job(args: tuple[SweepConfig, str, str]) -> tuple[str, str, Any]:
    cfg, kind, name = args
    try:
        if kind == "system":
            return kind, name, system_job(cfg, name)
        return kind, name, oracle_job(cfg, name)
    except FlowPrefillError as e:
        # Not every error type survives pickling back from a worker: send the message.
        return "error", name, f"{kind} {name}: {e}"


@dataclass
class SweepResult:
    config: dict[str, Any]
    cost_model: str
    predictor_fit: dict[str, Any]
    bound_rps: float
    reference_rate_rps: float
    num_requests: int
    systems: list[SystemOutcome]
    wall_s: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def by_name(self) -> dict[str, SystemOutcome]:
        return {s.name: s for s in self.systems}


def _jobs(cfg: SweepConfig) -> list[tuple[SweepConfig, str, str]]:
    jobs = [(cfg, "system", name) for name in cfg.systems]
    if cfg.oracles:
        seen: dict[tuple[str, str, int, str], str] = {}
        for name in cfg.systems:
            seen.setdefault(get_system(name).oracle_key, name)
        jobs.extend((cfg, "oracle", name) for name in seen.values())
    # Slack-ranked policies keep late requests queued, so their overloaded runs cost the
    # most: start them first so the two workers finish together.
    return sorted(jobs, key=lambda j: (get_system(j[2]).policy not in _SLOW_POLICIES, j[1]))


_SLOW_POLICIES = ("s-edf", "d-edf")


def run_sweep(cfg: SweepConfig, *, progress: bool = True) -> SweepResult:
    cfg.check()
    start = time.perf_counter()
    ev = evaluator(cfg)
    jobs = _jobs(cfg)
    results: dict[tuple[str, str], Any] = {}
    bar = tqdm(total=len(jobs), desc="simulate", unit="job", disable=not progress)
    for kind, name, value in _map(_job, jobs, cfg.jobs):
        if kind == "error":
            raise InvalidRequestError(value)
        results[(kind, name)] = value
        bar.update()
    bar.close()
    oracle_by_key = {
        get_system(name).oracle_key: v for (kind, name), v in results.items() if kind == "oracle"
    }
    outcomes = []
    for name in cfg.systems:
        out: SystemOutcome = results[("system", name)]
        out.oracle_goodput_rps = oracle_by_key.get(get_system(name).oracle_key)
        outcomes.append(out)
    fit = ev.predictor.fit_error
    return SweepResult(
        config=cfg.model_dump(mode="json"),
        cost_model=ev.cost.name,
        predictor_fit={
            "coefficients": ev.predictor.coefficients,
            "error": fit.model_dump() if fit is not None else None,
        },
        bound_rps=ev.bound_rps(),
        reference_rate_rps=ev.reference_rate(),
        num_requests=ev.num_requests,
        systems=outcomes,
        wall_s=time.perf_counter() - start,
    )


def _map(
    fn: Callable[[tuple[SweepConfig, str, str]], tuple[str, str, Any]],
    jobs: list[tuple[SweepConfig, str, str]],
    workers: int,
) -> Iterator[tuple[str, str, Any]]:
    if workers <= 1 or len(jobs) <= 1:
        yield from map(fn, jobs)
        return
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(min(workers, len(jobs))) as pool:
        yield from pool.imap_unordered(fn, jobs)
