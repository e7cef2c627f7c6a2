"""benchmarks/stack/goodput_search.py: the goodput search of the stack benchmark, driven by
synthetic systems whose attainment falls at a known rate (no servers)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.stack import goodput_search as sb


def search(
    attainment: Callable[[float], float],
    start: float,
    precision: float = 0.1,
    min_rate: float = 0.1,
    max_rate: float = 64.0,
) -> Any:
    bis = sb.Bisection(start=start, precision=precision, min_rate=min_rate, max_rate=max_rate)
    for _ in range(100):
        rate = bis.next_rate()
        if rate is None:
            return bis
        att = attainment(rate)
        bis.add(sb.Probe(rate, att, {"all": {"attainment": att}}, 1.0))
    raise AssertionError("bisection did not finish in 100 probes")


def knee(threshold: float) -> Callable[[float], float]:
    """A system that meets 95 % of its SLOs up to ``threshold`` req/s and 50 % above."""
    return lambda rate: 0.95 if rate <= threshold else 0.5


@given(
    threshold=st.floats(0.3, 40.0),
    start=st.floats(0.2, 50.0),
    precision=st.sampled_from([0.05, 0.1, 0.3]),
)
def test_goodput_is_a_passing_rate_within_the_precision_of_the_knee(
    threshold: float, start: float, precision: float
) -> None:
    bis = search(knee(threshold), start, precision)
    assert bis.goodput <= threshold
    # The bracket closes: the lowest failing rate is above the knee, within the precision.
    assert bis.hi is not None and bis.hi > threshold
    assert bis.hi / bis.goodput <= 1 + precision + 1e-9
    assert threshold / bis.goodput <= 1 + precision + 1e-9


def test_probes_stay_few_for_a_wide_search() -> None:
    bis = search(knee(5.0), start=0.2, precision=0.1)
    # 5 doublings to cross the knee, then about log2(ln 2 / ln 1.1) ≈ 3 halvings of the
    # log-bracket; a linear grid at this precision from 0.2 would need ~40 probes.
    assert len(bis.probes) <= 10


def test_a_system_that_fails_even_the_lowest_rate_has_zero_goodput() -> None:
    bis = search(lambda rate: 0.2, start=4.0, min_rate=0.25)
    assert bis.goodput == 0.0
    assert min(p.rate for p in bis.probes) == pytest.approx(0.25)


def test_a_system_that_passes_the_highest_rate_reports_it() -> None:
    bis = search(lambda rate: 1.0, start=3.0, max_rate=16.0)
    assert bis.goodput == 16.0
    assert bis.hi is None


def test_a_noisy_pass_above_a_failure_ends_the_search_at_the_highest_pass() -> None:
    """Attainment that does not fall with the rate (a noisy machine): the goodput is the
    highest rate that passed, and the search stops instead of oscillating."""
    bis = sb.Bisection(start=2.0, precision=0.1, min_rate=0.1, max_rate=64.0)
    for rate, passed in [(2.0, False), (1.0, True)]:
        assert bis.next_rate() == pytest.approx(rate)
        bis.add(sb.Probe(rate, 0.95 if passed else 0.5, {}, 1.0))
    mid = bis.next_rate()
    assert mid is not None and mid == pytest.approx(math.sqrt(2.0), abs=1e-3)
    bis.add(sb.Probe(mid, 0.95, {}, 1.0))
    bis.add(sb.Probe(3.0, 0.95, {}, 1.0))  # a late pass above the failure
    assert bis.goodput == 3.0
    assert bis.done


def test_attainment_plot_draws_every_class_and_system(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    results = {
        name: {seed: search(knee(k + seed), start=1.0) for seed in (0, 1)}
        for name, k in (("flowprefill", 4.0), ("vllm", 1.0))
    }
    for by_seed in results.values():
        for bis in by_seed.values():
            for p in bis.probes:
                p.classes = {
                    "text": {"attainment": p.attainment},
                    "all": {"attainment": p.attainment},
                }
    out = tmp_path / "attainment.png"
    sb.plot_attainment(out, results, ["text"], {"text": 250.0}, "synthetic")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 10_000
