"""``serve-prefill --kv-transport http`` serves hand-off reads on its KV port only.

A real ``flowprefill serve-prefill`` process (tiny model): decode's side of the KV port
(its real pull client reads and deletes there), the gateway's side of the main port
(prefill, and DELETE of a hand-off decode will not load; reads refused, naming the KV
port), and SIGTERM closing both. The KV app's answers in detail (ranges, ids) are in
tests/kv/test_http_transport.py and tests/prefill/server/test_kv_http.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from flowprefill.contracts.kv import HandoffRef
from flowprefill.kv import HTTPPullTransport, SharedDirTransport
from flowprefill.models import named_model_dir
from flowprefill.prefill.predictor.model import TTFTPredictor
from flowprefill.prefill.server.cli import add_arguments, run
from tests.helpers import free_port, wait_ready


def _prefill(url: str, rid: str) -> HandoffRef:
    body = {"request_id": rid, "prompt_token_ids": list(range(1, 30)), "ttft_slo_s": 60.0}
    r = httpx.post(f"{url}/v1/prefill", json=body, timeout=60)
    assert r.status_code == 200, r.text
    ref = HandoffRef.from_params(r.json()["kv_transfer_params"])
    assert ref is not None
    return ref


def test_hand_offs_are_read_on_the_kv_port_and_released_on_the_main_one(tmp_path: Path) -> None:
    model_dir = named_model_dir("tiny-llama", cache_dir=tmp_path / "models")
    profile = tmp_path / "p.json"
    TTFTPredictor.linear(2e-5).save(profile)
    port, kv_port = free_port(), free_port()
    url, kv_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{kv_port}"
    kv_dir = tmp_path / "kv"
    argv = [sys.executable, "-m", "flowprefill.cli", "serve-prefill", "--model", str(model_dir)]
    argv += ["--profile", str(profile), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--kv-port", str(kv_port), "--kv-transport", "http", "--kv-dir", str(kv_dir)]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        wait_ready(url, proc)
        ref = _prefill(url, "r1")
        assert ref.source == kv_url  # what decode is told to pull from
        store = SharedDirTransport(kv_dir)
        data = store.path("r1").read_bytes()

        # The gateway's port: no reads, whatever the request; the answer names the KV port.
        for method in ("GET", "HEAD"):
            r = httpx.request(method, f"{url}/v1/kv/r1", headers={"Range": "bytes=0-7"})
            assert r.status_code == 405 and r.headers["allow"] == "DELETE", method
        assert f"{kv_url}/v1/kv/<id>" in httpx.get(f"{url}/v1/kv/r1").json()["error"]["message"]

        # The KV port: the bytes, by range too; nothing but hand-offs (and liveness).
        assert httpx.get(f"{kv_url}/v1/kv/r1").content == data
        part = httpx.get(f"{kv_url}/v1/kv/r1", headers={"Range": "bytes=0-7"})
        assert part.status_code == 206 and part.content == data[:8]
        assert httpx.get(f"{kv_url}/health").status_code == 200
        for path in ("/v1/prefill", "/ready", "/metrics", "/v1/load"):
            assert httpx.get(f"{kv_url}{path}").status_code == 404, path

        # Decode's connector: header, download, and its DELETE once loaded — all on the KV
        # port (the NetworkPolicy lets decode reach nothing else on prefill pods).
        pull = HTTPPullTransport(tmp_path / "decode-cache")
        try:
            assert pull.header(ref).num_tokens == 29
            pull.open(ref).close()
            assert pull.delete(ref, wait=True)
        finally:
            pull.close()
        assert not store.path("r1").exists()

        # The gateway releases a hand-off decode will not load on the main port.
        ref2 = _prefill(url, "r2")
        assert httpx.delete(f"{url}/v1/kv/{ref2.handoff_id}").json() == {
            "handoff_id": "r2",
            "deleted": True,
        }
        assert httpx.get(f"{kv_url}/v1/kv/r2").status_code == 404

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) in (0, -signal.SIGTERM)
        for base in (url, kv_url):
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"{base}/health", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_the_kv_port_must_differ_from_the_main_one() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--kv-transport", "http", "--port", "9100", "--kv-port", "9100"])
    with pytest.raises(SystemExit, match="--kv-port must differ from --port"):
        run(args)
