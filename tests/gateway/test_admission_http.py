"""Admission over real HTTP: a gateway in front of two real prefill instances (tiny model,
CPU). The queued work is the gateway's routing state (requests it has booked on each
instance), so what is predicted does not depend on how fast this machine is.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from flowprefill.contracts.names import Router
from flowprefill.contracts.prefill_api import LOAD_PATH, PrefillLoad
from flowprefill.gateway.routing import InstancePool
from flowprefill.models import named_model_dir
from tests.helpers import local_stack

SLO_TABLE = {
    "version": 1,
    "default_class": "chat",
    "classes": [
        {
            "name": "chat",
            "task_type": "text",
            "ttft_slo_ms": 1000,
            "priority": 10,
            "attainment_target": 0.9,
        },
        {
            "name": "batch",
            "task_type": "file",
            "ttft_slo_ms": 1000,
            "priority": -5,
            "attainment_target": 0.5,
            "match": {"headers": {"x-task": "batch"}},
        },
    ],
}
PER_TOKEN_S = 1e-3
"""The gateway's predictor in these tests: 1 ms per token."""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    model_dir = named_model_dir("tiny-llama", cache_dir=tmp_path_factory.mktemp("models"))
    table = tmp_path_factory.mktemp("gateway") / "slo-table.json"
    table.write_text(json.dumps(SLO_TABLE))
    with local_stack(model_dir, table) as s:
        s["state"].prefill_pool.predict_s = lambda n: n * PER_TOKEN_S
        yield s


@pytest.fixture
def pool(stack: dict[str, Any]) -> Iterator[InstancePool]:
    p: InstancePool = stack["state"].prefill_pool
    p.policy = Router.SLACK_AWARE
    yield p
    for inst in p.instances:
        for rid in [r for r in inst.in_flight if r.startswith("ghost")]:
            p.end(inst, rid)
    p.reports.clear()


@pytest.fixture
def client(stack: dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack['url']}/v1", api_key="none", max_retries=0)


def load_up(pool: InstancePool, index: int) -> None:
    """Book 1.6 s of work due within 0.95 s of now on instance ``index``, in pieces that
    each stay feasible on their own (so an S-EDF engine would run them before a later
    deadline) for 0.75 s: a loaded test host may take that long to bring the request to
    admission, and a piece no longer feasible would not count."""
    inst = pool.instances[index]
    now = pool.clock()
    for k in range(8):
        pool.begin(inst, f"ghost-{index}-{k}", now + 0.95, 200)


def served(stack: dict[str, Any]) -> list[int]:
    return [e.scheduler.stats.num_finished for e in stack["engines"]]


def batch(client: openai.OpenAI, **kw: Any) -> Any:
    return client.completions.with_raw_response.create(
        model="tiny",
        prompt="a short prompt",
        max_tokens=1,
        extra_headers={"x-task": "batch"},
        **kw,
    )


def test_sheddable_request_nobody_can_serve_in_time_is_refused(
    stack: dict[str, Any], pool: InstancePool, client: openai.OpenAI
) -> None:
    load_up(pool, 0)
    load_up(pool, 1)
    before = served(stack)
    with pytest.raises(openai.RateLimitError) as refused:
        batch(client)
    err = refused.value
    assert err.status_code == 429
    assert int(err.response.headers["retry-after"]) >= 1
    assert err.response.headers["x-flowprefill-slo-class"] == "batch"
    body = err.response.json()["error"]
    assert "'batch'" in body["message"] and body["type"] == "rate_limit_exceeded"
    assert served(stack) == before  # refused at the gateway: no instance saw it
    metrics = httpx.get(f"{stack['url']}/metrics").text
    assert 'flowprefill_gateway_shed_total{slo_class="batch"}' in metrics


def test_non_sheddable_class_is_served_under_the_same_load(
    stack: dict[str, Any], pool: InstancePool, client: openai.OpenAI
) -> None:
    load_up(pool, 0)
    load_up(pool, 1)
    raw = client.completions.with_raw_response.create(model="tiny", prompt="hi", max_tokens=1)
    assert raw.http_response.status_code == 200
    assert raw.headers["x-flowprefill-slo-class"] == "chat"


def test_sheddable_request_goes_to_the_instance_that_can_serve_it(
    stack: dict[str, Any], pool: InstancePool, client: openai.OpenAI
) -> None:
    pool.policy = Router.ROUND_ROBIN  # alternates: one of two requests prefers the busy one
    load_up(pool, 0)
    before = served(stack)
    for _ in range(2):
        assert batch(client).http_response.status_code == 200
    after = served(stack)
    assert (after[0] - before[0], after[1] - before[1]) == (0, 2)


def test_sheddable_request_is_accepted_when_an_instance_has_room(
    stack: dict[str, Any], pool: InstancePool, client: openai.OpenAI
) -> None:
    raw = batch(client)
    assert raw.http_response.status_code == 200
    assert raw.parse().choices[0].text is not None


def test_prefill_instances_report_their_backlog(stack: dict[str, Any]) -> None:
    url = stack["prefill_urls"][0]
    load = PrefillLoad.model_validate(httpx.get(f"{url}{LOAD_PATH}").json())
    assert load == PrefillLoad(backlog_tokens=0, queue_delay_s=0.0, num_requests=0)
    answer = httpx.post(
        f"{url}/v1/prefill",
        json={"request_id": "direct-1", "prompt_token_ids": [1, 2, 3], "ttft_slo_s": 5.0},
    ).json()
    assert answer["load"] == {"backlog_tokens": 0, "queue_delay_s": 0.0, "num_requests": 0}
