"""A prefill process that dies: in-flight requests get a clear 5xx, new ones go elsewhere."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from flowprefill.contracts import Endpoint, GatewayConfig
from flowprefill.gateway.app import create_gateway_app
from flowprefill.gateway.cli import build_state
from flowprefill.models import named_model_dir
from flowprefill.predictor.model import TTFTPredictor
from tests.helpers import free_port, serve_in_thread

TABLE = {
    "version": 1,
    "default_class": "chat",
    "classes": [
        {
            "name": "chat",
            "task_type": "text",
            "ttft_slo_ms": 60000,
            "priority": 0,
            "attainment_target": 0.9,
        }
    ],
}


def start_prefill(model_dir: Path, profile: Path, port: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flowprefill.cli",
            "serve-prefill",
            "--model",
            str(model_dir),
            "--profile",
            str(profile),
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
    )


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "prefill server exited during start-up"
        try:
            if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(url)


# model dir, temporary dir, the two prefill URLs, their processes
TwoPrefills = tuple[Path, Path, list[str], list[subprocess.Popen[bytes]]]


@pytest.fixture(scope="module")
def two_prefills(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoPrefills]:
    tmp = tmp_path_factory.mktemp("failover")
    model_dir = named_model_dir("tiny-llama", cache_dir=tmp / "models")
    profile = tmp / "profile.json"
    TTFTPredictor.linear(2e-5).save(profile)
    ports = [free_port(), free_port()]
    procs = [start_prefill(model_dir, profile, p) for p in ports]
    try:
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        for url, proc in zip(urls, procs, strict=True):
            wait_ready(url, proc)
        yield model_dir, tmp, urls, procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def test_dead_prefill_instance_fails_in_flight_and_is_routed_around(
    two_prefills: TwoPrefills,
) -> None:
    model_dir, tmp, urls, procs = two_prefills
    (tmp / "slo.json").write_text(json.dumps(TABLE))
    config = GatewayConfig(
        service="t",
        model_name="tiny",
        tokenizer_path=str(model_dir),
        decode=[],
        prefill=[Endpoint(pool="p", host="h", port=1, url=u) for u in urls],
        prefill_routing="round-robin",
    )
    state = build_state(config, tmp / "slo.json")
    with serve_in_thread(create_gateway_app(state)) as gw:
        long_prompt = {
            "model": "tiny",
            "prompt": [1 + i % 2000 for i in range(8000)],
            "max_tokens": 1,
        }

        def call() -> int:
            return httpx.post(f"{gw}/v1/completions", json=long_prompt, timeout=120).status_code

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(call) for _ in range(8)]
            time.sleep(0.3)  # requests are queued on both instances
            procs[0].send_signal(signal.SIGKILL)
            statuses = sorted(f.result() for f in futures)
        assert 200 in statuses, statuses
        failed = [s for s in statuses if s != 200]
        assert failed and all(s in (502, 503) for s in failed), statuses
        # The dead instance is out of rotation: every new request is served.
        for _ in range(4):
            r = httpx.post(
                f"{gw}/v1/completions",
                timeout=60,
                json={"model": "tiny", "prompt": "hello", "max_tokens": 1},
            )
            assert r.status_code == 200, r.text
        metrics = httpx.get(f"{gw}/metrics").text
        assert 'flowprefill_gateway_errors_total{reason="prefill_failed"}' in metrics
