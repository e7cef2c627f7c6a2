"""A follower rank that dies takes the instance down cleanly: errors, not hangs."""

from __future__ import annotations

import os
import signal
import time

import pytest
from fastapi.testclient import TestClient

from flowprefill.errors import RankFailedError
from flowprefill.prefill.engine import PrefillEngine
from flowprefill.prefill.executor.preemption import TaskControl
from flowprefill.prefill.server.prefill import create_app
from flowprefill.prefill.tp.prefill_backend import TPPrefillBackend
from tests.prefill.tp.conftest import tp_config
from tests.prefill.tp.harness import Task, prompts

BOUND_S = 20.0
"""In-flight work must be answered within this long after the rank dies."""


class _Flat:
    def predict_s(self, num_tokens: int) -> float:
        return 1e-4 * num_tokens


def _wait_failed(backend: TPPrefillBackend) -> RankFailedError:
    deadline = time.monotonic() + BOUND_S
    while backend.group.failure is None:
        assert time.monotonic() < deadline, "the dead rank was not noticed"
        time.sleep(0.01)
    return backend.group.failure


def test_killing_a_rank_mid_prefill_fails_the_task_and_the_instance() -> None:
    backend = TPPrefillBackend(tp_config("llama"))
    try:
        running = Task(backend, prompts([4000], backend.vocab_size, seed=1), "long").start()
        parked = Task(backend, prompts([900], backend.vocab_size, seed=2), "parked")
        running.wait_checkpoints(2)
        assert running.preempt()  # one task parked on every rank ...
        parked.start()
        parked.wait_checkpoints(2)  # ... and one running when rank 1 dies
        follower = backend.group.processes[0]
        os.kill(follower.pid or 0, signal.SIGKILL)
        failure = _wait_failed(backend)
        assert "rank 1" in str(failure) and str(-signal.SIGKILL) in str(failure)
        start = time.monotonic()
        with pytest.raises(Exception):  # noqa: B017 - gloo's error or RankFailedError
            parked.join()
        assert time.monotonic() - start < BOUND_S
        # New work is refused at once, naming the cause.
        with pytest.raises(RankFailedError, match="rank 1"):
            backend.run(prompts([5], backend.vocab_size, seed=3), TaskControl("after"))
    finally:
        backend.close()


def test_engine_answers_in_flight_requests_with_503_and_reports_not_ready() -> None:
    backend = TPPrefillBackend(tp_config("llama"))
    engine = PrefillEngine(backend, _Flat())
    backend.group.on_failure(engine.fail)
    engine.start()
    try:
        futures = [
            engine.submit(p, ttft_slo_s=10.0)
            for p in prompts([6000, 3000, 50], backend.vocab_size, seed=4)
        ]
        time.sleep(0.05)
        os.kill(backend.group.processes[0].pid or 0, signal.SIGKILL)
        for fut in futures:
            error = fut.exception(timeout=BOUND_S)
            if error is not None:  # the short one may have finished before the kill
                assert isinstance(error, RankFailedError) or "rank" in str(error).lower()
        assert any(fut.exception() is not None for fut in futures)
        assert not engine.accepting
        with pytest.raises(RankFailedError, match="rank 1"):
            engine.submit([1, 2, 3], ttft_slo_s=1.0)
        client = TestClient(create_app(engine))  # no lifespan: the engine runs already
        ready = client.get("/ready")
        assert ready.status_code == 503
        assert "rank 1" in ready.text
        answer = client.post(
            "/v1/prefill",
            json={"request_id": "late", "prompt_token_ids": [1, 2], "ttft_slo_s": 1.0},
        )
        assert answer.status_code == 503 and "rank 1" in answer.json()["error"]["message"]
    finally:
        engine.close(drain=False, timeout_s=5.0)
        backend.close()
