"""The waiting queue ``Q_w``, kept in priority order at every instant without re-ranking.

A waiting request's rank input never changes, so its policy key changes at one instant at
most (:class:`~flowprefill.prefill.scheduler.policies.Phases`: S-EDF's latest feasible
start). The queue keeps each request under the key it has now and moves it when its
instant passes, so a round asks for the most urgent request, or the requests in order,
instead of ranking the whole queue:

- ``early``: keyed by ``before``; ``switches``: the same requests by ``switch_s``;
- ``late``: requests whose instant passed, keyed by ``after``;
- a request whose instant is exactly now has its ``at`` key (found in ``switches``).

These are binary heaps (``heapq``), one pair per power-of-two bucket of prompt lengths,
so that batching can skip every request too large for the room left in its batch
(:class:`Candidates`) a bucket at a time. The most urgent request is the smallest of the
buckets' tops (a few dozen at most); the order is read without changing a heap by a walk
from its root (a small heap of the frontier, O(log k) for the k-th item; :func:`_walk`),
and the walks of all the buckets merge in one frontier.

Deletion is lazy. A request that leaves (submitted in a batch, cancelled) or moves from
``early`` to ``late`` leaves a dead item behind (one naming an entry that is gone, or a
side its entry left); **every bucket heap's top is live after every change** (dead tops
are popped at once), deeper dead items are skipped by walks, and when dead items outnumber
the waiting requests by :data:`COMPACT_SLACK` every heap is rebuilt without them (O(n),
so O(1) amortized). The switch heap's dead items (a request that left before its
instant) are not popped when the request leaves: :meth:`WaitingQueue.advance` drops them
when their instant passes, or a compaction does, so a submit round pays one pop per
member. The heaps hold at most ``3n + COMPACT_SLACK`` items.

Costs with ``n`` waiting requests: add O(log n); remove O(log n) when the request heads its
bucket (batch members usually do), else O(1), amortized; :meth:`WaitingQueue.first`
O(buckets); ordered iteration O(log k) for the k-th item met (yielded, too large in a
bucket that partly fits, or dead); a request moves from ``early`` to ``late`` once,
O(log n). Time may go backwards (a caller's clock, a test): the queue then rebuilds,
O(n log n). Nothing in a round grows with ``n`` but these logarithms.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from flowprefill.prefill.request import Request
from flowprefill.prefill.scheduler.policies import Phases, PriorityPolicy, RankInput, SortKey

Keyed = tuple[Any, ...]
"""``(*key, request_id, entry token)``: what the side heaps hold, flat (comparing flat
tuples is cheaper than comparing nested ones). Keys are unique (they end with seq), so
the id and token never decide the order; the token tells a re-added request's item from
its earlier entry's."""
Switch = tuple[float, int, str]
"""(switch_s, entry token, request_id): what the switch heap holds."""

COMPACT_SLACK = 1024
"""Dead items tolerated beyond the number of waiting requests before every heap is
rebuilt without them (O(n), so O(1) amortized per removal)."""


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
    token: int
    """Unique per :meth:`WaitingQueue.add`."""
    late: bool = False

    @property
    def key(self) -> SortKey:
        """The key this entry is kept under now (``at`` aside: see ``_at_now``)."""
        return self.phases.after if self.late else self.phases.before

    def item(self) -> Keyed:
        """The item this entry is kept under now (on its side: late or early)."""
        return (*self.key, self.request.request_id, self.token)


class _Sides:
    """The early and the late heap of one bucket of requests."""

    __slots__ = ("early", "late", "live", "smallest")

    def __init__(self, bucket: int) -> None:
        self.early: list[Keyed] = []
        self.late: list[Keyed] = []
        self.live = 0
        """Waiting requests in this group (the heaps also hold dead items)."""
        self.smallest = smallest_in(bucket)
        """The fewest tokens a request of this bucket has."""

    def side(self, late: bool) -> list[Keyed]:
        return self.late if late else self.early


def _walk(heap: list[Switch]) -> Iterator[Switch]:  # the switch heap's; ordered() inlines it
    """The items of a binary heap in order, the heap unchanged: O(log k) for the k-th."""
    frontier = [(heap[0], 0)] if heap else []
    while frontier:
        item, i = heapq.heappop(frontier)
        yield item
        for child in (2 * i + 1, 2 * i + 2):
            if child < len(heap):
                heapq.heappush(frontier, (heap[child], child))


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
        return self._queue.in_order(self._now_s, self, self._skip)


