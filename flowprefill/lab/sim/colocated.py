"""One device group runs both phases (the paper's §6.5, Figure 16): colocated systems.

Every request's prefill gives its first token; then it decodes one token per step until
its output length (:mod:`.decode`). Two ways of sharing one device:

* ``vllm-cp2k`` — vLLM's continuous batching with chunked prefill (its default FCFS
  scheduler, ``max_num_batched_tokens`` = 2,048): each iteration runs every decoding
  request (one token each, scheduled first, as vLLM does) and fills the rest of the 2,048-
  token budget with prompt chunks in arrival order, several prompts per iteration if they
  fit, at most ``max_num_seqs`` (256) requests in flight. An iteration is **one** pass
  over all its rows (:meth:`DecodeCostModel.iteration_s`: the weights are read once for
  the chunk and the decodes together, one per-pass overhead). Every decode token of the
  iteration, and the first token of a prompt whose last chunk it ran, comes at its end.
* ``flowprefill`` — the engine's own ``Scheduler`` (S-EDF, SLO-aware batching, operator-
  level preemption, 4 ms run-time splitting: the disaggregated ``flowprefill`` system of
  :mod:`.systems`) drives the prefill instance; a decode instance on the same device runs
  steps back to back while any request decodes, its batch the requests decoding when a
  step starts (a request joins at the first step after its first token; the KV stays on
  the device, no hand-off). **Interference rule** (processor sharing): the two instances
  are separate streams on one device, so while a prefill runs the device is shared —
  a decode step that starts while a prefill task runs takes ``(1 + α)`` times its solo
  time and the prefill loses ``α`` times the solo time (:meth:`SimulatedPool.stall`);
  a prefill submitted during a solo step shares its remainder the same way. ``α = 1``
  (default) is strict equal time-sharing: work-conserving, each at half speed, no credit
  for overlapping memory-bound decode with compute-bound prefill (pessimistic for both
  instances). Short prefills finishing sooner under S-EDF is then what shortens the
  interference, as the paper reports.
* ``flowprefill-da`` (decode-aware, issue 24 item 2's policy in the simulator): when a
  step would share the device and that would carry some decoding request's mean gap so
  far (its TPOT, this step's token included) past its TBT target, the running prefill
  parks at its next operator boundary for the length of one solo step (the step waits
  for that boundary, then runs alone) — unless the park would cost a TTFT target, the
  engine's rule: parked and then run for its predicted rest, the prefill must still end
  by its earliest deadline and by the latest start of the most urgent waiting request
  (vetoed otherwise, and it shares); otherwise as ``flowprefill``. Judging the mean,
  not the single gap, lets a request bank slack: with a target under two solo steps a
  per-gap rule parks at every step and starves prefill (measured: TTFT attainment
  26.5 % against 99.9 % at 2 req/s with 25 ms targets; docs/simulator.md).

Not modelled: KV-cache capacity (no request waits for memory), vLLM's priority
scheduling, speculative or multi-step decoding, and the per-iteration CPU work beyond the
2 ms pass overhead.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from flowprefill.bench.workload import Workload
from flowprefill.contracts.slo import PAPER_TBT_SLOS_S
from flowprefill.errors import InvalidRequestError, UnknownNameError
from flowprefill.lab.sim.cost import GPUCostModel, Segment
from flowprefill.lab.sim.decode import DecodeCostModel, DecodeRecord, output_lengths
from flowprefill.lab.sim.driver import _COMPLETION, Instance, Simulation
from flowprefill.lab.sim.systems import build_instance, cached_predict, fit_predictor, get_system
from flowprefill.prefill.request import RequestState, Task

TTFT_SCALE = 3.0
"""§6.5: "we relax the TTFT SLO to 3× the values in Table 2" (half the GPUs of 1P1D)."""
TBT_SLOS_S = PAPER_TBT_SLOS_S
"""§6.5: 0.1 s text/image, 0.2 s search/file."""
INTERFERENCE = 1.0
"""α of the processor-sharing rule (module docstring)."""
CHUNK_TOKENS = 2048
MAX_NUM_SEQS = 256
"""vLLM's default ``max_num_seqs``."""
MAX_BLOCKING_S = 0.004
"""The engine's run-time splitting bound on a GPU (docs/simulator.md)."""


@dataclass(frozen=True, slots=True)
class ColocatedSystem:
    name: str
    label: str
    decode_aware: bool = False
    vllm: bool = False


