"""The scheduling decision of one round (the paper's Algorithm 2, lines 5–26), as pure state.

:class:`Scheduler` owns the three queues — waiting requests ``Q_w``, preempted tasks
``Q_p`` and the running task ``E`` — and nothing else. It never waits, sleeps or touches
threads: the caller reports arrivals and completions, then asks for one round at a given
time and carries out the returned commands, in order, on an execution pool. That caller
is :func:`flowprefill.prefill.scheduler.round.run_round`, which the engine's loop thread and the
simulator both call, so what the simulator predicts is what the engine decides.

Invariant after every :meth:`Scheduler.schedule` call: the running task holds the
highest-priority runnable entry (waiting request, preempted task or the running task
itself) under the configured policy at that instant — unless parking the running task
would exceed the parked-memory budget (:mod:`flowprefill.prefill.scheduler.memory`): then the
round declines the preemption, the running task continues and the round says so.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from flowprefill.contracts.engine import DEFAULT_BATCH_TOKEN_BUDGET
from flowprefill.errors import InvalidRequestError, UnknownTaskError
from flowprefill.prefill.predictor.model import TTFTPredictor
from flowprefill.prefill.request import Request, RequestState, Task
from flowprefill.prefill.scheduler.batching import BatchingPolicy, SLOAwareBatching
from flowprefill.prefill.scheduler.memory import ParkedMemory
from flowprefill.prefill.scheduler.policies import PriorityPolicy, RankInput, SlackEDF, SortKey
from flowprefill.prefill.scheduler.waiting import Candidates, WaitingQueue


class CommandKind(StrEnum):
    SUBMIT = "submit"
    PREEMPT = "preempt"
    RESUME = "resume"


@dataclass(frozen=True, slots=True)
class Command:
    kind: CommandKind
    task: Task


@dataclass(slots=True)
class SchedulerOutput:
    """What one round decided; commands are to be applied in order."""

    round_index: int
    now_s: float
    commands: list[Command] = field(default_factory=list)
    declined_preemption: Task | None = None
    """The running task, when a more urgent entry did not preempt it because parking it
    would exceed the parked-memory budget (no commands then)."""


@dataclass(slots=True)
class SchedulerStats:
    num_rounds: int = 0
    num_command_rounds: int = 0
    num_submits: int = 0
    num_preemptions: int = 0
    num_resumes: int = 0
    num_finished: int = 0
    num_preemptions_declined: int = 0
    """Rounds that left the running task running because of the parked-memory budget."""


class Scheduler:
    """Slack-aware EDF scheduling with SLO-aware batching over one execution slot."""

    def __init__(
        self,
        *,
        predict_s: Callable[[int], float],
        policy: PriorityPolicy | None = None,
        batching: BatchingPolicy | None = None,
        token_budget: int = DEFAULT_BATCH_TOKEN_BUDGET,
        parked_memory: ParkedMemory | None = None,
        predict_monotone: bool | None = None,
    ) -> None:
        """``parked_memory`` bounds the bytes preempted tasks hold (None: unbounded).
        ``predict_monotone``: ``predict_s`` never decreases in the token count (batching
        then skips candidates larger than one already too slow); None: True for a
        :class:`TTFTPredictor`'s method whose polynomial guarantees it, else False."""
        if token_budget <= 0:
            raise InvalidRequestError(f"batch token budget must be positive, got {token_budget}")
        self.policy: PriorityPolicy = policy or SlackEDF()
        self.batching: BatchingPolicy = batching or SLOAwareBatching()
        self.predict_s = predict_s
        if predict_monotone is None:
            owner = getattr(predict_s, "__self__", None)
            predict_monotone = isinstance(owner, TTFTPredictor) and owner.monotone
        self.predict_monotone = predict_monotone
        self.token_budget = token_budget
        self.parked_memory = parked_memory if parked_memory is not None else ParkedMemory()
        self.waiting: dict[str, Request] = {}
        """``Q_w`` by request id, in arrival order (read-only outside this class)."""
        self.preempted: dict[int, Task] = {}
        self.running: Task | None = None
        self.stats = SchedulerStats()
        self._known_ids: set[str] = set()
        self._queue = WaitingQueue(self.policy)
        """``Q_w`` in priority order: a round looks at the requests it may pick only."""
        self._full_s: dict[int, float] = {}
        """task_id -> predicted time of the whole task, for the tasks this scheduler holds
        (a task's requests never change, so a round keys it without predicting again;
        predicted when first keyed, not in the round that submits it)."""

    # ------------------------------------------------------------------ events

    def add(self, request: Request) -> None:
        """An arrival: the request joins ``Q_w``."""
        if request.request_id in self._known_ids:
            raise InvalidRequestError(f"request id {request.request_id!r} is already queued")
        if request.state is not RequestState.WAITING:
            raise InvalidRequestError(f"request {request.request_id} is {request.state}")
        self.waiting[request.request_id] = request
        self._known_ids.add(request.request_id)
        # A waiting request's rank input never changes: compute (and predict) it once.
        self._queue.add(
            request,
            RankInput(
                request.deadline_s,
                request.arrival_s,
                self.predict_s(request.num_tokens),
                request.seq,
            ),
        )

    def finish(self, task: Task, now_s: float, *, failed: bool = False) -> None:
        """A completion: ``task`` left the execution pool (done or failed)."""
        self.parked_memory.unpark(task)
        self._full_s.pop(task.task_id, None)
        if self.running is task:
            self.running = None
        elif self.preempted.pop(task.task_id, None) is None:
            # A preempt that raced with the task's last operator leaves it in Q_p until its
            # completion event arrives; anything else is a caller bug.
            raise UnknownTaskError(f"{task!r} is neither running nor preempted")
        task.transition(RequestState.FAILED if failed else RequestState.FINISHED, now_s)
        for r in task.requests:
            self._known_ids.discard(r.request_id)
        self.stats.num_finished += 1

    def cancel(self, request_id: str, now_s: float) -> Task | None:
        """Drop a request. Returns its task if no live request is left in it (to cancel it)."""
        r = self.waiting.pop(request_id, None)
        self._queue.remove(request_id)
        if r is not None:
            r.transition(RequestState.CANCELLED, now_s)
            self._known_ids.discard(request_id)
            return None
        for task in self._tasks():
            for member in task.requests:
                if member.request_id == request_id and not member.is_terminal:
                    member.transition(RequestState.CANCELLED, now_s)
                    if all(m.is_terminal for m in task.requests):
                        return task
                    return None
        return None

    def find(self, request_id: str) -> Request | None:
        """The queued request ``request_id`` (waiting, or in the running or a preempted task)."""
        r = self.waiting.get(request_id)
        if r is not None:
            return r
        for task in self._tasks():
            for member in task.requests:
                if member.request_id == request_id:
                    return member
        return None

    # ------------------------------------------------------------------ ranking

    def rank_input(self, item: Request | Task) -> RankInput:
        if isinstance(item, Request):
            cached = self._queue.rank_input(item.request_id)
            if cached is not None:
                return cached
            return RankInput(
                item.deadline_s, item.arrival_s, self.predict_s(item.num_tokens), item.seq
            )
        leader = item.requests[0]
        full_s = self._full_s.get(item.task_id)
        if full_s is None:
            full_s = self.predict_s(item.num_tokens)
            if item is self.running or item.task_id in self.preempted:
                self._full_s[item.task_id] = full_s  # until finish()
        remaining = full_s * max(0.0, 1.0 - item.progress)
        return RankInput(leader.deadline_s, leader.arrival_s, remaining, leader.seq)

    def sort_key(self, item: Request | Task, now_s: float) -> SortKey:
        return self.policy.sort_key(self.rank_input(item), now_s)

    def _tasks(self) -> Iterable[Task]:
        if self.running is not None:
            yield self.running
        yield from self.preempted.values()

    def runnable(self) -> list[Request | Task]:
        """``Q_all``: every waiting request, preempted task and the running task."""
        items: list[Request | Task] = list(self.waiting.values())
        items.extend(self._tasks())
        return items

    # ------------------------------------------------------------------ one round

    def schedule(self, now_s: float) -> SchedulerOutput:
        """Run one scheduling round at ``now_s``; returns the commands to carry out.

        Looks at the running and preempted tasks and at the waiting requests it may pick
        or batch only (:mod:`.waiting`), never ranks the whole queue."""
        stats = self.stats
        stats.num_rounds += 1
        out = SchedulerOutput(stats.num_rounds, now_s)
        # The smallest key of the running task, the parked ones and the queue's most
        # urgent request, in that order (keys are unique: they end with a seq).
        policy = self.policy
        running = self.running
        best: Request | Task | None = running
        best_key: SortKey | None = None
        if running is not None:
            best_key = policy.sort_key(self.rank_input(running), now_s)
        for task in self.preempted.values():
            key = policy.sort_key(self.rank_input(task), now_s)
            if best_key is None or key < best_key:
                best_key, best = key, task
        most_urgent = self._queue.first(now_s)
        if most_urgent is not None and (best_key is None or most_urgent[0] < best_key):
            best_key, best = most_urgent
        if best is None or best is running:
            return out
        assert best_key is not None

        if self._declines(best, out):
            return out
        if isinstance(best, Request):
            batch = self.batching.form_batch(
                best,
                Candidates(
                    self._queue, now_s, skip=best.request_id, monotone=self.predict_monotone
                ),
                now_s=now_s,
                predict_s=self.predict_s,
                token_budget=self.token_budget,
            )
            self._switch(Task(self._within_rank(batch, best_key, now_s)), out, now_s, submit=True)
        else:
            self._switch(best, out, now_s, submit=False)
        return out

    def _declines(self, best: Request | Task, out: SchedulerOutput) -> bool:
        """Whether the parked-memory budget keeps the running task running although
        ``best`` outranks it (said in ``out``). Decided before a batch is formed:
        declining leaves every queue as it was."""
        if self.running is None or self.parked_memory.fits_switch(
            self.running, None if isinstance(best, Request) else best
        ):
            return False
        out.declined_preemption = self.running
        self.stats.num_preemptions_declined += 1
        return True

    def _switch(self, target: Task, out: SchedulerOutput, now_s: float, *, submit: bool) -> None:
        """Preempt the running task (if any) and run ``target``: a new task of waiting
        requests (``submit``) or a parked one; the commands go to ``out`` in that order."""
        if self.running is not None:
            victim = self.running
            victim.transition(RequestState.PREEMPTED, now_s)
            self.preempted[victim.task_id] = victim
            self.parked_memory.park(victim)
            out.commands.append(Command(CommandKind.PREEMPT, victim))
            self.stats.num_preemptions += 1
        if submit:
            waiting, remove = self.waiting, self._queue.remove
            for r in target.requests:
                del waiting[r.request_id]
                remove(r.request_id)
            out.commands.append(Command(CommandKind.SUBMIT, target))
            self.stats.num_submits += 1
        else:
            del self.preempted[target.task_id]
            self.parked_memory.unpark(target)
            out.commands.append(Command(CommandKind.RESUME, target))
            self.stats.num_resumes += 1
        target.transition(RequestState.RUNNING, now_s)
        self.running = target
        self.stats.num_command_rounds += 1

    def _best_outside(self, batch: list[Request], now_s: float) -> SortKey | None:
        """The smallest key of a runnable entry that is not in ``batch``: a task's, or the
        first waiting request in order that the batch does not hold."""
        inside = {r.request_id for r in batch}
        keys = [self.sort_key(task, now_s) for task in self._tasks()]
        for key, request in self._queue.ordered(now_s):
            if request.request_id not in inside:
                keys.append(key)
                break
        return min(keys, default=None)

    def _within_rank(
        self, batch: list[Request], leader_key: SortKey, now_s: float
    ) -> list[Request]:
        """``batch`` without the trailing members that make it rank below an entry left
        outside it. A batch is ranked by its leader's deadline and the whole batch's
        predicted time, so a member can turn a feasible leader's batch infeasible (greedy
        batching fills the budget whatever the members' deadlines): the batch would
        then run although an entry outside it ranks higher — the task it just preempted,
        say — and be preempted by it at the next round. The leader alone is the best
        entry (of key ``leader_key``), so this keeps at least the leader."""
        if len(batch) == 1:
            return batch
        if self._batch_key(batch, now_s) <= leader_key:
            # The leader ranks first of every runnable entry, so the whole batch ranking
            # no lower does too: nothing would be trimmed (the usual case: a batch that
            # keeps its leader feasible keeps its key), and no outside entry is looked up.
            return batch
        return self._trimmed(batch, self._best_outside(batch, now_s), now_s)

    def _batch_key(self, batch: list[Request], now_s: float) -> SortKey:
        """The key of a task of ``batch``: its leader's deadline, the whole batch's time."""
        leader = batch[0]
        whole = RankInput(
            leader.deadline_s,
            leader.arrival_s,
            self.predict_s(sum([r.num_tokens for r in batch])),
            leader.seq,
        )
        return self.policy.sort_key(whole, now_s)

    def _trimmed(
        self, batch: list[Request], best_outside: SortKey | None, now_s: float
    ) -> list[Request]:
        """``batch`` without the trailing members that make it rank below
        ``best_outside`` (the smallest key left outside it), the leader always kept."""
        kept = list(batch)
        while len(kept) > 1 and best_outside is not None:
            if self._batch_key(kept, now_s) <= best_outside:
                break
            dropped = kept.pop()
            best_outside = min(best_outside, self.sort_key(dropped, now_s))
        return kept

    def most_urgent_waiting(self, now_s: float) -> Request | None:
        """The waiting request the policy ranks first at ``now_s`` (None: none waits)."""
        first = self._queue.first(now_s)
        return None if first is None else first[1]

    @property
    def waiting_tokens(self) -> int:
        """Prompt tokens of the waiting requests (O(1): kept by the queue)."""
        return self._queue.num_tokens

    @property
    def queue_depth(self) -> int:
        """Requests not yet finished: waiting plus those in running or preempted tasks."""
        return len(self.waiting) + sum(
            sum(not r.is_terminal for r in t.requests) for t in self._tasks()
        )
