"""Smoke test of benchmarks/sim/tp.py (Llama-3-70B, TP4) with tiny settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.sim import tp as bench
from flowprefill.contracts.slo import paper_ttft_slos_s
from flowprefill.lab.sim.systems import PAPER_SYSTEMS


def test_sim_tp_runs_the_70b_tp4_comparison_and_writes_its_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--num-requests", "60", "--seeds", "0", "--tolerance", "0.2"]
    argv += ["--slo-scales", "0.5,1,2", "--no-oracles", "--no-plots", "--no-progress"]
    argv += ["--jobs", "1", "--tp-check-us", "20", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert "Llama3-70B, TP4: ours beside what the paper states" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["cost_model"] == "llama3-70b/a800/tp4"
    assert summary["slos_s"] == paper_ttft_slos_s("llama3-70b")
    assert set(summary["goodput_rps"]) == set(PAPER_SYSTEMS)
    assert summary["goodput_rps"]["flowprefill"] > 0
    figures = {f["figure"]: f for f in summary["paper_comparison"]}
    fp, fcfs = summary["goodput_rps"]["flowprefill"], summary["goodput_rps"]["distserve-fcfs"]
    assert figures["goodput FlowPrefill / DistServe FCFS"]["ours"] == pytest.approx(fp / fcfs)
    quote = figures["goodput FlowPrefill / DistServe FCFS"]["paper_says"]
    assert "4.7×–5.6× higher request rates than DistServe" in quote
    # TP costs: two all-reduces per layer, one agreement per operator checkpoint (80 × 5).
    for row in summary["tp_costs"]:
        assert 0 < row["allreduce_s"] < row["solo_s"]
        assert row["checkpoints_s"] == pytest.approx(80 * 5 * 20e-6)
    checks = sorted({r["tp_check_us"] for r in summary["sensitivity"]})
    assert checks == pytest.approx([0.0, 20.0, 100.0])
    assert (tmp_path / "result.json").exists()
    assert "--tp-check-us" in summary["command"]
