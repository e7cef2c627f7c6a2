"""The KV hand-off / second-token model (flowprefill/lab/sim/handoff.py), its use in the
simulator (SimResult, the sweep's first-gap attainment, ``--transport``) and the gap table
(benchmarks/sim/handoff_gap.py). Figures are hand-computed from the models' config.json."""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks.sim import handoff_gap
from flowprefill.errors import InvalidRequestError, UnknownNameError
from flowprefill.lab.sim import cli
from flowprefill.lab.sim.cost import PASS_OVERHEAD_S
from flowprefill.lab.sim.driver import Instance, Simulation
from flowprefill.lab.sim.handoff import (
    DECODE_HBM_EFFICIENCY,
    NVLINK_EFFICIENCY,
    TRANSPORTS,
    SecondTokenModel,
    Transport,
    attach_second_token,
    build_second_token,
    get_transport,
)
from flowprefill.lab.sim.hardware import get_gpu, get_model
from flowprefill.lab.sim.plan import INSTANT
from flowprefill.lab.sim.pool import SimulatedPool
from flowprefill.lab.sim.report import classes_table
from flowprefill.lab.sim.sweep import RunSummary, SweepResult, SystemOutcome
from flowprefill.prefill.scheduler.batching import NoBatching
from flowprefill.prefill.scheduler.core import Scheduler
from flowprefill.prefill.scheduler.policies import get_policy

from .conftest import PREDICTOR, ToyCost, req

KIB = 1024
LENGTHS = (1, 1024, 4096, 8192, 16384, 32768)


def test_kv_bytes_per_token_are_the_models_figures() -> None:
    # 2 (K, V) × layers × KV heads × head_dim × 2 B (bf16)
    assert get_model("llama3-8b").kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2 == 128 * KIB
    assert get_model("llama3-70b").kv_bytes_per_token() == 2 * 80 * 8 * 128 * 2 == 320 * KIB
    m = build_second_token("llama3-70b", "h100", "nvlink")
    assert m.tp == 4  # the paper's degree for 70B
    assert m.kv_bytes(1000) == 1000 * 320 * KIB


def test_the_70b_shape_is_meta_llama_3_70b() -> None:
    m = get_model("llama3-70b")
    shape = (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim)
    assert shape == (80, 8192, 64, 8, 128)
    assert (m.intermediate_size, m.vocab_size, m.default_tp) == (28672, 128256, 4)
    # Parameters a decode step reads: everything but the embedding table (~70.6B − 1.05B).
    assert m.decode_weight_params == pytest.approx(69.5e9, rel=0.005)
    assert get_model("llama3-8b").decode_weight_params == pytest.approx(7.50e9, rel=0.005)


def test_handoff_and_decode_step_by_hand() -> None:
    link = Transport("test", 1e9, 1e-3, "test link", line_rate_bytes_per_s=2e9)
    m = SecondTokenModel(get_model("llama3-8b"), get_gpu("h100"), link)
    assert m.handoff_s(1000) == pytest.approx(1e-3 + 1000 * 128 * KIB / 1e9)
    weights_s = 7.50e9 * 2 / (3.35e12 * DECODE_HBM_EFFICIENCY)
    kv_s = 1001 * 128 * KIB / (3.35e12 * DECODE_HBM_EFFICIENCY)
    assert m.decode_step_s(1001) == pytest.approx(PASS_OVERHEAD_S + weights_s + kv_s, rel=0.005)
    assert m.first_gap_s(1000) == pytest.approx(m.handoff_s(1000) + m.decode_step_s(1001))
    # Today's path also pays the file write: 1 / (1/1.5 + 1/0.8) GB/s in all.
    f = build_second_token("llama3-8b", "h100", "file+http")
    per_byte = 1 / 1.5e9 + 1 / 0.8e9
    assert f.handoff_s(4096) == pytest.approx(5e-3 + 4096 * 128 * KIB * per_byte)


def test_the_tp_gather_to_rank0_costs_the_other_ranks_share_over_nvlink() -> None:
    link = Transport("test", 1e9, 0.0, "test link")
    gathered = SecondTokenModel(get_model("llama3-70b"), get_gpu("h100"), link, tp=4)
    per_token = 320 * KIB
    gather = 3 / 4 * per_token / (450e9 * NVLINK_EFFICIENCY)
    assert gathered.handoff_per_token_s == pytest.approx(gather + per_token / 1e9)


