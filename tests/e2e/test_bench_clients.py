"""Third-party benchmark clients against ``flowprefill up``, run as their docs show.

One ``flowprefill up`` (gateway + one prefill instance + one vLLM decode, demo-size Llama)
for the module; then each of guidellm, aiperf and inference-perf, installed at a pinned
version in its own venv (tests/e2e/bench_clients.py: built under ``.cache/`` the first
time, a failed install fails the test), runs a short synthetic benchmark against the
gateway: 10 streamed ``/v1/completions`` requests of 64 prompt tokens and 8 output
tokens, the tool's own synthetic/random data, the served model directory as its
tokenizer. docs/bench.md shows the same commands.

Checked from each tool's own result files: every request succeeded (none failed or left
incomplete), and the token counts the tool reports equal what the server counted, per
request where the tool saved both its own count and the server's ``usage`` (aiperf,
inference-perf), and in total against decode's own vLLM counters (all three): decode
counts each prompt plus its first token (prefill made it) and generates the rest
(:class:`tests.e2e.bench_clients.ServerCounts`). The gateway's error counter must not
move. inference-perf needs Python >= 3.12: without a CPython 3.12 its test skips, saying so.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.bench_clients import (
    InstallError,
    NoPythonError,
    ServerCounts,
    Stack,
    client_venv,
    demo_up,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed (pip install -e '.[decode]'; see README)",
    ),
]

MODEL = "demo-llama"  # vLLM's CPU attention needs head_dim 64 (tiny-* has 16)
REQUESTS = 10
PROMPT_TOKENS = 64
OUTPUT_TOKENS = 8
RUN_TIMEOUT_S = 300
# An install from scratch (CI's fresh clone) takes minutes on a loaded 2-core machine.
TEST_TIMEOUT_S = 1800


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with demo_up(tmp_path_factory.mktemp("bench-clients"), MODEL) as running:
        yield running


def venv_of(name: str) -> Path:
    """The tool's venv; skips only when its Python is missing, fails with pip's output
    when the install fails."""
    try:
        return client_venv(name)
    except NoPythonError as e:
        pytest.skip(str(e))
    except InstallError as e:
        pytest.fail(f"installing {name} failed:\n{e}", pytrace=False)


def template_overhead(stack: Stack) -> int:
    """Tokens the served chat template adds around one user message (with the assistant
    turn opened), counted with the served tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(stack.model_dir)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": ""}], add_generation_prompt=True, tokenize=False
    )
    assert isinstance(text, str)
    return len(tokenizer.encode(text, add_special_tokens=False))


