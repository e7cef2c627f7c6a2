"""Simulating a GPU from measured operator times (``--calibration``,
flowprefill/lab/sim/vidur.py)."""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

import pytest

from flowprefill.errors import InvalidRequestError, UnknownNameError
from flowprefill.lab.sim import cli
from flowprefill.lab.sim.cost import CostModel, build_cost_model
from flowprefill.lab.sim.driver import Simulation
from flowprefill.lab.sim.systems import SYSTEMS, build_instance, fit_predictor
from flowprefill.lab.sim.vidur import (
    ATTENTION_OP,
    VIDUR_OPS,
    CalibrationRow,
    load_tables,
    read_tables,
    write_calibration,
)
from flowprefill.prefill.request import Request

A100 = build_cost_model("llama3-8b", "a100")


def scaled_rows(factor: float, *, attention: bool = True) -> list[CalibrationRow]:
    """The packaged A100 profile (TP 1) with every operator ``factor`` times slower, and —
    with ``attention`` — the A100 model's attention, also ``factor`` times slower."""
    table = load_tables()[1]
    rows = []
    for i, n in enumerate(int(x) for x in table.num_tokens):
        times = {op: [factor * float(table.times_ms[op][i])] for op in VIDUR_OPS}
        if attention:
            times[ATTENTION_OP] = [factor * 1e3 * A100.attention_s([(n, 0)])]
        rows.append(CalibrationRow(num_tokens=n, times_ms=times))
    return rows


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def cost_from_cli(argv: list[str]) -> CostModel:
    return cli.config_from_args(parse(argv)).cost.build()


def lone_ttft_s(argv: list[str], num_tokens: int) -> float:
    """TTFT of one request alone on the device the CLI arguments describe."""
    cfg = cli.config_from_args(parse(argv))
    cost = cfg.cost.build()
    predictor = fit_predictor(cost, max_blocking_s=cfg.max_blocking_s)
    inst = build_instance(
        SYSTEMS["flowprefill"], cost, predictor.predict_s, max_blocking_s=cfg.max_blocking_s
    )
    request = Request.create("r", arrival_s=0.0, ttft_slo_s=60.0, num_tokens=num_tokens)
    Simulation([inst]).run([request])
    assert request.ttft_s is not None
    return request.ttft_s


def test_written_rows_read_back_as_medians(tmp_path: Path) -> None:
    times = {op: [1.0, 3.0, 2.0] for op in VIDUR_OPS} | {ATTENTION_OP: [5.0, 7.0, 6.0]}
    rows = [
        CalibrationRow(num_tokens=n, times_ms=times, hidden_size=4096, num_heads=32)
        for n in (128, 256)
    ]
    path = write_calibration(tmp_path / "h100.csv", rows)
    header = path.read_text().splitlines()[0].split(",")
    for op in (*VIDUR_OPS, ATTENTION_OP):
        for stat in ("min", "max", "mean", "median", "std"):
            assert f"time_stats.{op}.{stat}" in header
    table = read_tables(path)[1]
    assert list(table.num_tokens) == [128, 256]
    assert table.time_ms("mlp_up_proj", 200) == pytest.approx(2.0)
    assert table.attention_time_ms(200) == pytest.approx(6.0)
    assert table.shape == {"hidden_size": 4096, "num_heads": 32}


def test_doubled_operator_times_double_a_lone_requests_ttft(tmp_path: Path) -> None:
    """Through the CLI's own path: every measured time ×2 → TTFT ×2 (the 2 ms per-pass
    overhead is not measured, so it stays: "roughly" with it, exactly without it)."""
    path = write_calibration(tmp_path / "slow.csv", scaled_rows(2.0))
    same = write_calibration(tmp_path / "same.csv", scaled_rows(1.0))
    for n in (512, 8192, 32768):
        base = lone_ttft_s(["--max-blocking-ms", "none", "--pass-overhead-ms", "0"], n)
        slow = ["--calibration", str(path), "--max-blocking-ms", "none"]
        assert lone_ttft_s([*slow, "--pass-overhead-ms", "0"], n) == pytest.approx(2 * base)
        # Defaults: the 2 ms pass overhead is not doubled, and with operators twice as
        # slow more of them pass the 4 ms split bound: more, smaller tiles, at the
        # profile's (worse) time per token for their size.
        ratio = lone_ttft_s(["--calibration", str(path)], n) / lone_ttft_s([], n)
        assert 1.85 < ratio < 2.2, (n, ratio)
        # The A100 profile as a calibration of the A100 changes nothing.
        assert lone_ttft_s(["--calibration", str(same)], n) == pytest.approx(
            lone_ttft_s([], n), rel=1e-9
        )


