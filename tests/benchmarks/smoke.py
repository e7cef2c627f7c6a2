"""Running a benchmark script as its user does, for the smoke tests: ``python
benchmarks/<script> ARGS`` from the repository root, in a subprocess, at its smallest size.

The point of a smoke test is that a script which no longer runs (a renamed import, a wire
format that moved under its stubs, a flag that lost its meaning) fails CI instead of the
next person who needs its figures; the figures themselves are not judged.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_script(
    script: str,
    *args: str,
    tmp_path: Path,
    models: Path | None = None,
    timeout_s: float = 240.0,
) -> str:
    """Run ``benchmarks/<script>`` with ``args``; assert it exits 0; its stdout.

    Named models are built (random weights, no download) into ``models`` (default: a
    cache under ``tmp_path``); one OpenMP thread per process, as the stack tests run; rich
    draws its tables 200 columns wide so that a test can find a heading or a row label
    unabridged.
    """
    env = {
        **os.environ,
        "FLOWPREFILL_MODEL_CACHE": str(models or tmp_path / "models"),
        "OMP_NUM_THREADS": "1",
        "COLUMNS": "200",
    }
    argv = [sys.executable, str(ROOT / "benchmarks" / script), *args]
    run = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert run.returncode == 0, (
        f"{script} exited {run.returncode}\n--- stdout\n{run.stdout[-4000:]}\n"
        f"--- stderr\n{run.stderr[-4000:]}"
    )
    return run.stdout
