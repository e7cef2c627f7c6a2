"""The vLLM P/D route's deadline from llm-d's TTFT header under either name: a router
speaking llm-d's current ``x-llm-d-slo-ttft-ms`` gets the deadline the deprecated
``x-slo-ttft-ms`` gives, and the current name wins when both are sent."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from flowprefill.errors import EngineClosedError
from flowprefill.prefill.server.pd_api import add_pd_route

DEFAULT_S = 7.0


class RecordingEngine:
    """Records what the route submits, then refuses as a closed engine does (503): the
    deadline is all these tests read, so no model runs."""

    def __init__(self) -> None:
        self.submitted: list[dict[str, Any]] = []

    def submit(self, token_ids: Any, **kwargs: Any) -> Any:
        self.submitted.append(kwargs)
        raise EngineClosedError("closed for the test")


@pytest.fixture
def route() -> tuple[TestClient, RecordingEngine]:
    app, engine = FastAPI(), RecordingEngine()
    add_pd_route(
        app,
        engine,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]  # never reached: the engine refuses first
        lambda: None,
        model_name="m",
        default_ttft_slo_s=DEFAULT_S,
    )
    return TestClient(app), engine


def deadline(route: tuple[TestClient, RecordingEngine], headers: dict[str, str]) -> float:
    client, engine = route
    body = {"prompt": [1, 2, 3], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    answer = client.post("/v1/completions", json=body, headers=headers)
    assert answer.status_code == 503
    return float(engine.submitted[-1]["ttft_slo_s"])


def test_the_llm_d_name_gives_the_deadline_the_old_name_does(
    route: tuple[TestClient, RecordingEngine],
) -> None:
    assert deadline(route, {"x-slo-ttft-ms": "1500"}) == 1.5
    assert deadline(route, {"x-llm-d-slo-ttft-ms": "1500"}) == 1.5
    assert deadline(route, {}) == DEFAULT_S


def test_the_current_name_wins_over_the_alias(route: tuple[TestClient, RecordingEngine]) -> None:
    assert deadline(route, {"x-llm-d-slo-ttft-ms": "800", "x-slo-ttft-ms": "3000"}) == 0.8
    # A malformed hint is ignored (the default applies), as it always was.
    assert deadline(route, {"x-llm-d-slo-ttft-ms": "soon"}) == DEFAULT_S
