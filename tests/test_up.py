"""`flowprefill up` as a user runs it: starts, answers, stops everything on Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from flowprefill.cli import main
from flowprefill.contracts import EngineConfig
from flowprefill.predictor.model import TTFTPredictor
from tests.helpers import free_port


@pytest.mark.parametrize(("prefill", "tp"), [(2, 1), (1, 2)], ids=["2x-tp1", "1x-tp2"])
def test_prefill_only_stack_serves_and_stops_cleanly(tmp_path: Path, prefill: int, tp: int) -> None:
    """``up`` with ``--tp 2`` too: the prefill instance then spawns its second rank."""
    port = free_port()
    profile = tmp_path / "p.json"
    TTFTPredictor.linear(2e-5).save(profile)
    env = {
        **os.environ,
        "FLOWPREFILL_MODEL_CACHE": str(tmp_path / "models"),
        "OMP_NUM_THREADS": "1",
    }
    log = tmp_path / "up.log"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flowprefill.cli",
            "up",
            "--model",
            "tiny-llama",
            "--decode",
            "0",
            "--prefill",
            str(prefill),
            "--tp",
            str(tp),
            "--port",
            str(port),
            "--profile",
            str(profile),
            "--run-dir",
            str(tmp_path / "run"),
            "--batching",
            "member-headroom",
            "--batch-token-budget",
            "2048",
        ],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        deadline = time.monotonic() + 180
        while "is up" not in log.read_text(errors="replace"):
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            timeout=60,
            json={"model": "tiny-llama", "prompt": "Hello", "max_tokens": 1},
        )
        assert r.status_code == 200, r.text
        assert r.headers["x-flowprefill-slo-class"] == "text"
        assert {p.name for p in (tmp_path / "run").iterdir()} >= {
            "engine-0.json",
            "gateway.json",
            "slo-table.json",
            "logs",
        }
        engine = EngineConfig.load(tmp_path / "run" / f"engine-{prefill - 1}.json")
        assert (engine.batching, engine.batch_token_budget) == ("member-headroom", 2048)
        assert engine.tp_size == tp
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    # Every child is gone with it: nothing answers on the gateway port any more.
    try:
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
        alive = True
    except httpx.HTTPError:
        alive = False
    assert not alive


def test_decode_with_an_unsupported_head_size_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    monkeypatch.setenv("FLOWPREFILL_MODEL_CACHE", str(tmp_path / "models"))
    code = main(["up", "--model", "tiny-llama", "--decode", "1", "--run-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2
    if importlib.util.find_spec("vllm") is None:
        assert "vLLM" in err and "--decode 0" in err
    else:
        assert "head_dim 16" in err


def test_unknown_engine_policy_names_are_refused_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for flag, value in (("--batching", "biggest-first"), ("--policy", "lifo")):
        with pytest.raises(SystemExit) as exc:
            main(["up", flag, value, "--run-dir", str(tmp_path)])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {flag}: unknown" in err and f"'{value}'; expected one of" in err
    assert not any(tmp_path.iterdir())


def _plan(tmp_path: Path, *flags: str) -> dict[str, EngineConfig]:
    import argparse

    from flowprefill.contracts import SLOTable
    from flowprefill.up import add_arguments, plan_stack

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--prefill", "2", *flags])
    plan = plan_stack(args, tmp_path / "m", tmp_path / "p.json", SLOTable.paper(), tmp_path)
    return {
        name: EngineConfig.model_validate_json(text)
        for name, text in plan.files.items()
        if name.startswith("engine-")
    }


def test_tp_runs_every_prefill_instance_with_n_ranks_sharing_the_cores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("flowprefill.up.machine_cores", lambda: 8)
    engines = _plan(tmp_path, "--tp", "2")
    assert [(e.tp_size, e.num_threads) for e in engines.values()] == [(2, 4), (2, 4)]
    assert {e.tp_size for e in _plan(tmp_path, "--tp", "8").values()} == {8}
    assert {e.num_threads for e in _plan(tmp_path, "--tp", "8").values()} == {1}
    # --threads wins; one rank keeps torch's default as before.
    assert {e.num_threads for e in _plan(tmp_path, "--tp", "2", "--threads", "3").values()} == {3}
    assert {(e.tp_size, e.num_threads) for e in _plan(tmp_path).values()} == {(1, None)}


@pytest.mark.parametrize("value", ["0", "9", "-1", "two"])
def test_tp_outside_what_the_engine_serves_is_refused_before_anything_starts(
    value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["up", "--tp", value, "--run-dir", str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --tp: '{value}' is not a tensor-parallel degree" in err
    assert "1 to 8 ranks per instance" in err
    assert not any(tmp_path.iterdir())
