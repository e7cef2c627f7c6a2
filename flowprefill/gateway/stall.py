"""An upstream instance's stalled flag (set and cleared by the health prober)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class StallFlag(asyncio.Event):
    """An instance's stalled flag: an :class:`asyncio.Event` that also calls back, so that
    each upstream call in flight learns of a stall without a task of its own waiting on
    the event (:func:`until_stalled`)."""

    def __init__(self) -> None:
        super().__init__()
        self._listeners: dict[Callable[[], None], asyncio.AbstractEventLoop] = {}

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` soon (in the running loop, as a callback) when the flag is set;
        at once (soon) if it is set already."""
        loop = asyncio.get_running_loop()
        if self.is_set():
            loop.call_soon(callback)
        else:
            self._listeners[callback] = loop

    def remove_listener(self, callback: Callable[[], None]) -> None:
        self._listeners.pop(callback, None)

    def set(self) -> None:
        super().set()
        listeners, self._listeners = self._listeners, {}
        for callback, loop in listeners.items():
            loop.call_soon(callback)
