"""The NIXL contract against the real thing: stock vLLM decode (``NixlConnector``,
``kv_consumer``) pulling KV from a FlowPrefill prefill server.

Decode runs with a poisoned ``flowprefill`` package first on its ``PYTHONPATH`` (importing
it raises), so every passing test also shows that no FlowPrefill code runs in the decode
process. Prefix caching is off in decode, so "vLLM alone" (the reference) never reuses
blocks a pull wrote. A second vLLM runs as a stock *producer*, so the vLLM-shaped P/D
request is compared with vLLM's own prefill + decode. Needs vLLM and nixl; skipped with
the reason where they are missing.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from flowprefill.contracts import NixlSettings
from flowprefill.contracts.names import DType, KVTransport
from flowprefill.contracts.nixl import RemotePrefill
from flowprefill.models import load_model
from flowprefill.prefill.engine import PrefillEngine
from flowprefill.prefill.executor.runner import PreemptibleExecutor
from flowprefill.prefill.predictor.model import TTFTPredictor
from flowprefill.prefill.server.kv_http import add_discard_route
from flowprefill.prefill.server.nixl_sink import NixlSink, nixl_sink
from flowprefill.prefill.server.pd_api import add_pd_route
from flowprefill.prefill.server.prefill import create_app
from flowprefill.stack.decode import decode_spec, shared_cores_env
from tests.helpers import free_port, serve_in_thread, wait_vllm

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None or importlib.util.find_spec("nixl") is None,
        reason="needs vLLM and nixl (pip install -e '.[up]')",
    ),
]

MAX_TOKENS = 8


def poisoned_path(root: Path) -> Path:
    """A directory whose ``flowprefill`` package refuses to import."""
    pkg = root / "poison" / "flowprefill"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "raise ImportError('the decode process must not import flowprefill')\n"
    )
    return pkg.parent


def start_vllm(
    model_dir: Path, tmp: Path, name: str, role: str, extra: list[str]
) -> tuple[subprocess.Popen[bytes], str, Path]:
    port, side = free_port(), free_port()
    spec = decode_spec(
        model_dir, port, tmp, max_model_len=2048, transport=KVTransport.NIXL,
        side_channel_port=side,
    )  # fmt: skip
    argv = [*spec.argv, "--no-enable-prefix-caching", *extra]
    if role == "kv_producer":
        i = argv.index("--kv-transfer-config")
        argv[i + 1] = argv[i + 1].replace("kv_consumer", "kv_producer")
    env = {
        **os.environ,
        **spec.env,
        **shared_cores_env(1),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CACHE_ROOT": str(tmp / f"vllm-cache-{name}"),
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(poisoned_path(tmp / name)),
    }
    log = tmp / f"{name}.log"
    proc = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)
    return proc, f"http://127.0.0.1:{port}", log


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from tests.kv.test_vllm_decode import _save_tiny

    tmp = tmp_path_factory.mktemp("nixl-e2e")
    model_dir = _save_tiny("llama", tmp)
    procs = []
    try:
        decode, decode_url, decode_log = start_vllm(model_dir, tmp, "decode", "kv_consumer", [])
        procs.append(decode)
        producer, producer_url, producer_log = start_vllm(
            model_dir, tmp, "producer", "kv_producer", []
        )
        procs.append(producer)
        with ExitStack() as es:
            model = load_model(model_dir)
            executor = es.enter_context(PreemptibleExecutor(model, granularity="operator"))
            engine = PrefillEngine(executor, TTFTPredictor.linear(1e-5))
            sink = nixl_sink(
                NixlSettings(side_channel_port=0, buffer_mb=4),
                model_path=str(model_dir),
                model_config=model.config,
                dtype=DType.FLOAT32,
                device="cpu",
                host="127.0.0.1",
            )
            es.callback(sink.close)
            app = create_app(engine, kv_sink=sink)
            add_discard_route(app, sink.discard)
            add_pd_route(
                app, engine, sink, tokenizer=lambda: None, model_name=str(model_dir),
                default_ttft_slo_s=60.0,
            )  # fmt: skip
            prefill_url = es.enter_context(serve_in_thread(app))
            wait_vllm(decode_url, decode, decode_log)
            wait_vllm(producer_url, producer, producer_log)
            yield {
                "decode": decode_url,
                "producer": producer_url,
                "prefill": prefill_url,
                "model": str(model_dir),
                "sink": sink,
                "decode_log": decode_log,
            }
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def prompt(n: int, k: int) -> list[int]:
    return [(k * i + 3) % 2000 + 1 for i in range(n)]


def complete(
    url: str, model: str, ids: list[int], max_tokens: int, params: dict[str, Any] | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if params is not None:
        body["kv_transfer_params"] = params
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json())


def tokens(answer: dict[str, Any]) -> list[int]:
    return list(answer["choices"][0]["token_ids"])


def prefill(stack: dict[str, Any], rid: str, ids: list[int]) -> tuple[int, dict[str, Any]]:
    r = httpx.post(
        f"{stack['prefill']}/v1/prefill",
        json={"request_id": rid, "prompt_token_ids": ids, "ttft_slo_s": 60.0},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return int(r.json()["first_token_id"]), r.json()["kv_transfer_params"]


def nixl_bytes(decode_url: str) -> float:
    text = httpx.get(f"{decode_url}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:nixl_bytes_transferred_sum")
    )


def wait_freed(sink: NixlSink, rid: str, timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while rid in sink.producer.leases and time.monotonic() < deadline:
        time.sleep(0.05)
    return rid not in sink.producer.leases


# Block boundaries (128 tokens): one short block, exactly one block (and decode's extra
# first token spills into a second), one plus one, several.
@pytest.mark.parametrize("n", [5, 127, 128, 300])
def test_decode_continues_from_our_first_token_with_pulled_kv(
    stack: dict[str, Any], n: int
) -> None:
    ids = prompt(n, 7 + n)
    rid = f"gw-{n}"
    before = nixl_bytes(stack["decode"])
    first, params = prefill(stack, rid, ids)
    remote = RemotePrefill.from_params(params)
    assert remote is not None and remote.request_id == rid
    layout = stack["sink"].producer.layout
    assert len(remote.block_ids) == layout.num_blocks(n + 1)
    disagg = complete(stack["decode"], stack["model"], [*ids, first], MAX_TOKENS - 1, params)
    alone = complete(stack["decode"], stack["model"], ids, MAX_TOKENS)
    assert [first, *tokens(disagg)] == tokens(alone)
    # Decode read our blocks and said so: the lease ended and the blocks are free again.
    assert wait_freed(stack["sink"], rid)
    moved = len(remote.block_ids) * layout.block_bytes * stack["sink"].producer.pool.num_layers
    deadline = time.monotonic() + 30  # vLLM publishes its counters every few seconds
    while nixl_bytes(stack["decode"]) - before < moved:
        assert time.monotonic() < deadline, "vLLM's nixl metrics show no bytes moved"
        time.sleep(0.5)
    assert nixl_bytes(stack["decode"]) - before == moved


@pytest.mark.parametrize("n", [60, 257])
def test_vllm_pd_request_gives_vllm_prefill_plus_decode_tokens(
    stack: dict[str, Any], n: int
) -> None:
    """The same P/D request against a stock vLLM producer and against us, each answer's
    kv_transfer_params handed to stock decode with the same prompt: same tokens."""
    ids = prompt(n, 3 + n)
    request = {
        "model": stack["model"],
        "prompt": ids,
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    ours = httpx.post(f"{stack['prefill']}/v1/completions", json=request, timeout=60)
    theirs = httpx.post(f"{stack['producer']}/v1/completions", json=request, timeout=60)
    assert ours.status_code == 200 and theirs.status_code == 200, (ours.text, theirs.text)
    our_params, their_params = (
        ours.json()["kv_transfer_params"],
        theirs.json()["kv_transfer_params"],
    )
    # The shape a router reads: every key vLLM's producer answers with.
    assert set(their_params) - {"remote_prefill_cached_tokens"} <= set(our_params)
    assert len(our_params["remote_block_ids"][0]) == len(their_params["remote_block_ids"][0])
    via_ours = complete(stack["decode"], stack["model"], ids, MAX_TOKENS, our_params)
    via_vllm = complete(stack["decode"], stack["model"], ids, MAX_TOKENS, their_params)
    assert tokens(via_ours) == tokens(via_vllm)
    assert ours.json()["choices"][0]["token_ids"] == [tokens(via_ours)[0]]


def test_zeroed_pages_change_the_output(stack: dict[str, Any]) -> None:
    """The bytes are used: the same request over zero-filled pages decodes differently."""
    ids = prompt(200, 17)
    first, _ = prefill(stack, "real", ids)
    heads, dim = stack["sink"].producer.layout.num_kv_heads, stack["sink"].producer.layout.head_dim
    zeros = [
        (torch.zeros(heads, len(ids), dim), torch.zeros(heads, len(ids), dim))
        for _ in range(stack["sink"].producer.pool.num_layers)
    ]
    params = stack["sink"].publish("zeros", zeros, ids, len(ids) + 1)
    zeroed = complete(stack["decode"], stack["model"], [*ids, first], MAX_TOKENS - 1, params)
    alone = complete(stack["decode"], stack["model"], ids, MAX_TOKENS)
    assert [first, *tokens(zeroed)] != tokens(alone)


def test_blocks_beyond_the_buffer_are_recomputed_and_decode_lives(stack: dict[str, Any]) -> None:
    ids = prompt(100, 19)
    first, params = prefill(stack, "forged", ids)
    forged = {**params, "remote_block_ids": [[stack["sink"].producer.pool.num_blocks + 5]]}
    answer = complete(stack["decode"], stack["model"], [*ids, first], MAX_TOKENS - 1, forged)
    alone = complete(stack["decode"], stack["model"], ids, MAX_TOKENS)
    assert [first, *tokens(answer)] == tokens(alone)
    test_decode_continues_from_our_first_token_with_pulled_kv(stack, 40)  # still serving


def test_a_producer_gone_before_the_pull_means_recompute(stack: dict[str, Any]) -> None:
    """Prefill restarted between its answer and decode's pull: decode's handshake fails,
    vLLM recomputes (kv_load_failure_policy recompute), and a producer started again (a
    fresh engine id) is pulled from as before."""
    ids = prompt(150, 23)
    first, _ = prefill(stack, "before-restart", ids)
    model = load_model(Path(stack["model"]))
    gone = nixl_sink(
        NixlSettings(side_channel_port=0, buffer_mb=1),
        model_path=stack["model"], model_config=model.config, dtype=DType.FLOAT32,
        device="cpu", host="127.0.0.1",
    )  # fmt: skip
    kv = [(torch.randn(2, len(ids), 32), torch.randn(2, len(ids), 32)) for _ in range(2)]
    params = gone.publish("restart", kv, ids, len(ids) + 1)
    gone.close()
    answer = complete(stack["decode"], stack["model"], [*ids, first], MAX_TOKENS - 1, params)
    alone = complete(stack["decode"], stack["model"], ids, MAX_TOKENS)
    assert [first, *tokens(answer)] == tokens(alone)
    again = nixl_sink(
        NixlSettings(side_channel_port=0, buffer_mb=1),
        model_path=stack["model"], model_config=model.config, dtype=DType.FLOAT32,
        device="cpu", host="127.0.0.1",
    )  # fmt: skip
    try:
        assert again.producer.engine_id != gone.producer.engine_id
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([ids]), use_cache=True)
        from flowprefill.kv.capture import layers_from_cache

        params = again.publish(
            "after-restart", layers_from_cache(out.past_key_values), ids, len(ids) + 1
        )
        answer = complete(stack["decode"], stack["model"], [*ids, first], MAX_TOKENS - 1, params)
        assert [first, *tokens(answer)] == tokens(alone)
        assert wait_freed(again, "after-restart")
    finally:
        again.close()


def test_an_expired_lease_frees_the_blocks_and_decode_still_answers(
    stack: dict[str, Any],
) -> None:
    """Decode came after the lease ended: the blocks were already freed (and logged as
    read after expiry when it does read them); decode answers and keeps serving."""
    ids = prompt(90, 29)
    first, _ = prefill(stack, "before-expiry", ids)
    model = load_model(Path(stack["model"]))
    short = nixl_sink(
        NixlSettings(side_channel_port=0, buffer_mb=1, lease_s=0.2),
        model_path=stack["model"], model_config=model.config, dtype=DType.FLOAT32,
        device="cpu", host="127.0.0.1",
    )  # fmt: skip
    try:
        kv = [(torch.randn(2, len(ids), 32), torch.randn(2, len(ids), 32)) for _ in range(2)]
        free = short.producer.pool.free_blocks
        params = short.publish("expiring", kv, ids, len(ids) + 1)
        assert short.producer.pool.free_blocks < free
        deadline = time.monotonic() + 5
        while "expiring" in short.producer.leases:  # the producer's own thread expires it
            assert time.monotonic() < deadline, "the lease never expired"
            time.sleep(0.05)
        assert short.producer.pool.free_blocks == free
        assert short.producer.leases.expired_total == 1
        answer = complete(stack["decode"], stack["model"], [*ids, first], MAX_TOKENS - 1, params)
        assert len(tokens(answer)) == MAX_TOKENS - 1
    finally:
        short.close()
    test_decode_continues_from_our_first_token_with_pulled_kv(stack, 33)


def test_released_kv_is_gone(stack: dict[str, Any]) -> None:
    _, params = prefill(stack, "released", prompt(30, 31))
    assert "released" in stack["sink"].producer.leases
    r = httpx.delete(f"{stack['prefill']}/v1/kv/released", timeout=10)
    assert r.status_code == 200 and "released" not in stack["sink"].producer.leases
    assert httpx.delete(f"{stack['prefill']}/v1/kv/released", timeout=10).status_code == 404
    assert params["remote_request_id"] == "released"


def test_decode_never_imported_flowprefill(stack: dict[str, Any]) -> None:
    log = stack["decode_log"].read_text()
    assert "must not import flowprefill" not in log
    assert "NIXL compatibility check passed" in log
