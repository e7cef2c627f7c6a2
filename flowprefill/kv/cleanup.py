"""Delayed clean-ups on one daemon thread: the connector deletes a finished request's KV
hand-off a grace period later (``connector.DELETE_GRACE_S``), whether or not vLLM schedules
anything meanwhile."""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Callable

from flowprefill.contracts.kv import HandoffRef

logger = logging.getLogger("vllm.flowprefill.kv.cleanup")


class DelayedCleanup:
    """Runs clean-ups a given time after they are queued, on one daemon thread (started on
    first use), whether or not vLLM schedules anything meanwhile."""

    def __init__(self) -> None:
        self._due: list[tuple[float, int, Callable[[HandoffRef], None], HandoffRef]] = []
        self._seq = 0
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None

    def after(self, delay_s: float, fn: Callable[[HandoffRef], None], ref: HandoffRef) -> None:
        with self._cv:
            self._seq += 1
            heapq.heappush(self._due, (time.monotonic() + delay_s, self._seq, fn, ref))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kv-cleanup", daemon=True)
                self._thread.start()
            self._cv.notify()

    def run_all_now(self) -> None:
        with self._cv:
            due, self._due = self._due, []
        for _, _, fn, ref in sorted(due):
            fn(ref)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._due or self._due[0][0] > time.monotonic():
                    timeout = self._due[0][0] - time.monotonic() if self._due else None
                    self._cv.wait(timeout)
                _, _, fn, ref = heapq.heappop(self._due)
            try:  # outside the lock: a slow unlink must not block request_finished
                fn(ref)
            except Exception:  # the thread serves every later clean-up: keep it alive
                logger.exception("clean-up of hand-off %s failed", ref.handoff_id)
