"""Stage 2 of the pipeline: the first token, from a prefill instance.

First, admission (:meth:`~flowprefill.gateway.routing.InstancePool.admit`): a request of
a sheddable class (negative priority) that no instance is predicted to serve before its
deadline is refused here, 429 with ``Retry-After``
(:class:`~flowprefill.gateway.errors.ShedError`), before anything is sent; one the routed
instance would serve late goes to an instance that can. Overload bounds (docs/gateway.md,
"Overload"; :class:`~flowprefill.gateway.errors.OverloadError`, 503 with ``Retry-After``):
any other request predicted past its deadline plus its useful wait is refused
(``too_late``), as is any request while ``max_waiting`` already wait for their first token
(``queue_full``); one still without its first token at its deadline plus its useful wait
is abandoned (``expired``: its prefill is cancelled). The decision
(:class:`~flowprefill.gateway.routing.Admitted`) is passed to the send: the admitted
instance (with :func:`~flowprefill.gateway.routing.failover`'s retry rule) is sent a
:class:`~flowprefill.contracts.prefill_api.PrefillRequest` carrying the class's
``ttft_slo_s`` and the ``elapsed_s`` since gateway arrival. When decode will continue the
request, prefill is asked to hand off the KV cache, streamed so that writing it is not on
the time to first token. Records the first-token metrics: TTFT and
``met``/``missed`` against the class SLO, both from gateway arrival — a request still
waiting at its deadline is counted missed then, so misses show while an overload lasts;
and passes the
instance's reported backlog (:class:`~flowprefill.contracts.prefill_api.PrefillLoad`) to
the pool for the next admissions.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from flowprefill.contracts.metrics import OverloadReason
from flowprefill.contracts.prefill_api import PrefillRequest
from flowprefill.gateway.admission import Refuse, is_sheddable
from flowprefill.gateway.classify import Job
from flowprefill.gateway.errors import OverloadError, ShedError
from flowprefill.gateway.metrics import GatewayMetrics
from flowprefill.gateway.routing import Admitted, Instance, InstancePool, Placement, failover_call
from flowprefill.gateway.upstream import PrefillAnswer, PrefillClient

_VALIDATED_IDS = 100
"""Up to this many prompt ids, a prefill request is validated whole (see ``request``)."""


class PrefillStage:
    def __init__(
        self,
        pool: InstancePool,
        client: PrefillClient,
        metrics: GatewayMetrics,
        clock: Callable[[], float],
        *,
        has_decode: bool,
    ) -> None:
        self.pool = pool
        self.client = client
        self.metrics = metrics
        self.clock = clock
        self.has_decode = has_decode
        self.waiting = 0
        """Requests admitted here and still waiting for their first token."""
        self.peak = 0
        """The most that ever waited at once."""

    def request(self, job: Job, now_s: float) -> PrefillRequest:
        """What a prefill instance is sent for ``job`` at ``now_s``."""
        hand_off = self.has_decode and job.body.output_budget > 1
        ids = job.token_ids
        # The prompt's ids are ints already (the tokenizer's, or the body's validated
        # list): a long prompt is not validated again (about 17 ns an id, 70 us for 4,000),
        # the rest of the request is; a short one is cheaper validated whole than copied.
        long_prompt = len(ids) > _VALIDATED_IDS
        request = PrefillRequest(
            request_id=job.request_id,
            prompt_token_ids=[] if long_prompt else ids,
            ttft_slo_s=job.ttft_slo_s,
            elapsed_s=job.elapsed_s(now_s),
            slo_class=job.slo.name,
            hand_off_kv=hand_off,
            stream=hand_off,
        )
        return request.model_copy(update={"prompt_token_ids": ids}) if long_prompt else request

    def admit(self, work: Placement, job: Job) -> Admitted:
        """Where ``job`` goes, or refuse it (raise :class:`ShedError` or
        :class:`OverloadError`, counted per class); decided once: an instance that has it
        serves it."""
        if self.waiting >= self.pool.overload.max_waiting:
            raise self.overloaded(
                job,
                OverloadReason.QUEUE_FULL,
                f"finds {self.waiting} requests waiting for their first token "
                f"(overload.max_waiting = {self.pool.overload.max_waiting})",
                self.drain_s(),
            )
        decision = self.pool.admit(
            work,
            sheddable=is_sheddable(job.slo.priority),
            useful_wait_s=self.pool.overload.useful_wait_s(job.ttft_slo_s),
        )
        if isinstance(decision, Refuse) and decision.shed:
            self.metrics.shed.labels(job.slo.name).inc()
            raise ShedError(
                job.slo.name,
                ttft_slo_s=job.ttft_slo_s,
                best_finish_in_s=decision.best_finish_s - self.clock(),
                retry_after_s=decision.retry_after_s,
            )
        if isinstance(decision, Refuse):
            late_s = decision.best_finish_s - job.deadline_s
            raise self.overloaded(
                job,
                OverloadReason.TOO_LATE,
                f"would have its first token {late_s:.2f} s past its "
                f"{job.ttft_slo_s * 1e3:.0f} ms TTFT target at the earliest, beyond its "
                f"useful wait of {self.pool.overload.useful_wait_s(job.ttft_slo_s):.2f} s",
                decision.retry_after_s,
            )
        return decision

    def overloaded(
        self, job: Job, reason: OverloadReason, detail: str, retry_after_s: float
    ) -> OverloadError:
        """The 503 for ``job``, counted per class and reason."""
        self.metrics.overload_refused.labels(job.slo.name, str(reason)).inc()
        return OverloadError(job.slo.name, reason, detail, retry_after_s=retry_after_s)

    def drain_s(self) -> float:
        """About when the least loaded instance will have served what this gateway sent
        it: the retry delay of a refusal that has no per-request prediction."""
        return min(self.pool.predict_s(i.tokens_in_flight) for i in self.pool.instances)

    async def run(self, job: Job) -> PrefillAnswer:
        """Raises :class:`~flowprefill.gateway.errors.GatewayError` subclasses."""

        async def call(inst: Instance) -> PrefillAnswer:
            now = self.clock()
            answer = await self.client.prefill(
                inst.url, self.request(job, now), job.upstream_hints(now)
            )
            if answer.response.load is not None:
                self.pool.report_load(inst.url, answer.response.load, answered=job.request_id)
            return answer

        work = Placement(job.request_id, job.deadline_s, len(job.token_ids))
        admitted = self.admit(work, job)
        self.waiting += 1
        self.metrics.waiting.set(self.waiting)
        if self.waiting > self.peak:
            self.peak = self.waiting
            self.metrics.waiting_max.set(self.peak)
        try:
            return await self._wait_first_token(job, work, admitted, call)
        finally:
            self.waiting -= 1
            self.metrics.waiting.set(self.waiting)

    async def _wait_first_token(
        self,
        job: Job,
        work: Placement,
        admitted: Admitted,
        call: Callable[[Instance], Awaitable[PrefillAnswer]],
    ) -> PrefillAnswer:
        # A request still waiting at its deadline is counted missed then, not when (or if)
        # its first token comes: under overload S-EDF sinks late requests below feasible
        # ones, and counting at the first token would show the misses only once the
        # overload is over — too late for the autoscaler that reads these counters.
        counted = False

        def at_deadline() -> None:
            nonlocal counted
            counted = True
            self.metrics.missed_at_deadline(job.slo.name)

        overdue = asyncio.get_running_loop().call_later(
            max(0.0, job.deadline_s - self.clock()), at_deadline
        )
        # Past its useful wait the answer is worth nothing to the client and the request
        # only holds a place in the queues: cancelled (which closes its upstream
        # connection, and the prefill server drops it) and answered 503, so nothing waits
        # without bound, whatever order the engine serves late requests in.
        useful_s = self.pool.overload.useful_wait_s(job.ttft_slo_s)
        try:
            async with asyncio.timeout(job.deadline_s + useful_s - self.clock()) as bound:
                answer = await failover_call(self.pool, work, call, admitted)
        except TimeoutError:
            if not bound.expired():
                raise
            raise self.overloaded(
                job,
                OverloadReason.EXPIRED,
                f"had no first token {useful_s:.2f} s past its "
                f"{job.ttft_slo_s * 1e3:.0f} ms TTFT target (its useful wait): abandoned",
                self.drain_s(),
            ) from None
        finally:
            overdue.cancel()
        ttft_s = self.clock() - job.arrival_s
        work_s = self.pool.predict_s(len(job.token_ids))
        self.metrics.child(self.metrics.prefill_work, job.slo.name).inc(work_s)
        self.metrics.first_token(
            job.slo.name,
            ttft_s=ttft_s,
            met=job.met_slo(ttft_s),
            wait_s=answer.wait_s,
            counted=counted,
        )
        return answer
