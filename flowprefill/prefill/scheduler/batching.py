"""Batch formation policies, chosen by name.

Every policy grows the batch of the highest-priority request ``H`` (the leader) with
candidates taken in priority order, within the token budget (inclusive: a 4096-token budget
admits a batch of exactly 4096). They differ in which deadlines they check:

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

* ``member-aware`` and ``headroom`` — each of those two changes alone (ablations; on the
  simulator ``headroom`` gets most of the gain, ``member-aware`` alone almost none).
* ``greedy`` — what DistServe / vLLM do: fill the token budget in queue order, stopping at
  the first request that does not fit. No deadline check (the simulator's baselines).
* ``none`` — never batch (the paper's "no batching" ablation).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from flowprefill.contracts.names import Batching
from flowprefill.prefill.request import Request

PredictFn = Callable[[int], float]
"""Predicted prefill latency in seconds for a batch of ``n`` tokens."""


class BatchingPolicy(Protocol):
    name: Batching

    def form_batch(
        self,
        leader: Request,
        candidates: Iterable[Request],
        *,
        now_s: float,
        predict_s: PredictFn,
        token_budget: int,
    ) -> list[Request]:
        """Return the batch, leader first; ``candidates`` come in priority order."""
        ...


class SLOAwareBatching:
    """Algorithm 1: a candidate joins while the grown batch fits the leader's remaining time.

    ``fraction`` is the share of that time the batch may take (1 for the paper's rule).
    """

    name = Batching.SLO_AWARE
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
        for r in candidates:
            grown = num_tokens + r.num_tokens
            # Budget is inclusive: a 4096-token budget admits a batch of exactly 4096.
            if grown <= token_budget and allowed_s > predict_s(grown):
                batch.append(r)
                num_tokens = grown
        return batch


class HeadroomBatching(SLOAwareBatching):
    """``slo-aware`` whose batches keep half of the leader's remaining time free."""

    name = Batching.HEADROOM
    fraction = 0.5


class NoBatching:
    name = Batching.NONE

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


class GreedyBatching:
    """Fill the budget in queue order; stop at the first request that does not fit."""

    name = Batching.GREEDY

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
        for r in candidates:
            if num_tokens + r.num_tokens > token_budget:
                break
            batch.append(r)
            num_tokens += r.num_tokens
        return batch


class MemberAwareBatching:
    """Every member's deadline counts; late leaders are batched with late requests."""

    name = Batching.MEMBER_AWARE
    fraction = 1.0
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
        for r in candidates:
            grown = num_tokens + r.num_tokens
            if grown > token_budget:
                continue
            remaining_s = r.deadline_s - now_s
            late = remaining_s < predict_s(r.num_tokens)
            if leader_late:
                ok = late
            else:
                allowed_s = self.fraction * min(tightest_s, remaining_s)
                ok = not late and predict_s(grown) < allowed_s
            if ok:
                batch.append(r)
                num_tokens = grown
                tightest_s = min(tightest_s, remaining_s)
        return batch


class MemberHeadroomBatching(MemberAwareBatching):
    """``member-aware`` whose batches also keep half the tightest member's slack free."""

    name = Batching.MEMBER_HEADROOM
    fraction = 0.5


BATCHING: dict[Batching, type[BatchingPolicy]] = {
    b.name: b
    for b in (
        SLOAwareBatching,
        NoBatching,
        MemberHeadroomBatching,
        MemberAwareBatching,
        HeadroomBatching,
        GreedyBatching,
    )
}


def get_batching(name: str | Batching) -> BatchingPolicy:
    """Build a batching policy by name, parsed by :meth:`Batching.parse`."""
    return BATCHING[Batching.parse(name)]()
