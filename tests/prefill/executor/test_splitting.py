"""Run-time operator splitting: same results, bounded stretches, exact checkpoint counts.

Tolerance: splitting changes only the order of float32 sums inside attention (a block's
keys before it and its own square are merged by log-sum-exp); linears' row tiles compute
the same dot products. Logits and every KV tensor agree with the unsplit executor within
``ATOL`` (measured ≤ 1e-6 on the tiny models) and the first token is the same. A
preempted-and-resumed split prefill is bit-identical to an uninterrupted split prefill.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from transformers import PreTrainedModel

from flowprefill.contracts import EngineConfig
from flowprefill.contracts.engine import DEFAULT_MAX_BLOCKING_MS, DEFAULT_MAX_BLOCKING_MS_CPU
from flowprefill.prefill.executor.calibration import calibrate
from flowprefill.prefill.executor.checkpoints import find_decoder_layers
from flowprefill.prefill.executor.packing import Segment
from flowprefill.prefill.executor.preemption import TaskControl
from flowprefill.prefill.executor.runner import PreemptibleExecutor, PrefillOutput
from flowprefill.prefill.executor.splitting import (
    MIN_ROWS,
    Packer,
    SplitPolicy,
    SplitRates,
    _pairs,
    attention_plan,
    block_attention,
    install_split_operators,
    row_tiles,
)
from flowprefill.prefill.executor.tiling import RowProfile
from tests.prefill.executor.helpers import StopAt, TaskThread, assert_bit_identical, random_prompts

MakeExecutor = Callable[..., PreemptibleExecutor]
ATOL = 1e-5
# Fixed rates make the split plan independent of how fast this machine is today: with
# 1 GFLOP/s and a 0.05 ms bound every operator of a few-hundred-token prompt is split.
RATES = SplitRates(gemm_flop_per_s=1e9, attention_flop_per_s=1e9)
TIGHT_MS = 0.05


def assert_close(split: list[PrefillOutput], whole: list[PrefillOutput]) -> None:
    for x, y in zip(split, whole, strict=True):
        assert x.first_token_id == y.first_token_id
        torch.testing.assert_close(x.logits, y.logits, atol=ATOL, rtol=0)
        for (k1, v1), (k2, v2) in zip(x.kv_cache, y.kv_cache, strict=True):
            torch.testing.assert_close(k1, k2, atol=ATOL, rtol=0)
            torch.testing.assert_close(v1, v2, atol=ATOL, rtol=0)


def counted_run(executor: PreemptibleExecutor, prompts: list[list[int]]) -> tuple[list, int]:
    control = TaskControl("count")
    out = executor.run(prompts, control)
    return out, control.num_checkpoints


@pytest.mark.parametrize("chunk_size", [None, 64])
def test_split_prefill_matches_unsplit(
    tiny_model: PreTrainedModel, make_executor: MakeExecutor, chunk_size: int | None
) -> None:
    """Llama, Qwen2 and Qwen3-MoE (experts split too), batched and chunked."""
    lengths = [300, 40, 180]
    prompts = random_prompts(lengths, int(tiny_model.config.vocab_size), seed=5)
    whole = make_executor(tiny_model, chunk_size=chunk_size)
    reference, whole_checks = counted_run(whole, prompts)
    whole.close()
    split = make_executor(
        tiny_model, chunk_size=chunk_size, max_blocking_ms=TIGHT_MS, split_rates=RATES
    )
    out, checks = counted_run(split, prompts)
    assert_close(out, reference)
    assert checks > 2 * whole_checks  # it really split
    assert checks == split.expected_checkpoints(lengths)


def test_short_prompts_run_exactly_as_unsplit(
    tiny_model: PreTrainedModel, make_executor: MakeExecutor
) -> None:
    """Nothing is predicted over the bound: same kernels, same bits; the only added
    checkpoints are the one at each decoder layer's entry."""
    lengths = [37, 12]
    prompts = random_prompts(lengths, int(tiny_model.config.vocab_size), seed=6)
    whole = make_executor(tiny_model)
    reference, whole_checks = counted_run(whole, prompts)
    whole.close()
    split = make_executor(tiny_model, max_blocking_ms=1000.0, split_rates=RATES)
    out, checks = counted_run(split, prompts)
    assert_bit_identical(out, reference)
    layers = int(tiny_model.config.num_hidden_layers)
    assert checks == whole_checks + layers == split.expected_checkpoints(lengths)


