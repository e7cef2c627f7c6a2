"""Cost of one scheduling round with 10 to 10,000 queued requests: the engine's indexed
round beside the reference that ranks every entry (:mod:`flowprefill.lab.ranking`, which
keys every entry with the policy's ``sort_key`` each round).

Two kinds of round are timed, since they do different work:
  * no-op round: the running task stays the most urgent entry;
  * submit round: an urgent arrival outranks it, so the round preempts the running task,
    forms a batch with SLO-aware batching and submits it.

Each filled scheduler runs ``--cycles`` of both (the urgent task then completes and the
long one resumes), so rounds are timed as a running engine makes them, one after another.

An arrival (``Scheduler.add``) is timed too: the indexed queue pays there (O(log n)) for
what its rounds save. Variants are timed interleaved, each on a freshly filled scheduler,
and every pair of rounds is checked to decide the same commands.

    python benchmarks/prefill/scheduling_round_cost.py [--sizes 10,100,1000,10000] [--repeats 20]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from rich.console import Console
from rich.progress import track
from rich.table import Table

from flowprefill.lab.ranking import RankingScheduler
from flowprefill.prefill.predictor.model import TTFTPredictor
from flowprefill.prefill.request import Request
from flowprefill.prefill.scheduler.core import Scheduler, SchedulerOutput
from flowprefill.prefill.scheduler.policies import get_policy

PREDICTOR = TTFTPredictor(coefficients=[0.004, 2.5e-5, 1.5e-9])  # ~A100 Llama-3-8B shape
VARIANTS: dict[str, type[Scheduler]] = {"ranking": RankingScheduler, "indexed": Scheduler}


def populated(cls: type[Scheduler], n: int, seed: int, policy: str) -> tuple[Scheduler, float]:
    """A long relaxed request runs and ``n`` others wait; the mean seconds per arrival."""
    rng = random.Random(seed)
    s = cls(predict_s=PREDICTOR.predict_s, policy=get_policy(policy))
    s.add(Request.create("run", arrival_s=0.5, ttft_slo_s=1000.0, num_tokens=16000))
    s.schedule(1.0)
    waiting = [
        Request.create(
            f"w{i}",
            arrival_s=1.0 + rng.random(),
            ttft_slo_s=2000.0 + rng.random(),
            num_tokens=rng.randint(16, 8000),
        )
        for i in range(n)
    ]
    t0 = time.perf_counter()
    for r in waiting:
        s.add(r)
    return s, (time.perf_counter() - t0) / max(n, 1)


def decided(out: SchedulerOutput) -> list[tuple[str, list[str]]]:
    return [(c.kind.value, [r.request_id for r in c.task.requests]) for c in out.commands]


def time_rounds(
    cls: type[Scheduler], n: int, seed: int, policy: str, cycles: int
) -> tuple[float, list[float], list[float], list[list[tuple[str, list[str]]]]]:
    """Arrival seconds, then ``cycles`` times: a no-op round, an urgent arrival's submit
    round (timed), and the urgent task's completion (its resume round not timed). The
    submit rounds' commands come back to compare the variants."""
    s, arrival = populated(cls, n, seed, policy)
    noop, submit, commands = [], [], []
    now = 2.0
    for cycle in range(cycles):
        t0 = time.perf_counter()
        out = s.schedule(now)
        noop.append(time.perf_counter() - t0)
        assert not out.commands or policy == "fcfs"
        s.add(Request.create(f"urgent{cycle}", arrival_s=now, ttft_slo_s=0.25, num_tokens=128))
        t0 = time.perf_counter()
        out = s.schedule(now)
        submit.append(time.perf_counter() - t0)
        assert out.commands
        commands.append(decided(out))
        now += 0.01
        assert s.running is not None
        s.finish(s.running, now)
        s.schedule(now)  # resumes the long task
    return arrival, noop, submit, commands


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="10,100,1000,10000", help="queued requests, comma-separated")
    ap.add_argument("--repeats", type=int, default=20, help="filled schedulers per size")
    ap.add_argument("--cycles", type=int, default=5, help="rounds of each kind per scheduler")
    ap.add_argument("--policy", default="s-edf")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    rounds = args.repeats * args.cycles
    table = Table(title=f"scheduling round cost, µs ({args.policy}, median of {rounds} rounds)")
    table.add_column("queued", justify="right")
    for variant in VARIANTS:
        table.add_column(f"{variant} no-op", justify="right")
        table.add_column(f"{variant} submit", justify="right")
    table.add_column("indexed arrival", justify="right")
    for n in sizes:
        times: dict[str, list[tuple[float, list[float], list[float]]]] = {v: [] for v in VARIANTS}
        for repeat in track(range(args.repeats), description=f"{n:>6} queued", transient=True):
            commands = []
            order = list(VARIANTS.items())
            if repeat % 2:
                order.reverse()  # interleaved: neither variant always runs second
            for variant, cls in order:
                arrival, noop, submit, decision = time_rounds(
                    cls, n, repeat, args.policy, args.cycles
                )
                times[variant].append((arrival, noop, submit))
                commands.append(decision)
            assert commands[0] == commands[1], f"the variants decided differently at {n}"
        row = [f"{n:,}"]
        for variant in VARIANTS:
            row += [
                f"{statistics.median(x for t in times[variant] for x in t[1]) * 1e6:,.0f}",
                f"{statistics.median(x for t in times[variant] for x in t[2]) * 1e6:,.0f}",
            ]
        row.append(f"{statistics.median(t[0] for t in times['indexed']) * 1e6:.1f}")
        table.add_row(*row)
    Console().print(table)


if __name__ == "__main__":
    main()
