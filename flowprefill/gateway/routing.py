"""Choosing a prefill (or decode) instance, keeping track of which ones are healthy, and
the one retry rule.

**Routing** (:func:`route`; the policy is chosen per pool in ``gateway.json``:
``prefill_routing``, ``decode_routing``, :class:`~flowprefill.contracts.names.Router`).
Every policy reads the gateway's *in-flight book*: per instance, the requests this gateway
sent there and still awaits (:attr:`Instance.in_flight`: request id -> deadline and
tokens), booked while an attempt runs (:func:`failover`). No extra round trips.

* ``round-robin`` — the paper's proxy: the next healthy instance in turn.
* ``slack-aware`` (default for prefill) — the instance where this request's predicted
  slack is largest. Each instance runs EDF-like scheduling, so what delays a new request
  is the outstanding work *due before it*, not the whole queue: the predicted TTFT on an
  instance is ``predict(tokens due no later + own tokens)``. Ties rotate.
* ``least-loaded`` (default for decode) — fewest in-flight requests; ties rotate.

The simulator routes with the same function over the same kind of book
(:mod:`flowprefill.lab.sim.gateway`).

**Admission** (:meth:`InstancePool.admit`, the decision itself in
:mod:`flowprefill.gateway.admission`): before a request is sent, each instance's predicted
first token for it is estimated from the book (entries due no later than it, except those
already predicted to miss: S-EDF runs them after every feasible one) plus the work the
instance reported that this gateway did not send (other gateways' or direct clients'),
drained linearly over the engine's own predicted queue delay since the report
(:class:`~flowprefill.contracts.prefill_api.PrefillLoad`, on every prefill answer). The
decision is handed to the sending stage as data (:class:`Admitted`, keyed by request id):
its instance is where the request's first attempt goes.

**Back-off.** An instance that fails (connection error, 5xx) is taken out of rotation for a
back-off that doubles per consecutive failure (1 s, 2 s, ... 30 s). When it expires, the
next request may be sent there again: a refused connection is retried once on another
instance, so probing a dead instance costs no request; a success clears the count.

**Retry** (:func:`failover`, for prefill and decode alike). A failure with a 5xx status
takes the instance out of rotation for its back-off; a success clears its record. An
attempt is tried once more, on another pick, when that cannot duplicate anything the
client sees:

* a *refused connection* (:attr:`~flowprefill.gateway.errors.UpstreamError.retryable`:
  the instance never saw the request);
* an instance that died or stalled before the attempt received anything from it
  (:attr:`~flowprefill.gateway.errors.UpstreamError.connection_lost`): a prefill has no side
  effect but compute, and a decode that produced nothing yet has streamed nothing.

An attempt that had received something ends with its error: its output reached the
client. The KV hand-off does not pin decode to an instance — it lives in shared storage or
at the prefill instance, and a decode that cannot read it recomputes.

**Colocated pairing** (:meth:`InstancePool.paired`). A colocated prefill instance names its
pod's own decode in its answer (``decode_url``); the decode stage sends the request's first
decode attempt there, so the KV stays inside the pod, and falls back to the pool's pick by
the retry rule above. The gateway sends a request only where its config lets it: the URL
is used when it is a listed decode instance, or when exactly one listed decode instance is
on the host of the prefill instance that answered (an operator-rendered colocated pool: one
headless Service, prefill on one port and decode on another, while the announced URL is the
pod's IP). In that second case the pod gets an instance of its own that shares the listed
one's in-flight book and stall flag (its requests count in the pool's load; a stalled
Service is abandoned as before) but has its own back-off: a pod whose decode failed is not
paired with again until its back-off ends, and its failure does not take the Service, the
pool's other pods, out of rotation. Anything else is ignored (no pairing).

**Stalled instances** (:class:`~flowprefill.gateway.health.HealthProber`): alive enough to
accept a connection, never answering. A process that is stopped (SIGSTOP, a frozen node, a
wedged event loop) still completes TCP handshakes from its listen backlog, so requests sent
to it neither fail nor finish: the failure-driven back-off never sees it. The gateway
therefore probes every instance's liveness path on its own:

* every ``interval_s`` each instance gets ``GET /health`` with a ``timeout_s`` deadline;
* ``failures`` consecutive probes without an answer in time mark it *stalled*: it leaves
  rotation, and attempts in flight on it are abandoned (:func:`failover` retries one that
  had received nothing yet on another instance, and ends one that had with a clear error);
* the first answered probe (any HTTP status: the process runs) puts it back.

A probe also ends a dead instance's back-off: one whose probes were refused and that now
answers has been restarted (and a vLLM or prefill server listens only once it can serve),
so it is back in rotation at once instead of after a back-off that doubled while it was
down (up to 30 s of every request failing for want of it when it is the only one).

So a stall is detected within ``failures × (interval_s + timeout_s)`` (4 s by default)
of its start. A refused connection says nothing about a stall: a dead process fails the
requests sent to it at once, and the back-off handles it; a stalled instance that dies
stays out until it answers again (restarted).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TypeVar
from urllib.parse import urlsplit

from flowprefill.contracts.gateway import OverloadSettings
from flowprefill.contracts.names import Router
from flowprefill.contracts.prefill_api import PrefillLoad
from flowprefill.gateway.admission import (
    Accept,
    Estimate,
    LoadReport,
    Refuse,
    decide,
    predicted_finish_s,
)
from flowprefill.gateway.errors import NoHealthyInstanceError, UpstreamError
from flowprefill.gateway.stall import StallFlag

log = logging.getLogger(__name__)

T = TypeVar("T")

MAX_ATTEMPTS = 2
MAX_PODS = 1024
"""Colocated pods' instances an :class:`InstancePool` keeps (:meth:`InstancePool.paired`)
before it forgets the idle ones."""


@dataclass(eq=False)
class Instance:
    url: str
    healthy: bool = True
    consecutive_failures: int = 0
    retry_after_s: float = 0.0
    in_flight: dict[str, tuple[float, int]] = field(default_factory=dict)
    """The in-flight book: request id -> (deadline_s, num_tokens) of work this gateway
    sent here and awaits."""
    stall: StallFlag = field(default_factory=lambda: StallFlag())
    """Set while the health prober finds it unresponsive
    (:class:`~flowprefill.gateway.health.HealthProber`): out of
    rotation whatever its back-off says."""
    last_item_s: float = -math.inf
    """When an attempt on it last delivered an item (``time.monotonic()``;
    :func:`until_stalled`): a sign of life the prober counts like an answered probe."""

    @property
    def num_in_flight(self) -> int:
        return len(self.in_flight)

    def tokens_due_before(self, deadline_s: float) -> int:
        return sum(n for d, n in self.in_flight.values() if d <= deadline_s)

    @property
    def tokens_in_flight(self) -> int:
        return sum(n for _, n in self.in_flight.values())


def route(
    policy: Router,
    candidates: Sequence[Instance],
    turn: int,
    *,
    deadline_s: float,
    num_tokens: int,
    now_s: float,
    predict_s: Callable[[int], float],
) -> Instance:
    """The instance ``policy`` picks among ``candidates`` (non-empty, in pool order) for a
    request of ``num_tokens`` due at ``deadline_s``, from their in-flight books. ``turn``
    (one more per pick) rotates round-robin and where ties start, so ties spread instead
    of always landing on the first candidate."""
    k = turn % len(candidates)
    if policy is Router.ROUND_ROBIN or len(candidates) == 1:
        return candidates[k]
    rotated = [*candidates[k:], *candidates[:k]]
    if policy is Router.LEAST_LOADED:
        return min(rotated, key=lambda i: i.num_in_flight)
    return max(
        rotated,
        key=lambda i: deadline_s - now_s - predict_s(i.tokens_due_before(deadline_s) + num_tokens),
    )


def _forgettable(pod: Instance) -> bool:
    """A pod instance without a failure record holds nothing of its own (its book is the
    listed instance's): recreated as it was when next named."""
    return pod.healthy and pod.consecutive_failures == 0


@dataclass(frozen=True, slots=True)
class Placement:
    """What a pool needs to pick an instance for a request and book it there."""

    request_id: str
    deadline_s: float
    num_tokens: int


@dataclass(frozen=True, slots=True)
class Admitted:
    """Admission's decision for one request, handed to the stage that sends it: the
    instance its first attempt goes to (for decode: the colocated pod that prefilled it,
    :meth:`InstancePool.paired`)."""

    request_id: str
    instance: Instance
    rerouted: bool = False
    """Not the instance routing preferred (that one was predicted too late)."""


class InstancePool:
    """The instances of one role (prefill or decode) behind the gateway."""

    def __init__(
        self,
        role: str,
        urls: list[str],
        *,
        policy: Router | str = Router.SLACK_AWARE,
        predict_s: Callable[[int], float] | None = None,
        clock: Callable[[], float] = time.monotonic,
        base_backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        overload: OverloadSettings | None = None,
    ) -> None:
        if not urls:
            raise ValueError(f"no {role} instances configured")
        self.role = role
        self.policy = Router.parse(policy)
        self.instances = [Instance(u.rstrip("/")) for u in urls]
        self.predict_s = predict_s or (lambda n: n * 1e-4)
        self.clock = clock
        self.base_backoff_s = base_backoff_s
        self.max_backoff_s = max_backoff_s
        self.overload = overload or OverloadSettings()
        """Useful wait and queue bound of admission (docs/gateway.md, "Overload")."""
        self._rr = itertools.count()
        self.reports: dict[str, LoadReport] = {}
        """Instance URL -> its latest load report."""
        self._pods: dict[str, Instance] = {}
        """Colocated pods' own instances behind a listed one (:meth:`paired`), by URL."""
        self._unpaired: set[str] = set()
        """Announced URLs :meth:`paired` refused (logged once each)."""

    def available(self, inst: Instance) -> bool:
        """Whether ``inst`` (listed, or a pod :meth:`paired` returned) may be sent a request
        now: not in its back-off, not stalled."""
        if not inst.healthy and self.clock() >= inst.retry_after_s:
            # Back-off over: give it a chance; a failure puts it back out for longer.
            inst.healthy = True
        return inst.healthy and not inst.stall.is_set()

    def healthy(self) -> list[Instance]:
        return [inst for inst in self.instances if self.available(inst)]

    def paired(self, url: str, *, near: str) -> Instance | None:
        """The instance a colocated prefill instance at ``near`` (its base URL) names as its
        pod's own decode at ``url`` (see the module docstring): the listed instance at
        ``url``; else, when exactly one listed instance is on ``near``'s host, an instance
        for ``url`` sharing that one's in-flight book and stall flag; else None."""
        url = url.rstrip("/")
        listed = next((i for i in self.instances if i.url == url), None)
        if listed is not None:
            return listed
        host = urlsplit(near).hostname
        same_host = [i for i in self.instances if host and urlsplit(i.url).hostname == host]
        if len(same_host) != 1:
            if url not in self._unpaired:
                self._unpaired.add(url)
                log.warning(
                    "%s instance %s named %s as its colocated decode, which is not one of this "
                    "gateway's %s instances nor behind exactly one of them on its host: "
                    "decoded where the pool picks",
                    "prefill", near, url, self.role,
                )  # fmt: skip
            return None
        (service,) = same_host
        pod = self._pods.get(url)
        if pod is None or pod.in_flight is not service.in_flight:
            if len(self._pods) >= MAX_PODS:
                # Pods come and go (rollouts): forget those without a failure record.
                for key in [k for k, p in self._pods.items() if _forgettable(p)]:
                    del self._pods[key]
            pod = Instance(url, in_flight=service.in_flight, stall=service.stall)
            self._pods[url] = pod
        return pod

    def pick(self, *, deadline_s: float, num_tokens: int) -> Instance:
        """The routing policy's choice among the healthy instances (:func:`route`).
        Raises NoHealthyInstanceError with none."""
        candidates = self.healthy()
        if not candidates:
            raise NoHealthyInstanceError(self.role)
        return route(
            self.policy,
            candidates,
            next(self._rr),
            deadline_s=deadline_s,
            num_tokens=num_tokens,
            now_s=self.clock(),
            predict_s=self.predict_s,
        )

    def estimate_finish_s(
        self, inst: Instance, *, deadline_s: float, num_tokens: int, now_s: float
    ) -> float:
        """When a request of ``num_tokens`` due at ``deadline_s`` sent now would have its
        first token on ``inst``: the work due before it, as :meth:`admit` counts it."""
        ahead = 0.0
        for d, n in inst.in_flight.values():
            if d <= deadline_s and d - now_s - self.predict_s(n) >= 0:
                ahead += n
        report = self.reports.get(inst.url)
        if report is not None:
            ahead += report.foreign_tokens_at(now_s)
        return predicted_finish_s(now_s, ahead, num_tokens, self.predict_s)

    def admit(
        self, work: Placement, *, sheddable: bool, useful_wait_s: float = math.inf
    ) -> Admitted | Refuse:
        """Where ``work`` goes (:class:`Admitted`), or that it is refused
        (:func:`~flowprefill.gateway.admission.decide` on the routing policy's pick, with
        ``useful_wait_s`` past the deadline for a non-sheddable request). Raises
        NoHealthyInstanceError with nothing to pick."""
        preferred = self.pick(deadline_s=work.deadline_s, num_tokens=work.num_tokens)
        if not sheddable and useful_wait_s == math.inf:
            return Admitted(work.request_id, preferred)
        now = self.clock()
        estimates = [
            Estimate(
                self.instances.index(inst),
                self.estimate_finish_s(
                    inst, deadline_s=work.deadline_s, num_tokens=work.num_tokens, now_s=now
                ),
            )
            for inst in self.healthy()
        ]
        decision = decide(
            sheddable=sheddable,
            deadline_s=work.deadline_s,
            estimates=estimates,
            preferred=self.instances.index(preferred),
            useful_wait_s=useful_wait_s,
        )
        if isinstance(decision, Accept):
            return Admitted(work.request_id, self.instances[decision.index], decision.rerouted)
        return decision

    def report_load(self, url: str, load: PrefillLoad, *, answered: str) -> None:
        """Instance ``url`` reported ``load`` in its answer to request ``answered``: the
        tokens it holds beyond what this gateway still awaits there are foreign."""
        inst = next((i for i in self.instances if i.url == url), None)
        if inst is None:
            return
        own = inst.tokens_in_flight - inst.in_flight.get(answered, (0.0, 0))[1]
        self.reports[url] = LoadReport(load, self.clock(), max(0, load.backlog_tokens - own))

    def begin(self, inst: Instance, request_id: str, deadline_s: float, num_tokens: int) -> None:
        inst.in_flight[request_id] = (deadline_s, num_tokens)

    def end(self, inst: Instance, request_id: str) -> None:
        inst.in_flight.pop(request_id, None)

    def mark_failure(self, inst: Instance) -> None:
        inst.consecutive_failures += 1
        # The exponent capped: thousands of streams abandoned at once (a stalled instance)
        # count thousands of failures, and 2.0 ** 1024 overflows a float.
        doublings = min(inst.consecutive_failures - 1, 60)
        backoff = min(self.max_backoff_s, self.base_backoff_s * 2**doublings)
        inst.healthy = False
        inst.retry_after_s = self.clock() + backoff

    def mark_success(self, inst: Instance) -> None:
        inst.consecutive_failures = 0
        inst.healthy = True


async def failover(
    pool: InstancePool,
    work: Placement,
    attempt: Callable[[Instance], AsyncGenerator[T, None]],
    admitted: Admitted | None = None,
) -> AsyncGenerator[T, None]:
    """Yield what ``attempt(instance)`` yields, on ``admitted``'s instance while it is
    available (:meth:`InstancePool.available`), else on the instance ``pool`` picks;
    after a failure that is safe to retry (see the module docstring), on a second pick.
    Raises the last :class:`~flowprefill.gateway.errors.UpstreamError`, or
    :class:`~flowprefill.gateway.errors.NoHealthyInstanceError` when nothing is left to
    pick."""
    if admitted is not None and admitted.request_id != work.request_id:
        raise ValueError(f"admitted {admitted.request_id}, asked to send {work.request_id}")
    for n in range(1, MAX_ATTEMPTS + 1):
        first = admitted.instance if admitted is not None and n == 1 else None
        if first is not None and pool.available(first):
            inst = first
        else:
            inst = pool.pick(deadline_s=work.deadline_s, num_tokens=work.num_tokens)
        pool.begin(inst, work.request_id, work.deadline_s, work.num_tokens)
        received = False
        try:
            async with (
                aclosing(attempt(inst)) as items,
                aclosing(until_stalled(items, inst, pool.role)) as guarded,
            ):
                async for item in guarded:
                    received = True
                    yield item
            pool.mark_success(inst)
            return
        except UpstreamError as e:
            if e.status >= 500:
                pool.mark_failure(inst)
            again = e.retryable or (e.connection_lost and not received)
            if not (again and n < MAX_ATTEMPTS):
                raise
        finally:
            pool.end(inst, work.request_id)


async def until_stalled(
    items: AsyncIterator[T], inst: Instance, role: str
) -> AsyncGenerator[T, None]:
    """``items``, until ``inst`` is declared stalled: then the pending step is cancelled
    (which closes its upstream connection) and an unanswered :class:`UpstreamError` is
    raised instead.

    The steps run in the caller's task — upstream clients keep per-task state across a
    stream — so the abandonment is a cancellation of this task, sent only while it waits
    inside a step (``waiting``) and taken back (``uncancel``) when it arrives. A stall
    noticed while the consumer handles an item is acted on before the next step."""
    task = asyncio.current_task()
    assert task is not None, "until_stalled runs inside a task"
    waiting = abandoned = False

    def on_stall() -> None:
        nonlocal abandoned
        if waiting and not abandoned:
            abandoned = True
            task.cancel(f"{role} instance {inst.url} stalled")

    inst.stall.add_listener(on_stall)
    try:
        while True:
            if inst.stall.is_set():
                raise _stalled(inst, role)
            waiting = True
            try:
                item = await anext(items)
            except StopAsyncIteration:
                if abandoned:  # it swallowed the cancellation and finished anyway
                    task.uncancel()
                return
            except (asyncio.CancelledError, UpstreamError):
                # Ours alone (not the client's too): the attempt is abandoned, not failed.
                if abandoned and task.uncancel() == 0:
                    raise _stalled(inst, role) from None
                raise
            finally:
                waiting = False
            if abandoned:  # the step finished anyway; the cancellation is not ours to keep
                task.uncancel()
                raise _stalled(inst, role)
            inst.last_item_s = time.monotonic()
            yield item
    finally:
        inst.stall.remove_listener(on_stall)


def _stalled(inst: Instance, role: str) -> UpstreamError:
    return UpstreamError(
        503,
        f"{role} instance {inst.url} stopped answering (health probes failed); abandoned",
        f"{role}_stalled",
        connection_lost=True,
    )


async def failover_call(
    pool: InstancePool,
    work: Placement,
    call: Callable[[Instance], Awaitable[T]],
    admitted: Admitted | None = None,
) -> T:
    """:func:`failover` for an attempt with one result."""

    async def once(inst: Instance) -> AsyncGenerator[T, None]:
        yield await call(inst)

    results = [r async for r in failover(pool, work, once, admitted)]
    return results[-1]
