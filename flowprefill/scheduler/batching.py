"""Batch formation policies, chosen by name.

``slo-aware`` is the paper's Algorithm 1: grow the batch of the highest-priority request
``H`` with candidates (in priority order) while the predicted latency of the grown batch
still fits in ``H``'s remaining time and the batch stays within the token budget.
``none`` never batches (the paper's "no batching" ablation).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from flowprefill.errors import UnknownNameError
from flowprefill.request import Request

PredictFn = Callable[[int], float]
"""Predicted prefill latency in seconds for a batch of ``n`` tokens."""


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
        """Return the batch, leader first; ``candidates`` come in priority order."""
        ...


class SLOAwareBatching:
    name = "slo-aware"

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
        remaining_s = leader.deadline_s - now_s
        num_tokens = leader.num_tokens
        for r in candidates:
            grown = num_tokens + r.num_tokens
            # Budget is inclusive: a 4096-token budget admits a batch of exactly 4096.
            if grown <= token_budget and remaining_s > predict_s(grown):
                batch.append(r)
                num_tokens = grown
        return batch


class NoBatching:
    name = "none"

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


BATCHING: dict[str, type[BatchingPolicy]] = {b.name: b for b in (SLOAwareBatching, NoBatching)}


def get_batching(name: str) -> BatchingPolicy:
    cls = BATCHING.get(name.lower().replace("_", "-"))
    if cls is None:
        raise UnknownNameError("batching policy", name, sorted(BATCHING))
    return cls()
