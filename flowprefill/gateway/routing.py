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
success clears the count. An instance that accepts connections but stops answering
(stopped, wedged) is found by the gateway's health probes instead
(:mod:`flowprefill.gateway.health`) and kept out while it is stalled.

Admission (:meth:`InstancePool.admit`, :mod:`flowprefill.gateway.admission`): before a
request is sent, each instance's predicted first token for it is estimated from what this
gateway sent there (entries due no later than it, except those already predicted to miss:
S-EDF runs them after every feasible one) plus the work the instance reported that this
gateway did not send (other gateways' or direct clients'), drained linearly over the
engine's own predicted queue delay since the report (:class:`~flowprefill.contracts.
prefill_api.PrefillLoad`, on every prefill answer). The instance admission chooses is
where the request's first attempt goes.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from flowprefill.contracts.names import Router
from flowprefill.contracts.prefill_api import PrefillLoad
from flowprefill.gateway.admission import Accept, Decision, Estimate, decide, predicted_finish_s
from flowprefill.gateway.errors import NoHealthyInstanceError


@dataclass(eq=False)
class Instance:
    url: str
    healthy: bool = True
    consecutive_failures: int = 0
    retry_after_s: float = 0.0
    # request id -> (deadline_s, num_tokens) of work this gateway sent and awaits.
    in_flight: dict[str, tuple[float, int]] = field(default_factory=dict)
    stall: asyncio.Event = field(default_factory=asyncio.Event)
    """Set while the health prober finds it unresponsive (flowprefill.gateway.health):
    out of rotation whatever its back-off says."""

    @property
    def num_in_flight(self) -> int:
        return len(self.in_flight)

    def tokens_due_before(self, deadline_s: float) -> int:
        return sum(n for d, n in self.in_flight.values() if d <= deadline_s)

    @property
    def tokens_in_flight(self) -> int:
        return sum(n for _, n in self.in_flight.values())


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
        self.reports: dict[str, LoadReport] = {}
        """Instance URL -> its latest load report."""
        self._reserved: dict[tuple[float, int], Instance] = {}

    def healthy(self) -> list[Instance]:
        now = self.clock()
        out = []
        for inst in self.instances:
            if not inst.healthy and now >= inst.retry_after_s:
                # Back-off over: give it a chance; a failure puts it back out for longer.
                inst.healthy = True
            if inst.healthy and not inst.stall.is_set():
                out.append(inst)
        return out

    def pick(self, *, deadline_s: float, num_tokens: int) -> Instance:
        """The instance for a request due at ``deadline_s``: the one :meth:`admit`
        reserved for it if still healthy, else the routing policy's choice."""
        candidates = self.healthy()
        if not candidates:
            raise NoHealthyInstanceError(self.role)
        reserved = self._reserved.pop((deadline_s, num_tokens), None)
        if reserved is not None and reserved in candidates:
            return reserved
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

    def estimate_finish_s(
        self, inst: Instance, *, deadline_s: float, num_tokens: int, now_s: float
    ) -> float:
        """When a request of ``num_tokens`` due at ``deadline_s`` sent now would have its
        first token on ``inst``: the work due before it, as :meth:`admit` counts it."""
        ahead = 0.0
        for d, n in inst.in_flight.values():
            if d <= deadline_s and d - now_s - self.predict_s(n) >= 0:
                ahead += n
        report = self.reports.get(inst.url)
        if report is not None:
            ahead += report.foreign_tokens_at(now_s)
        return predicted_finish_s(now_s, ahead, num_tokens, self.predict_s)

    def admit(self, *, deadline_s: float, num_tokens: int, sheddable: bool) -> Decision:
        """Where a request goes, or that it is refused
        (:func:`~flowprefill.gateway.admission.decide`). An accepted request's instance is
        reserved: the next :meth:`pick` for the same deadline and size returns it (the
        failover's first attempt). Raises NoHealthyInstanceError with nothing to pick."""
        preferred = self.pick(deadline_s=deadline_s, num_tokens=num_tokens)
        if not sheddable:
            decision: Decision = Accept(self.instances.index(preferred))
        else:
            now = self.clock()
            estimates = [
                Estimate(
                    self.instances.index(inst),
                    self.estimate_finish_s(
                        inst, deadline_s=deadline_s, num_tokens=num_tokens, now_s=now
                    ),
                )
                for inst in self.healthy()
            ]
            decision = decide(
                sheddable=True,
                deadline_s=deadline_s,
                estimates=estimates,
                preferred=self.instances.index(preferred),
            )
        if isinstance(decision, Accept):
            self._reserved[(deadline_s, num_tokens)] = self.instances[decision.index]
        return decision

    def release_reservation(self, *, deadline_s: float, num_tokens: int) -> None:
        """Forget a reservation :meth:`pick` did not take (the request ended before)."""
        self._reserved.pop((deadline_s, num_tokens), None)

    def report_load(self, url: str, load: PrefillLoad, *, answered: str) -> None:
        """Instance ``url`` reported ``load`` in its answer to request ``answered``: the
        tokens it holds beyond what this gateway still awaits there are foreign."""
        inst = next((i for i in self.instances if i.url == url), None)
        if inst is None:
            return
        own = inst.tokens_in_flight - inst.in_flight.get(answered, (0.0, 0))[1]
        self.reports[url] = LoadReport(load, self.clock(), max(0, load.backlog_tokens - own))

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
