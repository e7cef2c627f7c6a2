from __future__ import annotations

import math

import pytest

from flowprefill.lab.sim.search import highest_passing, lowest_passing


def test_highest_passing_bisects_from_the_grid_bracket() -> None:
    calls: list[float] = []

    def ok(x: float) -> bool:
        calls.append(x)
        return x <= 3.3

    grid = [(1.0, True), (2.0, True), (3.0, True), (4.0, False), (5.0, True)]
    got = highest_passing(ok, grid, rel_tol=0.01)
    assert got == pytest.approx(3.3, rel=0.01) and got <= 3.3
    assert all(3.0 <= x <= 4.0 for x in calls)  # never looked past the first failure


def test_highest_passing_expands_and_gives_up() -> None:
    assert highest_passing(lambda x: x <= 20.0, guess=1.0, rel_tol=0.01) == pytest.approx(
        20.0, rel=0.01
    )
    assert highest_passing(lambda x: x <= 0.3, [(1.0, False)], rel_tol=0.01) == pytest.approx(
        0.3, rel=0.011
    )
    assert highest_passing(lambda x: False, guess=1.0) == 0.0


def test_lowest_passing_mirrors_it() -> None:
    grid = [(0.1, False), (0.5, False), (1.0, True), (2.0, True)]
    assert lowest_passing(lambda s: s >= 0.7, grid, rel_tol=0.01) == pytest.approx(0.7, rel=0.01)
    assert lowest_passing(lambda s: s >= 0.7, grid, rel_tol=0.01) >= 0.7
    assert math.isinf(lowest_passing(lambda s: False, guess=1.0))
