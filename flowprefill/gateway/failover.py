"""The one retry rule of the gateway, for prefill and decode alike.

An attempt runs on the instance the pool picks and is booked there while it runs (the
routing policies read that book). A failure with a 5xx status takes the instance out of
rotation for its back-off; a success clears its record. Only a *refused connection*
(:attr:`~flowprefill.gateway.errors.UpstreamError.retryable`: the instance never saw the
request) is tried once more, on another pick: anything later might already have been
processed, and a second try could duplicate work or output. The KV hand-off does not
pin decode to an instance — it lives in shared storage or at the prefill instance, and a
decode that cannot read it recomputes.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import TypeVar

from flowprefill.gateway.errors import UpstreamError
from flowprefill.gateway.routing import Instance, InstancePool

T = TypeVar("T")

MAX_ATTEMPTS = 2


@dataclass(frozen=True, slots=True)
class Placement:
    """What a pool needs to pick an instance for a request and book it there."""

    request_id: str
    deadline_s: float
    num_tokens: int


async def failover(
    pool: InstancePool, work: Placement, attempt: Callable[[Instance], AsyncGenerator[T, None]]
) -> AsyncGenerator[T, None]:
    """Yield what ``attempt(instance)`` yields, on the instance ``pool`` picks; after a
    refused connection, on a second pick. Raises the last
    :class:`~flowprefill.gateway.errors.UpstreamError`, or
    :class:`~flowprefill.gateway.errors.NoHealthyInstanceError` when nothing is left to
    pick."""
    for n in range(1, MAX_ATTEMPTS + 1):
        inst = pool.pick(deadline_s=work.deadline_s, num_tokens=work.num_tokens)
        pool.begin(inst, work.request_id, work.deadline_s, work.num_tokens)
        try:
            async with aclosing(attempt(inst)) as items:
                async for item in items:
                    yield item
            pool.mark_success(inst)
            return
        except UpstreamError as e:
            if e.status >= 500:
                pool.mark_failure(inst)
            if not (e.retryable and n < MAX_ATTEMPTS):
                raise
        finally:
            pool.end(inst, work.request_id)


async def failover_call(
    pool: InstancePool, work: Placement, call: Callable[[Instance], Awaitable[T]]
) -> T:
    """:func:`failover` for an attempt with one result."""

    async def once(inst: Instance) -> AsyncGenerator[T, None]:
        yield await call(inst)

    results = [r async for r in failover(pool, work, once)]
    return results[-1]
