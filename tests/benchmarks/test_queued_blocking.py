"""benchmarks/prefill/queued_blocking.py at its smallest size: both schedulers swap into
the engine, the probes preempt, and the table comes out."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_tiny_run_prints_the_table() -> None:
    argv = [sys.executable, str(ROOT / "benchmarks" / "prefill" / "queued_blocking.py"),
            "--queued", "0,20", "--repeats", "1", "--tokens", "256", "--probes", "1"]  # fmt: skip
    run = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "ranking" in run.stdout and "indexed" in run.stdout and "blocking" in run.stdout
