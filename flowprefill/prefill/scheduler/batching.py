"""The engine's batch formation policies, chosen by name.

Every policy grows the batch of the highest-priority request ``H`` (the leader) with
candidates taken in priority order, within the token budget (inclusive: a budget of ``B``
tokens admits a batch of exactly ``B``). They differ in which deadlines they check:

* ``slo-aware`` — the paper's Algorithm 1: a candidate joins while the predicted latency of
  the grown batch still fits in ``H``'s remaining time. Only the leader's deadline counts.
* ``member-headroom`` — Algorithm 1 with two changes (+11–25 % goodput over ``slo-aware``
  on the simulator; docs/simulator.md, "Beyond the paper"):

  - *every member's* deadline counts: a candidate joins only if the grown batch finishes
    before its own deadline as well as every member's so far, and a candidate that cannot
    make its deadline even alone (negative slack) never joins a feasible leader. When the
    leader itself is already late, the batch is filled with other late requests instead:
    they are misses either way, and clearing them in full batches costs the feasible ones
    less device time than one by one (Algorithm 1 runs a late leader alone, because no
    prediction fits a negative remaining time);
  - *headroom*: the batch may take only half of the tightest member's remaining time. A
    batch cannot be preempted by a request due later than its leader, so a batch that
    fills the leader's whole slack makes every urgent request arriving meanwhile wait for
    it; keeping half the slack free bounds that wait.

* ``none`` — never batch: one request per task (the FCFS baseline of the demo, and tests
  that want one request per task).

The simulator's ablations (each change of ``member-headroom`` alone, greedy batching of the
baselines) are in :mod:`flowprefill.lab.sim.batching`; the ``fraction`` attribute of the
policies here is what they vary.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from flowprefill.contracts.names import Batching
from flowprefill.prefill.request import Request
from flowprefill.prefill.scheduler.waiting import Candidates

PredictFn = Callable[[int], float]
"""Predicted prefill latency in seconds for a batch of ``n`` tokens."""


def take_at_most(candidates: Iterable[Request], max_tokens: int) -> None:
    """Promise a candidate source that no request of more than ``max_tokens`` tokens will
    join (the room left in the budget), so that it may skip them (:class:`Candidates`;
    promises only tighten); a plain iterable is left as it is."""
    if isinstance(candidates, Candidates):
        held = candidates.max_tokens
        candidates.max_tokens = max_tokens if held is None else min(held, max_tokens)


def too_slow(candidates: Iterable[Request], num_tokens: int) -> None:
    """A candidate of ``num_tokens`` was refused because the grown batch is predicted too
    slow for a limit that only tightens as the batch grows. With a predictor that never
    decreases in the token count (:attr:`Candidates.monotone`), no larger candidate can
    join either: promise so. Otherwise nothing follows from it."""
    if isinstance(candidates, Candidates) and candidates.monotone:
        take_at_most(candidates, num_tokens - 1)


class BatchingPolicy(Protocol):
    name: str

    def form_batch(
        self,
        leader: Request,
        candidates: Iterable[Request],
        *,
        now_s: float,
        predict_s: PredictFn,
        token_budget: int,
    ) -> list[Request]:
        """Return the batch, leader first; ``candidates`` come in priority order (a
        :class:`Candidates` may leave out what :func:`take_at_most` promised to refuse)."""
        ...


class SLOAwareBatching:
    """Algorithm 1: a candidate joins while the grown batch fits the leader's remaining time.

    ``fraction`` is the share of that time the batch may take (1 for the paper's rule).
    """

    name: str = Batching.SLO_AWARE
    fraction = 1.0

    def form_batch(
        self,
        leader: Request,
        candidates: Iterable[Request],
        *,
        now_s: float,
        predict_s: PredictFn,
        token_budget: int,
    ) -> list[Request]:
        batch = [leader]
        allowed_s = self.fraction * (leader.deadline_s - now_s)
        num_tokens = leader.num_tokens
        take_at_most(candidates, token_budget - num_tokens)
        # With a predictor that never decreases in the token count, a full budget that
        # fits the leader's time means every batch within the budget does: no candidate
        # needs a prediction (the usual case for a feasible leader; same decisions).
        fits_all = (
            isinstance(candidates, Candidates)
            and candidates.monotone
            and allowed_s > predict_s(token_budget)
        )
        for r in candidates:
            grown = num_tokens + r.num_tokens
            # The budget is inclusive: a batch of exactly token_budget tokens is admitted.
            if grown > token_budget:
                continue
            if fits_all or allowed_s > predict_s(grown):
                batch.append(r)
                num_tokens = grown
                take_at_most(candidates, token_budget - num_tokens)
            else:
                too_slow(candidates, r.num_tokens)  # allowed_s is fixed, the batch grows
        return batch


class NoBatching:
    """One request per task."""

    name: str = Batching.NONE

    def form_batch(
        self,
        leader: Request,
        candidates: Iterable[Request],
        *,
        now_s: float,
        predict_s: PredictFn,
        token_budget: int,
    ) -> list[Request]:
        return [leader]


class MemberHeadroomBatching:
    """Every member's deadline counts, late leaders are batched with late requests, and a
    batch takes at most ``fraction`` of the tightest member's remaining time."""

    name: str = Batching.MEMBER_HEADROOM
    fraction = 0.5
    """Share of the tightest member's remaining time the batch may take."""

    def form_batch(
        self,
        leader: Request,
        candidates: Iterable[Request],
        *,
        now_s: float,
        predict_s: PredictFn,
        token_budget: int,
    ) -> list[Request]:
        batch = [leader]
        num_tokens = leader.num_tokens
        tightest_s = leader.deadline_s - now_s
        leader_late = tightest_s < predict_s(leader.num_tokens)
        take_at_most(candidates, token_budget - num_tokens)
        for r in candidates:
            grown = num_tokens + r.num_tokens
            if grown > token_budget:
                continue
            remaining_s = r.deadline_s - now_s
            late = remaining_s < predict_s(r.num_tokens)
            if leader_late:
                ok = late
            else:
                predicted_s = predict_s(grown)
                allowed_s = self.fraction * min(tightest_s, remaining_s)
                ok = not late and predicted_s < allowed_s
                if predicted_s >= self.fraction * tightest_s:
                    too_slow(candidates, r.num_tokens)  # tightest_s only shrinks
            if ok:
                batch.append(r)
                num_tokens = grown
                tightest_s = min(tightest_s, remaining_s)
                take_at_most(candidates, token_budget - num_tokens)
        return batch


BATCHING: dict[str, type[BatchingPolicy]] = {
    Batching.SLO_AWARE: SLOAwareBatching,
    Batching.MEMBER_HEADROOM: MemberHeadroomBatching,
    Batching.NONE: NoBatching,
}


def get_batching(name: str | Batching) -> BatchingPolicy:
    """Build a batching policy by name, parsed by :meth:`Batching.parse`."""
    return BATCHING[Batching.parse(name)]()
