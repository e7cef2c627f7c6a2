"""SIGTERM on a prefill process: in-flight requests finish, new ones are refused."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from flowprefill.contracts.metrics import PREFILL_QUEUE_DEPTH
from flowprefill.models import named_model_dir
from flowprefill.prefill.predictor.model import TTFTPredictor
from tests.helpers import free_port, wait_ready

QUEUE_DEPTH = PREFILL_QUEUE_DEPTH + " "


def test_sigterm_drains_in_flight_requests(tmp_path: Path) -> None:
    model_dir = named_model_dir("tiny-llama", cache_dir=tmp_path / "models")
    profile = tmp_path / "p.json"
    TTFTPredictor.linear(2e-5).save(profile)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flowprefill.cli",
            "serve-prefill",
            "--model",
            str(model_dir),
            "--profile",
            str(profile),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        wait_ready(url, proc)

        def call(i: int) -> int:
            body = {
                "request_id": f"r{i}",
                "prompt_token_ids": [1 + (i + j) % 2000 for j in range(8000)],
                "ttft_slo_s": 60.0,
            }
            return httpx.post(f"{url}/v1/prefill", json=body, timeout=120).status_code

        def queued() -> float:
            text = httpx.get(f"{url}/metrics", timeout=5).text
            line = next(x for x in text.splitlines() if x.startswith(QUEUE_DEPTH))
            return float(line.split()[-1])

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(call, i) for i in range(6)]
            # All six in flight before the signal (on a loaded machine sending six 8K-token
            # bodies can take longer than any fixed sleep): none of them may be dropped.
            deadline = time.monotonic() + 60
            while queued() < 6 and time.monotonic() < deadline:
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.2)
            refused = False
            try:
                httpx.post(
                    f"{url}/v1/prefill",
                    timeout=5,
                    json={"request_id": "late", "prompt_token_ids": [1, 2], "ttft_slo_s": 1.0},
                )
            except httpx.HTTPError:
                refused = True
            statuses = [f.result() for f in futures]
        assert statuses == [200] * 6  # every in-flight request was finished, none dropped
        assert refused  # no new work accepted while draining
        # uvicorn re-raises the signal once its graceful shutdown is done.
        assert proc.wait(60) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
