"""Autoscale controller: sizes the pools whose ``replicasOwner`` is ``operator`` and owns
their ``status.autoscaler``; it never touches a pool owned externally (kubectl, an HPA).

Per service, once per ``autoscaleIntervalSeconds`` (any of its pools' timers starts the
round; the others find it done): fold the newest scrape of the service's gateways into
each operator-owned pool's window history (:mod:`flowprefill_operator.history`), call the
pure decision functions of :mod:`flowprefill.autoscale.policy` on its windows, fit them
into the service's GPU budget, write each change through the pool's ``/scale``
subresource (the pool controller then moves its Deployment), post an Event per change,
count it, and record the decision in status.

Everything a decision remembers lives in the pool's ``status.autoscaler``: the scale times
the cool-downs read and the windows' history (written at most once per 1/60 of the long
window, and only while the gateways' counters move). So a restarted operator, or a
standby that takes over when the leader goes (kopf peering: standbys run no timers, so
they neither scrape nor decide), resumes the windows where status left them, and the
traffic while nobody scraped counts (the history's cursor). A pool with no history yet
decides nothing on its first scrape (a baseline).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

import kopf
from pydantic import ValidationError

from flowprefill.autoscale.policy import Decision, decide_decode, decide_prefill, fit_budget

from ..attainment import AttainmentTracker
from ..builders import PoolRef, pool_selector
from ..builders.slotable import selected
from ..history import HistorySettings, WindowHistory, newer, pods_of
from ..kube import ApiError
from ..metrics import OperatorMetrics
from ..models import ServingPoolSpec, ServingPoolStatus
from ..models.autoscaling import AutoscalerHistory, Autoscaling
from ..models.gateway import pool_workload_name
from ..scaling import (
    ServedClass,
    class_signals,
    next_status,
    observe_pool,
    prefill_load,
    scaler_memory,
    scaler_settings,
    tpot_signal,
)
from .common import POOLS, SETTINGS, Body, Context, Event, context, from_memo, parse_status, post
from .indexes import ClassEntry, class_index, classes_of, pool_index, pools_of
from .scraper import LatestScrapes, refresh_attainment

log = logging.getLogger(__name__)

IDLE_UNSEEN = "hold: no requests yet, but the long window has not been observed in full"


class ScalerRounds:
    """When each service's last round ran (monotonic), so the timers of its pools run one
    round per interval between them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[tuple[str, str], float] = {}

    def due(self, namespace: str, service: str, now: float, interval_s: float) -> bool:
        with self._lock:
            last = self._last.get((namespace, service))
            if last is not None and now - last < interval_s / 2:
                return False
            self._last[(namespace, service)] = now
            return True