SETUPS = [
    (name, model, tp, gathered)
    for model, tp, gathered in handoff_gap.SETUPS
    for name, t in TRANSPORTS.items()
    if gathered or t.per_rank
]


@pytest.mark.parametrize(("name", "model", "tp", "gathered"), SETUPS)
def test_the_gap_grows_with_the_prompt(name: str, model: str, tp: int, gathered: bool) -> None:
    m = build_second_token(model, "h100", name, tp=tp, gather_to_rank0=gathered)
    gaps = [m.first_gap_s(n) for n in LENGTHS]
    assert all(a < b for a, b in itertools.pairwise(gaps))
    assert all(m.handoff_s(n) < m.first_gap_s(n) for n in LENGTHS)


@pytest.mark.parametrize("tokens", LENGTHS)
def test_the_gap_shrinks_as_bandwidth_grows(tokens: int) -> None:
    base = get_transport("rdma-200g")
    model, gpu = get_model("llama3-70b"), get_gpu("h100")
    gaps = [
        SecondTokenModel(model, gpu, replace(base, bandwidth_bytes_per_s=bw)).first_gap_s(tokens)
        for bw in (1e9, 5e9, 20e9)
    ]
    assert gaps[0] > gaps[1] > gaps[2]
    # The named transports, slowest to fastest, at one prompt length.
    ordered = sorted(TRANSPORTS.values(), key=lambda t: t.bandwidth_bytes_per_s)
    named = [build_second_token("llama3-8b", "h100", t.name).first_gap_s(tokens) for t in ordered]
    assert all(a > b for a, b in itertools.pairwise(named))


@pytest.mark.parametrize("name", [t.name for t in TRANSPORTS.values() if t.per_rank])
def test_per_rank_tp_is_faster_than_gathering_to_rank0(name: str) -> None:
    gathered = build_second_token("llama3-70b", "h100", name, tp=4)
    per_rank = build_second_token("llama3-70b", "h100", name, tp=4, gather_to_rank0=False)
    for n in LENGTHS[1:]:
        assert per_rank.handoff_s(n) < gathered.handoff_s(n)
    if TRANSPORTS[name].link_per_gpu:  # four links at once: about four times the rate
        assert gathered.handoff_per_token_s > 3.5 * per_rank.handoff_per_token_s


def test_todays_file_path_has_no_per_rank_mode_and_names_are_checked() -> None:
    with pytest.raises(InvalidRequestError, match="sends from rank 0 only"):
        build_second_token("llama3-70b", "h100", "file+http", tp=4, gather_to_rank0=False)
    with pytest.raises(UnknownNameError, match="unknown transport 'carrier-pigeon'"):
        get_transport("carrier-pigeon")


def test_transport_figures_are_line_rate_bounded_and_cited() -> None:
    lines = {t.name: t.line_rate_bytes_per_s for t in TRANSPORTS.values()}
    assert lines == {"file+http": None, "tcp-25g": 3.125e9, "tcp-100g": 12.5e9,
                     "rdma-200g": 25e9, "rdma-400g": 50e9, "nvlink": 450e9}  # fmt: skip
    for t in TRANSPORTS.values():
        assert t.efficiency is None or 0 < t.efficiency < 1
        assert len(t.source) > 40
    assert get_transport("file+http").bandwidth_bytes_per_s == 0.8e9
    with pytest.raises(ValueError, match="above the line rate"):
        Transport("x", 2e9, 0.0, "x", line_rate_bytes_per_s=1e9)


def test_a_simulation_records_decode_start_and_first_gap_per_request() -> None:
    sched = Scheduler(
        predict_s=PREDICTOR.predict_s,
        policy=get_policy("s-edf"),
        batching=NoBatching(),
        token_budget=4096,
    )
    inst = Instance(sched, SimulatedPool(ToyCost(), INSTANT, None))
    # Toy cost: 1 ms per token, free instant preemption; every request finishes.
    requests = [req("a", 0.0, 100, 1.0, "text"), req("b", 0.05, 3000, 10.0, "search"),
                req("c", 0.1, 50, 1.0, "other"), req("d", 0.2, 800, 10.0, "text")]  # fmt: skip
    result = Simulation([inst]).run(requests)
    assert [r.request_id for r in result.requests] == ["a", "b", "c", "d"]
    assert result.first_gap_s == [] and result.decode_start_s == []
    link = Transport("test", 1e9, 1e-3, "test link")
    m = SecondTokenModel(get_model("llama3-8b"), get_gpu("h100"), link)
    counts = attach_second_token(result, m)
    for r, start, gap in zip(result.requests, result.decode_start_s, result.first_gap_s,
                             strict=True):  # fmt: skip
        assert r.finish_s is not None
        assert start == pytest.approx(r.finish_s + m.handoff_s(r.num_tokens))
        assert gap == pytest.approx(m.first_gap_s(r.num_tokens))
    # a: 100 tokens → 22 ms ≤ 0.1 s; d: 800 → 114 ms > 0.1 s; b: 3000 → 0.40 s > 0.2 s;
    # "other" has no TBT SLO.
    assert m.first_gap_s(800) == pytest.approx(0.114, abs=0.001)
    assert counts == {"search": (0, 1), "text": (1, 2)}


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return cli.run(parser.parse_args(argv))


