"""What code the model calls reads about the task and forward pass on the calling thread.

The executor installs its hooks once on a shared model (checkpoint hooks, the packed
attention function, the fast and split linears); several task threads run that model, all
but one parked. Those hooks are called by the model with the model's own arguments only,
so they find the state of *their* task in :data:`thread_context`: one thread-local object
whose fields every thread sees at their class defaults until the executor binds them.

Two scopes, each bound for a ``with`` block and restored when it ends (blocks nest):

- :meth:`ThreadContext.task`, for the whole of a task's run: its control and the
  per-checkpoint device sync;
- :meth:`ThreadContext.forward`, for one forward pass (one chunk): the attention segments,
  the operator-splitting packer and whether fast kernels are on.

The hooks read fields directly (one thread-local attribute read each): the checkpoint with
no signal up is the hot path of every operator.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flowprefill.prefill.executor.packer import Packer
    from flowprefill.prefill.executor.packing import Segment
    from flowprefill.prefill.executor.preemption import TaskControl


class ThreadContext(threading.local):
    """Per-thread fields; the class attributes are the defaults every thread starts with
    (no task, no sync, no segments: plain sdpa, no splitting, the model's own linears)."""

    control: TaskControl | None = None
    """The task that checkpoints count and park (:mod:`.preemption`)."""
    check_sync: Callable[[], None] | None = None
    """Waits for the task's device work before each checkpoint (``every_check`` and
    ``run_ahead`` on an asynchronous device:
    :func:`~flowprefill.prefill.executor.device.per_check_sync`)."""
    segments: Sequence[Segment] | None = None
    """Which query rows attend to which keys in this forward's packed row
    (:func:`~flowprefill.prefill.executor.attention.packed_attention`)."""
    packer: Packer | None = None
    """Splits operators predicted over the bound (:mod:`.splitting`)."""
    fast_kernels: bool = False
    """Installed fast linears use their packed weights (:mod:`.kernels`)."""

    @contextmanager
    def task(
        self, control: TaskControl | None, check_sync: Callable[[], None] | None = None
    ) -> Iterator[None]:
        """Make ``control`` (and ``check_sync``) this thread's for the block."""
        previous = self.control, self.check_sync
        self.control, self.check_sync = control, check_sync
        try:
            yield
        finally:
            self.control, self.check_sync = previous

    @contextmanager
    def forward(
        self,
        segments: Sequence[Segment] | None = None,
        packer: Packer | None = None,
        fast_kernels: bool = False,
    ) -> Iterator[None]:
        """Make these the state of the forward pass this thread runs in the block."""
        previous = self.segments, self.packer, self.fast_kernels
        self.segments, self.packer, self.fast_kernels = segments, packer, fast_kernels
        try:
            yield
        finally:
            self.segments, self.packer, self.fast_kernels = previous


thread_context = ThreadContext()


def activate(control: TaskControl | None) -> AbstractContextManager[None]:
    """Make ``control`` the target of :func:`checkpoint` calls on this thread (with no
    per-checkpoint sync: the executor's run binds its own)."""
    return thread_context.task(control)


def checkpoint() -> None:
    """A preemption boundary; a no-op when no task is active on this thread."""
    control = thread_context.control
    if control is not None:
        control.check()
