"""``flowprefill serve-prefill`` with ``tp_size = 2``: serves, and dies cleanly with a rank."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from flowprefill.models import named_model_dir
from flowprefill.prefill.predictor.model import TTFTPredictor
from tests.helpers import free_port, wait_ready


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid and b"spawn_main" in cmdline:
            found.append(int(entry.name))
    return found


def test_tp2_server_answers_then_exits_when_a_rank_is_killed(tmp_path: Path) -> None:
    model_dir = named_model_dir("tiny-llama", cache_dir=tmp_path / "models")
    profile = tmp_path / "p.json"
    TTFTPredictor.linear(2e-5).save(profile)
    config = tmp_path / "engine.json"
    config.write_text(
        json.dumps({"model_path": str(model_dir), "tp_size": 2, "predictor_path": str(profile)})
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flowprefill.cli",
            "serve-prefill",
            "--config",
            str(config),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        wait_ready(url, proc)
        ok = httpx.post(
            f"{url}/v1/prefill",
            json={"request_id": "a", "prompt_token_ids": list(range(1, 200)), "ttft_slo_s": 5.0},
            timeout=60,
        )
        assert ok.status_code == 200 and ok.json()["num_prompt_tokens"] == 199
        followers = _children(proc.pid)
        assert len(followers) == 1

        def call(i: int) -> httpx.Response:
            body = {
                "request_id": f"r{i}",
                "prompt_token_ids": [1 + (i + j) % 2000 for j in range(8000)],
                "ttft_slo_s": 60.0,
            }
            return httpx.post(f"{url}/v1/prefill", json=body, timeout=120)

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(call, i) for i in range(3)]
            time.sleep(0.3)
            killed = time.monotonic()
            os.kill(followers[0], signal.SIGKILL)
            answers = [f.result() for f in futures]
        assert time.monotonic() - killed < 30
        failed = [a for a in answers if a.status_code != 200]
        assert failed, "every request finished although rank 1 was killed first"
        for answer in failed:
            assert answer.status_code == 503
            assert "rank 1" in answer.json()["error"]["message"]
        # The server exits non-zero so that Kubernetes restarts the pod.
        assert proc.wait(60) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
