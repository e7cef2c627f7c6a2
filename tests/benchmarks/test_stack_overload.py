"""benchmarks/stack/overload.py at its smallest size, through its command line: the stack
starts, capacity is measured, one load is offered and the table comes out
(tests/stack/test_overload.py checks the behaviour at 3x through the same functions)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.smoke import run_script

pytestmark = pytest.mark.slow


def test_one_short_load_prints_the_table(tmp_path: Path) -> None:
    out = run_script(
        "stack/overload.py", "--loads", "1", "--duration", "2", "--tokens", "256",
        "--out", str(tmp_path / "run"), tmp_path=tmp_path, timeout_s=300,
    )  # fmt: skip
    assert "capacity" in out and "Overload" in out
