"""One value per thread, with a default, set for the length of a ``with`` block.

The executor publishes what a forward pass on a thread needs — the task's control, the
packed segments, whether fast kernels are on, the per-checkpoint sync — in such slots:
code the model calls (checkpoint hooks, the attention function, the linears) reads its
slot without being passed anything, and every other thread sees the default. Blocks
nest: leaving one restores the value the thread had before it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

T = TypeVar("T")


class ThreadSlot(Generic[T]):
    __slots__ = ("_default", "_local")

    def __init__(self, default: T) -> None:
        self._local = threading.local()
        self._default = default

    def get(self) -> T:
        """This thread's value (the default outside every :meth:`bound` block)."""
        return getattr(self._local, "value", self._default)

    @contextmanager
    def bound(self, value: T) -> Iterator[None]:
        """Make ``value`` this thread's for the block."""
        previous = self.get()
        self._local.value = value
        try:
            yield
        finally:
            self._local.value = previous
