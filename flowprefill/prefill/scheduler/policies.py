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
"""

from __future__ import annotations

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


def _sgn(x: float) -> int:
    return (x > 0) - (x < 0)


def _signed_deadline_key(sign: int, entry: RankInput) -> SortKey:
    if sign > 0:
        return (0.0, entry.deadline_s, entry.arrival_s, entry.seq)
    if sign == 0:
        return (1.0, 0.0, entry.arrival_s, entry.seq)
    return (2.0, -entry.deadline_s, entry.arrival_s, entry.seq)


class PriorityPolicy(Protocol):
    name: ClassVar[Policy]

    def sort_key(self, entry: RankInput, now_s: float) -> SortKey:
        """Smaller runs first."""
        ...

    def priority(self, entry: RankInput, now_s: float) -> float:
        """The paper's scalar priority (larger is more urgent), for metrics and tests."""
        ...


class SlackEDF:
    """S-EDF, the paper's policy (§5.2, eq. 3)."""

    name: ClassVar[Policy] = Policy.S_EDF

    @staticmethod
    def slack_s(entry: RankInput, now_s: float) -> float:
        return entry.deadline_s - now_s - entry.predicted_remaining_s

    def sort_key(self, entry: RankInput, now_s: float) -> SortKey:
        return _signed_deadline_key(_sgn(self.slack_s(entry, now_s)), entry)

    def priority(self, entry: RankInput, now_s: float) -> float:
        return _sgn(self.slack_s(entry, now_s)) / entry.deadline_s


class DeadlineEDF:
    """D-EDF (paper §6.3): requests whose deadline already passed get the lowest priority."""

    name: ClassVar[Policy] = Policy.D_EDF

    def sort_key(self, entry: RankInput, now_s: float) -> SortKey:
        return _signed_deadline_key(_sgn(entry.deadline_s - now_s), entry)

    def priority(self, entry: RankInput, now_s: float) -> float:
        return _sgn(entry.deadline_s - now_s) / entry.deadline_s


class EDF:
    name: ClassVar[Policy] = Policy.EDF

    def sort_key(self, entry: RankInput, now_s: float) -> SortKey:
        return (entry.deadline_s, entry.arrival_s, entry.seq)

    def priority(self, entry: RankInput, now_s: float) -> float:
        return 1.0 / entry.deadline_s


class FCFS:
    name: ClassVar[Policy] = Policy.FCFS

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
