"""benchmarks/kv/handoff.py at its smallest size, part 1 (the hand-off format's costs on
the demo shape; no vLLM): every step is timed for both dtypes. Part 2 (``--vllm``, decode
in a real ``vllm.LLM``) is left out: another minute of CI for a vLLM start."""

from __future__ import annotations

import json
from pathlib import Path

from tests.benchmarks.smoke import run_script


def test_the_format_costs_at_one_small_length(tmp_path: Path) -> None:
    out = tmp_path / "handoff.json"
    argv = ["--lengths", "64", "--repeats", "1", "--json", str(out)]
    printed = run_script("kv/handoff.py", *argv, tmp_path=tmp_path)
    rows = json.loads(out.read_text())["format"]
    assert [(r["tokens"], r["dtype"]) for r in rows] == [(64, "bfloat16"), (64, "float32")]
    steps = ("build_ms", "put_ms", "header_ms", "read_ms", "verify_ms")
    assert all(r[k] > 0 for r in rows for k in steps)
    assert "(ms, median of 1)" in printed
