"""``benchmarks/stack/decode_aware.py`` at its smallest size: two ``flowprefill up`` stacks
(switch off and on) with vLLM decode, one round, one short prompt beside a short stream;
the figures are not judged, only that it runs to the end and writes what it says."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.benchmarks.smoke import run_script
from tests.benchmarks.test_stack_scripts import linear_profile


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_decode_aware(tmp_path: Path, demo_models: Path) -> None:
    out = tmp_path / "out"
    argv = [
        "--rounds", "1", "--tokens", "300", "--prompts", "1", "--stream-tokens", "120",
        "--profile", str(linear_profile(tmp_path / "p.json")), "--out", str(out),
    ]  # fmt: skip
    printed = run_script(
        "stack/decode_aware.py", *argv, tmp_path=tmp_path, models=demo_models, timeout_s=600
    )
    assert "decode-aware preemption through up" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["systems"]) <= {"off", "on"}
    for row in summary["systems"].values():
        assert row["gaps"] >= 1 and row["mean_ttft_s"] > 0
    assert summary["systems"].get("off", {}).get("parks_per_s", 0.0) == 0.0
