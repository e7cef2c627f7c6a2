"""A decode process killed while it holds a request: the KV hand-off is released through
the prefill instance that wrote it, not left to prefill's age sweep.

Real processes: a prefill server on the tiny model writing hand-offs into a directory
(``shared_dir``), the gateway in front of it, and stand-in decode servers
(:mod:`tests.gateway.decode_stub`) that never delete a hand-off themselves, so a file that
disappears was deleted by prefill's ``DELETE /v1/kv/<id>`` on the gateway's word (the age
sweep waits 600 s).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from flowprefill.contracts import Endpoint, GatewayConfig
from flowprefill.gateway.app import create_gateway_app
from flowprefill.gateway.cli import build_state
from flowprefill.models import named_model_dir
from flowprefill.prefill.predictor.model import TTFTPredictor
from tests.gateway.test_failover import TABLE, wait_ready
from tests.helpers import free_port, serve_in_thread

BODY = {"model": "tiny", "prompt": list(range(1, 41)), "max_tokens": 8, "ignore_eos": True}
"""More than one token (so decode gets the request); ``ignore_eos``: a random model's
end-of-sequence first token would end the answer before decode."""


PREFILL = [sys.executable, "-m", "flowprefill.cli", "serve-prefill"]


class Prefill:
    def __init__(self, url: str, kv_dir: Path, model_dir: Path) -> None:
        self.url, self.kv_dir, self.model_dir = url, kv_dir, model_dir

    def handoffs(self) -> list[Path]:
        """Hand-off files (and temp files of ones being written) in its directory."""
        return sorted(self.kv_dir.iterdir())


@pytest.fixture(scope="module")
def prefill(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prefill]:
    tmp = tmp_path_factory.mktemp("decode-death")
    model_dir = named_model_dir("tiny-llama", cache_dir=tmp / "models")
    profile = tmp / "profile.json"
    TTFTPredictor.linear(2e-5).save(profile)
    kv_dir = tmp / "kv"
    kv_dir.mkdir()
    port = free_port()
    # fmt: off
    argv = [
        *PREFILL, "--model", str(model_dir), "--profile", str(profile), "--port", str(port),
        "--host", "127.0.0.1", "--kv-dir", str(kv_dir), "--kv-transport", "shared_dir",
    ]
    # fmt: on
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, proc)
        yield Prefill(url, kv_dir, model_dir)
    finally:
        proc.kill()
        proc.wait()


class Decode:
    """A stub decode process (:mod:`tests.gateway.decode_stub`) and what it was sent."""

    def __init__(self, records: Path, chunks: int, hold_s: float) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.record = records / f"{self.port}.json"
        stub = [sys.executable, "-m", "tests.gateway.decode_stub", str(self.port), str(records)]
        self.proc = subprocess.Popen([*stub, "--chunks", str(chunks), "--hold", str(hold_s)])

    def got(self) -> str | None:
        """The hand-off id of the request it was sent, once it has one."""
        return json.loads(self.record.read_text())["handoff_id"] if self.record.exists() else None

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


@pytest.fixture
def decodes(tmp_path: Path) -> Iterator[Callable[[int, float], Decode]]:
    started: list[Decode] = []

    def start(chunks: int, hold_s: float) -> Decode:
        d = Decode(tmp_path, chunks, hold_s)
        started.append(d)
        return d

    try:
        yield start
    finally:
        for d in started:
            if d.proc.poll() is None:
                d.kill()


def _until(what: Callable[[], object], timeout_s: float, failure: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, failure
        time.sleep(0.05)


def _in_decode(decodes: list[Decode], prefill: Prefill) -> Decode:
    """The instance the gateway sent the request to, once it has it; the hand-off it was
    told to load is on disk then (the gateway awaits it before asking decode)."""
    _until(lambda: any(d.got() for d in decodes), 60, "no decode instance got the request")
    holder = next(d for d in decodes if d.got())
    assert [p.name for p in prefill.handoffs()] == [f"{holder.got()}.kv.safetensors"]
    return holder


def _gateway(prefill: Prefill, decodes: list[Decode], tmp_path: Path) -> GatewayConfig:
    (tmp_path / "slo.json").write_text(json.dumps(TABLE))
    for d in decodes:
        _until(lambda d=d: _answers(d.url), 60, "stub decode did not start")  # type: ignore[misc]
    return GatewayConfig(
        service="t",
        model_name="tiny",
        tokenizer_path=str(prefill.model_dir),
        prefill=[Endpoint(pool="p", host="h", port=1, url=prefill.url)],
        decode=[Endpoint(pool="d", host="h", port=1, url=d.url) for d in decodes],
    )


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _post(gw: str) -> Future[httpx.Response]:
    pool = ThreadPoolExecutor(1)
    future = pool.submit(httpx.post, f"{gw}/v1/completions", json=BODY, timeout=60)
    pool.shutdown(wait=False)
    return future


def test_decode_killed_mid_stream_fails_the_request_and_releases_its_handoff(
    prefill: Prefill, decodes: Callable[[int, float], Decode], tmp_path: Path
) -> None:
    """It had streamed a token (so no retry: that token reached the gateway) and its
    connector, had it one, died with it: the gateway answers a clear error and deletes
    the hand-off through prefill."""
    victim = decodes(1, 60.0)  # one chunk, then silence until killed
    state = build_state(_gateway(prefill, [victim], tmp_path), tmp_path / "slo.json")
    with serve_in_thread(create_gateway_app(state)) as gw:
        answer = _post(gw)
        _in_decode([victim], prefill)
        time.sleep(0.3)  # the chunk reaches the gateway
        assert not answer.done()
        victim.kill()
        r = answer.result(timeout=30)
        assert r.status_code == 502, r.text
        error = r.json()["error"]
        assert f"decode instance {victim.url}/v1/completions failed mid-request" in error["message"]
        _until(lambda: not prefill.handoffs(), 10, f"hand-off left: {prefill.handoffs()}")


def test_a_retry_on_another_decode_keeps_the_handoff_until_it_has_finished(
    prefill: Prefill, decodes: Callable[[int, float], Decode], tmp_path: Path
) -> None:
    """Killed before it sent anything: retried on the other instance, which may be loading
    the hand-off — so no release while it works, and one once it has finished (nothing
    loads a finished request's hand-off again)."""
    stubs = [decodes(0, 5.0), decodes(0, 5.0)]  # nothing for 5 s, then the last token
    state = build_state(_gateway(prefill, stubs, tmp_path), tmp_path / "slo.json")
    with serve_in_thread(create_gateway_app(state)) as gw:
        answer = _post(gw)
        victim = _in_decode(stubs, prefill)
        victim.kill()
        survivor = next(d for d in stubs if d is not victim)
        _until(survivor.got, 30, "the request was not retried on the other instance")
        assert survivor.got() == victim.got()
        assert not answer.done() and prefill.handoffs()  # live there: not released
        r = answer.result(timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"].endswith(" y")
        _until(lambda: not prefill.handoffs(), 10, f"hand-off left: {prefill.handoffs()}")
