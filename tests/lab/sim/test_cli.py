from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from flowprefill.lab.sim import cli


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return cli.run(parser.parse_args(argv))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "gpt2"], "unknown model 'gpt2'"),
        (["--gpu", "v100"], "unknown GPU 'v100'"),
        (["--rate", "-3"], "--rate"),
        (["--num-requests", "0"], "--num-requests"),
        (["--slo-rate", "-1"], "--slo-rate"),
        (["--systems", "flowprefill,magic"], "unknown system 'magic'"),
        (["--router", "random"], "unknown routing policy"),
        (["--trace", "/nonexistent.jsonl", "--rate", "1"], "no such file"),
        (["--tp", "4", "--tp-check-us", "-1", "--rate", "1"], "--tp-check-us must be ≥ 0"),
        (["--tp", "3", "--rate", "1"], "unknown tensor-parallel degree '3'"),
    ],
)
def test_bad_input_is_rejected_with_a_message_naming_it(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(argv) == 2
    assert message in capsys.readouterr().out.replace("\n", "")


def test_single_run_mode_prints_a_row_per_system(capsys: pytest.CaptureFixture[str]) -> None:
    code = run(["--num-requests", "80", "--rate", "3", "--systems", "paper", "--jobs", "1"])
    assert code == 0
    out = capsys.readouterr().out
    for name in ("distserve-fcfs", "distserve-cp2k", "distserve-cp8k", "sedf-layer", "flowprefill"):
        assert name in out


def test_sweep_writes_json_and_figures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--num-requests", "120", "--systems", "distserve-fcfs,flowprefill,sedf-layer"]
    argv += ["--rates", "2,8", "--slo-scales", "0.5,1,2", "--tolerance", "0.2", "--jobs", "1"]
    argv += ["--no-oracles", "--no-progress", "--out", str(tmp_path)]
    assert run(argv) == 0
    data = json.loads((tmp_path / "result.json").read_text())
    assert [s["name"] for s in data["systems"]] == ["distserve-fcfs", "flowprefill", "sedf-layer"]
    assert (tmp_path / "fig9_end_to_end.png").stat().st_size > 1000
    assert "Against the paper" in capsys.readouterr().out


def test_trace_replay_through_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.csv"
    rows = [f"{i * 0.5},{300 + 97 * i % 4000},10" for i in range(60)]
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    assert run(["--trace", str(trace), "--rate", "4", "--systems", "flowprefill"]) == 0
    assert "flowprefill" in capsys.readouterr().out


def test_other_models_and_gpus_run(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "llama3-70b", "--gpu", "h100", "--num-requests", "60", "--rate", "1"]
    assert run([*argv, "--systems", "flowprefill"]) == 0
    assert "llama3-70b/h100/tp4" in capsys.readouterr().out


def test_70b_tp4_uses_table_2s_70b_slos_and_the_tp_cost_model() -> None:
    """`flowprefill simulate --model llama3-70b --tp 4`: Table 2's 70B row for every class
    (from the contracts' SLO table, not the 8B default), on four ranks' cost model."""
    from flowprefill.contracts.slo import SLOTable
    from flowprefill.lab.sim.sweep import Evaluator

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    argv = ["--model", "llama3-70b", "--tp", "4", "--num-requests", "200"]
    args = parser.parse_args([*argv, "--tp-check-us", "25"])
    ev = Evaluator(cli.config_from_args(args))
    table = {c.name: c.ttft_slo_s for c in SLOTable.paper(model="llama3-70b").classes}
    assert table != {c.name: c.ttft_slo_s for c in SLOTable.paper().classes}
    assert ev.workloads[0].slo_table == table
    requests = ev.workloads[0].requests(rate=1.0, slo_scale=0.5)
    assert {r.slo_class for r in requests} == set(table)
    for r in requests:
        assert r.deadline_s - r.arrival_s == pytest.approx(0.5 * table[r.slo_class])
    assert ev.cost.name == "llama3-70b/a100/tp4"
    assert ev.cost.checkpoint_s == pytest.approx(25e-6)
