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
