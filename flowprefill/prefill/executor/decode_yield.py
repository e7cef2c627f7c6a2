"""Decode-aware yield: a running prefill steps aside for a decode step whose TBT is at risk.

Where prefill and decode share a device (a colocated pod, ``flowprefill up`` on one CPU),
a decode step that runs beside a prefill takes longer, and every decoding request's
time between tokens (TBT) grows with it. Decode tells the engine when its steps run
(*beats*, :mod:`flowprefill.kv.beats`); at each preemption checkpoint of the running
task this module decides whether to let the prefill go on or to park it until the step
has ended (the simulator's ``flowprefill-da``, :mod:`flowprefill.lab.sim.colocated`, is
the same idea decided once per step).

The rule. A decode step is *pending* when one is in progress (its ``START`` came, its
``END`` not yet) or, between steps, when the last step still had decoding requests (the
next is due). Its token must come by ``next_deadline`` (:class:`DecodeState`: the last
token plus the TBT target, or by the simulator's mean-gap rule). Parked, decode would
finish the pending step in ``solo_left``: the rest of the quiet gap between steps and a
step at their measured solo times, less the progress it made meanwhile at the measured
slowdown beside a prefill. The prefill goes on while it could still park at the *next*
checkpoint (``stretch`` away: the longest of the last few measured times between
checkpoints) and leave decode its ``solo_left``::

    park  iff  now + stretch + solo_left > next_deadline

then the task syncs the device and sleeps until the step's ``END`` beat. So prefill runs
as long as the target allows and decode gets the device just in time, not at every step.

TTFT first. A park never spends a TTFT target: it is *vetoed* unless the running task,
parked for ``solo_left`` and then run for the rest of its predicted time, still ends by
its earliest member's deadline, and by the time the most urgent waiting request must start
to make its own (:attr:`DecodeYield.queue_start_by_s`, which the engine sets after every
scheduling round; a request that cannot make it any more sets nothing)::

    veto  iff  now + solo_left + predicted × (1 − progress) > min(deadline, queue_start_by)

(``budget``: the engine's deadline and predictor for the task; unknown: only the queue
counts). A task already late does not park either: delaying it delays the queue. Under
a load where decode is always busy this is what keeps prefill going: without the veto, a
stretch and a decode step that together exceed the slack of a TBT gap park the prefill at
nearly every checkpoint (measured on CPU under ``flowprefill up``: TTFT attainment fell
from 83 % to 28 % at 4 req/s).
The stretch must be well under the target for this to work: with operators that run
longer than the target between two checkpoints, no park can come in time (``flowprefill
up --decode-aware`` bounds them at a quarter of the target, ``max_blocking_ms``).

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
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from flowprefill.kv.beats import DecodeState
    from flowprefill.prefill.request import Task


class Parkable(Protocol):
    """What a park needs of the task's control (a TaskControl; a protocol so that this
    module and preemption.py do not import each other)."""

    device_sync: Callable[[], None] | None
    decode_budget: tuple[float, float] | None
    """(the task's earliest deadline on :attr:`DecodeYield.clock`, its predicted prefill
    seconds in all); None: unknown, no TTFT veto."""

    @property
    def progress(self) -> float: ...


Budget = Callable[["Task"], tuple[float, float]]
"""``budget(task)`` -> (seconds from now until the task's earliest deadline, the task's
predicted prefill seconds in all): the engine's view, on its own clock."""


