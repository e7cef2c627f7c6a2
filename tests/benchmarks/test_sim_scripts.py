"""The simulator benchmarks under benchmarks/sim/ at their smallest sizes: each runs to the
end, prints its table and writes what it says it writes (a few seconds each; the figures
are not judged). autoscale.py and tp.py have their own tests."""

from __future__ import annotations

import json
from pathlib import Path

from tests.benchmarks.smoke import run_script


def test_handoff_gap(tmp_path: Path) -> None:
    out = tmp_path / "gap.json"
    printed = run_script("sim/handoff_gap.py", "--json", str(out), tmp_path=tmp_path)
    rows = json.loads(out.read_text())["rows"]
    assert {r["model"] for r in rows} == {"llama3-8b", "llama3-70b"}
    assert all(r["first_gap_ms"] > r["handoff_ms"] > 0 for r in rows)
    assert f"wrote {len(rows)} rows" in printed and "nvlink" in printed


def test_admission(tmp_path: Path) -> None:
    printed = run_script(
        "sim/admission.py", "--num-requests", "60", "--jobs", "1", tmp_path=tmp_path
    )
    assert "Non-sheddable goodput under overload" in printed
    assert "fp-shed-queue" in printed and "total" in printed


def test_beyond(tmp_path: Path) -> None:
    printed = run_script(
        "sim/beyond.py", "--num-requests", "60", "--seeds", "0", "--jobs", "1", tmp_path=tmp_path
    )
    for heading in ("Distance to the limits", "Routing over 2 prefill instances", "Single-SLO"):
        assert heading in printed
    assert "work-conserving bound" in printed and "slack-aware" in printed


def test_paper_figures(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["--num-requests", "60", "--seeds", "0", "--jobs", "1", "--out", str(out)]
    printed = run_script("sim/paper_figures.py", *argv, tmp_path=tmp_path)
    result = json.loads((out / "result.json").read_text())
    assert result["num_requests"] == 60 and result["systems"]
    assert (out / "single_slo.json").is_file()
    assert (out / "fig9_end_to_end.png").stat().st_size > 0
    assert "Against the paper's figures" in printed and "throughput FlowPrefill / CP2K" in printed


def test_bounded_blocking(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["--bounds", "4,none", "--num-requests", "40", "--tolerance", "0.2", "--jobs", "1"]
    printed = run_script("sim/bounded_blocking.py", *argv, "--out", str(out), tmp_path=tmp_path)
    result = json.loads((out / "result.json").read_text())
    assert {r["workload"] for r in result["rows"]} == {"paper", "long"}
    assert all(r["goodput_rps"] > 0 for r in result["rows"])
    assert len(result["verdicts"]) == 2 and (out / "bounded_blocking.png").stat().st_size > 0
    assert f"wrote {out}/result.json" in printed


def test_bounded_blocking_seeds(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["--seeds", "0", "--num-requests", "40", "--tolerance", "0.2", "--jobs", "1"]
    printed = run_script(
        "sim/bounded_blocking_seeds.py", *argv, "--out", str(out), tmp_path=tmp_path
    )
    summary = json.loads((out / "result.json").read_text())["summary"]
    assert set(summary) == {"paper", "long"}
    assert all(arms["none"]["goodput_rps"][0] > 0 for arms in summary.values())
    assert "FlowPrefill goodput vs unsplit" in printed and "4 ms, equal tiles" in printed
