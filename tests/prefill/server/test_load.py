"""``GET /v1/load`` answers with the backlog the engine published, never the scheduler's."""

from __future__ import annotations

import httpx

from flowprefill.prefill.engine import EngineSnapshot, PrefillEngine
from flowprefill.prefill.server.prefill import create_app
from tests.helpers import serve_in_thread
from tests.prefill.test_engine import PREDICTOR, SteppedBackend


def test_load_is_the_engines_published_snapshot() -> None:
    engine = PrefillEngine(SteppedBackend(), PREDICTOR)
    with serve_in_thread(create_app(engine)) as url:
        assert engine.snapshot.running  # the server started the engine
        assert httpx.get(f"{url}/v1/load").json() == {
            "backlog_tokens": 0,
            "queue_delay_s": 0.0,
            "num_requests": 0,
        }
        # A snapshot the scheduler's own queues contradict (they are empty): the server
        # answers with the snapshot, so it never reads the scheduler from its thread.
        engine.snapshot = EngineSnapshot(
            running=True, backlog_tokens=1234, queue_delay_s=0.5, num_requests=7
        )
        assert httpx.get(f"{url}/v1/load").json() == {
            "backlog_tokens": 1234,
            "queue_delay_s": 0.5,
            "num_requests": 7,
        }
    assert not engine.snapshot.running  # closed with the server
