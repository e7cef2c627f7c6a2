"""``benchmarks/stack/colocated.py`` and its report (``colocated_report.py``): its TBT rule
and goodput on crafted outcomes, and a
smoke run at its smallest size (one ``flowprefill up`` with vLLM decode, one rate, two
requests of a few tokens; the figures are not judged, only that it runs to the end and
writes what it says)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.sim.colocated import crossing
from benchmarks.stack.colocated_report import met_tbt_mean, summarize
from flowprefill.bench.client import Outcome
from tests.benchmarks.smoke import run_script
from tests.benchmarks.test_stack_scripts import linear_profile


def outcome(
    cls: str, times: list[float], ttft_slo: float = 1.0, error: str | None = None
) -> Outcome:
    o = Outcome("r", cls, 100, ttft_slo, 0.0, tbt_slo_s=0.1, token_times_s=times, error=error)
    o.ttft_s = times[0] if times else None
    return o


def test_tbt_is_judged_on_the_mean_gap_as_the_simulator() -> None:
    # Gaps 0.25, 0.02, 0.02: one gap over 0.1 s, mean 0.097 s within it.
    spiky = outcome("text", [0.5, 0.75, 0.77, 0.79])
    assert met_tbt_mean(spiky) and spiky.met_tbt is False
    slow = outcome("text", [0.5, 0.62, 0.74])  # mean 0.12 s
    assert not met_tbt_mean(slow)
    assert met_tbt_mean(outcome("text", [0.5]))  # one token: no gap to miss
    assert not met_tbt_mean(outcome("text", [0.5, 0.51], error="boom"))
    late = outcome("image", [2.0, 2.01], ttft_slo=1.0)  # TBT met, TTFT missed
    stats = summarize([spiky, slow, late])
    assert stats["text"]["tbt"] == 0.5 and stats["text"]["tbt_every"] == 0.0
    assert stats["all"]["ttft"] == 2 / 3 and stats["all"]["both"] == 1 / 3
    assert stats["image"]["both"] == 0.0 and stats["image"]["tbt"] == 1.0


def test_goodput_crossing() -> None:
    assert crossing([1, 2, 3], [1.0, 0.95, 0.85]) == pytest.approx(2.5)
    assert crossing([1, 2], [0.8, 0.95]) is None  # misses at the lowest rate
    assert crossing([1, 2], [1.0, 0.95]) == 2  # never crosses on the grid


@pytest.mark.slow
def test_colocated(tmp_path: Path, demo_models: Path) -> None:
    out = tmp_path / "out"
    argv = [
        "--systems", "flowprefill", "--rates", "1", "--duration", "2", "--min-requests", "2",
        "--length-scale", "0.02", "--max-tokens", "4", "--warmup-lengths", "64",
        "--profile", str(linear_profile(tmp_path / "p.json")), "--out", str(out),
    ]  # fmt: skip
    printed = run_script("stack/colocated.py", *argv, tmp_path=tmp_path, models=demo_models)
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["systems"]) == ["flowprefill"]
    classes = summary["systems"]["flowprefill"]["1.0"]
    assert classes["all"]["requests"] == 2 and classes["all"]["errors"] == 0
    assert summary["idle_decode_step_ms"]["flowprefill"] > 0
    assert (out / "colocated.png").stat().st_size > 0
    assert "TBT targets against a decode step" in printed
    assert "per rate, system and class" in printed
