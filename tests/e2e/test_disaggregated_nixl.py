"""End to end over NIXL: openai client → gateway → FlowPrefill prefill (TP=1 and TP=2) →
stock vLLM decode (``NixlConnector``) pulling the prompt's KV from prefill's memory; with
TP=2 each prefill rank serves its own heads and decode (TP=1) reads from both.

Decode runs with a poisoned ``flowprefill`` first on its path (importing it raises), and
without prefix caching, so the reference "vLLM alone" never reuses pulled blocks. Needs
vLLM and nixl; skipped with the reason where they are missing.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import openai
import pytest

from flowprefill.contracts import (
    Endpoint,
    EngineConfig,
    GatewayConfig,
    KVHandoffSettings,
    NixlSettings,
)
from flowprefill.contracts.names import DType
from flowprefill.gateway.app import create_gateway_app
from flowprefill.gateway.cli import build_state
from flowprefill.models import load_model, named_model_dir
from flowprefill.prefill.engine import PrefillEngine
from flowprefill.prefill.executor.runner import PreemptibleExecutor
from flowprefill.prefill.factory import model_config_of
from flowprefill.prefill.predictor.model import TTFTPredictor
from flowprefill.prefill.server.kv_http import add_discard_route
from flowprefill.prefill.server.nixl_sink import NixlSink, nixl_sink
from flowprefill.prefill.server.prefill import create_app
from flowprefill.prefill.tp.prefill_backend import TPPrefillBackend
from tests.helpers import serve_in_thread, wait_vllm
from tests.kv.nixl.test_vllm_consumer import nixl_bytes, start_vllm

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None or importlib.util.find_spec("nixl") is None,
        reason="needs vLLM and nixl (pip install -e '.[up]')",
    ),
]

TABLE = {
    "version": 1,
    "default_class": "chat",
    "classes": [
        {"name": "chat", "task_type": "text", "ttft_slo_ms": 5000, "priority": 10,
         "attainment_target": 0.9},
    ],
}  # fmt: skip


SETTINGS = NixlSettings(side_channel_port=0, buffer_mb=16)


def sink_for(model_dir: str, config: Any, group: Any = None) -> NixlSink:
    """Rank 0's producer; with a TP ``group`` the other ranks serve their own heads."""
    return nixl_sink(
        SETTINGS,
        model_path=model_dir, model_config=config, dtype=DType.FLOAT32, device="cpu",
        host="127.0.0.1",
        peers=group.kv_peers if group is not None else None,
        publish_peers=group.publish_kv if group is not None else None,
        peer_notifications=group.drain_kv_notifications if group is not None else None,
    )  # fmt: skip


def gateway(es: ExitStack, tmp: Any, model_dir: str, prefill_url: str, decode_url: str) -> str:
    (tmp / "slo.json").write_text(json.dumps(TABLE))
    config = GatewayConfig(
        service="nixl-e2e",
        model_name="demo",
        tokenizer_path=model_dir,
        prefill=[Endpoint(pool="p", host="h", port=1, url=prefill_url)],
        decode=[Endpoint(pool="d", host="h", port=1, url=decode_url)],
    )
    return es.enter_context(
        serve_in_thread(create_gateway_app(build_state(config, tmp / "slo.json")))
    )


