"""benchmarks/prefill/scheduling_round_cost.py at its smallest size: both rounds run, decide
the same commands (the script asserts it) and the table comes out."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_tiny_run_prints_the_table() -> None:
    argv = [sys.executable, str(ROOT / "benchmarks" / "prefill" / "scheduling_round_cost.py"),
            "--sizes", "10,100", "--repeats", "2"]  # fmt: skip
    run = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "indexed" in run.stdout and "ranking" in run.stdout and "100" in run.stdout
