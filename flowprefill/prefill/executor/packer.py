"""The bound a split forward keeps, the rates that predict an operator's time, and the
packer that places checkpoints between a forward's pieces.

Plain state with no hooks of its own: :mod:`.splitting` installs the split operators that
feed the packer, and :mod:`.context` holds the packer bound to the thread's forward pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from flowprefill.prefill.executor.tiling import MIN_ROWS, RowProfile


@dataclass(frozen=True, slots=True)
class SplitRates:
    """How fast this device runs the two kinds of operator, in FLOP per second, and,
    where measured (CUDA), each decoder weight shape's GEMM time by row count, keyed by
    its FLOP per row (equal shapes, equal key)."""

    gemm_flop_per_s: float
    attention_flop_per_s: float
    gemm_profiles: dict[float, RowProfile] = field(default_factory=dict)
    piece_overhead_s: float = 0.0
    """What the tile planner charges per tile (its checkpoint); only used with profiles."""

    def to_vector(self) -> list[float]:
        """Flat floats (tensor parallelism broadcasts rank 0's): the two rates, the
        overhead, then per profile its key, its length and its rows and seconds."""
        out = [self.gemm_flop_per_s, self.attention_flop_per_s, self.piece_overhead_s]
        for key, profile in self.gemm_profiles.items():
            out += [key, float(len(profile.rows)), *map(float, profile.rows), *profile.seconds]
        return out

    @classmethod
    def from_vector(cls, values: Sequence[float]) -> SplitRates:
        profiles: dict[float, RowProfile] = {}
        i = 3
        while i < len(values):
            key, n = values[i], int(values[i + 1])
            rows = tuple(int(x) for x in values[i + 2 : i + 2 + n])
            profiles[key] = RowProfile(rows, tuple(values[i + 2 + n : i + 2 + 2 * n]))
            i += 2 + 2 * n
        return cls(values[0], values[1], profiles, values[2])


@dataclass(frozen=True, slots=True)
class SplitPolicy:
    """The bound and the rates that turn an operator's size into a predicted time."""

    max_blocking_s: float
    rates: SplitRates

    def tile_rows(self, flop_per_row: float) -> int:
        """Most rows of a row-wise operator costing ``flop_per_row`` that fit the bound."""
        budget = self.max_blocking_s * self.rates.gemm_flop_per_s
        return max(MIN_ROWS, int(budget // max(flop_per_row, 1.0)))

    def attention_pair_budget(self, flop_per_pair: float) -> float:
        """Query-key pairs that fit the bound (``flop_per_pair`` = 4 · heads · head_dim)."""
        return self.max_blocking_s * self.rates.attention_flop_per_s / max(flop_per_pair, 1.0)


class Packer:
    """Greedy packing of one forward's pieces between checkpoints, on the forward's thread.

    Every piece (a whole operator, a tile, an attention block) adds its predicted time;
    a piece that would take the stretch since the last checkpoint past the bound gets a
    checkpoint before it. So an operator over the bound runs in pieces each within it,
    several short operators in a row (q, k and v projections) share a stretch while they
    fit, and the last tile of one operator never adds to the first of the next. The
    hook checkpoints (operator boundaries) start a new stretch too (:meth:`reset`).
    """

    __slots__ = ("on_boundary", "policy", "used_s")

    def __init__(self, policy: SplitPolicy, on_boundary: Callable[[], None]) -> None:
        self.policy = policy
        self.on_boundary = on_boundary
        self.used_s = 0.0

    def piece(self, seconds: float) -> None:
        if self.used_s > 0.0 and self.used_s + seconds > self.policy.max_blocking_s:
            self.on_boundary()
            self.used_s = 0.0
        self.used_s += seconds

    def hook(self) -> None:
        """An operator-boundary checkpoint was passed: a new stretch starts."""
        self.used_s = 0.0

    def split_start(self) -> None:
        """A split operator begins: checkpoint first. What ran since the last checkpoint
        is not all predicted (norms, RoPE, the MLP's activation, the KV cache append: ~16
        ms at 4K tokens on one CPU thread) and must not share a stretch with a full piece."""
        self.on_boundary()
        self.used_s = 0.0

    def count(self, seconds: Sequence[float], split: bool) -> int:
        """Checkpoints :meth:`piece` (and :meth:`split_start` when ``split``) would add
        for these pieces, without adding them."""
        added, used, bound = 0, self.used_s, self.policy.max_blocking_s
        if split:
            added, used = 1, 0.0
        for t in seconds:
            if used > 0.0 and used + t > bound:
                added += 1
                used = 0.0
            used += t
        self.used_s = used
        return added