STRETCHES = 8
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
        on_veto: Callable[[], None] | None = None,
        budget: Budget | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``max_park_s``: longest single park (default the TBT target); ``stale_s``: beats
        older than this mean decode is gone (default 10 TBT targets, at least 1 s);
        ``on_park(seconds)``: called after each park, ``on_veto()`` after each park the
        running task's TTFT vetoed (metrics); ``budget``: the task's deadline and predicted
        time (module docstring, "TTFT first"; None: no veto). ``clock`` must be
        CLOCK_MONOTONIC's: beats carry its stamps."""
        target = state.tbt_target_s
        self.state = state
        self.max_park_s = float(max_park_s) if max_park_s is not None else target
        if not self.max_park_s > 0:
            raise ValueError(f"max_park_s must be > 0, got {max_park_s!r}")
        self.stale_s = float(stale_s) if stale_s is not None else max(1.0, 10 * target)
        self.on_park = on_park
        self.on_veto = on_veto
        self.budget = budget
        self.clock = clock
        self.parks = 0
        self.parked_s = 0.0
        self.timeouts = 0
        self.vetoes = 0
        self.queue_start_by_s = math.inf
        """Latest start (on :attr:`clock`) at which the most urgent waiting request still
        makes its TTFT deadline; inf when none waits or none can make it any more. Set by
        the engine's scheduling loop after every round."""
        self._gave_up_at = -1  # end_count of a park that timed out
        self.stretch_s = 0.0
        """The longest of the last :data:`STRETCHES` times between two checkpoints of a
        running prefill (measured while decode is active)."""
        self._stretches: deque[float] = deque(maxlen=STRETCHES)
        self._last_check_s: float | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------ task threads

    def task_started(self, control: Parkable, task: Task) -> None:
        """A prefill task begins running (the pool's task thread): count it, and give its
        control the task's TTFT budget on this clock."""
        if self.budget is not None:
            until_deadline_s, predicted_s = self.budget(task)
            control.decode_budget = (self.clock() + until_deadline_s, predicted_s)
        with self._lock:
            self.state.prefill_running += 1

    def task_ended(self) -> None:
        with self._lock:
            self.state.prefill_running -= 1

    def solo_left_s(self, now: float) -> float:
        """How long decode needs, alone, to end the pending step (inf: none pending)."""
        s = self.state
        solo = s.solo_step_s if s.solo_step_s is not None else (s.shared_step_s or 0.0)
        shared = s.shared_step_s if s.shared_step_s is not None else DEFAULT_SLOWDOWN * solo
        slowdown = max(1.0, shared / solo) if solo > 0 else DEFAULT_SLOWDOWN
        if s.in_step:
            return max(0.0, solo - (now - s.step_start_s) / slowdown)
        if s.num_decoding <= 0:
            return math.inf
        between = s.solo_between_s or 0.0
        return max(0.0, between - (now - s.last_end_s) / slowdown) + solo

    def should_park(self, now: float) -> bool:
        """The decision alone (module docstring); its only side effect is forgetting a
        decode that has gone quiet."""
        s = self.state
        if now - s.last_beat_s > self.stale_s:
            s.active = False  # decode is gone; the next beat makes it active again
            return False
        if s.end_count == self._gave_up_at:
            return False  # the last park for this step timed out: do not wait again
        left = self.solo_left_s(now)
        return left != math.inf and now + self.stretch_s + left > s.next_deadline_s

    def affordable(self, control: Parkable, now: float, park_s: float) -> bool:
        """Whether the running task still ends by its deadline, and by the most urgent
        waiting request's latest start, after a park of ``park_s`` (module docstring, "TTFT
        first"). The task's own part counts only when its budget is known."""
        budget = control.decode_budget
        by = self.queue_start_by_s
        if budget is None:
            return now + park_s <= by
        deadline, predicted_s = budget
        return now + park_s + predicted_s * (1.0 - control.progress) <= min(deadline, by)

    def _measure_stretch(self, now: float) -> None:
        """Time between checkpoints, measured while decode is active (the only time this
        runs); an interval spanning a park or a quiet spell is not a stretch."""
        last = self._last_check_s
        self._last_check_s = now
        if last is None:
            return
        gap = now - last
        if 0 <= gap < self.max_park_s:
            recent = self._stretches
            recent.append(gap)
            # The longest of the last few: operators differ (attention is not a down_proj),
            # and the next one may be the long one.
            self.stretch_s = max(recent)

    def at_checkpoint(self, control: Parkable) -> None:
        """Called by :meth:`TaskControl.check` when ``state.active``: park for the pending
        decode step if its TBT is at risk (module docstring)."""
        now = self.clock()
        self._measure_stretch(now)
        if not self.should_park(now):
            return
        if not self.affordable(control, now, self.solo_left_s(now)):
            self.vetoes += 1
            if self.on_veto is not None:
                self.on_veto()
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
        self._last_check_s = None  # the park is not a stretch
        if self.on_park is not None:
            self.on_park(took)
