"""The gateway's own liveness probes of its prefill and decode instances.

A stopped or wedged process keeps its listening socket: handshakes complete, requests
neither fail nor finish, and the failure-driven back-off (:class:`InstancePool`) never
sees it. :class:`HealthProber` probes every instance's ``/health`` and owns each one's
stall flag (``Instance.stall``): ``failures`` unanswered probes in a row set it (attempts
on the instance are then abandoned, :func:`~flowprefill.gateway.routing.until_stalled`),
any answer clears it. A probe that times out while the instance delivers items on some
attempt (``Instance.last_item_s``) counts as answered: busy, not stalled.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
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
    BUSY = "busy"
    """No answer within the timeout, but an attempt on it delivered an item meanwhile: a
    process short of CPU (a niced decode beside a busy prefill) that still serves, whose
    streams must not be abandoned as if it hung."""


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
        started = time.monotonic()
        try:
            await client.get(inst.url + HEALTH_PATH, timeout=self.settings.timeout_s)
        except httpx.TimeoutException:
            return Probe.BUSY if inst.last_item_s >= started else Probe.UNANSWERED
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
        if probe is Probe.BUSY:  # it serves: the run of failed probes ends, not the stall
            self._failed[inst.url] = 0
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
