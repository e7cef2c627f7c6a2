"""Cooperative preemption protocol (the paper's Figure 7): signal, ACK, park, resume.

One :class:`TaskControl` belongs to one execution task. The scheduler thread calls
:meth:`TaskControl.request_preempt` — it raises the signal and blocks until the task
acknowledges at its next checkpoint (or finishes first). The task's own thread calls
:func:`~flowprefill.prefill.executor.context.checkpoint` at every preemption boundary; when
the signal is up it clears it, makes sure the device has finished the work issued so far,
acknowledges, and parks until :meth:`TaskControl.resume`. Because the task parks *inside*
its forward pass, every local variable, activation and KV tensor of the task stays exactly
as it was: resuming continues the same Python frame, so the result is bit-identical to an
uninterrupted run.

The hot path — a checkpoint with no signal — is one thread-local read, two attribute reads
(three with decode-aware preemption on and nothing decoding) and one integer increment;
the lock is only taken when a signal is actually up.

Checkpoints find their task in the thread's context
(:data:`~flowprefill.prefill.executor.context.thread_context`, bound by the executor's run
or by :func:`activate`), so hooks installed once on a shared model serve every task thread
without knowing about tasks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from flowprefill.errors import TaskCancelledError

if TYPE_CHECKING:
    from flowprefill.prefill.executor.decode_yield import DecodeYield

SyncFn = Callable[[], None]


class CheckpointGate(Protocol):
    """Replaces the park-at-the-next-checkpoint rule of one task (see TaskControl.gate)."""

    def at_checkpoint(self, control: TaskControl) -> None:
        """Called at every checkpoint after ``num_checkpoints`` was incremented; parks
        with :meth:`TaskControl.park` when the agreed checkpoint is reached."""
        ...


class TaskControl:
    """Preemption state of one task, shared between its thread and the scheduler."""

    __slots__ = (
        "_acked",
        "_checkpoint_s",
        "_cond",
        "_done",
        "_parked",
        "_resume",
        "cancelled",
        "decode_budget",
        "decode_yield",
        "device_sync",
        "gate",
        "handoff_s",
        "held_bytes",
        "name",
        "num_checkpoints",
        "num_checkpoints_expected",
        "preempt_requested",
    )

    def __init__(self, name: str = "task", device_sync: SyncFn | None = None) -> None:
        self.name = name
        self.preempt_requested = False
        self.cancelled = False
        self.num_checkpoints = 0
        self.num_checkpoints_expected = 0
        # Called before ACK so a parked task leaves no queued device work behind
        # (CUDA: synchronise the task's stream). None on CPU, where ops are synchronous.
        self.device_sync = device_sync
        self.decode_yield: DecodeYield | None = None
        """Decode-aware preemption (:mod:`flowprefill.prefill.executor.decode_yield`): park
        for a decode step whose TBT is at risk. None: the policy is off."""
        self.decode_budget: tuple[float, float] | None = None
        """Set by the policy when the task starts: (its earliest deadline, its predicted
        seconds), which a park must leave intact. None: unknown."""
        self.gate: CheckpointGate | None = None
        """Tensor parallelism: decides at which checkpoint this rank parks, so that every
        rank parks at the same one (:mod:`flowprefill.prefill.tp.agreement`). None: park at the
        first checkpoint after the signal."""
        self.held_bytes: Callable[[], int] | None = None
        """Set by the executor on the task's thread: measures the bytes the task holds,
        called by the pool once it has parked (:mod:`flowprefill.prefill.executor.memory`)."""
        self.handoff_s = 0.0
        """Of the last preemption's blocking, the part from the checkpoint that took the
        signal to :meth:`request_preempt` returning: the device drain, the ACK, the GIL
        and the preempting thread's wake-up. The rest is the remainder of the operator the
        signal landed in. 0 when the task finished instead of parking."""
        self._checkpoint_s = 0.0
        self._cond = threading.Condition()
        self._acked = False
        self._parked = False
        self._done = False
        self._resume = threading.Event()

    # --------------------------------------------------------------- task side

    def check(self) -> None:
        """One preemption checkpoint, called from the task's own thread."""
        self.num_checkpoints += 1
        decode = self.decode_yield
        # Before the signal check: a preemption raised during the wait is ACKed right after.
        if decode is not None and decode.state.active:
            decode.at_checkpoint(self)
        gate = self.gate
        if gate is not None:
            gate.at_checkpoint(self)
        elif self.preempt_requested or self.cancelled:
            self._park()

    def park(self) -> None:
        """Park now (a gate's decision): device sync, ACK, wait for resume or cancel.
        Raises TaskCancelledError if the task is, or becomes, cancelled."""
        self._park()

    def wait_parked_or_done(self, timeout_s: float | None = None) -> bool:
        """Block until the task is parked or finished; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._parked or self._done, timeout=timeout_s)

    def _park(self) -> None:
        self._checkpoint_s = time.perf_counter()
        if self.cancelled:
            raise TaskCancelledError(f"{self.name} was cancelled")
        if self.device_sync is not None:
            self.device_sync()
        with self._cond:
            self.preempt_requested = False
            self._acked = True
            self._parked = True
            self._resume.clear()
            self._cond.notify_all()
        self._resume.wait()  # resume() (or cancel()) already marked us as not parked
        if self.cancelled:
            raise TaskCancelledError(f"{self.name} was cancelled while preempted")

    def mark_done(self) -> None:
        """Called by the pool when the task's work returned or raised."""
        with self._cond:
            self._done = True
            self.preempt_requested = False
            self._cond.notify_all()

    @property
    def progress(self) -> float:
        """Fraction of expected checkpoints passed (0 when unknown)."""
        if self.num_checkpoints_expected <= 0:
            return 0.0
        return min(1.0, self.num_checkpoints / self.num_checkpoints_expected)

    # ---------------------------------------------------------- scheduler side

    def request_preempt(self, timeout_s: float | None = None) -> tuple[bool, float]:
        """Raise the signal and wait for the ACK.

        Returns ``(parked, blocking_s)``: ``parked`` is False when the task finished before
        reaching another checkpoint (its completion event is then already queued). Sets
        :attr:`handoff_s`, the part of ``blocking_s`` after the checkpoint.
        Raises TimeoutError when neither happens within ``timeout_s``.
        """
        start = time.perf_counter()
        with self._cond:
            if self._done:
                return False, 0.0
            if self._parked:
                raise RuntimeError(f"{self.name} is already preempted")
            self._acked = False
            self.preempt_requested = True
            ok = self._cond.wait_for(lambda: self._acked or self._done, timeout=timeout_s)
            if not ok:
                self.preempt_requested = False
                raise TimeoutError(f"{self.name} did not reach a checkpoint in {timeout_s}s")
            end = time.perf_counter()
            self.handoff_s = end - max(start, self._checkpoint_s) if self._acked else 0.0
            return self._acked, end - start

    def resume(self) -> None:
        with self._cond:
            if self.cancelled or self._done:
                return  # it is unwinding or gone; its completion event is on its way
            if not self._parked:
                raise RuntimeError(f"{self.name} is not parked")
            # Cleared here, not when the task thread wakes: the scheduler may preempt the
            # task again before that thread is scheduled, and that must be a new signal
            # (the task parks at its next checkpoint), not "already preempted".
            self._parked = False
            self._resume.set()

    def cancel(self) -> None:
        """Ask the task to stop at its next checkpoint (or now, if it is parked)."""
        with self._cond:
            self.cancelled = True
            self._parked = False
            self._resume.set()

    @property
    def parked(self) -> bool:
        return self._parked

    @property
    def done(self) -> bool:
        return self._done
