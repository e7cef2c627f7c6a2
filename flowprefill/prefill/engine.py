"""A FlowPrefill prefill instance: request queue, scheduler loop, execution pool, backend.

:class:`PrefillEngine` is the object servers and demos hold. ``submit`` validates a prompt,
stamps its arrival and deadline and returns a :class:`concurrent.futures.Future` that
resolves to a :class:`PrefillResult` (first token + KV cache) when the prefill finishes,
or raises the error that ended it. Everything else happens on the scheduler thread, which
publishes an :class:`EngineSnapshot` after each round: other threads (the HTTP server)
read the engine's state from that snapshot, never from the scheduler.

Deadline contract (:mod:`flowprefill.contracts.prefill_api`): a request carries its SLO
class's ``ttft_slo_s`` and the ``elapsed_s`` it already spent since the gateway received
it. Its ``arrival_s`` is that gateway arrival on this engine's clock (``clock() -
elapsed_s``), ``deadline_s = arrival_s + ttft_slo_s``, and ``met_slo``, the ``outcome``
label of ``flowprefill_prefill_requests`` and the TTFT histogram all measure from that
arrival against the class SLO.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

from flowprefill.contracts import slo as slo_contract
from flowprefill.contracts.engine import DEFAULT_BATCH_TOKEN_BUDGET, DecodeAwareSettings
from flowprefill.contracts.names import Batching
from flowprefill.contracts.prefill_api import PrefillLoad
from flowprefill.errors import EngineClosedError, InvalidRequestError, TaskCancelledError
from flowprefill.prefill.executor.decode_yield import DecodeYield
from flowprefill.prefill.executor.pool import ExecutionPool
from flowprefill.prefill.executor.preemption import TaskControl
from flowprefill.prefill.metrics import EngineMetrics
from flowprefill.prefill.request import Request, RequestState, Task
from flowprefill.prefill.scheduler.batching import BatchingPolicy, get_batching
from flowprefill.prefill.scheduler.core import CommandKind, Scheduler
from flowprefill.prefill.scheduler.loop import SchedulerLoop
from flowprefill.prefill.scheduler.memory import ParkedBytesFn, ParkedMemory
from flowprefill.prefill.scheduler.policies import get_policy
from flowprefill.prefill.scheduler.round import (
    Arrival,
    Cancel,
    Cancelled,
    Completion,
    PreemptOutcome,
    RoundOutput,
)

if TYPE_CHECKING:
    from flowprefill.kv.beats import BeatListener

BLOCKING_HISTORY = 10_000
"""How many recent preemptions ``PrefillEngine.preemptions`` keeps (the metrics histograms
count every one); bounded so a long-running server does not grow."""


class PrefillBackend(Protocol):
    """What the engine runs tasks on: a batch of prompts on the calling thread, reaching
    checkpoints on the way. :func:`flowprefill.prefill.factory.build_backend` builds one (a
    single executor, or a tensor-parallel instance's rank 0); it may also offer
    ``estimate_parked_bytes`` (a bound on what one parked task holds)."""

    @property
    def max_prompt_tokens(self) -> int: ...

    def run(self, prompts: Sequence[Sequence[int]], control: TaskControl) -> Sequence[Any]:
        """One output per prompt, in order."""
        ...

    def validate(self, prompts: Sequence[Sequence[int]]) -> Any:
        """Raise InvalidRequestError for a prompt the model cannot take (token ids...)."""
        ...


class Predictor(Protocol):
    def predict_s(self, num_tokens: int) -> float: ...


@dataclass(slots=True)
class PrefillResult:
    request_id: str
    slo_class: str
    output: Any
    """The backend's per-request output (first token, logits, KV cache)."""
    arrival_s: float
    """Gateway arrival on the engine's clock (submit time minus ``elapsed_s``)."""
    finish_s: float
    ttft_slo_s: float
    """The SLO class's TTFT target (not the budget left at submit)."""
    num_preemptions: int
    batch_size: int

    @property
    def ttft_s(self) -> float:
        """Gateway arrival → first token."""
        return self.finish_s - self.arrival_s

    @property
    def met_slo(self) -> bool:
        """The class SLO, judged from the gateway arrival."""
        return slo_contract.met_slo(self.ttft_s, self.ttft_slo_s)


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """The engine as its scheduler thread left it after a round, for other threads.

    Published by replacing ``PrefillEngine.snapshot`` with a new object (one reference
    assignment, atomic under the GIL), never by changing one: a reader holds a consistent
    view however far the scheduler has moved on since, and is at most one round behind.
    """

    running: bool
    """The scheduler loop runs: started, and neither stopped nor crashed."""
    backlog_tokens: int
    """Prompt tokens still to prefill: waiting and parked requests, and what remains of the
    running task."""
    queue_delay_s: float
    """The engine's predictor over ``backlog_tokens`` (0 when idle)."""
    num_requests: int
    """Requests the backlog consists of."""

    @property
    def load(self) -> PrefillLoad:
        """The backlog as the prefill API reports it."""
        return PrefillLoad(
            backlog_tokens=self.backlog_tokens,
            queue_delay_s=self.queue_delay_s,
            num_requests=self.num_requests,
        )


def take_snapshot(scheduler: Scheduler, *, running: bool) -> EngineSnapshot:
    """Everything ``scheduler`` holds (waiting requests, parked tasks and what remains of the
    running task, by its progress) and the predicted time to prefill it all. Call it on the
    thread that owns ``scheduler``."""
    waiting = scheduler.waiting
    tasks = list(scheduler.preempted.values())
    if scheduler.running is not None:
        tasks.append(scheduler.running)
    # Once per round on the scheduler thread: never a sum over the waiting queue.
    tokens = round(
        scheduler.waiting_tokens + sum(t.num_tokens * max(0.0, 1.0 - t.progress) for t in tasks)
    )
    return EngineSnapshot(
        running=running,
        backlog_tokens=tokens,
        queue_delay_s=scheduler.predict_s(tokens) if tokens else 0.0,
        num_requests=len(waiting) + sum(len(t.requests) for t in tasks),
    )


class PrefillEngine:
    def __init__(
        self,
        backend: PrefillBackend,
        predictor: Predictor,
        *,
        policy: str = "s-edf",
        batching: str | BatchingPolicy = Batching.SLO_AWARE,
        token_budget: int = DEFAULT_BATCH_TOKEN_BUDGET,
        clock: Callable[[], float] = time.monotonic,
        metrics: EngineMetrics | None = None,
        parked_memory_bytes: int | None = None,
        parked_bytes: ParkedBytesFn | None = None,
        decode_aware: DecodeAwareSettings | None = None,
    ) -> None:
        """``parked_memory_bytes`` bounds what preempted tasks hold (None: unbounded);
        a preemption that would exceed it is declined (:mod:`flowprefill.prefill.scheduler.memory`).
        ``parked_bytes`` bounds one parked task; default: the backend's
        ``estimate_parked_bytes``, which a budget requires. ``batching``: one of the
        engine's names (:class:`~flowprefill.contracts.names.Batching`), or a policy object
        (the simulator's ablations). ``decode_aware``: listen for decode's beats at its
        socket from :meth:`start` and park running prefills for decode steps whose TBT is
        at risk (:mod:`flowprefill.prefill.executor.decode_yield`); None: off."""
        self.backend = backend
        self.clock = clock
        self.metrics = metrics or EngineMetrics()
        self.scheduler = Scheduler(
            predict_s=predictor.predict_s,
            policy=get_policy(policy),
            batching=get_batching(batching) if isinstance(batching, str) else batching,
            token_budget=token_budget,
            parked_memory=ParkedMemory(
                parked_memory_bytes,
                parked_bytes or getattr(backend, "estimate_parked_bytes", None),
            ),
        )
        if parked_memory_bytes is not None:
            self.metrics.parked_budget_bytes.set(parked_memory_bytes)
        self.pool: ExecutionPool[Sequence[Any]] = ExecutionPool(self._run_task, self._on_task_done)
        self.decode_aware = decode_aware
        self.decode_yield: DecodeYield | None = None
        self._beats: BeatListener | None = None
        if decode_aware is not None:
            # Here, not at module level: the flowprefill.kv package imports torch, which
            # the engine alone does not need.
            from flowprefill.kv.beats import DecodeState

            self.decode_yield = DecodeYield(
                DecodeState(decode_aware.tbt_target_s, decode_aware.rule),
                max_park_s=decode_aware.max_park_s,
                on_park=self._count_decode_park,
                budget=self._ttft_budget,
                on_veto=self._count_decode_veto,
            )
            self.pool.decode_yield = self.decode_yield
        self.loop = SchedulerLoop(
            self.scheduler, self.pool, on_round=self._on_round, on_crash=self._on_crash, clock=clock
        )
        self.preemptions: deque[PreemptOutcome] = deque(maxlen=BLOCKING_HISTORY)
        """The most recent preemptions' outcomes, oldest first (appended on the scheduler
        thread): blocking and its handoff part."""
        self._decode_timeouts_seen = 0
        self._ids = itertools.count()
        # Guards _futures and _accepting: submit, cancel and close run on callers'
        # threads, round outputs and crashes arrive on the scheduler thread.
        self._lock = threading.Lock()
        self._futures: dict[str, Future[PrefillResult]] = {}
        self._accepting = False
        self._failure: BaseException | None = None
        self.snapshot = take_snapshot(self.scheduler, running=False)
        """The latest :class:`EngineSnapshot`; replaced, never changed."""

    # -------------------------------------------------------------- lifecycle

    def start(self) -> PrefillEngine:
        if self.decode_yield is not None and self.decode_aware is not None:
            from flowprefill.kv.beats import BeatListener

            self._beats = BeatListener(self.decode_aware.socket_path, self.decode_yield.state)
        self.loop.start()
        # Nothing is queued yet (submit waits for _accepting): the loop has no round to
        # publish until the first event, and this snapshot cannot overwrite a newer one.
        self.snapshot = take_snapshot(self.scheduler, running=True)
        with self._lock:
            self._accepting = True
        return self

    def __enter__(self) -> PrefillEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, *, drain: bool = True, timeout_s: float = 60.0) -> None:
        """Stop accepting; with ``drain`` let queued work finish (up to ``timeout_s``).

        Whatever is still unfinished afterwards fails with EngineClosedError — a caller
        is always answered, never left waiting.
        """
        with self._lock:
            self._accepting = False
            pending = list(self._futures.items())
        if drain:
            deadline = time.monotonic() + timeout_s
            for _, fut in pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    fut.exception(timeout=remaining)
                except Exception:
                    break
        with self._lock:
            unfinished = list(self._futures)
        for rid in unfinished:
            self.cancel(rid)
        self.loop.stop()
        self.pool.join(timeout_s=5.0)
        if self._beats is not None:
            self._beats.close()
            self._beats = None
        with self._lock:
            leftovers = list(self._futures.values())
            self._futures.clear()
        for fut in leftovers:
            _fail(fut, EngineClosedError("the prefill engine shut down"))

    def fail(self, error: BaseException) -> None:
        """The backend is gone (a tensor-parallel rank died): stop accepting and fail every
        request in flight with ``error``. Idempotent; the engine cannot recover."""
        with self._lock:
            if self._failure is None:
                self._failure = error
            self._accepting = False
            futures = list(self._futures.values())
            self._futures.clear()
        for fut in futures:
            _fail(fut, error)

    @property
    def failure(self) -> BaseException | None:
        """Why the engine stopped for good (None while it is healthy or just closed)."""
        with self._lock:
            return self._failure

    @property
    def accepting(self) -> bool:
        with self._lock:
            accepting = self._accepting
        return accepting and self.loop.running

    @property
    def blocking_times_s(self) -> list[float]:
        """The blocking times of :attr:`preemptions`, oldest first (a copy)."""
        return [p.blocking_s for p in list(self.preemptions)]

    # ---------------------------------------------------------------- requests

    def submit(
        self,
        prompt_token_ids: Sequence[int],
        *,
        ttft_slo_s: float,
        elapsed_s: float = 0.0,
        slo_class: str = "default",
        request_id: str | None = None,
    ) -> Future[PrefillResult]:
        """Queue a prompt of SLO class ``slo_class`` whose class TTFT target is ``ttft_slo_s``.

        ``elapsed_s`` (>= 0) is the time the request already spent since the gateway
        received it; the request's arrival is ``clock() - elapsed_s`` and its deadline
        ``arrival + ttft_slo_s``, so the first token is due ``ttft_slo_s - elapsed_s``
        from now (the remaining budget, possibly negative: such a request is still served).
        """
        if not self.accepting:
            failure = self.failure
            if isinstance(failure, EngineClosedError):
                raise failure
            raise EngineClosedError("the prefill engine is not accepting requests")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if not (isinstance(elapsed_s, int | float) and 0 <= elapsed_s < math.inf):
            raise InvalidRequestError(
                f"request {rid}: elapsed_s must be a finite number of seconds >= 0, "
                f"got {elapsed_s!r}"
            )
        request = Request.create(
            rid,
            arrival_s=self.clock() - elapsed_s,
            ttft_slo_s=ttft_slo_s,
            prompt_token_ids=list(prompt_token_ids),
            slo_class=slo_class,
            max_tokens=self.backend.max_prompt_tokens,
        )
        # Checked here, not in the task: one bad prompt must not fail a whole batch.
        self.backend.validate([request.prompt_token_ids or ()])
        fut: Future[PrefillResult] = Future()
        with self._lock:
            if rid in self._futures:
                raise InvalidRequestError(f"request id {rid!r} is already in flight")
            self._futures[rid] = fut
        self.loop.post(Arrival(request))
        return fut

    def cancel(self, request_id: str) -> None:
        """Drop a request (client gone). Its future fails with TaskCancelledError."""
        self.loop.post(Cancel(request_id))

    # ------------------------------------------------------------- internals

    def _run_task(self, task: Task, control: TaskControl) -> Sequence[Any]:
        prompts = [r.prompt_token_ids or () for r in task.requests]
        outputs = self.backend.run(prompts, control)
        if len(outputs) != len(prompts):
            raise RuntimeError(f"backend returned {len(outputs)} outputs for {len(prompts)}")
        return outputs

    def _ttft_budget(self, task: Task) -> tuple[float, float]:
        """What a decode-aware park must leave intact (the task's own thread): seconds until
        the task's earliest deadline, and its predicted prefill seconds."""
        deadline = min(r.deadline_s for r in task.requests)
        return deadline - self.clock(), self.scheduler.predict_s(task.num_tokens)

    def _count_decode_veto(self) -> None:
        self.metrics.decode_park_vetoes.inc()

    def _count_decode_park(self, seconds: float) -> None:
        """A task parked for decode (its own thread): parks and parked time."""
        m = self.metrics
        m.decode_parks.inc()
        m.decode_parked.inc(seconds)
        assert self.decode_yield is not None
        if self.decode_yield.timeouts > self._decode_timeouts_seen:
            self._decode_timeouts_seen = self.decode_yield.timeouts
            m.decode_park_timeouts.inc()

    def _on_task_done(
        self, task: Task, result: Sequence[Any] | None, error: BaseException | None
    ) -> None:
        self.loop.post(Completion(task, result, error))

    # ------------------------------------------- the scheduler thread's output

    def _on_round(self, out: RoundOutput) -> None:
        """Publish the snapshot, resolve futures and record metrics for what one round did.

        The snapshot goes first, so a caller woken by its future reads a backlog that no
        longer holds its own request."""
        self.snapshot = take_snapshot(self.scheduler, running=not out.stopped)
        for cancelled in out.cancelled:
            self._answer_cancel(cancelled)
        for completion in out.completed:
            self._answer_completion(completion)
        m = self.metrics
        for p in out.preempted:
            m.preemptions.inc()
            m.preemption_blocking.observe(p.outcome.blocking_s)
            m.preemption_handoff.observe(p.outcome.handoff_s)
            self.preemptions.append(p.outcome)
        if out.stopped:
            return
        m.rounds.inc()
        if out.commands:
            m.command_rounds.inc()
        for cmd in out.commands:
            if cmd.kind is CommandKind.SUBMIT:
                m.batch_size.observe(len(cmd.task.requests))
        m.queue_depth.set(self.scheduler.queue_depth)
        m.preempted_tasks.set(len(self.scheduler.preempted))
        m.parked_bytes.set(self.pool.parked_bytes)
        if out.scheduled is not None and out.scheduled.declined_preemption is not None:
            m.preemptions_declined.inc()
        if self.decode_yield is not None:
            self._publish_queue_start_by(self.decode_yield)

    def _publish_queue_start_by(self, decide: DecodeYield) -> None:
        """Tell decode-aware preemption by when the most urgent waiting request must start
        to make its TTFT deadline (the scheduler's thread, after a round); a park must not
        push it past that."""
        now = self.clock()
        head = self.scheduler.most_urgent_waiting(now)
        start_by = math.inf
        if head is not None:
            latest = head.deadline_s - self.scheduler.predict_s(head.num_tokens)
            if latest >= now:  # one that cannot make it any more does not hold decode back
                start_by = decide.clock() + (latest - now)
        decide.queue_start_by_s = start_by

    def _on_crash(self, error: BaseException) -> None:
        self.snapshot = replace(self.snapshot, running=False)
        self.fail(RuntimeError(f"prefill scheduler failed: {type(error).__name__}: {error}"))

    def _pop_future(self, request_id: str) -> Future[PrefillResult] | None:
        with self._lock:
            return self._futures.pop(request_id, None)

    def _answer_cancel(self, cancelled: Cancelled) -> None:
        fut = self._pop_future(cancelled.request_id)
        if fut is None:
            return
        r = cancelled.request
        self.metrics.requests.labels(r.slo_class if r else "unknown", "cancelled").inc()
        _fail(fut, TaskCancelledError(f"request {cancelled.request_id} was cancelled"))

    def _answer_completion(self, event: Completion) -> None:
        m = self.metrics
        for i, r in enumerate(event.task.requests):
            fut = self._pop_future(r.request_id)
            if r.state is RequestState.CANCELLED:
                if fut is not None:
                    _fail(fut, TaskCancelledError(f"request {r.request_id} was cancelled"))
                continue
            if event.error is not None or event.result is None:
                m.requests.labels(r.slo_class, "failed").inc()
                if fut is not None:
                    _fail(fut, event.error or RuntimeError("prefill produced no output"))
                continue
            res = PrefillResult(
                request_id=r.request_id,
                slo_class=r.slo_class,
                output=event.result[i],
                arrival_s=r.arrival_s,
                finish_s=r.finish_s if r.finish_s is not None else self.clock(),
                ttft_slo_s=r.ttft_slo_s,
                num_preemptions=r.num_preemptions,
                batch_size=len(event.task.requests),
            )
            m.ttft.labels(r.slo_class).observe(res.ttft_s)
            m.requests.labels(r.slo_class, "met" if res.met_slo else "missed").inc()
            if fut is not None and not fut.done():
                fut.set_result(res)


def _fail(fut: Future[PrefillResult], error: BaseException) -> None:
    # Each future is popped from _futures exactly once, so only its popper resolves it;
    # the check covers a caller that cancelled the Future object itself.
    if not fut.done():
        fut.set_exception(error)
