"""Pure: a pool's spec, status and observed metrics -> the inputs of the autoscaler's
decision functions (:mod:`flowprefill.autoscale.policy`), and a decision -> status.

No I/O: the autoscale controller reads the cluster and the metric windows, these functions
shape them, the policy decides.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from flowprefill.autoscale.policy import (
    ClassSignal,
    Decision,
    PoolObservation,
    ScalerMemory,
    ScalerSettings,
    TpotSignal,
    WindowCounts,
)

from .attainment import WORK, Counts, tpot_quantile
from .models.autoscaling import AutoscalerStatus, Autoscaling

TPOT_QUANTILE = 0.9
RFC3339 = "%Y-%m-%dT%H:%M:%SZ"


@dataclass(frozen=True)
class ServedClass:
    """An SLO class the pool's service serves, with the targets the autoscaler reads."""

    name: str
    attainment_target: float
    tpot_slo_ms: int | None


def scaler_settings(a: Autoscaling) -> ScalerSettings:
    """The CRD's autoscaling block as the policy's settings."""
    return ScalerSettings(
        min_replicas=a.min_replicas,
        max_replicas=a.max_replicas,
        scale_up_burn_rate=a.scale_up_burn_rate,
        scale_down_burn_rate=a.scale_down_burn_rate,
        scale_up_cooldown_s=float(a.scale_up_cooldown_seconds),
        scale_down_cooldown_s=float(a.scale_down_cooldown_seconds),
        warmup_s=float(a.warmup_seconds),
        max_step_up=a.max_step_up,
        min_requests=float(a.min_requests),
        min_short_requests=float(a.min_short_requests),
        tpot_up_ratio=a.tpot_up_ratio,
        tpot_down_ratio=a.tpot_down_ratio,
    )


def to_epoch(rfc3339: str | None) -> float | None:
    if not rfc3339:
        return None
    try:
        return datetime.strptime(rfc3339, RFC3339).replace(tzinfo=UTC).timestamp()
    except ValueError:
        return None  # garbled: as if never scaled (cool-downs do not hold)


def to_rfc3339(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, UTC).strftime(RFC3339)


def scaler_memory(status: AutoscalerStatus | None) -> ScalerMemory:
    """The cool-down memory, from status (so that a restarted operator keeps it)."""
    status = status or AutoscalerStatus()
    return ScalerMemory(
        last_scale_up_s=to_epoch(status.last_scale_up_time),
        last_scale_down_s=to_epoch(status.last_scale_down_time),
    )


def _pod_ready(pod: Mapping[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def observe_pool(
    now_s: float,
    replicas: int,
    deployment: Mapping[str, Any] | None,
    pods: Sequence[Mapping[str, Any]],
    warmup_s: float,
) -> PoolObservation:
    """Ready replicas from the Deployment's status; warming ones are pods not ready yet and
    created less than ``warmup_s`` ago (pods older than that and still not ready are
    broken, not coming capacity)."""
    ready = int(((deployment or {}).get("status") or {}).get("readyReplicas", 0) or 0)
    warming = 0
    for pod in pods:
        meta = pod.get("metadata") or {}
        if meta.get("deletionTimestamp") or _pod_ready(pod):
            continue
        created = to_epoch(meta.get("creationTimestamp"))
        if created is not None and now_s - created < warmup_s:
            warming += 1
    return PoolObservation(
        now_s=now_s, replicas=replicas, ready_replicas=ready, warming_replicas=warming
    )


def _window(counts: Mapping[str, float] | None) -> WindowCounts:
    counts = counts or {}
    return WindowCounts(met=counts.get("met", 0.0), missed=counts.get("missed", 0.0))


def prefill_load(long: Counts, span_s: float) -> float | None:
    """The prefill work the service's gateways served over the long window, in replicas'
    worth (predicted device-seconds per second); None when the gateways export none (an
    older gateway) or the window is empty."""
    work = [c[WORK] for c in long.values() if WORK in c]
    if not work or span_s <= 0:
        return None
    return sum(work) / span_s


def class_signals(classes: list[ServedClass], short: Counts, long: Counts) -> list[ClassSignal]:
    """Every served class with its met/missed over both windows (zero without traffic)."""
    return [
        ClassSignal(
            name=c.name,
            attainment_target=c.attainment_target,
            short=_window(short.get(c.name)),
            long=_window(long.get(c.name)),
        )
        for c in classes
    ]


def tpot_signal(classes: list[ServedClass], short: Counts, long: Counts) -> TpotSignal | None:
    """The TPOT signal of the class with a ``tpotSloMs`` whose p90 is furthest over (or
    closest to) its target in either window; None when no served class sets one or none
    has TPOT samples."""
    best: tuple[float, str, TpotSignal] | None = None
    for c in classes:
        if c.tpot_slo_ms is None:
            continue
        slo_s = c.tpot_slo_ms / 1000.0
        short_p90 = tpot_quantile(short.get(c.name, {}), TPOT_QUANTILE)
        long_p90 = tpot_quantile(long.get(c.name, {}), TPOT_QUANTILE)
        seen = [p for p in (short_p90, long_p90) if p is not None]
        if not seen:
            continue
        ratio = max(seen) / slo_s
        signal = TpotSignal(slo_s=slo_s, short_p90_s=short_p90, long_p90_s=long_p90)
        if best is None or (ratio, c.name) > (best[0], best[1]):
            best = (ratio, c.name, signal)
    return best[2] if best else None


def next_status(
    previous: AutoscalerStatus | None, decision: Decision, before: int, now_s: float
) -> AutoscalerStatus:
    """Status after ``decision`` was carried out on a pool that had ``before`` replicas."""
    previous = previous or AutoscalerStatus()
    update: dict[str, Any] = {
        "desired_replicas": decision.replicas,
        "reason": decision.reason,
        "driver": decision.driver or "",
    }
    if decision.replicas > before:
        update["last_scale_up_time"] = to_rfc3339(now_s)
    elif decision.replicas < before:
        update["last_scale_down_time"] = to_rfc3339(now_s)
    return previous.model_copy(update=update)
