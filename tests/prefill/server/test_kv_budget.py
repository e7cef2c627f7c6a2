"""The KV a prefill instance holds for decode has a byte budget: past it a prompt gets no
hand-off (decode recomputes), nothing already written is evicted, and the instance's
metrics say how much it holds and how many it refused."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from flowprefill.errors import KVBudgetExceededError
from flowprefill.kv import SharedDirTransport
from flowprefill.models import build_named
from flowprefill.prefill.engine import PrefillEngine
from flowprefill.prefill.executor.runner import PreemptibleExecutor
from flowprefill.prefill.predictor.model import TTFTPredictor
from flowprefill.prefill.server.kv_sink import directory_sink, kv_nbytes
from flowprefill.prefill.server.prefill import create_app
from tests.helpers import serve_in_thread

TOKENS = 40
PROMPT = [(7 * i) % 2000 for i in range(TOKENS)]


@pytest.fixture(scope="module")
def executor() -> Iterator[PreemptibleExecutor]:
    with PreemptibleExecutor(build_named("tiny-llama", seed=0), granularity="operator") as ex:
        yield ex


def _body(rid: str) -> dict[str, object]:
    return {
        "request_id": rid,
        "prompt_token_ids": PROMPT,
        "ttft_slo_s": 5.0,
        "elapsed_s": 0.0,
        "slo_class": "chat",
    }


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def test_sink_refuses_past_its_budget_and_evicts_nothing(
    executor: PreemptibleExecutor, tmp_path: Path
) -> None:
    output = executor.prefill([PROMPT])[0]
    size = kv_nbytes(output.kv_cache)
    sink = directory_sink(tmp_path, executor.model.config, budget_bytes=int(2.5 * size))
    ids = [0] * TOKENS
    sink("a", ids, output)
    sink("b", ids, output)
    held = sink.held_bytes()
    assert 2 * size <= held <= 2.5 * size  # safetensors headers are small
    with pytest.raises(KVBudgetExceededError, match="budget"):
        sink("c", ids, output)
    transport = SharedDirTransport(tmp_path)
    assert not transport.path("c").exists()  # nothing half-written
    assert transport.path("a").exists() and transport.path("b").exists()  # nothing evicted
    assert sink.held_bytes() == held
    transport.delete("a")  # decode loaded it
    sink("c", ids, output)
    assert transport.path("c").exists()


def test_full_budget_answers_the_first_token_without_hand_off(
    executor: PreemptibleExecutor, tmp_path: Path
) -> None:
    output = executor.prefill([PROMPT])[0]
    size = kv_nbytes(output.kv_cache)
    engine = PrefillEngine(executor, TTFTPredictor.linear(1e-5))
    sink = directory_sink(tmp_path, executor.model.config, budget_bytes=int(1.5 * size))
    engine.metrics.watch_kv(sink.held_bytes, sink.budget_bytes or 0)
    with serve_in_thread(create_app(engine, kv_sink=sink)) as url:
        first = httpx.post(f"{url}/v1/prefill", json=_body("one"), timeout=30).json()
        second = httpx.post(f"{url}/v1/prefill", json=_body("two"), timeout=30)
        metrics = httpx.get(f"{url}/metrics").text
    assert first["kv_transfer_params"] is not None
    assert second.status_code == 200, second.text
    answer = second.json()
    assert answer["first_token_id"] == first["first_token_id"]  # the token still goes out
    assert answer["kv_transfer_params"] is None  # decode recomputes
    held = _metric(metrics, "flowprefill_prefill_kv_held_bytes")
    assert held == sink.held_bytes() == SharedDirTransport(tmp_path).path("one").stat().st_size
    assert _metric(metrics, "flowprefill_prefill_kv_budget_bytes") == int(1.5 * size)
    refused = 'flowprefill_prefill_kv_handoffs_refused_total{reason="budget"}'
    assert _metric(metrics, refused) == 1.0
