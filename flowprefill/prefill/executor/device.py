"""Per-task device streams and what "the operator has finished" means on each device.

On CPU every PyTorch op is synchronous: when a checkpoint hook runs, the operator before it
has finished, and parking the thread leaves nothing behind. On CUDA, kernels are queued
asynchronously: the Python thread reaches a checkpoint while the GPU may still be working
through many operators queued earlier. Two consequences (paper §5.1):

- each task issues its work on its own ``torch.cuda.Stream``, so a parked task's queue and
  the urgent task's queue are separate and can be synchronised separately;
- before a task ACKs a preemption, its stream must be drained, so the urgent task does not
  compete with kernels the parked task left queued.

``DeviceSync`` (:mod:`flowprefill.contracts.names`) selects *when* the task's stream is
synchronised:

``every_check`` (the paper's choice, the default)
    Synchronise at every checkpoint. The host never runs more than one operator ahead of
    the device, so the ACK arrives within one operator of the signal, and
    ``TaskControl.progress`` counts operators the device has really finished. Cost: one
    host–device round trip per operator (~10–50 µs on current GPUs) and no host/device
    overlap across a boundary, so kernel-launch latency is exposed once per operator.

``run_ahead``
    Let the host run ``run_ahead`` operators (default 1) ahead of the device: each
    checkpoint records an event on the task's stream and waits for the event recorded
    ``run_ahead`` checkpoints earlier. The host queues the next operator while the device
    still runs the previous one, so launch latency overlaps device work instead of adding
    to it; when parking, the stream is drained (as in every mode) before the ACK, so the
    ACK arrives within ``run_ahead + 1`` operators of the signal and no kernel is left
    queued. ``TaskControl.progress`` counts checkpoints the host passed; the device has
    finished all but the last ``run_ahead`` operators. Measured on an H100 (docs/gpu.md):
    a 512-token prefill at operator level took 37 % longer than without checkpoints with
    ``every_check`` and 23 % with ``run_ahead`` 1; from 8K tokens up both cost ~1 % or less.

``on_preempt``
    Synchronise only when parking (via ``TaskControl.device_sync``, before the ACK). The
    hot path stays free of syncs and the host can queue far ahead, but at a signal the
    device may still hold many queued operators — up to the rest of the forward pass — and
    draining them is blocking time the urgent request pays. Pick this only when operator
    times are long compared with the sync cost and blocking time matters less.

:class:`DeviceStreams` is what the executor needs of a device type: :class:`CpuStreams` (no
streams, nothing to wait for) or :class:`CudaStreams`. The CUDA path is tested on CPU
through a fake (tests/prefill/executor/test_device.py) and on an H100 by
``benchmarks/gpu_validate.py`` (docs/gpu.md).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

import torch

from flowprefill.contracts.names import DeviceSync
from flowprefill.prefill.executor.context import checkpoint, thread_context


def check_sync_mode(mode: str | DeviceSync) -> DeviceSync:
    """``mode`` parsed by :meth:`DeviceSync.parse` (every_check, run_ahead or on_preempt)."""
    return DeviceSync.parse(mode)


class DeviceStreams(Protocol):
    """Per-task streams of one device type, and waiting for them."""

    #: False when device work is synchronous (CPU): no stream, no syncs needed.
    asynchronous: bool

    def prepare(self) -> None:
        """Make work issued so far (e.g. weight uploads) visible to task streams."""

    def new_stream(self) -> object | None:
        """A fresh stream for one task (None where streams do not exist)."""

    def stream_context(self, stream: object | None) -> AbstractContextManager[object]:
        """Make ``stream`` current on this thread for the duration of the block."""

    def synchronize(self, stream: object | None) -> None:
        """Block the calling thread until ``stream`` has finished all queued work."""

    def record(self, stream: object | None) -> object:
        """A marker of the work queued on ``stream`` so far (a CUDA event)."""

    def wait(self, marker: object) -> None:
        """Block the calling thread until the work before ``marker`` has finished."""


class CpuStreams:
    """CPU ops are synchronous: no streams, nothing to wait for."""

    asynchronous = False

    def prepare(self) -> None:
        pass

    def new_stream(self) -> object | None:
        return None

    def stream_context(self, stream: object | None) -> AbstractContextManager[object]:
        return nullcontext()

    def synchronize(self, stream: object | None) -> None:
        pass

    def record(self, stream: object | None) -> object:
        return None

    def wait(self, marker: object) -> None:
        pass


class CudaStreams:
    """CUDA streams. Constructing it touches no CUDA state (it can be built on CPU hosts)."""

    asynchronous = True

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def prepare(self) -> None:
        # Weights were uploaded on the default stream; task streams must not read them
        # before the copies land.
        torch.cuda.synchronize(self.device)

    def new_stream(self) -> object | None:
        return torch.cuda.Stream(device=self.device)

    def stream_context(self, stream: object | None) -> AbstractContextManager[object]:
        if stream is None:
            return nullcontext()
        assert isinstance(stream, torch.cuda.Stream)
        return torch.cuda.stream(stream)

    def synchronize(self, stream: object | None) -> None:
        if stream is None:
            torch.cuda.synchronize(self.device)
        else:
            assert isinstance(stream, torch.cuda.Stream)
            stream.synchronize()

    def record(self, stream: object | None) -> object:
        event = torch.cuda.Event()
        if stream is None:
            event.record()
        else:
            assert isinstance(stream, torch.cuda.Stream)
            event.record(stream)
        return event

    def wait(self, marker: object) -> None:
        assert isinstance(marker, torch.cuda.Event)
        marker.synchronize()


def streams_for(device: torch.device) -> DeviceStreams:
    """The streams of ``device``'s type (CPU or CUDA)."""
    if device.type == "cpu":
        return CpuStreams()
    if device.type == "cuda":
        return CudaStreams(device)
    raise ValueError(f"unsupported device type {device.type!r}; expected 'cpu' or 'cuda'")


