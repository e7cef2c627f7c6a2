"""Smoke test of ``benchmarks/stack/colocated.py`` at its smallest size: one ``flowprefill
up`` (with vLLM decode), one rate, two requests of a few tokens; the figures are not judged,
only that it runs to the end and writes what it says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmarks.smoke import run_script
from tests.benchmarks.test_stack_scripts import linear_profile

pytestmark = pytest.mark.slow


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
