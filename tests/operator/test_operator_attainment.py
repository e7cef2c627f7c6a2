"""Gateway counters -> windows: parsing, windows of any length, resets, new pods, pods of
one service, TPOT quantiles, shed counts."""

from __future__ import annotations

import math

import pytest
from flowprefill_operator.attainment import (
    WORK,
    AttainmentTracker,
    parse_slo_counters,
    scrape,
    tpot_quantile,
)
from flowprefill_operator.scaling import prefill_load
from prometheus_client import Counter, generate_latest

from flowprefill.contracts.metrics import GATEWAY_SHED, TPOT_BUCKETS_S
from flowprefill.gateway.metrics import GatewayMetrics


def gateway_metrics(
    counts: dict[tuple[str, str], int],
    tpot_s: dict[str, list[float]] | None = None,
    shed: dict[str, int] | None = None,
    work_s: dict[str, float] | None = None,
) -> str:
    """Exposition text as the gateway's own metrics render it: ``counts`` of (class,
    outcome), TPOT samples, shed requests and prefill work (device-seconds) by class."""
    m = GatewayMetrics()
    for (cls, outcome), n in counts.items():
        m.slo_requests.labels(cls, outcome).inc(n)
        m.ttft.labels(cls).observe(0.1)
    for cls, samples in (tpot_s or {}).items():
        for t in samples:
            m.decoded(cls, decode_s=t, num_tokens=2)
    shed_counter = getattr(m, "shed", None)  # the gateway's admission counts it
    if shed_counter is None:
        shed_counter = Counter(GATEWAY_SHED, "shed", ["slo_class"], registry=m.registry)
    for cls, n in (shed or {}).items():
        shed_counter.labels(cls).inc(n)
    for cls, w in (work_s or {}).items():
        m.prefill_work.labels(cls).inc(w)
    return generate_latest(m.registry).decode()


def test_parse_counters_ignores_other_families() -> None:
    text = gateway_metrics({("chat", "met"): 9, ("chat", "missed"): 1, ("file", "met"): 2})
    assert parse_slo_counters(text) == {"chat": {"met": 9.0, "missed": 1.0}, "file": {"met": 2.0}}


def test_parse_reads_prefill_work_and_the_load_follows() -> None:
    text = gateway_metrics({("chat", "met"): 1}, work_s={"chat": 3.0, "file": 9.0})
    counts = parse_slo_counters(text)
    assert counts["chat"][WORK] == 3.0 and counts["file"] == {WORK: 9.0}
    assert prefill_load(counts, span_s=6.0) == 2.0  # 12 device-seconds in 6 s: 2 replicas
    assert prefill_load({"chat": {"met": 1.0}}, span_s=6.0) is None  # an older gateway


def test_parse_reads_shed_and_tpot_buckets() -> None:
    text = gateway_metrics({("chat", "met"): 1}, tpot_s={"chat": [0.004, 0.04]}, shed={"bg": 3})
    counts = parse_slo_counters(text)
    assert counts["bg"] == {"shed": 3.0}
    chat = counts["chat"]
    assert chat["tpot_le_0.005"] == 1 and chat["tpot_le_0.05"] == 2 and chat["tpot_le_+Inf"] == 2
    assert len([k for k in chat if k.startswith("tpot_le_")]) == len(TPOT_BUCKETS_S) + 1


def test_tpot_quantile_interpolates_as_histogram_quantile() -> None:
    # 10 samples: 8 in (0.02, 0.03], 2 in (0.05, 0.075]
    counts = {"tpot_le_0.02": 0, "tpot_le_0.03": 8, "tpot_le_0.05": 8, "tpot_le_0.075": 10}
    counts["tpot_le_+Inf"] = 10
    assert tpot_quantile(counts, 0.5) == pytest.approx(0.02 + 0.01 * 5 / 8)
    assert tpot_quantile(counts, 0.9) == pytest.approx(0.05 + 0.025 * 1 / 2)
    assert tpot_quantile({"tpot_le_1.0": 0, "tpot_le_+Inf": 4}, 0.9) == 1.0  # beyond: top bound
    assert tpot_quantile({"tpot_le_1.0": 0, "tpot_le_+Inf": 0}, 0.9) is None
    assert tpot_quantile({"met": 3}, 0.9) is None
    assert not math.isinf(tpot_quantile({"tpot_le_+Inf": 2}, 0.9) or 0.0)


