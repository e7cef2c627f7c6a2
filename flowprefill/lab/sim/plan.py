"""Where a simulated task can be preempted: its timeline and checkpoint positions.

A task (a batch of requests) runs as one forward pass, or as one pass per chunk when the
system uses chunked prefill (the chunk covers ``chunk_size`` tokens of the batch laid end to
end; each request's tokens in a later chunk attend to its earlier ones). Positions are
*elapsed run time* of the task, in seconds from its first operator.

Checkpoints, mirroring the engine's executor (flowprefill/prefill/executor/checkpoints.py):

* ``operator`` — after every checkpointed segment of every layer (qkv_proj, attention,
  o_proj, gate_up, down_proj), including the very last one: the engine's hook after the
  last ``down_proj`` fires too, so a task preempted there parks with progress 1.0 and
  only finishes when it is resumed.
* ``layer`` — after every decoder layer (the last one included, as above).
* ``none`` — only between chunks (no chunks: never). A preempt issued during the last
  chunk waits for the task to *finish*: the pool reports "not parked".
* ``instant`` — the oracle: anywhere, at no cost.

A preempt signal raised at elapsed ``e`` is honoured at the first checkpoint at or after
``e``; the blocking time is the distance.

Run-time operator splitting (``max_blocking_s``, the engine's ``max_blocking_ms``; operator
granularity only): every segment predicted longer than the bound runs in pieces, with a
checkpoint after each piece (:meth:`~flowprefill.lab.sim.cost.CostModel.split_pass_cost`,
:mod:`.split`), so at operator granularity the checkpoints are after every *piece* of every
segment. Segments within the bound keep their single checkpoint; a pass with none over it
is exactly the unsplit one.

Tensor parallelism changes where nothing parks, only what a checkpoint costs: every rank
passes the same checkpoints and they park at the same checkpoint number (the paper's
synchronised counter, §5.1). The engine agrees on that number through a shared-memory
table each rank checks at *every* checkpoint (flowprefill/prefill/tp/agreement.py), so each
checkpoint of the granularity in use adds the cost model's ``checkpoint_s`` to the segment
(or piece) it ends: 5 per layer at operator level plus those splitting adds, 1 at layer
level, none for ``none`` (chunk boundaries are pass boundaries, already paid by the
per-pass overhead) and the free ``instant`` oracle.
Not modelled: the engine's target can lie past the checkpoint where the leader saw the
signal when a follower already ran ahead (at most to the next collective; usually it is
the same checkpoint), and the ACK waits for the slowest rank to park.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Final, TypeAlias

from flowprefill.contracts.names import Granularity
from flowprefill.errors import InvalidRequestError
from flowprefill.lab.sim.cost import CostModel, PassCost, Segment


class Oracle(Enum):
    """Preemption no engine has: anywhere, at no cost (the oracle systems' bound)."""

    INSTANT = "instant"


INSTANT: Final = Oracle.INSTANT
Preemption: TypeAlias = Granularity | Oracle
"""Where a simulated task can be preempted: at the checkpoints of an engine's
:class:`~flowprefill.contracts.names.Granularity`, or anywhere (:data:`INSTANT`)."""


def chunk_segments(lengths: Sequence[int], chunk_size: int | None) -> list[list[Segment]]:
    """Split a batch into passes: each pass is a list of ``(new, prefix)`` per request."""
    if chunk_size is None:
        return [[(n, 0) for n in lengths]]
    if chunk_size <= 0:
        raise InvalidRequestError(f"chunk size must be positive, got {chunk_size}")
    passes: list[list[Segment]] = []
    current: list[Segment] = []
    room = chunk_size
    for n in lengths:
        done = 0
        while done < n:
            take = min(room, n - done)
            current.append((take, done))
            done += take
            room -= take
            if room == 0:
                passes.append(current)
                current, room = [], chunk_size
    if current:
        passes.append(current)
    return passes


def with_checkpoints(cost: PassCost, granularity: Preemption, check_s: float) -> PassCost:
    """``cost`` with ``check_s`` added after every checkpoint ``granularity`` places in it."""
    if check_s <= 0 or granularity in (Granularity.NONE, INSTANT):
        return cost
    if granularity is Granularity.OPERATOR:
        op_s = tuple(op + check_s for op in cost.op_s)
    else:  # LAYER: one check at the end of each layer
        op_s = (*cost.op_s[:-1], cost.op_s[-1] + check_s)
    return PassCost(cost.pre_s, op_s, cost.num_layers, cost.pieces)


def check_max_blocking_s(max_blocking_s: float | None) -> None:
    if max_blocking_s is not None and not max_blocking_s > 0:
        raise InvalidRequestError(
            f"--max-blocking-ms must be positive (or none), got {max_blocking_s * 1e3:g}"
        )


@dataclass(frozen=True, slots=True)
class ExecutionPlan:
    passes: tuple[PassCost, ...]
    starts_s: tuple[float, ...]
    total_s: float
    granularity: Preemption
    op_ends_s: tuple[tuple[float, ...], ...]
    """Per pass: where each stretch of ``op_s`` ends within a layer (running sums)."""

    @classmethod
    def build(
        cls,
        cost: CostModel,
        lengths: Sequence[int],
        *,
        granularity: Preemption,
        chunk_size: int | None = None,
        max_blocking_s: float | None = None,
    ) -> ExecutionPlan:
        """``max_blocking_s`` splits operators (operator granularity only, as the engine)."""
        check_max_blocking_s(max_blocking_s)
        bound = max_blocking_s if granularity is Granularity.OPERATOR else None
        passes = tuple(
            with_checkpoints(
                cost.pass_cost(seg)
                if bound is None
                else with_layer_entry(cost.split_pass_cost(seg, bound)),
                granularity,
                cost.checkpoint_s,
            )
            for seg in chunk_segments(lengths, chunk_size)
        )
        starts: list[float] = []
        t = 0.0
        for p in passes:
            starts.append(t)
            t += p.total_s
        ends = tuple(tuple(itertools.accumulate(p.op_s)) for p in passes)
        return cls(passes, tuple(starts), t, granularity, ends)

    @property
    def num_added_checkpoints(self) -> int:
        """Checkpoints operator splitting added to this task."""
        return sum(p.num_added_checkpoints for p in self.passes)

    def next_checkpoint_s(self, elapsed_s: float) -> float | None:
        """First checkpoint at or after ``elapsed_s``; None if the task ends first."""
        g = self.granularity
        if g is INSTANT:
            return min(elapsed_s, self.total_s)
        k = max(0, bisect.bisect_right(self.starts_s, elapsed_s) - 1)
        start = self.starts_s[k]
        if k > 0 and elapsed_s == start:
            return start  # exactly at a chunk boundary, which is a checkpoint
        if g is Granularity.NONE:
            return self.starts_s[k + 1] if k + 1 < len(self.starts_s) else None
        p = self.passes[k]
        y = elapsed_s - start - p.pre_s
        layer_s = p.layer_s
        if layer_s <= 0:
            return start + p.total_s
        if g is Granularity.LAYER:
            n = min(max(math.ceil(y / layer_s), 1), p.num_layers)
            return start + p.pre_s + n * layer_s
        # OPERATOR
        if y <= 0:
            return start + p.pre_s + p.op_s[0]
        layer = min(int(y // layer_s), p.num_layers - 1)
        within = y - layer * layer_s
        if within <= 0:
            return start + p.pre_s + layer * layer_s  # exactly at the previous layer's end
        ends = self.op_ends_s[k]
        i = bisect.bisect_left(ends, within)  # the first stretch ending at or after it
        if i < len(ends):
            return start + p.pre_s + layer * layer_s + ends[i]
        # Rounding put us past the layer's end: the next checkpoint is the next layer's first.
        if layer + 1 < p.num_layers:
            return start + p.pre_s + (layer + 1) * layer_s + p.op_s[0]
        return start + p.total_s

    def progress(self, elapsed_s: float) -> float:
        """Fraction of the task's run time done (what ``Task.progress`` reports)."""
        if self.total_s <= 0:
            return 1.0
        return min(1.0, max(0.0, elapsed_s / self.total_s))


def with_layer_entry(pc: PassCost) -> PassCost:
    """The engine's checkpoint at the entry of every decoder layer when it splits
    (flowprefill/prefill/executor/runner.py): a zero-length stretch first in each layer. Only the
    first layer's matters for blocking — it ends the pass's prologue (per-pass overhead and
    embedding), which otherwise shares a stretch with layer 0's first segment."""
    pieces = pc.pieces or (1,) * len(pc.op_s)
    return PassCost(pc.pre_s, (0.0, *pc.op_s), pc.num_layers, (pieces[0] + 1, *pieces[1:]))
