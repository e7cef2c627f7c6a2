"""Admission at arrival: refuse early what cannot be served in time.

One pure decision, called by the gateway (:meth:`flowprefill.gateway.routing.InstancePool.admit`)
and by the simulator's ``shed-*`` admission policies (:mod:`flowprefill.lab.sim.gateway`), so
the policy measured in simulation is the one that serves:

* A class with a negative ``priority`` is *sheddable* (the SLOClass CRD's contract): its
  *limit* is its deadline. Any other class's limit is its deadline plus its *useful wait*
  (``max(factor × TTFT target, floor)``,
  :meth:`~flowprefill.contracts.gateway.OverloadSettings.useful_wait_s`): served late
  rather than refused, but not so late that the answer is worth nothing.
* A request goes to the routed instance if its first token is predicted there by its
  limit; else to the instance where it is predicted earliest among those that make the
  limit (route elsewhere); else it is refused, with a retry delay: a sheddable one with
  429 (shed), any other with 503 (overloaded).

Callers supply, per instance, the predicted time the request's first token would be ready
there (:func:`predicted_finish_s`: the work due before it plus its own, through the
engine's TTFT predictor). The decision is made once, before the request is sent, and handed
to the prefill stage as data (:class:`flowprefill.gateway.routing.Admitted`): once an
instance has it, it is served however late (the engine never drops a request).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from flowprefill.contracts.prefill_api import PrefillLoad

MIN_RETRY_AFTER_S = 1.0
"""HTTP ``Retry-After`` counts whole seconds; a refusal never asks for less than one."""


def is_sheddable(priority: int) -> bool:
    """Negative priority: the class may be refused under overload."""
    return priority < 0


@dataclass(frozen=True, slots=True)
class Estimate:
    """What one instance would do with the request: its first token at ``finish_s``."""

    index: int
    finish_s: float


@dataclass(frozen=True, slots=True)
class Accept:
    index: int
    """The instance that gets the request."""
    rerouted: bool = False
    """True when it is not the instance routing preferred (that one would be too late)."""


@dataclass(frozen=True, slots=True)
class Refuse:
    retry_after_s: float
    """When a retry is predicted to fit: the best instance's lateness past the limit, at
    least 1 s."""
    best_finish_s: float
    """The earliest predicted first token over the instances (past the limit)."""
    shed: bool = True
    """A sheddable class's refusal (429); False: a non-sheddable one's, predicted past
    its useful wait (503)."""


Decision = Accept | Refuse


def predicted_finish_s(
    now_s: float, tokens_ahead: float, num_tokens: int, predict_s: Callable[[int], float]
) -> float:
    """First token of a request of ``num_tokens`` behind ``tokens_ahead`` tokens of work
    due before it, predicted as one prefill of both (an EDF engine runs that work first)."""
    return now_s + predict_s(round(tokens_ahead) + num_tokens)


def decide(
    *,
    sheddable: bool,
    deadline_s: float,
    estimates: Sequence[Estimate],
    preferred: int,
    useful_wait_s: float = math.inf,
) -> Decision:
    """Accept on ``preferred`` (the routing policy's pick), on another instance that makes
    the limit, or refuse. The limit is ``deadline_s`` for a sheddable request, else
    ``deadline_s + useful_wait_s`` (infinite by default: never refused). ``estimates`` must
    include ``preferred``."""
    by_index = {e.index: e for e in estimates}
    if preferred not in by_index:
        raise ValueError(f"preferred instance {preferred} has no estimate")
    if useful_wait_s < 0:
        raise ValueError(f"useful_wait_s must be >= 0, got {useful_wait_s}")
    limit_s = deadline_s if sheddable else deadline_s + useful_wait_s
    if by_index[preferred].finish_s <= limit_s:
        return Accept(preferred)
    best = min(estimates, key=lambda e: (e.finish_s, e.index))
    if best.finish_s <= limit_s:
        return Accept(best.index, rerouted=True)
    # The queue ahead drains by about this much before the same request could make it.
    late_s = best.finish_s - limit_s
    return Refuse(max(MIN_RETRY_AFTER_S, float(math.ceil(late_s))), best.finish_s, sheddable)


@dataclass(frozen=True, slots=True)
class LoadReport:
    """An instance's :class:`PrefillLoad` as received at ``at_s`` (gateway clock), and the
    tokens it holds that this gateway did not send."""

    load: PrefillLoad
    at_s: float
    foreign_tokens: int

    def foreign_tokens_at(self, now_s: float) -> float:
        """What is left of the foreign work at ``now_s``: the engine predicted its whole
        backlog done in ``queue_delay_s``; the foreign part drains in proportion."""
        if self.foreign_tokens <= 0 or self.load.queue_delay_s <= 0:
            return 0.0
        left = 1.0 - (now_s - self.at_s) / self.load.queue_delay_s
        return self.foreign_tokens * min(1.0, max(0.0, left))
