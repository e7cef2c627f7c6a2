"""The tree stays lint-, format- and type-clean (DESIGN.md "Style"): the same ruff and mypy
commands a developer runs, over the packages, the tests and the benchmarks, so CI fails on
a regression instead of leaving it to the next reader."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TREES = ["flowprefill", "operator", "tests", "benchmarks", "scripts"]
TYPED = ["flowprefill", "operator/flowprefill_operator", "tests", "benchmarks", "scripts"]


def _run(tool: str, *args: str, timeout_s: float = 600) -> None:
    if importlib.util.find_spec(tool) is None:
        pytest.skip(f"{tool} is not installed (the dev extra: pip install -e '.[dev]')")
    out = subprocess.run(
        [sys.executable, "-m", tool, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert out.returncode == 0, (
        f"{tool} {' '.join(args)}:\n{out.stdout[-6000:]}{out.stderr[-2000:]}"
    )


def test_ruff_check() -> None:
    _run("ruff", "check", *TREES)


def test_ruff_format() -> None:
    _run("ruff", "format", "--check", *TREES)


@pytest.mark.slow
def test_mypy() -> None:
    _run("mypy", *TYPED)
