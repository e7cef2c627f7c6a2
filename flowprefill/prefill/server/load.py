"""A prefill instance's backlog as the gateway's admission reads it
(:class:`~flowprefill.contracts.prefill_api.PrefillLoad`).

Read from the scheduler's queues on the server's thread while the scheduler thread may be
changing them: each queue is copied with one ``list()`` (atomic for a dict under the GIL),
and a snapshot that still races a round (an item counted twice or missed while it moves
between queues) is only as wrong as one round's change, which the next answer corrects.
"""

from __future__ import annotations

from flowprefill.contracts.prefill_api import PrefillLoad
from flowprefill.prefill.request import Request, Task
from flowprefill.prefill.scheduler.core import Scheduler


def remaining_tokens(item: Request | Task) -> float:
    """Prompt tokens still to prefill: a parked or running task's share not yet done."""
    if isinstance(item, Request):
        return float(item.num_tokens)
    return item.num_tokens * max(0.0, 1.0 - item.progress)


def backlog(scheduler: Scheduler) -> PrefillLoad:
    """Everything ``scheduler`` holds (waiting, parked, running), and the engine's
    predicted time to prefill it all."""
    items: list[Request | Task] = list(scheduler.waiting.values())
    items.extend(scheduler.preempted.values())
    running = scheduler.running
    if running is not None:
        items.append(running)
    tokens = round(sum(remaining_tokens(x) for x in items))
    num_requests = sum(1 if isinstance(x, Request) else len(x.requests) for x in items)
    return PrefillLoad(
        backlog_tokens=tokens,
        queue_delay_s=scheduler.predict_s(tokens) if tokens else 0.0,
        num_requests=num_requests,
    )