@pytest.fixture(scope="module")
def decode(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("nixl-gw")
    model_dir = named_model_dir("demo-llama", cache_dir=tmp / "models")
    proc, url, log = start_vllm(model_dir, tmp, "decode", "kv_consumer", [])
    try:
        wait_vllm(url, proc, log)
        yield {"url": url, "model_dir": str(model_dir), "tmp": tmp, "log": log}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def gw(request: pytest.FixtureRequest, decode: dict[str, Any]) -> Iterator[dict[str, Any]]:
    tp = int(request.param)
    with ExitStack() as es:
        if tp == 1:
            model = load_model(decode["model_dir"])
            backend: Any = es.enter_context(PreemptibleExecutor(model, granularity="operator"))
        else:
            config = EngineConfig(
                model_path=decode["model_dir"], tp_size=2, num_threads=1,
                kv=KVHandoffSettings(transport="nixl", nixl=SETTINGS),
            )  # fmt: skip
            backend = es.enter_context(TPPrefillBackend(config))
        engine = PrefillEngine(backend, TTFTPredictor.linear(1e-4), batching="none")
        group = backend.group if tp == 2 else None
        sink = sink_for(decode["model_dir"], model_config_of(backend), group)
        if tp == 2:  # every rank serves its own heads: rank 1's agent is in the handshake
            assert sink.producer.tp_size == 2 and sink.producer.layout.num_kv_heads == 1
        es.callback(sink.close)
        app = create_app(engine, kv_sink=sink)
        add_discard_route(app, sink.discard)
        prefill_url = es.enter_context(serve_in_thread(app))
        tmp = decode["tmp"] / f"gw-tp{tp}"
        tmp.mkdir()
        url = gateway(es, tmp, decode["model_dir"], prefill_url, decode["url"])
        yield {"url": url, "sink": sink, "tp": tp}


def vllm_alone(decode: dict[str, Any], ids: list[int], max_tokens: int) -> str:
    r = httpx.post(
        f"{decode['url']}/v1/completions",
        timeout=300,
        json={"model": decode["model_dir"], "prompt": ids, "max_tokens": max_tokens,
              "temperature": 0.0},
    )  # fmt: skip
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def test_openai_client_gets_vllms_tokens_over_nixl(
    decode: dict[str, Any], gw: dict[str, Any]
) -> None:
    ids = [(37 * i + gw["tp"]) % 30000 + 5 for i in range(300)]
    before = nixl_bytes(decode["url"])
    c = openai.OpenAI(base_url=f"{gw['url']}/v1", api_key="none", max_retries=0, timeout=300)
    resp = c.completions.create(model="demo", prompt=ids, max_tokens=12, temperature=0)
    assert resp.choices[0].text == vllm_alone(decode, ids, 12)
    streamed = c.completions.create(
        model="demo", prompt=ids[1:], max_tokens=12, temperature=0, stream=True
    )
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == vllm_alone(
        decode, ids[1:], 12
    )
    # Both requests' KV came over NIXL: vLLM counted the bytes, our leases ended.
    sink: NixlSink = gw["sink"]
    layout, layers = sink.producer.layout, sink.producer.pool.num_layers
    blocks = layout.num_blocks(301) + layout.num_blocks(300)
    moved = blocks * layout.block_bytes * layers * sink.producer.tp_size  # every rank's heads
    deadline = time.monotonic() + 30
    while nixl_bytes(decode["url"]) - before < moved:
        assert time.monotonic() < deadline, "vLLM's nixl metrics show no bytes moved"
        time.sleep(0.5)
    assert nixl_bytes(decode["url"]) - before == moved
    while len(sink.producer.leases) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(sink.producer.leases) == 0
    assert "must not import flowprefill" not in decode["log"].read_text()


class _DiesAfterAnswering(NixlSink):
    """A prefill instance that goes away right after it answered with its KV reference,
    before decode could pull (a crash or restart between the two): its producer closes."""

    def publish(
        self, request_id: str, layers: Any, token_ids: Any, decode_prompt_tokens: int
    ) -> Any:
        params = super().publish(request_id, layers, token_ids, decode_prompt_tokens)
        self.producer.close()
        return params


def test_prefill_gone_before_the_pull_still_answers_with_vllms_tokens(
    decode: dict[str, Any],
) -> None:
    """openai client → gateway → a prefill instance whose producer is gone before decode
    pulls: decode's handshake fails, vLLM recomputes the prompt, the client gets vLLM's own
    tokens (no error), and decode keeps serving."""
    with ExitStack() as es:
        model = load_model(decode["model_dir"])
        backend = es.enter_context(PreemptibleExecutor(model, granularity="operator"))
        engine = PrefillEngine(backend, TTFTPredictor.linear(1e-4), batching="none")
        live = sink_for(decode["model_dir"], model.config)
        dying = _DiesAfterAnswering(live.producer)
        app = create_app(engine, kv_sink=dying)
        prefill_url = es.enter_context(serve_in_thread(app))
        tmp = decode["tmp"] / "gw-dying"
        tmp.mkdir()
        url = gateway(es, tmp, decode["model_dir"], prefill_url, decode["url"])
        ids = [(41 * i) % 30000 + 9 for i in range(200)]
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
        resp = c.completions.create(model="demo", prompt=ids, max_tokens=10, temperature=0)
        assert resp.choices[0].text == vllm_alone(decode, ids, 10)
    assert httpx.get(f"{decode['url']}/health", timeout=10).status_code == 200
