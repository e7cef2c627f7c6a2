"""The provisioning systems the elastic simulation compares, and what they observe.

Every control period the elastic pool (:mod:`flowprefill.lab.sim.elastic`) hands a controller
an :class:`Observed` — the pool's replicas asked / ready / warming, the log of finished
requests, the requests queued right now — and sets the pool to the replica count it
returns. The controllers:

* :class:`Fixed` — a constant count (provisioning for the peak).
* :class:`SloScaler` — ours: :func:`flowprefill.autoscale.policy.decide_prefill` on every
  class's met/missed over the short and the long window (error-budget burn rate).
* :class:`SingleTarget` — what llm-d and Dynamo do: one TTFT target per pool, the
  tightest class's p90 TTFT against its SLO; up when over it, down when well below it.
  It runs the policy's own single-signal rule (:func:`~flowprefill.autoscale.policy.
  decide_decode`, p90 over both windows against a target) with that class's TTFT as the
  signal, so it has exactly our cool-downs, warm-up hold, steps and bounds: only the
  signal differs.
* :class:`QueueHPA` — a Kubernetes HPA on queued requests per replica:
  ``desired = ceil(current × metric / target)``, no change within the 10 % tolerance,
  scale-down stabilized (the highest recommendation of the last window, default 5 min),
  scale-up limited to the default ``max(100 %, 4 pods)`` per step. Replicas still warming
  count with no queue, as the HPA counts not-yet-ready pods when scaling up.

What the controllers see of requests (:class:`Judge`, a choice of the elastic pool):

* ``first-token`` — at its first token, TTFT against the class's SLO
  (``Request.met_slo``); a request still waiting counts only once it finishes (how the
  gateway counted before it counted at the deadline).
* ``deadline`` — a met request counts at its first token; a request whose deadline
  passed without a first token counts as missed then (at the first control step after
  it), as the gateway's timer per request counts it
  (``flowprefill_gateway_slo_requests``). Under overload S-EDF runs the requests that can
  still make it and sinks the late ones, which then wait until the load drops: with
  ``first-token`` the requests that *finish* mostly met, and the misses show up only
  after the overload is over.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Protocol

import numpy as np

from flowprefill.autoscale.policy import (
    ClassSignal,
    PoolObservation,
    ScalerMemory,
    ScalerSettings,
    TpotSignal,
    WindowCounts,
    decide_decode,
    decide_prefill,
)
from flowprefill.prefill.request import Request


class Judge(StrEnum):
    FIRST_TOKEN = "first-token"
    DEADLINE = "deadline"


@dataclass
class _ClassLog:
    finish_s: list[float] = field(default_factory=list)
    num_met: list[int] = field(default_factory=list)
    """Cumulative: requests met among the first k+1 finished."""
    ttft_s: list[float] = field(default_factory=list)


class FinishedLog:
    """Finished requests per class, in finishing order, queried by time window."""

    def __init__(self) -> None:
        self._classes: dict[str, _ClassLog] = {}

    def add(self, slo_class: str, time_s: float, *, met: bool, ttft_s: float) -> None:
        """One judged request at ``time_s`` (kept in time order per class: an entry earlier
        than the class's last one is counted at the last one's time)."""
        log = self._classes.setdefault(slo_class, _ClassLog())
        log.finish_s.append(max(time_s, log.finish_s[-1]) if log.finish_s else time_s)
        log.num_met.append((log.num_met[-1] if log.num_met else 0) + int(met))
        log.ttft_s.append(ttft_s)

    def add_finished(self, request: Request) -> None:
        """A request at its first token, judged as the gateway judges it."""
        ttft, met = request.ttft_s, request.met_slo
        if ttft is None or met is None or request.finish_s is None:
            raise ValueError(f"request {request.request_id} has not finished")
        self.add(request.slo_class, request.finish_s, met=met, ttft_s=ttft)

    @property
    def classes(self) -> list[str]:
        return sorted(self._classes)

    def _start(self, slo_class: str, since_s: float) -> tuple[_ClassLog | None, int]:
        log = self._classes.get(slo_class)
        if log is None:
            return None, 0
        return log, bisect.bisect_right(log.finish_s, since_s)

    def counts(self, slo_class: str, since_s: float) -> WindowCounts:
        """Met / missed of ``slo_class`` among the requests finished after ``since_s``."""
        log, i = self._start(slo_class, since_s)
        if log is None or i >= len(log.finish_s):
            return WindowCounts(0, 0)
        total = len(log.finish_s) - i
        met = log.num_met[-1] - (log.num_met[i - 1] if i > 0 else 0)
        return WindowCounts(met, total - met)

    def p90_ttft_s(self, slo_class: str, since_s: float) -> float | None:
        """p90 TTFT of ``slo_class`` finished after ``since_s`` (None: none finished)."""
        log, i = self._start(slo_class, since_s)
        if log is None or i >= len(log.ttft_s):
            return None
        return float(np.percentile(log.ttft_s[i:], 90))


@dataclass(frozen=True)
class Observed:
    pool: PoolObservation
    log: FinishedLog
    num_queued: int
    """Requests waiting (not running) on the replicas that take traffic, right now."""
    work_s: float = 0.0
    """Device-seconds of prefill work submitted to the pool's replicas so far (cumulative,
    removed replicas included): its increase over a window is the load offered then."""


class Controller(Protocol):
    name: str

    def decide(self, observed: Observed) -> int:
        """Replicas the pool should have from now on."""
        ...


@dataclass(frozen=True)
class Windows:
    """The two windows the autoscalers read (simulated seconds)."""

    short_s: float
    long_s: float

    def __post_init__(self) -> None:
        if not 0 < self.short_s < self.long_s:
            raise ValueError(f"windows must satisfy 0 < short < long, got {self}")


class Fixed:
    name = "fixed"

    def __init__(self, replicas: int) -> None:
        if replicas < 1:
            raise ValueError(f"a fixed pool needs at least 1 replica, got {replicas}")
        self.replicas = replicas

    def decide(self, observed: Observed) -> int:
        return self.replicas


class _PolicyScaler:
    """Keeps the :class:`ScalerMemory` the policy asks its caller to persist."""

    def __init__(self, settings: ScalerSettings, windows: Windows) -> None:
        self.settings = settings
        self.windows = windows
        self.memory = ScalerMemory()
        self.reasons: list[tuple[float, int, int, str]] = []
        """(time, before, after, reason) of every change."""

    def _remember(self, obs: PoolObservation, replicas: int, reason: str) -> int:
        if replicas > obs.replicas:
            self.memory = replace(self.memory, last_scale_up_s=obs.now_s)
        elif replicas < obs.replicas:
            self.memory = replace(self.memory, last_scale_down_s=obs.now_s)
        if replicas != obs.replicas:
            self.reasons.append((obs.now_s, obs.replicas, replicas, reason))
        return replicas


class SloScaler(_PolicyScaler):
    """Ours: every class's error-budget burn over both windows (``decide_prefill``)."""

    name = "slo-burn"

    def __init__(
        self, settings: ScalerSettings, windows: Windows, targets: Mapping[str, float]
    ) -> None:
        super().__init__(settings, windows)
        self.targets = dict(targets)
        self._work: deque[tuple[float, float]] = deque()

    def decide(self, observed: Observed) -> int:
        now, log = observed.pool.now_s, observed.log
        signals = [
            ClassSignal(
                name,
                target,
                log.counts(name, now - self.windows.short_s),
                log.counts(name, now - self.windows.long_s),
            )
            for name, target in sorted(self.targets.items())
        ]
        pool = replace(observed.pool, load=self._load(now, observed.work_s))
        d = decide_prefill(self.settings, pool, self.memory, signals)
        return self._remember(observed.pool, d.replicas, d.reason)

    def _load(self, now_s: float, work_s: float) -> float | None:
        """Work offered over the long window, in replicas' worth (None until the first
        sample is a whole window old): what the operator would read off the engines."""
        self._work.append((now_s, work_s))
        while len(self._work) > 1 and self._work[1][0] <= now_s - self.windows.long_s:
            self._work.popleft()
        then_s, then_work = self._work[0]
        if now_s - then_s < self.windows.long_s * 0.99:
            return None
        return (work_s - then_work) / (now_s - then_s)


