"""The benchmarks that start vLLM (``flowprefill up`` with decode, or vLLM alone) at their
smallest sizes: one stack or server each, demo-llama (vLLM's CPU attention does not take
tiny-llama's head size), a request or two. Each runs to the end and prints its table; the
figures are not judged. Slow (a vLLM start is about a minute on two cores): one at a time.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.stack.common import Server, up_server, wait_all
from tests.benchmarks.smoke import run_script

pytestmark = pytest.mark.slow


def linear_profile(path: Path, s_per_token: float = 1e-3) -> Path:
    """A TTFT profile without a profiling run (about demo-llama's speed on this CPU)."""
    from flowprefill.prefill.predictor.model import TTFTPredictor

    TTFTPredictor.linear(s_per_token).save(path)
    return path


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, demo_models: Path) -> Iterator[Server]:
    """One ``flowprefill up`` (file hand-off) for the two scripts that measure a running
    stack rather than start their own."""
    from flowprefill.models import named_model_dir

    out = tmp_path_factory.mktemp("stack")
    model = named_model_dir("demo-llama", cache_dir=demo_models)
    server = up_server("up", model, linear_profile(out / "p.json"), out, ["OMP_NUM_THREADS=1"])
    server.start()
    try:
        wait_all([server], timeout_s=240)
        yield server
    finally:
        server.stop()


def test_ttft(stack: Server, tmp_path: Path) -> None:
    argv = ["--url", stack.base_url, "--lengths", "16,64", "--repeats", "1", "--max-tokens", "2"]
    printed = run_script("stack/ttft.py", *argv, tmp_path=tmp_path, timeout_s=120)
    assert f"TTFT at {stack.base_url}, max_tokens 2" in printed
    assert "│            16 │" in printed and "│            64 │" in printed


def test_prefill_beside_decode(stack: Server, tmp_path: Path) -> None:
    # Not --stop-worker: it pauses every vLLM worker on the machine, not only this stack's.
    prefill = stack.metrics_urls["prefill"]
    decode = f"http://127.0.0.1:{int(stack.base_url.rsplit(':', 1)[1]) + 200}"
    argv = ["--prefill-url", prefill, "--decode-url", decode, "--tokens", "32", "--repeats", "1"]
    printed = run_script("stack/prefill_beside_decode.py", *argv, tmp_path=tmp_path)
    assert "KV hand-off write (wall ms, median)" in printed
    assert "0.3 s after a vLLM request" in printed
    assert "vLLM decode, 32-token completions:" in printed


def test_idle_cpu(tmp_path: Path, demo_models: Path) -> None:
    argv = ["--variants", "nixl", "--requests", "1", "--idle-s", "0.5", "--out", str(tmp_path)]
    printed = run_script("stack/idle_cpu.py", *argv, tmp_path=tmp_path, models=demo_models)
    assert "idle stack: % of one core over 0.5 s without traffic" in printed
    assert "nixl (CPU default)" in printed and "shared_dir" not in printed


def test_uniform(tmp_path: Path, demo_models: Path) -> None:
    out = tmp_path / "out"
    argv = [
        "--systems", "flowprefill", "--rounds", "1", "--warmup", "0", "--num-prompts", "2",
        "--input-len", "16", "--output-len", "2", "--rate", "10",
        "--profile", str(linear_profile(tmp_path / "p.json")), "--out", str(out),
    ]  # fmt: skip
    printed = run_script("stack/uniform.py", *argv, tmp_path=tmp_path, models=demo_models)
    runs = json.loads((out / "summary.json").read_text())["runs"]
    assert list(runs) == ["flowprefill"] and runs["flowprefill"][0]["failed"] == 0
    assert "vllm bench serve: random 16-token prompts" in printed


def test_vs_vllm(tmp_path: Path, demo_models: Path) -> None:
    out = tmp_path / "out"
    argv = [
        "--systems", "flowprefill", "--seeds", "0", "--duration", "2", "--min-requests", "2",
        "--start-rate", "1", "--min-rate", "1", "--max-rate", "1", "--length-scale", "0.02",
        "--warmup-lengths", "64", "--profile", str(linear_profile(tmp_path / "p.json")),
        "--out", str(out),
    ]  # fmt: skip
    printed = run_script("stack/vs_vllm.py", *argv, tmp_path=tmp_path, models=demo_models)
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["systems"]) == ["flowprefill"]
    assert (out / "attainment.png").stat().st_size > 0
    assert "goodput (req/s at ≥ 90 % TTFT attainment" in printed


def test_second_token_gap(tmp_path: Path, demo_models: Path) -> None:
    out = tmp_path / "gap.json"
    argv = ["--transports", "http", "--tokens", "64", "--repeats", "1", "--pause", "0"]
    printed = run_script(
        "kv/second_token_gap.py", *argv, "--out", str(tmp_path / "run"), "--json", str(out),
        tmp_path=tmp_path, models=demo_models,
    )  # fmt: skip
    samples = json.loads(out.read_text())["samples_s"]
    assert len(samples["http"]["64"]) == 1 and samples["http"]["64"][0] > 0
    assert "Gap between the first and second token" in printed


def test_vllm_idle_spin(tmp_path: Path, demo_models: Path) -> None:
    argv = ["--caps", "0.005", "--tokens", "4", "--repeats", "1"]
    printed = run_script("decode/vllm_idle_spin.py", *argv, tmp_path=tmp_path, models=demo_models)
    assert "vLLM decode, 4-token completions, one at a time" in printed
    assert "0.005" in printed
