"""Pure shaping of the autoscaler's inputs: CRD block -> settings, status <-> cool-down
memory, pods -> observation, windows -> class and TPOT signals, decision -> status."""

from __future__ import annotations

from typing import Any

import pytest
from flowprefill_operator.models.autoscaling import AutoscalerStatus, Autoscaling
from flowprefill_operator.scaling import (
    ServedClass,
    class_signals,
    next_status,
    observe_pool,
    scaler_memory,
    scaler_settings,
    to_epoch,
    to_rfc3339,
    tpot_signal,
)

from flowprefill.autoscale.policy import Decision, ScalerSettings, WindowCounts

NOW = 1_800_000_000.0


def test_settings_map_every_field() -> None:
    a = Autoscaling.model_validate(
        {"minReplicas": 2, "maxReplicas": 9, "scaleUpCooldownSeconds": 30, "warmupSeconds": 45}
    )
    s = scaler_settings(a)
    assert (s.min_replicas, s.max_replicas) == (2, 9)
    assert (s.scale_up_cooldown_s, s.scale_down_cooldown_s, s.warmup_s) == (30.0, 600.0, 45.0)
    assert (s.scale_up_burn_rate, s.scale_down_burn_rate) == (2.0, 0.5)
    assert (s.max_step_up, s.min_requests) == (4, 20)


def test_memory_round_trips_through_status() -> None:
    assert to_epoch(to_rfc3339(NOW)) == NOW
    memory = scaler_memory(AutoscalerStatus(last_scale_up_time=to_rfc3339(NOW)))
    assert (memory.last_scale_up_s, memory.last_scale_down_s) == (NOW, None)
    assert scaler_memory(None).last_scale_up_s is None
    # A garbled time must not freeze the pool in a cool-down forever.
    assert (
        scaler_memory(AutoscalerStatus(last_scale_down_time="yesterday")).last_scale_down_s is None
    )


def pod(age_s: float, ready: bool, deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"creationTimestamp": to_rfc3339(NOW - age_s)}
    if deleting:
        meta["deletionTimestamp"] = to_rfc3339(NOW)
    status = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    return {"metadata": meta, "status": status}


def test_warming_pods_are_young_and_not_ready() -> None:
    pods = [
        pod(10, ready=True),
        pod(10, ready=False),  # starting: coming capacity
        pod(500, ready=False),  # older than the warm-up and still not ready: broken
        pod(5, ready=False, deleting=True),
    ]
    deployment = {"status": {"readyReplicas": 1}}
    o = observe_pool(NOW, 4, deployment, pods, warmup_s=120)
    assert (o.now_s, o.replicas, o.ready_replicas, o.warming_replicas) == (NOW, 4, 1, 1)
    assert observe_pool(NOW, 2, None, [], warmup_s=120).ready_replicas == 0


CLASSES = [ServedClass("chat", 0.9, 50), ServedClass("file", 0.99, None)]


def test_every_served_class_gets_a_signal_zero_without_traffic() -> None:
    short = {"chat": {"met": 9.0, "missed": 1.0, "tpot_le_+Inf": 3.0}}
    long = {"chat": {"met": 90.0, "missed": 10.0}, "file": {"met": 4.0}}
    signals = {s.name: s for s in class_signals(CLASSES, short, long)}
    assert signals["chat"].short == WindowCounts(met=9, missed=1)
    assert signals["chat"].long == WindowCounts(met=90, missed=10)
    assert signals["file"].short == WindowCounts(met=0, missed=0)
    assert (signals["file"].attainment_target, signals["file"].long.met) == (0.99, 4)


def tpot_counts(n_fast: int, n_slow: int) -> dict[str, float]:
    """n_fast samples at <= 0.02 s, n_slow in (0.1, 0.15]."""
    return {
        "tpot_le_0.02": n_fast,
        "tpot_le_0.1": n_fast,
        "tpot_le_0.15": n_fast + n_slow,
        "tpot_le_+Inf": n_fast + n_slow,
    }


def test_tpot_signal_of_the_class_furthest_over_its_target() -> None:
    classes = [ServedClass("chat", 0.9, 50), ServedClass("code", 0.9, 200)]
    counts = {"chat": tpot_counts(9, 1), "code": tpot_counts(0, 10)}
    # chat p90 0.02 (0.4x of 50 ms); code p90 0.145 (0.73x of 200 ms): code drives.
    signal = tpot_signal(classes, counts, counts)
    assert signal is not None and signal.slo_s == 0.2
    assert signal.short_p90_s == pytest.approx(0.145)
    assert tpot_signal(classes, {}, {}) is None  # no samples
    assert tpot_signal([ServedClass("file", 0.9, None)], counts, counts) is None  # no target


def test_status_records_the_decision_and_only_real_scale_times() -> None:
    up = next_status(None, Decision(replicas=3, reason="burn", driver="chat"), 1, NOW)
    assert (up.desired_replicas, up.reason, up.driver) == (3, "burn", "chat")
    assert (up.last_scale_up_time, up.last_scale_down_time) == (to_rfc3339(NOW), None)
    held = next_status(up, Decision(replicas=3, reason="hold", driver="chat"), 3, NOW + 60)
    assert held.last_scale_up_time == to_rfc3339(NOW) and held.last_scale_down_time is None
    down = next_status(held, Decision(replicas=2, reason="idle", driver=""), 3, NOW + 90)
    assert down.last_scale_down_time == to_rfc3339(NOW + 90)
    assert down.last_scale_up_time == to_rfc3339(NOW)


def test_crd_defaults_are_the_policys() -> None:
    ours = scaler_settings(Autoscaling.model_validate({"minReplicas": 1, "maxReplicas": 5}))
    assert ours == ScalerSettings(min_replicas=1, max_replicas=5)
