"""benchmarks/gateway/overhead.py at a tiny size: the real gateway (``flowprefill
serve-gateway``) between the benchmark's stubs and its load generator answers every
request, so the stubs keep speaking the wire formats the gateway reads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_tiny_run_completes_every_request(tmp_path: Path) -> None:
    argv = [
        sys.executable, str(ROOT / "benchmarks" / "gateway" / "overhead.py"), "--rounds", "1",
        "--requests", "5", "--warmup", "2", "--seconds", "1", "--concurrency", "2",
    ]  # fmt: skip
    env = {**os.environ, "FLOWPREFILL_MODEL_CACHE": str(tmp_path / "models")}
    run = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    # The benchmark exits 1 when any request failed, naming the first failure.
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "this tree" in run.stdout and "request(s) failed" not in run.stdout


@pytest.mark.slow
def test_a_tiny_open_streams_sweep_holds_every_stream(tmp_path: Path) -> None:
    """benchmarks/gateway/streams.py at its smallest size: the stub holds the streams until
    all are open through the gateway, then every one ends whole (the script exits 1 when a
    stream failed or fewer were open at once)."""
    from tests.benchmarks.smoke import run_script

    out = run_script("gateway/streams.py", "--levels", "3", "--ramp", "2", tmp_path=tmp_path)
    assert "RSS/stream KiB" in out
