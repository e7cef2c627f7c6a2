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


def test_the_mean_ratio_interval_brackets_the_ratio_and_narrows_with_runs() -> None:
    from benchmarks.prefill.queued_blocking import mean_ratio

    base = [[1.0, 2.0], [3.0], [10.0, 1.0, 2.0], []] * 5  # a run may have no preemption
    ratio, lo, hi = mean_ratio([[2 * v for v in run] for run in base], base)
    assert ratio == 2.0 and lo < 2.0 < hi
    same, lo_few, hi_few = mean_ratio(base, base)
    assert same == 1.0 and lo_few < 1.0 < hi_few
    _, lo_many, hi_many = mean_ratio(base * 20, base * 20)
    assert hi_many - lo_many < (hi_few - lo_few) / 3  # 20x the runs: about 1/4.5 as wide


def test_the_interval_resamples_runs_whole() -> None:
    """Runs whose preemptions agree with each other but not with other runs: resampled
    one by one the samples would look like 200 independent ones and the interval would
    be far narrower than 20 runs can bound."""
    from benchmarks.prefill.queued_blocking import mean_ratio

    runs = [[float(k % 4)] * 10 for k in range(1, 21)]
    _, lo, hi = mean_ratio(runs, runs)
    flat = [[v] for run in runs for v in run]
    _, lo_flat, hi_flat = mean_ratio(flat, flat)
    assert hi - lo > 2 * (hi_flat - lo_flat)
    assert all(v != v for v in mean_ratio([[]], base=runs))  # nothing measured: NaN
