"""End to end: openai client → gateway → FlowPrefill prefill → KV hand-off → real vLLM decode.

One vLLM OpenAI server (decode, with our KV connector) and one prefill instance share a
locally built demo-size Llama (float32). Needs vLLM (the `decode` extra); skipped with the
reason where it is not installed.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from flowprefill.contracts import Endpoint, GatewayConfig
from flowprefill.gateway.app import create_gateway_app
from flowprefill.gateway.cli import build_state
from flowprefill.gateway.routing import Instance
from flowprefill.models import load_model, named_model_dir
from flowprefill.prefill.engine import PrefillEngine
from flowprefill.prefill.executor.runner import PreemptibleExecutor
from flowprefill.prefill.predictor.model import TTFTPredictor
from flowprefill.prefill.server.kv_sink import directory_sink
from flowprefill.prefill.server.prefill import create_app
from flowprefill.stack.decode import decode_env, decode_spec
from tests.helpers import free_port, serve_in_thread, wait_vllm

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed (pip install -e '.[decode]'; see README)",
    ),
]

TABLE = {
    "version": 1,
    "default_class": "chat",
    "classes": [
        {
            "name": "chat",
            "task_type": "text",
            "ttft_slo_ms": 1500,
            "priority": 10,
            "attainment_target": 0.9,
        },
        {
            "name": "file",
            "task_type": "file",
            "ttft_slo_ms": 120_000,
            "priority": 0,
            "attainment_target": 0.9,
            "claim": {"anyone": True},  # the test puts its long prompt here by x-slo-class
        },
    ],
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("e2e")
    model_dir = named_model_dir("demo-llama", cache_dir=tmp / "models")
    kv_dir = tmp / "kv"
    port = free_port()
    log = (tmp / "vllm.log").open("wb")
    proc = subprocess.Popen(
        decode_spec(model_dir, port, kv_dir).argv,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **decode_env(tmp)},
    )
    decode_url = f"http://127.0.0.1:{port}"
    try:
        with ExitStack() as stack:
            model = load_model(model_dir)
            executor = stack.enter_context(PreemptibleExecutor(model, granularity="operator"))
            t0 = time.perf_counter()
            executor.prefill([list(range(1, 2001))])
            per_token = (time.perf_counter() - t0) / 2000
            engine = PrefillEngine(executor, TTFTPredictor.linear(per_token), batching="none")
            prefill_url = stack.enter_context(
                serve_in_thread(create_app(engine, kv_sink=directory_sink(kv_dir, model.config)))
            )
            wait_vllm(decode_url, proc, tmp / "vllm.log")
            (tmp / "slo.json").write_text(json.dumps(TABLE))
            config = GatewayConfig(
                service="e2e",
                model_name="demo",
                tokenizer_path=str(model_dir),
                prefill=[Endpoint(pool="p", host="h", port=1, url=prefill_url)],
                decode=[Endpoint(pool="d", host="h", port=1, url=decode_url)],
            )
            gw = stack.enter_context(
                serve_in_thread(create_gateway_app(build_state(config, tmp / "slo.json")))
            )
            yield {
                "gw": gw,
                "decode": decode_url,
                "prefill": prefill_url,
                "model_dir": str(model_dir),
                "kv_dir": kv_dir,
                "tmp": tmp,
                "engine": engine,
            }
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def vllm_alone(stack: dict[str, Any], prompt_ids: list[int], max_tokens: int) -> str:
    """The reference: vLLM generating by itself (no hand-off), greedy."""
    r = httpx.post(
        f"{stack['decode']}/v1/completions",
        timeout=300,
        json={
            "model": stack["model_dir"],
            "prompt": prompt_ids,
            "max_tokens": max_tokens,
            "temperature": 0.0,
        },
    )
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def client(stack: dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack['gw']}/v1", api_key="none", max_retries=0, timeout=300)


def test_openai_client_gets_the_same_tokens_as_vllm_alone(stack: dict[str, Any]) -> None:
    ids = [(37 * i) % 30000 + 5 for i in range(300)]
    expected = vllm_alone(stack, ids, 12)
    c = client(stack)
    resp = c.completions.create(model="demo", prompt=ids, max_tokens=12, temperature=0)
    assert resp.choices[0].text == expected
    assert resp.usage is not None and resp.usage.completion_tokens == 12
    chunks = list(
        c.completions.create(
            model="demo",
            prompt=ids,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == expected
    # OpenAI's closing usage chunk: no choices; the first token plus what decode generated.
    last = chunks[-1]
    assert not last.choices and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (300, 12)
    assert all(ch.usage is None for ch in chunks[:-1])
    # Decode loaded the hand-off and deleted it when the request finished (shared_dir:
    # nothing is left for the age sweep).
    assert f"of hand-off {resp.id}" in (stack["tmp"] / "vllm.log").read_text()
    handoff = stack["kv_dir"] / f"{resp.id}.kv.safetensors"
    deadline = time.monotonic() + 10
    while handoff.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not handoff.exists()


def test_streaming_chat_matches_non_streaming(stack: dict[str, Any]) -> None:
    c = client(stack)
    msgs: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "Tell me about prefill scheduling."}
    ]
    full = c.chat.completions.create(model="demo", messages=msgs, max_tokens=10, temperature=0)
    parts = [
        ch.choices[0].delta.content or ""
        for ch in c.chat.completions.create(
            model="demo", messages=msgs, max_tokens=10, temperature=0, stream=True
        )
        if ch.choices
    ]
    assert "".join(parts) == full.choices[0].message.content


def test_long_prefill_is_preempted_and_urgent_requests_keep_their_slo(
    stack: dict[str, Any],
) -> None:
    long_ids = [(11 * i) % 30000 + 5 for i in range(6000)]
    shorts = [[(13 * i + k) % 30000 + 5 for i in range(64)] for k in range(3)]
    expected_long = vllm_alone(stack, long_ids, 4)
    expected_short = [vllm_alone(stack, s, 4) for s in shorts]
    engine: PrefillEngine = stack["engine"]
    preempted_before = engine.scheduler.stats.num_preemptions
    c = client(stack)

    def ask(ids: list[int], cls: str) -> tuple[str, float]:
        t0 = time.monotonic()
        stream = c.completions.create(
            model="demo",
            prompt=ids,
            max_tokens=4,
            temperature=0,
            stream=True,
            extra_headers={"x-slo-class": cls},
        )
        text, ttft = "", None
        for ch in stream:
            if ttft is None:
                ttft = time.monotonic() - t0
            text += ch.choices[0].text if ch.choices else ""
        assert ttft is not None
        return text, ttft

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        long_f = pool.submit(ask, long_ids, "file")
        deadline = time.monotonic() + 30
        while engine.scheduler.running is None:  # wait until the long prefill is running
            assert time.monotonic() < deadline
            time.sleep(0.005)
        short_fs = [pool.submit(ask, s, "chat") for s in shorts]
        short_results = [f.result() for f in short_fs]
        long_text, long_ttft = long_f.result()
    assert engine.scheduler.stats.num_preemptions > preempted_before
    for (text, ttft), expected in zip(short_results, expected_short, strict=True):
        assert text == expected
        assert ttft < 1.5, f"urgent request took {ttft:.2f} s to its first token"
        assert ttft < long_ttft
    assert long_text == expected_long


def _vllm_running(stack: dict[str, Any]) -> float:
    text = httpx.get(f"{stack['decode']}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_client_disconnect_cancels_prefill_and_decode(stack: dict[str, Any]) -> None:
    engine: PrefillEngine = stack["engine"]
    cancelled = 'flowprefill_prefill_requests_total{outcome="cancelled"'
    # 1. Gone while its prefill waits/runs: the prefill instance drops the request.
    long_ids = [(7 * i) % 30000 + 5 for i in range(6000)]
    with httpx.Client(timeout=httpx.Timeout(30, read=0.3)) as c, pytest.raises(httpx.ReadTimeout):
        c.post(
            f"{stack['gw']}/v1/completions",
            json={"model": "demo", "prompt": long_ids, "max_tokens": 4},
        )
    deadline = time.monotonic() + 30
    while engine.scheduler.queue_depth or engine.pool.num_tasks:
        assert time.monotonic() < deadline, "prefill kept a request nobody waits for"
        time.sleep(0.05)
    from prometheus_client import generate_latest

    assert cancelled in generate_latest(engine.metrics.registry).decode()
    # 2. Gone mid-stream: vLLM stops decoding it.
    ids = [(5 * i) % 30000 + 5 for i in range(100)]
    with (
        httpx.Client(timeout=120) as c,
        c.stream(
            "POST",
            f"{stack['gw']}/v1/completions",
            json={
                "model": "demo",
                "prompt": ids,
                "max_tokens": 2000,
                "stream": True,
                "temperature": 0.0,
                "ignore_eos": True,
            },
        ) as resp,
    ):
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data:") for line in got)
        assert _vllm_running(stack) >= 1
    deadline = time.monotonic() + 30
    while _vllm_running(stack) > 0:
        assert time.monotonic() < deadline, "vLLM kept decoding for a client that left"
        time.sleep(0.2)


def test_dead_decode_instance_fails_in_flight_and_is_routed_around(stack: dict[str, Any]) -> None:
    """A second vLLM decode instance (the victim) is SIGKILLed, with its whole process
    group as when a pod dies, while it decodes a streaming and a non-streaming request."""
    tmp: Path = stack["tmp"]
    port = free_port()
    log = tmp / "vllm-victim.log"
    victim = subprocess.Popen(
        decode_spec(Path(stack["model_dir"]), port, stack["kv_dir"]).argv,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env={**os.environ, **decode_env(tmp / "victim")},
        start_new_session=True,
    )
    victim_url = f"http://127.0.0.1:{port}"
    try:
        wait_vllm(victim_url, victim, log)
        config = GatewayConfig(
            service="e2e-failover",
            model_name="demo",
            tokenizer_path=stack["model_dir"],
            prefill=[Endpoint(pool="p", host="h", port=1, url=stack["prefill"])],
            decode=[
                Endpoint(pool="d", host="h", port=1, url=victim_url),
                Endpoint(pool="d", host="h", port=2, url=stack["decode"]),
            ],
        )
        state = build_state(config, tmp / "slo.json")
        assert state.decode_pool is not None
        victim_inst, healthy_inst = state.decode_pool.instances

        def in_decode(inst: Instance, n: int) -> None:
            deadline = time.monotonic() + 120
            while len(inst.in_flight) < n:
                assert time.monotonic() < deadline, "request never reached decode"
                time.sleep(0.02)

        with (
            serve_in_thread(create_gateway_app(state)) as gw,
            concurrent.futures.ThreadPoolExecutor(2) as pool,
        ):
            c = openai.OpenAI(base_url=f"{gw}/v1", api_key="none", max_retries=0, timeout=300)

            def long(prompt: list[int], stream: bool) -> Any:
                return c.completions.create(
                    model="demo",
                    prompt=prompt,
                    max_tokens=2000,
                    temperature=0,
                    stream=stream,
                    extra_body={"ignore_eos": True},
                )

            ids = [[(17 * i + k) % 30000 + 5 for i in range(80)] for k in range(4)]
            # Least-loaded decode routing with ties broken in turn: the first request goes
            # to the victim, the second (victim busy) to the healthy one, the third (a tie
            # again) to the victim. Checked, so a routing change fails here, not later.
            on_victim = iter(long(ids[0], stream=True))
            next(on_victim), next(on_victim)
            in_decode(victim_inst, 1)
            on_healthy = iter(long(ids[1], stream=True))
            next(on_healthy), next(on_healthy)
            in_decode(healthy_inst, 1)
            non_streaming = pool.submit(long, ids[2], False)
            in_decode(victim_inst, 2)
            assert len(healthy_inst.in_flight) == 1

            os.killpg(victim.pid, signal.SIGKILL)
            victim.wait(30)

            # In flight on the victim: the non-streaming request is retried on the healthy
            # instance if the victim had sent it nothing yet (the client saw nothing),
            # else answered a clear 502; a stream that already started ends with an
            # OpenAI-style error event.
            try:
                retried = non_streaming.result(timeout=120)
            except openai.InternalServerError as err:
                assert err.status_code == 502 and "decode instance" in err.message
                failed_on_victim = 2
            else:
                assert retried.choices[0].finish_reason == "length"
                assert retried.usage is not None and retried.usage.completion_tokens == 2000
                failed_on_victim = 1
            with pytest.raises(openai.APIError, match="decode instance"):
                for _ in on_victim:
                    pass
            # The healthy instance's stream goes on.
            got = [next(on_healthy) for _ in range(5)]
            assert all(ch.choices and ch.choices[0].finish_reason is None for ch in got)
            on_healthy.close()

            # New requests are served: while the victim is out of rotation (its back-off, 2 s
            # after two failures) only the healthy instance is asked; once it is back, the
            # first request routed to it meets the dead port and is retried on the healthy
            # instance (exactly one more failure on the victim's record, then 4 s out again).
            assert victim_inst.consecutive_failures == 2
            backoff_end = victim_inst.retry_after_s

            def served(k: int) -> None:
                r = c.completions.create(model="demo", prompt=ids[3][k % 3 :], max_tokens=6)
                assert r.choices[0].finish_reason == "length", k
                assert r.usage is not None and r.usage.completion_tokens == 6

            k = 0
            while state.clock() < backoff_end:
                served(k)
                k += 1
                if state.clock() < backoff_end:
                    assert victim_inst.consecutive_failures == 2
            for _ in range(8):  # rotation decides when the victim's turn comes
                served(k)
                k += 1
                if victim_inst.consecutive_failures > 2:
                    break
            assert victim_inst.consecutive_failures == 3
            metrics = httpx.get(f"{gw}/metrics").text
            errors = 'flowprefill_gateway_errors_total{reason="decode_failed"}'
            assert f"{errors} {failed_on_victim}.0" in metrics
    finally:
        if victim.poll() is None:
            os.killpg(victim.pid, signal.SIGKILL)
            victim.wait(30)


@pytest.fixture(scope="module")
def tp_gateway(stack: dict[str, Any]) -> Iterator[str]:
    """A second gateway in front of a TP=2 prefill instance (rank 0 here, rank 1 spawned)
    and the same vLLM decode."""
    from flowprefill.contracts import EngineConfig
    from flowprefill.prefill.factory import model_config_of
    from flowprefill.prefill.tp.prefill_backend import TPPrefillBackend

    tmp = stack["tmp"]
    config = EngineConfig(model_path=stack["model_dir"], tp_size=2, num_threads=1)
    with ExitStack() as es:
        backend = es.enter_context(TPPrefillBackend(config))
        engine = PrefillEngine(backend, TTFTPredictor.linear(1e-4), batching="none")
        sink = directory_sink(stack["kv_dir"], model_config_of(backend))
        prefill_url = es.enter_context(serve_in_thread(create_app(engine, kv_sink=sink)))
        gw_config = GatewayConfig(
            service="e2e-tp",
            model_name="demo",
            tokenizer_path=stack["model_dir"],
            prefill=[Endpoint(pool="p", host="h", port=1, url=prefill_url)],
            decode=[Endpoint(pool="d", host="h", port=1, url=stack["decode"])],
        )
        yield es.enter_context(
            serve_in_thread(create_gateway_app(build_state(gw_config, tmp / "slo.json")))
        )


def _external_hits(decode_url: str) -> float:
    text = httpx.get(f"{decode_url}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:external_prefix_cache_hits_total")
    )


def test_tp2_prefill_hands_off_kv_that_vllm_continues(
    stack: dict[str, Any], tp_gateway: str
) -> None:
    """openai client → gateway → TP=2 prefill → vLLM: the same tokens as vLLM alone, and
    decode took the prompt from the hand-off (external cache hits), not by recomputing."""
    ids = [(29 * i) % 30000 + 7 for i in range(260)]
    hits_before = _external_hits(stack["decode"])
    c = openai.OpenAI(base_url=f"{tp_gateway}/v1", api_key="none", max_retries=0, timeout=300)
    resp = c.completions.create(model="demo", prompt=ids, max_tokens=10, temperature=0)
    # Decode loaded the whole prompt from the hand-off (before the reference below puts
    # it in vLLM's own prefix cache): nothing was recomputed.
    loaded = re.findall(
        rf"loaded (\d+) prompt tokens \[0, \d+\) of hand-off {re.escape(resp.id)}\b",
        (stack["tmp"] / "vllm.log").read_text(),
    )
    assert loaded and int(loaded[0]) == len(ids)
    deadline = time.monotonic() + 30  # vLLM publishes its counters every few seconds
    while _external_hits(stack["decode"]) - hits_before < len(ids):
        assert time.monotonic() < deadline, "vLLM reported no external cache hits"
        time.sleep(0.5)
    assert resp.choices[0].text == vllm_alone(stack, ids, 10)