class WaitingQueue:
    """``Q_w`` ordered by ``policy`` at any instant (each request with the rank input it
    was added with)."""

    def __init__(self, policy: PriorityPolicy) -> None:
        self.policy = policy
        self._entries: dict[str, _Entry] = {}
        self._buckets: dict[int, _Sides] = {}
        self._switches: list[Switch] = []  # early entries whose key will move
        self._dead = 0
        """Dead items in all heaps (exact: counted as they die and as they are popped)."""
        self._tokens = itertools.count()
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

    @property
    def held_items(self) -> int:
        """Items every heap holds, dead ones included: at most ``3n + COMPACT_SLACK``
        (each waiting request's item in its bucket and in the switch heap, and no more
        dead ones than waiting requests plus the slack)."""
        groups = self._buckets.values()
        return len(self._switches) + sum(len(g.early) + len(g.late) for g in groups)

    # ------------------------------------------------------------------ membership

    def add(self, request: Request, rank: RankInput) -> None:
        phases = self.policy.phases(rank)
        entry = _Entry(request, rank, phases, bucket_of(request.num_tokens), next(self._tokens))
        self._entries[request.request_id] = entry
        self.num_tokens += request.num_tokens
        self._place(entry)

    def remove(self, request_id: str) -> Request | None:
        """Take a request out: its items die where they are (its bucket's top is popped;
        its switch item waits for its instant or the next compaction)."""
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return None
        request = entry.request
        self.num_tokens -= request.num_tokens
        bucket = self._buckets[entry.bucket]
        bucket.live -= 1
        late = entry.late
        self._dead += 1 if late or entry.phases.switch_s == math.inf else 2
        self._pop_dead(bucket.late if late else bucket.early, late)
        if self._dead > len(self._entries) + COMPACT_SLACK:
            self._compact()
        return request

    def _place(self, entry: _Entry) -> None:
        bucket = self._buckets.get(entry.bucket)
        if bucket is None:
            bucket = self._buckets[entry.bucket] = _Sides(entry.bucket)
        bucket.live += 1
        entry.late = entry.phases.switch_s < self._now_s
        item = entry.item()
        heapq.heappush(bucket.side(entry.late), item)
        if not entry.late and entry.phases.switch_s != math.inf:
            heapq.heappush(
                self._switches, (entry.phases.switch_s, entry.token, entry.request.request_id)
            )

    # ------------------------------------------------------------------ dead items

    def _live(self, rid: str, token: int, late: bool | None) -> _Entry | None:
        """The entry an item stands for (``late``: the side its heap holds; None: any),
        or None when the item is dead (its request left, or moved to the other side)."""
        entry = self._entries.get(rid)
        if entry is None or entry.token != token or (late is not None and entry.late != late):
            return None
        return entry

    def _pop_dead(self, heap: list[Keyed], late: bool) -> None:
        """Pop the dead items at the top of a bucket's heap (so its top is live)."""
        entries = self._entries
        while heap:
            top = heap[0]
            entry = entries.get(top[-2])
            if entry is not None and entry.token == top[-1] and entry.late is late:
                return
            heapq.heappop(heap)
            self._dead -= 1

    def _compact_if_due(self) -> None:
        if self._dead > len(self._entries) + COMPACT_SLACK:
            self._compact()

    def _compact(self) -> None:
        """Rebuild every heap without its dead items."""
        for group in self._buckets.values():
            for late in (False, True):
                kept = [x for x in group.side(late) if self._live(x[-2], x[-1], late)]
                heapq.heapify(kept)
                if late:
                    group.late = kept
                else:
                    group.early = kept
        self._switches = [x for x in self._switches if self._live(x[2], x[1], False)]
        heapq.heapify(self._switches)
        self._dead = 0

    # ------------------------------------------------------------------ time

    def advance(self, now_s: float) -> None:
        """Move every request whose instant is before ``now_s`` to its ``after`` key."""
        if now_s < self._now_s:
            entries = list(self._entries.values())
            self._buckets.clear()
            self._switches.clear()
            self._dead = 0
            self._now_s = now_s
            for entry in entries:
                self._place(entry)
            return
        self._now_s = now_s
        heap = self._switches
        if not heap or heap[0][0] >= now_s:
            return
        while heap and heap[0][0] < now_s:
            _, token, rid = heapq.heappop(heap)
            moved = self._live(rid, token, False)
            if moved is None:  # its request left: the item was dead
                self._dead -= 1
                continue
            bucket = self._buckets[moved.bucket]
            moved.late = True
            self._dead += 1  # its early item
            heapq.heappush(bucket.late, moved.item())
            self._pop_dead(bucket.early, False)
        self._compact_if_due()

    def _at_now(self, now_s: float) -> list[tuple[int, Keyed]]:
        """Early requests whose instant is exactly ``now_s``: (bucket, item under their
        ``at`` key)."""
        heap = self._switches
        if not heap or heap[0][0] > now_s:  # after advance(): none is before now
            return []
        found = []
        for switch_s, token, rid in _walk(heap):
            if switch_s > now_s:
                break
            entry = self._live(rid, token, False)
            if entry is not None:
                found.append((entry.bucket, (*entry.phases.at, rid, token)))
        return found

    # ------------------------------------------------------------------ order

    def first(self, now_s: float) -> tuple[SortKey, Request] | None:
        """The most urgent waiting request at ``now_s`` and its key."""
        self.advance(now_s)
        if self._at_now(now_s):
            return next(self.ordered(now_s), None)  # rare: a float instant hit exactly
        best: Keyed | None = None
        for group in self._buckets.values():  # their tops are live
            early, late = group.early, group.late
            if early and (best is None or early[0] < best):
                best = early[0]
            if late and (best is None or late[0] < best):
                best = late[0]
        if best is None:
            return None
        entry = self._entries[best[-2]]
        return entry.key, entry.request

    def ordered(
        self, now_s: float, limit: Candidates | None = None
    ) -> Iterator[tuple[SortKey, Request]]:
        """Every waiting request with its key at ``now_s``, most urgent first (as
        :meth:`in_order`, which it reads). The queue must not change while the iterator
        is in use."""
        entries = self._entries
        for request in self.in_order(now_s, limit):
            yield entries[request.request_id].phases.key(now_s), request

    def in_order(
        self, now_s: float, limit: Candidates | None = None, skip: str | None = None
    ) -> Iterator[Request]:
        """Every waiting request but ``skip``, most urgent first at ``now_s``; with
        ``limit``, those of more than ``limit.max_tokens`` tokens (read as it changes) may
        be left out, a whole bucket at a time where none of it fits. The queue must not
        change while the iterator is in use.

        One walk (as :func:`_walk`) over several heaps at once: each bucket's ``early``
        and ``late`` heap and the requests whose instant is exactly now. A bucket that
        cannot fit any more is not walked further. (The hot loop of a submit round's
        batching: names are local and the liveness test is inline.)"""
        self.advance(now_s)
        at_now = self._at_now(now_s)
        at_ids = {item[-2] for _, item in at_now} if at_now else None
        room = None if limit is None else limit.max_tokens
        # Per source: its heap (None: one request at its instant), the fewest tokens its
        # bucket holds, and its side (None: the requests at their instant, all live).
        sources: list[tuple[list[Keyed] | None, int, bool | None]] = []
        # (*item, source, index in its heap), flat: a flat tuple compares in one pass
        # where (item, source, index) compares item twice (equality, then order). Built
        # by concatenation, which is faster than unpacking into a new tuple.
        frontier: list[Keyed] = []
        for group in self._buckets.values():
            smallest = group.smallest
            if limit is not None and (not group.live or (room is not None and smallest > room)):
                continue  # nothing in this bucket can fit
            if group.early:
                frontier.append(group.early[0] + (len(sources), 0))
                sources.append((group.early, smallest, False))
            if group.late:
                frontier.append(group.late[0] + (len(sources), 0))
                sources.append((group.late, smallest, True))
        for number, keyed in at_now:
            frontier.append((*keyed, len(sources), 0))
            sources.append((None, smallest_in(number), None))
        heapq.heapify(frontier)
        # Every item the frontier will ever hold has at least this many tokens: once the
        # room is below it, nothing left can fit and the walk ends (a full batch's room
        # usually is) instead of popping each source's last item to find that out.
        fewest = min((source[1] for source in sources), default=0)
        entries = self._entries
        heappop, heappush = heapq.heappop, heapq.heappush
        while frontier:
            if limit is not None:
                room = limit.max_tokens
                if room is not None and fewest > room:
                    return
            item = heappop(frontier)
            source: int = item[-2]
            walked, smallest, late = sources[source]
            if room is not None and smallest > room:
                continue  # nothing left in this bucket can fit: not walked further
            if walked is not None:
                child = 2 * item[-1] + 1
                size = len(walked)
                if child < size:
                    heappush(frontier, walked[child] + (source, child))
                    child += 1
                    if child < size:
                        heappush(frontier, walked[child] + (source, child))
            rid = item[-4]
            entry = entries.get(rid)
            if entry is None or entry.token != item[-3]:
                continue  # dead: its request left
            if late is not None:
                if entry.late is not late:
                    continue  # dead: its request moved to the late side
                if at_ids is not None and rid in at_ids:
                    continue  # an early item whose instant is now: its key is "at" (own source)
            request = entry.request
            if (room is None or request.num_tokens <= room) and rid != skip:
                yield request

    def requests(self) -> Iterator[Request]:
        """In arrival order of the calls to :meth:`add`."""
        return (entry.request for entry in self._entries.values())
