"""A prefill process that dies or stalls: requests in flight on it are retried on the other
instance (nothing had reached the client yet), new ones go elsewhere."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from flowprefill.contracts import Endpoint, GatewayConfig
from flowprefill.contracts.gateway import HealthProbeSettings
from flowprefill.gateway.app import GatewayState, create_gateway_app
from flowprefill.gateway.cli import build_state
from flowprefill.models import named_model_dir
from flowprefill.prefill.predictor.model import TTFTPredictor
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
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return named_model_dir("tiny-llama", cache_dir=tmp_path_factory.mktemp("models"))


@pytest.fixture
def two_prefills(model_dir: Path, tmp_path: Path) -> Iterator[TwoPrefills]:
    """Fresh for each test: the tests kill or stop one."""
    tmp = tmp_path
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
                p.send_signal(signal.SIGCONT)
                p.kill()
            p.wait()


def _gateway_state(two_prefills: TwoPrefills, **config: Any) -> GatewayState:
    model_dir, tmp, urls, _ = two_prefills
    (tmp / "slo.json").write_text(json.dumps(TABLE))
    gateway = GatewayConfig(
        service="t",
        model_name="tiny",
        tokenizer_path=str(model_dir),
        decode=[],
        prefill=[Endpoint(pool="p", host="h", port=1, url=u) for u in urls],
        prefill_routing="round-robin",
        **config,
    )
    return build_state(gateway, tmp / "slo.json")


LONG_PROMPT = {"model": "tiny", "prompt": [1 + i % 2000 for i in range(8000)], "max_tokens": 1}


def _long_prefills(gw: str, n: int, fault: Callable[[], None]) -> list[int]:
    """``n`` long prefills spread over both instances; ``fault()`` once they are queued."""

    def call() -> int:
        return httpx.post(f"{gw}/v1/completions", json=LONG_PROMPT, timeout=120).status_code

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(call) for _ in range(n)]
        time.sleep(0.3)  # requests are queued on both instances
        fault()
        return sorted(f.result() for f in futures)


def _served(gw: str) -> None:
    r = httpx.post(
        f"{gw}/v1/completions",
        timeout=60,
        json={"model": "tiny", "prompt": "hello", "max_tokens": 1},
    )
    assert r.status_code == 200, r.text


def test_dead_prefill_instance_is_retried_elsewhere_and_routed_around(
    two_prefills: TwoPrefills,
) -> None:
    procs = two_prefills[3]
    state = _gateway_state(two_prefills)
    with serve_in_thread(create_gateway_app(state)) as gw:
        statuses = _long_prefills(gw, 8, lambda: procs[0].send_signal(signal.SIGKILL))
        assert statuses == [200] * 8  # the dead instance's share was retried, not failed
        dead = state.prefill_pool.instances[0]
        assert not dead.healthy and dead.consecutive_failures >= 1
        for _ in range(4):  # out of rotation: every new request is served
            _served(gw)
        metrics = httpx.get(f"{gw}/metrics").text
        assert 'flowprefill_gateway_errors_total{reason="prefill_failed"}' not in metrics


def test_stalled_prefill_instance_is_abandoned_and_routed_around(
    two_prefills: TwoPrefills,
) -> None:
    """SIGSTOP: the process keeps its socket (connections are accepted, never answered),
    so only the gateway's health probes can tell."""
    procs = two_prefills[3]
    probe = HealthProbeSettings(interval_s=0.2, timeout_s=0.5, failures=2)
    state = _gateway_state(two_prefills, health_probe=probe)
    stalled = state.prefill_pool.instances[0]
    with serve_in_thread(create_gateway_app(state)) as gw:
        t0 = time.monotonic()
        statuses = _long_prefills(gw, 8, lambda: procs[0].send_signal(signal.SIGSTOP))
        assert statuses == [200] * 8  # abandoned on the stalled one, retried on the other
        assert stalled.stall.is_set()
        for _ in range(4):
            _served(gw)
        assert time.monotonic() - t0 < 100  # nothing waited for the stalled one's timeout
        procs[0].send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 30
        while stalled.stall.is_set():  # the first answered probe takes it back
            assert time.monotonic() < deadline, "never taken back into rotation"
            time.sleep(0.1)
        metrics = httpx.get(f"{gw}/metrics").text
        assert "prefill_stalled" not in metrics  # retried: no request failed for it
