"""The ``profile`` sweep: time prefills of growing length on this engine and hardware.

Fits :class:`~flowprefill.prefill.predictor.model.TTFTPredictor` on a geometric sweep of token
counts and reports its error on *held-out* lengths between the profiled ones, which is the
error the scheduler will actually see for unseen prompt lengths.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from rich.progress import Progress

from flowprefill.errors import InvalidRequestError
from flowprefill.prefill.predictor.model import FitError, TTFTPredictor

TimedPrefill = Callable[[int], None]
"""Runs one prefill of ``n`` tokens on the engine's executor (synchronously)."""


@dataclass(frozen=True, slots=True)
class ProfileReport:
    predictor: TTFTPredictor
    holdout: list[tuple[int, float]]
    holdout_error: FitError | None


def sweep_points(min_tokens: int, max_tokens: int, num_points: int) -> list[int]:
    """Geometrically spaced token counts, inclusive of both ends, deduplicated."""
    if min_tokens < 1 or max_tokens < min_tokens:
        raise InvalidRequestError(
            f"need 1 <= --min-tokens <= --max-tokens, got {min_tokens}..{max_tokens}"
        )
    if num_points < 2:
        raise InvalidRequestError(f"--points must be at least 2, got {num_points}")
    ratio = (max_tokens / min_tokens) ** (1 / (num_points - 1))
    return sorted({round(min_tokens * ratio**i) for i in range(num_points)})


def measure(
    run: TimedPrefill, token_counts: list[int], *, repeats: int, label: str, warmup: bool = True
) -> list[tuple[int, float]]:
    """Median wall time of ``repeats`` runs per token count (interleaved across counts)."""
    if repeats < 1:
        raise InvalidRequestError(f"--repeats must be at least 1, got {repeats}")
    if warmup:
        run(token_counts[0])
    times: dict[int, list[float]] = {n: [] for n in token_counts}
    with Progress(transient=True) as progress:
        bar = progress.add_task(label, total=repeats * len(token_counts))
        # Interleave lengths across repeats so machine noise spreads over every point.
        for _ in range(repeats):
            for n in token_counts:
                t0 = time.perf_counter()
                run(n)
                times[n].append(time.perf_counter() - t0)
                progress.advance(bar)
    return [(n, statistics.median(ts)) for n, ts in times.items()]


def profile(
    run: TimedPrefill,
    *,
    min_tokens: int = 32,
    max_tokens: int = 4096,
    num_points: int = 8,
    repeats: int = 3,
    degree: int = 2,
    hardware: str = "",
    model: str = "",
) -> ProfileReport:
    points = sweep_points(min_tokens, max_tokens, num_points)
    samples = measure(run, points, repeats=repeats, label="profiling prefill")
    predictor = TTFTPredictor.fit(samples, degree, hardware=hardware, model=model)
    # Held out: geometric midpoints between consecutive profiled lengths.
    mids = sorted({round((a * b) ** 0.5) for a, b in itertools.pairwise(points)})
    mids = [m for m in mids if m not in set(points)]
    holdout = (
        measure(run, mids, repeats=repeats, label="held-out lengths", warmup=False) if mids else []
    )
    return ProfileReport(predictor, holdout, predictor.error_on(holdout) if holdout else None)
