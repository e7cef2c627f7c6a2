from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from flowprefill.errors import InvalidRequestError
from flowprefill.prefill.predictor.model import TTFTPredictor
from flowprefill.prefill.predictor.profile import profile, sweep_points


def test_fit_recovers_a_quadratic() -> None:
    truth = lambda n: 0.004 + 2e-5 * n + 3e-9 * n * n  # noqa: E731
    samples = [(n, truth(n)) for n in (32, 64, 128, 256, 512, 1024, 2048, 4096)]
    p = TTFTPredictor.fit(samples, degree=2)
    for n in (48, 700, 3000, 8000):
        assert p.predict_s(n) == pytest.approx(truth(n), rel=1e-6)
    assert p.fit_error is not None and p.fit_error.max_abs_pct < 1e-4


def test_round_trip_and_versioning(tmp_path: Path) -> None:
    p = TTFTPredictor.fit([(10, 0.01), (100, 0.05), (1000, 0.6)], degree=1, model="m")
    path = tmp_path / "profile.json"
    p.save(path)
    q = TTFTPredictor.load(path)
    assert q == p
    raw = json.loads(path.read_text())
    raw["format_version"] = 99
    path.write_text(json.dumps(raw))
    with pytest.raises(InvalidRequestError, match="format_version 99"):
        TTFTPredictor.load(path)
    path.write_text("{nope")
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        TTFTPredictor.load(path)
    with pytest.raises(InvalidRequestError, match="does not exist"):
        TTFTPredictor.load(tmp_path / "missing.json")


def test_bad_fits_are_refused() -> None:
    with pytest.raises(InvalidRequestError, match="degree"):
        TTFTPredictor.fit([(1, 1.0), (2, 2.0)], degree=4)
    with pytest.raises(InvalidRequestError, match="distinct"):
        TTFTPredictor.fit([(5, 1.0), (5, 1.1)], degree=1)
    with pytest.raises(InvalidRequestError, match="min-tokens"):
        sweep_points(100, 10, 5)


def test_predictions_never_go_below_the_floor() -> None:
    p = TTFTPredictor(coefficients=[-1.0, 0.001], min_latency_s=0.002)
    assert p.predict_s(1) == 0.002
    assert p.predict_s(5000) == pytest.approx(4.0)


def test_profile_sweep_fits_what_it_measures() -> None:
    """A prefill stand-in whose cost is a known function of n (sleep ≥ 2 ms)."""
    calls: list[int] = []

    def run(n: int) -> None:
        calls.append(n)
        time.sleep(0.002 + n * 2e-6)

    report = profile(run, min_tokens=32, max_tokens=2048, num_points=5, repeats=1, degree=1)
    assert sorted(set(calls)) == sorted(
        set(sweep_points(32, 2048, 5)) | {n for n, _ in report.holdout}
    )
    assert report.holdout_error is not None
    # Sleep overshoot is small next to 2 ms; a generous bound keeps this from flaking.
    assert report.holdout_error.mean_abs_pct < 50
    assert report.predictor.coefficients[1] == pytest.approx(2e-6, rel=0.5)
