"""Preemption blocking and prefill time of a running task while the queue is long and
arrivals stream in: what the scheduler's rounds cost the executor under the GIL.

The engine's loop thread runs a scheduling round for every arrival; the executor thread
runs the prefill and must take the GIL at each checkpoint to see a preemption signal. A
round that ranks the whole queue therefore slows the prefill and delays the ACK of an
urgent preemption. Per arm (queued requests × scheduler), one engine per run:

1. a blocker holds the executor (waiting at checkpoints, so it can be preempted) while
   ``--queued`` relaxed requests are queued behind it (they rank after everything below),
   and relaxed arrivals stream in at ``--rate`` per second from then on;
2. ``--longs`` long prompts, one after the other, each preempt the blocker; one urgent
   short prompt (a probe) arrives while each runs, at a set fraction of the prompt's solo
   time after it started executing, and preempts it;
3. recorded: the probes' blocking (signal → ACK, the engine's own measurement) and the
   part of it after the checkpoint (the handoff: device drain, GIL, wake-ups), the long
   prompts' TTFT and how many rounds ran meanwhile.

A probe's blocking is how long the operator its signal lands in still has to run (then
the checkpoint, the GIL and the ACK): on a CPU a 4,096-token prompt's attention runs for
tens of milliseconds, its other operators for well under one. So where the signal lands
decides a sample, and arms compare only if their signals land alike. Hence the moments
are timed from the long prompt's own start (not from its submission, which a long queue
delays), spread evenly over the prompt (each run's fractions are stratified), and the
same in every arm of a repeat (common random numbers; the intervals resample repeats,
pairing the arms). What remains between arms is what the queue costs: slower operators
(the GIL, the cores the rounds take), a later checkpoint, a later ACK.

Batching is off (``none``), so every arm does the same work: a probe runs alone, not
with queued requests. Schedulers: ``indexed`` (the engine's) and ``ranking``
(:mod:`flowprefill.lab.ranking`, which ranks every entry as the engine did before its
queue was indexed), swapped into the engine for the run. Each repeat runs the arms in a
fresh random order (seeded), so that drift, and what a run leaves behind for the next (a
dropped queue's garbage), hit every arm alike; the engine is dropped without draining
after each run. ``--gc frozen`` (default) freezes what startup built out of the garbage
collector's scans after the warm-up, as ``serve-prefill`` does; ``--gc python`` keeps
Python's defaults. Full collections that fall while a long prompt runs are counted with
their longest pause. The predictor is linear at ``--per-token-us`` (default: the prompt's
solo time), so that runs of the benchmark can share one.

    python benchmarks/prefill/queued_blocking.py                    # 0 / 1,000 / 10,000 queued
    python benchmarks/prefill/queued_blocking.py --queued 0,100 --repeats 1 --tokens 1024
    python benchmarks/prefill/queued_blocking.py --schedulers indexed --gc python
    python benchmarks/prefill/queued_blocking.py --device cuda --model llama3-8b --tokens 16384

On CUDA the model is ``benchmarks/gpuval``'s Llama-3-8B shape (random bf16 weights built on
the GPU, ``--layers`` to shorten it); docs/gpu.md has its figures on an H100.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

import flowprefill.prefill.engine as engine_module
from flowprefill.lab.ranking import RankingScheduler
from flowprefill.models import build_named
from flowprefill.prefill.engine import PrefillEngine
from flowprefill.prefill.executor.preemption import TaskControl
from flowprefill.prefill.executor.runner import PreemptibleExecutor
from flowprefill.prefill.predictor.model import TTFTPredictor
from flowprefill.prefill.scheduler.core import Scheduler
from flowprefill.web.gc_tuning import freeze_startup

SCHEDULERS: dict[str, type[Scheduler]] = {"indexed": Scheduler, "ranking": RankingScheduler}
RELAXED_SLO_S = 1e6
"""Queued and streaming requests: due long after the long prompt (1e5 s) and the probes."""


@dataclass
class Arm:
    queued: int
    scheduler: str
    blocking_runs: list[list[float]] = field(default_factory=list)
    """The probes' blocking, ms, one list per run (a probe that came after its long prompt
    had finished preempted nothing: no sample)."""
    handoff_ms: list[float] = field(default_factory=list)
    """Of each blocking sample, checkpoint → ACK seen (the rest: the operator's remainder)."""
    long_ttft_runs: list[list[float]] = field(default_factory=list)
    """The long prompts' TTFT, ms, one list per run."""
    start_lag_ms: list[float] = field(default_factory=list)
    """Each long prompt's submission → its task starting (the rounds before it, the
    blocker's ACK, a collection)."""
    probes_unanswered: int = 0
    rounds: list[int] = field(default_factory=list)
    arrivals: list[int] = field(default_factory=list)
    full_gc_ms: list[float] = field(default_factory=list)
    """Pauses of full (oldest-generation) garbage collections while the long prompts ran."""

    @property
    def blocking_ms(self) -> list[float]:
        return [b for run in self.blocking_runs for b in run]

    @property
    def long_ttft_ms(self) -> list[float]:
        return [t for run in self.long_ttft_runs for t in run]


class FullCollections:
    """Times Python's full garbage collections (``gc.callbacks``) while :attr:`on`: each
    holds the GIL for its whole scan, so a preemption signalled meanwhile waits for it."""

    def __init__(self) -> None:
        self.on = False
        self.pauses_s: list[float] = []
        self._began = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if not self.on or info["generation"] != 2:
            return
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.pauses_s.append(time.perf_counter() - self._began)

    def take(self) -> list[float]:
        """The pauses since the last call, seconds."""
        pauses, self.pauses_s = self.pauses_s, []
        return pauses


FULL_COLLECTIONS = FullCollections()

BLOCKER = [5] * 8
"""The blocker's prompt: :class:`Holding` keeps it at its checkpoints until released."""


class Holding:
    """The executor, except that the blocker's task waits at checkpoints until
    ``released`` (so no queued request runs between the long prompts, however slowly the
    machine submits them), and that each long prompt's start is stamped (``started``)."""

    def __init__(self, ex: PreemptibleExecutor, long_prompt: list[int]) -> None:
        self.ex = ex
        self.long_prompt = long_prompt
        self.released = threading.Event()
        self.started = threading.Event()
        self.started_at = 0.0
        self.max_prompt_tokens = ex.max_prompt_tokens

    def validate(self, prompts: Sequence[Sequence[int]]) -> Any:
        return self.ex.validate(prompts)

    def estimate_parked_bytes(self, num_tokens: int, num_requests: int = 1) -> int:
        return self.ex.estimate_parked_bytes(num_tokens, num_requests)

    def run(self, prompts: Sequence[Sequence[int]], control: TaskControl) -> Sequence[Any]:
        if list(prompts[0]) == BLOCKER:
            while not self.released.wait(0.002):
                control.check()
        elif list(prompts[0]) == self.long_prompt:
            self.started_at = time.perf_counter()
            self.started.set()
        return self.ex.run(prompts, control)


@contextmanager
def engine_with(
    cls: type[Scheduler], backend: Holding, predictor: TTFTPredictor
) -> Iterator[PrefillEngine]:
    """A started engine whose scheduler is ``cls`` (swapped in where the engine builds it)."""
    saved = engine_module.Scheduler
    engine_module.Scheduler = cls  # type: ignore[misc]
    try:
        engine = PrefillEngine(backend, predictor, batching="none").start()
    finally:
        engine_module.Scheduler = saved  # type: ignore[misc]
    try:
        yield engine
    finally:
        engine.close(drain=False, timeout_s=30)


def wait_until(cond: object, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError("the engine did not take the queued requests in time")
        time.sleep(0.01)


def one_run(
    arm: Arm,
    ex: PreemptibleExecutor,
    predictor: TTFTPredictor,
    long_prompt: list[int],
    long_s: float,
    phases: Sequence[float],
    args: argparse.Namespace,
) -> None:
    """One engine: fill its queue, then a long prompt per entry of ``phases``, each probed
    at that fraction of ``long_s`` after it started executing."""
    short = [7] * 16
    backend = Holding(ex, long_prompt)
    blocking, ttfts = [], []
    with engine_with(SCHEDULERS[arm.scheduler], backend, predictor) as engine:
        engine.submit(BLOCKER, ttft_slo_s=2e5, request_id="blocker")
        wait_until(lambda: engine.scheduler.running is not None, 30)
        for i in range(arm.queued):
            engine.submit(short, ttft_slo_s=RELAXED_SLO_S, request_id=f"q{i}")
        wait_until(lambda: engine.snapshot.num_requests >= arm.queued + 1, 600)
        stop, streamed = threading.Event(), [0]

        def stream() -> None:
            gap_s = 1.0 / args.rate
            while not stop.wait(gap_s):
                engine.submit(short, ttft_slo_s=RELAXED_SLO_S, request_id=f"s{streamed[0]}")
                streamed[0] += 1

        streamer = threading.Thread(target=stream, daemon=True)
        streamer.start()
        rounds_before = engine.scheduler.stats.num_rounds
        for j, phase in enumerate(phases):
            seen = len(engine.preemptions)
            backend.started.clear()
            FULL_COLLECTIONS.take()
            FULL_COLLECTIONS.on = True
            submitted_at = time.perf_counter()
            long_f = engine.submit(long_prompt, ttft_slo_s=1e5, request_id=f"long{j}")
            if not backend.started.wait(60):
                raise TimeoutError("the long prompt did not start in time")
            arm.start_lag_ms.append((backend.started_at - submitted_at) * 1e3)
            # Timed from the prompt's own start: its submission is delayed by the round
            # that takes it (and by a collection), and by the blocker's ACK, differently
            # per arm, which would move the probe to other operators.
            time.sleep(max(0.0, backend.started_at + phase * long_s - time.perf_counter()))
            probe_f = engine.submit(short, ttft_slo_s=args.probe_slo_s, request_id=f"u{j}")
            long = long_f.result(timeout=120 + 20 * long_s)
            FULL_COLLECTIONS.on = False
            arm.full_gc_ms += [p * 1e3 for p in FULL_COLLECTIONS.take()]
            # Answered before the next long prompt, so that its preemptions are this
            # one's. A probe past its latest feasible start sinks below the blocker
            # (slack-aware EDF) and is never answered: counted, not waited for.
            try:
                probe_f.result(timeout=2 + 20 * long_s)
            except TimeoutError:
                arm.probes_unanswered += 1
            # The long prompt's preemption of the blocker comes first; then the probe's
            # of the long prompt, if the probe came while it ran (the long prompt then
            # says so); otherwise the probe preempted the blocker: not a sample.
            new = list(engine.preemptions)[seen:]
            if long.num_preemptions and len(new) >= 2:
                blocking.append(new[1].blocking_s * 1e3)
                arm.handoff_ms.append(new[1].handoff_s * 1e3)
            ttfts.append(long.ttft_s * 1e3)
        rounds = engine.scheduler.stats.num_rounds - rounds_before
        stop.set()
        streamer.join()
    # The queue is dropped undrained: on a GPU thousands of queued requests would take
    # minutes to answer, and only the probes' preemptions are measured.
    arm.blocking_runs.append(blocking)
    arm.long_ttft_runs.append(ttfts)
    arm.rounds.append(rounds)
    arm.arrivals.append(streamed[0])


def stratified(rng: random.Random, n: int, top: float) -> list[float]:
    """``n`` fractions in ``[0, top)``, one in each of ``n`` equal strata, shuffled."""
    fractions = [(k + rng.random()) * top / n for k in range(n)]
    rng.shuffle(fractions)
    return fractions


def build(args: argparse.Namespace) -> Any:
    """The model to prefill: a named tiny one on CPU, or gpuval's shape on the GPU."""
    if args.device == "cpu":
        return build_named(args.model, seed=1)
    # The GPU shapes live with the GPU validation (benchmarks/gpuval), one package up.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks.gpuval.common import SHAPES, build_model

    if args.model not in SHAPES:
        raise SystemExit(f"--model {args.model!r} on cuda: expected one of {sorted(SHAPES)}")
    device = torch.device("cuda", torch.cuda.current_device())
    return build_model(args.model, args.layers, device, torch.bfloat16, seed=1)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def mean_ratio(
    runs: Sequence[Sequence[float]],
    base: Sequence[Sequence[float]],
    *,
    paired: bool = False,
    resamples: int = 4000,
    seed: int = 0,
) -> tuple[float, float, float]:
    """The mean of every sample in ``runs`` over the same of ``base``, and its 90 %
    bootstrap interval (percentile method). Runs are resampled whole, not samples: the
    preemptions of one run share its conditions (what else the host ran, the garbage
    the last run left), so resampling them one by one would claim an interval too narrow.
    ``paired``: run ``k`` of each side belongs to the same repeat (the same probe moments),
    so a resample takes the same repeats on both sides; the sides must have as many runs.
    NaN where either side has no sample."""

    def sums(side: Sequence[Sequence[float]]) -> tuple[np.ndarray, np.ndarray]:
        return (
            np.array([sum(run) for run in side], dtype=float),
            np.array([len(run) for run in side], dtype=float),
        )

    (a_sum, a_n), (b_sum, b_n) = sums(runs), sums(base)
    if not a_n.sum() or not b_n.sum():
        return (float("nan"),) * 3
    if paired and a_sum.size != b_sum.size:
        raise ValueError(f"paired sides need as many runs: {a_sum.size} and {b_sum.size}")
    rng = np.random.default_rng(seed)
    ia = rng.integers(0, a_sum.size, size=(resamples, a_sum.size))
    ib = ia if paired else rng.integers(0, b_sum.size, size=(resamples, b_sum.size))
    with np.errstate(invalid="ignore", divide="ignore"):
        ratios = (a_sum[ia].sum(axis=1) / a_n[ia].sum(axis=1)) / (
            b_sum[ib].sum(axis=1) / b_n[ib].sum(axis=1)
        )
    lo, hi = np.nanpercentile(ratios, [5.0, 95.0])
    return float((a_sum.sum() / a_n.sum()) / (b_sum.sum() / b_n.sum())), float(lo), float(hi)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--model", default="tiny-llama", help="cuda: llama3-8b (gpuval's shapes)")
    ap.add_argument("--layers", type=int, help="cuda: decoder layers (default: the model's)")
    ap.add_argument("--sync", default="every_check", help="the executor's device sync mode")
    ap.add_argument("--tokens", type=int, default=4096, help="the long prompt's length")
    ap.add_argument("--queued", default="0,1000,10000", help="waiting requests per arm")
    ap.add_argument("--schedulers", default="indexed,ranking")
    ap.add_argument("--rate", type=float, default=200.0, help="streaming arrivals per second")
    ap.add_argument(
        "--longs", type=int, default=8, help="long prompts per run, one urgent probe each"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--probe-slo-s",
        type=float,
        default=0.5,
        help="the urgent probes' TTFT target: far below the long prompts' (1e5 s), so "
        "each preempts; one still unanswered at it has missed its latest start and waits "
        "behind the blocker",
    )
    ap.add_argument(
        "--per-token-us",
        type=float,
        help="the predictor's microseconds per prompt token (default: the long prompt's "
        "solo time over its tokens, measured at start)",
    )
    ap.add_argument(
        "--gc",
        choices=("frozen", "python"),
        default="frozen",
        help="frozen: what startup built is frozen out of the collector's scans, as "
        "serve-prefill does (flowprefill.web.gc_tuning); python: Python's defaults",
    )
    args = ap.parse_args()
    torch.manual_seed(0)
    model = build(args)
    long_prompt = torch.randint(0, 2000, (args.tokens,)).tolist()
    arms = [
        Arm(int(q), name) for q in args.queued.split(",") for name in args.schedulers.split(",")
    ]
    # Wide enough for the table when the output is not a terminal (a log, CI).
    console = Console(width=max(Console().width, 240))
    with PreemptibleExecutor(model, granularity="operator", sync=args.sync) as ex:
        ex.run([long_prompt], TaskControl("warm-up"))
        t0 = time.perf_counter()
        ex.run([long_prompt], TaskControl("alone"))
        long_s = time.perf_counter() - t0
        if args.gc == "frozen":
            freeze_startup()
        per_token_s = (
            args.per_token_us * 1e-6 if args.per_token_us is not None else long_s / args.tokens
        )
        predictor = TTFTPredictor.linear(per_token_s=per_token_s)
        with Progress(console=console, transient=True) as progress:
            job = progress.add_task("arms", total=args.repeats * len(arms))
            order, moments = random.Random(0), random.Random(1)
            for repeat in range(args.repeats):
                # Every arm of a repeat probes at the same moments (paired comparison);
                # up to 95 % of the solo time, so that the probe nearly always comes
                # while its long prompt still runs.
                phases = stratified(moments, args.longs, 0.95)
                for arm in order.sample(arms, len(arms)):
                    progress.update(job, description=f"{arm.queued} queued, {arm.scheduler}")
                    one_run(arm, ex, predictor, long_prompt, long_s, phases, args)
                    progress.advance(job)
                    # A line per run, so a run cut short still shows what it measured.
                    progress.console.print(
                        f"repeat {repeat + 1}, {arm.queued:,} queued, {arm.scheduler}: "
                        f"blocking mean {statistics.fmean(arm.blocking_runs[-1] or [0]):.2f} "
                        f"ms ({len(arm.blocking_runs[-1])} probes), long TTFT median "
                        f"{statistics.median(arm.long_ttft_runs[-1]):.0f} ms"
                    )
    table = Table(
        title=f"{args.tokens}-token prefill ({args.model}, {args.device}, sync {args.sync}, "
        f"alone {long_s * 1e3:.0f} ms, predictor {per_token_s * 1e6:.2f} µs/token) with "
        f"{args.rate:g} arrivals/s streaming, {args.longs} long prompts a run, one urgent "
        f"probe each, {args.repeats} repeats, garbage collector {args.gc}"
    )
    for column in ("queued", "scheduler", "probes that preempted", "blocking p50 ms",
                   "blocking mean ms", "blocking p99 ms", "mean vs first (90 % interval)",
                   "of which handoff: mean (p99) ms",
                   "long TTFT ms (median)", "long TTFT vs first (90 % interval)",
                   "long start after submit ms (median)",
                   "full GCs (max ms)", "rounds", "arrivals"):  # fmt: skip
        table.add_column(column, justify="right")
    for arm in arms:
        # Against the same scheduler's first arm (by default, the empty queue), repeat by
        # repeat: both probed at the same moments.
        base = next(a for a in arms if a.scheduler == arm.scheduler)
        ratio, lo, hi = mean_ratio(arm.blocking_runs, base.blocking_runs, paired=True)
        ttft, ttft_lo, ttft_hi = mean_ratio(arm.long_ttft_runs, base.long_ttft_runs, paired=True)
        blocking = arm.blocking_ms
        table.add_row(
            f"{arm.queued:,}",
            arm.scheduler,
            f"{len(blocking)} of {args.longs * args.repeats}"
            + (f" ({arm.probes_unanswered} unanswered)" if arm.probes_unanswered else ""),
            f"{statistics.median(blocking):.2f}" if blocking else "-",
            f"{statistics.fmean(blocking):.2f}" if blocking else "-",
            f"{pct(blocking, 0.99):.2f}" if blocking else "-",
            "-" if arm is base or not blocking else f"{ratio:.2f} ({lo:.2f}-{hi:.2f})",
            f"{statistics.fmean(arm.handoff_ms):.3f} ({pct(arm.handoff_ms, 0.99):.3f})"
            if arm.handoff_ms
            else "-",
            f"{statistics.median(arm.long_ttft_ms):.0f}",
            "-" if arm is base else f"{ttft:.3f} ({ttft_lo:.3f}-{ttft_hi:.3f})",
            f"{statistics.median(arm.start_lag_ms):.2f}",
            f"{len(arm.full_gc_ms)} ({max(arm.full_gc_ms, default=0.0):.1f})",
            f"{sum(arm.rounds):,}",
            f"{sum(arm.arrivals):,}",
        )
    console.print(table)


if __name__ == "__main__":
    main()
