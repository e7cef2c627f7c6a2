"""Colocated prefill and decode on one device (flowprefill/lab/sim/colocated.py) and its
benchmark (benchmarks/sim/colocated.py). Hand-built cases check the TBT accounting
against the rules the module states."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.sim import colocated
from flowprefill.bench.workload import Workload, get_slo_table, qwen_like
from flowprefill.contracts.names import Granularity
from flowprefill.lab.sim.colocated import MAX_BLOCKING_S, run_colocated, run_vllm
from flowprefill.lab.sim.cost import build_cost_model
from flowprefill.lab.sim.decode import DecodeCostModel, DecodeRecord
from flowprefill.lab.sim.plan import ExecutionPlan

COST = build_cost_model("llama3-8b", "a100")
DECODE = DecodeCostModel(COST)


def _solo_s(num_tokens: int) -> float:
    return ExecutionPlan.build(
        COST, [num_tokens], granularity=Granularity.OPERATOR, max_blocking_s=MAX_BLOCKING_S
    ).total_s


def _pair(short_done_s: float) -> Workload:
    """A 64-token text request at 0; a 16K search prompt 1 ms after its first token."""
    return Workload(
        "pair",
        arrival_s=(0.0, short_done_s + 0.001),
        num_tokens=(64, 16384),
        slo_class=("text", "search"),
        slo_table=get_slo_table("llama3-8b"),
        base_rate=1.0,
    )


def test_a_long_prefill_shares_the_device_with_a_decoding_request() -> None:
    # Processor sharing (α = 1): step 1 starts solo and B's prefill joins 1 ms into it
    # (the rest is shared: +1× the rest); step 2 starts while B runs (2× its solo time);
    # B loses 1× the solo time of everything it shared.
    t_a = _solo_s(64)
    res = run_colocated("flowprefill", _pair(t_a), COST, rate=1.0, outputs=[3, 1], keep_gaps=True)
    a, b = res.records
    d1, d2 = DECODE.step_s([65]), DECODE.step_s([66])
    assert a.first_token_s == pytest.approx(t_a)
    assert a.gaps_s == pytest.approx([d1 + (d1 - 0.001), 2 * d2], abs=1e-9)
    lost = (d1 - 0.001) + d2
    assert res.ttft_s(1) == pytest.approx(_solo_s(16384) + lost, abs=1e-9)
    assert b.done and b.num_gaps == 0
    assert res.num_parks == 0


def test_decode_aware_parks_the_prefill_at_an_operator_boundary() -> None:
    # A 20 ms TBT target: sharing step 2 would take 2 × 12.5 ms, past it. Decode-aware,
    # the prefill parks at its next checkpoint (≤ 4 ms away) and the step runs alone.
    t_a = _solo_s(64)
    tight = {"text": 0.02, "image": 0.02, "search": 0.2, "file": 0.2}
    runs = {
        name: run_colocated(
            name, _pair(t_a), COST, rate=1.0, outputs=[3, 1], keep_gaps=True, tbt_slos_s=tight
        )
        for name in ("flowprefill", "flowprefill-da")
    }
    d2 = DECODE.step_s([66])
    incidental, aware = runs["flowprefill"].records[0], runs["flowprefill-da"].records[0]
    assert incidental.gaps_s[1] == pytest.approx(2 * d2) and incidental.gaps_s[1] > 0.02
    assert d2 <= aware.gaps_s[1] <= d2 + MAX_BLOCKING_S + 1e-9
    assert aware.gaps_s[1] <= 0.02
    assert runs["flowprefill-da"].num_parks == 1
    assert runs["flowprefill-da"].num_vetoes == 0  # the 16K prompt still makes its target
    # The parked prefill loses the whole solo step (not α × it): its first token is later.
    assert runs["flowprefill-da"].ttft_s(1) == pytest.approx(
        runs["flowprefill"].ttft_s(1), abs=1e-9
    )  # α = 1: both lose exactly d2


def test_decode_aware_does_not_park_a_prefill_whose_ttft_the_park_would_cost() -> None:
    # The same pair, with TTFT targets a hundredth of §6.5's: the 16K prompt cannot end by
    # its deadline, so a park would only delay it (and the queue): the engine's TTFT-first
    # rule vetoes it, and the step shares the device as without decode-aware.
    t_a = _solo_s(64)
    tight = {"text": 0.02, "image": 0.02, "search": 0.2, "file": 0.2}
    runs = {
        name: run_colocated(
            name,
            _pair(t_a),
            COST,
            rate=1.0,
            outputs=[3, 1],
            keep_gaps=True,
            tbt_slos_s=tight,
            ttft_scale=0.01,
        )
        for name in ("flowprefill", "flowprefill-da")
    }
    aware = runs["flowprefill-da"]
    assert aware.num_parks == 0 and aware.num_vetoes == 1
    assert aware.records[0].gaps_s == pytest.approx(runs["flowprefill"].records[0].gaps_s)
    assert aware.ttft_s(1) == pytest.approx(runs["flowprefill"].ttft_s(1), abs=1e-9)


def test_vllm_iterations_mix_every_decode_with_up_to_2k_prompt_tokens() -> None:
    a = DecodeRecord(100, 3, 0.1, keep_gaps=True)
    b = DecodeRecord(5000, 2, 0.2, keep_gaps=True)
    iterations = run_vllm([0.0, 0.0001], [a, b], DECODE)
    t1 = DECODE.iteration_s([(100, 0)], [])  # B not there yet
    t2 = t1 + DECODE.iteration_s([(2047, 0)], [101])  # A's decode takes 1 of 2,048
    t3 = t2 + DECODE.iteration_s([(2047, 2047)], [102])
    t4 = t3 + DECODE.iteration_s([(906, 4094)], [])  # A done: B's last 906 tokens
    t5 = t4 + DECODE.iteration_s([], [5001])
    assert iterations == 5
    assert a.first_token_s == pytest.approx(t1) and a.gaps_s == pytest.approx([t2 - t1, t3 - t2])
    assert b.first_token_s == pytest.approx(t4) and b.gaps_s == pytest.approx([t5 - t4])
    # Every gap of A carries a 2K chunk: past text's 0.1 s TBT target.
    assert not a.met_tbt and a.gaps_within == 0


@pytest.mark.parametrize("system", ["vllm-cp2k", "flowprefill", "flowprefill-da"])
def test_a_seeded_run_is_reproducible(system: str) -> None:
    def once() -> list[tuple[float | None, float | None]]:
        res = run_colocated(system, qwen_like(150, seed=5), COST, rate=5.0, seed=5)
        return [(r.first_token_s, r.mean_tbt_s) for r in res.records]

    first = once()
    assert first == once()
    assert all(t is not None for t, _ in first)


def test_benchmark_smoke(tmp_path: Path) -> None:
    assert colocated.main(["--quick", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "result.json").read_text())
    assert set(doc["curves"]) == {"vllm-cp2k", "flowprefill", "flowprefill-da"}
    assert len(doc["curves"]["flowprefill"]["tbt"]) == len(doc["rates"]) == 2
    assert doc["summary"]["flowprefill_vs_vllm-cp2k_ttft_ge_at_every_rate"] is True
    assert set(doc["tight_curves"]) == {"flowprefill", "flowprefill-da"}
    assert (tmp_path / "fig16_colocated.png").stat().st_size > 0