COLOCATED_SYSTEMS: dict[str, ColocatedSystem] = {
    s.name: s
    for s in (
        ColocatedSystem("vllm-cp2k", "vLLM-CP2K", vllm=True),
        ColocatedSystem("flowprefill", "FlowPrefill"),
        ColocatedSystem("flowprefill-da", "FlowPrefill, decode-aware", decode_aware=True),
    )
}


def get_colocated(name: str) -> ColocatedSystem:
    spec = COLOCATED_SYSTEMS.get(name.lower())
    if spec is None:
        raise UnknownNameError("colocated system", name, list(COLOCATED_SYSTEMS))
    return spec


@dataclass(slots=True)
class ColocatedResult:
    """One run: per request (arrival order) its class, TTFT target and output record."""

    system: str
    rate: float
    arrival_s: list[float]
    slo_class: list[str]
    ttft_slo_s: list[float]
    records: list[DecodeRecord]
    num_steps: int = 0
    """Decode steps (FlowPrefill) or iterations (vLLM)."""
    num_parks: int = 0
    """Decode-aware parks of a running prefill."""
    num_vetoes: int = 0
    """Parks the running prefill's or the queue's TTFT vetoed."""
    num_preemptions: int = 0

    def ttft_s(self, i: int) -> float | None:
        first = self.records[i].first_token_s
        return None if first is None else first - self.arrival_s[i]

    def met_ttft(self, i: int) -> bool:
        ttft = self.ttft_s(i)
        return ttft is not None and ttft <= self.ttft_slo_s[i]

    def _share(self, ok: list[bool]) -> float:
        return sum(ok) / len(ok) if ok else 0.0

    @property
    def ttft_attainment(self) -> float:
        return self._share([self.met_ttft(i) for i in range(len(self.records))])

    @property
    def tbt_attainment(self) -> float:
        """Requests whose mean gap (TPOT) is within their class's TBT target."""
        return self._share([r.met_tbt for r in self.records])

    @property
    def both_attainment(self) -> float:
        n = len(self.records)
        return self._share([self.met_ttft(i) and self.records[i].met_tbt for i in range(n)])

    @property
    def gap_attainment(self) -> float:
        """Every inter-token gap of every request: the share within its target."""
        gaps = sum(r.num_gaps for r in self.records)
        return sum(r.gaps_within for r in self.records) / gaps if gaps else 0.0

    def per_class(self) -> dict[str, tuple[float, float]]:
        """class → (TTFT attainment, TBT attainment)."""
        out: dict[str, tuple[float, float]] = {}
        for c in sorted(set(self.slo_class)):
            idx = [i for i, k in enumerate(self.slo_class) if k == c]
            ttft = self._share([self.met_ttft(i) for i in idx])
            out[c] = (ttft, self._share([self.records[i].met_tbt for i in idx]))
        return out


def _records(
    workload: Workload, outputs: list[int], tbt_slos_s: dict[str, float], *, keep_gaps: bool
) -> list[DecodeRecord]:
    return [
        DecodeRecord(n, out, tbt_slos_s[c], keep_gaps=keep_gaps)
        for n, out, c in zip(workload.num_tokens, outputs, workload.slo_class, strict=True)
    ]


# ----------------------------------------------------------------------- vLLM-CP2K


@dataclass(slots=True)
class _Prompt:
    record: DecodeRecord
    done: int = 0


def run_vllm(
    arrivals_s: list[float],
    records: list[DecodeRecord],
    decode: DecodeCostModel,
    *,
    chunk_tokens: int = CHUNK_TOKENS,
    max_num_seqs: int = MAX_NUM_SEQS,
) -> int:
    """vLLM's iteration loop (module docstring) over requests in arrival order; fills
    ``records`` and returns the number of iterations."""
    if chunk_tokens <= 0:
        raise InvalidRequestError(f"chunk size must be positive, got {chunk_tokens}")
    waiting: deque[_Prompt] = deque()
    decoding: list[DecodeRecord] = []
    t, i, n, iterations = 0.0, 0, len(records), 0
    while i < n or waiting or decoding:
        while i < n and arrivals_s[i] <= t:
            waiting.append(_Prompt(records[i]))
            i += 1
        if not waiting and not decoding:
            t = arrivals_s[i]
            continue
        budget = chunk_tokens - len(decoding)  # decodes are scheduled first, 1 token each
        in_flight = len(decoding)
        chunks: list[tuple[_Prompt, int]] = []
        for p in waiting:
            if budget <= 0 or (p.done == 0 and in_flight >= max_num_seqs):
                break
            take = min(budget, p.record.prompt_tokens - p.done)
            chunks.append((p, take))
            budget -= take
            in_flight += p.done == 0
        segments: list[Segment] = [(take, p.done) for p, take in chunks]
        t += decode.iteration_s(segments, [r.context for r in decoding])
        iterations += 1
        for r in decoding:
            r.emit(t)
        decoding = [r for r in decoding if not r.done]
        for p, take in chunks:
            p.done += take
            if p.done == p.record.prompt_tokens:
                waiting.popleft()  # FCFS: finished prompts are at the head
                p.record.emit(t)
                if not p.record.done:
                    decoding.append(p.record)
    return iterations


