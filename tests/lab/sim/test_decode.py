"""The decode step cost model and TBT records (flowprefill/lab/sim/decode.py), and the
pool's stall that colocated decode uses (flowprefill/lab/sim/pool.py)."""

from __future__ import annotations

import pytest

from flowprefill.contracts.names import Granularity
from flowprefill.lab.sim.cost import build_cost_model
from flowprefill.lab.sim.decode import DecodeCostModel, DecodeRecord, output_lengths
from flowprefill.lab.sim.pool import SimulatedPool
from flowprefill.prefill.request import Request, Task

A100 = DecodeCostModel(build_cost_model("llama3-8b", "a100"))
H100 = DecodeCostModel(build_cost_model("llama3-8b", "h100"))

# Llama-3-8B config.json: per layer qkv 4096×6144, o 4096×4096, gate_up 4096×2×14336,
# down 14336×4096; 32 layers; LM head 128,256×4096. bf16.
WEIGHT_BYTES = 2 * (32 * (4096 * 6144 + 4096 * 4096 + 4096 * 28672 + 14336 * 4096) + 128256 * 4096)
A100_HBM = 0.8 * 2.039e12  # datasheet × DECODE_HBM_EFFICIENCY
KV_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # 128 KiB


def test_memory_terms_are_the_hand_computed_bytes_over_bandwidth() -> None:
    assert abs(WEIGHT_BYTES - 15.009e9) < 2e6
    assert A100.weights_s == pytest.approx(WEIGHT_BYTES / A100_HBM)
    assert A100.kv_per_token_s == pytest.approx(KV_PER_TOKEN / A100_HBM)
    floor = A100.memory_floor_s([1000, 3000])
    assert floor == pytest.approx(0.002 + (WEIGHT_BYTES + 4000 * KV_PER_TOKEN) / A100_HBM)


def test_a100_step_magnitude_is_the_measured_gemms_not_the_floor() -> None:
    # vidur measured the 32 layers' linears at one row at 9.76 ms (> 8.56 ms for their
    # bytes at 0.8 × datasheet): the profile binds, one step at 1K of context ≈ 12.5 ms.
    step = A100.step_s([1024])
    assert step == pytest.approx(0.01248, abs=2e-4)
    assert step > A100.memory_floor_s([1024])


def test_h100_step_is_the_memory_floor() -> None:
    # GEMM times scaled by peak FLOP/s undercut the bytes: the floor binds.
    assert H100.step_s([1024]) == pytest.approx(H100.memory_floor_s([1024]))
    assert 0.006 < H100.step_s([1024]) < A100.step_s([1024])


@pytest.mark.parametrize("model", [A100, H100], ids=["a100", "h100"])
def test_step_grows_with_batch_and_context(model: DecodeCostModel) -> None:
    by_batch = [model.step_s([2048] * b) for b in (1, 2, 8, 32, 64, 128, 256)]
    assert by_batch == sorted(by_batch)
    assert by_batch[-1] > 1.5 * by_batch[0]
    by_ctx = [model.step_s([c] * 16) for c in (0, 512, 4096, 16384, 32768)]
    assert by_ctx == sorted(by_ctx) and by_ctx[-1] > by_ctx[0]


def test_a_mixed_iteration_reads_the_weights_once() -> None:
    ctx = [1024] * 32
    mixed = A100.iteration_s([(2048, 0)], ctx)
    chunk = A100.iteration_s([(2048, 0)], [])
    assert chunk == pytest.approx(A100.cost.pass_cost([(2048, 0)]).total_s)
    expected = A100.cost.pass_cost([(2048, 0)] + [(1, c) for c in ctx]).total_s + A100.lm_head_s
    assert mixed == pytest.approx(max(expected, A100.memory_floor_s(ctx)))
    assert chunk < mixed < chunk + A100.step_s(ctx)
    assert A100.iteration_s([], []) == 0.0


def test_output_lengths_are_seeded_and_bounded() -> None:
    a = output_lengths(2000, 3)
    assert a == output_lengths(2000, 3) and a != output_lengths(2000, 4)
    assert min(a) >= 2 and max(a) <= 1024
    assert 100 < sorted(a)[1000] < 160  # median 128


def test_record_counts_gaps_and_mean_tbt() -> None:
    rec = DecodeRecord(100, 4, 0.125, keep_gaps=True)  # binary-exact times
    for t in (1.0, 1.0625, 1.25, 1.375):
        rec.emit(t)
    assert rec.done and rec.gaps_s == [0.0625, 0.1875, 0.125]
    assert rec.gaps_within == 2 and rec.max_gap_s == 0.1875
    assert rec.mean_tbt_s == 0.125 and rec.met_tbt
    assert rec.context == 104
    with pytest.raises(RuntimeError):
        rec.emit(2.0)


def _running_pool(num_tokens: int = 4096) -> tuple[SimulatedPool, Task]:
    pool = SimulatedPool(A100.cost, Granularity.OPERATOR, None, 0.004)
    task = Task([Request.create("r", arrival_s=0.0, ttft_slo_s=10.0, num_tokens=num_tokens)])
    pool.submit(task)
    return pool, task


def test_stall_moves_completion_and_freezes_progress() -> None:
    pool, task = _running_pool()
    total = pool.plan(task).total_s
    token = pool.token(task)
    assert pool.stall(0.05, now_s=0.1) == 0.1
    assert pool.token(task) != token
    assert pool.done_s(task) == pytest.approx(total + 0.05)
    pool.advance_to(0.11)  # inside the stall: no work since 0.1
    p_mid = pool.progress(task)
    pool.advance_to(0.13)
    assert pool.progress(task) == p_mid
    # A preempt during a stall waits for it to end, then for the next checkpoint.
    out = pool.preempt(task)
    assert out.blocking_s >= 0.02 - 1e-12 and out.blocking_s <= 0.02 + 0.0041


def test_stall_at_next_checkpoint_parks_within_the_split_bound() -> None:
    pool, task = _running_pool(16384)
    begin = pool.stall(0.01, now_s=0.0333, at_next_checkpoint=True)
    assert 0.0333 <= begin <= 0.0333 + 0.0041  # operators split at 4 ms
    assert pool.done_s(task) == pytest.approx(pool.plan(task).total_s + 0.01)
