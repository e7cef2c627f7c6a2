"""Colocated pairing: a prefill instance that names its pod's own decode (``decode_url``)
gets the request's decode there; a failure there falls back to the pool's pick.

Real servers, in threads: prefill instances on the tiny model (``create_app(...,
decode_url=...)``, as ``serve-prefill --colocated-decode-url`` runs them), the gateway, and
stand-in decode servers that answer their own name, so the client's text says where its
decode ran. Without pairing, decode's least-loaded routing rotates ties across the
instances, so requests sent one at a time land on every decode instance.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from flowprefill.contracts import Endpoint, GatewayConfig
from flowprefill.contracts.prefill_api import PrefillResponse
from flowprefill.gateway.app import GatewayState, create_gateway_app
from flowprefill.gateway.cli import build_state
from flowprefill.gateway.routing import Admitted, Instance, InstancePool, Placement, failover
from flowprefill.models import load_model, named_model_dir
from flowprefill.prefill.engine import PrefillEngine
from flowprefill.prefill.executor.runner import PreemptibleExecutor
from flowprefill.prefill.predictor.model import TTFTPredictor
from flowprefill.prefill.server.cli import add_arguments
from flowprefill.prefill.server.prefill import create_app
from tests.gateway.test_failover import TABLE
from tests.helpers import free_port, serve_in_thread

BODY = {"model": "tiny", "prompt": list(range(1, 41)), "max_tokens": 4, "ignore_eos": True}
"""More than one token, so decode gets the request; ``ignore_eos``: a random model's
end-of-sequence first token would end the answer before decode."""


def decode_stub(name: str, seen: list[str]) -> FastAPI:
    """A decode instance that streams `` <name>`` and records each request's id."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        seen.append(request.headers["x-request-id"])

        async def events() -> AsyncIterator[str]:
            chunk = {"choices": [{"index": 0, "text": f" {name}", "finish_reason": "length"}]}
            yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return named_model_dir("tiny-llama", cache_dir=tmp_path_factory.mktemp("pairing"))


class Stack:
    def __init__(self, es: ExitStack, model_dir: Path, tmp: Path) -> None:
        self.es, self.model_dir, self.tmp = es, model_dir, tmp
        self.seen: dict[str, list[str]] = {}
        self.engines: dict[str, PrefillEngine] = {}

    def decode(self, name: str) -> str:
        self.seen[name] = []
        return self.es.enter_context(serve_in_thread(decode_stub(name, self.seen[name])))

    def prefill(self, name: str, decode_url: str | None) -> str:
        executor = self.es.enter_context(PreemptibleExecutor(load_model(self.model_dir)))
        engine = PrefillEngine(executor, TTFTPredictor.linear(1e-5))
        self.engines[name] = engine
        return self.es.enter_context(serve_in_thread(create_app(engine, decode_url=decode_url)))

    def gateway(self, prefill: list[str], decode: list[str]) -> tuple[str, GatewayState]:
        (self.tmp / "slo.json").write_text(json.dumps(TABLE))
        config = GatewayConfig(
            service="t",
            model_name="tiny",
            tokenizer_path=str(self.model_dir),
            prefill=[Endpoint(pool="p", host="h", port=1, url=u) for u in prefill],
            decode=[Endpoint(pool="d", host="h", port=1, url=u) for u in decode],
            prefill_routing="round-robin",
        )
        state = build_state(config, self.tmp / "slo.json")
        return self.es.enter_context(serve_in_thread(create_gateway_app(state))), state


@pytest.fixture
def stack(model_dir: Path, tmp_path: Path) -> Iterator[Stack]:
    with ExitStack() as es:
        yield Stack(es, model_dir, tmp_path)


def complete(gw: str) -> str:
    r = httpx.post(f"{gw}/v1/completions", json=BODY, timeout=60)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def _count(engine: PrefillEngine) -> float:
    """Requests ``engine`` has answered (its TTFT histogram's count)."""
    for metric in engine.metrics.ttft.collect():
        for sample in metric.samples:
            if sample.name.endswith("_count"):
                return sample.value
    return 0.0


def test_each_request_decodes_in_the_pod_that_prefilled_it(stack: Stack) -> None:
    """Two colocated "pods" (prefill A beside decode A, B beside B): whichever prefill
    instance answered, decode ran beside it — every time."""
    dec_a, dec_b = stack.decode("A"), stack.decode("B")
    pre_a, pre_b = stack.prefill("A", dec_a), stack.prefill("B", dec_b)
    gw, state = stack.gateway([pre_a, pre_b], [dec_a, dec_b])
    for _ in range(6):
        before = {n: _count(e) for n, e in stack.engines.items()}
        text = complete(gw)
        (prefilled,) = [n for n, e in stack.engines.items() if _count(e) > before[n]]
        assert text.endswith(f" {prefilled}"), (text, prefilled)
    # Round-robin prefill routing: both pods served, each decoded its own.
    assert len(stack.seen["A"]) == len(stack.seen["B"]) == 3
    assert all(not i.in_flight for i in state.decode_pool.instances)  # type: ignore[union-attr]