def run_tool(argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    """Run a client to completion; its output, or a failure showing the end of it."""
    done = subprocess.run(
        argv,
        cwd=cwd,
        env=env if env is not None else dict(os.environ),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{argv}\nexited {done.returncode}:\n{output[-6000:]}"
    return output


def assert_server_counted(
    stack: Stack, before: ServerCounts, prompt_tokens: list[int], output_tokens: list[int]
) -> None:
    """The tool's per-request token counts, totalled, equal what the servers counted."""
    served = ServerCounts.since(stack, before, requests=len(prompt_tokens))
    assert served == (len(prompt_tokens), sum(prompt_tokens), sum(output_tokens)), (
        "(requests, prompt tokens, output tokens): the server's, then the tool's",
        served,
        (len(prompt_tokens), sum(prompt_tokens), sum(output_tokens)),
    )


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_guidellm_runs_against_the_gateway(stack: Stack, endpoint: str) -> None:
    """``chat`` is guidellm's default request format (nothing passed for it)."""
    venv = venv_of("guidellm")
    out = stack.tmp / f"guidellm-{endpoint}"
    out.mkdir()
    before = ServerCounts.read(stack)
    backend = f"kind=openai_http,target={stack.url},model={MODEL}"
    if endpoint == "completions":
        backend += ",request_format=/v1/completions"
    # fmt: off
    argv = [
        str(venv / "bin" / "guidellm"), "run",
        "--backend", backend,
        "--tokenizer", f"kind=huggingface_auto,model={stack.model_dir}",
        "--profile", "kind=constant,rate=4",
        "--constraint", f"kind=max_requests,count={REQUESTS}",
        "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},"
                  f"output_tokens={OUTPUT_TOKENS}",
        "--output", f"kind=json,path={out / 'benchmarks.json'}",
        "--disable-console-interactive",
    ]
    # fmt: on
    output = run_tool(argv, cwd=out)

    (benchmark,) = json.loads((out / "benchmarks.json").read_text())["benchmarks"]
    requests: dict[str, Any] = benchmark["requests"]
    errors = [r["info"].get("error") for r in requests.get("errored") or []]
    assert not errors, (errors[:3], output[-4000:])
    assert not requests.get("incomplete"), requests.get("incomplete")
    successful: list[dict[str, Any]] = requests["successful"]
    assert len(successful) == REQUESTS, output[-4000:]
    # guidellm reports the server's usage as its counts: each prompt it built to 64
    # tokens with the served tokenizer is 64 tokens to the server (plus the chat
    # template's tokens over chat), and each answer has the 8 tokens asked for (guidellm
    # sends ignore_eos), streamed: a chunk per token, or fewer where vLLM merged the deltas
    # of steps its API server had not sent yet (a loaded host), never one blob.
    prompts = [r["prompt_tokens"] for r in successful]
    outputs = [r["output_tokens"] for r in successful]
    overhead = template_overhead(stack) if endpoint == "chat" else 0
    assert prompts == [PROMPT_TOKENS + overhead] * REQUESTS
    assert outputs == [OUTPUT_TOKENS] * REQUESTS
    iterations = [r["info"]["timings"]["token_iterations"] for r in successful]
    assert all(2 <= it <= out for it, out in zip(iterations, outputs, strict=True)), iterations
    assert_server_counted(stack, before, prompts, outputs)


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_aiperf_runs_against_the_gateway(stack: Stack, endpoint: str) -> None:
    """``chat`` is aiperf's default endpoint type (nothing passed for it)."""
    venv = venv_of("aiperf")
    out = stack.tmp / f"aiperf-{endpoint}"
    before = ServerCounts.read(stack)
    endpoint_args = ["--endpoint-type", "completions"] if endpoint == "completions" else []
    # fmt: off
    argv = [
        str(venv / "bin" / "aiperf"), "profile",
        "--model", MODEL, "--url", stack.url,
        *endpoint_args, "--streaming",
        "--tokenizer", str(stack.model_dir),
        "--isl", str(PROMPT_TOKENS), "--osl", str(OUTPUT_TOKENS),
        "--request-count", str(REQUESTS), "--request-rate", "4",
        "--artifact-dir", str(out), "--ui", "none",
    ]
    # fmt: on
    # aiperf 0.13.0 with HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE set looks a local
    # tokenizer directory up as a cached hub snapshot, and fails; the directory is local,
    # so nothing is downloaded without them either.
    env = {
        k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    }
    output = run_tool(argv, cwd=stack.tmp, env=env)

    summary = json.loads((out / "profile_export_aiperf.json").read_text())
    assert summary["error_summary"] == [], summary["error_summary"]
    assert summary["request_count"]["avg"] == REQUESTS, output[-4000:]
    records = [
        json.loads(line)
        for line in (out / "profile_export.jsonl").read_text().splitlines()
        if line.strip()
    ]
    assert len(records) == REQUESTS
    assert [r for r in records if r.get("error")] == []
    metrics = [{k: v["value"] for k, v in r["metrics"].items()} for r in records]
    # Per request: aiperf's own counts (its tokenizer on the prompt it built, and on the
    # streamed text joined) equal the usage the server returned. Over chat aiperf counts
    # the message's content; the server also counts the chat template around it.
    overhead = template_overhead(stack) if endpoint == "chat" else 0
    prompts = [m["input_sequence_length"] for m in metrics]
    outputs = [m["output_sequence_length"] for m in metrics]
    assert [p + overhead for p in prompts] == [m["usage_prompt_tokens"] for m in metrics]
    assert outputs == [m["usage_completion_tokens"] for m in metrics]
    assert prompts == [PROMPT_TOKENS] * REQUESTS
    assert_server_counted(stack, before, [p + overhead for p in prompts], outputs)


INFERENCE_PERF_CONFIG = """\
api:
  type: completion
  streaming: true
server:
  type: vllm
  model_name: {model}
  base_url: {url}
tokenizer:
  pretrained_model_name_or_path: {tokenizer}
data:
  type: random
  input_distribution: {{min: {prompt}, max: {prompt}, mean: {prompt}, std_dev: 0}}
  output_distribution: {{min: {output}, max: {output}, mean: {output}, std_dev: 0}}
load:
  type: constant
  stages: [{{rate: 5, duration: {duration}}}]
report:
  request_lifecycle:
    per_request: true
storage:
  local_storage:
    path: {reports}
"""


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_inference_perf_runs_against_the_gateway(stack: Stack) -> None:
    venv = venv_of("inference-perf")
    out = stack.tmp / "inference-perf"
    out.mkdir()
    config = out / "config.yml"
    config.write_text(
        INFERENCE_PERF_CONFIG.format(
            model=MODEL,
            url=stack.url,
            tokenizer=stack.model_dir,
            prompt=PROMPT_TOKENS,
            output=OUTPUT_TOKENS,
            duration=REQUESTS // 5,
            reports=out / "reports",
        )
    )
    before = ServerCounts.read(stack)
    output = run_tool([str(venv / "bin" / "inference-perf"), "--config_file", str(config)], out)

    reports = out / "reports"
    summary = json.loads((reports / "summary_lifecycle_metrics.json").read_text())
    assert summary["failures"]["count"] == 0, (summary["failures"], output[-4000:])
    assert summary["successes"]["count"] == REQUESTS, output[-4000:]
    per_request = json.loads((reports / "per_request_lifecycle_metrics.json").read_text())
    assert len(per_request) == REQUESTS
    assert [r["error"] for r in per_request] == [None] * REQUESTS
    # Per request: inference-perf's own counts (its tokenizer on the prompt it built, and
    # on the streamed text) equal the usage the server returned.
    prompts = [r["info"]["request_metrics"]["text"]["input_tokens"] for r in per_request]
    outputs = [r["info"]["response_metrics"]["output_tokens"] for r in per_request]
    usage = [r["info"]["response_metrics"]["server_usage"] for r in per_request]
    assert prompts == [u["prompt_tokens"] for u in usage]
    assert outputs == [u["completion_tokens"] for u in usage]
    # inference-perf sends ignore_eos: every answer has the tokens asked for.
    assert prompts == [PROMPT_TOKENS] * REQUESTS
    assert outputs == [OUTPUT_TOKENS] * REQUESTS
    assert_server_counted(stack, before, prompts, outputs)
