"""Pure shaping of the autoscaler's inputs: CRD block -> settings, status <-> cool-down
memory, pods -> observation, windows -> class and TPOT signals, decision -> status, and
the windows' history (memory <-> status)."""

from __future__ import annotations

from typing import Any

import pytest
from flowprefill_operator.controllers.autoscaler import Histories, history_due
from flowprefill_operator.history import HISTORY_POINTS, HistorySettings, WindowHistory
from flowprefill_operator.models.autoscaling import (
    AutoscalerHistory,
    AutoscalerStatus,
    Autoscaling,
)
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


# The windows' history (flowprefill_operator.history): kept in status so that a restart or
# a fail-over resumes it.

PREFILL_HISTORY = HistorySettings.of(30, 600, "prefill")  # memory: 3 s; status: 10 s


def counters(met: float, missed: float = 0.0, work: float = 0.0) -> dict[str, dict[str, float]]:
    return {"chat": {"met": met, "missed": missed, "prefill_work_s": work, "shed": 1.0}}


def test_history_counts_increases_with_resets_and_new_pods() -> None:
    h = WindowHistory(PREFILL_HISTORY)
    h.advance(NOW, {"gw-a": counters(100)})  # a baseline: totals before are not traffic
    assert h.increases(600) == ({}, 0.0)
    h.advance(NOW + 10, {"gw-a": counters(110, 5)})
    h.advance(NOW + 20, {"gw-a": counters(3), "gw-b": counters(7)})  # a restarted, b new
    long, span = h.increases(600)
    assert span == 20 and long == {"chat": {"met": 20.0, "missed": 5.0}}  # shed is not read
    short, span = h.increases(10)
    assert span == 10 and short == {"chat": {"met": 10.0}}


def test_decode_history_keeps_only_the_tpot_histogram() -> None:
    h = WindowHistory(HistorySettings.of(30, 600, "decode"))
    h.advance(NOW, {"gw": {"chat": {"met": 1.0, "tpot_le_0.05": 1.0, "tpot_le_+Inf": 1.0}}})
    h.advance(NOW + 5, {"gw": {"chat": {"met": 9.0, "tpot_le_0.05": 4.0, "tpot_le_+Inf": 6.0}}})
    assert h.increases(600)[0] == {"chat": {"tpot_le_0.05": 3.0, "tpot_le_+Inf": 5.0}}


