from __future__ import annotations

import csv
import itertools
from statistics import mean

import pytest

from flowprefill.errors import UnknownNameError
from flowprefill.predictor.model import TTFTPredictor
from flowprefill.sim.cost import ProfileCostModel, build_cost_model
from flowprefill.sim.vidur import load_tables


def csv_median(op: str, n: int, tp: int = 1) -> float:
    from importlib import resources

    text = resources.files("flowprefill").joinpath("data", "vidur", "a100_Meta-Llama-3-8B_mlp.csv")
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
