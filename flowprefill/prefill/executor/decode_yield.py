"""Decode-aware yield: a running prefill steps aside for a decode step whose TBT is at risk.

Where prefill and decode share a device (a colocated pod, ``flowprefill up`` on one CPU),
a decode step that runs beside a prefill takes longer, and every decoding request's
time between tokens (TBT) grows with it. Decode tells the engine when its steps run
(*beats*, :mod:`flowprefill.kv.beats`); at each preemption checkpoint of the running
task this module decides, by the simulator's ``flowprefill-da`` rule
(:mod:`flowprefill.lab.sim.colocated`), whether to let the prefill go on or to park it
until the step has ended.

The rule. A step is *pending* when one is in progress (its ``START`` came, its ``END``
not yet) or, between steps, when the last step still had decoding requests (the next is
due). If the prefill went on, the pending step would end at

* in a step: ``max(step_start + shared_step, now)``;
* between steps: ``max(last_end + between_shared, now) + shared_step``,

with ``shared_step`` the measured time of steps that ran beside a prefill and
``between_shared`` the quiet gap between steps scaled by the same slowdown. When that
end is past ``next_deadline`` — the latest time the next token may come without any
decoding request's mean gap so far passing the TBT target — the task syncs the device
and sleeps until the step's ``END`` beat. Judging the mean gap lets a request bank
slack from quick steps, so prefill is not parked at every step when the target is under
two step times (the per-gap rule starved prefill in the simulator).

Bounds, so that decode can never stall prefill: one park lasts at most ``max_park_s``
(default: the TBT target); a park that times out (a lost ``END``, a hung decode) is not
repeated until a new ``END`` arrives; beats older than ``stale_s`` mean decode is gone
and nothing is due.

This is not a scheduler preemption: no ACK, no requeue, the scheduler does not see it;
the task just waits inside its checkpoint, like a tensor-parallel gate. A preemption
signal raised meanwhile is acknowledged at this same checkpoint once the wait ends
(the yield runs before the signal check), so it adds at most one park to the blocking
time. Tensor parallelism: only rank 0's tasks yield (rank 0 listens); it parks *before*
the next collective, where the other ranks simply wait for it, so no rank runs ahead
or out of step.

Hot path: :meth:`TaskControl.check` reads ``control.decode_yield`` (None when the policy
is off) and, when set, ``.state.active``, which is False unless a request is decoding.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from flowprefill.kv.beats import DecodeState

if TYPE_CHECKING:
    from flowprefill.prefill.executor.preemption import TaskControl

DEFAULT_SLOWDOWN = 2.0
"""Shared/solo step time assumed before any shared step was measured (equal sharing)."""


class DecodeYield:
    """The decision and the wait; one per engine, shared by its tasks' controls."""

    def __init__(
        self,
        state: DecodeState,
        *,
        max_park_s: float | None = None,
        stale_s: float | None = None,
        on_park: Callable[[float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``max_park_s``: longest single park (default the TBT target); ``stale_s``: beats
        older than this mean decode is gone (default 10 TBT targets, at least 1 s);
        ``on_park(seconds)``: called after each park (metrics)."""
        target = state.tbt_target_s
        self.state = state
        self.max_park_s = float(max_park_s) if max_park_s is not None else target
        if not self.max_park_s > 0:
            raise ValueError(f"max_park_s must be > 0, got {max_park_s!r}")
        self.stale_s = float(stale_s) if stale_s is not None else max(1.0, 10 * target)
        self.on_park = on_park
        self.clock = clock
        self.parks = 0
        self.parked_s = 0.0
        self.timeouts = 0
        self._gave_up_at = -1  # end_count of a park that timed out
        self._lock = threading.Lock()

    # ------------------------------------------------------------ task threads

    def task_started(self) -> None:
        """A prefill task begins running (the pool's task thread)."""
        with self._lock:
            self.state.prefill_running += 1

    def task_ended(self) -> None:
        with self._lock:
            self.state.prefill_running -= 1

    def predicted_end_s(self, now: float) -> float:
        """When the pending step would end if the prefill went on (inf: none pending)."""
        s = self.state
        solo = s.solo_step_s or 0.0
        shared = s.shared_step_s if s.shared_step_s is not None else DEFAULT_SLOWDOWN * solo
        if s.in_step:
            return max(s.step_start_s + shared, now)
        if s.num_decoding <= 0:
            return math.inf
        slowdown = shared / solo if solo > 0 else DEFAULT_SLOWDOWN
        between = (s.solo_between_s or 0.0) * slowdown
        return max(s.last_end_s + between, now) + shared

    def should_park(self, now: float) -> bool:
        """The decision alone (no side effects but forgetting a stale decode)."""
        s = self.state
        if now - s.last_beat_s > self.stale_s:
            s.active = False  # decode is gone; the next beat makes it active again
            return False
        if s.end_count == self._gave_up_at:
            return False  # the last park for this step timed out: do not wait again
        end = self.predicted_end_s(now)
        return end != math.inf and end > s.next_deadline_s

    def at_checkpoint(self, control: TaskControl) -> None:
        """Called by :meth:`TaskControl.check` when ``state.active``: park for the pending
        decode step if its TBT is at risk (module docstring)."""
        now = self.clock()
        if not self.should_park(now):
            return
        s = self.state
        if control.device_sync is not None:
            control.device_sync()  # leave no queued device work to compete with decode
        after = s.end_count
        s.parked_since = now
        try:
            ended = s.wait_end(after, self.max_park_s)
        finally:
            s.parked_since = None
        took = self.clock() - now
        self.parks += 1
        self.parked_s += took
        if not ended:
            self.timeouts += 1
            self._gave_up_at = after
        if self.on_park is not None:
            self.on_park(took)
