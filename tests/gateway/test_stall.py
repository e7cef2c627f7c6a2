"""``StallFlag``: an asyncio Event whose listeners (each upstream call in flight) are
called back, in the loop, when it is set — and never once removed."""

from __future__ import annotations

import asyncio

from flowprefill.gateway.stall import StallFlag


async def test_listeners_are_called_back_when_the_flag_is_set() -> None:
    flag = StallFlag()
    calls: list[str] = []
    flag.add_listener(lambda: calls.append("a"))
    removed = lambda: calls.append("removed")  # noqa: E731
    flag.add_listener(removed)
    flag.remove_listener(removed)
    flag.set()
    assert calls == []  # soon, not inside set()
    await asyncio.sleep(0)
    assert calls == ["a"] and flag.is_set()
    flag.set()  # once: a listener is called back for one stall
    await asyncio.sleep(0)
    assert calls == ["a"]


async def test_a_listener_added_to_a_set_flag_is_called_back_at_once() -> None:
    flag = StallFlag()
    flag.set()
    calls: list[int] = []
    flag.add_listener(lambda: calls.append(1))
    await asyncio.sleep(0)
    assert calls == [1]
    flag.clear()
    flag.add_listener(lambda: calls.append(2))
    await asyncio.sleep(0)
    assert calls == [1]
    assert await asyncio.wait_for(_waiter(flag), 1) is True


async def _waiter(flag: StallFlag) -> bool:
    asyncio.get_running_loop().call_soon(flag.set)
    return await flag.wait()  # still an Event
