"""Attainment from gateway counters: parsing, windows, resets, new pods."""

from __future__ import annotations

import pytest
from flowprefill_operator.attainment import AttainmentTracker, parse_slo_counters, scrape
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest


def gateway_metrics(counts: dict[tuple[str, str], int]) -> str:
    """Exposition text as the gateway's prometheus_client would render it."""
    registry = CollectorRegistry()
    c = Counter(
        "flowprefill_gateway_slo_requests", "requests", ["slo_class", "outcome"], registry=registry
    )
    h = Histogram("flowprefill_gateway_ttft_seconds", "ttft", ["slo_class"], registry=registry)
    for (cls, outcome), n in counts.items():
        c.labels(cls, outcome).inc(n)
        h.labels(cls).observe(0.1)
    return generate_latest(registry).decode()


def test_parse_counters_ignores_other_families() -> None:
    text = gateway_metrics({("chat", "met"): 9, ("chat", "missed"): 1, ("file", "met"): 2})
    assert parse_slo_counters(text) == {"chat": {"met": 9.0, "missed": 1.0}, "file": {"met": 2.0}}


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
