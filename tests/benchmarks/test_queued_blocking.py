"""benchmarks/prefill/queued_blocking.py at its smallest size: both schedulers swap into
the engine, the probes preempt, and the table comes out; what the figures rest on (the
interval's resampling, the probe moments) behaves."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_a_tiny_run_prints_the_table() -> None:
    argv = [sys.executable, str(ROOT / "benchmarks" / "prefill" / "queued_blocking.py"),
            "--queued", "0,20", "--repeats", "1", "--tokens", "256", "--longs", "2"]  # fmt: skip
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


def test_a_paired_interval_takes_the_same_repeats_on_both_sides() -> None:
    """Repeats that differ a lot from each other (where their probes landed) but whose arms
    agree within each: pairing cancels what the repeats share, resampling each side on its
    own does not."""
    from benchmarks.prefill.queued_blocking import mean_ratio

    base = [[float(1 + 10 * (k % 3))] for k in range(30)]
    runs = [[1.05 * v for v in run] for run in base]
    ratio, lo, hi = mean_ratio(runs, base, paired=True)
    assert abs(ratio - 1.05) < 1e-9 and abs(lo - 1.05) < 1e-9 and abs(hi - 1.05) < 1e-9
    _, lo_apart, hi_apart = mean_ratio(runs, base)
    assert lo_apart < 0.9 and hi_apart > 1.2
    with pytest.raises(ValueError, match="as many runs"):
        mean_ratio(runs, base[:-1], paired=True)


def test_the_probe_moments_cover_each_stratum_once() -> None:
    import random

    from benchmarks.prefill.queued_blocking import stratified

    fractions = stratified(random.Random(3), 8, 0.95)
    assert sorted(int(f / (0.95 / 8)) for f in fractions) == list(range(8))
    assert all(0 <= f < 0.95 for f in fractions)
    assert fractions != sorted(fractions)  # shuffled: the order of the moments is random too
