"""Every benchmark module imports: a name a benchmark takes from flowprefill that is renamed
or moved fails here, not at the next person's run (mypy does not see it: the project's
mypy settings ignore imports it cannot resolve)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODULES = sorted(
    ".".join(path.relative_to(ROOT).with_suffix("").parts)
    for path in (ROOT / "benchmarks").rglob("*.py")
    if path.name != "__init__.py"
)


def test_the_benchmarks_are_found() -> None:
    assert "benchmarks.gateway.overhead" in MODULES and len(MODULES) > 30


@pytest.mark.parametrize("module", MODULES)
def test_imports(module: str) -> None:
    importlib.import_module(module)