class Histories:
    """Each operator-owned pool's :class:`WindowHistory` in memory, taken from its status
    whenever status holds a newer one than memory (this process just started, or stood
    by while another replica scaled)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_pool: dict[tuple[str, str], WindowHistory] = {}

    def of(
        self,
        namespace: str,
        name: str,
        role: str,
        auto: Autoscaling,
        persisted: AutoscalerHistory | None,
    ) -> WindowHistory:
        settings = HistorySettings.of(auto.short_window_seconds, auto.long_window_seconds, role)
        with self._lock:
            history = self._by_pool.get((namespace, name))
            if history is None or history.settings != settings or newer(persisted, history):
                if persisted is not None:
                    history = WindowHistory.from_wire(persisted, settings)
                else:
                    history = WindowHistory(settings)
                self._by_pool[(namespace, name)] = history
            return history

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._by_pool.pop((namespace, name), None)


@dataclass
class Scaled:
    """One operator-owned pool in a round: what it was, its windows, what was decided."""

    body: Body
    spec: ServingPoolSpec
    status: ServingPoolStatus
    history: WindowHistory | None = None
    decision: Decision | None = None


def served_classes(peers: list[PoolRef], classes: list[ClassEntry]) -> list[ServedClass]:
    """The classes the service's gateway serves (its pools' selectors), with targets."""
    selectors = [p.spec.slo_class_selector for p in peers]
    return [
        ServedClass(e.name, e.view.spec.attainment_target, e.view.spec.tpot_slo_ms)
        for e in classes
        if e.view.spec is not None and selected(e.view, selectors)
    ]


def decide(
    ctx: Context,
    namespace: str,
    pool: Scaled,
    classes: list[ServedClass],
    now_s: float,
    prefill_replicas: int = 0,
) -> Decision | None:
    """The policy's decision for one pool on its history's windows; None without two
    points in the history (the first scrape is only a baseline)."""
    auto, history = pool.spec.autoscaling, pool.history
    assert auto is not None  # replicasOwner operator requires it
    if history is None or len(history.times) < 2:
        return None
    short, _ = history.increases(auto.short_window_seconds)
    long, long_span_s = history.increases(auto.long_window_seconds)
    name = pool.body["metadata"]["name"]
    observation = observe_pool(
        now_s,
        pool.spec.replicas,
        ctx.kube.get("Deployment", namespace, pool_workload_name(name)),
        ctx.kube.list("Pod", namespace, pool_selector(name)),
        float(auto.warmup_seconds),
    )
    settings, memory = scaler_settings(auto), scaler_memory(pool.status.autoscaler)
    # A colocated pool scales as a prefill pool (docs/operator.md, Colocated pools).
    if pool.spec.runs_prefill:
        signals = class_signals(classes, short, long)
        if (
            long_span_s < auto.long_window_seconds
            and pool.spec.replicas > auto.min_replicas
            and all(c.long.total == 0 for c in signals)
        ):
            # The policy scales an idle pool down; idle means a whole long window without
            # requests, which a just-started operator (or a new pool) has not seen yet.
            return Decision(pool.spec.replicas, IDLE_UNSEEN)
        load = prefill_load(long, long_span_s)
        if load is not None:  # this pool's share: the service's prefill pools split it
            share = pool.spec.replicas / max(1, prefill_replicas)
            observation = replace(observation, load=load * share)
        return decide_prefill(settings, observation, memory, signals)
    tpot = tpot_signal(classes, short, long)
    if tpot is None:  # nothing to size decode on: hold, and say why
        why = (
            "no TPOT samples yet"
            if any(c.tpot_slo_ms is not None for c in classes)
            else "no served SLO class sets tpotSloMs"
        )
        return Decision(replicas=pool.spec.replicas, reason=f"hold: {why}", driver="")
    return decide_decode(settings, observation, memory, tpot)


def budget_gpus(pools: list[Scaled], others: list[PoolRef]) -> int | None:
    """GPUs the operator-owned pools may hold: the smallest budget set on any pool of the
    service, less what its externally owned pools hold; None without a budget."""
    specs = [*(s.spec for s in pools), *(o.spec for o in others)]
    budgets = [
        spec.autoscaling.gpu_budget
        for spec in specs
        if spec.autoscaling is not None and spec.autoscaling.gpu_budget is not None
    ]
    if not budgets:
        return None
    fixed = sum(o.spec.replicas * o.spec.resources.gpus_per_pod for o in others)
    return max(0, min(budgets) - fixed)


def carry_out(ctx: Context, metrics: OperatorMetrics, pool: Scaled, now_s: float) -> list[Event]:
    """Write the decision through /scale (if it changes the replicas) and into status."""
    decision = pool.decision
    assert decision is not None
    meta = pool.body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    before = pool.spec.replicas
    metrics.decided(namespace, name, decision.replicas)
    events = []
    if decision.replicas != before:
        ctx.kube.patch(
            "ServingPool", namespace, name, {"spec": {"replicas": decision.replicas}}, sub="scale"
        )
        metrics.scaled(namespace, name, before, decision.replicas)
        reason = "ScaledUp" if decision.replicas > before else "ScaledDown"
        message = f"{before} -> {decision.replicas} replicas: {decision.reason}"
        events.append(Event("Normal", reason, message))
        log.info("%s/%s %s", namespace, name, message)
    status = next_status(pool.status.autoscaler, decision, before, now_s)
    persisted = status.history
    if pool.history is not None and history_due(persisted, pool.history):
        status = status.model_copy(update={"history": pool.history.wire()})
    if pool.status.autoscaler is None or status.wire() != pool.status.autoscaler.wire():
        ctx.kube.patch(
            "ServingPool", namespace, name, {"status": {"autoscaler": status.wire()}}, sub="status"
        )
    return events


def history_due(persisted: AutoscalerHistory | None, history: WindowHistory) -> bool:
    """Whether the history in memory should replace the one in status: at most once per
    persist step (1/60 of the long window), and only when a gateway counter moved since
    (the cursor in status differs). While nothing moves, status stays as it is: the
    cursor there is still true, so the quiet time counts as quiet in the first point a
    restarted operator adds."""
    last = history.last_time
    if last is None:
        return False
    if persisted is None or not persisted.times:
        return True
    if last - persisted.times[-1] < history.settings.persist_step_s:
        return False
    return history.cursor_wire() != persisted.cursor


@dataclass(frozen=True)
class Memory:
    """The process-wide state a round reads: the namespace tracker the scraper fills,
    the newest scrapes with their wall-clock times, the pools' histories."""

    tracker: AttainmentTracker
    scrapes: LatestScrapes
    histories: Histories


