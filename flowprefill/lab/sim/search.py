"""Bisection for goodput (highest passing rate) and tightest SLO scale (lowest passing scale).

Both start from a grid of already-evaluated points when there is one (the curves drawn in
the plots), take the bracket around the *first* crossing — so a non-monotone wobble far
past the knee cannot be reported as goodput — and bisect it to a relative tolerance.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Predicate = Callable[[float], bool]

MAX_STEPS = 12


def _bisect(ok: Predicate, good: float, bad: float, rel_tol: float) -> float:
    """``ok(good)`` holds and ``ok(bad)`` does not; shrink until they are close."""
    for _ in range(64):
        if abs(bad - good) <= rel_tol * max(abs(good), abs(bad)):
            break
        mid = (good + bad) / 2
        if ok(mid):
            good = mid
        else:
            bad = mid
    return good


def highest_passing(
    ok: Predicate,
    grid: Sequence[tuple[float, bool]] = (),
    *,
    guess: float = 1.0,
    rel_tol: float = 0.02,
) -> float:
    """Largest ``x > 0`` with ``ok(x)`` (ok is expected to hold below a threshold).

    Returns 0.0 when even ``guess / 2**MAX_STEPS`` fails.
    """
    points = sorted(grid)
    good: float | None = None
    bad: float | None = None
    for x, passed in points:
        if passed:
            good = x
        else:
            bad = x
            break
    if bad is None:
        x = good if good is not None else guess
        for _ in range(MAX_STEPS):
            x *= 2
            if not ok(x):
                bad = x
                break
            good = x
        else:
            return x
    if good is None:
        x = bad
        for _ in range(MAX_STEPS):
            x /= 2
            if ok(x):
                good = x
                break
            bad = x
        else:
            return 0.0
    return _bisect(ok, good, bad, rel_tol)


def lowest_passing(
    ok: Predicate,
    grid: Sequence[tuple[float, bool]] = (),
    *,
    guess: float = 1.0,
    rel_tol: float = 0.02,
) -> float:
    """Smallest ``x > 0`` with ``ok(x)`` (ok is expected to hold above a threshold).

    Returns ``inf`` when even ``guess * 2**MAX_STEPS`` fails.
    """
    points = sorted(grid, reverse=True)
    good: float | None = None
    bad: float | None = None
    for x, passed in points:
        if passed:
            good = x
        else:
            bad = x
            break
    if bad is None:
        x = good if good is not None else guess
        for _ in range(MAX_STEPS):
            x /= 2
            if not ok(x):
                bad = x
                break
            good = x
        else:
            return x
    if good is None:
        x = bad
        for _ in range(MAX_STEPS):
            x *= 2
            if ok(x):
                good = x
                break
            bad = x
        else:
            return float("inf")
    return _bisect(ok, good, bad, rel_tol)
