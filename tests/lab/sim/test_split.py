"""Run-time operator splitting in the simulator (flowprefill/lab/sim/split.py): pieces within
the bound, priced from the cost model, only where the engine would split."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import pytest

from flowprefill.bench.workload import Workload, get_slo_table
from flowprefill.contracts.engine import DEFAULT_MAX_BLOCKING_MS, DEFAULT_MAX_BLOCKING_MS_CPU
from flowprefill.contracts.names import Granularity
from flowprefill.lab.sim import cli
from flowprefill.lab.sim.cost import build_cost_model
from flowprefill.lab.sim.plan import INSTANT, ExecutionPlan
from flowprefill.lab.sim.pool import SimulatedPool
from flowprefill.lab.sim.profile import ProfileCostModel
from flowprefill.lab.sim.split import GPU_PIECE_OVERHEAD_S, MIN_ROWS, tile_sizes
from flowprefill.lab.sim.systems import SYSTEMS, build_instance, fit_predictor, run_system
from flowprefill.lab.sim.vidur import load_tables
from flowprefill.prefill.executor.splitting import row_tiles
from flowprefill.prefill.predictor.model import TTFTPredictor
from flowprefill.prefill.request import Request, Task

A100 = build_cost_model("llama3-8b", "a100")
A100_EQUAL = build_cost_model("llama3-8b", "a100", tile_plan="equal")
OVERHEAD = GPU_PIECE_OVERHEAD_S
ATTN, GATE_UP = 1, 3


def segment_pieces(pc_pieces: tuple[int, ...], op_s: tuple[float, ...]) -> list[list[float]]:
    """The stretches of each segment; a split one starts with a zero-length stretch (the
    engine's checkpoint before a split operator)."""
    out, i = [], 0
    for k in pc_pieces:
        out.append(list(op_s[i : i + k]))
        i += k
    return out


def work(pieces: list[float]) -> list[float]:
    """A split segment's pieces of work (without the leading checkpoint)."""
    assert len(pieces) > 1 and pieces[0] == 0.0
    return pieces[1:]


@pytest.mark.parametrize("bound_ms", [1.0, 2.0, 4.0, 8.0])
def test_a_32k_attention_is_split_into_pieces_within_the_bound(bound_ms: float) -> None:
    b = bound_ms / 1e3
    whole = A100.pass_cost([(32768, 0)])
    split = A100.split_pass_cost([(32768, 0)], b)
    attn = work(segment_pieces(split.pieces, split.op_s)[ATTN])
    assert whole.op_s[ATTN] > 40e-3  # the long operator the split is for
    # ceil(t / b) blocks; whole rows fill each block a little under b, so maybe one more.
    assert math.ceil(whole.op_s[ATTN] / b) <= len(attn) <= math.ceil(whole.op_s[ATTN] / b) + 1
    assert max(attn) <= b + OVERHEAD + 1e-12
    # The same FLOPs, plus one exposed launch per added checkpoint (one before each piece).
    assert sum(attn) == pytest.approx(whole.op_s[ATTN] + len(attn) * OVERHEAD, rel=1e-9)
    # Every GEMM segment over the bound is split too: with equal tiles ceil(t / b) of
    # them; with the profiled plan as many as its cheapest plan needs, each tile's
    # profile time within the bound.
    equal = A100_EQUAL.split_pass_cost([(32768, 0)], b)
    for i, pieces in enumerate(segment_pieces(equal.pieces, equal.op_s)):
        if i != ATTN and whole.op_s[i] > b:
            assert len(work(pieces)) == math.ceil(whole.op_s[i] / b)
        elif i != ATTN:
            assert pieces == [whole.op_s[i]]
    for i, pieces in enumerate(segment_pieces(split.pieces, split.op_s)):
        if i != ATTN and whole.op_s[i] > b:
            assert len(work(pieces)) >= math.ceil(whole.op_s[i] / b)
            assert max(work(pieces)) <= b + OVERHEAD + 1e-12
        elif i != ATTN:
            assert pieces == [whole.op_s[i]]
    assert split.num_added_checkpoints == 32 * (len(split.op_s) - 5)
    # Per split segment: its k pieces' checkpoints, one of them the leading one.
    assert split.num_added_checkpoints == 32 * sum(k - 1 for k in split.pieces if k > 1)


def test_gemm_tiles_cost_the_profile_at_the_tile_size() -> None:
    """gate_up of 32K tokens at 4 ms: ceil(34.2 / 4) = 9 tiles of 3641 (the last 3640)
    rows, each the vidur time at that many tokens — not a ninth of the whole."""
    b = 4e-3
    split = A100_EQUAL.split_pass_cost([(32768, 0)], b)
    tiles = work(segment_pieces(split.pieces, split.op_s)[GATE_UP])
    sizes = tile_sizes(32768, 9)
    assert sizes == [3641] * 8 + [3640]
    t = load_tables()[1]
    per_tile = [
        1e-3 * (t.time_ms("post_attention_layernorm", m) + t.time_ms("mlp_up_proj", m))
        for m in sizes
    ]
    assert tiles == pytest.approx([x + OVERHEAD for x in per_tile], rel=1e-12)
    whole = A100.pass_cost([(32768, 0)]).op_s[GATE_UP]
    assert sum(tiles) != pytest.approx(whole, rel=1e-3)  # smaller GEMMs are priced as such


def test_short_prompts_plans_are_identical_with_and_without_splitting() -> None:
    """Same stretches and total time; the only addition is the engine's zero-length stretch
    at each layer's entry (its checkpoint before every decoder layer when it splits)."""
    for lengths in ([512], [2048], [300, 900, 1500], [3000]):
        plain = ExecutionPlan.build(A100, lengths, granularity=Granularity.OPERATOR)
        split = ExecutionPlan.build(
            A100, lengths, granularity=Granularity.OPERATOR, max_blocking_s=4e-3
        )
        assert split.total_s == plain.total_s
        for s_pass, p_pass in zip(split.passes, plain.passes, strict=True):
            assert s_pass.op_s == (0.0, *p_pass.op_s)
        assert split.num_added_checkpoints == sum(p.num_layers for p in plain.passes)


def test_only_operator_granularity_splits() -> None:
    """The engine splits at operator granularity only: layer-level, chunked-baseline and
    oracle plans ignore the bound."""
    for g in (Granularity.LAYER, Granularity.NONE, INSTANT):
        for chunk in (None, 2048):
            plain = ExecutionPlan.build(A100, [32768], granularity=g, chunk_size=chunk)
            bounded = ExecutionPlan.build(
                A100, [32768], granularity=g, chunk_size=chunk, max_blocking_s=4e-3
            )
            assert bounded == plain
    for name in ("distserve-fcfs", "distserve-cp2k", "distserve-cp8k", "sedf-layer"):
        inst = build_instance(SYSTEMS[name], A100, lambda n: 1e-3 * n, max_blocking_s=4e-3)
        task = Task([Request.create("a", arrival_s=0.0, ttft_slo_s=9.0, num_tokens=32768)])
        inst.pool.submit(task)
        assert inst.pool.num_added_checkpoints == 0


def test_a_preempt_inside_a_split_attention_waits_at_most_one_piece() -> None:
    b = 4e-3
    pool = SimulatedPool(A100, Granularity.OPERATOR, max_blocking_s=b)
    task = Task([Request.create("a", arrival_s=0.0, ttft_slo_s=99.0, num_tokens=32768)])
    pool.submit(task)
    plan = pool.plan(task)
    p = plan.passes[0]
    q = p.pieces[0]  # attention's stretches start at op_s[q]: the leading checkpoint, blocks
    assert p.op_s[q] == 0.0
    # Half-way through the second block of layer 3's attention.
    into = p.pre_s + 3 * p.layer_s + sum(p.op_s[: q + 2]) + 0.5 * p.op_s[q + 2]
    pool.advance_to(into)
    outcome = pool.preempt(task)
    assert outcome.parked
    assert outcome.blocking_s == pytest.approx(0.5 * p.op_s[q + 2], rel=1e-9)
    assert outcome.blocking_s < b
    unsplit = ExecutionPlan.build(A100, [32768], granularity=Granularity.OPERATOR)
    unsplit_park = unsplit.next_checkpoint_s(into)
    assert unsplit_park is not None and unsplit_park - into > 20e-3  # instead of ~43 ms


def test_tp_all_reduce_runs_once_after_the_last_tile_and_checkpoints_pay_agreement() -> None:
    tp4 = build_cost_model("llama3-70b", "a100", tp=4, tp_check_s=5e-6, tile_plan="equal")
    n, b = 32768, 4e-3
    whole = tp4.pass_cost([(n, 0)])
    split = tp4.split_pass_cost([(n, 0)], b)
    o_proj = work(segment_pieces(split.pieces, split.op_s)[2])
    expected = [tp4._compute(m)[2] + OVERHEAD for m in tile_sizes(n, len(o_proj))]
    expected[-1] += tp4.allreduce_s(n)  # the whole all-reduce rides on the last tile, once
    assert o_proj == pytest.approx(expected, rel=1e-12)
    plain_plan = ExecutionPlan.build(tp4, [n], granularity=Granularity.OPERATOR)
    split_plan = ExecutionPlan.build(tp4, [n], granularity=Granularity.OPERATOR, max_blocking_s=b)
    extra_checkpoints = split_plan.num_added_checkpoints
    # The split pieces, plus the checkpoint at each of the 80 layers' entry.
    assert extra_checkpoints == 80 * (len(split.op_s) - 5) + 80
    added_compute = split.total_s - whole.total_s
    assert split_plan.total_s - plain_plan.total_s == pytest.approx(
        added_compute + extra_checkpoints * 5e-6, rel=1e-9
    )


def test_the_profiled_cpu_engine_splits_evenly_with_a_dispatch_cost() -> None:
    cost = ProfileCostModel(TTFTPredictor.linear(per_token_s=1e-3), num_layers=2)
    whole = cost.pass_cost([(1000, 0)])  # 10 segments of 0.1 s
    split = cost.split_pass_cost([(1000, 0)], 0.03)
    assert split.pieces == (5,) * 5  # a leading checkpoint and 4 pieces per segment
    first = segment_pieces(split.pieces, split.op_s)[0]
    assert first == pytest.approx([0.0] + [0.025 + cost.split_overhead_s] * 4)
    assert split.total_s == pytest.approx(whole.total_s + 2 * 5 * 4 * cost.split_overhead_s)


def test_tiles_are_cut_like_the_engines_row_tiles() -> None:
    assert tile_sizes(10_000, 3) == [3334, 3333, 3333]
    # At most ceil(n / MIN_ROWS) tiles: 100 rows → 7 tiles of 14 or 15 rows.
    assert tile_sizes(100, 8) == [15, 15, 14, 14, 14, 14, 14]
    assert len(tile_sizes(100, 8)) == math.ceil(100 / MIN_ROWS)
    assert tile_sizes(4096, 1) == [4096]
    for n, k in ((32768, 9), (5000, 7), (77, 2)):
        assert [b - a for a, b in row_tiles(n, math.ceil(n / k))] == tile_sizes(n, k)


def long_workload(num_requests: int = 120, seed: int = 3) -> Workload:
    """Short text requests among prompts of 16K–32K tokens, Poisson at 1 req/s."""
    rng = np.random.default_rng(seed)
    long = rng.random(num_requests) < 0.3
    tokens = np.where(long, rng.integers(16384, 32769, num_requests), 400)
    return Workload(
        name="long",
        arrival_s=tuple(float(t) for t in np.cumsum(rng.exponential(1.0, num_requests))),
        num_tokens=tuple(int(n) for n in tokens),
        slo_class=tuple("file" if x else "text" for x in long),
        slo_table=get_slo_table("llama3-8b"),
        base_rate=1.0,
    )


def test_blocking_is_bounded_in_a_simulation_with_32k_prompts() -> None:
    """Every wait is at most one piece — or the prologue (pass overhead + embedding + the
    first piece) when the signal comes before the first checkpoint of a pass."""
    w, b = long_workload(), DEFAULT_MAX_BLOCKING_MS / 1e3
    spec = SYSTEMS["flowprefill"]
    plain = run_system(spec, w, A100, rate=0.6, predictor=fit_predictor(A100))
    split = run_system(
        spec,
        w,
        A100,
        rate=0.6,
        predictor=fit_predictor(A100, max_blocking_s=b),
        max_blocking_s=b,
    )
    assert plain.num_preemptions > 20 and split.num_preemptions > 20
    assert max(plain.blocking_s) > 20e-3
    piece = max(max(A100.split_pass_cost([(n, 0)], b).op_s) for n in w.num_tokens)
    prologue = max(
        (lambda pc: pc.pre_s + pc.op_s[0])(A100.split_pass_cost([(n, 0)], b)) for n in w.num_tokens
    )
    # A tile's GEMM can run up to ~9 % slower per token than the whole (the profile's
    # wave-quantisation sawtooth), which the engine's FLOP-rate prediction cannot see.
    assert piece <= 1.1 * b + OVERHEAD
    assert max(split.blocking_s) <= max(piece, prologue) + 1e-12
    assert max(split.blocking_s) <= 4.5e-3  # this seed's signals all land inside layers
    assert split.num_added_checkpoints > 0 and plain.num_added_checkpoints == 0


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_cli_bound_defaults_to_the_engines_per_device_and_none_disables(tmp_path: Path) -> None:
    assert cli.config_from_args(parse([])).max_blocking_s == DEFAULT_MAX_BLOCKING_MS / 1e3
    profile = tmp_path / "p.json"
    TTFTPredictor.linear(per_token_s=1e-3).save(profile)
    cpu = cli.config_from_args(parse(["--profile", str(profile)]))
    assert cpu.max_blocking_s == DEFAULT_MAX_BLOCKING_MS_CPU / 1e3  # the CPU engine's
    for off in ("none", "0", "off"):
        assert cli.config_from_args(parse(["--max-blocking-ms", off])).max_blocking_s is None
    cfg = cli.config_from_args(parse(["--max-blocking-ms", "2.5", "--split-overhead-us", "30"]))
    assert cfg.max_blocking_s == pytest.approx(2.5e-3)
    assert cfg.cost.build().split_overhead_s == pytest.approx(30e-6)  # type: ignore[attr-defined]
    with pytest.raises(SystemExit):
        parse(["--max-blocking-ms", "-1"])


def test_profiled_tiles_avoid_the_profiles_expensive_sizes() -> None:
    """The vidur profile's time per token has a sawtooth in the token count: gate_up's 9
    equal tiles of 3,641 tokens cost 3.7 % more per token than the whole 32K; the profiled
    plan (the engine's on CUDA) finds tiles within the bound that cost less, and the
    split prompt costs less than with equal tiles at every long length."""
    b = 4e-3
    for n in (4096, 8192, 16384, 32768):
        equal = A100_EQUAL.split_pass_cost([(n, 0)], b)
        profiled = A100.split_pass_cost([(n, 0)], b)
        assert profiled.total_s < equal.total_s
        assert max(profiled.op_s) <= b + OVERHEAD + 1e-12
    split = A100.split_pass_cost([(32768, 0)], b)
    equal = A100_EQUAL.split_pass_cost([(32768, 0)], b)
    gate_up = work(segment_pieces(split.pieces, split.op_s)[GATE_UP])
    equal_gate_up = work(segment_pieces(equal.pieces, equal.op_s)[GATE_UP])
    assert sum(gate_up) < sum(equal_gate_up)
