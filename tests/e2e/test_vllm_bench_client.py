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
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.stack.common import VLLM_CPU_CLI
from tests.e2e.bench_clients import Stack, demo_up

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
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with demo_up(tmp_path_factory.mktemp("vllm-bench"), MODEL) as running:
        yield running


def _gateway_log(stack: Stack) -> Path:
    return stack.run_dir / "logs" / "gateway.log"


def _tokenize_calls(gateway_log: Path) -> int:
    return gateway_log.read_text(errors="replace").count('"POST /tokenize HTTP/1.1" 200')


@pytest.mark.parametrize(
    ("backend", "endpoint"),
    [("openai", "/v1/completions"), ("openai-chat", "/v1/chat/completions")],
)
def test_vllm_bench_serve_runs_against_the_gateway(
    stack: Stack, backend: str, endpoint: str
) -> None:
    out = stack.tmp / backend
    tokenize_before = _tokenize_calls(_gateway_log(stack))
    # fmt: off
    argv = [
        *vllm_cli(), "bench", "serve",
        "--backend", backend, "--endpoint", endpoint,
        "--base-url", stack.url, "--model", MODEL,
        "--tokenizer", str(stack.model_dir),
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
    assert _tokenize_calls(_gateway_log(stack)) > tokenize_before

    result = json.loads((out / "result.json").read_text())
    assert (result["completed"], result["failed"]) == (NUM_PROMPTS, 0), result
    # ignore_eos (sent with random prompts) honoured: every answer has all its tokens.
    assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    # --goodput ttft:5000 was applied: the field is there, and loose on this model.
    assert result["request_goodput"] is not None
    assert 0 < result["request_goodput"] <= result["request_throughput"] + 1e-9