def test_without_a_decode_url_decode_is_routed_as_before(stack: Stack) -> None:
    """The field absent (a plain prefill instance): least-loaded ties rotate, so decode
    lands on both instances — the control for the test above."""
    dec_a, dec_b = stack.decode("A"), stack.decode("B")
    gw, _ = stack.gateway([stack.prefill("P", None)], [dec_a, dec_b])
    texts = [complete(gw) for _ in range(4)]
    assert {t.rsplit(" ", 1)[-1] for t in texts} == {"A", "B"}


def test_a_pod_whose_decode_is_down_falls_back_to_the_pools_pick(stack: Stack) -> None:
    """The named decode refuses connections: the attempt is retried where the pool picks
    (the retry rule), and the dead one sits out its back-off, so the next request goes
    straight to the pool's pick."""
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    alive = stack.decode("B")
    gw, state = stack.gateway([stack.prefill("A", dead)], [dead, alive])
    assert complete(gw).endswith(" B")
    pool = state.decode_pool
    assert pool is not None
    down = next(i for i in pool.instances if i.url == dead)
    assert not down.healthy and down.consecutive_failures == 1
    assert complete(gw).endswith(" B")
    assert down.consecutive_failures == 1  # in its back-off: not tried again
    assert len(stack.seen["B"]) == 2


def test_a_pod_behind_its_pools_service_is_paired_by_host(stack: Stack) -> None:
    """As the operator lists a colocated pool: one Service name for prefill (8100) and
    decode (8200), while the pod names its own IP. Here the "Service" is ``localhost`` and
    the "pod IP" 127.0.0.1: the decode goes to the pod's address, booked under the Service;
    the pod's failure leaves the Service (the pool's other pods) in rotation."""
    colo = stack.decode("colo")
    port = int(colo.rsplit(":", 1)[1])
    other = stack.decode("other")
    pre = stack.prefill("colo", f"http://127.0.0.1:{port}")
    service_prefill = pre.replace("127.0.0.1", "localhost")
    service_decode = f"http://localhost:{port}"
    gw, state = stack.gateway([service_prefill], [service_decode, other])
    for _ in range(4):
        assert complete(gw).endswith(" colo")
    assert stack.seen["other"] == []
    pool = state.decode_pool
    assert pool is not None and [i.url for i in pool.instances] == [service_decode, other]
    pod = pool.paired(f"http://127.0.0.1:{port}", near=service_prefill)
    assert pod is not None and pod not in pool.instances
    assert pod.in_flight is pool.instances[0].in_flight  # the Service's book


async def _drain(pool: InstancePool, work: Placement, admitted: Admitted | None) -> list[str]:
    async def attempt(inst: Instance) -> AsyncGenerator[str, None]:
        # Booked in the listed instance's book while the attempt runs.
        assert work.request_id in pool.instances[0].in_flight
        yield inst.url

    return [u async for u in failover(pool, work, attempt, admitted)]


async def test_a_paired_pods_attempt_is_booked_under_its_listed_instance() -> None:
    pool = InstancePool("decode", ["http://svc.ns:8200", "http://other.ns:8200"])
    pod = pool.paired("http://10.0.0.7:8200/", near="http://svc.ns:8100")
    assert pod is not None and pod.url == "http://10.0.0.7:8200"
    assert pool.paired("http://10.0.0.7:8200", near="http://svc.ns:8100") is pod  # kept
    work = Placement("r1", math.inf, 10)
    assert await _drain(pool, work, Admitted("r1", pod)) == ["http://10.0.0.7:8200"]
    assert not pool.instances[0].in_flight  # ended
    # Its own back-off: a failed pod is skipped, the listed instance stays in rotation.
    pool.mark_failure(pod)
    assert not pool.available(pod) and pool.available(pool.instances[0])


def test_paired_refuses_what_the_gateway_does_not_list() -> None:
    pool = InstancePool("decode", ["http://a:8200", "http://b:8200", "http://b:8201"])
    assert pool.paired("http://a:8200", near="http://x:8100") is pool.instances[0]  # listed
    # Not listed, and its prefill's host serves no listed decode, or more than one.
    assert pool.paired("http://10.0.0.1:8200", near="http://x:8100") is None
    assert pool.paired("http://10.0.0.1:8200", near="http://b:8100") is None


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("10.0.0.1:8200", "expected http(s)://host:port"),
        ("ftp://h:1", "expected http(s)://host:port"),
        ("http://h", "expected http(s)://host:port"),
        ("http://h:99999", "bad port"),
        ("http://h:8200/v1", "nothing after the port"),
    ],
)
def test_bad_decode_urls_are_refused_naming_the_url(url: str, message: str) -> None:
    base = {"request_id": "r", "first_token_id": 1, "num_prompt_tokens": 1, "ttft_s": 0.1,
            "met_slo": True, "num_preemptions": 0, "batch_size": 1}  # fmt: skip
    with pytest.raises(ValidationError, match=re.escape(message)):
        PrefillResponse.model_validate(base | {"decode_url": url})
    assert PrefillResponse.model_validate(base | {"decode_url": "http://h:8200/"}).decode_url == (
        "http://h:8200"
    )
    assert PrefillResponse.model_validate(base).decode_url is None  # absent: as before
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--colocated-decode-url", url])