# ----------------------------------------------------------------------- FlowPrefill


@dataclass(eq=False)
class _ColocatedInstance(Instance):
    """The prefill instance; after each round the decode side sees the device's task."""

    def wake(self, now_s: float, sim: Simulation) -> None:
        Instance.wake(self, now_s, sim)
        if isinstance(sim, ColocatedSimulation):
            sim.after_round(now_s)


@dataclass(slots=True)
class _Step:
    members: list[DecodeRecord]
    end_s: float
    parked: bool
    charged: set[int] = field(default_factory=set)
    """Prefill tasks already charged for sharing this step."""


class ColocatedSimulation(Simulation):
    """The engine's prefill instance and a decode instance on one device (module
    docstring). Decode steps are the base driver's control ticks."""

    def __init__(
        self,
        instance: Instance,
        decode: DecodeCostModel,
        records: dict[int, DecodeRecord],
        *,
        interference: float = INTERFERENCE,
        decode_aware: bool = False,
    ) -> None:
        if not 0 <= interference <= 1:
            raise InvalidRequestError(f"interference must be in [0, 1], got {interference}")
        super().__init__([instance])
        self.instance, self.decode, self.records = instance, decode, records
        self.alpha, self.decode_aware = interference, decode_aware
        self.active: list[DecodeRecord] = []
        self.step: _Step | None = None
        self.start_s = math.inf
        self.num_steps = self.num_parks = self.num_vetoes = 0

    def count_finished(self, task: Task) -> None:
        super().count_finished(task)
        for r in task.requests:
            if r.state is RequestState.FINISHED and r.finish_s is not None:
                rec = self.records[r.seq]
                rec.emit(r.finish_s)  # the first token is the prefill's
                if not rec.done:
                    self.active.append(rec)
                    if self.step is None:
                        self.start_s = min(self.start_s, r.finish_s)

    def next_tick_s(self) -> float:
        return self.step.end_s if self.step is not None else self.start_s

    def tick(self, now_s: float) -> None:
        step = self.step
        if step is not None and step.end_s <= now_s:
            for rec in step.members:
                rec.emit(step.end_s)
            self.active = [r for r in self.active if not r.done]
            self.step = None
        self.start_s = math.inf
        if self.step is None and self.active:
            self._start_step(now_s)

    def _start_step(self, now_s: float) -> None:
        solo_s = self.decode.step_s([r.context for r in self.active])
        pool = self.instance.pool
        running = pool.running
        self.num_steps += 1
        token = None if running is None else pool.token(running)
        if running is None:
            self.step = _Step(list(self.active), now_s + solo_s, parked=False)
            return
        shared_end = now_s + solo_s * (1 + self.alpha)
        at_risk = any(
            r.first_token_s is not None
            and shared_end - r.first_token_s > (r.num_gaps + 1) * r.tbt_target_s
            for r in self.active
        )
        park = self.decode_aware and at_risk
        if park and not self._affordable(running, now_s, solo_s):
            park = False
            self.num_vetoes += 1
        if park:
            begin = pool.stall(solo_s, now_s=now_s, at_next_checkpoint=True)
            self.step = _Step(list(self.active), begin + solo_s, parked=True)
            self.num_parks += 1
        else:
            pool.stall(self.alpha * solo_s, now_s=now_s)
            self.step = _Step(list(self.active), shared_end, parked=False)
        self.step.charged.add(running.task_id)
        self._repost(running, token)

    def _affordable(self, task: Task, now_s: float, park_s: float) -> bool:
        """The engine's TTFT-first rule (:meth:`DecodeYield.affordable
        <flowprefill.prefill.executor.decode_yield.DecodeYield.affordable>`, with the
        engine's budget and the queue's latest start): parked at its next checkpoint for
        ``park_s``, then run for the predicted rest, ``task`` must still end by its earliest
        deadline and by the latest start of the most urgent waiting request that can
        still make its own."""
        park = self.instance.pool.next_park(now_s)
        if park is None:
            return True  # it ends first: no park happens, nothing to veto
        begin, progress = park
        scheduler = self.instance.scheduler
        by = min(r.deadline_s for r in task.requests)
        head = scheduler.most_urgent_waiting(now_s)
        if head is not None:
            latest = head.deadline_s - scheduler.predict_s(head.num_tokens)
            if latest >= now_s:  # one that cannot make it any more does not hold decode back
                by = min(by, latest)
        rest_s = scheduler.predict_s(task.num_tokens) * (1.0 - progress)
        return begin + park_s + rest_s <= by

    def after_round(self, now_s: float) -> None:
        """A task the round started during a step shares (or, parked, waits out) the
        rest of it."""
        step, pool = self.step, self.instance.pool
        running = pool.running
        if step is None or running is None or running.task_id in step.charged:
            return
        left = step.end_s - now_s
        if left <= 0:
            return
        step.charged.add(running.task_id)
        token = pool.token(running)
        if step.parked:
            pool.stall(left, now_s=now_s)
        else:
            pool.stall(self.alpha * left, now_s=now_s)
            step.end_s += self.alpha * left
        self._repost(running, token)

    def _repost(self, task: Task, token_before: int | None) -> None:
        """Post the stalled task's new completion (its old one is now stale); nothing
        when the stall did not happen (the task was done: its completion stands)."""
        pool = self.instance.pool
        token = pool.token(task)
        if token != token_before:
            self.instance.post(pool.done_s(task), _COMPLETION, task, token or 0)

    def drain(self) -> None:
        """Decode what is left once every prefill is done (the base loop has stopped)."""
        while (t := self.next_tick_s()) < math.inf:
            self.tick(t)