@pytest.mark.parametrize("chunk_size", [None, 64])
def test_nested_preemptions_inside_split_operators_are_bit_identical(
    tiny_model: PreTrainedModel, make_executor: MakeExecutor, chunk_size: int | None
) -> None:
    """A is preempted inside a split operator by B, B inside one by C; C finishes, B and
    A resume and finish; A is preempted once more. Every output equals its solo split run
    exactly (parking continues the same frame: the tile loop resumes where it stopped)."""
    executor = make_executor(
        tiny_model, chunk_size=chunk_size, max_blocking_ms=TIGHT_MS, split_rates=RATES
    )
    vocab = executor.vocab_size
    pa, pb, pc = (
        random_prompts(n, vocab, seed=s) for n, s in (([200, 90], 1), ([150], 2), ([20], 3))
    )
    solo = {name: executor.prefill(p) for name, p in zip("abc", (pa, pb, pc), strict=True)}
    expected_a = executor.expected_checkpoints([200, 90])
    stops_a = [5, expected_a // 2, expected_a - 3]
    a = TaskThread(executor, pa, StopAt("A", at=stops_a)).start()
    a_control = a.control
    assert isinstance(a_control, StopAt)
    a_control.preempt_at(stops_a[0])
    b = TaskThread(executor, pb, StopAt("B", at=[17])).start()
    b_control = b.control
    assert isinstance(b_control, StopAt)
    b_control.preempt_at(17)
    c = TaskThread(executor, pc, TaskControl("C")).start()
    assert_bit_identical(c.join(), solo["c"])
    b_control.resume()
    assert_bit_identical(b.join(), solo["b"])
    for stop in stops_a[1:]:
        a_control.resume()
        a_control.preempt_at(stop)
    a_control.resume()
    assert_bit_identical(a.join(), solo["a"])
    assert a_control.num_checkpoints == expected_a
    assert a_control.progress == 1.0


@settings(max_examples=12, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 260), min_size=1, max_size=4),
    chunk=st.sampled_from([None, 16, 100]),
    bound=st.sampled_from([0.02, 0.1, 0.5, 3.0]),
)
def test_expected_checkpoints_equal_those_passed(
    tiny_models: dict[str, PreTrainedModel],
    lengths: list[int],
    chunk: int | None,
    bound: float,
) -> None:
    """The scheduler's progress is checkpoints passed / expected: the prediction replays
    the packing exactly, for any batch, chunking and bound."""
    model = tiny_models["llama"]
    with PreemptibleExecutor(
        model, chunk_size=chunk, max_blocking_ms=bound, split_rates=RATES
    ) as executor:
        _, checks = counted_run(executor, random_prompts(lengths, 1000, seed=sum(lengths)))
        assert checks == executor.expected_checkpoints(lengths)


def sawtooth_rates(model: PreTrainedModel) -> SplitRates:
    """RATES plus a GPU-like profile for every decoder weight shape: a GEMM of a multiple
    of 48 rows runs at the rate, any other row count 25 % slower (a partial wave)."""
    shapes = {
        tuple(m.weight.shape)
        for m in find_decoder_layers(model)[1].modules()
        if isinstance(m, torch.nn.Linear)
    }
    rows = tuple(range(16, 1025, 16))
    profiles = {}
    for out_f, in_f in shapes:
        per_row = 2.0 * out_f * in_f / RATES.gemm_flop_per_s
        profiles[2.0 * out_f * in_f] = RowProfile(
            rows, tuple(m * per_row * (1.0 if m % 48 == 0 else 1.25) for m in rows)
        )
    return SplitRates(RATES.gemm_flop_per_s, RATES.attention_flop_per_s, profiles)


