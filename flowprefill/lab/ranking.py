"""The scheduling round as Algorithm 2 reads: rank every runnable entry, sort the whole
waiting queue for batching. The engine's :class:`Scheduler` decides the same from an
indexed queue (:mod:`flowprefill.prefill.scheduler.waiting`) at a cost that does not grow
with the queue; this is the reference it must agree with, command for command
(``tests/prefill/scheduler/test_replay.py``), and the baseline of
``benchmarks/prefill/scheduling_round_cost.py``."""

from __future__ import annotations

from flowprefill.prefill.request import Request, RequestState, Task
from flowprefill.prefill.scheduler.core import Command, CommandKind, Scheduler, SchedulerOutput
from flowprefill.prefill.scheduler.policies import RankInput, SortKey


class RankingScheduler(Scheduler):
    """:class:`Scheduler` whose round ranks everything, as Algorithm 2 reads."""

    def schedule(self, now_s: float) -> SchedulerOutput:
        self.stats.num_rounds += 1
        out = SchedulerOutput(self.stats.num_rounds, now_s)
        items = self.runnable()
        if not items:
            return out
        keyed = [(self.sort_key(item, now_s), item) for item in items]
        _best_key, best = min(keyed, key=lambda kv: kv[0])
        if best is self.running:
            return out
        if self.running is not None and not self.parked_memory.fits_switch(
            self.running, None if isinstance(best, Request) else best
        ):
            out.declined_preemption = self.running
            self.stats.num_preemptions_declined += 1
            return out
        if isinstance(best, Request):
            candidates = sorted(
                (kv for kv in keyed if isinstance(kv[1], Request) and kv[1] is not best),
                key=lambda kv: kv[0],
            )
            batch = self.batching.form_batch(
                best,
                [r for _, r in candidates if isinstance(r, Request)],
                now_s=now_s,
                predict_s=self.predict_s,
                token_budget=self.token_budget,
            )
            target = Task(self._ranked_within(batch, keyed, now_s))
        else:
            target = best
        if self.running is not None:
            victim = self.running
            victim.transition(RequestState.PREEMPTED, now_s)
            self.preempted[victim.task_id] = victim
            self.parked_memory.park(victim)
            out.commands.append(Command(CommandKind.PREEMPT, victim))
            self.stats.num_preemptions += 1
        if isinstance(best, Request):
            for r in target.requests:
                del self.waiting[r.request_id]
                self._queue.remove(r.request_id)
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
        return out

    def _ranked_within(
        self, batch: list[Request], keyed: list[tuple[SortKey, Request | Task]], now_s: float
    ) -> list[Request]:
        inside = {id(r) for r in batch}
        outside = [k for k, x in keyed if id(x) not in inside]
        best_outside = min(outside, default=None)
        kept = list(batch)
        while len(kept) > 1 and best_outside is not None:
            leader = kept[0]
            rank = RankInput(
                leader.deadline_s,
                leader.arrival_s,
                self.predict_s(sum(r.num_tokens for r in kept)),
                leader.seq,
            )
            if self.policy.sort_key(rank, now_s) <= best_outside:
                break
            dropped = kept.pop()
            best_outside = min(best_outside, self.sort_key(dropped, now_s))
        return kept