def test_history_round_trips_through_status_compact_and_bounded() -> None:
    h = WindowHistory(PREFILL_HISTORY)
    for i in range(0, 1200):  # a scrape a second for twice the long window
        h.advance(NOW + i, {"gw": counters(i * 2, i // 10, i * 0.5)})
    wire = h.wire()
    assert wire is not None
    assert len(wire.times) <= HISTORY_POINTS + 2 and wire.times[-1] == NOW + 1199
    assert wire.times[0] <= NOW + 1199 - 600  # the baseline of the long window is kept
    assert set(wire.counts["chat"]) == {"met", "missed", "prefill_work_s"}
    assert all(len(row) == len(wire.times) - 1 for row in wire.counts["chat"].values())
    assert wire.cursor == {
        "gw": {"chat": {"met": 2398.0, "missed": 119.0, "prefill_work_s": 599.5}}
    }
    # Through the API server (camelCase JSON) and back: the windows read the same.
    restored = WindowHistory.from_wire(
        AutoscalerStatus.model_validate(AutoscalerStatus(history=wire).wire()).history,  # type: ignore[arg-type]
        PREFILL_HISTORY,
    )
    for span in (600, 300, 30):
        assert restored.increases(span) == h.increases(span)


def test_a_restored_history_counts_the_gap_from_its_cursor() -> None:
    h = WindowHistory(PREFILL_HISTORY)
    h.advance(NOW, {"gw": counters(10)})
    h.advance(NOW + 60, {"gw": counters(20)})
    wire = h.wire()
    assert wire is not None
    later = WindowHistory.from_wire(wire, PREFILL_HISTORY)
    # Nobody scraped for 90 s; then: 30 more met and 40 missed, and a new gateway pod.
    later.advance(NOW + 150, {"gw": counters(50, 40), "gw-new": counters(5)})
    long, span = later.increases(600)
    assert span == 150 and long == {"chat": {"met": 45.0, "missed": 40.0}}


def test_a_garbled_history_starts_afresh() -> None:
    bad = AutoscalerHistory(times=[NOW, NOW - 5], counts={}, cursor={"gw": {}})
    assert WindowHistory.from_wire(bad, PREFILL_HISTORY).times == []
    short_rows = AutoscalerHistory(times=[NOW, NOW + 5], counts={"chat": {"met": []}})
    assert WindowHistory.from_wire(short_rows, PREFILL_HISTORY).times == []


def auto(long_s: int = 600) -> Autoscaling:
    return Autoscaling.model_validate(
        {"maxReplicas": 3, "shortWindowSeconds": 30, "longWindowSeconds": long_s}
    )


def test_a_replica_takes_the_newer_history_from_status() -> None:
    """A replica that stood by (kopf peering) keeps an old history in memory; when it
    takes over, status holds the newer one the other replica wrote."""
    stale = WindowHistory(PREFILL_HISTORY)
    stale.advance(NOW, {"gw": counters(0)})
    current = WindowHistory(PREFILL_HISTORY)
    current.advance(NOW, {"gw": counters(0)})
    current.advance(NOW + 300, {"gw": counters(50)})
    histories = Histories()
    assert histories.of("ns", "p", "prefill", auto(), stale.wire()).times == [NOW]
    taken = histories.of("ns", "p", "prefill", auto(), current.wire())
    assert taken.increases(600)[0] == {"chat": {"met": 50.0}}
    # Memory ahead of status (status is written once per persist step): memory stands.
    taken.advance(NOW + 303, {"gw": counters(60)})
    assert histories.of("ns", "p", "prefill", auto(), current.wire()) is taken
    # Other windows: the history is rebuilt from status at the new resolution.
    assert histories.of("ns", "p", "prefill", auto(1200), current.wire()) is not taken


def test_history_is_written_at_most_once_per_persist_step() -> None:
    h = WindowHistory(PREFILL_HISTORY)
    assert not history_due(None, h)  # nothing scraped yet
    h.advance(NOW, {"gw": counters(0)})
    assert history_due(None, h)
    written = h.wire()
    h.advance(NOW + 5, {"gw": counters(1)})
    assert not history_due(written, h)  # 5 s < 10 s (600 s / 60)
    h.advance(NOW + 10, {"gw": counters(2)})
    assert history_due(written, h)
    written = h.wire()
    # Quiet: nothing moved, so status (its cursor still true) is not rewritten; the quiet
    # time counts as zero in the first point a restarted operator adds.
    h.advance(NOW + 60, {"gw": counters(2)})
    assert not history_due(written, h)
    assert written is not None
    resumed = WindowHistory.from_wire(written, PREFILL_HISTORY)
    resumed.advance(NOW + 600, {"gw": counters(2)})
    assert resumed.increases(600) == ({"chat": {"met": 2.0}}, 600.0)


def test_a_gateway_that_missed_a_scrape_is_not_counted_again() -> None:
    h = WindowHistory(PREFILL_HISTORY)
    h.advance(NOW, {"gw": counters(1000)})
    h.advance(NOW + 5, {}, live=["gw"])  # it exists but did not answer (a timeout)
    h.advance(NOW + 10, {"gw": counters(1010)}, live=["gw"])
    assert h.increases(600)[0] == {"chat": {"met": 10.0}}
    # A pod gone for good leaves the cursor; a new one counts from zero.
    h.advance(NOW + 15, {"gw-2": counters(4)}, live=["gw-2"])
    assert h.cursor is not None and set(h.cursor) == {"gw-2"}
    assert h.increases(600)[0] == {"chat": {"met": 14.0}}
