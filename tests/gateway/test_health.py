"""Stalled instances: found by the health prober, their attempts abandoned and retried."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import httpx
import pytest

from flowprefill.contracts.gateway import HealthProbeSettings
from flowprefill.gateway.errors import UpstreamError
from flowprefill.gateway.health import HealthProber
from flowprefill.gateway.routing import Instance, InstancePool, Placement, failover

SETTINGS = HealthProbeSettings(interval_s=0.01, timeout_s=0.01, failures=2)


def _client(behaviour: dict[str, str]) -> httpx.AsyncClient:
    """Each host answers, times out, or refuses, as ``behaviour`` says."""

    def handler(request: httpx.Request) -> httpx.Response:
        what = behaviour[request.url.host]
        if what == "timeout":
            raise httpx.ReadTimeout("no answer", request=request)
        if what == "refused":
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(404 if what == "404" else 200)

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


async def test_unanswered_probes_in_a_row_mark_an_instance_stalled_until_it_answers() -> None:
    pool = InstancePool("prefill", ["http://a", "http://b"], policy="round-robin")
    a, b = pool.instances
    behaviour = {"a": "timeout", "b": "ok"}
    prober = HealthProber([pool], SETTINGS)
    async with _client(behaviour) as client:
        await prober.probe_all(client)
        assert not a.stall.is_set()  # one failed probe is not a stall
        await prober.probe_all(client)
        assert a.stall.is_set() and not b.stall.is_set()
        assert pool.healthy() == [b]
        behaviour["a"] = "refused"  # dead now: says nothing about the stall, keeps it
        await prober.probe_all(client)
        assert a.stall.is_set()
        behaviour["a"] = "404"  # any answer: the process serves again
        await prober.probe_all(client)
        assert not a.stall.is_set() and pool.healthy() == [a, b]
        behaviour["a"] = "timeout"  # the count starts over after an answer
        await prober.probe_all(client)
        assert not a.stall.is_set()


async def test_refused_probes_never_mark_a_stall() -> None:
    pool = InstancePool("decode", ["http://a"])
    prober = HealthProber([pool], SETTINGS)
    async with _client({"a": "refused"}) as client:
        for _ in range(5):
            await prober.probe_all(client)
    assert not pool.instances[0].stall.is_set()


class Upstreams:
    """Attempts: instance ``a`` sends ``before_hang`` items then never another; ``b``
    streams three items. Records which attempts were closed."""

    def __init__(self, before_hang: int) -> None:
        self.before_hang = before_hang
        self.closed: list[str] = []

    async def attempt(self, inst: Instance) -> AsyncGenerator[str, None]:
        name = inst.url.removeprefix("http://")
        try:
            if name == "a":
                for i in range(self.before_hang):
                    yield f"a{i}"
                await asyncio.Event().wait()
            for i in range(3):
                await asyncio.sleep(0)
                yield f"{name}{i}"
        finally:
            self.closed.append(name)


async def _run(pool: InstancePool, upstreams: Upstreams) -> list[str]:
    got: list[str] = []
    async for item in failover(pool, Placement("r1", 10.0, 5), upstreams.attempt):
        got.append(item)
    return got


async def _stall_later(inst: Instance) -> None:
    await asyncio.sleep(0.05)
    inst.stall.set()


async def test_an_attempt_that_received_nothing_is_retried_on_another_instance() -> None:
    pool = InstancePool("prefill", ["http://a", "http://b"], policy="round-robin")
    upstreams = Upstreams(before_hang=0)
    stall = asyncio.create_task(_stall_later(pool.instances[0]))
    assert await asyncio.wait_for(_run(pool, upstreams), 10) == ["b0", "b1", "b2"]
    await stall
    assert upstreams.closed == ["a", "b"]  # the abandoned attempt's connection was closed
    assert pool.instances[0].in_flight == {} and pool.instances[0].consecutive_failures == 1


async def test_an_attempt_that_had_received_something_ends_with_a_clear_error() -> None:
    pool = InstancePool("decode", ["http://a", "http://b"], policy="round-robin")
    upstreams = Upstreams(before_hang=2)
    got: list[str] = []

    async def run() -> None:
        async for item in failover(pool, Placement("r1", 10.0, 5), upstreams.attempt):
            got.append(item)

    stall = asyncio.create_task(_stall_later(pool.instances[0]))
    with pytest.raises(UpstreamError, match="decode instance http://a stopped answering") as e:
        await asyncio.wait_for(run(), 10)
    await stall
    assert got == ["a0", "a1"] and e.value.reason == "decode_stalled"
    assert upstreams.closed == ["a"]


async def test_a_client_that_leaves_while_the_instance_stalls_is_still_cancelled() -> None:
    pool = InstancePool("prefill", ["http://a", "http://b"], policy="round-robin")
    upstreams = Upstreams(before_hang=0)
    task = asyncio.create_task(_run(pool, upstreams))
    await asyncio.sleep(0.02)
    task.cancel()  # the client left...
    pool.instances[0].stall.set()  # ...and the prober declares the stall at the same time
    with pytest.raises(asyncio.CancelledError):
        await task
    assert upstreams.closed == ["a"]  # no retry for a client that is gone


async def test_a_dead_instance_that_answers_again_is_back_without_waiting_its_backoff() -> None:
    """Restarted: its refusals had doubled the back-off; the first answered probe ends it.
    An instance whose failures were answers (5xx) keeps its back-off: it never refused."""
    clock = [100.0]
    pool = InstancePool("decode", ["http://a", "http://b"], clock=lambda: clock[0])
    a, b = pool.instances
    for _ in range(5):
        pool.mark_failure(a)  # requests refused while it was down: 16 s back-off
        pool.mark_failure(b)  # answered 5xx
    behaviour = {"a": "refused", "b": "ok"}
    prober = HealthProber([pool], SETTINGS)
    async with _client(behaviour) as client:
        await prober.probe_all(client)
        assert pool.healthy() == []
        behaviour["a"] = "ok"
        await prober.probe_all(client)
    assert pool.healthy() == [a] and a.consecutive_failures == 0
    assert b.consecutive_failures == 5


async def test_an_instance_whose_streams_deliver_is_busy_not_stalled() -> None:
    """A decode short of CPU answers its probes too late but still streams: its streams
    must go on. Once nothing is delivered, the same unanswered probes mark the stall."""
    pool = InstancePool("decode", ["http://a"])
    a = pool.instances[0]

    async def slow_probe(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(0.02)
        raise httpx.ReadTimeout("no answer", request=request)

    async def attempt(inst: Instance) -> AsyncGenerator[int, None]:
        for i in range(40):
            await asyncio.sleep(0.005)
            yield i

    async def stream() -> list[int]:
        return [i async for i in failover(pool, Placement("r1", 10.0, 5), attempt)]

    prober = HealthProber([pool], SETTINGS)
    async with httpx.AsyncClient(transport=httpx.MockTransport(slow_probe)) as client:
        streaming = asyncio.create_task(stream())
        for _ in range(4):
            await prober.probe_all(client)
            assert not a.stall.is_set()
        assert await asyncio.wait_for(streaming, 10) == list(range(40))
        for _ in range(2):
            await prober.probe_all(client)
    assert a.stall.is_set()
