"""benchmarks/gpu_validate.py on CPU with the tiny model and --quick: every section runs,
the outputs exist and are sane, and the calibration CSV parses with the simulator's reader.
(The GPU run it exists for is described in docs/gpu.md.)"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_validate
from benchmarks.gpuval import operators
from flowprefill.lab.sim import vidur


@pytest.mark.slow
def test_quick_cpu_run_writes_sane_results_and_a_calibration_the_simulator_reads(
    tmp_path: Path,
) -> None:
    threads = torch.get_num_threads()
    argv = ["--device", "cpu", "--model", "tiny", "--quick", "--threads", "1"]
    try:
        # A generous budget: on a loaded CI machine nothing should be skipped for time.
        rc = gpu_validate.main([*argv, "--budget-s", "240", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    results = json.loads((tmp_path / "results.json").read_text())
    sections = results["sections"]
    assert list(sections) == ["checks", "prefill", "blocking", "operators", "urgent"]
    assert {name: s["status"] for name, s in sections.items()} == dict.fromkeys(sections, "ok")
    assert all(s["elapsed_s"] >= 0 for s in sections.values())
    assert results["device"]["type"] == "cpu" and results["model"]["layers"] == 4
    arms = results["arms"]
    assert arms[:3] == ["none", "layer", "operator"] and "operator/on_preempt" not in arms

    checks = {c["name"]: c for c in sections["checks"]["checks"]}
    stream_checks = [
        c for c in checks.values() if "stream" in c["name"] or "on_preempt" in c["name"]
    ]
    assert stream_checks and all(c["status"] == "skipped" for c in stream_checks)
    assert all("CPU" in c["detail"] for c in stream_checks)
    assert checks["preempted + resumed prefill is bit-identical"]["status"] == "ok"
    assert checks["checkpoints passed = expected_checkpoints"]["status"] == "ok"
    assert checks["executor logits match the plain forward"]["status"] == "ok"

    rows = sections["prefill"]["rows"]
    assert {(r["tokens"], r["arm"]) for r in rows} == {
        (n, arm) for n in (64, 256, 1024) for arm in ["plain", *arms]
    }
    for row in rows:
        assert row["runs"] == 2 and 0 < row["min_ms"] <= row["median_ms"]
        assert math.isfinite(row["overhead_vs_plain_pct"]) and row["tflops"] > 0
        assert row["mfu_pct"] is None  # no peak on CPU

    blocking = {r["granularity"]: r for r in sections["blocking"]["rows"]}
    assert {"layer", "operator"} <= set(blocking)
    for row in blocking.values():
        assert row["samples"] > 0
        assert 0 <= row["p50_ms"] <= row["max_ms"] and row["mean_ms"] <= row["max_ms"]

    ops = sections["operators"]
    assert ops["parsed_by_simulator"] and ops["parsed_token_counts"] == [1, 16, 64, 256, 1024]
    path = tmp_path / ops["csv"]
    header = next(csv.reader(path.open()))
    for op in vidur.VIDUR_OPS:
        assert f"time_stats.{op}.median" in header
    assert {"num_tokens", "num_tensor_parallel_workers"} <= set(header)
    table = operators.parse_with_simulator(path)[1]  # flowprefill.lab.sim.vidur's own parser
    assert list(table.num_tokens) == [1, 16, 64, 256, 1024]
    assert all(table.time_ms(op, 100) > 0 for op in vidur.VIDUR_OPS)

    urgent = {r["arm"]: r for r in sections["urgent"]["rows"]}
    fcfs, sedf = urgent["fcfs / operator"], urgent["s-edf / operator"]
    assert fcfs["preemptions"] == 0 and sedf["preemptions"] >= 1
    # Preempting at an operator boundary beats waiting for the whole long prefill.
    assert sedf["urgent_ttft_ms"] < fcfs["urgent_ttft_ms"]


def test_nixl_page_checks_run_on_host_memory() -> None:
    """gpu_validate's NIXL checks (CUDA there) run the same code on CPU: pages packed on
    the device equal the CPU's, and a second NIXL agent READs a published block back."""
    pytest.importorskip("nixl._api")
    from benchmarks.gpuval.nixl_pages import nixl_page_checks

    results: list[tuple[str, bool | None, str]] = []
    nixl_page_checks(torch.device("cpu"), torch.float32, lambda *a: results.append(a))
    assert [ok for _, ok, _ in results if ok is not None] == [True, True], results
