"""Hand-checkable cost models and helpers for the simulator tests."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from flowprefill.lab.sim.cost import PassCost, Segment
from flowprefill.lab.sim.profile import split_evenly
from flowprefill.prefill.predictor.model import TTFTPredictor
from flowprefill.prefill.request import Request


class ToyCost:
    """Every token costs ``per_token_s``; a pass pays ``overhead_s`` first; each cached
    prefix token of a chunk costs ``reread_s`` (the KV re-read). The pass's token work is
    split evenly over ``num_layers`` × 5 segments; each checkpoint costs ``checkpoint_s``
    (the TP ranks' agreement)."""

    name = "toy"
    max_context_tokens = 1 << 20

    def __init__(
        self,
        per_token_s: float = 1e-3,
        *,
        overhead_s: float = 0.0,
        reread_s: float = 0.0,
        num_layers: int = 2,
        checkpoint_s: float = 0.0,
    ) -> None:
        self.per_token_s = per_token_s
        self.overhead_s = overhead_s
        self.reread_s = reread_s
        self.num_layers = num_layers
        self.checkpoint_s = checkpoint_s

    def pass_cost(self, segments: Sequence[Segment]) -> PassCost:
        work = sum(c for c, _ in segments) * self.per_token_s
        work += sum(p for _, p in segments) * self.reread_s
        op = work / (5 * self.num_layers)
        return PassCost(self.overhead_s, (op,) * 5, self.num_layers)

    def split_pass_cost(self, segments: Sequence[Segment], max_blocking_s: float) -> PassCost:
        """Equal pieces, no added cost."""
        return split_evenly(self.pass_cost(segments), max_blocking_s, 0.0)

    def ideal_cost_s(self, num_tokens: int) -> float:
        return num_tokens * self.per_token_s


PREDICTOR = TTFTPredictor.linear(per_token_s=1e-3)
"""Exact for ToyCost() without overheads."""


def req(rid: str, arrival_s: float, num_tokens: int, slo_s: float, cls: str = "x") -> Request:
    return Request.create(
        rid, arrival_s=arrival_s, ttft_slo_s=slo_s, num_tokens=num_tokens, slo_class=cls
    )


@pytest.fixture
def toy() -> ToyCost:
    return ToyCost()