@pytest.mark.parametrize("family", ["llama"], indirect=True)
def test_profiled_tiles_give_the_same_results_and_exact_counts(
    tiny_model: PreTrainedModel, make_executor: MakeExecutor
) -> None:
    """With a measured GEMM profile (CUDA) the planner picks other tiles than equal ones;
    results still equal the unsplit run's and the checkpoint count is still predicted."""
    lengths = [300, 40, 180]
    prompts = random_prompts(lengths, int(tiny_model.config.vocab_size), seed=7)
    whole = make_executor(tiny_model)
    reference, _ = counted_run(whole, prompts)
    whole.close()
    bound_ms = 1.0  # ~60 rows of the widest linear at RATES
    equal = make_executor(tiny_model, max_blocking_ms=bound_ms, split_rates=RATES)
    _, equal_checks = counted_run(equal, prompts)
    equal.close()
    profiled = make_executor(
        tiny_model, max_blocking_ms=bound_ms, split_rates=sawtooth_rates(tiny_model)
    )
    out, checks = counted_run(profiled, prompts)
    assert_close(out, reference)
    assert checks == profiled.expected_checkpoints(lengths)
    assert checks != equal_checks  # other tiles: the profile was used


@pytest.mark.parametrize("family", ["llama"], indirect=True)
def test_calibration_profiles_every_weight_shape_when_asked(tiny_model: PreTrainedModel) -> None:
    """On CUDA by default, here forced: one profile per distinct decoder weight shape,
    row counts on the grid, positive times."""
    handle = install_split_operators(find_decoder_layers(tiny_model)[1])
    try:
        rates = calibrate(
            handle,
            int(tiny_model.config.num_attention_heads),
            int(tiny_model.config.hidden_size) // int(tiny_model.config.num_attention_heads),
            torch.device("cpu"),
            torch.float32,
            lambda: None,
            repeats=1,
            max_blocking_s=0.002,
            profile_rows=True,
        )
    finally:
        handle.remove()
    assert set(rates.gemm_profiles) == {cost for _, cost in handle_costs(tiny_model)}
    for profile in rates.gemm_profiles.values():
        assert len(profile.rows) >= 2 and all(r % 256 == 0 for r in profile.rows)
        assert all(t > 0 for t in profile.seconds)
    assert rates.piece_overhead_s > 0
    handle = install_split_operators(find_decoder_layers(tiny_model)[1])
    try:
        off = calibrate(
            handle, 4, 16, torch.device("cpu"), torch.float32, lambda: None, repeats=1,
            max_blocking_s=0.002,
        )  # fmt: skip
    finally:
        handle.remove()
    assert off.gemm_profiles == {}  # CPU default: GEMM time is linear in rows there


def handle_costs(model: PreTrainedModel) -> list[tuple[object, float]]:
    handle = install_split_operators(find_decoder_layers(model)[1])
    try:
        return list(handle.linears)
    finally:
        handle.remove()


# ------------------------------------------------------------------------------ plans


@given(
    segs=st.lists(st.tuples(st.integers(1, 3000), st.integers(0, 3000)), min_size=1, max_size=4),
    budget=st.floats(1e3, 1e7),
)
def test_attention_plan_covers_rows_within_budget(
    segs: list[tuple[int, int]], budget: float
) -> None:
    segments, k = [], 0
    q = 0
    for rows, earlier in segs:
        segments.append(Segment(q, q + rows, k, k + earlier + rows))
        q += rows
        k += earlier + rows
    pieces = attention_plan(segments, budget)
    for index, seg in enumerate(segments):
        mine = [(p, pairs) for p, pairs in pieces if p.segment == index]
        rows = seg.q_end - seg.q_start
        offset = seg.k_end - seg.k_start - rows
        assert mine[0][0].q_start == 0 and mine[-1][0].q_end == rows
        for (p1, _), (p2, _) in itertools.pairwise(mine):
            assert p1.q_end == p2.q_start
        whole = _pairs(offset, 0, rows) <= budget
        assert (len(mine) == 1 and mine[0][0].whole) == whole
        for piece, pairs in mine:
            assert pairs == _pairs(offset, piece.q_start, piece.q_end)
            if not piece.whole:
                size = piece.q_end - piece.q_start
                assert pairs <= budget or size == MIN_ROWS or piece.q_end == rows


