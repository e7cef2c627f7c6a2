"""The event-driven scheduling loop (Algorithm 2, lines 3–4): woken only by events.

One thread blocks on an event queue — no timers, no polling — and each wake-up handles
every event that is queued (arrivals, completions, cancellations), runs one scheduling
round and carries out its commands on the execution pool. Commands are applied from this
thread only, so the pool never sees two commands at once; ``preempt`` blocks until the
victim acknowledges, which is exactly the paper's "signal, wait for ACK, submit".
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from flowprefill.request import Request, Task
from flowprefill.scheduler.core import CommandKind, Scheduler, SchedulerOutput

log = logging.getLogger(__name__)


class Pool(Protocol):
    def submit(self, task: Task) -> None: ...
    def preempt(self, task: Task) -> Any: ...
    def resume(self, task: Task) -> None: ...
    def cancel(self, task: Task) -> None: ...
    def release(self, task: Task) -> None: ...
    def progress(self, task: Task) -> float: ...


@dataclass(frozen=True, slots=True)
class Arrival:
    request: Request


@dataclass(frozen=True, slots=True)
class Completion:
    task: Task
    result: Any
    error: BaseException | None


@dataclass(frozen=True, slots=True)
class Cancel:
    request_id: str


@dataclass(frozen=True, slots=True)
class Stop:
    pass


Event = Arrival | Completion | Cancel | Stop


class LoopObserver(Protocol):
    """Hooks for the engine (futures) and metrics; called on the loop thread."""

    def on_round(self, out: SchedulerOutput, scheduler: Scheduler) -> None: ...
    def on_preempt(self, task: Task, outcome: Any) -> None: ...
    def on_completion(self, event: Completion, now_s: float) -> None: ...
    def on_cancelled(self, request: Request | None, request_id: str) -> None: ...
    def on_crash(self, error: BaseException) -> None: ...


class SchedulerLoop:
    def __init__(
        self,
        scheduler: Scheduler,
        pool: Pool,
        observer: LoopObserver,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.scheduler = scheduler
        self.pool = pool
        self.observer = observer
        self.clock = clock
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("scheduler loop already started")
        self._thread = threading.Thread(
            target=self._main, name="flowprefill-scheduler", daemon=True
        )
        self._thread.start()

    def post(self, event: Event) -> None:
        """Thread-safe: enqueue an event; the loop wakes for it."""
        self._events.put(event)

    def stop(self, timeout_s: float | None = 10.0) -> None:
        if self._thread is None:
            return
        self.post(Stop())
        self._thread.join(timeout_s)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------------ thread

    def _main(self) -> None:
        try:
            while True:
                events = [self._events.get()]  # blocks: the loop sleeps until an event
                while True:
                    try:
                        events.append(self._events.get_nowait())
                    except queue.Empty:
                        break
                if not self._handle(events):
                    return
        except BaseException as e:  # a bug: make it visible, and never leave callers hanging
            log.exception("scheduler loop crashed")
            self.observer.on_crash(e)
            raise
        finally:
            self._stopped.set()

    def _handle(self, events: list[Event]) -> bool:
        now = self.clock()
        keep_going = True
        for ev in events:
            if isinstance(ev, Arrival):
                self.scheduler.add(ev.request)
            elif isinstance(ev, Completion):
                self.scheduler.finish(ev.task, now, failed=ev.error is not None)
                self.pool.release(ev.task)
                self.observer.on_completion(ev, now)
            elif isinstance(ev, Cancel):
                self._cancel(ev.request_id, now)
            else:
                keep_going = False
        if not keep_going:
            return False
        running = self.scheduler.running
        if running is not None:
            # S-EDF needs the running task's true remaining time: read how far it got.
            running.progress = self.pool.progress(running)
        out = self.scheduler.schedule(self.clock())
        for cmd in out.commands:
            if cmd.kind is CommandKind.PREEMPT:
                outcome = self.pool.preempt(cmd.task)
                self.observer.on_preempt(cmd.task, outcome)
            elif cmd.kind is CommandKind.SUBMIT:
                self.pool.submit(cmd.task)
            else:
                self.pool.resume(cmd.task)
        self.observer.on_round(out, self.scheduler)
        return True

    def _cancel(self, request_id: str, now: float) -> None:
        request = self.scheduler.waiting.get(request_id)
        empty_task = self.scheduler.cancel(request_id, now)
        if empty_task is not None:
            # Nobody wants this task's output any more: stop it at its next checkpoint.
            # Its completion (with TaskCancelledError) frees the slot and wakes the loop.
            self.pool.cancel(empty_task)
        self.observer.on_cancelled(request, request_id)
