"""The simulator's autoscalers' observations and the HPA baseline; the diurnal day."""

from __future__ import annotations

import pytest

from flowprefill.autoscale.policy import PoolObservation, WindowCounts
from flowprefill.errors import InvalidRequestError
from flowprefill.lab.sim.autoscalers import FinishedLog, HPASettings, Observed, QueueHPA
from flowprefill.lab.sim.diurnal import DiurnalSpec


def test_the_log_counts_met_and_missed_and_p90_within_a_window() -> None:
    log = FinishedLog()
    for i in range(10):
        log.add("text", float(i), met=i % 2 == 0, ttft_s=0.1 * (i + 1))
    log.add("file", 4.5, met=False, ttft_s=9.0)
    assert log.counts("text", 4.0) == WindowCounts(met=2, missed=3)  # 5..9
    assert log.counts("text", -1.0) == WindowCounts(met=5, missed=5)
    assert log.counts("file", 5.0) == WindowCounts(0, 0)
    assert log.counts("image", 0.0) == WindowCounts(0, 0)
    assert log.p90_ttft_s("text", 4.0) == pytest.approx(0.96)  # of 0.6..1.0
    assert log.p90_ttft_s("image", 0.0) is None
    assert log.classes == ["file", "text"]


def _obs(now: float, replicas: int, queued: int) -> Observed:
    return Observed(PoolObservation(now, replicas, replicas, 0), FinishedLog(), queued)


def test_the_hpa_follows_kubernetes_formula_tolerance_and_stabilization() -> None:
    hpa = QueueHPA(HPASettings(1, 10, target_queued_per_replica=2.0, stabilization_s=5.0))
    assert hpa.decide(_obs(0.0, 2, 10)) == 5  # ceil(2 × (10/2) / 2)
    assert hpa.decide(_obs(1.0, 5, 10)) == 5  # at target
    assert hpa.decide(_obs(2.0, 5, 9)) == 5  # 10 % under: within the tolerance
    assert hpa.decide(_obs(2.0, 5, 12)) == 6  # 20 % over: ceil(5 × 1.2)
    assert hpa.decide(_obs(3.0, 5, 0)) == 5  # scale-down waits for the window's highest
    assert hpa.decide(_obs(6.5, 5, 0)) == 5  # t=2's recommendations are within 5 s
    assert hpa.decide(_obs(7.5, 5, 0)) == 1  # all recommendations since t=2.5 say 1
    # Scale-up is limited to max(+4 pods, +100 %) per step, and to max_replicas.
    assert hpa.decide(_obs(8.0, 1, 100)) == 5
    assert hpa.decide(_obs(9.0, 8, 100)) == 10


def test_the_diurnal_day_follows_its_curve_with_bursts() -> None:
    spec = DiurnalSpec(peak_rps=10.0, compression=240.0, num_bursts=2, seed=3)
    assert spec.day_s == 360.0 and spec.burst_s == 2.5
    trough, peak = spec.trough_at * spec.day_s, (spec.trough_at + 0.5) * spec.day_s
    assert spec.base_rate(trough) == pytest.approx(2.5)
    assert spec.base_rate(peak) == pytest.approx(10.0)
    spans = spec.bursts()
    assert len(spans) == 2 and all(0 <= a < b <= spec.day_s for a, b in spans)
    assert spans[0][1] <= spans[1][0]
    inside = (spans[0][0] + spans[0][1]) / 2
    assert spec.rate(inside) == pytest.approx(1.5 * spec.base_rate(inside))
    w = spec.build()
    assert w.arrival_s == tuple(sorted(w.arrival_s)) and w.arrival_s[-1] < spec.day_s
    # Mean rate of the curve is (peak + trough) / 2 = 6.25 req/s over 360 s, plus bursts.
    expected = 6.25 * 360 + sum(0.5 * spec.base_rate((a + b) / 2) * (b - a) for a, b in spans)
    assert abs(len(w) - expected) < 4 * expected**0.5
    assert spec.build() == w  # seeded
    assert set(w.slo_class) == {"text", "image", "search", "file"}


def test_the_diurnal_day_rejects_bad_shapes() -> None:
    with pytest.raises(InvalidRequestError, match="trough_fraction"):
        DiurnalSpec(trough_fraction=0.0)
    with pytest.raises(InvalidRequestError, match="do not fit"):
        DiurnalSpec(num_bursts=100, burst_real_s=3600.0)