def test_a_calibrated_gpu_uses_its_measured_times_instead_of_peak_scaling(
    tmp_path: Path,
) -> None:
    path = write_calibration(tmp_path / "h100.csv", scaled_rows(0.5, attention=False))
    scaled = cost_from_cli(["--gpu", "h100"])
    measured = cost_from_cli(["--gpu", "h100", "--calibration", str(path)])
    a100 = A100.pass_cost([(4096, 0)]).op_s
    # GEMMs: half the A100's (as measured), not A100 ÷ 989/312 (peak scaling).
    assert measured.pass_cost([(4096, 0)]).op_s[3] == pytest.approx(0.5 * a100[3], rel=1e-9)
    assert scaled.pass_cost([(4096, 0)]).op_s[3] == pytest.approx(a100[3] * 312 / 989)
    # No attention column: attention stays FLOP-modelled at the H100's peak.
    assert measured.pass_cost([(4096, 0)]).op_s[1] == pytest.approx(
        scaled.pass_cost([(4096, 0)]).op_s[1]
    )
    assert "calibrated:h100.csv" in measured.name


def test_measured_attention_prices_a_chunk_by_its_causal_pairs(tmp_path: Path) -> None:
    """A chunk of c tokens after p cached costs the measured no-cache attention at
    sqrt(2cp + c²) tokens (as many query-key pairs) plus the KV re-read."""
    path = write_calibration(tmp_path / "c.csv", scaled_rows(1.0))
    cost = cost_from_cli(["--calibration", str(path)])
    table = read_tables(path)[1]
    c, p = 2048, 6144
    n_eq = math.sqrt(2 * c * p + c * c)
    reread = (
        A100.attention_s([(c, p)])
        - A100.attention_s([(c, 0)])
        - (4 * 32 * 128 * c * p / (312e12 * 0.6))
    )
    got = cost.pass_cost([(c, p)]).op_s[1]
    assert got == pytest.approx(1e-3 * table.attention_time_ms(n_eq) + reread, rel=1e-6)
    # Beyond the table, quadratic in the tokens.
    assert table.attention_time_ms(65536) == pytest.approx(4 * table.attention_time_ms(32768))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.replace("time_stats.mlp_act.median", "time_stats.mlp_act.p50"),
         "missing column(s) time_stats.mlp_act.median"),
        (lambda t: t.replace(",1\n", ",one\n", 1),
         "line 2: num_tensor_parallel_workers 'one' is not a number"),
        (lambda t: t.replace("num_tensor_parallel_workers", "tp"),
         "missing column(s) num_tensor_parallel_workers"),
    ],
)  # fmt: skip
def test_a_bad_calibration_is_refused_naming_file_and_column(
    tmp_path: Path, edit: object, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    good = write_calibration(tmp_path / "good.csv", scaled_rows(1.0)[:50])
    bad = tmp_path / "bad.csv"
    assert callable(edit)
    bad.write_text(edit(good.read_text()))
    with pytest.raises(InvalidRequestError, match=re.escape(message)) as err:
        read_tables(bad)
    assert "bad.csv" in str(err.value)
    argv = ["--calibration", str(bad), "--rate", "1", "--num-requests", "20", "--jobs", "1"]
    assert cli.run(parse(argv)) == 2
    assert "bad.csv" in capsys.readouterr().out


def test_calibrations_of_another_shape_or_tp_or_half_attention_are_refused(
    tmp_path: Path,
) -> None:
    times = {op: [1.0] for op in VIDUR_OPS}
    other = write_calibration(
        tmp_path / "small.csv", [CalibrationRow(num_tokens=64, times_ms=times, hidden_size=2048)]
    )
    with pytest.raises(InvalidRequestError, match="hidden_size = 2048"):
        cost_from_cli(["--calibration", str(other)])
    tp1 = write_calibration(tmp_path / "tp1.csv", [CalibrationRow(num_tokens=64, times_ms=times)])
    with pytest.raises(UnknownNameError, match="tensor-parallel degree '4'"):
        cost_from_cli(["--calibration", str(tp1), "--tp", "4"])
    with_attention = {**times, ATTENTION_OP: [1.0]}
    with pytest.raises(InvalidRequestError, match="every row or none"):
        write_calibration(
            tmp_path / "half.csv",
            [
                CalibrationRow(num_tokens=64, times_ms=times),
                CalibrationRow(num_tokens=128, times_ms=with_attention),
            ],
        )
    with pytest.raises(InvalidRequestError, match="no times for 'add'"):
        write_calibration(
            tmp_path / "x.csv",
            [CalibrationRow(num_tokens=64, times_ms={k: times[k] for k in VIDUR_OPS[:-1]})],
        )
    with pytest.raises(InvalidRequestError, match="--profile"):
        cli.config_from_args(parse(["--calibration", str(tp1), "--profile", "p.json"]))


def test_rows_already_in_the_files_format_are_written_as_given(tmp_path: Path) -> None:
    """benchmarks/gpu_validate.py builds vidur-format dict rows; they go through as is."""
    row = CalibrationRow(num_tokens=64, times_ms={op: [2.0] for op in VIDUR_OPS}).to_csv_row()
    row["n_head"] = 32
    path = write_calibration(tmp_path / "d.csv", [row, {**row, "num_tokens": 128}])
    assert read_tables(path)[1].time_ms("emb", 100) == pytest.approx(2.0)