@given(rows=st.integers(1, 100_000), tile=st.integers(1, 5000))
def test_row_tiles_are_near_equal_and_cover(rows: int, tile: int) -> None:
    tiles = row_tiles(rows, tile)
    assert len(tiles) == math.ceil(rows / tile)
    assert tiles[0][0] == 0 and tiles[-1][1] == rows
    sizes = [b - a for a, b in tiles]
    assert max(sizes) <= tile and max(sizes) - min(sizes) <= 1


@given(
    pieces=st.lists(st.floats(0.0, 0.02), min_size=1, max_size=50),
    bound=st.floats(0.001, 0.01),
)
def test_packer_keeps_every_stretch_within_the_bound(pieces: list[float], bound: float) -> None:
    marks: list[int] = []
    packer = Packer(SplitPolicy(bound, RATES), lambda: marks.append(len(seen)))
    seen: list[float] = []
    predicted = Packer(SplitPolicy(bound, RATES), lambda: None).count(pieces, split=False)
    for t in pieces:
        packer.piece(t)
        seen.append(t)
    assert len(marks) == predicted
    bounds = [0, *marks, len(pieces)]
    for a, b in itertools.pairwise(bounds):
        stretch = pieces[a:b]
        # Over the bound only as one piece that alone exceeds it (zero-cost ones aside).
        assert sum(stretch) <= bound + 1e-12 or sum(stretch) - max(stretch) <= 1e-12


def test_block_attention_equals_causal_attention_rows() -> None:
    """Block [a, b) with keys before it merged by log-sum-exp = those rows of full causal
    attention (bottom-right aligned when earlier chunks' keys precede the queries)."""
    torch.manual_seed(0)
    heads, dim, earlier, rows = 4, 16, 50, 300
    q = torch.randn(1, heads, rows, dim)
    k = torch.randn(1, heads, earlier + rows, dim)
    v = torch.randn(1, heads, earlier + rows, dim)
    allowed = torch.arange(earlier + rows)[None, :] <= (torch.arange(rows)[:, None] + earlier)
    full = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    for a, b in [(0, 64), (64, 200), (200, 300)]:
        block = block_attention(q, k, v, a, b, earlier, None)
        torch.testing.assert_close(block, full[:, :, a:b], atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------- config


def test_engine_config_bound_defaults_per_device() -> None:
    assert EngineConfig().resolved_max_blocking_ms() == DEFAULT_MAX_BLOCKING_MS_CPU
    # On a GPU only when asked (docs/gpu.md: the H100 ran slower split).
    assert EngineConfig(device="cuda:0").resolved_max_blocking_ms() is None
    cuda_split = EngineConfig(device="cuda:0", max_blocking_ms=DEFAULT_MAX_BLOCKING_MS)
    assert cuda_split.resolved_max_blocking_ms() == DEFAULT_MAX_BLOCKING_MS
    assert EngineConfig(max_blocking_ms=7).resolved_max_blocking_ms() == 7.0
    assert EngineConfig(max_blocking_ms="off").resolved_max_blocking_ms() is None
    # Only operator granularity splits: layer/none keep their coarser contract.
    assert EngineConfig(granularity="layer", max_blocking_ms=7).resolved_max_blocking_ms() is None
    for bad in (0, -3, "on"):
        with pytest.raises(ValidationError, match="max_blocking_ms"):
            EngineConfig(max_blocking_ms=bad)


def test_executor_refuses_a_non_positive_bound_and_leaves_no_hooks(
    tiny_models: dict[str, PreTrainedModel],
) -> None:
    model = tiny_models["llama"]
    with pytest.raises(ValueError, match="max_blocking_ms"):
        PreemptibleExecutor(model, max_blocking_ms=0.0, split_rates=RATES)
    PreemptibleExecutor(model).close()  # nothing left installed by the failed one
