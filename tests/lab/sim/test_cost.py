from __future__ import annotations

import csv
import itertools
from statistics import mean

import pytest

from flowprefill.errors import InvalidRequestError, UnknownNameError
from flowprefill.lab.sim.cost import TP_CHECK_S, build_cost_model
from flowprefill.lab.sim.profile import ProfileCostModel
from flowprefill.lab.sim.vidur import load_tables
from flowprefill.prefill.predictor.model import TTFTPredictor


def csv_median(op: str, n: int, tp: int = 1) -> float:
    from importlib import resources

    text = resources.files("flowprefill.lab.sim").joinpath(
        "data", "vidur", "a100_Meta-Llama-3-8B_mlp.csv"
    )
    rows = [
        r
        for r in csv.DictReader(text.read_text().splitlines())
        if int(r["num_tokens"]) == n and int(r["num_tensor_parallel_workers"]) == tp
    ]
    return mean(float(r[f"time_stats.{op}.median"]) for r in rows)


def test_gemm_segments_are_the_csv_medians_at_profiled_points() -> None:
    cost = build_cost_model("llama3-8b", "a100", pass_overhead_s=0.0)
    pc = cost.pass_cost([(4096, 0)])
    qkv = csv_median("input_layernorm", 4096) + csv_median("attn_pre_proj", 4096)
    qkv += csv_median("attn_rope", 4096)
    assert pc.op_s[0] == pytest.approx(qkv * 1e-3, rel=1e-12)
    up = csv_median("post_attention_layernorm", 4096) + csv_median("mlp_up_proj", 4096)
    assert pc.op_s[3] == pytest.approx(up * 1e-3, rel=1e-12)
    assert pc.pre_s == pytest.approx(csv_median("emb", 4096) * 1e-3, rel=1e-12)
    assert pc.num_layers == 32


def test_interpolates_between_and_extrapolates_linearly_beyond_the_table() -> None:
    t = load_tables()[1]
    xs = [int(x) for x in t.num_tokens]
    n = next(x + 1 for x, y in itertools.pairwise(xs) if y - x > 2 and x > 1000)
    lo = max(x for x in xs if x < n)
    hi = min(x for x in xs if x > n)
    a, b = t.time_ms("mlp_up_proj", lo), t.time_ms("mlp_up_proj", hi)
    assert t.time_ms("mlp_up_proj", n) == pytest.approx(a + (b - a) * (n - lo) / (hi - lo))
    assert t.time_ms("mlp_up_proj", 65536) == pytest.approx(2 * t.time_ms("mlp_up_proj", 32768))


def test_attention_is_causal_flops_at_the_stated_efficiency() -> None:
    cost = build_cost_model("llama3-8b", "a100", attn_efficiency=0.5)
    n = 8192
    flops = 4 * 32 * 128 * (n * n / 2)
    assert cost.attention_s([(n, 0)]) == pytest.approx(flops / (312e12 * 0.5))


def test_kv_reread_makes_smaller_chunks_slower() -> None:
    cost = build_cost_model("llama3-8b", "a100")
    n = 32768

    def total(chunk: int) -> float:
        return sum(cost.pass_cost([(min(chunk, n - p), p)]).total_s for p in range(0, n, chunk))

    whole = cost.pass_cost([(n, 0)]).total_s
    assert whole < total(8192) < total(2048) < total(512)
    # Same FLOPs: the difference is pass overhead + the re-read of the cached prefix.
    reread = cost.attention_s([(2048, 30720)]) - cost.attention_s([(2048, 0)])
    assert reread > 4 * 32 * 128 * 2048 * 30720 / (312e12 * 0.6)


def test_other_models_and_gpus_scale_by_stated_ratios() -> None:
    a100 = build_cost_model("llama3-8b", "a100", pass_overhead_s=0.0)
    h100 = build_cost_model("llama3-8b", "h100", pass_overhead_s=0.0)
    assert h100.pass_cost([(4096, 0)]).op_s[3] == pytest.approx(
        a100.pass_cost([(4096, 0)]).op_s[3] * 312 / 989
    )
    big = build_cost_model("llama3-70b", "a100", pass_overhead_s=0.0)
    assert big.tp == 4 and big.model.num_layers == 80
    assert big.pass_cost([(4096, 0)]).total_s > a100.pass_cost([(4096, 0)]).total_s
    assert big.allreduce_s(4096) > 0 and a100.allreduce_s(4096) == 0


@pytest.mark.parametrize(
    ("model", "gpu", "what"), [("gpt-5", "a100", "model"), ("llama3-8b", "tpu", "GPU")]
)
def test_unknown_names_list_the_known_ones(model: str, gpu: str, what: str) -> None:
    with pytest.raises(UnknownNameError, match=what) as err:
        build_cost_model(model, gpu)
    assert err.value.known


def test_unprofiled_tp_degree_is_rejected() -> None:
    with pytest.raises(UnknownNameError, match="tensor-parallel"):
        build_cost_model("llama3-8b", "a100", tp=3)


