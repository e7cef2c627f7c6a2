"""Prefill replicas that come and go, driven by a controller, with GPU-time accounting.

:class:`ElasticSimulation` is the driver's :class:`~flowprefill.lab.sim.driver.Simulation`
with a pool whose size a :class:`~flowprefill.lab.sim.autoscalers.Controller` sets every
``period_s``:

* A replica asked for at *t* starts warming: it holds its GPU from *t* on but takes
  traffic only from ``t + startup_s`` (weights loaded, CUDA graphs captured). Until then
  the controller sees it as *warming* (``PoolObservation.warming_replicas``).
* A replica removed stops taking traffic at once and *drains*: it finishes every request
  it already has (its own scheduler keeps running them), then releases its GPU. A
  replica removed while still warming releases it at once. Removal takes warming replicas
  first (the newest first, as a Deployment deletes not-ready pods first), then the ready
  replica with the least outstanding work (the shortest drain).
* GPU time of a replica: from when it was asked for to when its GPU is released — the
  end of its drain, or ``horizon_s`` (the end of the day) for a replica still serving
  then. ``gpu_hours = Σ GPU time × gpus_per_replica / 3600``, in simulated seconds: with
  a time-compressed day multiply by the compression for real hours
  (:mod:`flowprefill.lab.sim.diurnal`).

Replicas present at ``t = 0`` are ready at once (the day starts from a steady state).
What the controller sees of finished and late requests is ``judge``
(:class:`~flowprefill.lab.sim.autoscalers.Judge`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from flowprefill.autoscale.policy import PoolObservation
from flowprefill.lab.sim.autoscalers import Controller, FinishedLog, Judge, Observed
from flowprefill.lab.sim.driver import Instance, SimResult, Simulation
from flowprefill.lab.sim.gateway import Router, outstanding_tokens
from flowprefill.prefill.request import Request, Task


@dataclass(eq=False)
class Replica:
    instance: Instance
    started_s: float
    """When it was asked for: its GPU is held from here."""
    ready_s: float
    """When it takes traffic."""
    removed_s: float | None = None
    stopped_s: float | None = None
    """When its GPU was released (None: still held)."""

    def takes_traffic(self, now_s: float) -> bool:
        return self.removed_s is None and now_s >= self.ready_s

    def warming(self, now_s: float) -> bool:
        return self.removed_s is None and now_s < self.ready_s

    def idle(self) -> bool:
        return self.instance.scheduler.queue_depth == 0 and self.instance.next_wake_s() == math.inf

    def gpu_s(self, horizon_s: float) -> float:
        end = self.stopped_s if self.stopped_s is not None else max(horizon_s, self.started_s)
        return end - self.started_s


@dataclass(frozen=True, slots=True)
class PoolSample:
    """The pool at one control step (after the controller's decision)."""

    time_s: float
    replicas: int
    ready: int
    draining: int


def _queued(instance: Instance) -> int:
    """Requests waiting on ``instance``: all not finished, less the running task's."""
    sched = instance.scheduler
    running = sched.running
    in_run = 0 if running is None else sum(not r.is_terminal for r in running.requests)
    return sched.queue_depth - in_run


class ElasticSimulation(Simulation):
    """A simulation whose prefill pool ``controller`` resizes every ``period_s``."""

    def __init__(
        self,
        make_instance: Callable[[], Instance],
        controller: Controller,
        *,
        initial_replicas: int,
        startup_s: float,
        period_s: float,
        horizon_s: float,
        router: Router | None = None,
        gpus_per_replica: int = 1,
        judge: Judge = Judge.FIRST_TOKEN,
        miss_budget: int | None = None,
    ) -> None:
        if initial_replicas < 1:
            raise ValueError(f"initial_replicas must be ≥ 1, got {initial_replicas}")
        if startup_s < 0 or period_s <= 0 or horizon_s <= 0:
            raise ValueError(
                f"need startup_s ≥ 0, period_s > 0, horizon_s > 0; got {startup_s}, "
                f"{period_s}, {horizon_s}"
            )
        self.replicas = [Replica(make_instance(), 0.0, 0.0) for _ in range(initial_replicas)]
        super().__init__(
            [r.instance for r in self.replicas], router=router, miss_budget=miss_budget
        )
        self.make_instance = make_instance
        self.controller = controller
        self.startup_s = startup_s
        self.period_s = period_s
        self.horizon_s = horizon_s
        self.gpus_per_replica = gpus_per_replica
        self.judge = judge
        self.log = FinishedLog()
        self._by_deadline: list[Request] = []
        self._next_due = 0
        self.samples: list[PoolSample] = []
        self._next_tick_s = period_s

    # ------------------------------------------------------------ driver hooks
    def routable(self, now_s: float) -> list[Instance]:
        ready = [r.instance for r in self.replicas if r.takes_traffic(now_s)]
        if not ready:
            raise RuntimeError(f"no replica takes traffic at t={now_s:.3f} s")
        return ready

    def next_tick_s(self) -> float:
        return self._next_tick_s

    def count_finished(self, task: Task) -> None:
        super().count_finished(task)
        for r in task.requests:
            if r.finish_s is None or r.met_slo is None:
                continue
            if r.met_slo or self.judge is Judge.FIRST_TOKEN:
                self.log.add_finished(r)

    def _judge_overdue(self, now_s: float) -> None:
        """``deadline`` judging: count as missed every request due by ``now_s`` that has
        no first token by its deadline."""
        due = self._by_deadline
        while self._next_due < len(due) and due[self._next_due].deadline_s <= now_s:
            r = due[self._next_due]
            self._next_due += 1
            if r.finish_s is None or r.finish_s > r.deadline_s:
                self.log.add(r.slo_class, r.deadline_s, met=False, ttft_s=r.ttft_slo_s)

    def tick(self, now_s: float) -> None:
        self._release_drained(now_s)
        if self.judge is Judge.DEADLINE:
            self._judge_overdue(now_s)
        if now_s >= self.horizon_s:  # the day is over: the pool stays as it is
            self._next_tick_s = math.inf
            return
        asked = [r for r in self.replicas if r.removed_s is None]
        warming = sum(r.warming(now_s) for r in asked)
        obs = PoolObservation(now_s, len(asked), len(asked) - warming, warming)
        queued = sum(_queued(r.instance) for r in asked if r.takes_traffic(now_s))
        work = sum(r.instance.pool.work_s for r in self.replicas)
        target = self.controller.decide(Observed(obs, self.log, queued, work))
        self.resize(target, now_s)
        self._sample(now_s)
        self._next_tick_s = now_s + self.period_s

    # ------------------------------------------------------------ the pool
    def resize(self, target: int, now_s: float) -> None:
        """Ask for ``target`` replicas from ``now_s`` (at least one)."""
        target = max(1, target)
        asked = [r for r in self.replicas if r.removed_s is None]
        for _ in range(target - len(asked)):
            inst = self.make_instance()
            self.replicas.append(Replica(inst, now_s, now_s + self.startup_s))
            self.instances.append(inst)
        excess = len(asked) - target
        if excess <= 0:
            return
        # Warming ones first (newest first), then the ready one with the shortest drain.
        order = sorted(
            asked,
            key=lambda r: (
                not r.warming(now_s),
                -r.started_s if r.warming(now_s) else outstanding_tokens(r.instance.scheduler),
            ),
        )
        for r in order[:excess]:
            r.removed_s = now_s
            if now_s < r.ready_s:
                r.stopped_s = now_s  # never served: the pod is deleted
        self._release_drained(now_s)

    def _release_drained(self, now_s: float) -> None:
        for r in self.replicas:
            if r.removed_s is not None and r.stopped_s is None and r.idle():
                # The pool's clock stopped at its last completion (or the removal).
                r.stopped_s = max(r.removed_s, r.instance.pool.now_s)

    def _sample(self, now_s: float) -> None:
        asked = [r for r in self.replicas if r.removed_s is None]
        self.samples.append(
            PoolSample(
                now_s,
                len(asked),
                sum(r.takes_traffic(now_s) for r in asked),
                sum(r.removed_s is not None and r.stopped_s is None for r in self.replicas),
            )
        )

    def run(self, requests: Sequence[Request]) -> SimResult:
        self._by_deadline = sorted(requests, key=lambda r: r.deadline_s)
        self._next_due = 0
        result = super().run(requests)
        if not result.stopped_early:  # else replicas still hold work: no accounting
            self.finish()
        return result

    # ------------------------------------------------------------ accounting
    def finish(self) -> None:
        """Release the GPUs of replicas that drained after the last control step."""
        for r in self.replicas:
            if r.removed_s is not None and r.stopped_s is None:
                if not r.idle():
                    raise RuntimeError("a removed replica still has work after the run")
                r.stopped_s = max(r.removed_s, r.instance.pool.now_s)

    def gpu_seconds(self) -> float:
        """GPU time of every replica (see the module docstring)."""
        return self.gpus_per_replica * sum(r.gpu_s(self.horizon_s) for r in self.replicas)

    def gpu_hours(self) -> float:
        return self.gpu_seconds() / 3600.0
