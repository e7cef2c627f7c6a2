"""Which published prompts still hold blocks, and until when.

A lease starts when a prompt's KV is published and ends, freeing its blocks, when every
consumer that reads it has said so (``"<id>:<n>"`` notifications, ``n`` consumers), or
when it expires: a decode that never comes (client gone, gateway retried elsewhere) must
not hold the buffer forever. Consumers waiting in their queue send heartbeats
(``"HB:<id>,…"``) that push the deadline out (vLLM's rule: to now + 2/3 of the lease).
The clock is ``time.monotonic``; tests pass their own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from flowprefill.contracts.nixl import DEFAULT_LEASE_S, LEASE_EXTENSION_FRACTION


@dataclass
class Lease:
    block_ids: list[int]
    expires_at: float
    reads: dict[int, int] = field(default_factory=dict)
    """Reads done, by producer rank."""
    published_at: float = 0.0


class Leases:
    """Leases by request id; ``release`` frees a finished or expired lease's blocks."""

    def __init__(
        self,
        release: Callable[[Sequence[int]], None],
        lease_s: float = DEFAULT_LEASE_S,
        clock: Callable[[], float] = time.monotonic,
        ranks: int = 1,
    ) -> None:
        """``ranks``: producer ranks that each hold their heads of every lease's blocks and
        are each notified when read (tensor parallelism)."""
        if lease_s <= 0:
            raise ValueError(f"a lease must last > 0 s, got {lease_s}")
        self.ranks = ranks
        self.lease_s = lease_s
        self._release = release
        self._clock = clock
        self._leases: dict[str, Lease] = {}
        self._lock = threading.Lock()
        self.expired_total = 0
        self.completed_total = 0

    def __contains__(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._leases

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    def start(self, request_id: str, block_ids: list[int]) -> None:
        """Hold ``block_ids`` for ``request_id``; a second start for the same id (a retried
        request) frees the first one's blocks."""
        now = self._clock()
        with self._lock:
            old = self._leases.pop(request_id, None)
            self._leases[request_id] = Lease(block_ids, now + self.lease_s, published_at=now)
        if old is not None:
            self._release(old.block_ids)

    def read_done(self, request_id: str, consumers: int, rank: int = 0) -> bool:
        """One of the ``consumers`` readers of ``rank``'s blocks is done; True when the
        lease ended with it (every rank read by all its consumers). An unknown id (already
        expired or freed) is False."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None:
                return False
            lease.reads[rank] = lease.reads.get(rank, 0) + 1
            needed = max(1, consumers)
            if any(lease.reads.get(r, 0) < needed for r in range(self.ranks)):
                return False
            del self._leases[request_id]
            self.completed_total += 1
        self._release(lease.block_ids)
        return True

    def heartbeat(self, request_ids: Sequence[str]) -> None:
        deadline = self._clock() + self.lease_s * LEASE_EXTENSION_FRACTION
        with self._lock:
            for request_id in request_ids:
                lease = self._leases.get(request_id)
                if lease is not None:
                    lease.expires_at = max(lease.expires_at, deadline)

    def drop(self, request_id: str) -> bool:
        """End a lease nobody will read (the gateway gave up on it)."""
        with self._lock:
            lease = self._leases.pop(request_id, None)
        if lease is None:
            return False
        self._release(lease.block_ids)
        return True

    def expire(self) -> list[str]:
        """End every lease past its deadline; the ids that ended."""
        now = self._clock()
        with self._lock:
            gone = [rid for rid, lease in self._leases.items() if now >= lease.expires_at]
            freed = [self._leases.pop(rid) for rid in gone]
            self.expired_total += len(gone)
        for lease in freed:
            self._release(lease.block_ids)
        return gone
