"""The CPU engine benchmarks under benchmarks/prefill/ (and the simulator-vs-engine check,
which runs the real engine too) on the tiny model at their smallest sizes: each runs to the
end and prints or writes its figures (not judged). scheduling_round_cost.py has its own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmarks.smoke import run_script


def test_bounded_blocking(tmp_path: Path) -> None:
    out = tmp_path / "out"
    printed = run_script(
        "prefill/bounded_blocking.py", "--quick", "--out", str(out), tmp_path=tmp_path
    )
    result = json.loads((out / "results.json").read_text())
    assert result["model"] == "tiny-llama"
    arms = result["arms"]
    assert arms[0]["label"] == "off" and len(arms) > 1
    assert all(len(a["wall_s"]) == 2 and min(a["max_ms"]) > 0 for a in arms)  # 2 rounds
    # A bound splits operators: more checkpoints than running them whole.
    assert all(a["checkpoints"] > arms[0]["checkpoints"] for a in arms[1:])
    assert "max" in printed and "blocking" in printed


def test_checkpoint_overhead(tmp_path: Path) -> None:
    argv = ["--quick", "--model", "tiny-llama"]
    printed = run_script("prefill/checkpoint_overhead.py", *argv, tmp_path=tmp_path)
    assert "slowdown with checkpoints (wall time)" in printed
    assert "slowdown with checkpoints (cpu time)" in printed
    assert "operator" in printed and "tokens/s" in printed


def test_preemption_blocking(tmp_path: Path) -> None:
    argv = ["--quick", "--model", "tiny-llama", "--samples", "10"]
    printed = run_script("prefill/preemption_blocking.py", *argv, tmp_path=tmp_path)
    assert "Preemption blocking time (signal → ACK)" in printed
    assert "layer / operator ratio" in printed


def test_executor_speed(tmp_path: Path) -> None:
    out = tmp_path / "speed.json"
    argv = ["--models", "tiny-llama", "--lengths", "64", "--batch", "32,64", "--repeats", "1"]
    printed = run_script(
        "prefill/executor_speed.py", *argv, "--threads", "1", "--json", str(out), tmp_path=tmp_path
    )
    arms = json.loads(out.read_text())["models"]["tiny-llama"]
    assert set(arms) == {"1×64", "batch 32+64"}
    want = {"hf", "hf-last"} | {
        f"{g}/{k}" for g in ("none", "layer", "operator") for k in ("fast", "reference")
    }
    for by_arm in arms.values():
        assert set(by_arm) == want
        assert all(a["wall_ms_median"] > 0 for a in by_arm.values())
    assert "operator/fast" in printed


@pytest.mark.slow
def test_tp_overhead(tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    argv = ["--model", "tiny-llama", "--tokens", "128", "--repeats", "1", "--preemptions", "2"]
    printed = run_script(
        "prefill/tp_overhead.py", *argv, "--iters", "100", "--out", str(out), tmp_path=tmp_path
    )
    figures = json.loads(out.read_text())
    assert set(figures["agreement_us"]) == {"shared table", "all-reduce"}
    assert {"TP=2 none", "TP=2 operator"} <= figures["relative_prefill_time"].keys()
    assert "Rank agreement" in printed and "TP=2 / TP=1 prefill time" in printed


def test_validate_engine(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["--model", "tiny-llama", "--num-requests", "8", "--out", str(out)]
    printed = run_script("sim/validate_engine.py", *argv, tmp_path=tmp_path)
    measured = [json.loads(line) for line in (out / "measured.jsonl").read_text().splitlines()]
    assert len(measured) == 8 and all(r["ttft_s"] > 0 for r in measured)
    assert (out / "profile.json").is_file()
    assert "simulated vs measured TTFT error" in printed and "engine served 8 requests" in printed
