"""The event-driven scheduling loop (Algorithm 2, lines 3–4): woken only by events.

One thread blocks on an event queue — no timers, no polling — and each wake-up takes
every event that is queued (arrivals, completions, cancellations) and runs one
:func:`~flowprefill.prefill.scheduler.round.run_round` with them. Commands are applied from this
thread only, so the pool never sees two commands at once; ``preempt`` blocks until the
victim acknowledges, which is exactly the paper's "signal, wait for ACK, submit".

The loop owns the thread and the queue, nothing else: each round's
:class:`~flowprefill.prefill.scheduler.round.RoundOutput` goes to ``on_round`` (the engine
resolves its futures and metrics from it), and a crash goes to ``on_crash`` so that no
caller is left waiting.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from flowprefill.prefill.scheduler.core import Scheduler
from flowprefill.prefill.scheduler.round import Event, Pool, RoundOutput, Stop, run_round

log = logging.getLogger(__name__)


class SchedulerLoop:
    """Runs :func:`run_round` on its own thread for each batch of queued events.

    ``on_round`` and ``on_crash`` are called on the loop thread; ``on_round`` sees every
    round, including the last one (a Stop's), whose completions must still be answered.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        pool: Pool,
        *,
        on_round: Callable[[RoundOutput], None],
        on_crash: Callable[[BaseException], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.scheduler = scheduler
        self.pool = pool
        self.clock = clock
        self._on_round = on_round
        self._on_crash = on_crash
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

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

    def _main(self) -> None:
        try:
            while True:
                events = [self._events.get()]  # blocks: the loop sleeps until an event
                while True:
                    try:
                        events.append(self._events.get_nowait())
                    except queue.Empty:
                        break
                out = run_round(self.scheduler, self.pool, events, self.clock())
                self._on_round(out)
                if out.stopped:
                    return
        except BaseException as e:  # a bug: make it visible, and never leave callers hanging
            log.exception("scheduler loop crashed")
            self._on_crash(e)
            raise
