"""Batching policies the simulator adds, behind the engine's own ``BatchingPolicy`` protocol.

The engine's :mod:`flowprefill.scheduler.batching` has ``slo-aware`` and ``none``. The
baselines and the "beyond the paper" experiments need two more; they implement the same
protocol and are handed to the same :class:`~flowprefill.scheduler.core.Scheduler`:

* ``greedy`` — what DistServe / vLLM do: fill the token budget in queue (priority) order,
  stopping at the first request that does not fit. No deadline check.
* ``member-aware`` — SLO-aware batching that also looks at each member: a candidate joins
  only if the grown batch still finishes before *its own* deadline as well as the leader's,
  and a candidate that cannot make its deadline even alone (negative slack) never joins a
  feasible leader. When the leader itself is already late, the batch is filled greedily with
  other late requests: they are misses either way, and clearing them in full batches costs
  the feasible ones less device time than one by one (Algorithm 1 runs a late leader alone,
  because no prediction fits a negative remaining time).
* ``headroom`` — SLO-aware batching that spends only half of the leader's remaining time
  on growing the batch (``predict_s(grown) < 0.5 · (deadline − now)``). A batch cannot be
  preempted by a request due later than its leader, so a batch that fills the leader's
  whole slack makes every urgent request arriving meanwhile wait for it; keeping half the
  slack free bounds that wait.
* ``member-headroom`` — both: member-aware rules, late leaders batched with late
  requests, and half of the tightest member's slack kept free. The one that measurably
  helps on both workloads (docs/simulator.md, "Beyond the paper").
"""

from __future__ import annotations

from collections.abc import Iterable

from flowprefill.errors import UnknownNameError
from flowprefill.request import Request
from flowprefill.scheduler.batching import BATCHING, BatchingPolicy, PredictFn, get_batching


class GreedyBatching:
    name = "greedy"

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
    name = "member-aware"
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

    name = "member-headroom"
    fraction = 0.5


class HeadroomBatching:
    name = "headroom"
    fraction = 0.5
    """Share of the leader's remaining time a batch may take."""

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
            if grown <= token_budget and allowed_s > predict_s(grown):
                batch.append(r)
                num_tokens = grown
        return batch


SIM_BATCHING: dict[str, type[BatchingPolicy]] = {
    b.name: b
    for b in (GreedyBatching, MemberAwareBatching, HeadroomBatching, MemberHeadroomBatching)
}


def build_batching(name: str) -> BatchingPolicy:
    """The engine's policies by name, plus the simulator's."""
    key = name.lower().replace("_", "-")
    if key in BATCHING:
        return get_batching(key)
    cls = SIM_BATCHING.get(key)
    if cls is None:
        raise UnknownNameError("batching policy", name, sorted({*BATCHING, *SIM_BATCHING}))
    return cls()
