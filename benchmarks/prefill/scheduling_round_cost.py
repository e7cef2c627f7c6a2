"""Cost of one scheduling round with 10, 100 and 1,000 queued requests.

Two kinds of round are timed, since they do different work:
  * no-op round: an arrival that does not outrank the running task (rank every entry),
  * submit round: the best entry is a waiting request, so SLO-aware batching also sorts
    the waiting queue and grows a batch.

    python benchmarks/prefill/scheduling_round_cost.py [--repeats 200]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from rich.console import Console
from rich.table import Table

from flowprefill.prefill.predictor.model import TTFTPredictor
from flowprefill.prefill.request import Request
from flowprefill.prefill.scheduler.core import Scheduler
from flowprefill.prefill.scheduler.policies import get_policy

PREDICTOR = TTFTPredictor(coefficients=[0.004, 2.5e-5, 1.5e-9])  # ~A100 Llama-3-8B shape
SLOS = [0.25, 0.5, 4.0, 6.0]


def populated(n: int, rng: random.Random, policy: str) -> Scheduler:
    s = Scheduler(predict_s=PREDICTOR.predict_s, policy=get_policy(policy))
    # A long relaxed request runs; n others wait.
    s.add(Request.create("run", arrival_s=1.0, ttft_slo_s=1000.0, num_tokens=16000))
    s.schedule(1.0)
    s.running.leader.arrival_s = 0.5  # type: ignore[union-attr]
    for i in range(n):
        s.add(
            Request.create(
                f"w{i}",
                arrival_s=1.0 + rng.random(),
                ttft_slo_s=2000.0 + rng.random(),
                num_tokens=rng.randint(16, 8000),
            )
        )
    return s


def time_rounds(n: int, repeats: int, policy: str, rng: random.Random) -> tuple[float, float]:
    noop: list[float] = []
    submit: list[float] = []
    for _ in range(repeats):
        s = populated(n, rng, policy)
        t0 = time.perf_counter()
        out = s.schedule(2.0)
        noop.append(time.perf_counter() - t0)
        assert not out.commands or policy != "fcfs"
        # An urgent arrival: now the best entry is waiting -> batching + submit.
        s.add(Request.create("urgent", arrival_s=2.0, ttft_slo_s=0.25, num_tokens=128))
        t0 = time.perf_counter()
        out = s.schedule(2.0)
        submit.append(time.perf_counter() - t0)
        assert out.commands
    return statistics.median(noop), statistics.median(submit)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--policy", default="s-edf")
    args = ap.parse_args()
    rng = random.Random(0)
    table = Table(title=f"scheduling round cost ({args.policy}, median of {args.repeats})")
    table.add_column("queued requests", justify="right")
    table.add_column("no-op round µs", justify="right")
    table.add_column("submit round µs", justify="right")
    for n in (10, 100, 1000):
        noop, submit = time_rounds(
            n, args.repeats if n < 1000 else max(20, args.repeats // 5), args.policy, rng
        )
        table.add_row(str(n), f"{noop * 1e6:.0f}", f"{submit * 1e6:.0f}")
    Console().print(table)


if __name__ == "__main__":
    main()