def run_colocated(
    system: str,
    workload: Workload,
    cost: GPUCostModel,
    *,
    rate: float,
    seed: int = 0,
    ttft_scale: float = TTFT_SCALE,
    interference: float = INTERFERENCE,
    keep_gaps: bool = False,
    decode: DecodeCostModel | None = None,
    outputs: list[int] | None = None,
    tbt_slos_s: dict[str, float] = TBT_SLOS_S,
) -> ColocatedResult:
    """One colocated run of ``workload`` at ``rate`` req/s; output lengths from ``seed``
    (or ``outputs``, one per request, first token included)."""
    spec = get_colocated(system)
    decode = decode or DecodeCostModel(cost)
    requests = workload.requests(rate, ttft_scale)
    if outputs is None:
        outputs = output_lengths(len(workload), seed)
    if len(outputs) != len(workload) or min(outputs) < 1:
        raise InvalidRequestError("outputs: one length ≥ 1 per request")
    records = _records(workload, outputs, tbt_slos_s, keep_gaps=keep_gaps)
    result = ColocatedResult(
        spec.name,
        rate,
        [r.arrival_s for r in requests],
        [r.slo_class for r in requests],
        [r.ttft_slo_s for r in requests],
        records,
    )
    if spec.vllm:
        result.num_steps = run_vllm(result.arrival_s, records, decode)
        return result
    fp = get_system("flowprefill")
    predict_s = cached_predict(fit_predictor(cost, max_blocking_s=MAX_BLOCKING_S))
    base = build_instance(fp, cost, predict_s, max_blocking_s=MAX_BLOCKING_S)
    inst = _ColocatedInstance(base.scheduler, base.pool, base.admission)
    by_seq = {r.seq: rec for r, rec in zip(requests, records, strict=True)}
    sim = ColocatedSimulation(
        inst, decode, by_seq, interference=interference, decode_aware=spec.decode_aware
    )
    sim.run(requests)
    sim.drain()
    result.num_steps, result.num_parks = sim.num_steps, sim.num_parks
    result.num_vetoes = sim.num_vetoes
    result.num_preemptions = inst.scheduler.stats.num_preemptions
    return result