class SingleTarget(_PolicyScaler):
    """The peers' rule: the tightest class's p90 TTFT against its SLO. ``settings``'s
    ``tpot_up_ratio`` / ``tpot_down_ratio`` are the up / down thresholds on p90 / SLO."""

    name = "single-target"

    def __init__(
        self, settings: ScalerSettings, windows: Windows, slo_class: str, ttft_slo_s: float
    ) -> None:
        super().__init__(settings, windows)
        self.slo_class = slo_class
        self.ttft_slo_s = ttft_slo_s

    def decide(self, observed: Observed) -> int:
        now, log = observed.pool.now_s, observed.log
        signal = TpotSignal(
            self.ttft_slo_s,
            log.p90_ttft_s(self.slo_class, now - self.windows.short_s),
            log.p90_ttft_s(self.slo_class, now - self.windows.long_s),
        )
        d = decide_decode(self.settings, observed.pool, self.memory, signal)
        return self._remember(observed.pool, d.replicas, d.reason)


@dataclass(frozen=True)
class HPASettings:
    min_replicas: int
    max_replicas: int
    target_queued_per_replica: float
    stabilization_s: float
    """Scale-down stabilization window (Kubernetes default 300 s, time-compressed)."""
    tolerance: float = 0.1
    """No change while metric / target is within 1 ± this (Kubernetes default)."""
    scale_up_pods: int = 4
    scale_up_percent: float = 100.0
    """Default scale-up policy: at most max(+4 pods, +100 %) per step."""


class QueueHPA:
    name = "queue-hpa"

    def __init__(self, settings: HPASettings) -> None:
        if settings.target_queued_per_replica <= 0:
            raise ValueError("the HPA's target must be positive")
        self.settings = settings
        self._recommendations: deque[tuple[float, int]] = deque()

    def decide(self, observed: Observed) -> int:
        s, pool = self.settings, observed.pool
        current = max(1, pool.replicas)
        # Warming replicas have no queue: they pull the average down, as not-yet-ready
        # pods do in the HPA's scale-up calculation.
        metric = observed.num_queued / current
        ratio = metric / s.target_queued_per_replica
        desired = current if abs(ratio - 1.0) <= s.tolerance else math.ceil(current * ratio)
        up_limit = max(
            current + s.scale_up_pods, math.floor(current * (1 + s.scale_up_percent / 100))
        )
        desired = max(s.min_replicas, min(s.max_replicas, up_limit, desired))
        # Scale-down stabilization: the highest recommendation over the window.
        now = pool.now_s
        recs = self._recommendations
        recs.append((now, desired))
        while recs and recs[0][0] < now - s.stabilization_s:
            recs.popleft()
        if desired < pool.replicas:
            desired = min(pool.replicas, max(r for _, r in recs))
        return desired
