"""Batchings only the simulator's ablations and baselines run, next to the engine's own.

The engine offers the batchings of :mod:`flowprefill.prefill.scheduler.batching`; the
systems of :mod:`flowprefill.lab.sim.systems` also compare:

* ``member-aware`` and ``headroom`` — each of the two changes ``member-headroom`` makes to
  Algorithm 1, alone (on the simulator ``headroom`` gets most of the gain, ``member-aware``
  alone almost none; docs/simulator.md, "Beyond the paper");
* ``greedy`` — what DistServe / vLLM do: fill the token budget in queue order, stopping at
  the first request that does not fit. No deadline check (the baselines).

:func:`get_batching` builds any of them, or any of the engine's, by name.
"""

from __future__ import annotations

from collections.abc import Iterable

from flowprefill.contracts.names import Batching, Name
from flowprefill.errors import UnknownNameError
from flowprefill.prefill.request import Request
from flowprefill.prefill.scheduler.batching import (
    BATCHING,
    BatchingPolicy,
    MemberHeadroomBatching,
    PredictFn,
    SLOAwareBatching,
)


class AblationBatching(Name):
    """Batchings of the simulator's systems that the engine does not offer."""

    MEMBER_AWARE = "member-aware"
    HEADROOM = "headroom"
    GREEDY = "greedy"


class HeadroomBatching(SLOAwareBatching):
    """``slo-aware`` whose batches keep half of the leader's remaining time free."""

    name: str = AblationBatching.HEADROOM
    fraction = 0.5


class MemberAwareBatching(MemberHeadroomBatching):
    """``member-headroom`` without the headroom: a batch may take all of the tightest
    member's remaining time."""

    name: str = AblationBatching.MEMBER_AWARE
    fraction = 1.0


class GreedyBatching:
    """Fill the budget in queue order; stop at the first request that does not fit."""

    name: str = AblationBatching.GREEDY

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


SIM_BATCHING: dict[str, type[BatchingPolicy]] = {
    **BATCHING,
    AblationBatching.MEMBER_AWARE: MemberAwareBatching,
    AblationBatching.HEADROOM: HeadroomBatching,
    AblationBatching.GREEDY: GreedyBatching,
}
"""Every batching a simulated system may name: the engine's and the ablations'."""


def get_batching(name: str) -> BatchingPolicy:
    """Build a batching policy by name (the engine's or an ablation's), parsed leniently
    as :meth:`~flowprefill.contracts.names.Name.parse` does."""
    for names in (Batching, AblationBatching):
        try:
            return SIM_BATCHING[names.parse(name)]()
        except UnknownNameError:
            continue
    raise UnknownNameError(Batching.describe(), str(name), list(SIM_BATCHING))
