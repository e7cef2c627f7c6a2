"""Stalled instances: alive enough to accept a connection, never answering.

A process that is stopped (SIGSTOP, a frozen node, a wedged event loop) still completes
TCP handshakes from its listen backlog, so requests sent to it neither fail nor finish:
the failure-driven back-off of :mod:`flowprefill.gateway.routing` never sees it. The
gateway therefore probes every instance's liveness path on its own:

* every ``interval_s`` each instance gets ``GET /health`` with a ``timeout_s`` deadline;
* ``failures`` consecutive probes without an answer in time mark it *stalled*: it leaves
  rotation, and attempts in flight on it are abandoned
  (:func:`flowprefill.gateway.failover.failover` retries one that had received nothing
  yet on another instance, and ends one that had with a clear error);
* the first answered probe (any HTTP status: the process runs) puts it back.

A probe also ends a dead instance's back-off: one whose probes were refused and that now
answers has been restarted (and a vLLM or prefill server listens only once it can serve),
so it is back in rotation at once instead of after a back-off that doubled while it was
down (up to 30 s of every request failing for want of it when it is the only one).

So a stall is detected within ``failures × (interval_s + timeout_s)`` (4 s by default)
of its start. A refused connection says nothing about a stall: a dead process fails the
requests sent to it at once, and the routing back-off handles it; a stalled instance
that dies stays out until it answers again (restarted).
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Sequence

import httpx

from flowprefill.contracts.deployment import HEALTH_PATH
from flowprefill.contracts.gateway import HealthProbeSettings
from flowprefill.gateway.routing import Instance, InstancePool

log = logging.getLogger(__name__)


class Probe(enum.Enum):
    ANSWERED = "answered"
    """Any HTTP answer: the process runs its server."""
    UNANSWERED = "unanswered"
    """No answer within the timeout: the stall signal."""
    UNREACHABLE = "unreachable"
    """Refused or unresolvable: dead (or not started), not stalled."""


class HealthProber:
    """Probes the instances of ``pools`` until cancelled (a task of the gateway's
    lifespan). Owns each instance's stalled flag (``Instance.stall``) and its run of
    failed probes."""

    def __init__(self, pools: Sequence[InstancePool], settings: HealthProbeSettings) -> None:
        self.pools = list(pools)
        self.settings = settings
        self._failed: dict[str, int] = {}
        self._refused: set[str] = set()
        """Instances whose last probe was refused: dead, or not started yet."""

    async def run(self) -> None:
        async with httpx.AsyncClient() as client:
            while True:
                await self.probe_all(client)
                await asyncio.sleep(self.settings.interval_s)

    async def probe_all(self, client: httpx.AsyncClient) -> None:
        """One round: every instance probed concurrently, flags updated."""
        targets = [(pool, inst) for pool in self.pools for inst in pool.instances]
        answers = await asyncio.gather(*(self._probe(client, inst) for _, inst in targets))
        for (pool, inst), probe in zip(targets, answers, strict=True):
            self._record(pool, inst, probe)

    async def _probe(self, client: httpx.AsyncClient, inst: Instance) -> Probe:
        try:
            await client.get(inst.url + HEALTH_PATH, timeout=self.settings.timeout_s)
        except httpx.TimeoutException:
            return Probe.UNANSWERED
        except httpx.HTTPError:
            return Probe.UNREACHABLE
        return Probe.ANSWERED

    def _record(self, pool: InstancePool, inst: Instance, probe: Probe) -> None:
        if probe is Probe.UNREACHABLE:
            self._refused.add(inst.url)
            return
        if probe is Probe.ANSWERED:
            self._failed[inst.url] = 0
            if inst.url in self._refused:
                self._refused.discard(inst.url)
                if not inst.healthy:  # restarted: its back-off was for the dead process
                    pool.mark_success(inst)
                    log.warning(
                        "%s instance %s answers again: back in rotation", pool.role, inst.url
                    )
            if inst.stall.is_set():
                inst.stall.clear()
                log.warning("%s instance %s answers its health probe again", pool.role, inst.url)
            return
        failed = self._failed.get(inst.url, 0) + 1
        self._failed[inst.url] = failed
        if failed >= self.settings.failures and not inst.stall.is_set():
            inst.stall.set()  # out of rotation; attempts on it are abandoned
            log.warning(
                "%s instance %s failed %d health probes in a row: out of rotation until it "
                "answers (%d requests in flight on it abandoned)",
                pool.role,
                inst.url,
                failed,
                inst.num_in_flight,
            )
