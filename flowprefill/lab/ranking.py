"""The scheduling round as Algorithm 2 reads: rank every runnable entry, sort the whole
waiting queue for batching. The engine's :class:`Scheduler` decides the same from an
indexed queue (:mod:`flowprefill.prefill.scheduler.waiting`) at a cost that does not grow
with the queue; this is the reference it must agree with, command for command
(``tests/prefill/scheduler/test_replay.py``), and the baseline of
``benchmarks/prefill/scheduling_round_cost.py``."""

from __future__ import annotations

from flowprefill.prefill.request import Request, Task
from flowprefill.prefill.scheduler.core import Scheduler, SchedulerOutput
from flowprefill.prefill.scheduler.policies import SortKey


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
        if self._declines(best, out):
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
            self._switch(Task(self._ranked_within(batch, keyed, now_s)), out, now_s, submit=True)
        else:
            self._switch(best, out, now_s, submit=False)
        return out

    def _ranked_within(
        self, batch: list[Request], keyed: list[tuple[SortKey, Request | Task]], now_s: float
    ) -> list[Request]:
        inside = {id(r) for r in batch}
        best_outside = min((k for k, x in keyed if id(x) not in inside), default=None)
        return self._trimmed(batch, best_outside, now_s)