def first_gap_cell(out: str) -> float:
    row = next(line for line in out.splitlines() if "│ flowprefill" in line)
    return float(row.strip("│ ").split("│")[-1])


def test_the_transport_option_changes_the_first_gap_attainment(
    capsys: pytest.CaptureFixture[str],
) -> None:
    base = ["--num-requests", "120", "--seeds", "0", "--rate", "2", "--systems", "flowprefill"]
    cells = {}
    for name in ("file+http", "nvlink"):
        assert run_cli([*base, "--transport", name]) == 0
        out = capsys.readouterr().out
        assert f"TBT 1st gap % ({name})" in out.replace("\n", "")
        cells[name] = first_gap_cell(out)
    # Llama-3-8B on A100: over file+http ~0.25 ms per prompt token, so only short text
    # prompts make 0.1 s; over NVLink every finished request's gap is ~12–20 ms.
    assert cells["file+http"] < 60.0
    assert cells["nvlink"] > 95.0
    assert run_cli([*base, "--model", "llama3-70b", "--tp", "4", "--kv-per-rank"]) == 2
    assert "sends from rank 0 only" in capsys.readouterr().out.replace("\n", "")
    with pytest.raises(SystemExit):
        run_cli([*base, "--transport", "carrier-pigeon"])


def test_the_report_shows_the_first_gap_attainment() -> None:
    summary = RunSummary(
        *(1.0, 1.0, 0.9, {"text": (9, 10)}, 1.0, 2.0, 0, 1.0, 1.0, 0, False),
        first_gap_per_class={"text": (3, 4)},
        first_gap_attainment=0.75,
    )
    outcome = SystemOutcome("flowprefill", "FlowPrefill", "paper", 1.0, None, 1.0, 1.0, summary)
    result = SweepResult({"transport": "rdma-400g", "kv_per_rank": True}, "toy", {}, 1.0, 1.0,
                         10, [outcome], 0.0)  # fmt: skip
    table = classes_table(result)
    assert "over rdma-400g, per rank" in str(table.title)
    headers = [c.header for c in table.columns]
    assert headers[-1] == "TBT 1st gap %"
    assert list(table.columns[-1].cells) == ["75.0"]


def test_the_gap_table_benchmark_writes_its_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "gap.json"
    assert handoff_gap.main(["--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "llama3-70b TP4 on h100" in out and "every rank sends its heads" in out
    data = json.loads(path.read_text())
    rows = data["rows"]
    # 8B: 6 transports × 5 lengths; 70B gathered: the same; 70B per-rank: no file+http.
    assert len(rows) == 30 + 30 + 25
    key = {(r["model"], r["mode"], r["tokens"], r["transport"]): r for r in rows}
    small = key[("llama3-8b", "gathered", 1024, "nvlink")]
    assert small["kv_bytes"] == 1024 * 128 * KIB
    assert small["meets_tbt"] == {"0.1": True, "0.2": True}
    todays = key[("llama3-8b", "gathered", 1024, "file+http")]
    assert todays["meets_tbt"] == {"0.1": False, "0.2": False}
    assert todays["first_gap_ms"] > 200
    big = key[("llama3-70b", "gathered", 32768, "rdma-400g")]
    assert big["kv_bytes"] == 10 * (1 << 30)
    per_rank = key[("llama3-70b", "per-rank", 32768, "rdma-400g")]
    assert per_rank["first_gap_ms"] < big["first_gap_ms"]
    assert ("llama3-70b", "per-rank", 1024, "file+http") not in key
    m = build_second_token("llama3-70b", "h100", "rdma-400g")
    assert big["first_gap_ms"] == pytest.approx(1e3 * m.first_gap_s(32768))