def check_run_ahead(run_ahead: int) -> int:
    if isinstance(run_ahead, bool) or not isinstance(run_ahead, int) or run_ahead < 1:
        raise ValueError(f"run_ahead must be a positive number of operators, got {run_ahead!r}")
    return run_ahead


def per_check_sync(
    streams: DeviceStreams, stream: object | None, mode: DeviceSync, run_ahead: int = 1
) -> Callable[[], None] | None:
    """What one task's checkpoints wait for before counting, on its own ``stream``: the
    whole stream (``every_check``), the work queued ``run_ahead`` checkpoints ago
    (``run_ahead``), or nothing (``on_preempt``, or a synchronous device)."""
    if not streams.asynchronous or mode == DeviceSync.ON_PREEMPT:
        return None
    if mode == DeviceSync.EVERY_CHECK:
        return lambda: streams.synchronize(stream)
    queued: deque[object] = deque()

    def wait_for_older() -> None:
        queued.append(streams.record(stream))
        if len(queued) > run_ahead:
            streams.wait(queued.popleft())

    return wait_for_older


def synchronizing_checkpoint() -> None:
    """A checkpoint that first waits for the current task's device work
    (:func:`per_check_sync`: ``every_check`` and ``run_ahead`` modes).

    Installed as the hook body instead of :func:`checkpoint` when the device is
    asynchronous and the mode syncs at checkpoints; threads with no task stream skip it.
    """
    sync = thread_context.check_sync
    if sync is not None:
        sync()
    checkpoint()


def boundary_fn(streams: DeviceStreams, mode: DeviceSync) -> Callable[[], None]:
    """What a checkpoint hook calls for these streams and mode."""
    if streams.asynchronous and mode != DeviceSync.ON_PREEMPT:
        return synchronizing_checkpoint
    return checkpoint
