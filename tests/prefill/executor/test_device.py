"""Stream and sync logic of the device layer, exercised on CPU through fake streams.

The fake claims to be asynchronous (like CUDA) and records every call, so the tests see
exactly when a task's stream would be synchronised relative to checkpoints and the ACK.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import pytest
import torch
from transformers import PreTrainedModel

from flowprefill.contracts.names import DeviceSync
from flowprefill.errors import UnknownNameError
from flowprefill.prefill.executor.context import checkpoint
from flowprefill.prefill.executor.device import (
    CpuStreams,
    CudaStreams,
    boundary_fn,
    check_run_ahead,
    check_sync_mode,
    streams_for,
    synchronizing_checkpoint,
)
from flowprefill.prefill.executor.preemption import TaskControl
from flowprefill.prefill.executor.runner import PreemptibleExecutor
from tests.prefill.executor.helpers import StopAt, TaskThread, assert_bit_identical, random_prompts

MakeExecutor = Callable[..., PreemptibleExecutor]


class FakeStream:
    def __init__(self, index: int) -> None:
        self.index = index


class FakeAsyncStreams:
    """Records stream events: ("new", i), ("enter", i), ("exit", i), ("sync", i, n),
    ("record", i, n) and ("wait", i, m, n): n checkpoints passed when the call happened, m
    when the awaited marker was recorded."""

    asynchronous = True

    def __init__(self) -> None:
        self.events: list[tuple[object, ...]] = []
        self.prepared = 0
        self._lock = threading.Lock()
        self._next = 0
        # The control of the running task, to record how many checkpoints it had passed.
        self.controls: dict[int, TaskControl] = {}

    def prepare(self) -> None:
        self.prepared += 1

    def new_stream(self) -> object | None:
        with self._lock:
            self._next += 1
            stream = FakeStream(self._next)
        self.events.append(("new", stream.index))
        return stream

    def stream_context(self, stream: object | None) -> AbstractContextManager[object]:
        assert isinstance(stream, FakeStream)

        @contextmanager
        def context() -> Iterator[object]:
            self.events.append(("enter", stream.index))
            try:
                yield stream
            finally:
                self.events.append(("exit", stream.index))

        return context()

    def synchronize(self, stream: object | None) -> None:
        assert isinstance(stream, FakeStream)
        control = self.controls.get(stream.index)
        passed = control.num_checkpoints if control is not None else -1
        self.events.append(("sync", stream.index, passed))

    def _passed(self, stream: FakeStream) -> int:
        control = self.controls.get(stream.index)
        return control.num_checkpoints if control is not None else -1

    def record(self, stream: object | None) -> object:
        assert isinstance(stream, FakeStream)
        marker = (stream.index, self._passed(stream))
        self.events.append(("record", *marker))
        return marker

    def wait(self, marker: object) -> None:
        assert isinstance(marker, tuple)
        index, recorded_at = marker
        now = self._passed(FakeStream(index))
        self.events.append(("wait", index, recorded_at, now))

    def waits(self, stream_index: int) -> list[tuple[int, int]]:
        """(recorded at, waited at) of each marker waited for on the stream."""
        return [(e[2], e[3]) for e in self.events if e[0] == "wait" and e[1] == stream_index]  # type: ignore[misc]

    def syncs(self, stream_index: int) -> list[int]:
        return [e[2] for e in self.events if e[0] == "sync" and e[1] == stream_index]  # type: ignore[misc]


def test_streams_selection_and_modes() -> None:
    assert isinstance(streams_for(torch.device("cpu")), CpuStreams)
    cuda = streams_for(torch.device("cuda", 1))  # building it touches no CUDA state
    assert isinstance(cuda, CudaStreams)
    assert cuda.device == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="unsupported device type 'meta'"):
        streams_for(torch.device("meta"))
    with pytest.raises(UnknownNameError):
        check_sync_mode("never")
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="run_ahead must be a positive"):
            check_run_ahead(bad)  # type: ignore[arg-type]
    # What the hooks call: a per-check sync only for async devices in every_check mode.
    assert boundary_fn(CpuStreams(), DeviceSync.EVERY_CHECK) is checkpoint
    assert boundary_fn(cuda, DeviceSync.ON_PREEMPT) is checkpoint
    assert boundary_fn(cuda, DeviceSync.EVERY_CHECK) is synchronizing_checkpoint
    assert boundary_fn(cuda, DeviceSync.RUN_AHEAD) is synchronizing_checkpoint
    assert boundary_fn(CpuStreams(), DeviceSync.RUN_AHEAD) is checkpoint


def test_cpu_run_sets_no_device_sync(
    tiny_models: dict[str, PreTrainedModel], make_executor: MakeExecutor
) -> None:
    executor = make_executor(tiny_models["llama"])
    control = TaskControl()
    executor.run(random_prompts([5], executor.vocab_size, seed=20), control)
    assert control.device_sync is None  # CPU ops are synchronous: nothing to drain


def test_every_check_syncs_the_task_stream_at_each_checkpoint(
    tiny_models: dict[str, PreTrainedModel], make_executor: MakeExecutor
) -> None:
    streams = FakeAsyncStreams()
    executor = make_executor(
        tiny_models["qwen2"], granularity="operator", chunk_size=8, streams=streams
    )
    assert streams.prepared == 1
    control = TaskControl()
    streams.controls[1] = control
    prompts = random_prompts([6, 14], executor.vocab_size, seed=21)
    executor.run(prompts, control)
    expected = executor.expected_checkpoints([6, 14])
    # One sync before each checkpoint (chunk boundaries included), one before returning.
    assert streams.syncs(1) == [*range(expected), expected]
    assert streams.events[:2] == [("new", 1), ("enter", 1)]
    assert streams.events[-2:] == [("exit", 1), ("sync", 1, expected)]


def test_on_preempt_syncs_only_when_parking_and_before_the_ack(
    tiny_models: dict[str, PreTrainedModel], make_executor: MakeExecutor
) -> None:
    streams = FakeAsyncStreams()
    executor = make_executor(tiny_models["llama"], sync="on_preempt", streams=streams)
    prompts = random_prompts([12], executor.vocab_size, seed=22)
    solo = executor.prefill(prompts)
    control = StopAt("A", at=[3, 7])
    streams.controls[1] = control
    task = TaskThread(executor, prompts, control).start()
    control.preempt_at(3)
    # The drain ran before request_preempt returned, i.e. before the ACK reached us.
    assert streams.syncs(1) == [3]
    control.resume()
    control.preempt_at(7)
    assert streams.syncs(1) == [3, 7]
    control.resume()
    assert_bit_identical(task.join(), solo)
    assert streams.syncs(1) == [3, 7, executor.expected_checkpoints([12])]


@pytest.mark.parametrize("run_ahead", [1, 3])
def test_run_ahead_waits_for_the_operator_queued_that_many_checkpoints_before(
    tiny_models: dict[str, PreTrainedModel], make_executor: MakeExecutor, run_ahead: int
) -> None:
    streams = FakeAsyncStreams()
    executor = make_executor(
        tiny_models["llama"], sync="run_ahead", run_ahead=run_ahead, streams=streams
    )
    prompts = random_prompts([12], executor.vocab_size, seed=26)
    solo = executor.prefill(prompts)
    expected = executor.expected_checkpoints([12])
    control = StopAt("A", at=[5])
    streams.controls[1] = control
    task = TaskThread(executor, prompts, control).start()
    control.preempt_at(5)
    # With k checkpoints passed, the next one waits for the marker recorded when
    # k - run_ahead had passed: the host never runs more than run_ahead operators ahead.
    # The 5th checkpoint parks, so the last wait before the park was with 4 passed.
    assert streams.waits(1) == [(k - run_ahead, k) for k in range(run_ahead, 5)]
    # Parking drains the whole stream before the ACK: nothing stays queued.
    assert streams.syncs(1) == [5]
    control.resume()
    assert_bit_identical(task.join(), solo)
    assert streams.waits(1) == [(k - run_ahead, k) for k in range(run_ahead, expected)]
    assert streams.syncs(1) == [5, expected]


def test_per_check_sync_is_per_thread(
    tiny_models: dict[str, PreTrainedModel], make_executor: MakeExecutor
) -> None:
    """A parked task's stream is not synced by another task's checkpoints."""
    streams = FakeAsyncStreams()
    executor = make_executor(tiny_models["qwen3-moe"], streams=streams)
    control_a = StopAt("A", at=[2])
    streams.controls[1] = control_a
    a = TaskThread(executor, random_prompts([4], executor.vocab_size, 23), control_a).start()
    control_a.preempt_at(2)
    syncs_a = len(streams.syncs(1))
    control_b = TaskControl("B")
    streams.controls[2] = control_b
    TaskThread(executor, random_prompts([4], executor.vocab_size, 24), control_b).start().join()
    assert len(streams.syncs(1)) == syncs_a
    assert len(streams.syncs(2)) == executor.expected_checkpoints([4]) + 1
    control_a.resume()
    a.join()


def test_prefill_without_run_never_syncs(
    tiny_models: dict[str, PreTrainedModel], make_executor: MakeExecutor
) -> None:
    streams = FakeAsyncStreams()
    executor = make_executor(tiny_models["llama"], streams=streams)
    executor.prefill(random_prompts([4], executor.vocab_size, seed=25))
    assert streams.events == []
