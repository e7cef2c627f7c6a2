"""Tensor parallelism: two gloo processes on CPU park at the same checkpoint."""

from __future__ import annotations

import pytest

from flowprefill.executor.tp_demo import run_demo


@pytest.mark.slow
def test_tp_ranks_park_at_the_same_checkpoint_and_results_are_exact() -> None:
    result = run_demo(world=2)
    rank0, rank1 = result["reports"]
    # Every preempted task really parked, on both ranks, at the same checkpoint numbers.
    assert result["preempted"] == {"A": True, "B": True, "D": True}
    for key in ("A", "B", "D"):
        assert rank0["parked_at"][key], key
        assert rank0["parked_at"][key] == rank1["parked_at"][key], key
    for key in ("solo-A", "solo-B", "solo-C", "C"):
        assert rank0["parked_at"][key] == rank1["parked_at"][key] == []
    # Finished tasks passed every checkpoint; the cancelled one stopped on both ranks.
    for report in (rank0, rank1):
        for key in ("A", "B", "C"):
            assert report["num_checkpoints"][key] == report["per_forward"] == 20
        assert report["errors"] == {"D": "TaskCancelledError"}
    # Nested preemption left results bit-identical; TP matches the unsharded stack.
    assert result["bit_identical"] == {"A": True, "B": True, "C": True}
    assert all(diff < 1e-4 for diff in result["max_abs_diff_vs_unsharded"].values())