def autoscale_service(
    ctx: Context,
    memory: Memory,
    metrics: OperatorMetrics,
    namespace: str,
    service: str,
    peers: list[PoolRef],
    classes: list[ClassEntry],
) -> list[tuple[Body, Event]]:
    """One round for the service's operator-owned pools; returns the Events to post."""
    with ctx.locks("autoscale", namespace, service):
        refresh_attainment(ctx, memory.tracker, namespace, memory.scrapes)
        scraped = memory.scrapes.get(namespace)
        now_s = time.time()  # wall clock: the decision memory is kept in status
        owned: list[Scaled] = []
        for ref in peers:
            body = ctx.kube.get("ServingPool", namespace, ref.name)  # fresh replicas, status
            if body is None or body["metadata"].get("deletionTimestamp"):
                continue
            try:
                spec = ServingPoolSpec.model_validate(body.get("spec") or {})
            except ValidationError:
                continue  # the pool controller reports it
            if spec.replicas_owner == "operator" and spec.autoscaling is not None:
                status = parse_status(ServingPoolStatus, body.get("status"))
                persisted = status.autoscaler.history if status.autoscaler else None
                history = memory.histories.of(
                    namespace, ref.name, spec.role, spec.autoscaling, persisted
                )
                if scraped is not None:
                    live = [p for p, s in scraped.services.items() if s == service]
                    history.advance(
                        scraped.wall_s, pods_of(scraped.sample, scraped.services, service), live
                    )
                owned.append(Scaled(body, spec, status, history))
        served = served_classes(peers, classes)
        prefill_replicas = sum(p.spec.replicas for p in peers if p.spec.runs_prefill)
        for pool in owned:
            pool.decision = decide(ctx, namespace, pool, served, now_s, prefill_replicas)
        decided = [p for p in owned if p.decision is not None]
        others = [p for p in peers if p.name not in {s.body["metadata"]["name"] for s in owned}]
        budget = budget_gpus(owned, others)
        if budget is not None and decided:
            fitted = fit_budget(
                {p.body["metadata"]["name"]: p.decision for p in decided if p.decision},
                {p.body["metadata"]["name"]: p.spec.resources.gpus_per_pod for p in decided},
                budget,
                {p.body["metadata"]["name"]: p.spec.replicas for p in decided},
            )
            for p in decided:
                p.decision = fitted[p.body["metadata"]["name"]]
        events = []
        for pool in decided:
            events += [(pool.body, e) for e in carry_out(ctx, metrics, pool, now_s)]
        return events


def release(ctx: Context, metrics: OperatorMetrics, memory: Memory, body: kopf.Body) -> None:
    """A pool the autoscaler no longer owns: drop its gauge, its history and its
    status.autoscaler."""
    meta = body["metadata"]
    metrics.forget(meta["namespace"], meta["name"])
    memory.histories.forget(meta["namespace"], meta["name"])
    if (body.get("status") or {}).get("autoscaler") is not None:
        patch = {"status": {"autoscaler": None}}
        ctx.kube.patch("ServingPool", meta["namespace"], meta["name"], patch, sub="status")


@kopf.timer(*POOLS, id="autoscale", interval=SETTINGS.autoscale_interval_s, initial_delay=1.0)
def autoscale(body: kopf.Body, namespace: str | None, memo: kopf.Memo, **kwargs: Any) -> None:
    if namespace is None or body.get("metadata", {}).get("deletionTimestamp"):
        return
    ctx, metrics = context(memo), from_memo(memo, "operator_metrics", OperatorMetrics)
    memory = Memory(
        from_memo(memo, "attainment", AttainmentTracker),
        from_memo(memo, "latest_scrapes", LatestScrapes),
        from_memo(memo, "autoscaler_histories", Histories),
    )
    spec = body.get("spec") or {}
    service = spec.get("service")
    try:
        if spec.get("replicasOwner") != "operator" or not isinstance(service, str):
            release(ctx, metrics, memory, body)  # never writes replicas it does not own
            return
        rounds = from_memo(memo, "scaler_rounds", ScalerRounds)
        if not rounds.due(namespace, service, time.monotonic(), ctx.settings.autoscale_interval_s):
            return
        events = autoscale_service(
            ctx,
            memory,
            metrics,
            namespace,
            service,
            pools_of(pool_index(kwargs), namespace, service),
            classes_of(class_index(kwargs), namespace),
        )
    except ApiError as e:
        log.warning(
            "autoscaling of %s/%s failed (the next round retries): %s", namespace, service, e
        )
        return
    for pool_body, event in events:
        post(pool_body, [event])
