"""The hooks' per-thread state: bound for a block, restored after it, invisible to other
threads."""

from __future__ import annotations

import threading

import pytest

from flowprefill.prefill.executor.context import ThreadContext, activate, checkpoint, thread_context
from flowprefill.prefill.executor.packing import Segment
from flowprefill.prefill.executor.preemption import TaskControl


def _seen_from_another_thread() -> tuple[object, ...]:
    seen: list[tuple[object, ...]] = []

    def read() -> None:
        c = thread_context
        seen.append((c.control, c.check_sync, c.segments, c.packer, c.fast_kernels))

    thread = threading.Thread(target=read)
    thread.start()
    thread.join()
    return seen[0]


def test_bindings_nest_restore_and_stay_on_their_thread() -> None:
    defaults = (None, None, None, None, False)
    outer, inner = TaskControl("outer"), TaskControl("inner")
    segments = [Segment(0, 4, 0, 4)]

    def sync() -> None:
        pass

    with thread_context.task(outer, sync):
        with thread_context.forward(segments, fast_kernels=True):
            with activate(inner):
                checkpoint()
                assert thread_context.control is inner
                assert thread_context.check_sync is None
                assert _seen_from_another_thread() == defaults
            assert (thread_context.control, thread_context.check_sync) == (outer, sync)
            assert thread_context.segments is segments and thread_context.fast_kernels
        checkpoint()
        assert thread_context.segments is None and not thread_context.fast_kernels
    assert (inner.num_checkpoints, outer.num_checkpoints) == (1, 1)
    context = thread_context
    assert (context.control, context.check_sync, context.segments) == (None, None, None)
    assert (context.packer, context.fast_kernels) == (None, False)


def test_a_failing_block_restores_the_fields() -> None:
    context = ThreadContext()
    control = TaskControl()
    with pytest.raises(KeyError), context.task(control):
        raise KeyError("boom")
    assert context.control is None
