"""The waiting queue ``Q_w``, kept in priority order at every instant without re-ranking.

A waiting request's rank input never changes, so its policy key changes at one instant at
most (:class:`~flowprefill.prefill.scheduler.policies.Phases`: S-EDF's latest feasible
start). The queue keeps each request under the key it has now and moves it when its
instant passes, so a round asks for the most urgent request, or the requests in order,
instead of ranking the whole queue:

- ``early``: keyed by ``before``; ``switches``: the same requests by ``switch_s``;
- ``late``: requests whose instant passed, keyed by ``after``;
- a request whose instant is exactly now has its ``at`` key (found in ``switches``).

The lists exist twice: for the whole queue (the most urgent request, the order), and per
power-of-two bucket of token counts, so that batching can skip every request too large
for the room left in its batch (:class:`Candidates`) a bucket at a time.

Costs with ``n`` waiting requests (sortedcontainers' SortedList): add and remove
O(log n); :meth:`WaitingQueue.first` O(1); ordered iteration O(log n) per request
yielded, plus the requests of a bucket that only partly fits, skipped one by one; a
request moves from ``early`` to ``late`` once, O(log n). Time may go backwards (a
caller's clock, a test): the queue then re-sorts, O(n log n).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from sortedcontainers import SortedList

from flowprefill.prefill.request import Request
from flowprefill.prefill.scheduler.policies import Phases, PriorityPolicy, RankInput, SortKey

Keyed = tuple[SortKey, str]
"""(key, request_id): what the ordered lists hold (keys are unique: they end with seq)."""
_Head = tuple[SortKey, str, int, int, Any, Iterator[Keyed] | None]
"""A merge source's head: its key and request id, the source's number (ties: a request
may head two sources, with two keys, when its instant is now), its bucket (-1: none),
its list (None: the requests at their instant) and its iterator once started."""


def bucket_of(num_tokens: int) -> int:
    """Bucket ``b`` holds the requests of ``2**(b-1) <= num_tokens < 2**b`` tokens."""
    return max(num_tokens, 0).bit_length()


def smallest_in(bucket: int) -> int:
    return 0 if bucket == 0 else 1 << (bucket - 1)


@dataclass(slots=True)
class _Entry:
    request: Request
    rank: RankInput
    phases: Phases
    bucket: int
    late: bool = False


class _Bucket:
    __slots__ = ("early", "late")

    def __init__(self) -> None:
        self.early = SortedList()
        self.late = SortedList()

    def __len__(self) -> int:
        return len(self.early) + len(self.late)


class Candidates:
    """Waiting requests in priority order, for a batching policy to take from.

    ``max_tokens`` (None: no limit) is a promise by the consumer: it will take no request
    of more tokens than that, so the source may leave such requests out. A policy sets
    it to the room left in its token budget as its batch grows; one that never sets it
    sees every request.
    """

    def __init__(
        self, queue: WaitingQueue, now_s: float, skip: str | None, *, monotone: bool = False
    ) -> None:
        self.max_tokens: int | None = None
        self.monotone = monotone
        """The predictor never decreases in the token count (a policy may then promise
        to refuse every request larger than one refused as too slow)."""
        self._queue, self._now_s, self._skip = queue, now_s, skip

    def __iter__(self) -> Iterator[Request]:
        for _key, request in self._queue.ordered(self._now_s, self):
            if request.request_id != self._skip:
                yield request


class WaitingQueue:
    """``Q_w`` ordered by ``policy`` at any instant (each request with the rank input it
    was added with)."""

    def __init__(self, policy: PriorityPolicy) -> None:
        self.policy = policy
        self._entries: dict[str, _Entry] = {}
        self._all = _Bucket()
        self._buckets: dict[int, _Bucket] = {}
        self._switches = SortedList()  # (switch_s, seq, request_id) of early entries
        self._now_s = -math.inf
        self.num_tokens = 0
        """Prompt tokens of every waiting request (kept as they come and go)."""

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries

    def rank_input(self, request_id: str) -> RankInput | None:
        entry = self._entries.get(request_id)
        return entry.rank if entry is not None else None

    # ------------------------------------------------------------------ membership

    def add(self, request: Request, rank: RankInput) -> None:
        phases = self.policy.phases(rank)
        entry = _Entry(request, rank, phases, bucket_of(request.num_tokens))
        self._entries[request.request_id] = entry
        self.num_tokens += request.num_tokens
        self._place(entry)

    def remove(self, request_id: str) -> Request | None:
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return None
        self.num_tokens -= entry.request.num_tokens
        bucket = self._buckets[entry.bucket]
        for lists in (self._all, bucket):
            if entry.late:
                lists.late.remove((entry.phases.after, request_id))
            else:
                lists.early.remove((entry.phases.before, request_id))
        if not entry.late and entry.phases.switch_s != math.inf:
            self._switches.remove(self._switch_item(entry))
        if not bucket:
            del self._buckets[entry.bucket]
        return entry.request

    def _place(self, entry: _Entry) -> None:
        bucket = self._buckets.get(entry.bucket)
        if bucket is None:
            bucket = self._buckets[entry.bucket] = _Bucket()
        rid = entry.request.request_id
        entry.late = entry.phases.switch_s < self._now_s
        for lists in (self._all, bucket):
            if entry.late:
                lists.late.add((entry.phases.after, rid))
            else:
                lists.early.add((entry.phases.before, rid))
        if not entry.late and entry.phases.switch_s != math.inf:
            self._switches.add(self._switch_item(entry))

    @staticmethod
    def _switch_item(entry: _Entry) -> tuple[float, int, str]:
        return (entry.phases.switch_s, entry.rank.seq, entry.request.request_id)

    # ------------------------------------------------------------------ time

    def advance(self, now_s: float) -> None:
        """Move every request whose instant is before ``now_s`` to its ``after`` key."""
        if now_s < self._now_s:
            entries = list(self._entries.values())
            self._all = _Bucket()
            self._buckets.clear()
            self._switches.clear()
            self._now_s = now_s
            for entry in entries:
                self._place(entry)
            return
        self._now_s = now_s
        switches = self._switches
        while switches and switches[0][0] < now_s:
            _, _, rid = switches.pop(0)
            entry = self._entries[rid]
            entry.late = True
            for lists in (self._all, self._buckets[entry.bucket]):
                lists.early.remove((entry.phases.before, rid))
                lists.late.add((entry.phases.after, rid))

    def _at_now(self, now_s: float) -> list[tuple[int, Keyed]]:
        """Early requests whose instant is exactly ``now_s``: (bucket, (``at`` key, id))."""
        switches = self._switches
        if not switches or switches[0][0] != now_s:  # after advance(): none is before now
            return []
        # irange, not islice: positions would make SortedList re-index after every change.
        found = []
        for _, _, rid in switches.irange((now_s,), (now_s, math.inf)):
            entry = self._entries[rid]
            found.append((entry.bucket, (entry.phases.at, rid)))
        return found

    # ------------------------------------------------------------------ order

    def first(self, now_s: float) -> tuple[SortKey, Request] | None:
        """The most urgent waiting request at ``now_s`` and its key."""
        self.advance(now_s)
        if self._at_now(now_s):
            return next(self.ordered(now_s), None)  # rare: a float instant hit exactly
        early, late = self._all.early, self._all.late
        if early and (not late or early[0] < late[0]):
            key, rid = early[0]
        elif late:
            key, rid = late[0]
        else:
            return None
        return key, self._entries[rid].request

    def ordered(
        self, now_s: float, limit: Candidates | None = None
    ) -> Iterator[tuple[SortKey, Request]]:
        """Every waiting request with its key at ``now_s``, most urgent first; with
        ``limit``, those of more than ``limit.max_tokens`` tokens (read as it changes) may
        be left out, a whole bucket at a time where none of it fits.

        Merges sorted sources: each bucket's ``early`` and ``late`` lists (the whole
        queue's without ``limit``), and the requests whose instant is exactly now. A
        source is iterated only once its head has been taken."""
        self.advance(now_s)
        at_now = self._at_now(now_s)
        skip = {rid for _, (_, rid) in at_now}
        heads: list[_Head] = []
        groups = [(-1, self._all)] if limit is None else list(self._buckets.items())
        for number, lists in groups:
            for side in (lists.early, lists.late):
                if side:
                    heads.append((*side[0], len(heads), number, side, None))
        for number, keyed in at_now:
            bucket = number if limit is not None else -1
            heads.append((*keyed, len(heads), bucket, None, iter(())))
        heapq.heapify(heads)
        while heads:
            key, rid, tie, number, side, following = heapq.heappop(heads)
            if following is None:
                assert side is not None
                following = iter(side)
                next(following)  # the head, being taken now
            room = limit.max_tokens if limit is not None else None
            if room is not None and number >= 0 and smallest_in(number) > room:
                continue  # nothing left in this source can fit: drop it
            request = self._entries[rid].request
            fits = room is None or request.num_tokens <= room
            if fits and (rid not in skip or side is None):  # an early head at now: its key is "at"
                yield key, request
            for item in following:
                if item[1] not in skip:
                    heapq.heappush(heads, (*item, tie, number, side, following))
                    break

    def requests(self) -> Iterator[Request]:
        """In arrival order of the calls to :meth:`add`."""
        return (entry.request for entry in self._entries.values())
