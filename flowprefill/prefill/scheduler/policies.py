"""Priority policies behind one interface, chosen by name (an ablation is a config change).

Each policy maps a runnable entry to a sort key; the scheduler runs the entry with the
*smallest* key. Keys are tuples instead of the paper's float ``sgn(slack) / deadline`` so
that ties and precision never depend on the clock's epoch, but they order entries exactly
as the formula does for positive deadlines:

* S-EDF (default): ``sgn(slack) / deadline`` with ``slack = deadline - now - remaining``.
  Feasible entries first by earliest deadline; then slack exactly zero; then infeasible
  entries, *latest* deadline first (``-1/d`` grows with ``d``), i.e. those least late.
* D-EDF: the same with ``sgn(deadline - now)``: only already-missed deadlines sink.
* EDF: earliest deadline first.
* FCFS: earliest arrival first.

Every key ends with ``(arrival_s, seq)`` so the order is total and deterministic.

A key moves with time at one instant at most: :meth:`PriorityPolicy.phases` says which
(``switch_s``: an entry's latest feasible start for S-EDF, its deadline for D-EDF, never
for EDF and FCFS) and the keys before, at and after it. ``sort_key`` is defined through
it (each policy's own ``sort_key`` computes the one key it needs without building the
others; ``tests/prefill/scheduler/test_policies.py`` checks the two agree), so a queue
indexed by phases (:mod:`flowprefill.prefill.scheduler.waiting`) orders entries exactly
as ranking them all would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Protocol

from flowprefill.contracts.names import Policy


@dataclass(frozen=True, slots=True)
class RankInput:
    """What a policy may look at: one waiting request or one (running/preempted) task."""

    deadline_s: float
    arrival_s: float
    predicted_remaining_s: float
    seq: int


SortKey = tuple[float, ...]

NEVER = math.inf
"""``switch_s`` of a key that does not move with time."""


@dataclass(frozen=True, slots=True)
class Phases:
    """An entry's key over time: ``before`` while ``now < switch_s``, ``at`` when
    ``now == switch_s``, ``after`` once ``now > switch_s``."""

    switch_s: float
    before: SortKey
    at: SortKey
    after: SortKey

    def key(self, now_s: float) -> SortKey:
        if now_s < self.switch_s:
            return self.before
        return self.at if now_s == self.switch_s else self.after

    @classmethod
    def fixed(cls, key: SortKey) -> Phases:
        return cls(NEVER, key, key, key)


def _sgn(x: float) -> int:
    return (x > 0) - (x < 0)


def _signed_deadline_phases(switch_s: float, entry: RankInput) -> Phases:
    """Feasible (by deadline) until ``switch_s``; then, once past it, least late first."""
    return Phases(
        switch_s,
        (0.0, entry.deadline_s, entry.arrival_s, entry.seq),
        (1.0, 0.0, entry.arrival_s, entry.seq),
        (2.0, -entry.deadline_s, entry.arrival_s, entry.seq),
    )


class PriorityPolicy(Protocol):
    name: ClassVar[Policy]

    def phases(self, entry: RankInput) -> Phases:
        """The entry's key at every instant (as long as its rank input holds)."""
        ...

    def sort_key(self, entry: RankInput, now_s: float) -> SortKey:
        """Smaller runs first: ``phases(entry).key(now_s)``."""
        ...

    def priority(self, entry: RankInput, now_s: float) -> float:
        """The paper's scalar priority (larger is more urgent), for metrics and tests."""
        ...


class _ByPhases:
    def phases(self, entry: RankInput) -> Phases:
        raise NotImplementedError

    def sort_key(self, entry: RankInput, now_s: float) -> SortKey:
        return self.phases(entry).key(now_s)


def _signed_deadline_key(switch_s: float, entry: RankInput, now_s: float) -> SortKey:
    """``_signed_deadline_phases(switch_s, entry).key(now_s)`` without building the three
    keys (a round keys the running task and its batch this way; the tests compare the
    two on every side of the switch)."""
    if now_s < switch_s:
        return (0.0, entry.deadline_s, entry.arrival_s, entry.seq)
    if now_s == switch_s:
        return (1.0, 0.0, entry.arrival_s, entry.seq)
    return (2.0, -entry.deadline_s, entry.arrival_s, entry.seq)


class SlackEDF(_ByPhases):
    """S-EDF, the paper's policy (§5.2, eq. 3). The sign of the slack is that of
    ``latest_start - now`` (``latest_start = deadline - remaining``): one subtraction, so
    an entry changes key exactly once, at its latest feasible start."""

    name: ClassVar[Policy] = Policy.S_EDF

    @staticmethod
    def latest_start_s(entry: RankInput) -> float:
        return entry.deadline_s - entry.predicted_remaining_s

    @classmethod
    def slack_s(cls, entry: RankInput, now_s: float) -> float:
        return cls.latest_start_s(entry) - now_s

    def phases(self, entry: RankInput) -> Phases:
        return _signed_deadline_phases(self.latest_start_s(entry), entry)

    def sort_key(self, entry: RankInput, now_s: float) -> SortKey:
        return _signed_deadline_key(entry.deadline_s - entry.predicted_remaining_s, entry, now_s)

    def priority(self, entry: RankInput, now_s: float) -> float:
        return _sgn(self.slack_s(entry, now_s)) / entry.deadline_s


class DeadlineEDF(_ByPhases):
    """D-EDF (paper §6.3): requests whose deadline already passed get the lowest priority."""

    name: ClassVar[Policy] = Policy.D_EDF

    def phases(self, entry: RankInput) -> Phases:
        return _signed_deadline_phases(entry.deadline_s, entry)

    def sort_key(self, entry: RankInput, now_s: float) -> SortKey:
        return _signed_deadline_key(entry.deadline_s, entry, now_s)

    def priority(self, entry: RankInput, now_s: float) -> float:
        return _sgn(entry.deadline_s - now_s) / entry.deadline_s


class EDF(_ByPhases):
    name: ClassVar[Policy] = Policy.EDF

    def phases(self, entry: RankInput) -> Phases:
        return Phases.fixed((entry.deadline_s, entry.arrival_s, entry.seq))

    def sort_key(self, entry: RankInput, now_s: float) -> SortKey:
        return (entry.deadline_s, entry.arrival_s, entry.seq)

    def priority(self, entry: RankInput, now_s: float) -> float:
        return 1.0 / entry.deadline_s


class FCFS(_ByPhases):
    name: ClassVar[Policy] = Policy.FCFS

    def phases(self, entry: RankInput) -> Phases:
        return Phases.fixed((entry.arrival_s, entry.seq))

    def sort_key(self, entry: RankInput, now_s: float) -> SortKey:
        return (entry.arrival_s, entry.seq)

    def priority(self, entry: RankInput, now_s: float) -> float:
        return -entry.arrival_s


POLICIES: dict[Policy, type[PriorityPolicy]] = {
    p.name: p for p in (SlackEDF, DeadlineEDF, EDF, FCFS)
}


def get_policy(name: str | Policy) -> PriorityPolicy:
    """Build a policy by name, parsed by :meth:`Policy.parse` (``S_EDF`` is ``s-edf``)."""
    return POLICIES[Policy.parse(name)]()