def test_window_needs_two_samples_and_counts_increase_only() -> None:
    t = AttainmentTracker(window_s=300)
    t.record("ns", 0, {"gw-1": {"chat": {"met": 100, "missed": 50}}})  # history before us
    assert t.window("ns") == {}
    t.record("ns", 30, {"gw-1": {"chat": {"met": 109, "missed": 51}}})
    chat = t.window("ns")["chat"]
    assert (chat.met, chat.missed, chat.requests) == (9, 1, 10)
    assert chat.fraction == pytest.approx(0.9)


def test_counter_reset_new_pod_and_new_class() -> None:
    t = AttainmentTracker(window_s=300)
    t.record("ns", 0, {"gw-1": {"chat": {"met": 10}}})
    t.record(
        "ns",
        10,
        {
            "gw-1": {"chat": {"met": 3}, "file": {"missed": 2}},  # restarted
            "gw-2": {"chat": {"met": 4, "missed": 4}},
        },
    )
    w = t.window("ns")
    assert (w["chat"].met, w["chat"].missed) == (3 + 4, 4)
    assert (w["file"].met, w["file"].missed) == (0, 2)


def test_old_samples_leave_the_window() -> None:
    t = AttainmentTracker(window_s=60)
    for i in range(10):
        t.record("ns", i * 30, {"gw": {"chat": {"met": i * 10}}})
    w = t.window("ns")["chat"]
    assert w.met == 20  # only the last 60 s: 270 -> 240 -> 210 baseline
    assert w.window_s == 60


def test_scrape_survives_one_bad_gateway() -> None:
    def fetch(url: str) -> str:
        if "bad" in url:
            raise OSError("connection refused")
        return gateway_metrics({("chat", "met"): 1})

    sample, errors = scrape({"good": "http://good/metrics", "bad": "http://bad/metrics"}, fetch)
    assert sample == {"good": {"chat": {"met": 1.0}}}
    assert "connection refused" in errors["bad"]


def test_windows_of_any_length_from_the_samples_kept() -> None:
    t = AttainmentTracker(window_s=60)
    t.keep(300)
    for i in range(11):  # one scrape every 30 s, 10 requests each, every 5th missed
        t.record("ns", i * 30, {"gw": {"chat": {"met": i * 8, "missed": i * 2}}})
    short, short_span = t.increases("ns", 60)
    long, long_span = t.increases("ns", 300)
    assert (short["chat"], short_span) == ({"met": 16, "missed": 4}, 60)
    assert (long["chat"], long_span) == ({"met": 80, "missed": 20}, 300)
    everything, span = t.increases("ns", 10_000)  # longer than kept: all that is there
    assert span == 300 and everything["chat"]["met"] == 80
    assert t.window("ns")["chat"].requests == 20  # SLOClass status' window unchanged


def test_increases_of_one_services_gateways() -> None:
    t = AttainmentTracker(window_s=300)
    groups = {"a-gw": "a", "b-gw": "b"}
    t.record("ns", 0, {"a-gw": {"chat": {"met": 1}}, "b-gw": {"chat": {"met": 1}}}, groups)
    t.record("ns", 30, {"a-gw": {"chat": {"met": 4}}, "b-gw": {"chat": {"met": 11}}}, groups)
    assert t.increases("ns", 300, "a")[0] == {"chat": {"met": 3}}
    assert t.increases("ns", 300, "b")[0] == {"chat": {"met": 10}}
    assert t.increases("ns", 300)[0] == {"chat": {"met": 13}}
    assert t.increases("ns", 300, "c")[0] == {}


def test_shed_counts_reach_the_window() -> None:
    t = AttainmentTracker(window_s=300)
    t.record("ns", 0, {"gw": {"bg": {"shed": 5}}})
    t.record("ns", 30, {"gw": {"bg": {"shed": 12, "met": 1}}})
    bg = t.window("ns")["bg"]
    assert (bg.shed, bg.requests) == (7, 1)
