"""The one retry rule of the gateway, for prefill and decode alike.

An attempt runs on the instance the pool picks and is booked there while it runs (the
routing policies read that book). A failure with a 5xx status takes the instance out of
rotation for its back-off; a success clears its record. An attempt is tried once more,
on another pick, when that cannot duplicate anything the client sees:

* a *refused connection* (:attr:`~flowprefill.gateway.errors.UpstreamError.retryable`:
  the instance never saw the request);
* an instance that died or stalled before the attempt received anything from it
  (:attr:`~flowprefill.gateway.errors.UpstreamError.connection_lost`): a prefill has no side
  effect but compute, and a decode that produced nothing yet has streamed nothing.

An attempt that had received something ends with its error: its output reached the
client. Attempts on an instance the health prober declares stalled
(:mod:`flowprefill.gateway.health`) are abandoned at once, under the same rule. The KV
hand-off does not pin decode to an instance — it lives in shared storage or at the
prefill instance, and a decode that cannot read it recomputes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
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
    failure that is safe to retry (see above), on a second pick. Raises the last
    :class:`~flowprefill.gateway.errors.UpstreamError`, or
    :class:`~flowprefill.gateway.errors.NoHealthyInstanceError` when nothing is left to
    pick."""
    for n in range(1, MAX_ATTEMPTS + 1):
        inst = pool.pick(deadline_s=work.deadline_s, num_tokens=work.num_tokens)
        pool.begin(inst, work.request_id, work.deadline_s, work.num_tokens)
        received = False
        try:
            async with (
                aclosing(attempt(inst)) as items,
                aclosing(until_stalled(items, inst, pool.role)) as guarded,
            ):
                async for item in guarded:
                    received = True
                    yield item
            pool.mark_success(inst)
            return
        except UpstreamError as e:
            if e.status >= 500:
                pool.mark_failure(inst)
            again = e.retryable or (e.connection_lost and not received)
            if not (again and n < MAX_ATTEMPTS):
                raise
        finally:
            pool.end(inst, work.request_id)


async def until_stalled(
    items: AsyncIterator[T], inst: Instance, role: str
) -> AsyncGenerator[T, None]:
    """``items``, until ``inst`` is declared stalled: then the pending step is cancelled
    (which closes its upstream connection) and an unanswered :class:`UpstreamError` is
    raised instead.

    The steps run in the caller's task — upstream clients keep per-task state across a
    stream — so the abandonment is a cancellation of this task, sent only while it waits
    inside a step (``waiting``) and taken back (``uncancel``) when it arrives. A stall
    noticed while the consumer handles an item is acted on before the next step."""
    task = asyncio.current_task()
    assert task is not None, "until_stalled runs inside a task"
    waiting = abandoned = False

    def on_stall(_: object) -> None:
        nonlocal abandoned
        if waiting and not abandoned:
            abandoned = True
            task.cancel(f"{role} instance {inst.url} stalled")

    watcher = asyncio.ensure_future(inst.stall.wait())
    watcher.add_done_callback(on_stall)
    try:
        while True:
            if inst.stall.is_set():
                raise _stalled(inst, role)
            waiting = True
            try:
                item = await anext(items)
            except StopAsyncIteration:
                if abandoned:  # it swallowed the cancellation and finished anyway
                    task.uncancel()
                return
            except (asyncio.CancelledError, UpstreamError):
                # Ours alone (not the client's too): the attempt is abandoned, not failed.
                if abandoned and task.uncancel() == 0:
                    raise _stalled(inst, role) from None
                raise
            finally:
                waiting = False
            if abandoned:  # the step finished anyway; the cancellation is not ours to keep
                task.uncancel()
                raise _stalled(inst, role)
            yield item
    finally:
        watcher.remove_done_callback(on_stall)
        watcher.cancel()


def _stalled(inst: Instance, role: str) -> UpstreamError:
    return UpstreamError(
        503,
        f"{role} instance {inst.url} stopped answering (health probes failed); abandoned",
        f"{role}_stalled",
        connection_lost=True,
    )


async def failover_call(
    pool: InstancePool, work: Placement, call: Callable[[Instance], Awaitable[T]]
) -> T:
    """:func:`failover` for an attempt with one result."""

    async def once(inst: Instance) -> AsyncGenerator[T, None]:
        yield await call(inst)

    results = [r async for r in failover(pool, work, once)]
    return results[-1]
