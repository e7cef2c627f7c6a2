"""Execution pool: runs at most one task at a time and keeps preempted tasks suspended.

The pool makes no decisions; it carries out the scheduler's ``submit``, ``preempt`` and
``resume`` commands (paper §4), as :class:`flowprefill.prefill.scheduler.round.Pool` describes.
Each task runs in its own thread so that a preempted task can stay parked inside its
forward pass, keeping every activation and KV tensor, while another task's thread runs.
A parked thread waits on an Event and holds no GIL, and the pool never lets two tasks run
at once: ``preempt`` returns only once the running task has acknowledged (or finished).

What a parked task holds is measured by :meth:`ExecutionPool.held_bytes` (through the probe
the executor leaves on the task's control) and kept until the task resumes or ends;
:attr:`ExecutionPool.parked_bytes` is their sum, the parked-memory gauge.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Generic, TypeVar

from flowprefill.errors import TaskCancelledError, UnknownTaskError
from flowprefill.prefill.executor.context import activate
from flowprefill.prefill.executor.preemption import SyncFn, TaskControl
from flowprefill.prefill.request import Task
from flowprefill.prefill.scheduler.round import PreemptOutcome

if TYPE_CHECKING:
    from flowprefill.prefill.executor.decode_yield import DecodeYield

__all__ = ["ExecutionPool", "PreemptOutcome", "RunFn"]

R = TypeVar("R")

RunFn = Callable[[Task, TaskControl], R]
"""Does a task's work on the calling thread; its checkpoints reach ``TaskControl``."""


class ExecutionPool(Generic[R]):
    """Threads for tasks; one runs, the rest are parked at a checkpoint."""

    def __init__(
        self,
        run_fn: RunFn[R],
        on_done: Callable[[Task, R | None, BaseException | None], None],
        *,
        device_sync: SyncFn | None = None,
        preempt_timeout_s: float | None = 120.0,
    ) -> None:
        self._run_fn = run_fn
        self._on_done = on_done
        self._device_sync = device_sync
        self._preempt_timeout_s = preempt_timeout_s
        self._lock = threading.Lock()
        self._controls: dict[int, TaskControl] = {}
        self._threads: dict[int, threading.Thread] = {}
        self._running: int | None = None
        self._held: dict[int, int] = {}  # task_id -> bytes measured while parked
        self.decode_yield: DecodeYield | None = None
        """Given to every task's control (decode-aware preemption; None: off)."""

    # ----------------------------------------------------------------- commands

    def submit(self, task: Task) -> None:
        with self._lock:
            if self._running is not None and not self._controls[self._running].done:
                raise RuntimeError(f"cannot submit {task!r}: task {self._running} is running")
            control = TaskControl(name=repr(task), device_sync=self._device_sync)
            control.decode_yield = self.decode_yield
            self._controls[task.task_id] = control
            thread = threading.Thread(
                target=self._thread_main,
                args=(task, control),
                name=f"prefill-{task.task_id}",
                daemon=True,
            )
            self._threads[task.task_id] = thread
            self._running = task.task_id
        thread.start()

    def preempt(self, task: Task) -> PreemptOutcome:
        """Signal ``task`` and block until it parks (or finishes); see TaskControl."""
        control = self._control(task)
        parked, blocking_s = control.request_preempt(timeout_s=self._preempt_timeout_s)
        task.progress = control.progress
        with self._lock:
            if self._running == task.task_id:
                self._running = None
        return PreemptOutcome(parked, blocking_s, control.handoff_s)

    def resume(self, task: Task) -> None:
        control = self._control(task)
        with self._lock:
            self._running = task.task_id
            self._held.pop(task.task_id, None)
        if not control.done:
            control.resume()

    def cancel(self, task: Task) -> None:
        """Stop ``task`` at its next checkpoint; its on_done sees TaskCancelledError."""
        self._control(task).cancel()

    def progress(self, task: Task) -> float:
        return self._control(task).progress

    def held_bytes(self, task: Task) -> int | None:
        """Measure what the parked ``task`` holds (None: not parked, or no probe). Called
        from the scheduler thread, which alone resumes tasks, so it stays parked meanwhile."""
        control = self._control(task)
        probe = control.held_bytes
        if probe is None or not control.parked:
            return None
        held = probe()
        with self._lock:
            self._held[task.task_id] = held
        return held

    @property
    def parked_bytes(self) -> int:
        """Bytes the parked tasks hold, as last measured."""
        with self._lock:
            return sum(self._held.values())

    # ---------------------------------------------------------------- internals

    def _control(self, task: Task) -> TaskControl:
        with self._lock:
            control = self._controls.get(task.task_id)
        if control is None:
            raise UnknownTaskError(f"the execution pool holds no task {task!r}")
        return control

    def _thread_main(self, task: Task, control: TaskControl) -> None:
        result: R | None = None
        error: BaseException | None = None
        decode = control.decode_yield
        if decode is not None:
            decode.task_started(control, task)  # steps decode runs from now are not solo
        try:
            with activate(control):
                result = self._run_fn(task, control)
        except TaskCancelledError as e:
            error = e
        except BaseException as e:  # reported to the scheduler, never lost with the thread
            error = e
        finally:
            if decode is not None:
                decode.task_ended()
        with self._lock:
            if self._running == task.task_id:
                self._running = None
            self._held.pop(task.task_id, None)
        if error is None:
            task.progress = 1.0
        # Report before marking done: a racing preempt() that sees "done" can rely on the
        # completion event already being queued. The control stays until release(), so
        # commands issued before the completion event is handled still find the task.
        self._on_done(task, result, error)
        control.mark_done()

    def release(self, task: Task) -> None:
        """Forget a finished task (called when its completion event has been handled)."""
        with self._lock:
            self._controls.pop(task.task_id, None)
            thread = self._threads.pop(task.task_id, None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)

    @property
    def num_tasks(self) -> int:
        with self._lock:
            return len(self._controls)

    def join(self, timeout_s: float | None = None) -> None:
        """Wait for every task thread to end (tests, shutdown)."""
        with self._lock:
            threads = list(self._threads.values())
        for t in threads:
            t.join(timeout_s)
