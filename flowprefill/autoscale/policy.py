"""The autoscaler's decisions: how many replicas a prefill or decode pool should have.

Pure: no I/O and no clock (the caller passes ``now_s`` and persists
:class:`ScalerMemory`), so the operator and the simulator run the same rules and tests
replay recorded metric series.

**Prefill** pools serve several SLO classes at once; the class closest to missing its
attainment target drives. Its signal is the error-budget *burn rate* — the fraction of its
requests that missed the TTFT target over the fraction it may miss (``1 −
attainmentTarget``); 1 means the budget is spent exactly as fast as allowed — over a short
and a long window (multiwindow burn-rate alerting, as in the Google SRE workbook, on
minutes instead of days): a burst moves only the short window and is not acted on; a
long window alone is stale. Scale up when both windows burn at least
``scale_up_burn_rate``; scale down when every class burns at most ``scale_down_burn_rate``
in both (the band between is hysteresis) — every class that had any request, however
rare: a small sample of misses holds a scale-down — and, where the caller measures the
pool's load, the replicas left would not be busier than ``max_load_after_down``; or when
the pool has been idle for the whole long window.

**Decode** pools are sized on p90 time per output token against the classes'
``tpotSloMs``: up when both windows are over the target (``tpot_up_ratio``), down when
both are comfortably under it (``tpot_down_ratio``).

Both hold while replicas added earlier are still warming up (their capacity is coming),
respect cool-downs (between scale-ups; after any change before a scale-down), step up in
proportion to the overload (at most ``max_step_up``), step down one replica at a time, and
clamp to ``[min_replicas, max_replicas]``. :func:`fit_budget` then cuts scale-ups that
would take a service's pools together over a GPU budget, most urgent pool first.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class WindowCounts:
    """Requests of one class over one window that met / missed their TTFT target."""

    met: float
    missed: float

    @property
    def total(self) -> float:
        return self.met + self.missed

    @property
    def missed_fraction(self) -> float:
        return self.missed / self.total if self.total > 0 else 0.0


@dataclass(frozen=True)
class ClassSignal:
    """One SLO class a prefill pool serves, over the short and the long window."""

    name: str
    attainment_target: float
    short: WindowCounts
    long: WindowCounts

    def burn_rate(self, window: WindowCounts) -> float:
        """Missed fraction over the error budget (``1 − attainment_target``)."""
        budget = max(1e-9, 1.0 - self.attainment_target)
        return window.missed_fraction / budget


@dataclass(frozen=True)
class TpotSignal:
    """p90 time per output token over both windows (None: no samples) and its target."""

    slo_s: float
    short_p90_s: float | None
    long_p90_s: float | None


@dataclass(frozen=True)
class ScalerSettings:
    """Knobs of one pool's autoscaler (the ServingPool's ``autoscaling`` block)."""

    min_replicas: int
    max_replicas: int
    scale_up_burn_rate: float = 2.0
    """Both windows at 2× the allowed miss rate: a 90 % target then attains ≤ 80 % — a
    real shortfall, not noise (the SRE workbook pages at 14.4× over 1 h for a 30-day
    budget; a pool that can add capacity in minutes acts much earlier)."""
    scale_down_burn_rate: float = 0.5
    """Every class at most half its allowed miss rate in both windows: capacity to spare."""
    scale_up_cooldown_s: float = 60.0
    """Least time between two scale-ups (one short window's worth of fresh evidence)."""
    scale_down_cooldown_s: float = 600.0
    """Least time after any change before a scale-down (removing capacity is the risky
    direction: a burst right after would miss while a pod starts again)."""
    warmup_s: float = 120.0
    """Start-up time of a new replica; the caller counts replicas started less than this
    ago and not ready as ``warming_replicas``."""
    max_step_up: int = 4
    min_requests: float = 20.0
    """Requests of a class the long window needs before its burn rate can scale up (and of
    all classes together before the pool can scale down)."""
    min_short_requests: float = 5.0
    """Requests of a class the short window needs before its burn rate can scale up."""
    tpot_up_ratio: float = 1.0
    """Decode: scale up when p90 TPOT exceeds this × the target in both windows."""
    tpot_down_ratio: float = 0.6
    """Decode: scale down when p90 TPOT is under this × the target in both windows."""
    max_load_after_down: float = 0.7
    """With a measured ``load``: scale down only if the replicas left would be busy at most
    this fraction of the time. Attainment alone says nothing until a pool is nearly
    saturated (queueing delay grows steeply only near full load), so without it a pool
    steps down until it is one short, misses, and overshoots."""


@dataclass(frozen=True)
class PoolObservation:
    now_s: float
    replicas: int
    """Replicas asked for now (``spec.replicas``, what /scale reads)."""
    ready_replicas: int
    warming_replicas: int
    """Started less than ``warmup_s`` ago and not ready yet: capacity on its way."""
    load: float | None = None
    """Prefill work offered over the long window, in replicas' worth (device-seconds of
    work per second); None: not measured, and scale-down goes by attainment alone."""


@dataclass(frozen=True)
class ScalerMemory:
    """What the caller keeps between decisions (the operator: the pool's status)."""

    last_scale_up_s: float | None = None
    last_scale_down_s: float | None = None


@dataclass(frozen=True)
class Decision:
    replicas: int
    reason: str
    """One sentence for an Event and ``status``: what was decided and why."""
    driver: str | None = None
    """The class (or signal) that decided it."""
    pressure: float = 0.0
    """How far over its scale-up threshold the driving signal is (≥ 1 when scaling up);
    :func:`fit_budget` gives GPUs to the highest first."""


def _clamped(settings: ScalerSettings, obs: PoolObservation) -> Decision | None:
    if obs.replicas < settings.min_replicas:
        return Decision(
            settings.min_replicas,
            f"scale up {obs.replicas}→{settings.min_replicas}: below minReplicas",
            pressure=math.inf,
        )
    if obs.replicas > settings.max_replicas:
        return Decision(
            settings.max_replicas,
            f"scale down {obs.replicas}→{settings.max_replicas}: above maxReplicas",
        )
    return None


def _since(now_s: float, then_s: float | None) -> float:
    return math.inf if then_s is None else now_s - then_s


def _up(
    settings: ScalerSettings,
    obs: PoolObservation,
    memory: ScalerMemory,
    pressure: float,
    driver: str,
    why: str,
) -> Decision:
    """Scale up for ``pressure`` (signal / threshold ≥ 1), unless warming or cooling."""
    hold = Decision(obs.replicas, "", driver, pressure)
    if obs.replicas >= settings.max_replicas:
        return replace(hold, reason=f"hold at maxReplicas {obs.replicas}: {why}")
    if obs.warming_replicas > 0:
        return replace(
            hold, reason=f"hold: {obs.warming_replicas} replicas still warming up; {why}"
        )
    waited = _since(obs.now_s, memory.last_scale_up_s)
    if waited < settings.scale_up_cooldown_s:
        return replace(
            hold,
            reason=f"hold: scale-up cool-down ({waited:.0f} of "
            f"{settings.scale_up_cooldown_s:.0f} s); {why}",
        )
    # Proportional: at twice the threshold, twice the replicas (bounded per step).
    step = math.ceil(max(1, obs.replicas) * (min(pressure, 8.0) - 1.0))
    step = max(1, min(settings.max_step_up, step))
    target = min(settings.max_replicas, obs.replicas + step)
    return Decision(target, f"scale up {obs.replicas}→{target}: {why}", driver, pressure)


def _down(
    settings: ScalerSettings, obs: PoolObservation, memory: ScalerMemory, why: str
) -> Decision:
    """Scale down by one, unless at the minimum, warming or cooling."""
    if obs.replicas <= settings.min_replicas:
        return Decision(obs.replicas, f"hold at minReplicas {obs.replicas}: {why}")
    if obs.warming_replicas > 0:
        return Decision(obs.replicas, f"hold: {obs.warming_replicas} replicas warming up; {why}")
    last_change = max(
        (t for t in (memory.last_scale_up_s, memory.last_scale_down_s) if t is not None),
        default=None,
    )
    waited = _since(obs.now_s, last_change)
    if waited < settings.scale_down_cooldown_s:
        return Decision(
            obs.replicas,
            f"hold: scale-down cool-down ({waited:.0f} of "
            f"{settings.scale_down_cooldown_s:.0f} s); {why}",
        )
    target = obs.replicas - 1
    return Decision(target, f"scale down {obs.replicas}→{target}: {why}")


def decide_prefill(
    settings: ScalerSettings,
    observation: PoolObservation,
    memory: ScalerMemory,
    classes: Sequence[ClassSignal],
) -> Decision:
    """Replicas for a prefill pool serving ``classes`` (see the module docstring)."""
    clamped = _clamped(settings, observation)
    if clamped is not None:
        return clamped
    # Scale-up evidence: enough requests in the long window, and in the short one at
    # least min_short_requests (a rare class in a busy pool sees few requests per short
    # window; requiring the long window's count there would leave it unheard).
    judged = [
        c
        for c in classes
        if c.long.total >= settings.min_requests and c.short.total >= settings.min_short_requests
    ]
    worst = max(
        judged, key=lambda c: (min(c.burn_rate(c.short), c.burn_rate(c.long)), c.name), default=None
    )
    burns = ""
    if worst is not None:
        short, long = worst.burn_rate(worst.short), worst.burn_rate(worst.long)
        burns = (
            f"class {worst.name} burns {short:.1f}× its error budget (short window) "
            f"and {long:.1f}× (long)"
        )
        agreed = min(short, long)
        if agreed >= settings.scale_up_burn_rate:
            pressure = agreed / settings.scale_up_burn_rate
            return _up(settings, observation, memory, pressure, worst.name, burns)
    if all(c.long.total == 0 for c in classes):
        return _down(settings, observation, memory, "no requests in the long window")
    # Scale-down evidence: every class that had requests, however few, within budget in
    # each window it has requests in — removing capacity while any class misses (even a
    # rare one, judged on a small sample) is never right — and enough requests in all.
    seen = [c for c in classes if c.long.total > 0]
    hottest = max(
        max(c.burn_rate(c.short) if c.short.total else 0.0, c.burn_rate(c.long)) for c in seen
    )
    total = sum(c.long.total for c in seen)
    if total >= settings.min_requests and hottest <= settings.scale_down_burn_rate:
        why = f"every class within {hottest:.2f}× its error budget in both windows"
        load, left = observation.load, observation.replicas - 1
        if load is not None and left > 0 and load / left > settings.max_load_after_down:
            return Decision(
                observation.replicas,
                f"hold: {why}, but {left} replicas would be {load / left:.0%} busy "
                f"(more than {settings.max_load_after_down:.0%})",
            )
        return _down(settings, observation, memory, why)
    if worst is not None:
        return Decision(observation.replicas, f"hold: {burns}", worst.name)
    return Decision(
        observation.replicas,
        f"hold: too few requests to judge any class ({settings.min_requests:.0f} in the long "
        f"window and {settings.min_short_requests:.0f} in the short one needed)",
    )


def decide_decode(
    settings: ScalerSettings,
    observation: PoolObservation,
    memory: ScalerMemory,
    tpot: TpotSignal,
) -> Decision:
    """Replicas for a decode pool from p90 TPOT against its target."""
    clamped = _clamped(settings, observation)
    if clamped is not None:
        return clamped
    if tpot.short_p90_s is None or tpot.long_p90_s is None:
        return Decision(observation.replicas, "hold: no TPOT samples in one of the windows")
    short, long = tpot.short_p90_s / tpot.slo_s, tpot.long_p90_s / tpot.slo_s
    why = (
        f"p90 TPOT {tpot.short_p90_s * 1e3:.0f} ms (short) and {tpot.long_p90_s * 1e3:.0f} ms "
        f"(long) against a {tpot.slo_s * 1e3:.0f} ms target"
    )
    if min(short, long) >= settings.tpot_up_ratio:
        pressure = min(short, long) / settings.tpot_up_ratio
        return _up(settings, observation, memory, pressure, "tpot", why)
    if max(short, long) <= settings.tpot_down_ratio:
        return _down(settings, observation, memory, why)
    return Decision(observation.replicas, f"hold: {why}", "tpot")


def fit_budget(
    decisions: Mapping[str, Decision],
    gpus_per_replica: Mapping[str, int],
    budget_gpus: int | None,
    current: Mapping[str, int],
) -> dict[str, Decision]:
    """Cut scale-ups so the pools together stay within ``budget_gpus``.

    Scale-downs and holds are kept; the GPUs left over go to scale-ups in order of
    ``pressure`` (most urgent first), each as many replicas as fit. A pool already over
    the budget is never scaled up (nor forced down: that is the scale-down rule's call).
    """
    if budget_gpus is None:
        return dict(decisions)
    wanted = sum(d.replicas * gpus_per_replica[p] for p, d in decisions.items())
    if wanted <= budget_gpus:
        return dict(decisions)
    out: dict[str, Decision] = {}
    ups = []
    for pool, d in decisions.items():
        if d.replicas > current[pool]:
            ups.append(pool)
        else:
            out[pool] = d
    used = sum(out[p].replicas * gpus_per_replica[p] for p in out)
    used += sum(current[p] * gpus_per_replica[p] for p in ups)
    left = budget_gpus - used
    for pool in sorted(ups, key=lambda p: (-decisions[p].pressure, p)):
        d, gpus, now = decisions[pool], gpus_per_replica[pool], current[pool]
        extra = min(d.replicas - now, left // gpus if gpus > 0 else d.replicas - now)
        extra = max(0, extra)
        left -= extra * gpus
        if extra == d.replicas - now:
            out[pool] = d
            continue
        target = now + extra
        out[pool] = Decision(
            target,
            f"{d.reason}; cut to {target} by the GPU budget ({budget_gpus} GPUs for the "
            f"service's pools)",
            d.driver,
            d.pressure,
        )
    return out
