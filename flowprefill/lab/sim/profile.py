"""The engine's own profile as a cost model (``flowprefill simulate --profile``)."""

from __future__ import annotations

from collections.abc import Sequence

from flowprefill.errors import InvalidRequestError
from flowprefill.lab.sim.cost import PassCost, Segment
from flowprefill.lab.sim.split import CPU_PIECE_OVERHEAD_S, even_pieces
from flowprefill.prefill.predictor.model import TTFTPredictor


class ProfileCostModel:
    """The engine's measured ``poly(n)`` (a ``flowprefill profile`` JSON) as a cost model.

    A pass costs ``a + Σ_r [poly(p_r + c_r) − poly(p_r)]`` over its requests ``r`` (``c_r``
    new tokens after ``p_r`` cached ones; ``a`` = the fit's constant term): the engine packs
    a batch into one row and runs attention per request segment, so the linear work adds
    up and each request brings its own quadratic term. One request from scratch costs
    exactly ``predict_s(n)``. The pass is split evenly into ``num_layers`` × 5
    checkpointed segments (the profile has no per-operator times).
    """

    checkpoint_s = 0.0
    """The profiled engine runs on one device: a checkpoint is a flag read, in the profile."""

    def __init__(
        self,
        predictor: TTFTPredictor,
        *,
        num_layers: int = 4,
        max_tokens: int = 0,
        split_overhead_s: float = CPU_PIECE_OVERHEAD_S,
    ):
        if num_layers < 1:
            raise InvalidRequestError(f"--profile-layers must be ≥ 1, got {num_layers}")
        self.predictor = predictor
        self.split_overhead_s = split_overhead_s
        self.num_layers = num_layers
        self.name = f"profile:{predictor.model or 'engine'}@{predictor.hardware or 'cpu'}"
        self.max_context_tokens = max_tokens or max(predictor.max_tokens * 8, 32768)
        self._coef = list(predictor.coefficients)

    def _poly(self, n: float) -> float:
        acc = 0.0
        for c in reversed(self._coef):
            acc = acc * n + c
        return acc

    def pass_cost(self, segments: Sequence[Segment]) -> PassCost:
        poly = self._poly
        total = self._coef[0] + sum(poly(p + c) - poly(p) for c, p in segments)
        total = max(total, self.predictor.min_latency_s)
        op = total / (5 * self.num_layers)
        return PassCost(0.0, (op,) * 5, self.num_layers)

    def split_pass_cost(self, segments: Sequence[Segment], max_blocking_s: float) -> PassCost:
        """Equal pieces (the profile's work is linear in rows and in query-key pairs, so a
        piece costs its share), ``split_overhead_s`` per added piece."""
        return split_evenly(self.pass_cost(segments), max_blocking_s, self.split_overhead_s)

    def ideal_cost_s(self, num_tokens: int) -> float:
        return max(self._poly(num_tokens) - self._coef[0], 0.0)


def split_evenly(cost: PassCost, max_blocking_s: float, overhead_s: float) -> PassCost:
    """``cost`` with every segment longer than the bound cut into ``ceil(t / b)`` equal
    pieces (:func:`~flowprefill.lab.sim.split.even_pieces`): for cost models without a
    finer per-operator model."""
    if max(cost.op_s, default=0.0) <= max_blocking_s:
        return cost
    split = [even_pieces(t, max_blocking_s, overhead_s) for t in cost.op_s]
    return PassCost(
        cost.pre_s,
        tuple(t for pieces in split for t in pieces),
        cost.num_layers,
        tuple(len(pieces) for pieces in split),
    )