def test_profile_cost_model_charges_the_marginal_polynomial() -> None:
    pred = TTFTPredictor(coefficients=[0.01, 1e-4, 1e-8])
    cost = ProfileCostModel(pred, num_layers=2)
    whole = cost.pass_cost([(1000, 0)])
    assert whole.total_s == pytest.approx(pred.predict_s(1000))
    second_half = cost.pass_cost([(500, 500)]).total_s
    first_half = cost.pass_cost([(500, 0)]).total_s
    # Chunking pays the constant term twice, the token work once.
    assert first_half + second_half == pytest.approx(pred.predict_s(1000) + 0.01)
    assert len(whole.op_s) == 5 and whole.num_layers == 2


def _row_parallel_segments_s(n: int, tp: int) -> tuple[float, float]:
    """Llama-3-70B's o_proj and down_proj segments at TP ``tp`` from the CSV, without
    communication: each vidur op × its weight (or width) ratio to Llama-3-8B."""
    o_ratio = (64 * 128 * 8192) / (32 * 128 * 4096)
    down_ratio = (28672 * 8192) / (14336 * 4096)
    o = csv_median("attn_post_proj", n, tp) * o_ratio + csv_median("add", n, tp) * 2
    down = csv_median("mlp_act", n, tp) * 28672 / 14336
    down += csv_median("mlp_down_proj", n, tp) * down_ratio + csv_median("add", n, tp) * 2
    return o * 1e-3, down * 1e-3


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tp_adds_a_ring_allreduce_after_each_row_parallel_operator(tp: int) -> None:
    """Two all-reduces per layer (after o_proj and after down_proj), each of the tokens'
    bf16 activations over the ring: latency + 2(TP−1)/TP · n · hidden · 2 B / NVLink."""
    n = 4096
    cost = build_cost_model("llama3-70b", "a800", tp=tp, pass_overhead_s=0.0)
    expected_comm = 10e-6 + 2 * (tp - 1) / tp * n * 8192 * 2 / 200e9
    o, down = _row_parallel_segments_s(n, tp)
    op_s = cost.pass_cost([(n, 0)]).op_s
    assert op_s[2] == pytest.approx(o + expected_comm, rel=1e-9)
    assert op_s[4] == pytest.approx(down + expected_comm, rel=1e-9)
    assert cost.allreduce_s(n) == pytest.approx(expected_comm, rel=1e-12)
    # Column-parallel qkv_proj and gate_up need no all-reduce: same on every NVLink.
    fast = build_cost_model("llama3-70b", "a100", tp=tp, pass_overhead_s=0.0)
    fast_s = fast.pass_cost([(n, 0)]).op_s
    assert fast_s[0] == op_s[0] and fast_s[3] == op_s[3] and fast_s[1] == op_s[1]
    assert fast_s[2] < op_s[2]


def test_tp_shards_attention_heads_and_kv_reread() -> None:
    tp1 = build_cost_model("llama3-70b", "a100", tp=1)
    tp4 = build_cost_model("llama3-70b", "a100", tp=4)
    assert tp4.attention_s([(8192, 0)]) == pytest.approx(tp1.attention_s([(8192, 0)]) / 4)
    # 8 KV heads over 4 ranks: each re-reads 2 heads' K and V of the cached prefix.
    reread4 = tp4.attention_s([(1, 30000)]) - tp4.attention_s([(1, 0)])
    flops4 = 4 * (64 // 4) * 128 * 30000 / (312e12 * 0.6)
    assert reread4 - flops4 == pytest.approx(30000 * 2 * 2 * 128 * 2 / 2.039e12)


def test_the_ideal_cost_pays_the_allreduce_bandwidth() -> None:
    """A800 = A100 but for NVLink: their ideal (bound) costs differ by exactly the two
    all-reduces per layer that no schedule can avoid (TP>1), and not at all at TP 1."""
    n, layers = 3000, 80
    a100 = build_cost_model("llama3-70b", "a100", tp=4)
    a800 = build_cost_model("llama3-70b", "a800", tp=4)
    per_token_bytes = 2 * (4 - 1) / 4 * 8192 * 2
    extra = 2 * layers * n * per_token_bytes * (1 / 200e9 - 1 / 300e9)
    assert a800.ideal_cost_s(n) - a100.ideal_cost_s(n) == pytest.approx(extra, rel=1e-9)
    assert build_cost_model("llama3-70b", "a800", tp=1).ideal_cost_s(n) == pytest.approx(
        build_cost_model("llama3-70b", "a100", tp=1).ideal_cost_s(n)
    )
    # The ideal never exceeds what a real solo pass costs.
    assert a800.ideal_cost_s(n) < a800.pass_cost([(n, 0)]).total_s


def test_checkpoints_cost_the_rank_agreement_only_under_tp() -> None:
    assert build_cost_model("llama3-70b", "a100", tp=1).checkpoint_s == 0.0
    assert build_cost_model("llama3-70b", "a100", tp=4).checkpoint_s == TP_CHECK_S > 0
    assert build_cost_model("llama3-70b", "a100", tp=4, tp_check_s=3e-5).checkpoint_s == 3e-5
    with pytest.raises(InvalidRequestError, match="--tp-check-us"):
        build_cost_model("llama3-70b", "a100", tp=4, tp_check_s=-1e-6)
