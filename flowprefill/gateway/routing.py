"""Choosing a prefill (or decode) instance, and remembering which ones are healthy.

Policies (:class:`~flowprefill.contracts.names.Router`, chosen per pool in
``gateway.json``: ``prefill_routing``, ``decode_routing``):

* ``round-robin`` — the paper's proxy: the next healthy instance in turn.
* ``slack-aware`` (default for prefill) — the instance where this request's predicted
  slack is largest. Each instance runs EDF-like scheduling, so what delays a new request
  is the outstanding work *due before it*, not the whole queue: the predicted TTFT on an
  instance is ``predict(tokens due earlier + own tokens)``. This is tracked from the
  gateway's own in-flight requests (no extra round trips).
* ``least-loaded`` (default for decode) — fewest in-flight requests; ties rotate.

An instance that fails (connection error, 5xx) is taken out of rotation for a back-off
that doubles per consecutive failure (1 s, 2 s, ... 30 s). When it expires, the next
request may be sent there again: a refused connection is retried once on another instance
(:mod:`flowprefill.gateway.failover`), so probing a dead instance costs no request; a
success clears the count.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from flowprefill.contracts.names import Router
from flowprefill.gateway.errors import NoHealthyInstanceError


@dataclass(eq=False)
class Instance:
    url: str
    healthy: bool = True
    consecutive_failures: int = 0
    retry_after_s: float = 0.0
    # request id -> (deadline_s, num_tokens) of work this gateway sent and awaits.
    in_flight: dict[str, tuple[float, int]] = field(default_factory=dict)

    @property
    def num_in_flight(self) -> int:
        return len(self.in_flight)

    def tokens_due_before(self, deadline_s: float) -> int:
        return sum(n for d, n in self.in_flight.values() if d <= deadline_s)


class InstancePool:
    """The instances of one role (prefill or decode) behind the gateway."""

    def __init__(
        self,
        role: str,
        urls: list[str],
        *,
        policy: Router | str = Router.SLACK_AWARE,
        predict_s: Callable[[int], float] | None = None,
        clock: Callable[[], float] = time.monotonic,
        base_backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
    ) -> None:
        if not urls:
            raise ValueError(f"no {role} instances configured")
        self.role = role
        self.policy = Router.parse(policy)
        self.instances = [Instance(u.rstrip("/")) for u in urls]
        self.predict_s = predict_s or (lambda n: n * 1e-4)
        self.clock = clock
        self.base_backoff_s = base_backoff_s
        self.max_backoff_s = max_backoff_s
        self._rr = itertools.count()

    def healthy(self) -> list[Instance]:
        now = self.clock()
        out = []
        for inst in self.instances:
            if not inst.healthy and now >= inst.retry_after_s:
                # Back-off over: give it a chance; a failure puts it back out for longer.
                inst.healthy = True
            if inst.healthy:
                out.append(inst)
        return out

    def pick(self, *, deadline_s: float, num_tokens: int) -> Instance:
        candidates = self.healthy()
        if not candidates:
            raise NoHealthyInstanceError(self.role)
        turn = next(self._rr)
        if self.policy is Router.ROUND_ROBIN or len(candidates) == 1:
            return candidates[turn % len(candidates)]
        # Rotate the start so ties spread instead of always landing on the first one.
        rotated = candidates[turn % len(candidates) :] + candidates[: turn % len(candidates)]
        if self.policy is Router.LEAST_LOADED:
            return min(rotated, key=lambda i: i.num_in_flight)
        now = self.clock()
        return max(
            rotated,
            key=lambda i: (
                deadline_s - now - self.predict_s(i.tokens_due_before(deadline_s) + num_tokens)
            ),
        )

    def begin(self, inst: Instance, request_id: str, deadline_s: float, num_tokens: int) -> None:
        inst.in_flight[request_id] = (deadline_s, num_tokens)

    def end(self, inst: Instance, request_id: str) -> None:
        inst.in_flight.pop(request_id, None)

    def mark_failure(self, inst: Instance) -> None:
        inst.consecutive_failures += 1
        backoff = min(
            self.max_backoff_s, self.base_backoff_s * 2 ** (inst.consecutive_failures - 1)
        )
        inst.healthy = False
        inst.retry_after_s = self.clock() + backoff

    def mark_success(self, inst: Instance) -> None:
        inst.consecutive_failures = 0
        inst.healthy = True
