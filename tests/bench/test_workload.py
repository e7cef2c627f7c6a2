from __future__ import annotations

import numpy as np
import pytest

from flowprefill.bench.workload import QWEN_TYPES, get_slo_table, qwen_like, sharegpt_like
from flowprefill.errors import InvalidRequestError, UnknownNameError


def test_seeded_generation_is_bit_for_bit_reproducible() -> None:
    a = qwen_like(500, seed=7, arrival="gamma")
    b = qwen_like(500, seed=7, arrival="gamma")
    c = qwen_like(500, seed=8, arrival="gamma")
    assert a == b
    assert a.arrival_s != c.arrival_s


def test_lengths_follow_table1() -> None:
    w = qwen_like(60000, seed=1)
    tokens = np.array(w.num_tokens)
    classes = np.array(w.slo_class)
    for t in QWEN_TYPES:
        x = tokens[classes == t.name]
        assert len(x) / len(tokens) == pytest.approx(t.ratio, abs=0.01)
        assert x.mean() == pytest.approx(t.mean, rel=0.05)
        assert x.std() == pytest.approx(t.std, rel=0.1)
        assert np.percentile(x, 99) == pytest.approx(t.p99, rel=0.12)


def test_bursty_arrivals_have_the_requested_cv() -> None:
    gaps = np.diff(qwen_like(40000, seed=2, arrival="gamma", burst_cv=2.5).arrival_s)
    assert gaps.std() / gaps.mean() == pytest.approx(2.5, rel=0.1)
    poisson = np.diff(qwen_like(40000, seed=2).arrival_s)
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.05)


def test_rate_and_slo_scaling() -> None:
    w = qwen_like(100, seed=3)
    slow = w.requests(1.0)
    fast = w.requests(4.0, slo_scale=0.5)
    assert fast[10].arrival_s == pytest.approx(slow[10].arrival_s / 4)
    assert fast[10].ttft_slo_s == pytest.approx(slow[10].ttft_slo_s / 2)
    table = get_slo_table("llama3-8b")
    assert {r.ttft_slo_s for r in slow} <= set(table.values())


def test_sharegpt_like_is_single_slo_below_2k() -> None:
    w = sharegpt_like(2000, seed=0)
    assert set(w.slo_class) == {"text"}
    assert max(w.num_tokens) < 2048


@pytest.mark.parametrize("rate", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_rates_are_rejected_naming_the_flag(rate: float) -> None:
    with pytest.raises(InvalidRequestError, match="--rate"):
        qwen_like(10).requests(rate)


def test_empty_workload_and_unknown_slo_model_are_rejected() -> None:
    with pytest.raises(InvalidRequestError, match="--num-requests"):
        qwen_like(0)
    with pytest.raises(UnknownNameError, match="llama2"):
        qwen_like(10, model="llama2")
