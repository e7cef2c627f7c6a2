"""The engine-vs-simulator comparison on the engine's own profile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flowprefill.errors import InvalidRequestError
from flowprefill.lab.sim.config import CostSpec, SweepConfig
from flowprefill.lab.sim.validate import compare_with_measured, load_measured
from flowprefill.prefill.predictor.model import TTFTPredictor


def test_replaying_the_engines_own_timeline_gives_zero_error(tmp_path: Path) -> None:
    profile = tmp_path / "profile.json"
    TTFTPredictor.linear(per_token_s=1e-3).save(profile)
    # What a FlowPrefill engine with this exact cost would measure (Figure 8 timeline,
    # 4 layers × 5 operators: A's checkpoints every 0.05 s).
    rows = [
        {"request_id": "A", "arrival_s": 100.0, "num_tokens": 1000, "ttft_slo_s": 10.0,
         "slo_class": "file", "ttft_s": 1.1},
        {"request_id": "B", "arrival_s": 100.25, "num_tokens": 100, "ttft_slo_s": 0.5,
         "slo_class": "text", "ttft_s": 0.1},
    ]  # fmt: skip
    measured = tmp_path / "measured.jsonl"
    measured.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # That engine runs its operators whole (no run-time splitting).
    cfg = SweepConfig(
        cost=CostSpec(profile=str(profile)), systems=("fp-nobatch",), max_blocking_ms="off"
    )
    report = compare_with_measured(cfg, load_measured(measured), system="fp-nobatch")
    assert report.mean_abs_error_ms == pytest.approx(0.0, abs=1e-6)
    assert report.attainment_simulated == report.attainment_measured == 1.0
    assert "2 requests" in report.summary()


def test_bad_measured_rows_are_named(tmp_path: Path) -> None:
    p = tmp_path / "m.jsonl"
    p.write_text('{"request_id": "a", "arrival_s": 0, "num_tokens": 5, "ttft_slo_s": 1}\n')
    with pytest.raises(InvalidRequestError, match=r"m\.jsonl line 1"):
        load_measured(p)
