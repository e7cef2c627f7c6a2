"""benchmarks/sim/autoscale.py --quick: the comparison's table, JSON and plots (not its
figures)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.sim import autoscale as bench


def test_the_quick_run_writes_the_table_json_and_plots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    summary = bench.main(["--quick", "--jobs", "1", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["systems"].keys() == set(bench.SYSTEMS) == summary["systems"].keys()
    classes = {"text", "image", "search", "file"}
    for name, row in saved["systems"].items():
        assert row["system"] == name
        assert row["gpu_hours"] > 0
        assert set(row["attainment"]) == classes
        assert all(0.0 <= a <= 1.0 for a in row["attainment"].values())
        assert row["meets_targets"] == all(a >= 0.9 for a in row["attainment"].values())
        assert row["timeline"] and all(len(p) == 3 for p in row["timeline"])
    fixed = saved["systems"]["fixed-peak"]
    # The fixed count is the smallest the search found meeting every target.
    assert fixed["meets_targets"]
    passing = [p["replicas"] for p in saved["fixed_search"] if p["meets_targets"]]
    assert fixed["fixed_replicas"] == min(passing)
    assert all(
        not p["meets_targets"] for p in saved["fixed_search"] if p["replicas"] < min(passing)
    )
    # A fixed pool holds its replicas the whole day: GPU-hours = count × 24 h.
    assert fixed["gpu_hours"] == pytest.approx(24.0 * fixed["fixed_replicas"])
    assert saved["judge"] == "deadline" and saved["num_requests"] > 0
    for png in ("autoscale-replicas.png", "autoscale-attainment.png"):
        assert (tmp_path / png).stat().st_size > 0
    out = capsys.readouterr().out
    assert "GPU-hours" in out and "slo-burn" in out and "queue-hpa" in out
