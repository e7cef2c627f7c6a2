"""Every benchmark script has a smoke test (issue 23: a benchmark nobody runs breaks
silently, as ``gateway_overhead.py`` did when the gateway's prefill wire format changed).

A script is a file under ``benchmarks/`` with a ``__main__`` block; helper modules are
covered through the scripts that use them. A test covers a script when a test module
under ``tests/`` runs it: names its path (``run_script("sim/tp.py", ...)``, ``ROOT /
"benchmarks" / "sim" / "tp.py"``) or imports it and calls a ``main(``. This test checks
that such a module exists, not what it asserts.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(
    path.relative_to(ROOT / "benchmarks").as_posix()
    for path in (ROOT / "benchmarks").rglob("*.py")
    if re.search(r"""^if __name__ == ["']__main__["']:""", path.read_text(), re.MULTILINE)
)
TEST_SOURCES = {
    path: path.read_text()
    for path in (ROOT / "tests").rglob("test_*.py")
    if path.is_file() and path != Path(__file__).resolve()  # this one names scripts too
}


def covering_tests(script: str) -> list[str]:
    """The test modules that run ``script`` (relative to ``benchmarks/``)."""
    parts = script.removesuffix(".py").split("/")
    package, name = ".".join(["benchmarks", *parts[:-1]]), parts[-1]
    by_path = [
        re.compile(rf"""["/]{re.escape(script)}["']"""),
        re.compile(" / ".join(rf'"{re.escape(p)}"' for p in script.split("/")) + r"(?!\s*/)"),
    ]
    by_import = re.compile(rf"^from {re.escape(package)} import [^\n]*\b{name}\b", re.MULTILINE)
    found = []
    for path, text in TEST_SOURCES.items():
        if any(p.search(text) for p in by_path) or (by_import.search(text) and "main(" in text):
            found.append(path.relative_to(ROOT).as_posix())
    return found


def test_the_scripts_are_found() -> None:
    assert {"gateway/overhead.py", "gpu_validate.py", "sim/tp.py"} <= set(SCRIPTS)
    assert "stack/common.py" not in SCRIPTS  # a helper: no __main__ block


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_script_has_a_smoke_test(script: str) -> None:
    assert covering_tests(script), (
        f"benchmarks/{script} has no smoke test: add one that runs it at its smallest size "
        "(tests/benchmarks/smoke.py's run_script)"
    )
